"""Strategies, precision, compile and launchers, measured with real `phalanx train` runs.

Benchmark model: examples/shakespeare.yaml (GPT-2, 4 layers, 4 heads, width 256, block 128, BPE vocab
4096, micro-batch 8, global batch 8 x processes so there is no accumulation) on Tiny Shakespeare.
tokens/s is measured on wall-clock time between the end of the warm-up steps and the last step
(metrics.jsonl timestamps), so compilation and start-up are left out; they show in "first step".

    python bench/strategies.py                         # CPU: every table (~10 min on 2 cores)
    python bench/strategies.py --only strategy,launchers --steps 30
    python bench/strategies.py --device cuda           # GPU: MFU column; 2-process rows need 2 GPUs
    python bench/strategies.py --check-equivalence     # tiny model: loss trajectories agree (GPU check)

Tables:
  precision/compile  1 process (all cores on CPU): fp32, bf16, fp32+compile, bf16+compile
  strategy           2 processes: DDP vs FSDP2: tokens/s, peak memory per rank (host RSS high-water
                     mark; on GPU max allocated), model+grad+AdamW state per rank (16 bytes/param,
                     divided by the world size under FSDP)
  launchers          2 processes from one launcher vs two launchers (--nnodes 2, c10d on 127.0.0.1):
                     wall time of the whole command and time to the first step
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
import time
from pathlib import Path

from phalanx.core import host

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"  # --data; built-in corpus if absent
CONFIG = REPO / "examples" / "shakespeare.yaml"
TINY = ["model.n_layer=2", "model.n_head=2", "model.n_embd=64", "model.block_size=32", "data.vocab_size=512",
        "train.micro_batch_size=4", "train.global_batch_size=16", "train.warmup_steps=2", "train.lr=3e-3",
        "train.max_steps=10", "train.eval_max_samples=9"]


def phalanx_cmd(run: Path, cache: Path, nproc: int, steps: int, extra: list[str], config=CONFIG) -> list[str]:
    return [sys.executable, "-m", "phalanx", "train", str(config), f"data.train={DATA if DATA.is_file() else ''}",
            f"data.cache_dir={cache}", f"train.max_steps={steps}", "train.log_every=1", "train.eval_every=0",
            "train.checkpoint_every=0", f"train.global_batch_size={8 * nproc}", "train.micro_batch_size=8",
            "train.eval_max_samples=8", "log.progress=off", "--run-dir", str(run), "--nproc-per-node",
            str(nproc), *extra]


def train_lines(run: Path) -> list[dict]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    return [m for m in lines if "loss" in m and "event" not in m]


def measure(run: Path, t_start: float, wall: float, warmup: int) -> dict:
    """tokens/s after warm-up, time to first step, peak memory per rank, losses by step."""
    lines = train_lines(run)
    pts = [(m["step"], m["time_s"], m["tokens_per_s"] * m["step_time_s"]) for m in lines if m["step"] >= warmup]
    rate = sum(p[2] for p in pts[1:]) / (pts[-1][1] - pts[0][1]) if len(pts) > 1 else float("nan")
    last = lines[-1]
    peak = last.get("ranks/cuda_peak_mb") or last.get("ranks/host_peak_mb") or []
    summary = json.loads((run / "summary.json").read_text())
    return {"tokens_per_s": rate, "first_step_s": lines[0]["time_s"] - t_start, "wall_s": wall,
            "peak_mb": peak, "params": summary["parameters"], "losses": {m["step"]: m["loss"] for m in lines}}


def run_case(work: Path, cache: Path, name: str, nproc: int, steps: int, warmup: int, extra: list[str],
             launchers: int = 1, threads: int | None = None) -> dict:
    run = work / name.replace(" ", "_").replace("+", "-")
    shutil.rmtree(run, ignore_errors=True)
    if threads:
        extra = [*extra, f"dist.threads_per_worker={threads}"]
    cmds = [phalanx_cmd(run, cache, nproc * launchers, steps, extra)]
    if launchers > 1:  # one launcher per "node": --nproc-per-node nproc each, c10d on localhost
        from phalanx.core.dist import free_port

        port = free_port()
        base = phalanx_cmd(run, cache, nproc, steps, extra)
        base[base.index(f"train.global_batch_size={8 * nproc}")] = f"train.global_batch_size={8 * nproc * launchers}"
        cmds = [base + ["--nnodes", str(launchers), "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
                        f"bench-{port}"]] * launchers
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    t0 = time.time()
    procs = [subprocess.Popen(c, cwd=REPO, env={**env, **launcher_gpus(i, nproc, len(cmds))}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i, c in enumerate(cmds)]
    outs = [p.communicate()[0] for p in procs]
    wall = time.time() - t0
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{name}: exit codes {[p.returncode for p in procs]}\n{outs[0][-3000:]}")
    return {"name": name, "nproc": nproc * launchers, **measure(run, t0, wall, warmup)}


def launcher_gpus(i: int, nproc: int, launchers: int) -> dict:
    """Launchers standing in for nodes on one GPU machine: launcher i sees only its own `nproc` GPUs, as a
    node would. With the same environment every launcher's LOCAL_RANK 0 takes cuda:0 and NCCL stops with
    'Duplicate GPU detected'."""
    if launchers == 1:
        return {}
    import torch

    from phalanx.core.host import gpu_ids

    ids = gpu_ids(os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count())
    if not ids:
        return {}
    if len(ids) < nproc * launchers:
        raise RuntimeError(f"{launchers} launchers x {nproc} process(es) need {nproc * launchers} GPUs, "
                           f"{len(ids)} visible")
    return {"CUDA_VISIBLE_DEVICES": ",".join(ids[i * nproc:(i + 1) * nproc])}


def gpu_peak_tflops(dtype_16bit: bool) -> float:
    """The GPU's dense peak from phalanx's table (exact model match, as the run's own MFU uses); 0 if unlisted."""
    import torch

    from phalanx.run.telemetry import GPU_PEAK_TFLOPS, gpu_model

    peaks = GPU_PEAK_TFLOPS.get(gpu_model(torch.cuda.get_device_name()))
    return float(peaks[0] if dtype_16bit else peaks[1]) if peaks else 0.0


def mfu(row: dict, device: str) -> str:
    """Model FLOPs utilisation: 6N + 12·L·d·T FLOPs per token (nanoGPT/PaLM) over the peak."""
    if device != "cuda":
        return "-"
    flops = 6 * row["params"] + 12 * 4 * 256 * 128
    peak = gpu_peak_tflops("bf16" in row["name"] or "fp16" in row["name"]) * 1e12 * row["nproc"]
    return f"{100 * row['tokens_per_s'] * flops / peak:.1f}%" if peak else "? (unknown GPU)"


def fmt_peak(peak) -> str:
    return " / ".join(f"{p:.0f}" for p in peak) if peak else "-"


def table(title: str, header: list[str], rows: list[list[str]]) -> str:
    out = [f"\n### {title}", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows])


def median_rows(results: list[dict]) -> dict[str, dict]:
    by_name: dict[str, list[dict]] = {}
    for r in results:
        by_name.setdefault(r["name"], []).append(r)
    merged = {}
    for name, rs in by_name.items():
        merged[name] = {**rs[0], **{k: statistics.median(r[k] for r in rs)
                                    for k in ("tokens_per_s", "first_step_s", "wall_s")}, "n": len(rs)}
    return merged


def plan(only: set[str], device: str) -> list[tuple]:
    """(table, name, processes, overrides, launchers, threads per worker)."""
    n_gpu = 0
    if device == "cuda":
        import torch

        n_gpu = torch.cuda.device_count()
    one = host.cores() if device == "cpu" else None
    cases = []
    if "precision" in only:
        for name, extra in (("fp32", []), ("bf16", ["train.precision=bf16"]),
                            ("fp32+compile", ["train.compile=true"]),
                            ("bf16+compile", ["train.precision=bf16", "train.compile=true"])):
            cases.append(("precision", f"{name} x1", 1, extra, 1, one))
    two = device == "cpu" or n_gpu >= 2
    threads = max(1, host.cores() // 2) if device == "cpu" else None
    if "strategy" in only and two:
        cases += [("strategy", "ddp x2", 2, ["train.strategy=ddp"], 1, threads),
                  ("strategy", "fsdp x2", 2, ["train.strategy=fsdp"], 1, threads)]
    if "launchers" in only and two:
        cases += [("launchers", "1 launcher x2", 2, [], 1, threads),
                  ("launchers", "2 launchers x1", 1, [], 2, threads)]
    return cases


def report(results: dict[str, dict], cases: list[tuple], device: str) -> str:
    parts = []
    prec = [results[c[1]] for c in cases if c[0] == "precision" and c[1] in results]
    if prec:
        base = prec[0]["tokens_per_s"]
        parts.append(table("Precision and compile (1 process)", ["run", "tokens/s", "vs fp32", "first step s", "MFU"],
                           [[r["name"], f"{r['tokens_per_s']:.0f}", f"{r['tokens_per_s'] / base:.2f}x",
                             f"{r['first_step_s']:.1f}", mfu(r, device)] for r in prec]))
    strat = [results[c[1]] for c in cases if c[0] == "strategy" and c[1] in results]
    if strat:
        base = strat[0]["tokens_per_s"]
        parts.append(table("DDP vs FSDP2 (2 processes)", ["run", "tokens/s", "vs DDP", "peak MB per rank",
                                                         "model+grad+AdamW MB per rank", "MFU"],
                           [[r["name"], f"{r['tokens_per_s']:.0f}", f"{r['tokens_per_s'] / base:.2f}x",
                             fmt_peak(r["peak_mb"]),
                             f"{16 * r['params'] / 2 ** 20 / (2 if 'fsdp' in r['name'] else 1):.0f}",
                             mfu(r, device)] for r in strat]))
        if len(strat) == 2:
            a, b = strat[0]["losses"], strat[1]["losses"]
            diff = max(abs(a[s] - b[s]) / abs(a[s]) for s in a)
            parts.append(f"\nFSDP vs DDP losses: max relative difference {diff:.1e} over {len(a)} steps")
    launch = [results[c[1]] for c in cases if c[0] == "launchers" and c[1] in results]
    if launch:
        parts.append(table("One launcher vs two launchers (2 processes in all)",
                           ["run", "wall s", "first step s", "tokens/s"],
                           [[r["name"], f"{r['wall_s']:.1f}", f"{r['first_step_s']:.1f}",
                             f"{r['tokens_per_s']:.0f}"] for r in launch]))
    return "\n".join(parts)


def check_equivalence(work: Path, cache: Path, tol: float) -> int:
    """Tiny model, 10 steps: the device's runs follow the CPU/Gloo 2-process DDP trajectory."""
    import torch

    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    runs = {"cpu gloo ddp x2": (2, ["dist.backend=gloo"])}
    if n_gpu:
        runs["gpu x1"] = (1, [])
    if n_gpu >= 2:
        runs["gpu nccl ddp x2"] = (2, ["train.strategy=ddp"])
        runs["gpu nccl fsdp x2"] = (2, ["train.strategy=fsdp"])
    if not n_gpu:
        runs["cpu gloo fsdp x2"] = (2, ["dist.backend=gloo", "train.strategy=fsdp"])
    losses = {}
    for name, (nproc, extra) in runs.items():
        run = work / name.replace(" ", "_")
        shutil.rmtree(run, ignore_errors=True)
        cmd = [sys.executable, "-m", "phalanx", "train", f"data.train={DATA if DATA.is_file() else ''}",
               f"data.cache_dir={cache}", *TINY,
               "train.log_every=1", "train.eval_every=0", "log.progress=off", "dist.threads_per_worker=1",
               *extra, "--run-dir", str(run), "--nproc-per-node", str(nproc)]
        subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
        losses[name] = {m["step"]: m["loss"] for m in train_lines(run)}
    ref_name = next(iter(losses))
    ref, worst = losses[ref_name], 0.0
    print(f"equivalence (tiny GPT-2, 10 steps, reference: {ref_name}; tolerance {tol:g} relative)")
    for name, got in losses.items():
        diff = max(abs(got[s] - ref[s]) / abs(ref[s]) for s in ref)
        worst = max(worst, diff)
        print(f"  {name:20s} final loss {got[max(got)]:.6f}  max rel diff {diff:.1e}  "
              f"{'PASS' if diff <= tol else 'FAIL'}")
    return 0 if worst <= tol else 1


def check_contexts(work: Path, cache: Path) -> int:
    """While 2 workers train on 2 GPUs, each GPU hosts one phalanx process and no process touches two
    devices (a stray context on device 0 costs ~500 MB there per process)."""
    run = work / "contexts"
    shutil.rmtree(run, ignore_errors=True)
    cmd = [sys.executable, "-m", "phalanx", "train", f"data.train={DATA if DATA.is_file() else ''}",
           f"data.cache_dir={cache}", *TINY, "train.max_steps=400", "train.log_every=1", "train.eval_every=0",
           "log.progress=off", "--run-dir", str(run), "--nproc-per-node", "2"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    apps = ""
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            if (run / "metrics.jsonl").is_file() and len(train_lines(run)) >= 5:
                apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                                      capture_output=True, text=True).stdout
                break
            time.sleep(0.5)
    finally:
        proc.terminate()
        proc.wait()
    gpus_of: dict[str, set] = {}
    for line in apps.strip().splitlines():
        pid, uuid = (x.strip() for x in line.split(","))
        gpus_of.setdefault(pid, set()).add(uuid)
    if not gpus_of:
        print("contexts: nvidia-smi lists no processes (PID namespace?): not verified")
        return 0
    used = set().union(*gpus_of.values())
    bad = {pid: len(us) for pid, us in gpus_of.items() if len(us) > 1}
    print(f"contexts: {len(gpus_of)} processes on {len(used)} GPUs; on more than one GPU: {bad or 'none'}")
    return 1 if bad or len(used) < 2 else 0


def main() -> int:
    global DATA
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="precision,strategy,launchers", help="tables to produce")
    p.add_argument("--steps", type=int, default=25, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of tokens/s")
    p.add_argument("--repeats", type=int, default=1, help="runs per case (alternating); the median is shown")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--check-equivalence", action="store_true", help="tiny-model trajectory check only")
    p.add_argument("--tolerance", type=float, default=1e-4, help="--check-equivalence: max relative loss diff")
    p.add_argument("--check-contexts", action="store_true", help="GPU: one process per device while training")
    p.add_argument("--data", default=str(DATA), help="training text (default Tiny Shakespeare; the built-in "
                   "corpus when the file is absent)")
    p.add_argument("--work", default=None, help="folder for the runs (default: a temporary one)")
    args = p.parse_args()
    DATA = Path(args.data)
    work = Path(args.work or tempfile.mkdtemp(prefix="phalanx-bench-"))
    cache = work / "token-cache"
    if args.check_equivalence:
        return check_equivalence(work, cache, args.tolerance)
    if args.check_contexts:
        return check_contexts(work, cache)
    extra_dev = ["dist.backend=gloo"] if args.device == "cpu" else []
    cases = plan(set(args.only.split(",")), args.device)
    print(f"phalanx strategies benchmark: {args.device}, {host.cores()} cores, {args.steps} steps "
          f"(tokens/s after step {args.warmup}), {args.repeats} repeat(s); work folder {work}", flush=True)
    results = []
    for _ in range(args.repeats):
        for _, name, nproc, extra, launchers, threads in cases:
            r = run_case(work, cache, name, nproc, args.steps, args.warmup, [*extra, *extra_dev], launchers, threads)
            print(f"  {name}: {r['tokens_per_s']:.0f} tokens/s, wall {r['wall_s']:.1f} s", flush=True)
            results.append(r)
    print(report(median_rows(results), cases, args.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
