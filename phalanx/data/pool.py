"""The encoding pool: turns the pieces of one store (readers.py) into shards with a pool of processes, and
the claims that let several preparations share a cache folder.

Each piece is encoded by one process into one shard plus its record (`<fingerprint>.json`, written last);
a shard whose record exists is reused, so an interrupted preparation continues where it stopped. Memory is
bounded by the piece size and the number of processes, not by the corpus.

Several preparations may share a store (parallel runs, or the launchers of several nodes on a shared
file system or preparing into one `data.store_url`): a piece is claimed with an exclusive create before
it is encoded (remote.Place.claim), so they split the work, and each waits for the pieces the others
claimed (or takes over those of a process that died).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

from tqdm import tqdm

from phalanx.core import host
from phalanx.core.errors import redact
from phalanx.data import readers
from phalanx.data.remote.place import Place


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
    """Turns the pieces of one store into shards at `place` with `workers` processes (at most 2 pieces
    in flight per process): `work(piece)` (picklable) writes one shard and returns its record."""

    def __init__(self, work: Callable[[readers.Piece], dict], place: Place, workers: int, bar):
        self.work, self.workers, self.bar = work, workers, bar
        self.place = place
        self.encoded = 0  # pieces this preparation encoded (the others' were reused or another's)
        self.records: dict[int, dict] = {}
        self.others: dict[int, readers.Piece] = {}   # claimed by another preparation
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
                self.place.release(fp)
        return [self.records[i] for i in sorted(self.records)]

    def _skip(self, i: int, piece: readers.Piece) -> bool:
        fp = piece.fingerprint
        record = self.place.record(fp, max_age=60)
        if record is None and self.place.claim(fp):
            record = self.place.record(fp)  # finished by another preparation since the listing was made?
            if record is None:
                self.mine.add(fp)
                return False
            self.place.release(fp)
        if record is not None:
            self.records[i] = record
            self.bar.update(piece.size)
        else:
            self.others[i] = piece
        return True

    def _done(self, i: int, record: dict) -> None:
        self.records[i] = record
        self.encoded += 1
        self.place.release(record["fingerprint"])
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
        """Pieces another preparation claimed: wait for their shards, or take them over if it died (asked
        every few seconds of a remote store: a listing a second tells what is done)."""
        said, asked = False, 0.0
        while self.others:
            for i, piece in list(self.others.items()):
                record = self.place.record(piece.fingerprint, max_age=1.0)
                if record is not None:
                    self.records[i] = record
                    self.bar.update(piece.size)
                    del self.others[i]
            for i, piece in list(self.others.items()) if time.monotonic() - asked > 5 * self.place.remote else ():
                asked = time.monotonic()
                if self.place.claim(piece.fingerprint):
                    del self.others[i]
                    self.mine.add(piece.fingerprint)
                    self._done(i, self.work(piece))
                    self.bar.update(piece.size)
            if self.others and not said:
                print(f"phalanx: waiting for {len(self.others)} piece(s) another preparation is encoding "
                      f"into {redact(self.place.url) or self.place.local}", file=sys.stderr, flush=True)
                said = True
            time.sleep((1.0 if self.place.remote else 0.2) if self.others else 0)
