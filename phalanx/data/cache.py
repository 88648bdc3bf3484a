"""The cache folder, the one fingerprint its entries are named by, and building an entry atomically.

An entry (a tokenizer folder, a store's shard) is named by a fingerprint of what it is made from, so a
changed input makes a new name and an unchanged one finds the finished entry again.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import socket
from collections.abc import Callable
from pathlib import Path


def cache_root(configured: str) -> Path:
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "phalanx"


def fingerprint(*parts) -> str:
    """A short hash of `parts` (bytes as they are, anything else by its repr). A file counts by what the
    caller passes: its name, or its identity (sources.file_identity) when a change must make a new name."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else repr(part).encode())
        h.update(b"\0")
    return h.hexdigest()[:20]


def _unique_tmp(path: Path) -> Path:
    return path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")


def build_once(path: Path, build: Callable[[Path], None]) -> Path:
    """Return `path`, building it with `build(tmp_path)` and renaming it into place when it is missing."""
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _unique_tmp(path)
    try:
        build(tmp)
        try:
            os.replace(tmp, path)  # atomic: readers see nothing or the whole artefact
        except OSError:
            # A folder cannot replace a non-empty one: another node's main process, sharing this
            # cache folder, finished first. Its artefact is identical (same fingerprint); use it.
            if not path.exists():
                raise
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()
    return path
