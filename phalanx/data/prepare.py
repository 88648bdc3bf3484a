"""Data preparation for language modelling: tokenizer + token stores, streamed, parallel, resumable.

Runs once, in the launcher (or `phalanx prepare`), before any worker starts; workers only open a
complete, indexed store (`open_lm_data`). Input is read piece by piece (pieces.py), pieces are encoded
by a pool of processes, each piece is written as one shard of the store (store.py), and the index is
written last. Memory is bounded by the piece size and the number of workers, not by the corpus.

Several preparations may share a cache folder (parallel runs, or the launchers of several nodes on a
shared file system): a piece is claimed with an exclusive-create file before it is encoded, so they
split the work, and each waits for the pieces the others claimed.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil

from ..config import Config, ConfigError
from . import cache, encoder, pieces, store, tokenizer as toks
from .sources import files_of, format_of

VERSION = "lm-store-v1"


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


def source_identity(spec: str, fmt: str, key: str) -> list:
    """What the data is, cheaply: every file's path, size and mtime; a hub name; the Python version."""
    if not spec:
        return ["builtin", sys.version_info[:2], pieces.builtin.MAX_CHARS]
    if spec.startswith("hf:"):
        return [spec]
    return [[*pieces.file_identity(p), format_of(p, fmt)] for p in files_of(spec, key)]


def _splits(cfg: Config) -> list[tuple[str, str, str]]:
    d = cfg.data
    out = [(d.train, "data.train", "train")]
    if d.validation:
        out.append((d.validation, "data.validation", "validation"))
    return out


# ---- tokenizer -----------------------------------------------------------------------------------
def tokenizer_fingerprint(cfg: Config) -> str:
    d, spec = cfg.data, cfg.data.tokenizer or cfg.model.pretrained
    if spec:
        local = Path(spec)
        files = sorted(f for f in local.iterdir() if f.is_file()) if local.is_dir() else []
        return cache.fingerprint("pretrained-tokenizer", spec, *files)
    return cache.fingerprint(VERSION, "bpe", d.vocab_size, d.tokenizer_sample_mb, d.val_fraction, d.format,
                             d.text_field, json.dumps(source_identity(d.train, d.format, "data.train")))


def sample_texts(cfg: Config, budget: int) -> list[str]:
    """A deterministic sample of about `budget` bytes of the training text, spread over the whole corpus
    for text and JSON Lines files (the head of the stream for other sources), and excluding the
    validation tail when validation is held out of the training data."""
    d = cfg.data
    files = [] if not d.train or d.train.startswith("hf:") else files_of(d.train, "data.train")
    kinds = [format_of(p, d.format) for p in files]
    if not files or any(k not in ("text", "jsonl") for k in kinds):
        out, size = [], 0
        for piece in pieces.plan(d.train, d.format, d.text_field, "data.train", "train", budget):
            batches = pieces.documents(piece, d.text_field) if piece.kind != "text" else \
                (([text], n) for text, n in pieces.text_chunks(piece))
            for texts, n in batches:
                out.extend(texts)
                size += n
                if size >= budget:
                    return out
        return out
    sizes = [p.stat().st_size for p in files]
    usable = int(sum(sizes) * (1 - (0 if d.validation else d.val_fraction)))
    count = max(1, -(-min(usable, budget) // (1 << 20)))   # windows of about 1 MB
    width = min(usable, budget) // count
    out = []
    for i in range(count):
        pos = i * usable // count
        k = 0
        while pos >= sizes[k]:
            pos, k = pos - sizes[k], k + 1
        out.extend(_window(files[k], kinds[k], pos, min(pos + width, sizes[k]), sizes[k], d.text_field))
    return out


def _window(path: Path, kind: str, lo: int, hi: int, size: int, text_field: str) -> list[str]:
    """Whole lines of path[lo:hi] as text (one string) or JSON Lines rows."""
    buf = pieces.read_bytes(str(path), lo, hi)
    start = 0 if lo == 0 else buf.find(b"\n") + 1
    end = len(buf) if hi == size else buf.rfind(b"\n") + 1
    if start <= 0 and lo or end <= start:
        return []
    if kind == "jsonl":
        return pieces.jsonl_rows(buf[start:end], str(path), lo + start, text_field)
    return [pieces.decode(buf[start:end], str(path), lo + start)]


def check_sample(cfg: Config, head: int = 1 << 20, windows: int = 4, width: int = 1 << 18) -> None:
    """Launcher pre-flight on a bounded sample: every file exists and has a known format; its head and a
    few windows spread over it decode as UTF-8 and parse as JSON Lines with the text field. The full pass
    during preparation still reports any later problem with its file and line."""
    d = cfg.data
    for spec, key, _ in _splits(cfg):
        if not spec or spec.startswith("hf:"):
            continue
        for path in files_of(spec, key):
            kind, size = format_of(path, d.format), path.stat().st_size
            if size == 0:
                raise ConfigError(f"data file '{path}': empty file")
            if kind not in ("text", "jsonl"):
                continue
            spans = [(0, min(size, head))] + [(size * (i + 1) // (windows + 1), size * (i + 1) // (windows + 1) + width)
                                             for i in range(windows) if size > head]
            for lo, hi in spans:
                _window(path, kind, lo, min(hi, size), size, d.text_field)


def prepare_tokenizer(cfg: Config, root: Path, say) -> Path:
    """The tokenizer as a local folder in the cache: trained on a sample, or a copy of a pretrained one."""
    d = cfg.data
    spec = d.tokenizer or cfg.model.pretrained

    def build(tmp: Path) -> None:
        if spec:
            tok = toks.load_pretrained(spec)
            if not getattr(tok, "is_fast", False):
                raise ConfigError(f"tokenizer '{spec}': needs a fast (Rust) tokenizer with a tokenizer.json")
        else:
            t0 = time.perf_counter()
            texts = sample_texts(cfg, int(d.tokenizer_sample_mb * (1 << 20)))
            tok = toks.train_bpe(texts, d.vocab_size)
            say(f"phalanx: trained a {d.vocab_size}-token byte-level BPE on a {sum(map(len, texts)) / 1e6:.1f} MB "
                f"sample in {time.perf_counter() - t0:.1f} s")
        if tok.eos_token_id is None:
            raise ConfigError(f"tokenizer '{spec}': has no end-of-text token (eos_token)")
        tok.save_pretrained(tmp)

    return cache.build_once(root / f"tokenizer-{tokenizer_fingerprint(cfg)}", build, is_builder=True,
                            timeout_s=0)


def load_tokenizer(folder: Path):
    return toks.load_saved(folder)


# ---- stores --------------------------------------------------------------------------------------
def store_folder(cfg: Config, root: Path, spec: str, split: str, tok_dir: Path) -> Path:
    d = cfg.data
    return root / f"store-{cache.fingerprint(VERSION, tok_dir.name, spec or 'builtin', split, d.format, d.text_field, d.shard_mb)}"


def store_is_current(folder: Path, identity: list) -> bool:
    index = store.read_index(folder)
    return index is not None and index.get("sources") == json.loads(json.dumps(identity))


def prepare_lm(cfg: Config, workers: int = 0, progress: bool = True, say=None) -> dict:
    """Make sure the tokenizer and token stores of `cfg` exist; returns a summary per split."""
    say = say or (lambda text: print(text, file=sys.stderr, flush=True))
    d = cfg.data
    root = cache.cache_root(d.cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    tok_dir = prepare_tokenizer(cfg, root, say)
    workers = workers or cores()
    summaries = {}
    for spec, key, split in _splits(cfg):
        folder = store_folder(cfg, root, spec, split, tok_dir)
        identity = source_identity(spec, d.format, key)
        if store_is_current(folder, identity):
            summaries[split] = {**store.read_index(folder)["summary"], "reused": True}
            continue
        folder.mkdir(parents=True, exist_ok=True)
        summaries[split] = build_store(cfg, folder, spec, key, split, identity, tok_dir, workers, progress, say)
    return summaries


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def build_store(cfg: Config, folder: Path, spec: str, key: str, split: str, identity: list, tok_dir: Path,
                workers: int, progress: bool, say) -> dict:
    d, t0 = cfg.data, time.perf_counter()
    tokenizer = load_tokenizer(tok_dir)
    sample = sample_texts(cfg, 1 << 20) if split == "train" else []
    kind, why = encoder.choose(tok_dir, sample) if sample else ("tokenizers", "no sample")
    job = EncodeJob(str(folder), str(tok_dir), kind, store.token_dtype(len(tokenizer)).name,
                    tokenizer.eos_token_id, d.text_field)
    plan = pieces.plan(spec, d.format, d.text_field, key, split, int(d.shard_mb * (1 << 20)))
    bar = _progress_bar(progress, pieces.plan_size(spec, key), f"{key}")
    try:
        records = Encoding(job, workers, bar).run(plan)
    finally:
        bar.close()
    seconds = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in records)
    size = sum(r["bytes_in"] for r in records)
    summary = {"split": split, "source": spec or "builtin", "files": len(identity) if spec and not spec.startswith("hf:") else 1,
               "documents": sum(r["documents"] for r in records), "tokens": tokens, "shards": len(records),
               "store_bytes": tokens * store.token_dtype(len(tokenizer)).itemsize, "input_bytes": size,
               "seconds": round(seconds, 3), "mb_per_s": round(size / 1e6 / max(seconds, 1e-9), 2),
               "tokens_per_s": round(tokens / max(seconds, 1e-9)), "encoder": kind, "encoder_check": why,
               "workers": workers, "folder": str(folder)}
    if tokens == 0:
        raise ConfigError(f"config key '{key}': '{spec or 'built-in corpus'}' contains no text")
    store.write_json(folder / store.INDEX, {
        "version": VERSION, "dtype": job.dtype, "vocab_size": len(tokenizer), "eos_id": tokenizer.eos_token_id,
        "tokenizer": tok_dir.name, "sources": identity, "tokens": tokens, "documents": summary["documents"],
        "shards": records, "summary": summary, "created": time.strftime("%Y-%m-%dT%H:%M:%S")})
    _remove_unlisted(folder, records)
    say(f"phalanx: prepared {key} ({spec or 'built-in corpus'}): {summary['files']} file(s), "
        f"{summary['documents']:,} documents, {tokens:,} tokens in {len(records)} shard(s), "
        f"{summary['store_bytes'] / 1e6:.1f} MB ({job.dtype}), {seconds:.1f} s, {summary['mb_per_s']:.1f} MB/s, "
        f"encoder {kind} ({why})")
    return summary


def _remove_unlisted(folder: Path, records: list[dict]) -> None:
    """Shards of an older version of the data (a changed file) are dropped once the new index exists;
    every piece is done then, so a temporary file left is one that a killed preparation was writing."""
    keep = {r["fingerprint"] for r in records}
    for path in folder.iterdir():
        stale = path.suffix in (".bin", ".json") and path.name != store.INDEX and path.stem not in keep
        if stale or path.name.endswith(".tmp"):  # also what a killed preparation was writing
            path.unlink(missing_ok=True)


def _progress_bar(enabled: bool, total: int, label: str):
    from tqdm import tqdm

    return tqdm(total=total or None, unit="B", unit_scale=True, unit_divisor=1000, desc=f"prepare {label}",
                disable=not enabled, file=sys.stderr, dynamic_ncols=True, mininterval=0.5,
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, "
                           "{rate_fmt}{postfix}]" if total else None)


# ---- the encoding pool ---------------------------------------------------------------------------
_counter = None  # set in pool workers: shared count of input bytes done


def _init_worker(counter) -> None:
    global _counter
    _counter = counter
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: the pool is the parallelism


def _report(n: int) -> None:
    if _counter is not None:
        with _counter.get_lock():
            _counter.value += n


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
                _report(n)
            if piece.ends_document:
                writer.write([job.eos])
                documents = 1
        else:
            for texts, n in pieces.documents(piece, job.text_field):
                writer.write(enc.flat(texts, job.eos))
                documents += len(texts)
                done += n
                _report(n)
    except BaseException:
        writer.abort()
        raise
    _report(piece.size - done)
    return writer.close({"documents": documents, "source": piece.source, "kind": piece.kind,
                         "range": [piece.start, piece.end], "bytes_in": piece.size})


class Encoding:
    """Encodes the pieces of one store with `workers` processes, at most 2 pieces in flight per worker."""

    def __init__(self, job: EncodeJob, workers: int, bar):
        self.job, self.workers, self.bar = job, workers, bar
        self.folder = Path(job.folder)
        self.records: dict[int, dict] = {}
        self.others: dict[int, pieces.Piece] = {}   # claimed by another preparation
        self.mine: set[str] = set()
        self._reported = 0

    def run(self, plan) -> list[dict]:
        try:
            if self.workers <= 1:
                self._inline(plan)
            else:
                self._pooled(plan)
            self._wait_for_others()
        finally:
            for fp in self.mine:
                _release(self.folder, fp)
        return [self.records[i] for i in sorted(self.records)]

    def _skip(self, i: int, piece: pieces.Piece) -> bool:
        record = store.shard_record(self.folder, piece.fingerprint)
        if record is not None:
            self.records[i] = record
            self.bar.update(piece.size)
            return True
        if not _claim(self.folder, piece.fingerprint):
            self.others[i] = piece
            return True
        self.mine.add(piece.fingerprint)
        return False

    def _done(self, i: int, record: dict) -> None:
        self.records[i] = record
        _release(self.folder, record["fingerprint"])
        self.mine.discard(record["fingerprint"])

    def _inline(self, plan) -> None:
        for i, piece in enumerate(plan):
            if not self._skip(i, piece):
                self._done(i, encode_piece(self.job, piece))
                self.bar.update(piece.size)

    def _pooled(self, plan) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")  # no fork of a process that may hold threads (torch, tokenizers)
        counter = ctx.Value("q", 0)
        with ProcessPoolExecutor(self.workers, mp_context=ctx, initializer=_init_worker,
                                 initargs=(counter,)) as pool:
            running = {}
            try:
                for i, piece in enumerate(plan):
                    if self._skip(i, piece):
                        continue
                    running[pool.submit(encode_piece, self.job, piece)] = i
                    while len(running) >= 2 * self.workers:
                        self._collect(running, counter)
                while running:
                    self._collect(running, counter)
            except BaseException:
                pool.shutdown(wait=False, cancel_futures=True)
                raise

    def _collect(self, running: dict, counter) -> None:
        finished, _ = wait(list(running), timeout=0.5, return_when=FIRST_COMPLETED)
        for future in finished:
            self._done(running.pop(future), future.result())
        value = counter.value
        self.bar.update(value - self._reported)
        self._reported = value

    def _wait_for_others(self) -> None:
        """Pieces another preparation claimed: wait for their shards, or take them over if it died."""
        said = False
        while self.others:
            for i, piece in list(self.others.items()):
                record = store.shard_record(self.folder, piece.fingerprint)
                if record is not None:
                    self.records[i] = record
                    self.bar.update(piece.size)
                    del self.others[i]
                elif _claim(self.folder, piece.fingerprint):
                    del self.others[i]
                    self.mine.add(piece.fingerprint)
                    self._done(i, encode_piece(self.job, piece))
                    self.bar.update(piece.size)
            if self.others and not said:
                print(f"phalanx: waiting for {len(self.others)} piece(s) another preparation is encoding "
                      f"into {self.folder}", file=sys.stderr, flush=True)
                said = True
            time.sleep(0.2 if self.others else 0)


def _claim_path(folder: Path, fp: str) -> Path:
    return folder / f".{fp}.claim"


def _claim(folder: Path, fp: str) -> bool:
    """Exclusive-create a claim file naming this host and process; a claim of a dead local process is
    taken over."""
    path = _claim_path(folder, fp)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                owner = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                return False  # being written right now
            if owner.get("host") == socket.gethostname() and not psutil.pid_exists(owner.get("pid", -1)):
                path.unlink(missing_ok=True)
                continue
            return False
        with os.fdopen(fd, "w") as f:
            json.dump({"host": socket.gethostname(), "pid": os.getpid()}, f)
        return True
    return False


def _release(folder: Path, fp: str) -> None:
    _claim_path(folder, fp).unlink(missing_ok=True)


# ---- the workers' side ---------------------------------------------------------------------------
def open_lm_data(cfg: Config) -> LMData:
    """Open what `prepare_lm` made for `cfg` (never builds: a missing store is a clear error)."""
    d = cfg.data
    root = cache.cache_root(d.cache_dir)
    tok_dir = root / f"tokenizer-{tokenizer_fingerprint(cfg)}"
    if not tok_dir.is_dir():
        raise FileNotFoundError(f"tokenizer '{tok_dir}' not prepared (run `phalanx prepare` with this config)")
    opened = {}
    for spec, key, split in _splits(cfg):
        folder = store_folder(cfg, root, spec, split, tok_dir)
        if not store_is_current(folder, source_identity(spec, d.format, key)):
            raise FileNotFoundError(f"token store for {key} in '{folder}' is missing or older than the data "
                                    f"(run `phalanx prepare` with this config)")
        opened[split] = store.TokenStore(folder)
    train = opened["train"]
    val_tokens = 0 if "validation" in opened else min(int(round(len(train) * d.val_fraction)), d.val_max_tokens)
    return LMData(tok_dir, train, opened.get("validation"), val_tokens)


def lm_data_ready(cfg: Config) -> bool:
    try:
        open_lm_data(cfg)
        return True
    except FileNotFoundError:
        return False
