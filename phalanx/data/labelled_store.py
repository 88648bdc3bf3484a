"""Classification data, streamed: rows -> token ids, segment ids, lengths and labels as memory-mapped
arrays, built with the shared preparation machinery (prepare.py) and opened by the workers.

Each piece of the input becomes one `.npz` shard (ids, segment ids, lengths, label codes) with a record
of the raw labels it holds. Once every piece is done, the label names are fixed (`data.labels`, or the
training labels sorted) and the shards are copied, piece by piece, into one ragged array per split
(`train/` and `validation/`: ids, types, offsets, labels — `EncodedSet`), then `index.json` is written.
Memory is bounded by the piece size; nothing holds a list of every row.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from phalanx.core.config import Config, ConfigError
from phalanx.core.runfolder import write_json
from phalanx.data import cache, pieces, prepare, store
from phalanx.data import tokenizer as toks
from phalanx.data.labelled import EncodedSet, class_lookup, label_names
from phalanx.data.prepare import report, source_identity, splits

VERSION = "classify-store-v1"


def fields_of(cfg: Config) -> pieces.Fields:
    d = cfg.data
    pair = ((d.text_pair_field, "text"),) if d.text_pair_field else ()
    return ((d.text_field, "text"), *pair, (d.label_field, "label"))


@dataclass(frozen=True)
class ClassifyJob:
    """What a pool worker needs to encode a piece of rows (picklable)."""
    tokenizer_dir: str
    max_length: int
    fields: tuple
    dtype: str


@dataclass
class ClassifyData:
    tokenizer_dir: Path
    names: list[str]
    train: EncodedSet
    validation: EncodedSet


@lru_cache(maxsize=4)
def _tokenizer(tokenizer_dir: str, max_length: int):
    """The raw `tokenizers` backend with the truncation `transformers` applies for truncation=True."""
    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(max_length, strategy="longest_first")
    return tok


def encode_piece(job: ClassifyJob, piece: pieces.Piece, folder: Path) -> dict:
    tok, pair = _tokenizer(job.tokenizer_dir, job.max_length), len(job.fields) == 3
    ids, types, lengths, codes, labels = [], [], [], [], {}
    done = 0
    for rows, n in pieces.rows(piece, job.fields):
        inputs = [(r[0], r[1]) for r in rows] if pair else [r[0] for r in rows]
        for enc in tok.encode_batch(inputs, add_special_tokens=True):
            ids.append(np.asarray(enc.ids, dtype=job.dtype))
            types.append(np.asarray(enc.type_ids, dtype=np.uint8))
            lengths.append(len(enc.ids))
        codes.extend(labels.setdefault(r[-1], len(labels)) for r in rows)
        done += n
        report(n)
    report(piece.size - done)
    tmp = folder / f".{piece.fingerprint}.{os.getpid()}.tmp"
    flat = (lambda xs, dt: np.concatenate(xs) if xs else np.zeros(0, dtype=dt))
    with open(tmp, "wb") as f:
        np.savez(f, ids=flat(ids, job.dtype), types=flat(types, np.uint8), lengths=np.asarray(lengths, np.int64),
                 codes=np.asarray(codes, np.int64))
    os.replace(tmp, folder / f"{piece.fingerprint}.npz")
    record = {"file": f"{piece.fingerprint}.npz", "fingerprint": piece.fingerprint, "rows": len(lengths),
              "tokens": int(sum(lengths)), "labels": list(labels), "kind": piece.kind, "source": piece.source,
              "range": [piece.start, piece.end], "bytes_in": piece.size}
    write_json(folder / f"{piece.fingerprint}.json", record)
    return record


def _encode(job_and_folder, piece: pieces.Piece) -> dict:
    job, folder = job_and_folder
    return encode_piece(job, piece, Path(folder))


# ---- tokenizer, folder ---------------------------------------------------------------------------
def tokenizer_fingerprint(cfg: Config) -> str:
    return prepare.tokenizer_fingerprint(cfg, "wordpiece", fields_of(cfg))


def folder_of(cfg: Config) -> Path:
    d = cfg.data
    return cache.cache_root(d.cache_dir) / "classify-{}".format(cache.fingerprint(
        VERSION, tokenizer_fingerprint(cfg), d.train, d.validation, d.val_fraction, d.format, fields_of(cfg),
        d.max_length, d.labels))


def identity(cfg: Config) -> list:
    return json.loads(json.dumps([source_identity(spec, cfg.data.format, key) for spec, key, _ in splits(cfg)]))


# ---- building ------------------------------------------------------------------------------------
def prepare_classify(cfg: Config, workers: int = 0, progress: bool = True, say=None) -> dict:
    """Make sure the tokenizer and the encoded splits of `cfg` exist; returns a summary."""
    say = say or (lambda text: print(text, flush=True))  # stdout: stderr is for errors
    folder = folder_of(cfg)
    tok_dir = prepare.prepare_tokenizer(cfg, "wordpiece", fields_of(cfg), "pad_token", say)
    index = store.read_index(folder)
    if index is not None and index.get("sources") == identity(cfg):
        return {**index["summary"], "reused": True}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / store.INDEX).unlink(missing_ok=True)  # an older data's index: a failure leaves none
    t0, d = time.perf_counter(), cfg.data
    job = ClassifyJob(str(tok_dir), d.max_length, fields_of(cfg), store.token_dtype(toks.backend(tok_dir).get_vocab_size(with_added_tokens=True)).name)
    per_split = {}
    for spec, key, split in splits(cfg):
        total = pieces.plan_size(spec, key)
        size = prepare.piece_bytes(d.shard_mb, total)
        plan = pieces.plan(spec, d.format, job.fields, key, split, size)
        bar = prepare.progress_bar(progress, total, key)
        try:
            per_split[split] = prepare.Encoding(_encode, (job, str(folder)), folder,
                                                prepare.pool_size(workers, total, size), bar).run(plan)
        finally:
            bar.close()
    summary = assemble(cfg, folder, per_split, job.dtype)
    summary.update(seconds=round(time.perf_counter() - t0, 3), folder=str(folder), source=d.train,
                   shards=sum(len(r) for r in per_split.values()),
                   input_bytes=sum(x["bytes_in"] for r in per_split.values() for x in r))
    write_json(folder / store.INDEX, {"version": VERSION, "sources": identity(cfg), "summary": summary,
                                            "shards": per_split, "labels": summary["labels"]})
    prepare.remove_unlisted(folder, [x for r in per_split.values() for x in r])
    say(f"phalanx: prepared {d.train}: {summary['train_samples']:,} training and {summary['val_samples']:,} "
        f"validation rows, {summary['tokens']:,} tokens, labels {summary['labels']}, {summary['seconds']:.1f} s")
    return summary


def _row_ranges(cfg: Config, per_split: dict) -> dict[str, list[tuple[dict, int, int]]]:
    """(record, first row, end row) of each split: the validation file, or the last rows held out."""
    train = per_split["train"]
    if "validation" in per_split:
        return {"train": [(r, 0, r["rows"]) for r in train],
                "validation": [(r, 0, r["rows"]) for r in per_split["validation"]]}
    n = sum(r["rows"] for r in train)
    cut = max(1, int(round(n * (1 - cfg.data.val_fraction))))
    out, seen = {"train": [], "validation": []}, 0
    for r in train:
        lo, hi = seen, seen + r["rows"]
        if lo < cut:
            out["train"].append((r, 0, min(hi, cut) - lo))
        if hi > cut:
            out["validation"].append((r, max(cut, lo) - lo, r["rows"]))
        seen = hi
    return out


def assemble(cfg: Config, folder: Path, per_split: dict, dtype: str) -> dict:
    """Fix the label names, then copy the shards into one EncodedSet per split."""
    ranges = _row_ranges(cfg, per_split)
    if not sum(hi - lo for _, lo, hi in ranges["train"]):
        raise ConfigError(f"config key 'data.train': '{cfg.data.train}' holds no examples")
    seen = _train_labels(folder, ranges["train"])
    names = label_names(seen, cfg.data.labels)
    lookup = class_lookup(names, bool(cfg.data.labels), type(seen[0][0]))
    tokens = 0
    for split, parts in ranges.items():
        tokens += _write_split(folder, split, parts, names, bool(cfg.data.labels), lookup, dtype)
    n = {split: sum(hi - lo for _, lo, hi in parts) for split, parts in ranges.items()}
    return {"labels": names, "train_samples": n["train"], "val_samples": n["validation"], "tokens": tokens}


def _train_labels(folder: Path, parts) -> list[tuple]:
    """Distinct training labels in first-seen order, each with where it was first seen."""
    seen: dict = {}
    for record, lo, hi in parts:
        codes = np.load(folder / record["file"])["codes"][lo:hi]
        for code in dict.fromkeys(codes.tolist()):
            value = record["labels"][code]
            if value not in seen:
                seen[value] = (record, lo + int(np.argmax(codes == code)))
    return [(value, lambda r=r, k=k: locate(r, k)) for value, (r, k) in seen.items()]


def _write_split(folder: Path, split: str, parts, names: list[str], configured: bool, lookup: dict,
                 dtype: str) -> int:
    rows = sum(hi - lo for _, lo, hi in parts)
    shards = [np.load(folder / r["file"]) for r, _, _ in parts]
    spans = [(int(s["lengths"][:lo].sum()), int(s["lengths"][:hi].sum())) for s, (_, lo, hi) in zip(shards, parts)]
    tokens = sum(b - a for a, b in spans)
    out = folder / split
    out.mkdir(exist_ok=True)
    arrays = {name: np.lib.format.open_memmap(out / f"{name}.npy", mode="w+", dtype=dt, shape=(size,))
              for name, dt, size in (("ids", dtype, tokens), ("types", np.uint8, tokens),
                                     ("offsets", np.int64, rows + 1), ("labels", np.int64, rows))}
    t, r = 0, 0
    arrays["offsets"][0] = 0
    for shard, (record, lo, hi), (a, b) in zip(shards, parts, spans):
        arrays["ids"][t:t + b - a] = shard["ids"][a:b]
        arrays["types"][t:t + b - a] = shard["types"][a:b]
        arrays["offsets"][r + 1:r + 1 + hi - lo] = t + np.cumsum(shard["lengths"][lo:hi])
        classes = []
        for k, code in enumerate(shard["codes"][lo:hi].tolist()):
            value = record["labels"][code]
            if value not in lookup:
                known = "data.labels" if configured else "the training data"
                raise ConfigError(f"{locate(record, lo + k)}: label {value!r} is not one of the labels of {known} "
                                  f"({', '.join(names)[:200]})")
            classes.append(lookup[value])
        arrays["labels"][r:r + hi - lo] = classes
        t, r = t + b - a, r + hi - lo
    for array in arrays.values():
        array.flush()
    return tokens


def locate(record: dict, k: int) -> str:
    """'data file X line L' (JSON Lines) or '... row R' for row k of a shard (counted only for messages)."""
    source, (start, _) = record["source"], record["range"]
    if record["kind"] == "jsonl":
        line, seen = pieces.line_of(source, start), -1
        with open(source, "rb") as f:
            f.seek(start)
            for offset, text in enumerate(f):
                seen += bool(text.strip())
                if seen == k:
                    return f"data file '{source}' line {line + offset}"
    if record["kind"] == "parquet":
        import pyarrow.parquet as pq  # lazy: only Parquet inputs need it

        meta = pq.ParquetFile(source).metadata
        start = sum(meta.row_group(g).num_rows for g in range(start))
    kind = "data" if source.startswith("hf:") else "data file"
    return f"{kind} '{source}' row {start + k + 1}"


# ---- the workers' side ---------------------------------------------------------------------------
def open_classify(cfg: Config) -> ClassifyData:
    folder = folder_of(cfg)
    index = store.read_index(folder)
    if index is None or index.get("sources") != identity(cfg):
        raise FileNotFoundError(f"classification data in '{folder}' is missing or older than the data "
                                f"(run `phalanx prepare` with this config)")
    tok_dir = cache.cache_root(cfg.data.cache_dir) / f"tokenizer-{tokenizer_fingerprint(cfg)}"
    return ClassifyData(tok_dir, index["labels"], EncodedSet.load(folder / "train"),
                        EncodedSet.load(folder / "validation"))
