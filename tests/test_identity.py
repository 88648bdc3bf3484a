"""The pretrained base's identity (model/identity.py): by content, so a copy of the base is the same base
and one changed weight byte is another; hashed once per file version (cached, safely under concurrency,
in constant memory); a hub name is its snapshot's commit."""
from __future__ import annotations

import os
import shutil
import tracemalloc
from concurrent.futures import ProcessPoolExecutor

import pytest
from conftest import tiny_llama
from test_hub import fake_hub_repo

from phalanx.model import identity
from phalanx.model.identity import DIGESTS, base_identity, file_digest, hash_file


@pytest.fixture
def base(tmp_path):
    """A tiny Llama saved in two shards with their index, a stale model.safetensors beside them."""
    folder = tmp_path / "base"
    tiny_llama(folder)
    (folder / "model.safetensors").write_bytes(b"stale")
    return folder


@pytest.fixture
def hashed(monkeypatch):
    """The files hashed (read whole), in order."""
    calls = []

    def counting(path):
        calls.append(path.name)
        return hash_file(path)

    monkeypatch.setattr(identity, "hash_file", counting)
    return calls


def test_a_copy_is_the_same_base_and_one_weight_byte_is_another(base, tmp_path, hashed):
    cache = tmp_path / "cache"
    weights = sorted(p.name for p in base.glob("model-*.safetensors"))
    assert len(weights) >= 2
    first = base_identity(str(base), cache)
    assert first.startswith("sha256:") and sorted(hashed) == sorted(["config.json", *weights])  # not the stale file
    assert base_identity(str(base), cache) == first and len(hashed) == 1 + len(weights)  # cached: none again
    copy = tmp_path / "copy"  # as `cp -r` copies: new files, new inodes, new modification times
    shutil.copytree(base, copy, copy_function=shutil.copyfile)
    assert os.stat(copy / weights[0]).st_mtime_ns != os.stat(base / weights[0]).st_mtime_ns
    hashed.clear()
    assert base_identity(str(copy), cache) == first and sorted(hashed) == sorted(["config.json", *weights])
    hashed.clear()
    assert base_identity(str(copy), cache) == first and hashed == []  # one re-hash per copy, then cached
    (copy / "model.safetensors").write_bytes(b"another stale file")  # not named by the index: not the base
    assert base_identity(str(copy), cache) == first
    data = bytearray((copy / weights[-1]).read_bytes())
    data[-1] ^= 1  # one byte of one weight
    (copy / weights[-1]).write_bytes(bytes(data))
    assert base_identity(str(copy), cache) != first
    assert base_identity("", cache) == ""


def test_a_hub_name_is_its_snapshot_commit(tmp_path, monkeypatch):
    import huggingface_hub.constants as hf

    monkeypatch.setattr(hf, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hf, "HF_HUB_OFFLINE", True)
    old, new = "1" * 40, "2" * 40
    fake_hub_repo(tmp_path / "hub", "org/tiny", ["config.json"], rev=old)
    assert base_identity("hf:org/tiny", tmp_path / "cache") == f"hf:org/tiny@{old}"
    (tmp_path / "hub" / "models--org--tiny" / "snapshots" / new).mkdir()
    (tmp_path / "hub" / "models--org--tiny" / "snapshots" / new / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--org--tiny" / "refs" / "main").write_text(new)  # the hub moved on
    assert base_identity("hf:org/tiny", tmp_path / "cache") == f"hf:org/tiny@{new}"


def _digest(args):
    return file_digest(*args)


def test_ranks_hashing_at_once_agree_and_leave_one_whole_entry(tmp_path):
    big = tmp_path / "weights.bin"
    big.write_bytes(os.urandom(24 << 20))
    cache = tmp_path / "cache"
    with ProcessPoolExecutor(4) as pool:
        digests = set(pool.map(_digest, [(big, cache)] * 4))
    assert digests == {hash_file(big)}
    assert [p.name for p in (cache / DIGESTS).iterdir()] == [next((cache / DIGESTS).iterdir()).name]  # no temps
    assert file_digest(big, cache) == digests.pop()


def test_hashing_streams_in_constant_memory(tmp_path):
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        f.truncate(96 << 20)  # a sparse file: 96 MB of zeros
    tracemalloc.start()
    try:
        digest = hash_file(big)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * identity.READ_BYTES  # one 8 MB buffer, not the file
    import hashlib

    assert digest == hashlib.sha256(bytes(96 << 20)).hexdigest()
