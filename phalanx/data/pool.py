"""The encoding pool: turns the pieces of one store (pieces.py) into shards with a pool of processes, and
the claims that let several preparations share a cache folder.

Each piece is encoded by one process into one shard plus its record (`<fingerprint>.json`, written last);
a shard whose record exists is reused, so an interrupted preparation continues where it stopped. Memory is
bounded by the piece size and the number of processes, not by the corpus.

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
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path

import psutil
from tqdm import tqdm

from phalanx.core import host
from phalanx.data import pieces, store


def piece_bytes(shard_mb: float, total: int) -> int:
    """Bytes per piece: data.shard_mb, but small enough that a corpus of known size splits into ~64
    pieces (down to 1 MB) so every core has work. It depends on the data only, never on the workers."""
    limit = max(1, int(shard_mb * (1 << 20)))
    return max(min(limit, total // 64), min(limit, 1 << 20)) if total else limit


def pool_size(workers: int, total: int, per_piece: int) -> int:
    """No pool (its start-up costs ~1 s) when the input is one piece."""
    return 1 if 0 < total <= per_piece else (workers or host.cores())


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
    in flight per process): `work(piece)` (picklable) writes one shard and returns its record."""

    def __init__(self, work: Callable[[pieces.Piece], dict], folder: Path, workers: int, bar):
        self.work, self.workers, self.bar = work, workers, bar
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
                self._done(i, self.work(piece))
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
                    running[pool.submit(self.work, piece)] = i
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
                    self._done(i, self.work(piece))
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


