"""Sweep throughput: 8 tiny trials run as a shell loop of `phalanx train`, as `phalanx sweep --parallel 1` and
as `phalanx sweep --parallel 2`: trials per hour, CPU utilisation, and the sweep's own cost per trial.

The trials: a grid of train.lr (4 values) x model.n_layer (1, 2) on Tiny Shakespeare with a tiny model
(width 64, block 32), 1 process each, the token store built once beforehand. CPU utilisation is the
machine's mean busy share of all cores, sampled every 0.5 s. The sweep's cost per trial is its wall time
minus the sum of its trials' own wall times (start, Optuna, following metrics), over the 8 trials.

    python bench/sweep.py [--steps 30]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import yaml

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
LRS, LAYERS = [1e-3, 2e-3, 3e-3, 4e-3], [1, 2]


def overrides(cache: Path, steps: int) -> list[str]:
    return [f"data.train={DATA}", f"data.cache_dir={cache}", "model.n_head=2", "model.n_embd=64", "model.block_size=32",
            "data.vocab_size=512", "train.micro_batch_size=4", "train.global_batch_size=16", f"train.max_steps={steps}",
            "train.warmup_steps=2", "train.eval_every=0", "train.eval_max_samples=64", "train.log_every=10",
            "log.progress=off"]


def measured(cmd: list[str]) -> tuple[float, float]:
    """Wall seconds of `cmd` and the machine's mean CPU busy % while it ran."""
    samples, done = [], threading.Event()

    def sample():
        psutil.cpu_percent(None)
        while not done.wait(0.5):
            samples.append(psutil.cpu_percent(None))

    thread = threading.Thread(target=sample)
    thread.start()
    t0 = time.time()
    subprocess.run(cmd, check=True, capture_output=True, cwd=REPO)
    wall = time.time() - t0
    done.set()
    thread.join()
    return wall, statistics.fmean(samples) if samples else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="phalanx-bench-sweep-"))
    base = overrides(work / "cache", a.steps)
    phalanx = [sys.executable, "-m", "phalanx"]
    subprocess.run([*phalanx, "prepare", *base, "--quiet"], check=True, capture_output=True, cwd=REPO)
    loop = " ; ".join(f"{' '.join(phalanx)} train {' '.join(base)} train.lr={lr} model.n_layer={n} "
                      f"--run-dir {work}/loop/{lr}-{n} > /dev/null 2>&1" for lr in LRS for n in LAYERS)
    sweep_file = work / "bench-sweep.yaml"
    sweep_file.write_text(yaml.safe_dump({"overrides": base, "space": {"train.lr": LRS, "model.n_layer": LAYERS},
                                          "metric": "eval/loss", "sampler": "grid"}))
    rows = []
    for name, cmd in [("shell loop of phalanx train", ["bash", "-c", loop]),
                      ("phalanx sweep --parallel 1", [*phalanx, "sweep", str(sweep_file), "--parallel", "1",
                                                      "--out", str(work / "p1")]),
                      ("phalanx sweep --parallel 2", [*phalanx, "sweep", str(sweep_file), "--parallel", "2",
                                                      "--out", str(work / "p2")])]:
        wall, cpu = measured(cmd)
        out = work / ("p1" if "parallel 1" in name else "p2")
        trials = [json.loads(x) for x in (out / "trials.jsonl").read_text().splitlines()] if "sweep" in name else []
        assert not trials or [t["state"] for t in trials] == ["COMPLETE"] * 8, trials
        own = (wall - sum(t["wall_time_s"] for t in trials)) / 8 if "parallel 1" in name else None
        rows.append((name, wall, 8 / wall * 3600, cpu, own))
    loop_wall = rows[0][1]
    print("\n| how | wall s | trials/hour | CPU busy % (all cores) | sweep's own s per trial | vs loop |")
    print("|---|---|---|---|---|---|")
    for name, wall, per_hour, cpu, own in rows:
        print(f"| {name} | {wall:.1f} | {per_hour:.0f} | {cpu:.0f} | {'-' if own is None else f'{own:.2f}'} | "
              f"{loop_wall / wall:.2f}x |")
    print(f"\n(8 trials of {a.steps} steps, 1 process each; {psutil.cpu_count()} cores; work folder {work})")


if __name__ == "__main__":
    main()
