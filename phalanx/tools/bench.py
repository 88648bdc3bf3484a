"""Scaling benchmark: the same config at several world sizes, through the real launcher.

    phalanx bench CONFIG [key=value ...] --nproc 1,2 [--steps 20] [--warmup 3] [--mode strong|weak]

Each world size is a real `phalanx train` in a subprocess (so each gets a clean environment) writing
to OUT/npN. Strong scaling keeps the global batch; weak scaling keeps the work per process (the global
batch grows with the world size). CPU threads per process are set to cores / processes so the machine
is never oversubscribed and every world size uses the same cores; the table says how many. The first
`--warmup` steps are left out of every figure. Writes OUT/bench.md, OUT/bench.json and OUT/scaling.png.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from phalanx.core import host
from phalanx.core.config import ConfigError, check_world, load_config
from phalanx.core.runfolder import RunFolder
from phalanx.run.sinks import read_metrics

COLUMNS = ("processes", "threads/process", "global batch", "tokens/s", "speedup", "efficiency",
           "uncontended tokens/s (steps)",
           "step ms", "comm wait share", "all-reduce share", "CPU % per rank", "peak host MB per rank", "MFU")


def add_arguments(p) -> None:
    p.add_argument("items", nargs="*", metavar="CONFIG [key=value ...]", help="the config and overrides")
    p.add_argument("--nproc", default="1,2", help="comma-separated world sizes, e.g. 1,2,4")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per world size")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the figures")
    p.add_argument("--mode", choices=["strong", "weak"], default="strong",
                   help="strong: fixed global batch; weak: fixed batch per process")
    p.add_argument("--out", default=None, help="output folder (default runs/bench-<config name>)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds allowed per world size")


def plan(cfg, sizes: list[int], mode: str) -> list[dict]:
    """World size, threads per process and global batch of each run (checked before anything starts)."""
    base = cfg.train.global_batch_size
    runs = []
    for n in sizes:
        if mode == "weak" and base * n % sizes[0]:
            raise ConfigError(f"--mode weak: global batch {base} x {n} / {sizes[0]} is not a whole number")
        trial = copy.deepcopy(cfg)
        trial.train.global_batch_size = base * n // sizes[0] if mode == "weak" else base
        check_world(trial, n)
        runs.append({"processes": n, "threads": max(1, host.cores() // n),
                     "global_batch": trial.train.global_batch_size})
    return runs


def train_command(config: str | None, overrides: list[str], run: dict, steps: int, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "phalanx", "train", *([config] if config else []), *overrides,
            f"train.max_steps={steps}", "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=0",
            "train.checkpoint_every_minutes=0", f"train.eval_max_samples={run['global_batch']}",
            f"train.global_batch_size={run['global_batch']}", f"dist.threads_per_worker={run['threads']}",
            "log.progress=off", "resume=never", "--run-dir", str(run_dir), "--nproc-per-node", str(run["processes"])]


def _tokens_per_s(rows: list[dict]) -> float | None:
    step_s = sum(r["step_time_s"] for r in rows)
    return sum(r["tokens_per_s"] * r["step_time_s"] for r in rows) / step_s if rows else None


def measure(run_dir: Path, warmup: int, threads: int) -> dict:
    """Figures of one run from its metrics.jsonl, leaving out the first `warmup` steps."""
    rows = [r for r in read_metrics(RunFolder(run_dir).metrics)
            if "loss" in r and "event" not in r and r.get("step", 0) > warmup]
    if not rows:
        raise RuntimeError(f"{run_dir}: no training steps after the warm-up")
    # Steps in which every rank got >= 90% of its threads' CPU time: what the config does on quiet cores.
    # On GPUs a rank mostly waits for its device, so its CPU share says nothing about contention: every
    # step counts as quiet there.
    on_gpu = any("ranks/cuda_peak_mb" in r for r in rows)
    quiet = rows if on_gpu else [r for r in rows if min(r.get("ranks/cpu_percent", [0])) >= 90 * threads]
    step_s = sum(r["step_time_s"] for r in rows)
    split = [sum(r.get(k, 0) for k in ("data_time_s", "sync_time_s", "fwd_bwd_time_s", "optimizer_time_s"))
             for r in rows]
    peaks = [max(v) for v in zip(*[r["ranks/host_peak_mb"] for r in rows if "ranks/host_peak_mb" in r])]
    # Mean CPU use per rank: well under threads x 100% means the processes did not get their cores.
    cpu = [statistics.fmean(v) for v in zip(*[r["ranks/cpu_percent"] for r in rows if "ranks/cpu_percent" in r])]
    out = {"steps": len(rows), "tokens_per_s": _tokens_per_s(rows), "step_time_s": step_s / len(rows),
           "quiet_steps": len(quiet), "quiet_tokens_per_s": _tokens_per_s(quiet),
           "comm_wait_share": statistics.fmean((r.get("sync_time_s", 0) + r.get("comm_exposed_time_s", 0)) / s
                                               for r, s in zip(rows, split)),
           "allreduce_share": statistics.fmean(r.get("comm_time_s", 0) / s for r, s in zip(rows, split)),
           "host_peak_mb": peaks, "cpu_percent": cpu, "mfu": rows[-1].get("mfu")}
    cuda = [max(v) for v in zip(*[r["ranks/cuda_peak_mb"] for r in rows if "ranks/cuda_peak_mb" in r])]
    if cuda:
        out["cuda_peak_mb"] = cuda
    return out


def table(results: list[dict]) -> list[str]:
    base = results[0]
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---:|" * len(COLUMNS)]
    for r in results:
        speedup = r["tokens_per_s"] / base["tokens_per_s"]
        r["speedup"], r["efficiency"] = speedup, speedup / (r["processes"] / base["processes"])
        peaks = " / ".join(f"{p:.0f}" for p in r["host_peak_mb"])
        quiet = f"{r['quiet_tokens_per_s']:,.0f} ({r['quiet_steps']})" if r["quiet_steps"] else "n/a (0)"
        if r.get("cuda_peak_mb"):
            peaks += " (CUDA " + " / ".join(f"{p:.0f}" for p in r["cuda_peak_mb"]) + ")"
        cells = (r["processes"], r["threads"], r["global_batch"], f"{r['tokens_per_s']:,.0f}", f"{speedup:.2f}x",
                 f"{r['efficiency']:.0%}", quiet, f"{r['step_time_s'] * 1e3:.0f}", f"{r['comm_wait_share']:.1%}",
                 f"{r['allreduce_share']:.1%}", " / ".join(f"{c:.0f}" for c in r["cpu_percent"]), peaks,
                 f"{r['mfu']:.1%}" if r.get("mfu") else "n/a")
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


def plot(results: list[dict], path: Path, mode: str) -> Path:
    import matplotlib  # lazy: plotting only, at the end

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = [r["processes"] for r in results]
    tps = [r["tokens_per_s"] for r in results]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    a.plot(n, tps, "o-", label="measured")
    a.plot(n, [tps[0] * k / n[0] for k in n], "k--", label="ideal (linear)")
    a.set(xlabel="processes", ylabel="tokens/s", title=f"{mode} scaling: throughput", xticks=n)
    a.legend()
    a.grid(alpha=0.3)
    b.bar([str(k) for k in n], [r["efficiency"] * 100 for r in results], label="parallel efficiency")
    b.plot([str(k) for k in n], [r["comm_wait_share"] * 100 for r in results], "ro-",
           label="share of step waiting in collectives")
    top = max(110, 10 + max(r["efficiency"] * 100 for r in results))
    b.set(xlabel="processes", ylabel="%", title="efficiency and communication", ylim=(0, top))
    b.legend(fontsize=8, loc="lower right")
    b.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def run(args) -> int:
    config = next((i for i in args.items if "=" not in i), None)
    overrides = [i for i in args.items if i != config]
    try:
        sizes = sorted({int(x) for x in args.nproc.split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"--nproc: expected comma-separated integers, got {args.nproc!r}") from None
    if not sizes or sizes[0] < 1:
        raise ConfigError(f"--nproc: expected world sizes >= 1, got {args.nproc!r}")
    if args.steps <= args.warmup:
        raise ConfigError(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    cfg = load_config(config, overrides)
    out = Path(args.out or Path("runs") / f"bench-{cfg.name}")
    runs = plan(cfg, sizes, args.mode)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # launch sets it per run
    results, failed = [], []
    for r in runs:
        run_dir = out / f"np{r['processes']}"
        shutil.rmtree(run_dir, ignore_errors=True)
        print(f"phalanx bench: {r['processes']} process(es) x {r['threads']} thread(s), {args.steps} steps ...",
              flush=True)
        proc = subprocess.run(train_command(config, overrides, r, args.steps, run_dir), env=env,
                              capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0:
            failed.append(r["processes"])
            print(f"phalanx bench: {r['processes']} process(es) failed (exit {proc.returncode}):\n"
                  f"{proc.stderr[-2000:]}", file=sys.stderr)
            continue
        results.append({**r, **measure(run_dir, args.warmup, r["threads"]), "run_dir": str(run_dir)})
    if not results:
        return 1
    return _write(results, out, args, failed)


def _write(results: list[dict], out: Path, args, failed: list[int]) -> int:
    lines = table(results)
    notes = [f"{args.mode} scaling, {args.steps} steps per world size, first {args.warmup} left out; "
             f"{host.cores()} cores, threads/process = cores / processes (never oversubscribed).",
             "comm wait share: (step-start sync + gradient all-reduce not hidden by backward) / step time; "
             "all-reduce share: time a DDP gradient all-reduce was in flight / step time (overlaps backward).",
             "uncontended: only the steps in which every rank got >= 90% of its threads' CPU time (on GPUs: "
             "every step; a rank waiting for its device uses little CPU).",
             "CPU % per rank: mean process CPU use (100 = one core); below threads x 100 means the cores were "
             "shared with other work and the figures are pessimistic."]
    shared = [str(r["processes"]) for r in results if r["cpu_percent"] and not r.get("cuda_peak_mb") and
              min(r["cpu_percent"]) < 0.8 * 100 * r["threads"]]  # on GPUs low CPU use is the norm
    if shared:
        notes.append(f"WARNING: at {', '.join(shared)} process(es) a rank used under 80% of its threads' CPU "
                     f"time: other work shared the cores, so those figures understate what this config can do.")
    if failed:
        notes.append(f"failed world sizes: {', '.join(map(str, failed))}")
    text = "\n".join(lines + [""] + notes) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.md").write_text(text, encoding="utf-8")
    (out / "bench.json").write_text(json.dumps({"mode": args.mode, "steps": args.steps, "warmup": args.warmup,
                                                "cores": host.cores(), "results": results}, indent=2), encoding="utf-8")
    plot(results, out / "scaling.png", args.mode)
    print(text + f"\nwrote {out / 'bench.md'}, {out / 'bench.json'}, {out / 'scaling.png'}", flush=True)
    return 1 if failed else 0
