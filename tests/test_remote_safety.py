"""A store on object storage under stress, against the real S3-compatible server on 127.0.0.1 (tests/s3server.py):
the prefetch thread and the main thread sharing a token store's maps, transient network errors while a shard
downloads, and URLs that carry a secret."""
from __future__ import annotations

import gc
import io
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import SHAKESPEARE
from test_remote import lm_cfg

from phalanx.data import prepare as pipeline
from phalanx.data.remote import cache as shard_cache
from phalanx.data.lm_store import LM
from phalanx.data.samplers import GlobalBatchSampler, ShardPlan, windowed_order
from phalanx.run.batches import BatchSource
from phalanx.tasks.lm import LMTask, PackedBlocks


@pytest.fixture(scope="module")
def prepared(s3, tok, tmp_path_factory):
    """A small LM store in S3 (54 shards): its config, the ids of the same store kept locally, its URL."""
    root, url = tmp_path_factory.mktemp("prepared"), s3.bucket("safety")
    cfg = lm_cfg(str(SHAKESPEARE), root / "prep", tok, f"data.store_url={url}/stores")
    folder = pipeline.prepare(cfg, LM, 1, progress=False)["train"]["folder"]
    control = pipeline.prepare(lm_cfg(str(SHAKESPEARE), root / "control", tok), LM, 1, progress=False)["train"]
    ids = pipeline.store.TokenStore(control["folder"])
    return cfg, ids.slice(0, len(ids)), folder


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
    cfg, ids, _ = prepared
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


# ---- a network that fails while a shard downloads ------------------------------------------------------
class FlakyNetwork:
    """The real S3 filesystem behind a network that fails: the first `fail` downloads (None: every one) are cut,
    alternately as a connection refused at the request (botocore's error, as s3fs raises it once its own retries
    are spent) and as a connection reset after the first bytes."""

    def __init__(self, fs, fail: int | None):
        self.fs, self.fail, self.opens, self.times = fs, fail, 0, []

    def __getattr__(self, name):
        return getattr(self.fs, name)

    def open(self, path, mode="rb", **kw):
        from botocore.exceptions import EndpointConnectionError

        self.opens += 1
        self.times.append(time.monotonic())
        if self.fail is not None and self.opens > self.fail:
            return self.fs.open(path, mode, **kw)
        if self.opens % 2:
            raise EndpointConnectionError(endpoint_url=f"{self.fs.unstrip_protocol(path)}")
        return _CutAfterFirstBytes(self.fs.cat_file(path)[:100])


class _CutAfterFirstBytes(io.BytesIO):
    def read(self, n=-1):
        if self.tell():
            raise ConnectionResetError(104, "Connection reset by peer")
        return super().read(n)


def one_shard(s3, folder: str) -> tuple[str, bytes, str]:
    index = json.loads(s3.fs.cat_file(f"{folder}/index.json"))
    shard = index["shards"][2]
    obj = f"{folder}/{shard['fingerprint']}.bin"
    return obj, s3.fs.cat_file(obj), shard["sha256"]["ids"]


@pytest.fixture
def quick_backoff(monkeypatch):
    monkeypatch.setattr(shard_cache, "BACKOFF_S", 0.05, raising=False)  # 1 s in a run


def test_a_transient_network_error_is_retried_with_backoff(prepared, s3, tmp_path, quick_backoff):
    """`fetch` retried only a size or hash mismatch: one connection refused or reset failed the run."""
    cfg, _, folder = prepared
    obj, good, sha = one_shard(s3, folder)
    flaky, target = FlakyNetwork(s3.fs, fail=3), tmp_path / "shard.bin"
    shard_cache.fetch(flaky, obj, target, len(good), sha)
    assert flaky.opens == 4 and target.read_bytes() == good and not list(tmp_path.glob(".*.tmp"))
    waits = np.diff(flaky.times)
    assert waits[0] >= 0.05 and waits[1] >= 0.1 and waits[2] >= 0.2, waits  # backing off, doubled each time


def test_a_network_that_keeps_failing_stops_the_run_naming_the_object(prepared, s3, tok, tmp_path, quick_backoff):
    cfg, _, folder = prepared
    obj, good, sha = one_shard(s3, folder)
    down, target = FlakyNetwork(s3.fs, fail=None), tmp_path / "shard.bin"
    with pytest.raises(shard_cache.DownloadError) as e:
        shard_cache.fetch(down, obj, target, len(good), sha)
    assert down.opens == shard_cache.NETWORK_TRIES and not target.exists() and not list(tmp_path.glob(".*.tmp"))
    assert f"'s3://{obj.removeprefix('s3://')}'" in str(e.value) and "check the network" in str(e.value), e.value
    # the same through a worker's store: the node's downloader gives up, and the read says which object
    worker = lm_cfg(str(SHAKESPEARE), tmp_path / "node", tok, f"data.store_url={cfg.data.store_url}")
    train = pipeline.open_prepared(worker, LM).train
    train.cache.fs = FlakyNetwork(train.cache.fs, fail=None)
    with pytest.raises(shard_cache.DownloadError, match=r"s3://.*\.bin'.*failed 5 times"):
        train.slice(0, 10)
    # a missing object is not the network's: no retry
    missing = FlakyNetwork(s3.fs, fail=0)
    with pytest.raises(FileNotFoundError):
        shard_cache.fetch(missing, obj + ".gone", target, len(good), sha)
    assert missing.opens == 1


# ---- a URL with a secret ------------------------------------------------------------------------------
SECRETS = ("AKIDs3cr3tCRED", "s3cr3tSIGNATURE", "pA55w0rd")


def text_files(*roots: Path) -> dict[str, str]:
    out = {}
    for root in roots:
        for path in Path(root).rglob("*"):
            if path.is_file() and path.suffix not in (".bin", ".npy", ".pt", ".safetensors", ".distcp"):
                try:
                    out[str(path)] = path.read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    pass
    return out


def test_a_url_with_a_secret_is_redacted_wherever_it_is_shown_or_written(s3, tmp_path, capsys):
    """A presigned-style query on data.store_url was echoed into messages, remote.json, the index and
    RUN/config.yaml; the run itself must still use the real URL (it trains, reading its store through it)."""
    from conftest import TINY_LM, phalanx

    from phalanx.cli import main
    from phalanx.core.config import load_config
    from phalanx.tools.launch import worker_config

    url = f"{s3.bucket('secret-store')}/stores?X-Amz-Credential={SECRETS[0]}&X-Amz-Signature={SECRETS[1]}"
    run, cache = tmp_path / "run", tmp_path / "cache"
    args = ["train", f"data.train={SHAKESPEARE}", f"data.cache_dir={cache}", "--run-dir", run, *TINY_LM,
            "train.max_steps=2", "data.shard_mb=0.2", f"data.store_url={url}", "dist.backend=gloo"]
    proc = phalanx(*args, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shown = {"stdout": proc.stdout, "stderr": proc.stderr, **text_files(run, cache)}
    objects = {name: s3.fs.cat_file(name).decode() for name in s3.fs.find("secret-store") if name.endswith(".json")}
    assert any(name.endswith("index.json") for name in objects) and any("remote.json" in k for k in shown)
    assert "REDACTED" in next(v for k, v in shown.items() if k.endswith("config.yaml"))
    leaks = [where for where, text in {**shown, **objects}.items() if any(s in text for s in SECRETS)]
    assert not leaks, leaks
    # the workers' own config: the real URL, private to the user; RUN/config.yaml redacted
    cfg = load_config(None, [f"data.store_url={url}", f"run_dir={tmp_path / 'run2'}"])
    private = worker_config(cfg, tmp_path / "run2", multinode=False)
    try:
        assert load_config(str(private)).data.store_url == url and (private.stat().st_mode & 0o077) == 0
        assert not any(s in (tmp_path / "run2" / "config.yaml").read_text() for s in SECRETS)
    finally:
        private.unlink()
    # messages: a ConfigError (exit 2), `phalanx config`, a user:password URL
    bad = f"s3://secret-store/missing.jsonl?sig={SECRETS[1]}"
    assert main(["prepare", f"data.train={bad}", f"data.cache_dir={cache}"]) == 2
    assert main(["config", f"data.store_url=s3://user:{SECRETS[2]}@secret-store/x"]) == 0
    out, err = capsys.readouterr()
    assert "cannot list" in err or "not found" in err, err
    assert "s3://secret-store/missing.jsonl?sig=REDACTED" in err and "s3://REDACTED@secret-store/x" in out
    assert not any(s in out + err for s in SECRETS), (out, err)
