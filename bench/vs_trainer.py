"""phalanx vs the Transformers Trainer: classification and language model, defaults and the same math.

Same machine, same process count and threads, same model architecture and tokenizer (the Trainer side
reads them from a phalanx run's final/ folder), same data, micro-batch and global batch:
  classify  SST-2 first --rows rows, examples/sst2.yaml's small BERT (4 x 256, WordPiece 8192, max length
            128), micro 32, global 64
  lm        Tiny Shakespeare, examples/shakespeare.yaml's GPT-2 (4 x 256, BPE 4096, block 128), micro 8,
            global 32
Sides, run alternately (every repeat runs each side once, in turn, so machine drift hits all alike):
  phalanx            phalanx's defaults for the example (classify: length-grouped batches; fused AdamW;
                     clip 1.0) -- these are also its same-math settings
  phalanx-telem-off  the same with log.telemetry=false (what the per-rank accounting costs)
  trainer            the Trainer's defaults (classify: random order + dynamic padding; fused AdamW; clip 1.0)
  trainer-grouped    classify only: train_sampling_strategy="group_by_length", the same math as phalanx
Useful tokens/s (non-padding tokens of the global batches) and step time come from wall clocks: phalanx's
metrics.jsonl line times, the Trainer's per-step callback times; the first --warmup steps are not timed.
Medians over --repeats runs.

    python bench/vs_trainer.py [--repeats 3] [--tasks classify,lm] [--nproc 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
TASKS = {
    "classify": {"yaml": "sst2.yaml", "steps": 70, "micro": 32, "global": 64, "lr": 5e-4, "warmup": 100,
                 "weight_decay": 0.01, "beta2": 0.999,
                 "sides": ["phalanx", "phalanx-telem-off", "trainer", "trainer-grouped"]},
    "lm": {"yaml": "shakespeare.yaml", "steps": 40, "micro": 8, "global": 32, "lr": 1e-3, "warmup": 50,
           "weight_decay": 0.1, "beta2": 0.95, "sides": ["phalanx", "phalanx-telem-off", "trainer"]},
}


def run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env(1))
    if proc.returncode:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")


def env(threads: int) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}


def phalanx_cmd(task: str, spec: dict, data: dict, cache: Path, run: Path, steps: int, nproc: int, extra=()):
    return [sys.executable, "-m", "phalanx", "train", str(REPO / "examples" / spec["yaml"]), *data["phalanx"],
            f"data.cache_dir={cache}", f"train.max_steps={steps}", "train.log_every=10", "train.eval_every=0",
            "train.checkpoint_every=0", "train.eval_max_samples=64", "log.progress=off",
            f"train.micro_batch_size={spec['micro']}", f"train.global_batch_size={spec['global']}",
            "--nproc-per-node", str(nproc), "--run-dir", str(run), *extra]


def phalanx_rate(run: Path, warmup: int) -> dict:
    """Useful tokens/s over the log windows after `warmup` steps, on rank 0's line times (wall clock)."""
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    lines = [m for m in lines if "loss" in m and "event" not in m]
    first = next(m for m in lines if m["step"] >= warmup)
    later = [m for m in lines if m["step"] > first["step"]]
    n = later[0]["step"] - first["step"]  # steps per window
    useful = sum(m["useful_tokens_per_s"] * m["step_time_s"] * n for m in later)
    tokens = sum(m["tokens_per_s"] * m["step_time_s"] * n for m in later)
    wall = later[-1]["time_s"] - first["time_s"]
    return {"useful_tps": useful / wall, "step_s": wall / (later[-1]["step"] - first["step"]),
            "pad": 1 - useful / tokens}


def trainer_rate(prefix: Path, nproc: int, warmup: int) -> dict:
    ranks = [[json.loads(x) for x in Path(f"{prefix}-{r}.jsonl").read_text().splitlines()] for r in range(nproc)]
    timed = [[m for m in rows if m["step"] > warmup] for rows in ranks]
    useful = sum(m["useful"] for rows in timed for m in rows)
    tokens = sum(m["tokens"] for rows in timed for m in rows)
    clock = {m["step"]: m["time_s"] for m in ranks[0]}
    wall = clock[timed[0][-1]["step"]] - clock[warmup]
    return {"useful_tps": useful / wall, "step_s": wall / len(timed[0]), "pad": 1 - useful / tokens}


def run_side(side: str, task: str, spec: dict, data: dict, work: Path, final: Path, nproc: int, warmup: int,
             k: int) -> dict:
    """One run of `side`; spec's optional "phalanx_extra" / "trainer_extra" are appended to that side's command."""
    out = work / f"{task}-{side}-{k}"
    if side.startswith("phalanx"):
        extra = ["log.telemetry=false"] if side == "phalanx-telem-off" else []
        extra += spec.get("phalanx_extra", [])
        run(phalanx_cmd(task, spec, data, work / "cache", out, spec["steps"], nproc, extra))
        return phalanx_rate(out, warmup)
    accum = spec["global"] // (spec["micro"] * nproc)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(REPO / "bench" / "trainer_side.py"), "--task", task, "--final", str(final),
           "--data", data["trainer"], "--micro", str(spec["micro"]), "--accum", str(accum),
           "--steps", str(spec["steps"]), "--lr", str(spec["lr"]), "--warmup", str(spec["warmup"]),
           "--weight-decay", str(spec["weight_decay"]), "--beta2", str(spec["beta2"]),
           "--out", str(out), "--work", str(work / "trainer-out"), *(["--group"] if side == "trainer-grouped" else []),
           *spec.get("trainer_extra", [])]
    run(cmd)
    return trainer_rate(out, nproc, warmup)


def task_data(task: str, work: Path, rows: int) -> dict:
    if task == "classify":
        train = work / "sst2-train.jsonl"
        with open(DATA / "sst2" / "train.jsonl") as src, open(train, "w") as dst:
            for _, line in zip(range(rows), src):
                dst.write(line)
        return {"phalanx": [f"data.train={train}", f"data.validation={DATA / 'sst2' / 'validation.jsonl'}"],
                "trainer": str(train)}
    text = DATA / "tinyshakespeare" / "input.txt"
    return {"phalanx": [f"data.train={text}"], "trainer": str(text)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tasks", default="classify,lm")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rows", type=int, default=8000, help="classify: SST-2 training rows")
    p.add_argument("--warmup", type=int, default=10, help="steps not timed")
    p.add_argument("--sides", default="", help="only these sides, e.g. phalanx,phalanx-telem-off (default: all)")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="phalanx-vs-trainer-"))
    results: dict = {}
    for task in a.tasks.split(","):
        spec, data = TASKS[task], task_data(task, work, a.rows)
        # Untimed: tokenizer, token store and a final/ folder whose config + tokenizer the Trainer reuses.
        prep = work / f"{task}-prep"
        run(phalanx_cmd(task, spec, data, work / "cache", prep, 2, a.nproc))
        for k in range(a.repeats):
            for side in [s for s in spec["sides"] if not a.sides or s in a.sides.split(",")]:
                r = run_side(side, task, spec, data, work, prep / "final", a.nproc, a.warmup, k)
                results.setdefault((task, side), []).append(r)
                print(f"{task} {side} run {k}: {r['useful_tps']:.0f} useful tok/s, {r['step_s']:.3f} s/step, "
                      f"pad {r['pad']:.3f}", flush=True)
    med = {key: {m: statistics.median(r[m] for r in runs) for m in ("useful_tps", "step_s", "pad")}
           for key, runs in results.items()}
    print("\n| task | side | useful tokens/s (median) | runs | step time s | pad fraction |\n|---|---|---|---|---|---|")
    for (task, side), m in med.items():
        runs = ", ".join(f"{r['useful_tps']:.0f}" for r in results[(task, side)])
        print(f"| {task} | {side} | {m['useful_tps']:.0f} | {runs} | {m['step_s']:.3f} | {m['pad']:.3f} |")
    print("\n| task | ratio | value |\n|---|---|---|")
    for task in a.tasks.split(","):
        ours = med[(task, "phalanx")]
        if (task, "trainer") not in med:  # --sides without the Trainer: only the telemetry cost
            off = med[(task, "phalanx-telem-off")]["step_s"]
            print(f"| {task} | telemetry cost: median step time on / off - 1 | "
                  f"{100 * (ours['step_s'] / off - 1):+.1f}% |")
            continue
        same = "trainer-grouped" if (task, "trainer-grouped") in med else "trainer"
        defaults = ours["useful_tps"] / med[(task, "trainer")]["useful_tps"]
        same_math = ours["useful_tps"] / med[(task, same)]["useful_tps"]
        print(f"| {task} | defaults: phalanx / trainer (useful tok/s) | {defaults:.2f}x |")
        print(f"| {task} | same math: phalanx / {same} (useful tok/s) | {same_math:.2f}x |")
        off = med[(task, "phalanx-telem-off")]["step_s"]
        print(f"| {task} | telemetry cost: median step time on / off - 1 | {100 * (ours['step_s'] / off - 1):+.1f}% |")
    print(f"\n({a.nproc} processes x 1 thread; median of {a.repeats} alternating runs; first {a.warmup} steps "
          f"untimed; work folder {work})")


if __name__ == "__main__":
    main()
