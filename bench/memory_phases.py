"""Memory per rank by phase of a run, against the memory plan: where a run's private memory peaks (build,
first step, steps, evaluation, checkpoint, export; summary.json's private_peak_mb/*, run/memphases.py),
each rank's private peak sampled from outside (RssAnon every 0.05 s), and the plan's figure (the launcher's
line), for several world sizes of one config. Each run under a cgroup memory limit (bench/big_models.py).
`--accum N`: N micro-batches per optimizer step (global batch = micro-batch x world x N). `--out FILE`
appends each run's result (with its configuration) as a JSON line as it finishes; `--replan FILE...`
prints those results' table again with today's plan (no run), e.g. after the plan's constants change.
`--data=` (empty) trains on the task's built-in data (chat: its conversations).

    python bench/memory_phases.py [--pretrained FOLDER] --worlds 2,3,4 [--task lm] [--block 64] [--steps 2]
        [--micro 1] [--accum 1] [--limit-gb 12] [--out FILE] [key=value ...]
    python bench/memory_phases.py --replan FILE [FILE ...]
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from big_models import per_rank, report, run_limited

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "wikitext2" / "validation.txt"
PHASES = ("build", "first_step", "steps", "eval", "checkpoint", "export")


def overrides(world: int, args, extra: list[str]) -> list[str]:
    """The run's config keys (those the plan reads among them): the same for a run and for its replan."""
    return [f"task={args.task}", *([f"data.train={args.data}"] if args.data else []),
            f"model.block_size={args.block}", f"train.micro_batch_size={args.micro}",
            f"train.global_batch_size={args.micro * world * args.accum}",
            *([f"model.pretrained={args.pretrained}"] if args.pretrained else []), *extra]


def run_one(work: Path, world: int, args, extra: list[str]) -> dict:
    run = work / f"w{world}"
    shutil.rmtree(run, ignore_errors=True)
    keys = overrides(world, args, extra)
    cmd = [sys.executable, "-m", "phalanx", "train", f"data.cache_dir={work / 'cache'}",
           f"train.max_steps={args.steps}", "train.log_every=1", "train.eval_every=0",
           f"train.eval_max_samples={world}", "train.warmup_steps=1", "log.progress=off", "resume=never",
           "train.memory_check=warn", "--run-dir", str(run), "--nproc-per-node", str(world), *keys]
    done = run_limited(cmd, f"phalanx-phases-{world}", args.limit_gb)
    out, peaks, planned = done.out, done.peaks, done.planned_gb
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
    result = {"world": world, "ok": done.code == 0, "wall_s": round(done.seconds, 1), "planned_gb": planned,
              "sampled_private_gb": [round(peaks[r] / 2 ** 30, 3) for r in sorted(peaks) if r >= 0],
              "phases_gb": {p: [round(v / 1024, 3) for v in summary.get(f"private_peak_mb/{p}", [])] for p in PHASES},
              "parameters": summary.get("parameters"), "tail": "" if done.code == 0 else out[-1500:],
              "overrides": keys, "accum": args.accum, "steps": args.steps}
    shutil.rmtree(run / "checkpoints", ignore_errors=True)
    shutil.rmtree(run / "final", ignore_errors=True)
    return result


def replan(result: dict) -> float:
    """Today's plan (GB per rank) of a recorded run, from its config keys (the launcher's figure on CPU)."""
    sys.path.insert(0, str(REPO))
    from phalanx.core.config import load_config
    from phalanx.tools import memplan

    cfg = load_config(None, result["overrides"])
    return round(memplan.estimate(cfg, memplan.shapes(cfg), result["world"], "cpu", 0).peak / 2 ** 30, 2)


def steps_peak(result: dict) -> float:
    """The steps' private peak (GB, the largest rank's): summary.json's `steps` phase (steps after the first),
    else the first step's."""
    ph = result["phases_gb"]
    return max(ph.get("steps") or ph.get("first_step") or [0])


def _short(keys: list[str]) -> list[str]:
    """A run's config keys less the batch and the data (the W and accum columns say those)."""
    return [k for k in keys if not k.startswith(("data.train=", "train.micro_batch_size=", "train.global_batch_size="))]


def table(results: list[dict]) -> str:
    head = "| W | accum | ok | " + " | ".join(f"{p} GB" for p in PHASES) + \
        " | whole / steps | sampled private GB | planned GB | plan / steps' peak | config |"
    lines = [head, "|" + "---|" * (len(PHASES) + 8)]
    for r in results:
        ph = r["phases_gb"]
        cols = [" / ".join(f"{v:.2f}" for v in ph.get(p, [])) or "-" for p in PHASES]
        steps = steps_peak(r)
        whole = max((max(v) for v in ph.values() if v), default=0)
        ratio = f"{whole / steps:.3f}" if steps else "-"
        plan = f"{r['planned_gb'] / steps:.2f}" if steps and r["planned_gb"] else "-"
        lines.append(f"| {r['world']} | {r.get('accum', 1)} | {'yes' if r['ok'] else 'NO'} | " + " | ".join(cols) +
                     f" | {ratio} | {per_rank(r['sampled_private_gb'])} | {r['planned_gb']} | "
                     f"{plan} | {' '.join(_short(r.get('overrides', [])))} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pretrained", default="")
    p.add_argument("--task", default="lm")
    p.add_argument("--data", default=str(DATA))
    p.add_argument("--worlds", default="2,3,4")
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--micro", type=int, default=1, help="micro-batch size")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--out", default=None, help="append each result as a JSON line to this file")
    p.add_argument("--replan", nargs="+", default=None, help="JSON-lines files of earlier results: their table "
                   "with today's plan (nothing runs)")
    p.add_argument("--limit-gb", type=float, default=12.0)
    p.add_argument("--work", default=None)
    args, extra = p.parse_known_args()
    if args.replan:
        results = [json.loads(line) for f in args.replan for line in Path(f).read_text().splitlines() if line]
        for r in results:
            r["planned_gb"] = replan(r)
        print(table(results))
        return
    work = Path(args.work or tempfile.mkdtemp(prefix="phalanx-phases-"))
    results = []
    for world in [int(w) for w in args.worlds.split(",")]:
        r = run_one(work, world, args, extra)
        results.append(r)
        print(json.dumps(r), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(r) + "\n")
    report(work / "phases.json", results, table, f"{args.task}, block {args.block}, micro-batch {args.micro} x "
           f"{args.accum} per step, {args.steps} steps, limit {args.limit_gb} GB per run (shared 2-core machine); "
           f"private memory per rank (ranks separated by /)")


if __name__ == "__main__":
    main()
