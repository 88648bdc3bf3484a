"""The node-local cache of a store kept on object storage: its shard files, downloaded as the sample order
reaches them, within `data.cache_limit_gb`.

One downloader per node: the process holding an exclusive `flock` on `.downloader.lock` in the cache
folder (the kernel drops it when the process dies, so a killed run leaves no lock to wait on; the next
holder removes the partial `.tmp` files only a downloader writes). It fetches the files its process's
order wants next (`want`, in order of need) and those other processes of the node ask for (`.want.NAME`
request files), each to a temporary name, checked (size, and the sha256 the index records) and renamed.
Every process maps a file under a shared `flock` on it; eviction takes an exclusive one without waiting,
so a mapped file (whose deletion would free no disk) is never evicted, nor is one wanted or requested.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import threading
import time
from pathlib import Path

import fsspec

from phalanx.core.errors import HIDDEN, redact

MARKER = "remote.json"  # in a cache folder: the store's URL, the limit, and its shard files' sizes and hashes
LOCK = ".downloader.lock"
TRIES = 3          # downloads whose bytes do not match the index, before the file is refused
NETWORK_TRIES = 5  # downloads the network cut (after the client's own retries), before the run stops
BACKOFF_S = 1.0    # the first wait after a network error, doubled after each (1 + 2 + 4 + 8 s in all)
CHUNK = 8 << 20
PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError)  # no retry makes these right


class DownloadError(RuntimeError):
    """A file whose downloaded bytes never matched the index (it is refused, never trained on), or that the
    network kept failing to bring."""


def _download(fs, remote: str, tmp: Path) -> tuple[int, str]:
    h, n = hashlib.sha256(), 0
    with fs.open(remote, "rb", block_size=CHUNK) as src, open(tmp, "wb") as dst:
        while chunk := src.read(CHUNK):
            h.update(chunk)
            dst.write(chunk)
            n += len(chunk)
    return n, h.hexdigest()


def fetch(fs, remote: str, local: Path, size: int, sha256: str | None) -> None:
    """Download `remote` to `local` through a temporary name, checked (size; sha256 when the index records
    one: stores made before it are checked by size only); a mismatch is fetched again, then refused. A network
    error (a connection refused or reset, a timeout: any error but a missing or forbidden object) is retried
    after BACKOFF_S, 2 x BACKOFF_S, ... then the download fails naming the object."""
    tmp, mismatches, errors, started = local.with_name(f".{local.name}.{os.getpid()}.tmp"), 0, 0, time.monotonic()
    while True:
        try:
            n, digest = _download(fs, remote, tmp)
        except PERMANENT:
            tmp.unlink(missing_ok=True)
            raise
        except Exception as e:  # the network's: retried
            errors += 1
            if errors < NETWORK_TRIES:
                time.sleep(BACKOFF_S * 2 ** (errors - 1))
                continue
            failure = (f"the download failed {errors} times in {time.monotonic() - started:.0f} s, the last with "
                       f"{type(e).__name__}: {redact(str(e))}; check the network and that the store is reachable, "
                       f"then run the same command again")
        else:
            if n == size and (sha256 is None or digest == sha256):
                os.replace(tmp, local)
                return
            mismatches += 1
            if mismatches < TRIES:
                time.sleep(0.2 * mismatches)
                continue
            failure = (f"the downloaded bytes ({n} B, sha256 {digest[:12]}...) do not match the store's index "
                       f"({size} B, sha256 {(sha256 or 'not recorded')[:12]}...) after {TRIES} tries; the remote "
                       f"copy is damaged: prepare the store again (phalanx prepare)")
        tmp.unlink(missing_ok=True)
        raise DownloadError(f"'{_shown(fs, remote)}': {failure}") from None


def _shown(fs, path: str) -> str:
    """An object as a message names it: its URL, any secret in it redacted."""
    try:
        path = fs.unstrip_protocol(path)
    except Exception:  # noqa: BLE001 - a name is all a message needs
        pass
    return redact(path)


def write_marker(folder: Path, url: str, limit_bytes: int, files: dict[str, tuple[int, str | None]]) -> None:
    """remote.json, with the store's URL redacted (errors.redact); this process keeps the real one."""
    tmp = folder / f".{MARKER}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"url": redact(url), "limit_bytes": limit_bytes, "files": files}))
    os.replace(tmp, folder / MARKER)
    _urls[str(folder)] = url


_opened: dict[str, ShardCache] = {}
_urls: dict[str, str] = {}  # folder -> the store's real URL, as this process was given it (remote.open_cached)


def attached(folder: Path) -> ShardCache | None:
    """The cache of `folder` when it holds a remote store's files (one per folder and process), else None."""
    key = str(folder)
    if key not in _opened or _opened[key].failed:  # a refusal is tried again by a new opening
        try:
            spec = json.loads((Path(folder) / MARKER).read_text())
        except FileNotFoundError:
            return None
        url = _urls.get(key, spec["url"])
        if key not in _urls and HIDDEN in url:
            raise DownloadError(f"'{folder}': its store's URL carries a secret, which {MARKER} does not keep; open "
                                f"the store through its config (the same data.store_url)")
        _opened[key] = ShardCache(Path(folder), url, spec["limit_bytes"],
                                  {k: tuple(v) for k, v in spec["files"].items()})
    return _opened[key]


class ShardCache:
    def __init__(self, folder: Path, url: str, limit_bytes: int, files: dict[str, tuple[int, str | None]]):
        self.folder, self.url, self.limit, self.files = folder, url, limit_bytes, files
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.wanted: list[str] = []
        self.failed: dict[str, str] = {}  # file -> why its download was refused (it alone is refused)
        self.fetched = 0          # bytes this process downloaded (the benchmark's count)
        self.hits = self.misses = 0
        self._lock_fd: int | None = None
        self._wake = threading.Event()
        self._saved = (0, 0, 0)
        self.kept = sum(e.stat().st_size for e in os.scandir(folder) if e.is_file() and not e.name.startswith(".")
                        and e.name not in files)  # what is kept whole (records, per-row and split-wide files)

    def _save_stats(self) -> None:
        """`.stats.<pid>.json` when the counts changed (workers end with os._exit: no exit hook runs): the
        bytes this process downloaded, and its shard maps whose file was there (hits) or waited for."""
        counts = (self.fetched, self.hits, self.misses)
        if counts != self._saved:
            self._saved = counts
            tmp = self.folder / f".stats.{os.getpid()}.{threading.get_ident()}.tmp"  # two threads save
            tmp.write_text(json.dumps({"fetched_bytes": counts[0], "hits": counts[1], "misses": counts[2]}))
            os.replace(tmp, self.folder / f".stats.{os.getpid()}.json")

    # ---- every process ---------------------------------------------------------------------------
    def want(self, names: list[str]) -> None:
        """The files the order needs next, in order of need: what the downloader fetches and keeps."""
        wanted, room = [], self.limit - self.kept if self.limit else float("inf")
        for n in dict.fromkeys(names):
            if n in self.files:
                room -= self.files[n][0]
                if room < 0:  # more than the cache holds (the launcher checks the windowed order's
                    break     # lookahead; another order's may be larger): the nearest first
                wanted.append(n)
        self.wanted = wanted
        self._lead()
        self._wake.set()
        self._save_stats()

    def open(self, name: str) -> int:
        """A descriptor of the local copy of `name` under a shared lock (eviction passes it by); the
        caller maps it, and closing the descriptor releases it."""
        path, asked = self.folder / name, False
        while True:
            if name in self.failed:
                raise DownloadError(self.failed[name])
            if self._present(name):
                try:
                    fd = os.open(path, os.O_RDONLY)
                except FileNotFoundError:
                    continue  # evicted between the check and the open
                fcntl.flock(fd, fcntl.LOCK_SH)
                if os.fstat(fd).st_nlink:  # still the cache's file, not one evicted meanwhile
                    self.hits += not asked
                    self._save_stats()
                    return fd
                os.close(fd)
            self._lead()  # first: a new downloader clears the refusals of the last one, and tries again
            self._raise_failure(name)
            if not asked:
                self.misses += 1
                (self.folder / f".want.{name}").touch()
                asked = True
            self._wake.set()
            time.sleep(0.01)

    def _present(self, name: str) -> bool:
        try:
            return os.stat(self.folder / name).st_size == self.files[name][0]
        except FileNotFoundError:
            return False

    def _raise_failure(self, name: str) -> None:
        failed = self.folder / f".failed.{name}"
        if failed.exists():  # the node's downloader refused it
            self.failed[name] = failed.read_text()
            raise DownloadError(self.failed[name])

    def _lead(self) -> bool:
        """Become the node's downloader if no live process is (non-blocking)."""
        if self._lock_fd is not None:
            return True
        fd = os.open(self.folder / LOCK, os.O_CREAT | os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._lock_fd = fd
        for stale in [*self.folder.glob(".*.tmp"), *self.folder.glob(".failed.*")]:  # a killed or failed
            stale.unlink(missing_ok=True)  # downloader's partial files, and its refusals (tried again now)
        threading.Thread(target=self._download_loop, name="phalanx-shard-cache", daemon=True).start()
        return True

    # ---- the downloader ---------------------------------------------------------------------------
    def _download_loop(self) -> None:
        while True:
            requested = [p.name[6:] for p in self.folder.glob(".want.*")]
            todo = [n for n in [*requested, *self.wanted] if n in self.files and not self._present(n)]
            if not todo:
                self._wake.wait(0.2)  # idle: want() wakes it at once; other ranks ask within 0.2 s
                self._wake.clear()
                continue
            name = todo[0]
            size, sha = self.files[name]
            try:
                self._make_room(size, keep=set(requested) | set(self.wanted))
                fetch(self.fs, f"{self.root}/{name}", self.folder / name, size, sha)
                self.fetched += size
                self._save_stats()
            except Exception as e:  # said by every process that waits for this file
                self.failed[name] = redact(str(e))
                (self.folder / f".failed.{name}").write_text(self.failed[name])
                os.close(self._lock_fd)  # another opening may try again (a new run, once the store is fixed)
                self._lock_fd = None
                return
            (self.folder / f".want.{name}").unlink(missing_ok=True)

    def used(self) -> int:
        return sum(e.stat().st_size for e in os.scandir(self.folder) if e.is_file() and not e.name.startswith("."))

    def _make_room(self, size: int, keep: set[str]) -> None:
        """Evict shard files until `size` more bytes fit the limit: never a wanted or requested file, nor one
        a process maps; the least recently used first. Waits for processes to release their maps."""
        if not self.limit:
            return
        while self.used() + size > self.limit:
            candidates = sorted((e for e in os.scandir(self.folder) if e.is_file() and e.name in self.files
                                 and e.name not in keep), key=lambda e: e.stat().st_atime)
            if not any(self._evict(e.path) for e in candidates):
                time.sleep(0.02)

    @staticmethod
    def _evict(path: str) -> bool:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # mapped by a process: deleting it would free no disk
        else:
            os.unlink(path)
            return True
        finally:
            os.close(fd)
