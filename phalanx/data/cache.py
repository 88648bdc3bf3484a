"""Build-once caches shared by the processes of a node.

The main process of each node builds an artefact (tokenizer, token array) into a temporary path and
renames it into place; the other processes wait for the file instead of sitting in a collective that
could time out while a large corpus is tokenized.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Callable


def cache_root(configured: str) -> Path:
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "phalanx"


def fingerprint(*parts) -> str:
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, Path) or (isinstance(part, str) and os.path.isfile(part)):
            st = os.stat(part)  # size + mtime + path: cheap and changes when the file does
            h.update(f"{os.path.abspath(part)}:{st.st_size}:{st.st_mtime_ns}".encode())
        else:
            h.update(repr(part).encode())
        h.update(b"\0")
    return h.hexdigest()[:20]


def _unique_tmp(path: Path) -> Path:
    return path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")


def build_once(path: Path, build: Callable[[Path], None], *, is_builder: bool, timeout_s: float) -> Path:
    """Return `path`, building it with `build(tmp_path)` on the builder process, waiting elsewhere."""
    if path.exists():
        return path
    if is_builder:
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
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f}s for '{path}' from the node's main process")
        time.sleep(0.05)
    return path
