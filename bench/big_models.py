"""Models larger than one device: a ladder of GPT-2-style sizes, trained for a few steps on 2 processes,
each run under a memory limit, for four ways to train them:

    a  ddp                                     every rank holds the whole model, gradients and AdamW state
    b  fsdp, the pre-issue-18 way              whole model built on every rank, then sharded (a git worktree
                                               of BASE, the last commit before sharded construction)
    c  fsdp, sharded construction              meta build, fully_shard, only local shards materialised
    d  c + train.activation_checkpointing=full

A strategy stops at the first size that fails (out of memory under the limit, or any error). Per rank:
peak private memory (RssAnon of each worker, sampled every 0.05 s), the memory plan's predicted peak (its
line in the launcher's output; for b, today's plan of the same config), median step time. The limit is a
cgroup v1 memory limit on the launcher and its workers (so one failure cannot take the machine).

    python bench/big_models.py [--sizes 0.3,0.6,0.7,1.0,1.5] [--limit-gb 20] [--steps 3] [--block 512]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "wikitext2" / "validation.txt"
BASE = "97ac92b"  # the last commit before sharded construction (issue 18)
CGROUP = Path("/sys/fs/cgroup/memory")
# parameters (billions) -> (layers, width, heads); vocabulary 8192 (a tokenizer trained on the data)
LADDER = {0.05: (8, 640, 10), 0.3: (24, 1024, 16), 0.6: (24, 1408, 16), 0.7: (24, 1536, 16), 1.0: (24, 1792, 16),
          1.5: (48, 1600, 25)}
STRATEGIES = {"a ddp": (None, ["train.strategy=ddp"]),
              "b fsdp (pre-issue-18)": (BASE, ["train.strategy=fsdp"]),
              "c fsdp sharded build": (None, ["train.strategy=fsdp"]),
              "d c + activation ckpt": (None, ["train.strategy=fsdp", "train.activation_checkpointing=full"])}


def worktree(commit: str, work: Path) -> Path:
    path = work / f"phalanx-{commit}"
    if not path.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), commit], check=True,
                       capture_output=True)
    return path


class Limited:
    """A cgroup v1 memory group with a hard limit; children started with `enter` run inside it."""

    def __init__(self, name: str, limit: int):
        self.path = CGROUP / name
        self.path.mkdir(exist_ok=True)
        (self.path / "memory.limit_in_bytes").write_text(str(limit))

    def enter(self) -> None:  # preexec_fn: the child moves itself in before exec
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def close(self) -> None:
        time.sleep(0.5)
        try:
            self.path.rmdir()
        except OSError:
            pass


def private_peaks(launcher: subprocess.Popen, stop: threading.Event, peaks: dict) -> None:
    """Peak RssAnon per worker (its rank from the environment), sampled until `stop`."""
    import psutil

    while not stop.is_set():
        try:
            children = psutil.Process(launcher.pid).children(recursive=True)
        except psutil.Error:
            return
        for child in children:
            try:
                if "phalanx.run.worker" not in " ".join(child.cmdline()):
                    continue
                rank = int(child.environ().get("RANK", "-1"))
                status = Path(f"/proc/{child.pid}/status").read_text()
                anon = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("RssAnon"))
                peaks[rank] = max(peaks.get(rank, 0), anon)
            except (psutil.Error, OSError, StopIteration, ValueError):
                continue
        stop.wait(0.05)


@dataclass
class LimitedRun:
    """What a command run under a memory limit did: its output, exit code, each rank's private peak (bytes),
    wall seconds, and the launcher's memory-plan figure (GB) when it printed one."""
    out: str
    code: int
    peaks: dict
    seconds: float
    planned_gb: float | None


def run_limited(cmd: list[str], name: str, limit_gb: float, cwd: Path = REPO, env: dict | None = None) -> LimitedRun:
    """`cmd` in a cgroup of its own limited to `limit_gb`, each rank's private memory sampled from outside."""
    group = Limited(f"{name}-{os.getpid()}", int(limit_gb * 2 ** 30))
    peaks, stop = {}, threading.Event()
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=group.enter, env=env)
    sampler = threading.Thread(target=private_peaks, args=(proc, stop, peaks), daemon=True)
    sampler.start()
    out = proc.communicate()[0]
    stop.set()
    sampler.join()
    group.close()
    planned = next((float(line.split("about ")[1].split(" GB")[0]) for line in out.splitlines()
                    if "memory plan: about" in line), None)
    return LimitedRun(out, proc.returncode, peaks, time.time() - t0, planned)


def run_case(tree: Path, work: Path, name: str, size: float, extra: list[str], args) -> dict:
    layers, width, heads = LADDER[size]
    run = work / name.replace(" ", "_").replace("(", "").replace(")", "") / str(size)
    cmd = [sys.executable, "-m", "phalanx", "train", f"data.train={DATA}", f"data.cache_dir={work / 'cache'}",
           f"model.n_layer={layers}", f"model.n_embd={width}", f"model.n_head={heads}",
           f"model.block_size={args.block}", "data.vocab_size=8192", "train.micro_batch_size=1",
           "train.global_batch_size=2", f"train.max_steps={args.steps}", "train.log_every=1", "train.eval_every=0",
           "train.eval_max_samples=2", "train.warmup_steps=1", "log.progress=off", "resume=never",
           "--run-dir", str(run), "--nproc-per-node", "2", *extra]
    cmd.append("train.memory_check=warn")  # measure what happens, not what the plan says
    done = run_limited(cmd, "phalanx-bench", args.limit_gb, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)})
    out, peaks, planned = done.out, done.peaks, done.planned_gb
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] if \
        (run / "metrics.jsonl").exists() else []
    times = [m["step_time_s"] for m in steps if "step_time_s" in m and m.get("step", 0) > 1]
    hwm = next((m["ranks/host_peak_mb"] for m in steps[::-1] if "ranks/host_peak_mb" in m), [])
    failed = done.code != 0
    why = next((line for line in out.splitlines()[::-1] if line.startswith("phalanx:")), "") if failed else ""
    result = {"strategy": name, "size_b": size, "ok": not failed, "why": why[:160],
              "wall_s": round(done.seconds, 1),
              "private_peak_gb": [round(peaks[r] / 2 ** 30, 2) for r in sorted(peaks) if r >= 0],
              "peak_rss_gb": [round(v / 1024, 2) for v in hwm], "planned_gb": planned,
              "step_s": statistics.median(times) if times else None,
              "parameters": json.loads((run / "summary.json").read_text())["parameters"]
              if (run / "summary.json").exists() else None}
    shutil.rmtree(run, ignore_errors=True)  # its checkpoint and final model: gigabytes per rung
    return result


def plan_of(size: float, extra: list[str], args) -> float:
    """Today's memory plan of a configuration (for the pre-issue-18 runs, which do not print one)."""
    from phalanx.core.config import load_config
    from phalanx.tools import memplan

    layers, width, heads = LADDER[size]
    cfg = load_config(None, [f"model.n_layer={layers}", f"model.n_embd={width}", f"model.n_head={heads}",
                             f"model.block_size={args.block}", "data.vocab_size=8192", "train.micro_batch_size=1",
                             "train.global_batch_size=2", *extra])
    return round(memplan.estimate(cfg, memplan.shapes(cfg), 2, "cpu", 0).peak / 2 ** 30, 2)


def table(results: list[dict]) -> str:
    lines = ["| strategy | size (B) | parameters | ok | peak private GB per rank | peak RSS GB per rank | planned GB | "
             "plan / peak private | step s | note |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        peak = max(r["private_peak_gb"], default=0)  # the targets hold on private memory
        ratio = f"{r['planned_gb'] / peak:.2f}" if r["ok"] and peak and r["planned_gb"] else "-"
        lines.append(f"| {r['strategy']} | {r['size_b']} | {r['parameters'] or '-'} | {'yes' if r['ok'] else 'NO'} | "
                     f"{per_rank(r['private_peak_gb'])} | "
                     f"{per_rank(r['peak_rss_gb'])} | {r['planned_gb'] or '-'} | {ratio} | "
                     f"{r['step_s'] and round(r['step_s'], 2) or '-'} | {r['why']} |")
    return "\n".join(lines)


def report(path: Path, results: list[dict], table, header: str) -> None:
    """The ladder's results as JSON at `path`, then its header and table on stdout."""
    path.write_text(json.dumps(results, indent=1))
    print(f"\n{header}\n")
    print(table(results))


def per_rank(values) -> str:
    """A table cell of per-rank values: 'a / b', '-' where there are none."""
    return " / ".join(map(str, values)) or "-"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="0.3,0.6,0.7,1.0,1.5")
    p.add_argument("--strategies", default="a,b,c,d", help="letters of the strategies to run")
    p.add_argument("--limit-gb", type=float, default=20.0, help="memory limit of each run (launcher + workers)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--block", type=int, default=512)
    p.add_argument("--work", default=None)
    args = p.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="phalanx-big-"))
    sizes = [float(s) for s in args.sizes.split(",")]
    results = []
    for name, (commit, extra) in STRATEGIES.items():
        if name[0] not in args.strategies.split(","):
            continue
        tree = worktree(commit, work) if commit else REPO
        for size in sizes:
            r = run_case(tree, work, name, size, extra, args)
            if commit:
                r["planned_gb"] = plan_of(size, extra, args)
            results.append(r)
            print(json.dumps(r), flush=True)
            if not r["ok"]:
                break
    report(work / "big_models.json", results, table, f"{args.steps} steps, block {args.block}, micro-batch 1, 2 "
           f"processes, limit {args.limit_gb} GB per run, {os.cpu_count()} cores; results in {work}")


if __name__ == "__main__":
    main()
