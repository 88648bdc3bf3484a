"""The windowed order follows the training store's shard plan: a checkpoint records the plan, and a resume on a
store cut into other shards (another data.shard_mb) is refused under that order (it would repeat or skip samples
of the epoch under way), while the global order, old checkpoints and --force-resume resume as before."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from conftest import lm_args, phalanx

from phalanx.core.config import ConfigError, load_config
from phalanx.data.samplers import GlobalBatchSampler, ShardPlan, windowed_order
from phalanx.tasks import prepare_data
from phalanx.tools.launch import preflight

WINDOWED = ["data.order=windowed", "data.order_window=2", "dist.threads_per_worker=1", "dist.backend=gloo",
            "train.checkpoint_every=2"]


def test_another_shard_plan_changes_the_windowed_order_mid_epoch():
    """Why: half an epoch under one plan and the rest under another is not the epoch's samples once each."""
    n, span = 4000, lambda i: (np.asarray(i) * 10, np.asarray(i) * 10 + 11)  # samples of 10 tokens
    orders = [GlobalBatchSampler(n, 100, 10, seed=0, order=windowed_order(ShardPlan(n, span, cuts), 2))
              for cuts in (np.arange(0, 40001, 1000), np.arange(0, 40001, 2000))]
    epoch = np.concatenate([orders[0].stream(0, n // 2), orders[1].stream(n // 2, n - n // 2)])
    assert len(np.unique(epoch)) < n  # repeated (and so skipped) samples
    assert np.array_equal(np.sort(orders[0].stream(0, n)), np.arange(n))  # one plan: each once


@pytest.fixture(scope="module")
def windowed_run(tmp_path_factory, cache_dir):
    """4 steps of the windowed order on a local store of ~0.05 MB shards, checkpoints at steps 2 and 4."""
    run = tmp_path_factory.mktemp("windowed")
    phalanx(*lm_args(run, cache_dir, *WINDOWED, "train.max_steps=4", "data.shard_mb=0.05"), check=True, timeout=240)
    return run


def test_a_resume_on_another_shard_plan_is_refused_under_the_windowed_order(windowed_run, cache_dir):
    proc = phalanx(*lm_args(windowed_run, cache_dir, *WINDOWED, "train.max_steps=6", "data.shard_mb=0.1"),
                   timeout=240)
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])  # was 0: resumed
    meta = json.loads((windowed_run / "checkpoints" / "step_000004" / "meta.json").read_text())
    assert meta["shard_plan"]["shard_mb"] == 0.05 and len(meta["shard_plan"]["digest"]) == 16
    assert meta["train_state"]["data_order"] == 4
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "data.shard_mb=0.05" in lines[0] and "--fresh" in lines[0], proc.stderr
    assert "repeat or skip samples" in lines[0] and not (windowed_run / "checkpoints" / "step_000006").exists()


def _cfg(run, cache_dir, *extra):
    return load_config(None, [a for a in lm_args(run, cache_dir, *WINDOWED, *extra) if a not in ("train", "--run-dir")
                              and a != str(run)] + [f"run_dir={run}"])


def test_the_same_plan_the_global_order_old_checkpoints_and_force_resume_still_resume(windowed_run, cache_dir,
                                                                                      tmp_path):
    """The launcher's checks in this process (preflight, the data step, the plan), on copies of the checkpoint."""
    from phalanx.tools.launch import check_shard_plan

    same, other = (_cfg(windowed_run, cache_dir, f"data.shard_mb={mb}") for mb in (0.05, 0.1))
    prepare_data(other, progress=False)
    check_shard_plan(same)  # the plan it was made with
    with pytest.raises(ConfigError, match="data.shard_mb=0.05"):
        check_shard_plan(other)
    check_shard_plan(other, force_resume=True)
    step = windowed_run / "checkpoints" / "step_000004"
    for name, change in (("global", lambda m: {**m, "train_state": {**m["train_state"], "data_order": 3},
                                               "config": {**m["config"], "data.order": "global"}}),
                         ("old", lambda m: {k: v for k, v in m.items() if k != "shard_plan"})):
        copy = tmp_path / name / "checkpoints" / "step_000004"
        shutil.copytree(step, copy)
        (copy / "meta.json").write_text(json.dumps(change(json.loads((step / "meta.json").read_text()))))
        order = ["data.order=global"] if name == "global" else []
        cfg = _cfg(tmp_path / name, cache_dir, "data.shard_mb=0.1", *order)
        preflight(cfg, 1, "1")  # the settings recorded: the same
        check_shard_plan(cfg)  # and the plan: not the order's concern, or not recorded
