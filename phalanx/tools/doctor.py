"""Pre-flight checks of the distributed set-up, one verdict per line (ok / warning / problem).

    phalanx doctor [CONFIG [key=value ...]] [--nproc-per-node N] [--nnodes N] [--run-dir DIR]

Checks torch and the process-group backends, devices and their memory, a free rendezvous port, an
all-reduce across N real local processes (correct sum, and bandwidth), the run folder (writable, free
disk), and with a config an estimate of memory per rank against what is available. Exits 1 when any
line is a problem, so it can gate a job script.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import shutil
import socket
import sys
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as tdist

from phalanx.core import host
from phalanx.core.config import ConfigError, check_world, load_config
from phalanx.core.dist import free_port, pick_backend
from phalanx.tools.launch import parse_nnodes
from phalanx.tools import memplan
from phalanx.tools.memplan import gpu_memory

GB = 2 ** 30


def add_arguments(p) -> None:
    p.add_argument("items", nargs="*", metavar="[CONFIG] [key=value ...]",
                   help="optional config (and overrides) for the memory and disk estimates")
    p.add_argument("--nproc-per-node", type=int, default=1, help="processes per node to check for")
    p.add_argument("--nnodes", default="1", help="nodes, N or MIN:MAX (the estimate uses MAX)")
    p.add_argument("--rdzv-endpoint", default="", help="HOST:PORT of a multi-node rendezvous to check")
    p.add_argument("--run-dir", default=None, help="run folder to check (default: the config's, or runs/)")
    p.add_argument("--timeout", type=float, default=90.0, help="seconds allowed for the all-reduce check")


class Report:
    def __init__(self):
        self.lines: list[tuple[str, str, str]] = []

    def add(self, verdict: str, check: str, detail: str) -> None:
        self.lines.append((verdict, check, detail))
        print(f"{verdict:<8} {check:<22} {detail}", flush=True)

    def count(self, verdict: str) -> int:
        return sum(1 for v, _, _ in self.lines if v == verdict)


# ---- environment --------------------------------------------------------------------------------
def check_torch(rep: Report, backend: str, nproc: int) -> None:

    rep.add("ok", "torch", f"{torch.__version__} (python {sys.version.split()[0]})")
    available = {"gloo": tdist.is_gloo_available(),
                 "nccl": tdist.is_nccl_available() and torch.cuda.is_available(),
                 "mpi": tdist.is_mpi_available()}
    for name, ok in available.items():
        used = name == backend
        if ok:
            rep.add("ok", f"backend {name}", "available" + (" (used)" if used else ""))
        else:
            why = "no CUDA device" if name == "nccl" and tdist.is_nccl_available() else "not in this torch build"
            rep.add("problem" if used else "ok", f"backend {name}",
                    f"not available ({why})" + ("; it is the backend this run would use" if used else ""))
    if backend == "nccl" and torch.cuda.device_count() < nproc:
        rep.add("problem", "devices", f"{nproc} processes per node but {torch.cuda.device_count()} CUDA device(s)")


def check_devices(rep: Report, nproc: int) -> dict:
    """Report devices and return memory available per local process (bytes) by kind."""

    cores = host.cores()
    vm = psutil.virtual_memory()
    rep.add("ok" if nproc <= cores else "warning", "cpu",
            f"{cores} cores for {nproc} process(es): {max(1, cores // nproc)} thread(s) each"
            + ("" if nproc <= cores else " (more processes than cores: they will contend)"))
    rep.add("ok", "host memory", f"{vm.available / GB:.1f} GB available of {vm.total / GB:.1f} GB "
                                 f"({vm.available / nproc / GB:.1f} GB per process)")
    avail = {"host": vm.available / nproc}
    for i, (name, free, total) in enumerate(gpu_memory()):
        rep.add("ok", f"cuda:{i}", f"{name}, {free / GB:.1f} GB free of {total / GB:.1f} GB")
        avail["cuda"] = min(avail.get("cuda", free), free)
    if not torch.cuda.is_available():
        rep.add("ok", "cuda", "no CUDA device visible (CPU training with gloo)")
    return avail


def check_port(rep: Report, endpoint: str) -> None:

    if not endpoint:
        rep.add("ok", "rendezvous port", f"free port {free_port()} on 127.0.0.1 (standalone rendezvous)")
        return
    host, _, port = endpoint.rpartition(":")
    try:
        addrs = {a[4][0] for a in socket.getaddrinfo(host, int(port))}
    except (OSError, ValueError) as e:
        rep.add("problem", "rendezvous endpoint", f"{endpoint}: cannot resolve ({e})")
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        if s.connect_ex((host, int(port))) == 0:
            rep.add("ok", "rendezvous endpoint", f"{endpoint} ({', '.join(sorted(addrs))}) accepts connections")
            return
    local = any(a.startswith("127.") or a in _local_addresses() for a in addrs)
    rep.add("ok" if local else "warning", "rendezvous endpoint",
            f"{endpoint}: nothing listening yet" + (" (this node will host it)" if local else
                                                    "; the first node starts it, check firewalls if it never does"))


def _local_addresses() -> set[str]:

    return {a.address for addrs in psutil.net_if_addrs().values() for a in addrs}


# ---- all-reduce across real local processes -----------------------------------------------------
def _allreduce_worker(rank: int, world: int, port: int, backend: str, size_mb: int, queue) -> None:
    """One process of the check: exact sum of known values, then timed all-reduces of `size_mb` MB."""


    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(rank)
    try:
        tdist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                 timeout=datetime.timedelta(seconds=60))
        # Every rank can make every rank's values, so each one knows the exact sum to expect.
        values = [torch.randint(-1000, 1000, (4096,), generator=torch.Generator().manual_seed(r))
                  for r in range(world)]
        expected = sum(values)
        t = values[rank].to(torch.float64).to(device)
        tdist.all_reduce(t)
        correct = bool(torch.equal(t.cpu(), expected.to(torch.float64)))
        big = torch.ones(size_mb * 2 ** 20 // 4, dtype=torch.float32, device=device)
        tdist.all_reduce(big)  # warm-up: connections, buffers
        if backend == "nccl":  # the warm-up's kernels must not run inside the timed window
            torch.cuda.synchronize()
        iters = 5
        start = time.perf_counter()
        for _ in range(iters):
            tdist.all_reduce(big)
        if backend == "nccl":
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / iters
        ok = torch.tensor([float(correct)], device=device)
        tdist.all_reduce(ok, op=tdist.ReduceOp.MIN)
        if rank == 0:
            queue.put({"correct": bool(ok.item()), "seconds": seconds, "bytes": big.numel() * 4})
        tdist.destroy_process_group()
    except Exception as e:  # reported by the parent as a problem line
        queue.put({"error": f"rank {rank}: {type(e).__name__}: {e}"})


def check_allreduce(rep: Report, nproc: int, backend: str, timeout: float, size_mb: int = 32) -> None:


    if nproc < 2:
        rep.add("ok", "all-reduce", "1 process per node: nothing to reduce across (use --nproc-per-node N)")
        return
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_allreduce_worker, args=(r, nproc, port, backend, size_mb, queue), daemon=True)
             for r in range(nproc)]
    for p in procs:
        p.start()
    result, deadline = None, time.monotonic() + timeout
    while result is None and time.monotonic() < deadline:
        try:
            result = queue.get(timeout=0.5)
        except Exception:  # queue.Empty: keep waiting unless every process has exited
            if not any(p.is_alive() for p in procs):
                break
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    if result is None:
        rep.add("problem", "all-reduce", f"{nproc} {backend} processes did not finish within {timeout:.0f} s")
    elif "error" in result:
        rep.add("problem", "all-reduce", result["error"])
    elif not result["correct"]:
        rep.add("problem", "all-reduce", f"wrong sum across {nproc} processes ({backend})")
    else:
        algbw = result["bytes"] / result["seconds"]
        busbw = algbw * 2 * (nproc - 1) / nproc  # bytes each process sends and receives (ring)
        rep.add("ok", "all-reduce", f"{nproc} {backend} processes: sum correct; {size_mb} MB in "
                                    f"{result['seconds'] * 1e3:.1f} ms = {algbw / GB:.2f} GB/s "
                                    f"(bus {busbw / GB:.2f} GB/s)")


# ---- run folder -------------------------------------------------------------------------------
def check_run_dir(rep: Report, run_dir: Path, needed_bytes: float = 0.0) -> None:
    """Create the folder if needed, write and delete a file, then compare free space with what is needed."""
    missing = [p for p in [run_dir, *run_dir.parents] if not p.exists()]
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".doctor-{os.getpid()}"
        probe.write_bytes(b"x" * 4096)
        probe.unlink()
    except OSError as e:
        rep.add("problem", "run folder", f"cannot write to '{run_dir}': {e.strerror or e}")
        return
    finally:
        for p in missing:  # leave the file system as it was
            if p.is_dir() and not any(p.iterdir()):
                p.rmdir()
    free = shutil.disk_usage(next(p for p in [run_dir, *run_dir.parents] if p.exists())).free
    detail = f"'{run_dir}' writable, {free / GB:.1f} GB free"
    if needed_bytes:
        detail += f"; checkpoints + final model need about {needed_bytes / GB:.2f} GB"
    verdict = "problem" if free < needed_bytes else "warning" if free < max(2 * needed_bytes, GB) else "ok"
    rep.add(verdict, "run folder", detail)


# ---- memory plan from a config -----------------------------------------------------------------
def check_memory(rep: Report, cfg, world: int, nproc: int, backend: str, avail: dict) -> float:
    """Batch plan and the memory plan per rank (memplan.py, as the launcher prints it) vs available;
    returns the disk bytes checkpoints will need."""
    try:
        accum = check_world(cfg, world)
        rep.add("ok", "batch plan", f"global {cfg.train.global_batch_size} = micro {cfg.train.micro_batch_size} "
                                    f"x world {world} x accum {accum}")
    except ConfigError as e:
        rep.add("problem", "batch plan", str(e))
        return 0.0
    try:
        shapes = memplan.shapes(cfg)
    except Exception as e:  # e.g. a hub model that is not in the local cache
        rep.add("warning", "memory plan", f"could not build the model's shapes: {type(e).__name__}: {e}")
        return 0.0
    device = "cuda" if backend == "nccl" else "cpu"
    have = avail.get("cuda", 0) if device == "cuda" else avail["host"]
    plan = memplan.estimate(cfg, shapes, world, device, have)
    detail = f"{shapes.parameters / 1e6:,.1f}M parameters; " + plan.line().removeprefix("memory plan: ")
    if plan.fits:
        verdict = "warning" if plan.peak > 0.85 * have else "ok"
    else:
        fix = memplan.suggest(cfg, shapes, world, device, have)
        verdict, detail = "problem", detail + " -- does not fit" + (f"; try {fix}" if fix else "")
    rep.add(verdict, "memory plan", detail)
    checkpoint = 12 * shapes.parameters  # fp32 weights + AdamW moments
    return checkpoint * (cfg.train.keep_checkpoints + 1) + 4 * shapes.parameters


# ---- command ----------------------------------------------------------------------------------
def run(args) -> int:

    config = next((i for i in args.items if "=" not in i), None)
    cfg = load_config(config, [i for i in args.items if i != config]) if args.items else None
    fewest, nodes = parse_nnodes(args.nnodes)
    nproc = args.nproc_per_node
    backend = pick_backend(cfg.dist.backend if cfg else "auto")
    rep = Report()
    check_torch(rep, backend, nproc)
    avail = check_devices(rep, nproc)
    check_port(rep, args.rdzv_endpoint)
    if nodes > 1:
        rep.add("warning", "multi-node", f"{nodes} nodes: only this node is checked; run doctor on every node")
    check_allreduce(rep, nproc, backend, args.timeout)
    # planned at the fewest nodes elastic membership allows, as the launcher does: the largest FSDP shard
    needed = check_memory(rep, cfg, fewest * nproc, nproc, backend, avail) if cfg else 0.0
    check_run_dir(rep, Path(args.run_dir or (cfg.run_dir if cfg else "runs")), needed)
    problems, warnings = rep.count("problem"), rep.count("warning")
    print(f"verdict: {'PROBLEM' if problems else 'ok'} ({problems} problem(s), {warnings} warning(s))", flush=True)
    return 1 if problems else 0
