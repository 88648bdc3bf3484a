"""Padding benchmark: length-grouped vs plain shuffled batches on SST-2 (not a test; prints a table).

    python bench/padding.py [--data ../shared/data/sst2] [--rows 8000] [--rounds 2] [--steps 60] [--nproc 2]

Trains a small BERT-style encoder (examples/sst2.yaml with a smaller model) on the first --rows rows of
SST-2 train, alternating runs with data.group_by_length on and off so that a change in machine load
hits both alike, and reads `pad_fraction` and `useful_tokens_per_s` (non-padding tokens per second)
from each run's metrics.jsonl. The first logged window of each run is dropped (warm-up).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = ["model.n_layer=2", "model.n_head=2", "model.n_embd=128", "data.vocab_size=4096", "model.dropout=0.0",
         "train.micro_batch_size=32", "train.global_batch_size=64", "train.warmup_steps=10", "train.log_every=10",
         "train.eval_every=0", "train.eval_max_samples=64", "log.progress=off"]


def run_once(args, train: Path, grouped: bool, run_dir: Path, cache: Path) -> dict:
    cmd = [sys.executable, "-m", "phalanx", "train", str(REPO / "examples" / "sst2.yaml"), f"data.train={train}",
           f"data.validation={Path(args.data) / 'validation.jsonl'}", f"data.cache_dir={cache}", *MODEL,
           f"train.max_steps={args.steps}", f"data.group_by_length={str(grouped).lower()}",
           "--run-dir", str(run_dir), "--nproc-per-node", str(args.nproc)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"run failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    windows = [m for m in lines if "pad_fraction" in m][1:]  # drop the warm-up window
    return {"grouped": grouped, "pad_fraction": statistics.mean(m["pad_fraction"] for m in windows),
            "useful_tokens_per_s": statistics.mean(m["useful_tokens_per_s"] for m in windows),
            "tokens_per_s": statistics.mean(m["tokens_per_s"] for m in windows),
            "step_time_s": statistics.mean(m["step_time_s"] for m in windows)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "sst2"),
                   help="folder with train.jsonl and validation.jsonl")
    p.add_argument("--rows", type=int, default=8000, help="first N rows of SST-2 train")
    p.add_argument("--rounds", type=int, default=2, help="pairs of runs (grouped, plain), alternating")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per run")
    p.add_argument("--nproc", type=int, default=2, help="processes per run")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="phalanx-padding-") as tmp:
        tmp = Path(tmp)
        train = tmp / "train.jsonl"
        lines = (Path(args.data) / "train.jsonl").read_text(encoding="utf-8").splitlines()[:args.rows]
        train.write_text("\n".join(lines) + "\n", encoding="utf-8")
        results = []
        for r in range(args.rounds):
            for grouped in ((True, False) if r % 2 == 0 else (False, True)):
                results.append(run_once(args, train, grouped, tmp / f"run-{r}-{grouped}", tmp / "cache"))
                print(f"  round {r} grouped={grouped!s:5} done", file=sys.stderr, flush=True)
    print(f"SST-2 first {args.rows} train rows, {args.nproc} processes, {args.steps} steps/run, micro 32, "
          f"global 64, BERT 2x128\n")
    print("| run | grouping | pad_fraction | useful tokens/s | tokens/s | step time (s) |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for i, r in enumerate(results):
        print(f"| {i} | {'on' if r['grouped'] else 'off'} | {r['pad_fraction']:.3f} | {r['useful_tokens_per_s']:.0f} | "
              f"{r['tokens_per_s']:.0f} | {r['step_time_s']:.3f} |")
    mean = {g: {k: statistics.mean(r[k] for r in results if r["grouped"] == g) for k in ("pad_fraction",
                                                                                       "useful_tokens_per_s")}
            for g in (True, False)}
    on, off = mean[True], mean[False]
    print(f"\nmean pad_fraction: grouped {on['pad_fraction']:.3f}, plain {off['pad_fraction']:.3f}; mean useful "
          f"tokens/s: grouped {on['useful_tokens_per_s']:.0f}, plain {off['useful_tokens_per_s']:.0f} "
          f"({on['useful_tokens_per_s'] / off['useful_tokens_per_s']:.2f}x)")


if __name__ == "__main__":
    main()
