"""Config + world shape -> PyTorch's elastic launcher (torch.distributed.run), and the run's outcome.

Everything that can be checked is checked here, before any worker starts (exit code 2). Workers get
the resolved config as a file path. Rendezvous is c10d on a free port (standalone) unless an endpoint is
given for multi-node. Each elastic attempt gets a fresh rendezvous store
(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: the shared one kept a dead worker's keys and the next attempt
failed or hung in 5 of 8 restarts on this machine). How the run ended is worked out once, here
(`finish`), and written to RUN/outcome.json for `phalanx report` and `phalanx sweep`.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import signal
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import NoReturn

import psutil
import torch
import torch.distributed.run as trun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from phalanx.core import dist
from phalanx.core.config import (
    Config,
    ConfigError,
    check_world,
    config_yaml,
    has_secret,
    hub_name,
    load_config,
    recorded_settings,
    relevant_subset,
    save_yaml,
)
from phalanx.core.runfolder import (
    EXIT_FAILED,
    EXIT_HANG,
    EXIT_OK,
    EXIT_PREEMPTED,
    RunFolder,
    read_json,
)
from phalanx.data import prepare
from phalanx.data.cache import build_once, cache_root
from phalanx.data.hub import check_hub_names, gguf_file, is_gguf_name
from phalanx.model import gguf, precision
from phalanx.model.build import check_attention
from phalanx.model.identity import base_identity, file_digest
from phalanx.data.samplers import WINDOWED
from phalanx.run.checkpoint import CheckpointError, check_safe, read_meta, resolve_resume
from phalanx.run.watchdog import summarize
from phalanx.run.worker import serve
from phalanx.tasks import get_task, prepare_data
from phalanx.tools import memplan
from phalanx.tools.failures import FailureReporter, GroupFailure
from phalanx.tools.oomwatch import MemoryWatch


def parse_nnodes(nnodes: str) -> tuple[int, int]:
    lo, _, hi = str(nnodes).partition(":")
    try:
        lo_i, hi_i = int(lo), int(hi or lo)
    except ValueError:
        raise ConfigError(f"--nnodes: expected N or MIN:MAX, got {nnodes!r}") from None
    if lo_i < 1 or hi_i < lo_i:
        raise ConfigError(f"--nnodes: expected 1 <= MIN <= MAX, got {nnodes!r}")
    return lo_i, hi_i


ENDPOINT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(?::(\d+))?")


def check_flags(nproc_per_node: int, nnodes: str, rdzv_endpoint: str, rdzv_id: str, max_restarts: int) -> None:
    """The launcher flags, in the forms torchrun accepts, before anything is written or moved."""
    if nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node: expected a whole number >= 1, got {nproc_per_node}")
    parse_nnodes(nnodes)
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts: expected a whole number >= 0, got {max_restarts}")
    match = ENDPOINT.fullmatch(rdzv_endpoint) if rdzv_endpoint else None
    if rdzv_endpoint and (not match or (match.group(2) and not 0 < int(match.group(2)) < 65536)):
        raise ConfigError(f"--rdzv-endpoint: expected HOST, HOST:PORT or [IPv6]:PORT with a port from 1 to "
                          f"65535, got {rdzv_endpoint!r}")
    if rdzv_id and not re.fullmatch(r"[A-Za-z0-9._-]+", rdzv_id):
        raise ConfigError(f"--rdzv-id: expected letters, digits, '.', '_' or '-', got {rdzv_id!r}")


def resolve_pretrained(cfg: Config, builds: bool = True) -> Config:
    """model.pretrained naming a GGUF file (a path, or 'hf:OWNER/REPO/FILE.gguf') -> the same config naming the
    file's dequantised fp32 folder in the cache (CACHE/gguf/<its sha256>, built once per content: model/gguf.py).
    Called first, before anything else reads model.pretrained (resume check, memory plan, weight check, data
    step, workers): RUN/config.yaml records the folder, whose gguf.json names the file, and the same command
    finds the same folder again, so it resumes. `builds=False` (not the node's first process under an outside
    torchrun/srun): wait for that process to build it. Any other file there is exit 2 saying what is accepted."""
    spec = cfg.model.pretrained
    local = Path(hub_name(spec)).expanduser()
    if not spec or local.is_dir() or (not local.is_file() and not is_gguf_name(spec)):
        return cfg  # from scratch, a folder, or a hub repo
    path = local if local.is_file() else gguf_file(spec)
    header = gguf.check(path)
    root = cache_root(cfg.data.cache_dir).absolute()
    sha = file_digest(path, root)
    folder = root / "gguf" / gguf.folder_name(sha)
    if not folder.exists() and builds:
        print(f"phalanx: dequantising {path.name} ({header.architecture}; {', '.join(header.quant_types)}) to "
              f"fp32 in {folder}", flush=True)
        started = time.perf_counter()
        source = spec if spec.startswith("hf:") and not local.is_file() else str(path.absolute())
        build_once(folder, partial(gguf.dequantise, path, source, sha, header))
        print(f"phalanx: dequantised in {time.perf_counter() - started:.1f} s", flush=True)
    elif not folder.exists():
        gguf.wait_for(folder, path, cfg.dist.startup_timeout_s)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, pretrained=str(folder)))


def preflight(cfg: Config, nproc_per_node: int, nnodes: str, force_resume: bool = False) -> None:
    """Checks that need no worker: world shape, backend, task settings, resume compatibility (the data
    is checked by the data step that follows: tasks.prepare_data)."""
    lo, hi = parse_nnodes(nnodes)
    for n in range(lo, hi + 1):  # elastic membership may settle on any node count in the range
        check_world(cfg, n * nproc_per_node)
    backend = dist.pick_backend(cfg.dist.backend)
    problem = dist.check_backend(backend) or dist.check_gpu_count(
        backend, nproc_per_node, torch.cuda.device_count() if backend == "nccl" else 0)
    if problem:
        raise ConfigError(problem)
    check_hardware(cfg)
    get_task(cfg.task).check_config(cfg)
    path = resolve_resume(cfg)
    try:
        meta = read_meta(path) if path else None
        if path:
            check_safe(path)  # refuse a checkpoint that could run code, before any worker loads it
    except CheckpointError as e:
        raise ConfigError(f"resume: {e}") from None
    if meta and not force_resume:
        # A key the checkpoint predates counts as its default (old checkpoints stay resumable); renamed keys count
        # under their new names
        saved, now = recorded_settings(meta.get("config", {}), cfg.task), relevant_subset(cfg)
        changed = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
        if changed:
            raise ConfigError(f"checkpoint '{path}' was made with different training settings: "
                              f"{', '.join(changed)}; use --fresh to start over or --force-resume")
    if meta:
        get_task(cfg.task).check_resume(cfg, meta, [n * nproc_per_node for n in range(lo, hi + 1)])
    if meta and "base_model" in meta and meta["base_model"] != base_identity(cfg.model.pretrained, cache_root(
            cfg.data.cache_dir)) and (not force_resume or cfg.model.lora.r):  # adapters need their own base
        raise ConfigError(f"checkpoint '{path}' was trained from another base model than model.pretrained="
                          f"'{cfg.model.pretrained}' (its config or weights differ); use --fresh to start over")


def check_shard_plan(cfg: Config, force_resume: bool = False) -> None:
    """Once the data step made the training store: a checkpoint whose sample order is the windowed one (data order
    4) resumes only on a store cut into the same shards (store.plan_digest, in meta.json), since that order is a
    function of the shard plan; another plan (another data.shard_mb) would repeat or skip samples of the epoch under
    way. The global order does not depend on the plan; checkpoints made before it was recorded resume as before."""
    path = resolve_resume(cfg)
    try:
        meta = read_meta(path) if path and not force_resume else {}
    except CheckpointError:
        return  # said by preflight
    saved = meta.get("shard_plan") or {}
    if not saved.get("digest") or (meta.get("train_state") or {}).get("data_order", 0) < WINDOWED:
        return
    if prepare.train_plan(cfg, get_task(cfg.task).FORMAT) in ("", saved["digest"]):
        return
    was, now = saved.get("shard_mb"), cfg.data.shard_mb
    how = (f"set data.shard_mb={was:g} as it was" if was is not None and was != now else
           "prepare the training data as it was (the same files and data.shard_mb)")
    raise ConfigError(f"checkpoint '{path}' was made with the training store cut into other shards (data.shard_mb="
                      f"{was if was is None else f'{was:g}'} then, {now:g} now) and its sample order "
                      f"(data.order=windowed) follows the shards: resuming would repeat or skip samples of the epoch "
                      f"under way; {how}, or use --fresh to start over (--force-resume to resume anyway)")


def check_pretrained(cfg: Config) -> None:
    """model.pretrained before any worker starts: its weights cover the task's model (the checkpoint's
    headers against the model's skeleton on the meta device: a parameter that would stay unloaded is exit
    2 naming it; load.WeightPlan), fetched once here for a hub name; and its identity hashed once (the
    workers find the digests cached)."""
    if not cfg.model.pretrained:
        return
    import transformers  # only here: ~2 s, as the memory plan

    from phalanx.model.load import WeightPlan
    from phalanx.model.weights import Checkpoint, pretrained_folder

    check_hub_names(cfg, data=False)  # a hub name that is neither cached nor reachable: one line, not retries
    task = get_task(cfg.task)
    folder = pretrained_folder(cfg.model.pretrained)
    with torch.device("meta"):
        model = getattr(transformers, task.AUTO_MODEL).from_config(transformers.AutoConfig.from_pretrained(folder))
    WeightPlan(model, Checkpoint(folder), mismatched=task.MISMATCHED)
    base_identity(cfg.model.pretrained, cache_root(cfg.data.cache_dir))


def plan_memory(cfg: Config, nproc_per_node: int, nnodes: str) -> None:
    """The memory plan per rank, said before any worker starts (exit 2 when it does not fit and
    train.memory_check=error). The fewest nodes elastic membership allows is the largest FSDP shard."""
    backend = dist.pick_backend(cfg.dist.backend)
    device = "cuda" if backend == "nccl" else "cpu"
    gpus = memplan.gpu_memory() if device == "cuda" else []
    memplan.check(cfg, parse_nnodes(nnodes)[0] * nproc_per_node, nproc_per_node, device,
                  min((free for _, free, _ in gpus), default=None), say=lambda text: print(text, flush=True))


def check_hardware(cfg: Config) -> None:
    """train.precision, train.cpu_offload and train.compile against the device the workers will use (errors only; each
    worker prints the warnings, e.g. emulated fp16 on CPU, with the precision it picked)."""
    device_type = "cuda" if dist.pick_backend(cfg.dist.backend) == "nccl" else "cpu"
    precision.check_precision(cfg.train.precision, device_type)
    precision.check_offload(cfg.train.cpu_offload, device_type)
    check_attention(cfg.model, device_type)
    if cfg.train.compile:
        precision.check_compile(device_type)


def check_multinode(nnodes: str, rdzv_endpoint: str, fresh: bool) -> None:
    """Flags that only make sense together when one launcher runs per node."""
    if parse_nnodes(nnodes)[1] > 1 and not rdzv_endpoint:
        raise ConfigError(f"--nnodes {nnodes}: more than one node needs --rdzv-endpoint HOST:PORT (the same "
                          f"on every node, e.g. the first node's address) and --rdzv-id")
    if rdzv_endpoint and fresh:
        raise ConfigError("--fresh with --rdzv-endpoint: every node's launcher would move the run folder "
                          "aside; move it once before starting the nodes, or give a new --run-dir")


def move_aside(run_dir: Path) -> Path | None:
    """--fresh: keep the old run folder under a new name instead of deleting it."""
    if not run_dir.exists():
        return None
    target = run_dir.with_name(f"{run_dir.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.rename(target)
    return target


def torchrun_args(module_argv: list[str], nproc_per_node: int, nnodes: str, rdzv_endpoint: str, rdzv_id: str,
                  max_restarts: int, log_dir: Path | None = None) -> list[str]:
    args = ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc_per_node),
            "--max-restarts", str(max_restarts), "--monitor-interval", "0.2"]
    if rdzv_endpoint:
        args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", rdzv_id or "phalanx"]
    else:
        args += ["--standalone"]
    if log_dir is not None:  # workers' stderr to files there (stdout, with rank 0's progress, stays)
        args += ["--log-dir", str(log_dir), "--redirects", "2"]
    return args + ["--module", *module_argv]


def launch(cfg: Config | str, nproc_per_node: int = 1, *, nnodes: str = "1", rdzv_endpoint: str = "",
           rdzv_id: str = "", max_restarts: int = 0, fresh: bool = False, force_resume: bool = False,
           overrides: list[str] = ()) -> int:
    """Validate, write RUN/config.yaml, start the workers, and report how the run ended (exit code)."""
    if not isinstance(cfg, Config):
        cfg = load_config(cfg, list(overrides))
    run_dir = Path(cfg.run_dir)
    check_flags(nproc_per_node, nnodes, rdzv_endpoint, rdzv_id, max_restarts)
    check_multinode(nnodes, rdzv_endpoint, fresh)
    cfg = resolve_pretrained(cfg)  # a GGUF file -> its dequantised folder, for everything below
    # --fresh: the old run goes aside below, so its checkpoints are not this run's to check
    preflight(dataclasses.replace(cfg, resume="never") if fresh else cfg, nproc_per_node, nnodes, force_resume)
    # Not overlapped with the data step in a thread: transformers' lazy imports are not thread-safe (a chat
    # tokenizer import failed while the plan imported a model class).
    plan_memory(cfg, nproc_per_node, nnodes)
    check_pretrained(cfg)
    prepare_data(cfg)
    if not fresh:
        check_shard_plan(cfg, force_resume)  # needs the store the data step just made or found
    if fresh:  # only now: a refused command leaves the run folder where it was
        old = move_aside(run_dir)
        if old:
            print(f"phalanx: --fresh: moved the previous run to {old}", flush=True)
    if not cfg.dist.threads_per_worker:
        cfg.dist.threads_per_worker = dist.default_threads(nproc_per_node)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = worker_config(cfg, run_dir, multinode=bool(rdzv_endpoint))
    RunFolder(run_dir).clear_outcome()

    try:
        failure = run_workers(["phalanx.run.worker", str(config_path)], nproc_per_node, cfg.dist.threads_per_worker,
                              nnodes=nnodes, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id, max_restarts=max_restarts,
                              folder=RunFolder(run_dir))
    finally:
        if config_path.parent != run_dir:
            config_path.unlink(missing_ok=True)
    return finish(RunFolder(run_dir), failure)


def run_workers(module_argv: list[str], nproc_per_node: int, threads: int, *, nnodes: str = "1",
                rdzv_endpoint: str = "", rdzv_id: str = "", max_restarts: int = 0,
                folder: RunFolder | None = None) -> GroupFailure | None:
    """Start `python -m MODULE ARGS` as workers under PyTorch's elastic agent; how the group failed
    (failures.GroupFailure: its failures ranked root cause first), or None.
    Every phalanx command that starts workers (train, predict) comes through here. With a run folder,
    the workers' stderr (the tracebacks a dying rank causes in the others) and the agent's own log go to
    RUN/logs, and the console keeps phalanx's one-line account of each failure, which names them."""
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # fresh store per elastic attempt
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("PYTHONUNBUFFERED", "1")

    # Slurm's pre-timeout signal: the elastic agent does not handle SIGUSR1, so hand it to the workers,
    # which save and stop exactly as on SIGTERM.
    signal.signal(signal.SIGUSR1, _forward_to_workers)
    memory = MemoryWatch()  # how each worker exited, and whether the OOM killer killed one
    reporter = FailureReporter(max_restarts, single_node=not rdzv_endpoint, memory=memory, folder=folder)
    logging.getLogger(FailureReporter.LOGGER).addHandler(reporter)
    log_dir = folder.logs if folder is not None else None
    args = trun.get_args_parser().parse_args(
        torchrun_args(module_argv, nproc_per_node, nnodes, rdzv_endpoint, rdzv_id, max_restarts, log_dir))
    quiet = _agent_log_to_file(log_dir / "launcher.log") if log_dir is not None else None
    try:
        memory.start()
        trun.run(args)
    except (ChildFailedError, SignalException) as e:
        return reporter.group_failure(e)
    finally:
        memory.stop()
        logging.getLogger(FailureReporter.LOGGER).removeHandler(reporter)
        if quiet is not None:
            quiet()
    return None


def _agent_log_to_file(path: Path):
    """Send the elastic agent's W/E log lines to `path` instead of the console; returns the undo."""
    path.parent.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger("torch.distributed.elastic")
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False

    def undo() -> None:
        logger.removeHandler(handler)
        handler.close()
        logger.propagate = True
    return undo


def worker_config(cfg: Config, run_dir: Path, multinode: bool) -> Path:
    """The config file this launcher's workers read. One node: RUN/config.yaml. Several nodes: a file
    private to this launcher, because launchers sharing the run folder must not overwrite each other's
    (a node's threads_per_worker follows its own core count); global rank 0 writes RUN/config.yaml. A URL
    with a secret (user:password, a presigned query) is redacted in RUN/config.yaml: the workers then read the
    real one from a file only the user can read (mode 0600), removed when the run ends."""
    if not multinode:
        save_yaml(cfg, RunFolder(run_dir).config)
        if not has_secret(cfg):
            return RunFolder(run_dir).config
    fd, name = tempfile.mkstemp(prefix="phalanx-config-", suffix=".yaml")  # mode 0600
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(config_yaml(cfg, secrets=True))
    return Path(name)


def _forward_to_workers(signum, frame) -> None:

    for child in psutil.Process().children(recursive=True):
        try:
            child.send_signal(signum)
        except psutil.Error:
            pass


def finish(folder: RunFolder, failure: GroupFailure | None) -> int:
    """Say how the run ended (one line on stderr), write RUN/outcome.json, return the exit code."""
    status, code, line, step, extra = ending(folder, failure)
    if status != "ok":
        print(f"phalanx: {line}", file=sys.stderr, flush=True)
    folder.write_outcome(status, code, line, step, **extra)
    return code


def ending(folder: RunFolder, failure: GroupFailure | None) -> tuple[str, int, str, int | None, dict]:
    """(status, exit code, one-line account, step, extra outcome.json keys), from the markers the workers
    left, then the group's failure. The markers come first: the agent reports a failure (or its own
    signal) even when every worker saved on SIGTERM and exited 0, or stopped together on a NaN."""
    preempted = read_json(folder.preempted)
    if preempted:
        step = preempted["step"]
        return ("preempted", EXIT_PREEMPTED, f"preempted at step {step}; run the same command to resume", step,
                {"signal": preempted.get("signal")})
    hang = summarize(folder.hang)
    if hang:
        folder.hang_summary.write_text(hang + "\n")
        return "hang", EXIT_HANG, hang, folder.last_step(), {}
    error = read_json(folder.error)
    if error:
        return "failed", EXIT_FAILED, f"stopped: {error['error']}", error.get("step"), {}
    if failure is not None:
        cause = failure.ranked[0] if failure.ranked else None
        return ("failed", EXIT_FAILED, f"training failed: {failure.line()}", folder.last_step(),
                {"rank": cause.rank if cause else None, "pid": cause.pid if cause else None,
                 "consequences": failure.consequences()})
    summary = read_json(folder.summary) or {}
    step = summary.get("steps", folder.last_step())
    return "ok", EXIT_OK, f"finished at step {step}", step, {}


def run_as_worker(cfg: Config) -> NoReturn:
    """Already inside torchrun/srun: be that worker instead of launching again, through the one worker
    entry point (run/worker.serve: the rank's error record, exit without the Gloo teardown). A GGUF base is
    dequantised by the node's first process; the others wait for its folder."""
    cfg = resolve_pretrained(cfg, builds=os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")) == "0")
    get_task(cfg.task).check_config(cfg)
    check_world(cfg, int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1"))))
    check_hardware(cfg)
    serve(lambda: cfg, preempted_code=EXIT_PREEMPTED)
