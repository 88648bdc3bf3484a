"""The token store: token ids in bounded-size shards on disk, plus a small JSON index written last.

A store is a folder:
    <fingerprint>.bin    token ids of one piece of the input (raw little-endian uint16, or uint32 when
                         the vocabulary needs it), named by the piece's fingerprint so that a finished
                         shard is found again by an interrupted or changed preparation
    <fingerprint>.json   that shard's record (tokens, documents, source range), written after the .bin
    index.json           the shards in corpus order and what they were made from, written last:
                         a store is complete exactly when its index exists
Readers memory-map the shards, so memory per process does not depend on the size of the corpus.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from phalanx.core.runfolder import write_json

INDEX = "index.json"
VERSION = 1


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 65536 else np.uint32)


def read_index(folder: Path) -> dict | None:
    try:
        return json.loads((Path(folder) / INDEX).read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def shard_record(folder: Path, fp: str) -> dict | None:
    """The record of a finished shard, or None (its .json is written only after its .bin is complete)."""
    try:
        record = json.loads((folder / f"{fp}.json").read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    data = folder / record["file"]
    if not data.is_file():
        return None
    if "dtype" in record and data.stat().st_size != record["tokens"] * np.dtype(record["dtype"]).itemsize:
        return None
    return record


class ShardWriter:
    """Appends token arrays to `<fp>.bin` through a temporary file; `close()` publishes it."""

    def __init__(self, folder: Path, fp: str, dtype: np.dtype):
        self.folder, self.fp, self.dtype = folder, fp, dtype
        self.tmp = folder / f".{fp}.{os.getpid()}.tmp"
        self.f = open(self.tmp, "wb")
        self.tokens = 0

    def write(self, ids) -> None:
        arr = np.asarray(ids)
        if arr.size and int(arr.max()) > np.iinfo(self.dtype).max:
            raise ValueError(f"token id {int(arr.max())} does not fit the store's {self.dtype}")
        arr.astype(self.dtype, copy=False).tofile(self.f)
        self.tokens += arr.size

    def close(self, record: dict) -> dict:
        self.f.close()
        os.replace(self.tmp, self.folder / f"{self.fp}.bin")
        record = {"file": f"{self.fp}.bin", "fingerprint": self.fp, "dtype": self.dtype.name,
                  "tokens": self.tokens, **record}
        write_json(self.folder / f"{self.fp}.json", record)
        return record

    def abort(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)


class TokenStore:
    """A complete store as one token stream: `slice(lo, hi)` reads across shard boundaries."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index = read_index(self.folder)
        if index is None:
            raise FileNotFoundError(f"token store '{self.folder}' has no {INDEX} (not prepared, or interrupted)")
        self.index = index
        self.dtype = np.dtype(index["dtype"])
        shards = [s for s in index["shards"] if s["tokens"]]  # an empty file cannot be memory-mapped
        self._maps = [np.memmap(self.folder / s["file"], dtype=self.dtype, mode="r", shape=(s["tokens"],))
                      for s in shards]
        self._starts = np.zeros(len(shards) + 1, dtype=np.int64)
        np.cumsum([s["tokens"] for s in shards], out=self._starts[1:])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def slice(self, lo: int, hi: int) -> np.ndarray:
        """Tokens [lo, hi) of the stream as a new array."""
        if not 0 <= lo <= hi <= len(self):
            raise IndexError(f"tokens [{lo}, {hi}) outside the store's {len(self)}")
        k = int(np.searchsorted(self._starts, lo, side="right")) - 1
        parts = []
        while lo < hi:
            start, end = self._starts[k], self._starts[k + 1]
            take = min(hi, end) - lo
            parts.append(self._maps[k][lo - start: lo - start + take])
            lo += take
            k += 1
        return np.concatenate(parts) if len(parts) != 1 else np.array(parts[0])
