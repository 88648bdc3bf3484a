"""A store on object storage under stress, against the real S3-compatible server on 127.0.0.1 (tests/s3server.py):
the prefetch thread and the main thread sharing a token store's maps, transient network errors while a shard
downloads, and URLs that carry a secret."""
from __future__ import annotations

import gc
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import SHAKESPEARE
from s3server import S3Server
from test_prepare import tokenizer_dir
from test_remote import LINES, lm_cfg

from phalanx.data import prepare as pipeline
from phalanx.data.lm_store import LM
from phalanx.data.samplers import GlobalBatchSampler, ShardPlan, windowed_order
from phalanx.run.batches import BatchSource
from phalanx.tasks.lm import LMTask, PackedBlocks


@pytest.fixture(scope="module")
def s3():
    with S3Server() as server:
        yield server


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> str:
    return str(tokenizer_dir(tmp_path_factory.mktemp("tok"), "\n".join(LINES[:2000])))


@pytest.fixture(scope="module")
def prepared(s3, tok, tmp_path_factory):
    """A small LM store in S3 (~40 shards) and the same store kept locally (the control's ids)."""
    root, url = tmp_path_factory.mktemp("prepared"), s3.bucket("safety")
    cfg = lm_cfg(str(SHAKESPEARE), root / "prep", tok, f"data.store_url={url}/stores")
    pipeline.prepare(cfg, LM, 1, progress=False)
    control = pipeline.prepare(lm_cfg(str(SHAKESPEARE), root / "control", tok), LM, 1, progress=False)["train"]
    ids = pipeline.store.TokenStore(control["folder"])
    return cfg, ids.slice(0, len(ids))


# ---- the token store's maps, shared by the main thread and the prefetch thread --------------------------
def open_files(folder: Path) -> list[str]:
    """This process's open descriptors of files in `folder` (a shard's stays open while it is mapped)."""
    out = []
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = Path(fd).readlink()
        except OSError:
            continue
        if target.parent == folder and not target.name.startswith("."):  # not the downloader's lock
            out.append(target.name)
    return out


def test_the_prefetch_thread_and_the_main_thread_share_the_maps_safely(prepared, tok, tmp_path):
    """`BatchSource(prefetch=True)` (the CUDA path, driven here on the CPU): the prefetch thread collates the next
    step while the main thread releases maps (`keep_only`, each step) and reads the same shards (as an evaluation
    of the tail of the training store does). The cache's opening is slowed (5 ms, as a cold disk) so the threads
    meet. Unguarded, both threads mapped the same shard and one descriptor was lost, holding the cache's shared
    lock for good (the shard could never be evicted again), or one thread's keep_only deleted a map the other had
    just deleted or was iterating over (KeyError, 'dictionary changed size during iteration'). Every batch must
    also be the local store's."""
    cfg, ids = prepared
    worker = lm_cfg(str(SHAKESPEARE), tmp_path / "node", tok, f"data.store_url={cfg.data.store_url}")
    train = pipeline.open_prepared(worker, LM).train
    assert train.cache is not None and len(train.shards) > 20
    real_open = train.cache.open

    def slow_open(name: str) -> int:
        time.sleep(0.005)
        return real_open(name)

    train.cache.open = slow_open
    block = 16
    blocks = PackedBlocks(train, block)
    task = SimpleNamespace(train_set=blocks, collate=lambda ds, i: LMTask.collate(None, ds, i))
    sampler = GlobalBatchSampler(len(blocks), 8, 2, seed=0, order=windowed_order(ShardPlan.of(blocks), 2))
    source = BatchSource(task, sampler, 0, 1, torch.device("cpu"), prefetch=True)
    assert source.pool is not None and source.plan is not None
    switch, errors = sys.getswitchinterval(), []
    sys.setswitchinterval(1e-5)  # hand the GIL over often: the threads interleave finely
    try:
        for step in range(60):
            offset = step * sampler.global_batch_size
            _, batches = source.take(offset)  # the next step's collation starts on the thread
            for micro, got in zip(sampler.rank_micro_batches(sampler.global_batch(offset), 0, 1), batches):
                want = np.stack([ids[int(i) * block:int(i) * block + block + 1] for i in micro])
                assert np.array_equal(got["input_ids"].numpy(), want[:, :-1]), step
            for i in sampler.global_batch(offset + sampler.global_batch_size):  # what the thread reads now
                lo = int(i) * block
                assert np.array_equal(train.slice(lo, lo + block), ids[lo:lo + block])
                train.keep_only(set())  # and release every map, as a step whose windows moved on does
    except Exception as e:  # noqa: BLE001 - the race's symptom, whichever it is
        errors.append(e)
    finally:
        sys.setswitchinterval(switch)
        source.close()
    assert not errors, repr(errors[0])
    train.keep_only(set())
    gc.collect()
    assert open_files(train.folder) == []  # no descriptor (and its lock on a shard) lost
