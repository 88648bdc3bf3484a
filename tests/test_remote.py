"""Data on object storage, against a real S3-compatible server on 127.0.0.1 (tests/s3server.py: moto's
server, reached by s3fs): inputs read from s3:// URLs give the same store as local files; damaged or
missing objects are the same one-line exit 2."""
from __future__ import annotations

import gzip
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
import torch
from conftest import REFERENCE, REPO, SHAKESPEARE, final_params, lm_args, phalanx, train_losses

from phalanx.core.config import ConfigError, load_config
from phalanx.data import prepare as pipeline
from phalanx.data import layout, store
from phalanx.data.remote import cache as shard_cache
from phalanx.data.lm_store import LM

LINES = [line for line in SHAKESPEARE.read_text(encoding="utf-8").splitlines() if line.strip()][:6000]


def lm_cfg(data: str, cache: Path, tok: str, *extra):
    return load_config(None, [f"data.train={data}", f"data.cache_dir={cache}", f"data.tokenizer={tok}",
                              "data.val_fraction=0", "data.shard_mb=0.02", *extra])


def jsonl_bytes(lines: list[str]) -> bytes:
    return "".join(json.dumps({"text": t}) + "\n" for t in lines).encode()


def table_bytes(lines: list[str], kind: str) -> bytes:
    out, table = io.BytesIO(), pa.table({"text": lines})
    pq.write_table(table, out, row_group_size=500) if kind == "parquet" else pcsv.write_csv(table, out)
    return out.getvalue()


def stored(summary: dict) -> tuple[np.ndarray, list]:
    tokens = store.TokenStore(summary["folder"])
    return tokens.slice(0, len(tokens)), [(s["tokens"], s["documents"], s["range"]) for s in tokens.index["shards"]]


def test_every_input_format_read_from_s3_gives_the_local_store(s3, tok, tmp_path):
    bucket = s3.bucket("inputs")
    local = tmp_path / "local"
    (local / "parts").mkdir(parents=True)
    corpora = {"parts": {"parts/a.jsonl": jsonl_bytes(LINES[:3000]), "parts/b.jsonl": jsonl_bytes(LINES[3000:])},
               "t.txt": {"t.txt": ("\n".join(LINES) + "\n").encode()},
               "p.parquet": {"p.parquet": table_bytes(LINES[:3000], "parquet")},
               "c.csv": {"c.csv": table_bytes(LINES[:2000], "csv")}}
    for name, files in corpora.items():
        for rel, data in files.items():
            (local / rel).write_bytes(data)
            s3.put(f"{bucket}/corpus/{rel}", data)
        workers = 2 if name == "parts" else 1  # the pool's spawned processes read from S3 too
        here = pipeline.prepare(lm_cfg(str(local / name), tmp_path / f"c-{name}", tok), LM, workers, progress=False)
        there = pipeline.prepare(lm_cfg(f"{bucket}/corpus/{name}", tmp_path / f"s3-{name}", tok), LM, workers,
                                 progress=False)
        (ids, shards), (ids_s3, shards_s3) = stored(here["train"]), stored(there["train"])
        assert len(shards) > 1 and shards_s3 == shards, name
        assert np.array_equal(ids_s3, ids), name
        assert there["train"]["source"].startswith("s3://") and there["train"]["files"] == len(files)
        index = layout.read_index(there["train"]["folder"])
        assert index["sources"][0][0] == f"{bucket}/corpus/{sorted(files)[0]}" and index["sources"][0][2]  # ETag
        again = pipeline.prepare(lm_cfg(f"{bucket}/corpus/{name}", tmp_path / f"s3-{name}", tok), LM, 1,
                                 progress=False)
        assert again["train"]["reused"]  # listed again: the same objects, the same store


def test_damaged_or_missing_objects_are_one_line_like_local_files(s3, tok, tmp_path):
    bucket = s3.bucket("damaged")
    lines = [json.dumps({"text": t}) for t in LINES[:3000]]
    lines[2345] = '{"text": "bad \udcff byte"}'
    bad = "\n".join(lines).encode("utf-8", "surrogateescape") + b"\n"  # a lone 0xff byte on line 2346
    cases = {"bad.jsonl": (bad, "data file 's3://damaged/bad.jsonl' line 2346: not valid UTF-8"),
             "zipped.jsonl": (gzip.compress(jsonl_bytes(LINES[:50])), "'s3://damaged/zipped.jsonl': gzip-compressed"),
             "cut.parquet": (table_bytes(LINES[:2000], "parquet")[:3000], "'s3://damaged/cut.parquet': not a "
                             "readable Parquet file")}
    for name, (data, message) in cases.items():
        s3.put(f"{bucket}/{name}", data)
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            pipeline.prepare(lm_cfg(f"{bucket}/{name}", tmp_path / name, tok), LM, 1, progress=False)
        assert not list((tmp_path / name).rglob(layout.INDEX))
    s3.put(f"{bucket}/good.jsonl", jsonl_bytes(LINES[:50]))
    pipeline.prepare(lm_cfg(f"{bucket}/good.jsonl", tmp_path / "good", tok), LM, 1, progress=False)  # control
    for url, message in ((f"{bucket}/nope.jsonl", "'s3://damaged/nope.jsonl' not found"),
                         ("s3://no-such-bucket/x.jsonl", "cannot list 's3://no-such-bucket/x.jsonl' (")):
        proc = phalanx("prepare", f"data.train={url}", f"data.cache_dir={tmp_path / 'cli'}", f"data.tokenizer={tok}")
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
        assert f"config key 'data.train': {message}" in proc.stderr
        assert "phalanx-test" not in proc.stderr + proc.stdout  # credentials never in phalanx's output


# ---- training from a remote store ---------------------------------------------------------------
SMALL_SHARDS = ["data.shard_mb=0.05", "data.order_window=2"]  # 22 shards of ~52 KB: the cache holds ~10


def remote_run(run: Path, cache: Path, store_url: str, *extra) -> list[str]:
    return [*lm_args(run, cache, *REFERENCE, *SMALL_SHARDS), f"data.store_url={store_url}",
            "data.cache_limit_gb=0.0006", *extra]


def cache_folder(cache: Path) -> Path:
    return next((cache / "remote").glob("store-*"))


@pytest.fixture(scope="module")
def local_windowed(tmp_path_factory, cache_dir) -> Path:
    """The reference: the windowed order from a local store, 2 processes."""
    run = tmp_path_factory.mktemp("local-windowed")
    phalanx(*lm_args(run, cache_dir, *REFERENCE, *SMALL_SHARDS, "data.order=windowed"), "--nproc-per-node", 2,
            check=True, timeout=240)
    return run


def test_a_store_larger_than_the_cache_trains_bitwise_like_the_local_store(s3, tmp_path, local_windowed):
    """2 processes each side: the same windowed order from a local store and from S3 through a node cache
    of 0.6 MB for a 1.15 MB store (evicting as it goes): identical losses and weights."""
    url, local = s3.bucket("train-store"), local_windowed
    run, cache = tmp_path / "remote", tmp_path / "node-cache"
    phalanx(*remote_run(run, cache, url), "--nproc-per-node", 2, check=True, timeout=240)
    same_run(run, local)
    index = json.loads((cache_folder(cache) / layout.INDEX).read_text())
    store_bytes = index["summary"]["store_bytes"]
    assert store_bytes > 1.5 * 0.6e6 and all(len(s["sha256"]["ids"]) == 64 for s in index["shards"])
    left = sum(p.stat().st_size for p in cache_folder(cache).glob("*.bin"))
    assert 0 < left <= 0.6e6, left  # the limit held: shards were evicted as the order moved on
    stats = [json.loads(p.read_text()) for p in cache_folder(cache).glob(".stats.*.json")]
    fetched = [s["fetched_bytes"] for s in stats if s["fetched_bytes"]]
    assert len(fetched) == 1  # one downloader for the node's two ranks (the other asked it)


def same_run(run: Path, ref: Path, rel: float = 0.0) -> None:
    """Equal losses at every step and equal final weights (rel=0: bit for bit)."""
    got, want = train_losses(run), train_losses(ref)
    assert sorted(got) == sorted(want) == list(range(1, 11))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=rel, abs=0), f"step {step}: {got[step]} vs {want[step]}"
    p, q = final_params(run), final_params(ref)
    for name in q:
        torch.testing.assert_close(p[name], q[name], rtol=rel, atol=rel * 10, msg=name)


# ---- the node cache: verified downloads, a killed downloader, the lookahead ------------------------
def remote_store(s3, tmp_path: Path, tok: str, bucket: str) -> tuple:
    """A small LM store prepared into S3 (in this process); its config, the local control store's ids."""
    url = s3.bucket(bucket)
    cfg = lm_cfg(str(SHAKESPEARE), tmp_path / "prep", tok, f"data.store_url={url}/stores")
    summary = pipeline.prepare(cfg, LM, 1, progress=False)["train"]
    control = pipeline.prepare(lm_cfg(str(SHAKESPEARE), tmp_path / "control", tok), LM, 1, progress=False)["train"]
    return cfg, summary, stored(control)[0]


class FlakyOnce:
    """The real S3 filesystem, with the bytes of the first file it opens damaged (a transient fault)."""

    def __init__(self, fs):
        self.fs, self.opens = fs, 0

    def open(self, path, mode="rb", **kw):
        self.opens += 1
        data = self.fs.cat_file(path)
        return io.BytesIO(data[:-1] + bytes([data[-1] ^ 1]) if self.opens == 1 else data)


def test_a_damaged_shard_is_fetched_again_or_refused_never_read(s3, tok, tmp_path):
    cfg, summary, ids = remote_store(s3, tmp_path, tok, "damaged-store")
    index = json.loads(s3.fs.cat_file(f"{summary['folder']}/index.json"))
    shard = index["shards"][3]
    name, obj = f"{shard['fingerprint']}.bin", f"{summary['folder']}/{shard['fingerprint']}.bin"
    good = s3.fs.cat_file(obj)
    flaky, target = FlakyOnce(s3.fs), tmp_path / "one.bin"
    shard_cache.fetch(flaky, obj, target, len(good), shard["sha256"]["ids"])  # damaged once: fetched again
    assert flaky.opens == 2 and target.read_bytes() == good
    s3.put(obj, good[::-1])  # the object itself damaged: same size, other bytes
    lo = sum(s["tokens"] for s in index["shards"][:3])
    worker = lm_cfg(str(SHAKESPEARE), tmp_path / "node", tok, f"data.store_url={cfg.data.store_url}")
    with pytest.raises(shard_cache.DownloadError, match="do not match the store's index"):
        pipeline.open_prepared(worker, LM).train.slice(lo, lo + 10)
    folder = next((tmp_path / "node" / "remote").glob("store-*"))
    assert not (folder / name).exists() and not list(folder.glob(".*.tmp"))  # nothing of it kept
    s3.put(obj, good)  # control: the intact object is read, as the local store has it
    again = pipeline.open_prepared(worker, LM).train
    assert np.array_equal(again.slice(lo, lo + 5000), ids[lo:lo + 5000])


def test_a_killed_downloader_leaves_nothing_to_wait_on(s3, tmp_path):
    """SIGKILL mid-download: its lock dies with it, the next process leads at once and removes the
    partial file, and the file it fetches is whole."""
    import hashlib
    import os
    import signal
    import subprocess
    import sys
    import time

    data = os.urandom(48 << 20)
    url = s3.bucket("big")
    s3.put(f"{url}/big.bin", data)
    folder = tmp_path / "cache"
    folder.mkdir()
    files = {"big.bin": (len(data), hashlib.sha256(data).hexdigest())}
    shard_cache.write_marker(folder, url, 0, files)
    code = f"from phalanx.data.remote import cache; cache.attached({str(folder)!r}).open('big.bin')"
    child = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ))
    deadline = time.time() + 60
    while not list(folder.glob(".big.bin.*.tmp")) and time.time() < deadline and child.poll() is None:
        time.sleep(0.002)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert list(folder.glob(".big.bin.*.tmp")) and not (folder / "big.bin").exists()  # killed mid-download
    t0 = time.time()
    fd = shard_cache.attached(folder).open("big.bin")
    os.close(fd)
    # (this process's downloader thread may be saving its counts right now: its .stats tmp is no leftover)
    left = [p for p in folder.glob(".*.tmp") if not p.name.startswith(f".stats.{os.getpid()}.")]
    assert time.time() - t0 < 30 and not left, left
    assert hashlib.sha256((folder / "big.bin").read_bytes()).hexdigest() == files["big.bin"][1]


def test_a_cache_smaller_than_the_lookahead_is_exit_2_at_start(s3, tmp_path, cache_dir):
    url = s3.bucket("tiny-cache")
    run = tmp_path / "run"
    proc = phalanx(*remote_run(run, tmp_path / "c", url), "data.cache_limit_gb=0.0002", "--nproc-per-node", 2,
                   timeout=180)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()
    assert len(line) == 1 and "config key 'data.cache_limit_gb': 0.0002 GB cannot hold the lookahead" in line[0]
    assert "the 11 largest shards" in line[0] and "raise it to at least 0.000" in line[0]
    assert not (run / "metrics.jsonl").exists()  # no worker started


# ---- several nodes ----------------------------------------------------------------------------------
def objects(s3, prefix: str) -> dict[str, bytes]:
    """Every object under a prefix by its name there; an index without its times and summary."""
    out = {}
    s3.fs.invalidate_cache()  # s3fs answers from listings it kept
    for path in s3.fs.find(prefix):
        data = s3.fs.cat_file(path)
        if path.endswith("/index.json"):
            index = json.loads(data)
            data = json.dumps({k: v for k, v in index.items() if k not in ("created", "summary")}).encode()
        out[path[len(prefix.removeprefix("s3://")):]] = data
    return out


@pytest.mark.slow  # ~17 s
def test_two_launchers_split_the_preparation_and_make_the_one_node_store(s3, tok, tmp_path):
    """Two `phalanx prepare` at once (two nodes: a cache each, one store): each encodes a share of the
    pieces (claimed in the store), and the store equals one node's preparation byte for byte."""
    url = s3.bucket("split")
    common = ["prepare", f"data.train={SHAKESPEARE}", f"data.tokenizer={tok}", "data.shard_mb=0.01",
              "data.val_fraction=0", "--workers", "1", "--quiet"]
    procs = [subprocess.Popen([sys.executable, "-m", "phalanx", *common, f"data.store_url={url}/two",
                               f"data.cache_dir={tmp_path / f'node{i}'}"], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outputs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    shares = [int(out.split("encoded_here ")[1].split(";")[0]) for out, _ in outputs]
    one = phalanx(*common, f"data.store_url={url}/one", f"data.cache_dir={tmp_path / 'single'}", check=True)
    shards = int(one.stdout.split(" shard(s)")[0].rsplit(" ", 1)[1])
    assert sum(shares) == shards > 50 and min(shares) > 0, shares  # split, nothing prepared twice
    two, single = objects(s3, f"{url}/two"), objects(s3, f"{url}/one")
    assert two.keys() == single.keys() and len(two) > 2 * shards
    assert all(two[k] == single[k] for k in two)


def start(args: list) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "phalanx", *map(str, args)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(procs: list[subprocess.Popen], timeout: float = 300) -> list[str]:
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * len(procs), "\n----\n".join(o[-3000:] for o in outputs)
    return outputs


@pytest.mark.slow
def test_two_launchers_as_two_nodes_share_the_store_with_a_cache_each(s3, tmp_path, local_windowed):
    """Two nodes on this machine (one launcher and one cache each), one remote store: the run of the
    local store, bit for bit (one thread per worker: REFERENCE)."""
    from phalanx.core.dist import free_port

    url, run, port = s3.bucket("two-nodes"), tmp_path / "run", free_port()
    nodes = ["--nnodes", 2, "--nproc-per-node", 1, "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"r{port}"]
    finish([start([*remote_run(run, tmp_path / f"node{i}", url), *nodes]) for i in range(2)])
    same_run(run, local_windowed)
    for i in range(2):  # each node's workers read through their own cache
        assert list(cache_folder(tmp_path / f"node{i}").glob("*.bin"))


@pytest.mark.slow
def test_a_run_killed_on_2_processes_resumes_on_3_in_the_same_order(s3, tmp_path, cache_dir):
    """Resumed on another world size from the remote store, the run continues the same sample order:
    the local store's uninterrupted run, to float tolerance (3 processes sum in another order)."""
    url, run = s3.bucket("resume"), tmp_path / "run"
    wide = ["train.global_batch_size=24"]
    local = tmp_path / "local"
    phalanx(*lm_args(local, cache_dir, *REFERENCE, *SMALL_SHARDS, *wide, "data.order=windowed"),
            "--nproc-per-node", 2, check=True, timeout=240)
    first = phalanx(*remote_run(run, tmp_path / "c", url, *wide, "debug.fault=kill:rank=1:step=7"),
                    "--nproc-per-node", 2, timeout=240)
    assert first.returncode == 1, first.stderr[-3000:]
    second = phalanx(*remote_run(run, tmp_path / "c", url, *wide), "--nproc-per-node", 3, check=True, timeout=240)
    assert "resumed from" in second.stdout and "world size 3" in second.stdout
    same_run(run, local, rel=1e-5)


@pytest.mark.slow
def test_a_node_killed_while_preparing_leaves_work_the_rerun_picks_up(s3, tok, tmp_path):
    """SIGKILL mid-way: the shards it finished stay in the store and are not encoded again, its claims
    (a dead process on this host) are taken over, and the store equals one uninterrupted preparation."""
    import os
    import signal
    import time

    url = s3.bucket("killed-prepare")
    common = ["prepare", f"data.train={SHAKESPEARE}", f"data.tokenizer={tok}", "data.shard_mb=0.01",
              "data.val_fraction=0", "--workers", "1", "--quiet"]
    args = [*common, f"data.store_url={url}/store", f"data.cache_dir={tmp_path / 'node'}"]
    victim = subprocess.Popen([sys.executable, "-m", "phalanx", *args], cwd=REPO, stdout=subprocess.PIPE, text=True)
    def records() -> int:  # shard records in the store (written after their shard's arrays)
        s3.fs.invalidate_cache()
        return len([p for p in s3.fs.find(f"{url}/store") if "/store-" in p and p.endswith(".json")])
    deadline = time.time() + 120
    while time.time() < deadline and victim.poll() is None and records() < 30:
        time.sleep(0.05)
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    done = records()
    assert victim.returncode == -signal.SIGKILL and not any(p.endswith("index.json") for p in s3.fs.find(url))
    rerun = phalanx(*args, check=True)
    one = phalanx(*common, f"data.store_url={url}/one", f"data.cache_dir={tmp_path / 'one'}", check=True)
    shards = int(one.stdout.split(" shard(s)")[0].rsplit(" ", 1)[1])
    assert int(rerun.stdout.split("encoded_here ")[1].split(";")[0]) == shards - done  # nothing twice
    store, single = objects(s3, f"{url}/store"), objects(s3, f"{url}/one")
    assert store.keys() == single.keys() and all(store[k] == single[k] for k in store)  # nothing lost
