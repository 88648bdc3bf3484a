"""Where a store's files are: a local folder, or (`data.store_url`) a prefix on object storage — or any
fsspec URL or shared folder — with a local folder that stages what this node prepares and caches what it
reads (cache.py).

On the remote side every object is written once and whole (a PUT is atomic; a local target is written to
a temporary name and renamed): a shard's arrays, then its record (`<fp>.json`), the split-wide `*.npy`
files, the index last. So a store there is complete exactly when its index exists, as on disk, and the
launchers of several nodes prepare into it together: a piece is claimed by creating `.<fp>.claim` only if
it does not exist (S3's conditional write), so each node encodes a disjoint share of the pieces, planned
identically everywhere, and waits for the others' records before the index.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
from pathlib import Path

import fsspec
import numpy as np
import psutil

from phalanx.core.errors import redact
from phalanx.core.runfolder import write_json
from phalanx.data import layout
from phalanx.data.remote import cache as shard_cache

LEASE_S = 300.0  # a claim of another host older than this (not refreshed) is taken over: its node died


class Place:
    """One store: `local` holds it (no `url`), or stages and caches the store kept at `url`."""

    def __init__(self, local: Path, url: str = ""):
        self.local, self.url = Path(local), url.rstrip("/")
        self._listing: dict[str, int] | None = None
        self._listed_at = 0.0

    @property
    def remote(self) -> bool:
        return bool(self.url)

    def _fs(self):
        fs, root = fsspec.core.url_to_fs(self.url)
        return fs, root

    def __getstate__(self):  # sent to pool workers: the URL, not a listing
        return {"local": self.local, "url": self.url}

    def __setstate__(self, state):
        self.__init__(state["local"], state["url"])

    # ---- index --------------------------------------------------------------------------------------
    def read_index(self) -> dict | None:
        if not self.remote:
            return layout.read_index(self.local)
        fs, root = self._fs()
        try:
            return json.loads(fs.cat_file(f"{root}/{layout.INDEX}"))
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def remove_index(self) -> None:
        (self.local / layout.INDEX).unlink(missing_ok=True)
        if self.remote:
            fs, root = self._fs()
            try:
                fs.rm_file(f"{root}/{layout.INDEX}")
            except FileNotFoundError:
                pass

    def write_index(self, index: dict) -> None:
        """The index, last; a node that finds another's (identical but for its times) keeps that one."""
        path = self.local / layout.INDEX
        write_json(path, index)
        if self.remote:
            fs, root = self._fs()
            try:
                fs.pipe_file(f"{root}/{layout.INDEX}", path.read_bytes(), mode="create")
            except FileExistsError:  # another node's, maybe still being written: readable within seconds
                deadline = time.monotonic() + 60
                while self.read_index() is None and time.monotonic() < deadline:
                    time.sleep(0.1)

    # ---- shards -------------------------------------------------------------------------------------
    def listing(self, max_age: float = 0.0) -> dict[str, int]:
        """Object name -> size under the store's prefix (one listing request, reused for max_age seconds)."""
        if self._listing is None or time.monotonic() - self._listed_at > max_age:
            fs, root = self._fs()
            fs.invalidate_cache(root)
            try:
                found = fs.find(root, detail=True, withdirs=False)
            except FileNotFoundError:
                found = {}
            fs.invalidate_cache(root)  # s3fs answers 'not found' from a kept listing without asking
            self._listing = {name[len(root) + 1:]: int(info["size"]) for name, info in found.items()}
            self._listed_at = time.monotonic()
        return self._listing

    def record(self, fp: str, max_age: float | None = None) -> dict | None:
        """A finished shard's record: its arrays all there with their sizes, the record written after them.
        Remote: looked up in a listing at most `max_age` seconds old, or (None) asked for directly."""
        if not self.remote:
            return layout.shard_record(self.local, fp)
        fs, root = self._fs()
        if max_age is not None and f"{fp}.json" not in self.listing(max_age):
            return None
        try:
            record = json.loads(fs.cat_file(f"{root}/{fp}.json"))
        except FileNotFoundError:
            return None
        sizes = {n: self.listing(max_age).get(layout.array_file(fp, n)) if max_age is not None else
                 _size(fs, f"{root}/{layout.array_file(fp, n)}") for n in layout.arrays_of(record)}
        return record if sizes == array_sizes(record) else None

    def publish(self, record: dict) -> None:
        """Upload a finished shard (arrays, then record) and drop the local copy of its per-token arrays:
        the per-row ones (small) stay, for the split's finish step and the workers."""
        if not self.remote:
            return
        fp, fs, root = record["fingerprint"], *self._fs()
        per_token = {n for n, (_, per) in layout.arrays_of(record).items() if per == "tokens"}
        for name in layout.arrays_of(record):
            _put(fs, self.local / layout.array_file(fp, name), f"{root}/{layout.array_file(fp, name)}")
        _put(fs, self.local / f"{fp}.json", f"{root}/{fp}.json")
        for name in per_token:
            (self.local / layout.array_file(fp, name)).unlink(missing_ok=True)

    def localize_rows(self, records: list[dict]) -> None:
        """Every shard's per-row arrays and record in the local folder (those other nodes encoded)."""
        if not self.remote:
            return
        fs, root = self._fs()
        for r in records:
            for name, (_, per) in layout.arrays_of(r).items():
                target = self.local / layout.array_file(r["fingerprint"], name)
                if per == "rows" and not target.exists():
                    shard_cache.fetch(fs, f"{root}/{target.name}", target, array_sizes(r)[name],
                                      r.get("sha256", {}).get(name))
            write_json(self.local / f"{r['fingerprint']}.json", r)

    def publish_files(self, names: list[str]) -> dict[str, list]:
        """Upload split-wide files (e.g. offsets.npy); their [size, sha256] for the index."""
        out = {}
        for name in names:
            path = self.local / name
            out[name] = [path.stat().st_size, _sha256(path)]
            if self.remote:
                fs, root = self._fs()
                _put(fs, path, f"{root}/{name}")
        return out

    # ---- claims -------------------------------------------------------------------------------------
    def claim(self, fp: str) -> bool:
        """Create `.<fp>.claim` naming this host and process unless it exists; a claim of a dead local
        process, or of another host older than LEASE_S, is taken over."""
        if not self.remote:
            return _local_claim(self.local, fp)
        fs, root = self._fs()
        path, me = f"{root}/.{fp}.claim", json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                                      "time": time.time()}).encode()
        for _ in range(2):
            try:
                fs.pipe_file(path, me, mode="create")
                return True
            except FileExistsError:
                try:
                    owner = json.loads(fs.cat_file(path))
                except (FileNotFoundError, json.JSONDecodeError):
                    continue
                if not _dead(owner):
                    return False
                fs.rm_file(path)
        return False

    def drop_claims(self) -> None:
        """Once every piece is done: claims left by a killed preparation (between its record and its
        release) go; a remote store's other objects are each written once and kept."""
        if self.remote:
            fs, root = self._fs()
            for name in [n for n in self.listing() if n.endswith(".claim")]:
                try:
                    fs.rm_file(f"{root}/{name}")
                except FileNotFoundError:
                    pass

    def release(self, fp: str) -> None:
        if not self.remote:
            (self.local / f".{fp}.claim").unlink(missing_ok=True)
            return
        fs, root = self._fs()
        try:
            fs.rm_file(f"{root}/.{fp}.claim")
        except FileNotFoundError:
            pass


def array_sizes(record: dict) -> dict[str, int]:
    """Bytes of each array file of a shard record."""
    return {n: record[per] * np.dtype(dtype).itemsize for n, (dtype, per) in layout.arrays_of(record).items()}


def _size(fs, path: str) -> int | None:
    try:
        return int(fs.info(path)["size"])
    except FileNotFoundError:
        return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def _put(fs, local: Path, remote: str) -> None:
    """One object, whole: object stores make a PUT visible at once; a file system gets a rename."""
    if "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        tmp = f"{remote}.{socket.gethostname()}.{os.getpid()}.tmp"
        fs.makedirs(os.path.dirname(remote), exist_ok=True)
        shutil.copyfile(local, tmp)
        os.replace(tmp, remote)
    else:
        fs.put_file(str(local), remote)


def _dead(owner: dict) -> bool:
    if owner.get("host") == socket.gethostname():
        return not psutil.pid_exists(owner.get("pid", -1))
    return time.time() - owner.get("time", 0) > LEASE_S


def _local_claim(folder: Path, fp: str) -> bool:
    """Exclusive-create a claim file naming this host and process; a claim of a dead local process is
    taken over."""
    path = folder / f".{fp}.claim"
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


# ---- a node's side of a remote store ---------------------------------------------------------------
def share_folder(local: Path, url: str) -> None:
    """Upload a small folder (the tokenizer) beside the stores once: files first, then a `.done` marker."""
    fs, root = fsspec.core.url_to_fs(url)
    if fs.exists(f"{root}/.done"):
        return
    for path in sorted(local.iterdir()):
        if path.is_file():
            _put(fs, path, f"{root}/{path.name}")
    fs.pipe_file(f"{root}/.done", b"")


def fetch_folder(url: str, tmp: Path) -> None:
    """The folder `share_folder` uploaded, into `tmp` (renamed into place by cache.build_once)."""
    fs, root = fsspec.core.url_to_fs(url)
    if not fs.exists(f"{root}/.done"):
        raise FileNotFoundError(f"'{redact(url)}' not prepared (run `phalanx prepare` with this config)")
    tmp.mkdir(parents=True)
    for name, info in fs.find(root, detail=True).items():
        if not name.endswith("/.done"):
            shard_cache.fetch(fs, name, tmp / Path(name).name, int(info["size"]), None)


def open_cached(place: Place, index: dict, limit_bytes: int) -> None:
    """Ready the node-local folder of a remote store for the workers: the index, every shard's record and
    per-row arrays and the split-wide files (kept: small, and read whole), and the marker with which
    store.TokenStore maps the per-token arrays through the cache (cache.py) as the order needs them."""
    place.local.mkdir(parents=True, exist_ok=True)
    place.localize_rows(index["shards"])
    fs, root = place._fs()
    for name, (size, sha) in index.get("files", {}).items():
        target = place.local / name
        if not (target.exists() and target.stat().st_size == size):
            shard_cache.fetch(fs, f"{root}/{name}", target, size, sha)
    files = {}
    for r in index["shards"]:
        sizes = array_sizes(r)
        for name, (_, per) in layout.arrays_of(r).items():
            if per == "tokens":
                files[layout.array_file(r["fingerprint"], name)] = (sizes[name], r.get("sha256", {}).get(name))
    shard_cache.write_marker(place.local, place.url, limit_bytes, files)  # the URL redacted there, kept here
    write_json(place.local / layout.INDEX, index)


def lookahead_bytes(index: dict, shards: int) -> tuple[int, int]:
    """(bytes of the `shards` largest shards' per-token arrays, bytes kept whole: per-row and split-wide)."""
    sizes, kept = [], sum(size for size, _ in index.get("files", {}).values())
    for r in index["shards"]:
        per = {n: p for n, (_, p) in layout.arrays_of(r).items()}
        sizes.append(sum(b for n, b in array_sizes(r).items() if per[n] == "tokens"))
        kept += sum(b for n, b in array_sizes(r).items() if per[n] == "rows")
    return sum(sorted(sizes, reverse=True)[:shards]), kept
