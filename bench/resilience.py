"""Checkpoint cost and elastic-restart time for the benchmark model at 2 processes, repeated.

Each repetition trains the examples/shakespeare.yaml model (GPT-2, 4x256, block 128, vocab 4096) at
2 processes with a checkpoint every 5 steps; rank 1 SIGKILLs itself at the start of step 6 on the
first attempt, and `--max-restarts 1` must bring the run to step 10. Reported per repetition: exit
code and wall time (a hang would show as a timeout), checkpoint save time, size, load time on resume,
and restart time = from the death (right after the step-5 checkpoint) to the end of the first step
after resume, minus that step's own duration.

    python bench/resilience.py [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"


def once(work: Path, cache: Path, timeout: float) -> dict:
    run = Path(tempfile.mkdtemp(dir=work))
    cmd = [sys.executable, "-m", "phalanx", "train", str(REPO / "examples" / "shakespeare.yaml"),
           f"data.train={DATA}", f"data.cache_dir={cache}", "train.max_steps=10", "train.log_every=1",
           "train.eval_every=0", "train.checkpoint_every=5", "train.eval_max_samples=16", "log.progress=off",
           "debug.fault=kill:rank=1:step=6", "--nproc-per-node", "2", "--max-restarts", "1", "--run-dir", str(run)]
    t0 = time.time()
    try:
        code = subprocess.run(cmd, capture_output=True, timeout=timeout, cwd=REPO).returncode
    except subprocess.TimeoutExpired:
        return {"exit": "TIMEOUT (hang)", "wall_s": timeout}
    wall = time.time() - t0
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    ckpt5 = next(m for m in lines if m.get("event") == "checkpoint" and m["step"] == 5)
    resumed = next(m for m in lines if m.get("event") == "resumed")
    step6 = next(m for m in lines if m.get("step") == 6 and "loss" in m)
    size = sum(f.stat().st_size for f in (run / "checkpoints" / "step_000010").rglob("*") if f.is_file())
    return {"exit": code, "wall_s": wall, "save_s": ckpt5["checkpoint_s"], "load_s": resumed["load_s"],
            "size_mb": size / 2**20, "restart_s": step6["time_s"] - step6["step_time_s"] - ckpt5["time_s"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--timeout", type=float, default=300)
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="phalanx-resilience-"))
    cache = work / "cache"
    print(f"{'rep':>3}{'exit':>8}{'wall s':>9}{'save s':>9}{'load s':>9}{'size MB':>9}{'restart s':>11}")
    for i in range(a.repeats):
        r = once(work, cache, a.timeout)
        if "save_s" not in r:
            print(f"{i:>3}{r['exit']:>8}{r['wall_s']:>9.1f}")
            continue
        print(f"{i:>3}{r['exit']:>8}{r['wall_s']:>9.1f}{r['save_s']:>9.3f}{r['load_s']:>9.3f}{r['size_mb']:>9.1f}"
              f"{r['restart_s']:>11.2f}", flush=True)


if __name__ == "__main__":
    main()
