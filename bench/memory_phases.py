"""Memory per rank by phase of a run, against the memory plan: where a run's private memory peaks (build,
first step, steps, evaluation, checkpoint, export; summary.json's private_peak_mb/*, run/memphases.py),
each rank's private peak sampled from outside (RssAnon every 0.05 s), and the plan's figure (the launcher's
line), for several world sizes of one config. Each run under a cgroup memory limit (bench/big_models.py).

    python bench/memory_phases.py --pretrained FOLDER --worlds 2,3,4 [--task lm] [--block 64] [--steps 2]
        [--limit-gb 12] [key=value ...]
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from big_models import run_limited

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "wikitext2" / "validation.txt"
PHASES = ("build", "first_step", "steps", "eval", "checkpoint", "export")


def run_one(work: Path, world: int, args, extra: list[str]) -> dict:
    run = work / f"w{world}"
    shutil.rmtree(run, ignore_errors=True)
    cmd = [sys.executable, "-m", "phalanx", "train", f"task={args.task}", f"data.train={args.data}",
           f"data.cache_dir={work / 'cache'}", f"model.block_size={args.block}", "train.micro_batch_size=1",
           f"train.global_batch_size={world}", f"train.max_steps={args.steps}", "train.log_every=1",
           "train.eval_every=0", f"train.eval_max_samples={world}", "train.warmup_steps=1", "log.progress=off",
           "resume=never", "train.memory_check=warn", "--run-dir", str(run), "--nproc-per-node", str(world),
           *([f"model.pretrained={args.pretrained}"] if args.pretrained else []), *extra]
    done = run_limited(cmd, f"phalanx-phases-{world}", args.limit_gb)
    out, peaks, planned = done.out, done.peaks, done.planned_gb
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
    result = {"world": world, "ok": done.code == 0, "wall_s": round(done.seconds, 1), "planned_gb": planned,
              "sampled_private_gb": [round(peaks[r] / 2 ** 30, 3) for r in sorted(peaks) if r >= 0],
              "phases_gb": {p: [round(v / 1024, 3) for v in summary.get(f"private_peak_mb/{p}", [])] for p in PHASES},
              "parameters": summary.get("parameters"), "tail": "" if done.code == 0 else out[-1500:]}
    shutil.rmtree(run / "checkpoints", ignore_errors=True)
    shutil.rmtree(run / "final", ignore_errors=True)
    return result


def table(results: list[dict]) -> str:
    head = "| W | ok | " + " | ".join(f"{p} GB" for p in PHASES) + \
        " | whole / steps | sampled private GB | planned GB | plan / peak |"
    lines = [head, "|" + "---|" * (len(PHASES) + 6)]
    for r in results:
        ph = r["phases_gb"]
        cols = [" / ".join(f"{v:.2f}" for v in ph.get(p, [])) or "-" for p in PHASES]
        steps = max(ph.get("steps") or ph.get("first_step") or [0])
        whole = max((max(v) for v in ph.values() if v), default=0)
        sampled = max(r["sampled_private_gb"], default=0)
        ratio = f"{whole / steps:.3f}" if steps else "-"
        plan = f"{r['planned_gb'] / sampled:.2f}" if sampled and r["planned_gb"] else "-"
        lines.append(f"| {r['world']} | {'yes' if r['ok'] else 'NO'} | " + " | ".join(cols) + f" | {ratio} | "
                     f"{' / '.join(map(str, r['sampled_private_gb'])) or '-'} | {r['planned_gb']} | {plan} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pretrained", default="")
    p.add_argument("--task", default="lm")
    p.add_argument("--data", default=str(DATA))
    p.add_argument("--worlds", default="2,3,4")
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--limit-gb", type=float, default=12.0)
    p.add_argument("--work", default=None)
    args, extra = p.parse_known_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="phalanx-phases-"))
    results = []
    for world in [int(w) for w in args.worlds.split(",")]:
        r = run_one(work, world, args, extra)
        results.append(r)
        print(json.dumps(r), flush=True)
    (work / "phases.json").write_text(json.dumps(results, indent=1))
    print(f"\n{args.task}, block {args.block}, micro-batch 1, {args.steps} steps, limit {args.limit_gb} GB per run "
          f"(shared 2-core machine); private memory per rank (ranks separated by /)\n")
    print(table(results))


if __name__ == "__main__":
    main()
