"""What phalanx's fixed per-step extras cost, one at a time, in a plain DDP loop on the classification model.

A plain loop (DDP, fused AdamW, the model's own loss) on examples/sst2.yaml's small BERT, 2 processes x 1
thread, the same synthetic batches in every variant (32 sequences, widths 8-27 tokens, like length-grouped
SST-2). Each variant adds one thing phalanx does every step:
  comm-hook  the Gloo DDP comm hook that times gradient communication (log.telemetry)
  sync       the step-start all-reduce of the target count and stop votes
  seed       torch.manual_seed per micro-batch (dropout masks independent of the world size)
  clip       clip_grad_norm_ to 1.0 (read back as a float, as phalanx logs it)
  own-loss   logits -> cross_entropy(sum) scaled by world / count, instead of the model's mean loss
  all        all of the above
Variants alternate within each repeat; the table gives the median step time and its ratio to plain.

    python bench/step_costs.py [--repeats 3] [--steps 60]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = ["plain", "comm-hook", "sync", "seed", "clip", "own-loss", "all"]
EXTRAS = ["comm-hook", "sync", "seed", "clip", "own-loss"]


def worker(variant: str, steps: int, warmup: int) -> None:
    import torch
    import torch.distributed as tdist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from phalanx.core.config import ModelConfig
    from phalanx.model.build import build_classifier
    from phalanx.run.telemetry import CommTimer

    on = set(EXTRAS) if variant == "all" else {variant}
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method="env://")
    rank, world = tdist.get_rank(), tdist.get_world_size()
    torch.manual_seed(0)
    model = build_classifier(ModelConfig(arch="bert", n_layer=4, n_head=4, n_embd=256, dropout=0.1), 8192, 0, 128,
                             {0: "negative", 1: "positive"})
    ddp = DDP(model, gradient_as_bucket_view=True)
    if "comm-hook" in on:
        CommTimer.attach(ddp, type("Info", (), {"backend": "gloo", "world_size": world})())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    gen = torch.Generator().manual_seed(rank)
    times = []
    for step in range(steps):
        width = 8 + (step * 7) % 20
        ids = torch.randint(5, 8000, (32, width), generator=gen)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
        labels = torch.randint(0, 2, (32,), generator=gen)
        t0 = time.perf_counter()
        if "sync" in on:
            tdist.all_reduce(torch.tensor([32.0, 32.0 * width, 32.0 * width, 0.0, 0.0], dtype=torch.float64))
        if "seed" in on:
            torch.manual_seed(1337 + step * 1000 + rank)
        if "own-loss" in on:
            logits = ddp(**batch).logits
            loss = F.cross_entropy(logits.float(), labels, reduction="sum") * (world / (32 * world))
        else:
            loss = ddp(**batch, labels=labels).loss
        loss.backward()
        if "clip" in on:
            float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        print(json.dumps({"variant": variant, "step_s": statistics.median(times[warmup:])}), flush=True)
    tdist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--worker", help=argparse.SUPPRESS)  # set when torchrun starts this file
    a = p.parse_args()
    if a.worker:
        return worker(a.worker, a.steps, a.warmup)
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)}
    results: dict[str, list[float]] = {}
    for _ in range(a.repeats):
        for variant in VARIANTS:
            out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                  "2", __file__, "--worker", variant, "--steps", str(a.steps), "--warmup",
                                  str(a.warmup)], check=True, capture_output=True, text=True, env=env).stdout
            line = json.loads(next(x for x in out.splitlines() if x.startswith("{")))
            results.setdefault(variant, []).append(line["step_s"])
    plain = statistics.median(results["plain"])
    print("\n| variant | median step ms | runs (ms) | vs plain |\n|---|---|---|---|")
    for variant, runs in results.items():
        med = statistics.median(runs)
        print(f"| {variant} | {med * 1e3:.1f} | {', '.join(f'{r * 1e3:.1f}' for r in runs)} | {med / plain - 1:+.1%} |")
    print(f"\n(2 processes x 1 thread; median over steps {a.warmup}-{a.steps} of each run, then over {a.repeats} "
          f"alternating runs)")


if __name__ == "__main__":
    main()
