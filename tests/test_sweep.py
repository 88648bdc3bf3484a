"""`phalanx sweep`: real sweeps of real `phalanx train` trials (tiny model, Tiny Shakespeare, Gloo)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, SHAKESPEARE, TINY_LM, metrics, phalanx, with_worker_zygote

from phalanx.core.config import ConfigError
from phalanx.core.runfolder import RunFolder
from phalanx.tools.sweep import _reason, plan_slots
from phalanx.tools.sweepspec import load_sweep


def write_sweep(tmp_path: Path, cache_dir: Path, name: str = "s", extra: list[str] = (), **fields) -> Path:
    overrides = [f"data.train={SHAKESPEARE}", f"data.cache_dir={cache_dir}", *TINY_LM, "train.max_steps=12",
                 "train.eval_every=4", "train.log_every=4", "log.progress=off", *extra]
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"overrides": overrides, "metric": "eval/loss", **fields}))
    return path


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]


def points(rs: list[dict]) -> set:
    return {json.dumps([r["params"], r["seed"]], sort_keys=True) for r in rs}


def started(stderr: str) -> list[int]:
    """Trial numbers this sweep process started (its 'sweep: trial N: ... -> FOLDER' lines)."""
    return [int(line.split()[2].rstrip(":")) for line in stderr.splitlines()
            if line.startswith("sweep: trial ") and " -> " in line]


def test_grid_of_four_two_at_a_time_completes_and_best_yaml_trains(tmp_path, cache_dir):
    path = write_sweep(tmp_path, cache_dir, space={"train.lr": [1e-3, 3e-3], "model.n_layer": [1, 2]}, parallel=2)
    out = tmp_path / "sw"
    proc = phalanx("sweep", path, "--out", out, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("sweep: trial ")]
    assert " -> " in lines[0] and " -> " in lines[1]  # two trials started before any ended: in parallel
    rs = rows(out)
    assert [r["state"] for r in rs] == ["COMPLETE"] * 4 and len(points(rs)) == 4
    for r in rs:
        run = Path(r["run_dir"])
        assert run.parent == out / "trials" and run.name == f"{r['number']:04d}"
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        assert cfg["train"]["lr"] == r["params"]["train.lr"] and cfg["model"]["n_layer"] == r["params"]["model.n_layer"]
        assert cfg["dist"]["threads_per_worker"] == max(1, len(os.sched_getaffinity(0)) // 2)  # cores split
        assert json.loads((run / "summary.json").read_text())["eval/loss"] == pytest.approx(r["value"])
        assert [int(s) for s in r["evals"]] == [4, 8, 12]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["counts"]["COMPLETE"] == 4 and summary["best"]["value"] == min(r["value"] for r in rs)
    best_run = tmp_path / "best-run"
    phalanx("train", out / "best.yaml", "train.max_steps=2", "--run-dir", best_run, check=True)
    best_lr = summary["best"]["params"]["train.lr"]
    assert yaml.safe_load((best_run / "config.yaml").read_text())["train"]["lr"] == best_lr
    phalanx("report", out, check=True)
    assert len(list((out / "report").glob("*.png"))) == 3
    text = (out / "report.md").read_text()
    assert "Parameter importances" in text and f"| {summary['best']['number']} |" in text
    again = phalanx("sweep", path, "--out", out, check=True)  # nothing left: no trial runs twice
    assert started(again.stderr) == [] and len(rows(out)) == 4


@pytest.mark.slow  # ~30 s
def test_worse_lr_is_pruned_through_exit_75_and_a_nan_stop_is_fail(tmp_path, cache_dir):
    # sampler_seed 1: the grid hands out 3e-3 first, so the 1e-5 trial meets one finished trial
    path = write_sweep(tmp_path, cache_dir, space={"train.lr": [3e-3, 1e-5]}, sampler="grid", sampler_seed=1,
                       pruner={"type": "median", "startup_trials": 1, "warmup_steps": 0},
                       extra=["train.max_steps=120", "train.checkpoint_every=4"])
    out = tmp_path / "sw"
    proc = phalanx("sweep", path, "--out", out, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    good, bad = rows(out)
    assert good["params"]["train.lr"] == 3e-3 and good["state"] == "COMPLETE"
    # (enough steps that the SIGTERM lands long before the end: steps here take ~20 ms)
    assert bad["state"] == "PRUNED" and 4 <= bad["pruned_at_step"] < 120, bad
    assert json.loads((Path(bad["run_dir"]) / "PREEMPTED").read_text())["step"] >= 4  # the clean SIGTERM path
    assert "pruned at step" in proc.stderr

    nan = write_sweep(tmp_path, cache_dir, name="nan", space={"debug.fault": ["nan:rank=0:step=3"]},
                      extra=["train.nan_policy=stop"])
    proc = phalanx("sweep", nan, "--out", tmp_path / "nan-sw", timeout=300)
    assert proc.returncode == 1  # no trial completed
    (failed,) = rows(tmp_path / "nan-sw")
    assert failed["state"] == "FAIL" and failed["reason"].startswith("stopped: non-finite loss"), failed
    assert failed["reason"] == json.loads((Path(failed["run_dir"]) / "outcome.json").read_text())["line"]


def test_the_reason_is_the_launchers_outcome_line_else_the_consoles_last(tmp_path):
    """The launcher's RUN/outcome.json written since the trial started; without one (a command refused
    before it started writes nothing there; a killed launcher) the console's last line, as it was."""
    log = tmp_path / "sweep-trial.log"
    log.write_text("phalanx: rank 1 (pid 9) killed by SIGKILL; no restarts left (--max-restarts 0)\n"
                   "phalanx: training failed: rank 1 (pid 9) killed by SIGKILL\n")
    RunFolder(tmp_path).write_outcome("failed", 1, "training failed: rank 1 (pid 9) killed by SIGKILL", 6)
    assert _reason(tmp_path, 1, since=time.time() - 60) == "training failed: rank 1 (pid 9) killed by SIGKILL"
    log.write_text("... a traceback\nphalanx: error: train.lr: expected a number > 0, got -1\n")
    assert _reason(tmp_path, 2, since=time.time() + 60) == "error: train.lr: expected a number > 0, got -1"  # stale
    RunFolder(tmp_path).outcome_file.unlink()
    assert _reason(tmp_path, 2, since=0) == "error: train.lr: expected a number > 0, got -1"
    log.write_text("Killed\n")
    assert _reason(tmp_path, 137, since=0) == "exit code 137: Killed"


@pytest.mark.slow  # ~30 s
def test_ctrl_c_stops_cleanly_and_the_same_command_resumes(tmp_path, cache_dir):
    """2-process trials; SIGINT to the sweep's process group mid-trial; the rerun resumes that trial from
    its checkpoint (same number and folder) and completes the rest, no trial twice."""
    path = write_sweep(tmp_path, cache_dir, space={"train.lr": [2e-3, 3e-3]}, nproc_per_trial=2,
                       extra=["train.max_steps=40", "train.checkpoint_every=4", "train.eval_every=8"])
    out = tmp_path / "sw"
    proc = subprocess.Popen([sys.executable, "-m", "phalanx", "sweep", str(path), "--out", str(out)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=with_worker_zygote({**os.environ, "PYTHONUNBUFFERED": "1"}))
    deadline = time.time() + 120
    while time.time() < deadline:
        runs = list((out / "trials").glob("*/metrics.jsonl")) if (out / "trials").exists() else []
        if runs and any(m.get("step", 0) >= 6 for m in metrics(runs[0].parent)):
            break
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 75, err[-3000:]
    (stopped,) = [r for r in rows(out) if r["state"] == "RUNNING"]
    assert stopped["interrupted"] and "resume when the same command runs again" in err

    again = phalanx("sweep", path, "--out", out, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    rs = rows(out)
    assert sorted(r["number"] for r in rs) == [0, 1] and [r["state"] for r in rs] == ["COMPLETE"] * 2
    assert len(points(rs)) == 2 and f"sweep: trial {stopped['number']} (resumed)" in again.stderr
    resumed = [m for m in metrics(stopped["run_dir"]) if m.get("event") == "resumed"]
    assert len(resumed) == 1 and resumed[0]["step"] >= 4
    for r in rs:  # both ranks of a trial ran the parameters the sweep chose
        summary = json.loads((Path(r["run_dir"]) / "summary.json").read_text())
        assert summary["world_size"] == 2 and summary["steps"] == 40
        saved = yaml.safe_load((Path(r["run_dir"]) / "config.yaml").read_text())
        assert saved["train"]["lr"] == r["params"]["train.lr"]


@pytest.mark.slow  # ~40 s
def test_two_sweep_processes_split_one_study(tmp_path, cache_dir):
    path = write_sweep(tmp_path, cache_dir, space={"train.lr": [1e-3, 2e-3, 3e-3, 4e-3]}, extra=["train.max_steps=8"])
    out = tmp_path / "sw"
    cmd = [sys.executable, "-m", "phalanx", "sweep", str(path), "--out", str(out)]
    procs = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=with_worker_zygote({**os.environ, "PYTHONUNBUFFERED": "1"})) for _ in range(2)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    rs = rows(out)
    assert len(rs) == 4 and [r["state"] for r in rs] == ["COMPLETE"] * 4 and len(points(rs)) == 4
    first, second = (started(e) for e in errs)
    assert first and second and not set(first) & set(second)  # both worked, never on the same trial
    assert sorted(first + second) == sorted(r["number"] for r in rs)


@pytest.mark.slow  # ~12 s
def test_seeds_repeat_each_configuration_and_the_report_ranks_by_the_mean(tmp_path, cache_dir):
    path = write_sweep(tmp_path, cache_dir, space={"train.lr": [3e-3]}, seeds=[1, 2], parallel=2,
                       extra=["train.max_steps=8"])
    out = tmp_path / "sw"
    phalanx("sweep", path, "--out", out, "--trials", 5, check=True, timeout=300)  # capped at grid x seeds = 2
    rs = rows(out)
    assert sorted(r["seed"] for r in rs) == [1, 2] and {r["params"]["train.lr"] for r in rs} == {3e-3}
    losses = {r["seed"]: r["value"] for r in rs}
    assert losses[1] != losses[2]  # the seed reached the trials (init and data order differ)
    for r in rs:
        assert yaml.safe_load((Path(r["run_dir"]) / "config.yaml").read_text())["train"]["seed"] == r["seed"]
    (config,) = json.loads((out / "summary.json").read_text())["configs"]
    assert config["n"] == 2 and config["mean"] == pytest.approx((losses[1] + losses[2]) / 2)
    phalanx("report", out, check=True)
    assert "Configurations over seeds" in (out / "report.md").read_text()


@pytest.mark.parametrize("space,fields,message", [
    ({"train.lrr": [1e-3]}, {}, "space.train.lrr=0.001: unknown config key"),
    ({"train.lr": {"type": "uniform", "low": 1e-3, "high": 1e-4}}, {}, "space.train.lr: expected low < high"),
    ({"train.lr": {"type": "loguniform", "low": 1e-4, "high": 1e-2}}, {"sampler": "grid"}, "ranges need random or tpe"),
    ({"train.lr": {"type": "normal"}}, {}, "with type one of choice, int, uniform, loguniform"),
    ({"train.lr": [1e-3]}, {"metric": "eval/accuracy"}, "metric: expected one of eval/loss, eval/ppl (task lm)"),
    ({"train.lr": [1e-3]}, {"pruner": {"type": "median", "patience": 3}}, "pruner (median): expected settings among"),
    ({"train.lr": [1e-3]}, {"seeds": [1, 1]}, "seeds: expected a list of distinct non-negative integers"),
    ({"train.lr": [1e-3]}, {"parallel": 0}, "parallel: expected a positive integer"),
    ({"train.lr": [1e-3]}, {"tirals": 3}, "unknown key(s) tirals"),
])
def test_bad_sweep_files_are_one_clear_line(tmp_path, cache_dir, space, fields, message):
    path = write_sweep(tmp_path, cache_dir, space=space, **fields)
    with pytest.raises(ConfigError, match=None) as e:
        load_sweep(path)
    assert message in str(e.value) and str(path) in str(e.value)


def test_bad_sweep_is_exit_2_before_any_trial_and_oversubscription_is_refused(tmp_path, cache_dir):
    out = tmp_path / "sw"
    proc = phalanx("sweep", write_sweep(tmp_path, cache_dir, space={"model.n_layer": [1, 0]}), "--out", out)
    assert proc.returncode == 2 and "space.model.n_layer=0" in proc.stderr and not out.exists()
    big = write_sweep(tmp_path, cache_dir, name="big", space={"train.lr": [1e-3]}, parallel=64, nproc_per_trial=64)
    proc = phalanx("sweep", big, "--out", out)
    assert proc.returncode == 2 and "parallel 64 x nproc_per_trial 64 = 4096 processes" in proc.stderr
    assert not out.exists()
    slots = plan_slots(load_sweep(big), gpus=[], oversubscribe=True)
    assert len(slots) == 64 and all(s.threads >= 1 for s in slots)
