"""Config + world shape -> PyTorch's elastic launcher (torch.distributed.run), and the run's outcome.

Everything that can be checked is checked here, before any worker starts (exit code 2). Workers get
the resolved config as a file path. Rendezvous is c10d on a free port (standalone) unless an endpoint is
given for multi-node. Each elastic attempt gets a fresh rendezvous store
(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, DESIGN.md pitfall 1).
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
from pathlib import Path

import psutil
import torch.distributed.run as trun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from phalanx.core import dist
from phalanx.core.config import (
    Config,
    ConfigError,
    check_world,
    load_config,
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
from phalanx.model import precision
from phalanx.run.checkpoint import CheckpointError, check_safe, read_meta, resolve_resume
from phalanx.run.train import train
from phalanx.run.watchdog import summarize
from phalanx.tasks import get_task, prepare_data
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


def preflight(cfg: Config, nproc_per_node: int, nnodes: str, force_resume: bool = False) -> None:
    """Checks that need no worker: world shape, backend, task settings, resume compatibility (the data
    is checked by the data step that follows: tasks.prepare_data)."""
    lo, hi = parse_nnodes(nnodes)
    for n in range(lo, hi + 1):  # elastic membership may settle on any node count in the range
        check_world(cfg, n * nproc_per_node)
    problem = dist.check_backend(dist.pick_backend(cfg.dist.backend))
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
        # A key the checkpoint predates counts as its default (old checkpoints stay resumable).
        saved, now = {**relevant_subset(Config()), **meta.get("config", {})}, relevant_subset(cfg)
        changed = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
        if changed:
            raise ConfigError(f"checkpoint '{path}' was made with different training settings: "
                              f"{', '.join(changed)}; use --fresh to start over or --force-resume")


def check_hardware(cfg: Config) -> None:
    """train.precision and train.compile against the device the workers will use (errors only; each
    worker prints the warnings, e.g. emulated fp16 on CPU, with the precision it picked)."""
    device_type = "cuda" if dist.pick_backend(cfg.dist.backend) == "nccl" else "cpu"
    precision.check_precision(cfg.train.precision, device_type)
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
    # --fresh: the old run goes aside below, so its checkpoints are not this run's to check
    preflight(dataclasses.replace(cfg, resume="never") if fresh else cfg, nproc_per_node, nnodes, force_resume)
    prepare_data(cfg)
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
    return outcome(run_dir, failure)


def run_workers(module_argv: list[str], nproc_per_node: int, threads: int, *, nnodes: str = "1",
                rdzv_endpoint: str = "", rdzv_id: str = "", max_restarts: int = 0, folder: RunFolder | None = None):
    """Start `python -m MODULE ARGS` as workers under PyTorch's elastic agent; the failure, or None.
    Every phalanx command that starts workers (train, predict) comes through here. With a run folder,
    the workers' stderr (the tracebacks a dying rank causes in the others) and the agent's own log go to
    RUN/logs, and the console keeps phalanx's one-line account of each failure, which names them."""
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # fresh store per elastic attempt
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("PYTHONUNBUFFERED", "1")

    # Slurm's pre-timeout signal: the elastic agent does not handle SIGUSR1, so hand it to the workers,
    # which save and stop exactly as on SIGTERM.
    signal.signal(signal.SIGUSR1, _forward_to_workers)
    memory = MemoryWatch()  # so that a worker killed by the OOM killer is reported as out of memory
    failures = FailureReporter(max_restarts, single_node=not rdzv_endpoint, memory=memory, folder=folder)
    logging.getLogger(FailureReporter.LOGGER).addHandler(failures)
    log_dir = folder.logs if folder is not None else None
    args = trun.get_args_parser().parse_args(
        torchrun_args(module_argv, nproc_per_node, nnodes, rdzv_endpoint, rdzv_id, max_restarts, log_dir))
    quiet = _agent_log_to_file(log_dir / "launcher.log") if log_dir is not None else None
    try:
        memory.start()
        trun.run(args)
    except (ChildFailedError, SignalException) as e:
        return e
    finally:
        memory.stop()
        logging.getLogger(FailureReporter.LOGGER).removeHandler(failures)
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


class FailureReporter(logging.Handler):
    """Says in phalanx's words which worker failed and why, and whether the group restarts. The elastic
    agent knows (it logs 'failed (exitcode: X) local_rank: L (pid: P)' once per failed attempt, for the
    first worker that failed); the workers restarted after it say from which step they resume. With a
    MemoryWatch (oomwatch.py), a worker killed by the kernel's OOM killer is said to be out of memory."""

    LOGGER = "torch.distributed.elastic.multiprocessing.api"

    def __init__(self, max_restarts: int, single_node: bool, memory: MemoryWatch | None = None,
                 folder: RunFolder | None = None):
        super().__init__(logging.ERROR)
        self.max_restarts, self.single_node, self.failures = max_restarts, single_node, 0
        self.memory, self.folder = memory, folder

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        if not str(record.msg).startswith("failed (exitcode") or len(args) < 3:
            return  # another message, or a torch whose wording changed: its own log line still says it
        code, local_rank, pid = args[:3]
        self.failures += 1
        line = failure_line(code, local_rank, pid, self.single_node, self.memory, self.folder)
        if self.memory is not None:
            self.memory.snapshot()  # the next attempt's OOM kills are its own
        print(f"phalanx: {line}; "
              + (f"restarting all workers from the latest checkpoint (restart {self.failures} of "
                 f"{self.max_restarts})" if self.failures <= self.max_restarts else
                 f"no restarts left (--max-restarts {self.max_restarts})")
              + (f"; all workers' output in {self.folder.logs}" if self.folder is not None else ""),
              file=sys.stderr, flush=True)


def failure_line(code, local_rank, pid, single_node: bool, memory: MemoryWatch | None = None,
                 folder: RunFolder | None = None) -> str:
    who = f"rank {local_rank}" if single_node else f"local rank {local_rank} on this node"
    try:
        code = int(code)
    except (TypeError, ValueError):
        return f"{who} (pid {pid}) failed (exit code {code})"
    if code < 0:
        try:
            why = f"killed by {signal.Signals(-code).name}"
        except ValueError:
            why = f"killed by signal {-code}"
        if code == -signal.SIGKILL and memory is not None and memory.oom_killed():
            why += f": out of memory (the kernel's OOM killer; {memory.describe()})"
    else:
        own = folder.rank_error(int(pid)) if folder is not None else None
        why = f"exited with code {code}" + (f": {own}" if own else "")
    return f"{who} (pid {pid}) {why}"


def failure_line_of(failure, folder: RunFolder | None = None) -> str:
    """One line for a failed worker group: which rank failed first and why (never torch's banner)."""
    failures = getattr(failure, "failures", None)  # ChildFailedError: {global rank: ProcessFailure}
    if failures:
        rank, first = min(failures.items(), key=lambda item: item[1].timestamp)
        return failure_line(first.exitcode, rank, first.pid, single_node=True, folder=folder)
    sigval = getattr(failure, "sigval", None)  # SignalException: the launcher itself got a signal
    if sigval is not None:
        return f"the launcher received {signal.Signals(sigval).name}"
    text = str(failure).strip()
    return text.splitlines()[0] if text else repr(failure)


def worker_config(cfg: Config, run_dir: Path, multinode: bool) -> Path:
    """The config file this launcher's workers read. One node: RUN/config.yaml. Several nodes: a file
    private to this launcher, because launchers sharing the run folder must not overwrite each other's
    (a node's threads_per_worker follows its own core count); global rank 0 writes RUN/config.yaml."""
    if not multinode:
        save_yaml(cfg, RunFolder(run_dir).config)
        return RunFolder(run_dir).config
    fd, name = tempfile.mkstemp(prefix="phalanx-config-", suffix=".yaml")
    os.close(fd)
    save_yaml(cfg, name)
    return Path(name)


def _forward_to_workers(signum, frame) -> None:

    for child in psutil.Process().children(recursive=True):
        try:
            child.send_signal(signum)
        except psutil.Error:
            pass


def outcome(run_dir: Path, failure) -> int:
    """Turn markers left by the workers into a one-line message and an exit code."""

    folder = RunFolder(run_dir)
    preempted = read_json(folder.preempted)
    if preempted:
        print(f"phalanx: preempted at step {preempted['step']}; run the same command to resume", file=sys.stderr,
              flush=True)
        return EXIT_PREEMPTED
    hang = summarize(folder.hang)
    if hang:
        folder.hang_summary.write_text(hang + "\n")
        print(f"phalanx: {hang}", file=sys.stderr, flush=True)
        return EXIT_HANG
    error = read_json(folder.error)
    if error:
        print(f"phalanx: stopped: {error['error']}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    if failure is not None:
        print(f"phalanx: training failed: {failure_line_of(failure, folder)}",
              file=sys.stderr, flush=True)
        return EXIT_FAILED
    return EXIT_OK


def run_as_worker(cfg: Config) -> int:
    """Already inside torchrun/srun: be that worker instead of launching again."""
    get_task(cfg.task).check_config(cfg)
    check_world(cfg, int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1"))))
    check_hardware(cfg)
    summary = train(cfg)
    return EXIT_PREEMPTED if summary.get("preempted") else EXIT_OK
