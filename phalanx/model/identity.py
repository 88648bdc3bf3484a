"""What a pretrained base model is, by content: the identity a checkpoint records, so that resuming adapters
onto another base is refused (tools/launch.py), and that stored results computed from a base are keyed by.

A local folder's identity is a SHA-256 over config.json and every weight file the folder's index names
(weights.weight_files: a stale file beside them does not count), each file by its bytes: headers alone
are equal for a base and its instruct model. A copy of the folder (`cp` to node-local disk) has the same
identity; any changed byte changes it. Hashing streams 8 MB reads (constant memory per file; ~1 GB/s per
core on this shared machine, page-cached; the files of a sharded base on threads) and each file's digest
is cached under the phalanx cache folder by (real path, size, mtime_ns, inode, device), so a base is read
once per place it lives, not once per run or checkpoint. A hub name's identity is `hf:NAME@COMMIT`, the
snapshot's commit (a hub name alone is not versioned). A GGUF base's identity is the SHA-256 of the GGUF
file's bytes (`sha256sum` prints it), whether named as the file or as the folder it was dequantised into
(read from the folder's marker, model/gguf.py): a checkpoint's base identity then names the GGUF.
"""
from __future__ import annotations

import hashlib
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from phalanx.core.config import hub_name
from phalanx.model import gguf
from phalanx.model.weights import CONFIG, file_names, weight_files

READ_BYTES = 8 << 20
DIGESTS = "file-digests"  # the cache's subfolder: one small file per (file, version)


def base_identity(spec: str, cache_dir: Path) -> str:
    """`model.pretrained` -> its identity ('' when training from scratch); `cache_dir` is phalanx's cache
    folder (data.cache_dir, or its default)."""
    if not spec:
        return ""
    folder = Path(hub_name(spec))
    if folder.is_file():  # a GGUF file not yet resolved to its folder (tools/launch.resolve_pretrained)
        return "sha256:" + file_digest(folder, Path(cache_dir))
    if not folder.is_dir():
        return f"hf:{hub_name(spec)}@{hub_commit(hub_name(spec))}"
    dequantised = gguf.marker(folder)
    if dequantised:
        return "sha256:" + dequantised["sha256"]
    found = weight_files(folder)
    names = [n for n in [CONFIG, *(file_names(found) if found is not None else [])] if (folder / n).is_file()]
    # files on threads: hashlib releases the GIL, so a sharded base hashes on several cores
    with ThreadPoolExecutor(max_workers=max(1, min(len(names), os.cpu_count() or 1, 8))) as pool:
        digests = list(pool.map(lambda name: file_digest(folder / name, Path(cache_dir)), names))
    h = hashlib.sha256()
    for name, digest in zip(names, digests):
        h.update(f"{name}\0{digest}\0".encode())
    return "sha256:" + h.hexdigest()


def hub_commit(name: str) -> str:
    """The commit of the hub model's snapshot that a run uses (the cached one when offline)."""
    from huggingface_hub import snapshot_download  # lazy: only a hub name needs it

    return Path(snapshot_download(name, allow_patterns=[CONFIG])).name


def file_digest(path: Path, cache_dir: Path) -> str:
    """SHA-256 of the file's bytes, from the cache when this version of this file was hashed before."""
    st = os.stat(path)  # through symlinks: a hub snapshot's files link to its blobs
    key = hashlib.sha256(f"{os.path.realpath(path)}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\0{st.st_dev}"
                         .encode()).hexdigest()[:32]
    entry = cache_dir / DIGESTS / key
    try:
        cached = entry.read_text().strip()
        if len(cached) == 64 and all(c in "0123456789abcdef" for c in cached):
            return cached
    except OSError:
        pass
    digest = hash_file(path)
    # atomic and safe when several ranks or runs hash the same file at once: each writes a temporary file
    # of its own, then renames it over the entry (readers see a whole digest or none)
    tmp = entry.with_name(f".{key}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(digest + "\n")
        os.replace(tmp, entry)
    except OSError:  # a read-only cache: the digest is still right, just not remembered
        tmp.unlink(missing_ok=True)
    return digest


def hash_file(path: Path) -> str:
    """SHA-256 of a file, streamed through one reused 8 MB buffer."""
    h = hashlib.sha256()
    buf = bytearray(READ_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()
