"""The machinery of data preparation, shared by the tasks: a sample of the data, checks on a bounded
sample, and a pool of processes that turns pieces of the input (pieces.py) into shards.

Preparation runs once, in the launcher (or `phalanx prepare`), before any worker starts. Each piece is
encoded by one process of the pool into one shard file plus a record (`<fingerprint>.json`, written
last); a shard whose record exists is reused, so an interrupted preparation continues where it stopped.
Memory is bounded by the piece size and the number of processes, not by the corpus.

Several preparations may share a cache folder (parallel runs, or the launchers of several nodes on a
shared file system): a piece is claimed with an exclusive-create file before it is encoded, so they
split the work, and each waits for the pieces the others claimed (or takes over those of a process
that died on this host).
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Callable

import psutil
from tqdm import tqdm

from phalanx.core import host
from phalanx.core.config import Config, ConfigError
from phalanx.data import cache, pieces, store
from phalanx.data import tokenizer as toks
from phalanx.data.sources import files_of, format_of


def source_identity(spec: str, fmt: str, key: str) -> list:
    """What the data is, cheaply: every file's path, size and mtime; a hub name; the Python version."""
    if not spec:
        return ["builtin", sys.version_info[:2], pieces.builtin.MAX_CHARS]
    if spec.startswith("hf:"):
        return [spec]
    return [[*pieces.file_identity(p), format_of(p, fmt)] for p in files_of(spec, key)]


def splits(cfg: Config) -> list[tuple[str, str, str]]:
    d = cfg.data
    out = [(d.train, "data.train", "train")]
    if d.validation:
        out.append((d.validation, "data.validation", "validation"))
    return out



def sample_rows(cfg: Config, fields: pieces.Fields, budget: int) -> list[tuple]:
    """A deterministic sample of about `budget` bytes of the training rows, spread over the whole corpus
    for text and JSON Lines files (the head of the stream for other sources), and excluding the
    validation tail when validation is held out of the training data. A plain-text window is one row."""
    d = cfg.data
    files = [] if not d.train or d.train.startswith("hf:") else files_of(d.train, "data.train")
    kinds = [format_of(p, d.format) for p in files]
    if not files or any(k not in ("text", "jsonl") for k in kinds):
        out, size = [], 0
        for piece in pieces.plan(d.train, d.format, fields, "data.train", "train", budget):
            batches = pieces.rows(piece, fields) if piece.kind != "text" else \
                (([(text,)], n) for text, n in pieces.text_chunks(piece))
            for batch, n in batches:
                out.extend(batch)
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
        out.extend(_window(files[k], kinds[k], pos, min(pos + width, sizes[k]), sizes[k], fields))
    return out


def _window(path: Path, kind: str, lo: int, hi: int, size: int, fields: pieces.Fields) -> list[tuple]:
    """Whole lines of path[lo:hi] as one text row, or as JSON Lines rows."""
    buf = pieces.read_bytes(str(path), lo, hi)
    start = pieces.content_start(path, kind) if lo == 0 else buf.find(b"\n") + 1
    end = len(buf) if hi == size else buf.rfind(b"\n") + 1
    if start <= 0 and lo or end <= start:
        return []
    if kind == "jsonl":
        return pieces.jsonl_rows(buf[start:end], str(path), lo + start, fields)
    return [(pieces.decode(buf[start:end], str(path), lo + start),)]


def tokenizer_fingerprint(cfg: Config, kind: str, fields: pieces.Fields) -> str:
    d, spec = cfg.data, cfg.data.tokenizer or cfg.model.pretrained
    if spec:
        local = Path(spec)
        files = sorted(f for f in local.iterdir() if f.is_file()) if local.is_dir() else []
        return cache.fingerprint("pretrained-tokenizer", spec, *files)
    return cache.fingerprint("trained-tokenizer-v2", kind, d.vocab_size, d.tokenizer_sample_mb, d.val_fraction,
                             d.format, fields, json.dumps(source_identity(d.train, d.format, "data.train")))


TRAINERS = {"bpe": toks.train_bpe, "wordpiece": toks.train_wordpiece}


def prepare_tokenizer(cfg: Config, kind: str, fields: pieces.Fields, needs: str, say) -> Path:
    """The tokenizer as a folder of the cache: a `kind` tokenizer ('bpe' or 'wordpiece') trained on a
    sample of the training rows' text fields, or a copy of `data.tokenizer` / `model.pretrained`, which
    must have the special token `needs` (e.g. 'eos_token')."""
    d, spec = cfg.data, cfg.data.tokenizer or cfg.model.pretrained

    def build(tmp: Path) -> None:
        if spec:
            tok = toks.load_pretrained(spec)
            if not getattr(tok, "is_fast", False):
                raise ConfigError(f"tokenizer '{spec}': needs a fast (Rust) tokenizer with a tokenizer.json")
            tok.save_pretrained(tmp)
        else:
            t0 = time.perf_counter()
            rows = sample_rows(cfg, fields, int(d.tokenizer_sample_mb * (1 << 20)))
            texts = [row[i] for row in rows for i, (_, k) in enumerate(fields) if k == "text"]
            toks.save_trained(TRAINERS[kind](texts, d.vocab_size), kind, tmp)
            say(f"phalanx: trained a {d.vocab_size}-token {kind} tokenizer on {sum(map(len, texts)) / 1e6:.1f} MB "
                f"of sampled text in {time.perf_counter() - t0:.1f} s")
        if toks.special_id(tmp, needs) is None:
            raise ConfigError(f"tokenizer '{spec}': has no {needs.replace('_', ' ')}")

    root = cache.cache_root(d.cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    return cache.build_once(root / f"tokenizer-{tokenizer_fingerprint(cfg, kind, fields)}", build,
                            is_builder=True, timeout_s=0)


def open_or_prepare(open_: Callable[[], object], build: Callable[[], object], is_builder: bool,
                    timeout_s: float):
    """Open the prepared data. In a worker started by an outside torchrun/srun with nothing prepared,
    the node's first process prepares it and the others wait for the index (not in a collective that
    could time out). `open_` raises FileNotFoundError while the data is not ready."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return open_()
        except FileNotFoundError:
            if is_builder:
                build()
                return open_()
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout_s:.0f}s for the node's first process to prepare the data")
            time.sleep(0.1)


def check_sample(cfg: Config, fields: pieces.Fields, head: int = 1 << 20, windows: int = 4,
                 width: int = 1 << 18) -> None:
    """Launcher pre-flight on a bounded sample: every file exists and has a known format; its head and a
    few windows spread over it decode as UTF-8 and parse as JSON Lines with the text field. The full pass
    during preparation still reports any later problem with its file and line."""
    d = cfg.data
    for spec, key, _ in splits(cfg):
        if not spec or spec.startswith("hf:"):
            continue
        for path in files_of(spec, key):
            kind, size = format_of(path, d.format), path.stat().st_size
            if size == 0:
                raise ConfigError(f"data file '{path}': no rows (empty file)")
            if kind == "parquet":
                pieces.open_parquet(path, fields)  # the footer: readable, has rows and the fields
                continue
            pieces.content_start(path, kind)  # not compressed, not one JSON array
            if kind == "csv":
                continue
            spans = [(0, min(size, head))] + [(size * (i + 1) // (windows + 1), size * (i + 1) // (windows + 1) + width)
                                             for i in range(windows) if size > head]
            for lo, hi in spans:
                _window(path, kind, lo, min(hi, size), size, fields)



def piece_bytes(shard_mb: float, total: int) -> int:
    """Bytes per piece: data.shard_mb, but small enough that a corpus of known size splits into ~64
    pieces (down to 1 MB) so every core has work. It depends on the data only, never on the workers."""
    limit = max(1, int(shard_mb * (1 << 20)))
    return max(min(limit, total // 64), min(limit, 1 << 20)) if total else limit


def pool_size(workers: int, total: int, per_piece: int) -> int:
    """No pool (its start-up costs ~1 s) when the input is one piece."""
    return 1 if 0 < total <= per_piece else (workers or host.cores())



def remove_unlisted(folder: Path, records: list[dict]) -> None:
    """Shards of an older version of the data (a changed file) are dropped once the new index exists;
    every piece is done then, so a temporary file left is one that a killed preparation was writing."""
    keep = {r["fingerprint"] for r in records}
    for path in folder.iterdir():
        stale = path.suffix in (".bin", ".json", ".npz") and path.name != store.INDEX and path.stem not in keep
        if stale or path.name.endswith((".tmp", ".claim")):  # also what a killed preparation left
            path.unlink(missing_ok=True)


def progress_bar(enabled: bool, total: int, label: str):
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


def report(n: int) -> None:
    """A pool worker tells the progress bar that `n` more input bytes are done (no-op inline)."""
    if _counter is not None:
        with _counter.get_lock():
            _counter.value += n


class Encoding:
    """Turns the pieces of one store into shards in `folder` with `workers` processes (at most 2 pieces
    in flight per process): `encode(job, piece)` writes one shard and returns its record."""

    def __init__(self, encode: Callable, job, folder: Path, workers: int, bar):
        self.encode, self.job, self.workers, self.bar = encode, job, workers, bar
        self.folder = Path(folder)
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
                self._done(i, self.encode(self.job, piece))
                self.bar.update(piece.size)

    def _pooled(self, plan) -> None:
        ctx = mp.get_context("spawn")  # no fork of a process that may hold threads (torch, tokenizers)
        counter = ctx.Value("q", 0)
        with ProcessPoolExecutor(self.workers, mp_context=ctx, initializer=_init_worker,
                                 initargs=(counter,)) as pool:
            running = {}
            try:
                for i, piece in enumerate(plan):
                    if self._skip(i, piece):
                        continue
                    running[pool.submit(self.encode, self.job, piece)] = i
                    while len(running) >= 2 * self.workers:
                        self._collect(running, counter)
                while running:
                    self._collect(running, counter)
            except BaseException:
                # Drop the pieces not started; wait for those running (bounded: one piece each), so that
                # no process is still writing a temporary file or holding a claim when this returns.
                pool.shutdown(wait=True, cancel_futures=True)
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
                    self._done(i, self.encode(self.job, piece))
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
            except (OSError, json.JSONDecodeError):  # being written now, or its writer died at once
                if time.time() - path.stat().st_mtime < 10:
                    return False
                owner = {"host": socket.gethostname(), "pid": -1}
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


