"""The store: arrays in bounded-size shards on disk, plus a small JSON index written last.

A store is a folder (one per split):
    <fingerprint>.bin         token ids of one piece of the input (raw little-endian uint16, or uint32 when
                              the vocabulary needs it), named by the piece's fingerprint so that a finished
                              shard is found again by an interrupted or changed preparation
    <fingerprint>.<name>.bin  the piece's other arrays, when its record format has them: per token (e.g.
                              segment ids) or per row (e.g. row lengths, label codes)
    <fingerprint>.json        that shard's record (tokens, rows, documents, source range), written after its
                              arrays
    <name>.npy                arrays of the whole split made after every shard exists (row offsets,
                              label ids, ...)
    index.json                the shards in corpus order and what they were made from, written last:
                              a store is complete exactly when its index exists
Each shard's record holds the sha256 of each of its array files (`sha256`; stores made before it have
none: a download is then checked by size only). Readers memory-map the shards, so memory per process does
not depend on the size of the corpus; a store kept on object storage (remote/place.py) is mapped shard by shard
from the node-local cache (remote/cache.py) as the sample order reaches it.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

import numpy as np

from phalanx.core.runfolder import write_json
from phalanx.data.layout import INDEX, array_file, arrays_of, read_index, shard_array
from phalanx.data.remote import cache as shard_cache


class ShardWriter:
    """Appends a piece's arrays to `<fp>.bin` / `<fp>.<name>.bin` through temporary files; `close()`
    publishes them, then the record. `tokens` and `rows` map each array's name to its dtype."""

    def __init__(self, folder: Path, fp: str, tokens: dict[str, np.dtype], rows: dict[str, np.dtype]):
        self.folder, self.fp = Path(folder), fp
        self.dtypes = {**tokens, **rows}
        self.per = {**{n: "tokens" for n in tokens}, **{n: "rows" for n in rows}}
        self.counts = {"tokens": 0, "rows": 0}
        self.tmp = {n: self.folder / f".{array_file(fp, n)}.{os.getpid()}.tmp" for n in self.dtypes}
        self.files = {n: open(path, "wb") for n, path in self.tmp.items()}
        self.hashes = {n: hashlib.sha256() for n in self.dtypes}  # what a download is checked against

    def tokens(self, **arrays) -> None:
        """Per-token arrays of the same length, every one the format has (e.g. ids=..., types=...)."""
        self._append("tokens", arrays)

    def rows(self, **arrays) -> None:
        """Per-row arrays of the same length, every one the format has (e.g. lengths=..., codes=...)."""
        self._append("rows", arrays)

    def _append(self, per: str, arrays: dict) -> None:
        expected = {n for n, p in self.per.items() if p == per}
        if set(arrays) != expected:
            raise ValueError(f"shard {per}: expected arrays {sorted(expected)}, got {sorted(arrays)}")
        sizes = set()
        for name, values in arrays.items():
            arr, dtype = np.asarray(values), self.dtypes[name]
            if arr.size and int(arr.max()) > np.iinfo(dtype).max:
                raise ValueError(f"{name} value {int(arr.max())} does not fit the store's {dtype}")
            data = np.ascontiguousarray(arr.astype(dtype, copy=False))
            data.tofile(self.files[name])
            self.hashes[name].update(data.data)
            sizes.add(arr.size)
        if len(sizes) > 1:
            raise ValueError(f"shard {per}: arrays of different lengths {sorted(sizes)}")
        self.counts[per] += sizes.pop() if sizes else 0

    def close(self, record: dict) -> dict:
        for name, f in self.files.items():
            f.close()
            os.replace(self.tmp[name], self.folder / array_file(self.fp, name))
        ids = {"file": array_file(self.fp, "ids"), "fingerprint": self.fp, "dtype": self.dtypes["ids"].name,
               "tokens": self.counts["tokens"]}
        if set(self.dtypes) != {"ids"}:  # a store of token ids only keeps the first format's record
            ids.update(rows=self.counts["rows"], arrays={n: [dt.name, self.per[n]] for n, dt in self.dtypes.items()})
        ids["sha256"] = {n: h.hexdigest() for n, h in self.hashes.items()}
        record = {**ids, **record}
        write_json(self.folder / f"{self.fp}.json", record)
        return record

    def abort(self) -> None:
        for name, f in self.files.items():
            f.close()
            self.tmp[name].unlink(missing_ok=True)


def plan_digest(shards: list[dict]) -> str:
    """A split's shard plan: a digest of where its shards cut the token stream (the token counts of its non-empty
    shards, in order). The windowed order (samplers.ShardPlan) is a function of it, so a checkpoint records it
    (meta.json 'shard_plan') and a resume under that order needs the same (tools/launch.check_shard_plan)."""
    counts = [int(s["tokens"]) for s in shards if s["tokens"]]
    return hashlib.sha256(json.dumps(counts).encode()).hexdigest()[:16]


def write_offsets(folder: Path, records: list[dict]) -> int:
    """`offsets.npy`: where each row of the split starts in its token stream (rows + 1 entries), from the
    shards' row lengths; written piece by piece. Returns the number of rows."""
    rows = sum(r["rows"] for r in records)
    offsets = np.lib.format.open_memmap(Path(folder) / "offsets.npy", mode="w+", dtype=np.int64, shape=(rows + 1,))
    offsets[0], row, token = 0, 0, 0
    for r in records:
        lengths = shard_array(folder, r, "lengths")
        offsets[row + 1:row + 1 + len(lengths)] = token + np.cumsum(lengths, dtype=np.int64)
        row, token = row + len(lengths), token + r["tokens"]
    offsets.flush()
    return rows


class RaggedRows:
    """Examples stored ragged: example i is tokens offsets[i]:offsets[i+1] of each of `streams` (arrays, or a
    store's memory-mapped streams, TokenStore)."""

    def __init__(self, streams: tuple, offsets: np.ndarray):
        self.streams, self.offsets = streams, offsets
        self.lengths = np.diff(offsets)

    def token_span(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """Tokens [lo, hi) of each example (the store's shards it touches: samplers.ShardPlan)."""
        i = np.asarray(indices, dtype=np.int64)
        return np.asarray(self.offsets[i], dtype=np.int64), np.asarray(self.offsets[i + 1], dtype=np.int64)

    def stores(self) -> list:
        return [s for s in self.streams if isinstance(s, TokenStore)]


class TokenStore:
    """One per-token array of a complete store as one stream (`ids` by default): `slice(lo, hi)` or
    `store[lo:hi]` reads across shard boundaries. Shards are memory-mapped when first read; a store kept on
    object storage maps them from the node-local cache (`cache`), which fetches each when asked, and
    `keep_only` releases the maps the order no longer needs (so the cache may evict them).

    Thread-safe: on a GPU the next step is collated on a thread (run/batches.py) while the main thread
    releases maps and evaluates. The maps and descriptors change only under `_lock`, which is never held while
    a shard is opened (that may wait for a download): two threads that map one shard at once keep the first
    map, and the second closes its descriptor. An array handed out stays readable when its map is released
    (the mapping holds its own descriptor, and so the cache's shared lock, until it is freed)."""

    def __init__(self, folder: str | Path, name: str = "ids"):
        self.folder, self.name = Path(folder), name
        index = read_index(self.folder)
        if index is None:
            raise FileNotFoundError(f"token store '{self.folder}' has no {INDEX} (not prepared, or interrupted)")
        self.index = index
        self.shards = [s for s in index["shards"] if s["tokens"]]  # an empty file cannot be memory-mapped
        self.dtype = np.dtype(arrays_of(self.shards[0])[name][0]) if self.shards else np.dtype(index["dtype"])
        self.cache = shard_cache.attached(self.folder)
        self._maps: dict[int, np.ndarray] = {}
        self._fds: dict[int, int] = {}
        self._keep: set[int] = set()  # a cached store keeps these mapped between reads (the lookahead)
        self._lock = threading.Lock()  # guards _maps and _fds (see the class docstring)
        self.starts = np.zeros(len(self.shards) + 1, dtype=np.int64)
        np.cumsum([s["tokens"] for s in self.shards], out=self.starts[1:])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def file_of(self, k: int) -> str:
        return array_file(self.shards[k]["fingerprint"], self.name)

    def shard(self, k: int) -> np.ndarray:
        """Shard k's array, mapped on first use."""
        mapped = self._maps.get(k)  # one dict lookup is atomic: the lock only orders changes
        if mapped is not None:
            return mapped
        fd = None
        if self.cache is None:
            mapped = shard_array(self.folder, self.shards[k], self.name)
        else:  # outside the lock: it may wait for the node's downloader
            fd = self.cache.open(self.file_of(k))
            mapped = np.memmap(os.fdopen(os.dup(fd), "rb"), dtype=self.dtype, mode="r",
                               shape=(self.shards[k]["tokens"],))
        with self._lock:
            first = self._maps.setdefault(k, mapped)
            if first is mapped and fd is not None:
                self._fds[k], fd = fd, None
        if fd is not None:  # another thread mapped it meanwhile: its map is the one kept
            os.close(fd)
        return first

    def keep_only(self, shards: set[int]) -> None:
        """Release the maps (and the cache's shared locks) of every other shard; with a cache, a shard
        outside `shards` is mapped only while it is read (an evaluation pass never pins the cache)."""
        keep = set(shards)
        with self._lock:
            self._keep = keep
            released = [(self._maps.pop(k), self._fds.pop(k, None)) for k in list(self._maps) if k not in keep]
        for _, fd in released:
            if fd is not None:
                os.close(fd)

    def __getitem__(self, span: slice) -> np.ndarray:
        lo, hi, step = span.indices(len(self))
        if step != 1:
            raise IndexError("a token store is read in contiguous slices")
        return self.slice(lo, max(lo, hi))

    def slice(self, lo: int, hi: int) -> np.ndarray:
        """Tokens [lo, hi) of the stream as a new array."""
        if not 0 <= lo <= hi <= len(self):
            raise IndexError(f"tokens [{lo}, {hi}) outside the store's {len(self)}")
        k = int(np.searchsorted(self.starts, lo, side="right")) - 1
        parts = []
        while lo < hi:
            start, end = self.starts[k], self.starts[k + 1]
            take = min(hi, end) - lo
            parts.append(self.shard(k)[lo - start: lo - start + take])
            lo += take
            k += 1
        out = np.concatenate(parts) if len(parts) > 1 else np.array(parts[0]) if parts else \
            np.zeros(0, dtype=self.dtype)
        if self.cache is not None and len(self._maps) > len(self._keep):
            self.keep_only(self._keep)  # (a set is replaced, never changed: reading it here is safe)
        return out
