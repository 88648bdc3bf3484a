"""Language-modelling data: a byte-level BPE tokenizer and token stores for the training and
validation text, built with the shared preparation machinery (prepare.py), opened by the workers.

The training text is one stream of token ids with an end-of-text token after each document (a plain
text file, or a row); without `data.validation`, the last `data.val_fraction` of the stream (at most
`data.val_max_tokens`) is held out for validation, so nothing is read twice and no text is kept.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from phalanx.core import host
from phalanx.core.config import Config, ConfigError
from phalanx.core.runfolder import write_json
from phalanx.data import cache, encoder, pieces, prepare, store
from phalanx.data import tokenizer as toks
from phalanx.data.prepare import report, source_identity, splits

VERSION = "lm-store-v1"
SMALL = 8 << 20  # inputs up to this size are encoded by `tokenizers` directly


@dataclass(frozen=True)
class EncodeJob:
    """What a pool worker needs to turn a piece into a shard (picklable)."""
    folder: str
    tokenizer_dir: str
    encoder: str
    dtype: str
    eos: int
    text_field: str


@dataclass
class LMData:
    tokenizer_dir: Path
    train: store.TokenStore
    validation: store.TokenStore | None   # None: held out from the end of the training store
    val_tokens: int                       # tokens held out when validation is None



def tokenizer_folder(cfg: Config) -> Path:
    root = cache.cache_root(cfg.data.cache_dir)
    return root / f"tokenizer-{prepare.tokenizer_fingerprint(cfg, 'bpe', text_fields(cfg))}"


def text_fields(cfg: Config) -> pieces.Fields:
    return ((cfg.data.text_field, "text"),)


def check_sample(cfg: Config) -> None:
    prepare.check_sample(cfg, text_fields(cfg))


def sample_texts(cfg: Config, budget: int) -> list[str]:
    return [row[0] for row in prepare.sample_rows(cfg, text_fields(cfg), budget)]


# ---- stores --------------------------------------------------------------------------------------
def store_folder(cfg: Config, root: Path, spec: str, split: str, tok_dir: Path) -> Path:
    d = cfg.data
    # [spec]: the name, not the file's size and time (the index holds those): a changed file is
    # prepared into the same folder, which so never keeps an index of data that is gone
    return root / f"store-{cache.fingerprint(VERSION, tok_dir.name, [spec or 'builtin'], split, d.format, d.text_field, d.shard_mb)}"


def store_is_current(folder: Path, identity: list) -> bool:
    index = store.read_index(folder)
    return index is not None and index.get("sources") == json.loads(json.dumps(identity))


def prepare_lm(cfg: Config, workers: int = 0, progress: bool = True, say=None) -> dict:
    """Make sure the tokenizer and token stores of `cfg` exist; returns a summary per split."""
    say = say or (lambda text: print(text, flush=True))  # stdout: stderr is for errors
    d = cfg.data
    root = cache.cache_root(d.cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    tok_dir = prepare.prepare_tokenizer(cfg, "bpe", text_fields(cfg), "eos_token", say)
    workers = workers or host.cores()
    summaries = {}
    for spec, key, split in splits(cfg):
        folder = store_folder(cfg, root, spec, split, tok_dir)
        identity = source_identity(spec, d.format, key)
        if store_is_current(folder, identity):
            summaries[split] = {**store.read_index(folder)["summary"], "reused": True}
            continue
        folder.mkdir(parents=True, exist_ok=True)
        (folder / store.INDEX).unlink(missing_ok=True)  # an older data's index: a failure leaves none
        summaries[split] = build_store(cfg, (spec, key, split), folder, tok_dir, (workers, progress, say))
    return summaries


def build_store(cfg: Config, source: tuple[str, str, str], folder: Path, tok_dir: Path, how: tuple) -> dict:
    """Encode one split (`source` = spec, config key, split) into `folder`; `how` = (workers, progress, say)."""
    (spec, key, split), (workers, progress, say) = source, how
    d, t0 = cfg.data, time.perf_counter()
    identity = source_identity(spec, d.format, key)
    vocab, eos = toks.backend(tok_dir).get_vocab_size(with_added_tokens=True), toks.special_id(tok_dir, "eos_token")
    total = pieces.plan_size(spec, key)
    if 0 < total <= SMALL:  # nothing to gain from a faster encoder; skip its check
        kind, why = "tokenizers", f"input under {SMALL >> 20} MB"
    else:
        kind, why = encoder.choose(tok_dir, sample_texts(cfg, 1 << 20))
    job = EncodeJob(str(folder), str(tok_dir), kind, store.token_dtype(vocab).name, eos, d.text_field)
    size = prepare.piece_bytes(d.shard_mb, total)
    plan = pieces.plan(spec, d.format, text_fields(cfg), key, split, size)
    bar = prepare.progress_bar(progress, total, f"{key}")
    try:
        records = prepare.Encoding(encode_piece, job, folder, prepare.pool_size(workers, total, size), bar).run(plan)
    finally:
        bar.close()
    seconds = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in records)
    size = sum(r["bytes_in"] for r in records)
    summary = {"split": split, "source": spec or "builtin", "files": len(identity) if spec and not spec.startswith("hf:") else 1,
               "documents": sum(r["documents"] for r in records), "tokens": tokens, "shards": len(records),
               "store_bytes": tokens * store.token_dtype(vocab).itemsize, "input_bytes": size,
               "seconds": round(seconds, 3), "mb_per_s": round(size / 1e6 / max(seconds, 1e-9), 2),
               "tokens_per_s": round(tokens / max(seconds, 1e-9)), "encoder": kind, "encoder_check": why,
               "workers": workers, "folder": str(folder)}
    if tokens == 0:
        raise ConfigError(f"config key '{key}': '{spec or 'built-in corpus'}' contains no text")
    write_json(folder / store.INDEX, {
        "version": VERSION, "dtype": job.dtype, "vocab_size": vocab, "eos_id": eos,
        "tokenizer": tok_dir.name, "sources": identity, "tokens": tokens, "documents": summary["documents"],
        "shards": records, "summary": summary, "created": time.strftime("%Y-%m-%dT%H:%M:%S")})
    prepare.remove_unlisted(folder, records)
    say(f"phalanx: prepared {key} ({spec or 'built-in corpus'}): {summary['files']} file(s), "
        f"{summary['documents']:,} documents, {tokens:,} tokens in {len(records)} shard(s), "
        f"{summary['store_bytes'] / 1e6:.1f} MB ({job.dtype}), {seconds:.1f} s, {summary['mb_per_s']:.1f} MB/s, "
        f"encoder {kind} ({why})")
    return summary



def encode_piece(job: EncodeJob, piece: pieces.Piece) -> dict:
    """Encode one piece into its shard (in a pool worker or inline); returns the shard's record."""
    enc = encoder.cached(job.tokenizer_dir, job.encoder)
    writer = store.ShardWriter(Path(job.folder), piece.fingerprint, np.dtype(job.dtype))
    done, documents = 0, 0
    try:
        if piece.kind == "text":
            for text, n in pieces.text_chunks(piece):
                writer.write(enc.flat([text], None))
                done += n
                report(n)
            if piece.ends_document:
                writer.write([job.eos])
                documents = 1
        else:
            for rows, n in pieces.rows(piece, ((job.text_field, "text"),)):
                writer.write(enc.flat([r[0] for r in rows], job.eos))
                documents += len(rows)
                done += n
                report(n)
    except BaseException:
        writer.abort()
        raise
    report(piece.size - done)
    return writer.close({"documents": documents, "source": piece.source, "kind": piece.kind,
                         "range": [piece.start, piece.end], "bytes_in": piece.size})



# ---- the workers' side ---------------------------------------------------------------------------
def open_lm_data(cfg: Config) -> LMData:
    """Open what `prepare_lm` made for `cfg` (never builds: a missing store is a clear error)."""
    d = cfg.data
    root = cache.cache_root(d.cache_dir)
    tok_dir = tokenizer_folder(cfg)
    if not tok_dir.is_dir():
        raise FileNotFoundError(f"tokenizer '{tok_dir}' not prepared (run `phalanx prepare` with this config)")
    opened = {}
    for spec, key, split in splits(cfg):
        folder = store_folder(cfg, root, spec, split, tok_dir)
        if not store_is_current(folder, source_identity(spec, d.format, key)):
            raise FileNotFoundError(f"token store for {key} in '{folder}' is missing or older than the data "
                                    f"(run `phalanx prepare` with this config)")
        opened[split] = store.TokenStore(folder)
    train = opened["train"]
    val_tokens = 0 if "validation" in opened else min(int(round(len(train) * d.val_fraction)), d.val_max_tokens)
    return LMData(tok_dir, train, opened.get("validation"), val_tokens)
