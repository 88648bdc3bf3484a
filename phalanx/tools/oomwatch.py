"""How did each worker end, did the kernel's OOM killer kill one, and how much memory did they hold?

A worker killed by SIGKILL looks the same whether the OOM killer, a scheduler or a user sent it. The
kernel counts its OOM kills (`oom_kill`) in the cgroup files and in /proc/vmstat, so the launcher reads
those counters when it starts and again when a worker dies: a counter that rose means out of memory.
The RSS peaks come from sampling the launcher's process tree, because a killed worker can no longer
say how much it held. The exit status of every worker (ExitWatch) is read the moment it exits, because
the elastic agent keeps only the one failure it logs until the group is given up. No torch here: the
launcher imports this before any worker exists.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

OOM_KEY = "oom_kill"
GB = 2 ** 30  # as doctor.py: binary gigabytes, printed as "GB"


def counter_sources(proc_cgroup: str | Path = "/proc/self/cgroup",
                    mountinfo: str | Path = "/proc/self/mountinfo",
                    vmstat: str | Path = "/proc/vmstat") -> list[Path]:
    """The files that count OOM kills for this process, most specific first: its cgroup v2
    memory.events, its cgroup v1 memory.oom_control, then the system-wide /proc/vmstat. Only files that
    exist are returned; the arguments exist so that tests can point at their own files."""
    mounts = _cgroup_mounts(mountinfo)
    found: list[Path] = []
    for line in _read_lines(proc_cgroup):
        hierarchy, _, rest = line.partition(":")
        controllers, _, cg_path = rest.partition(":")
        if hierarchy == "0" and not controllers:  # cgroup v2: "0::/path"
            kind, name = "cgroup2", "memory.events"
        elif "memory" in controllers.split(","):  # cgroup v1: "4:memory:/path"
            kind, name = "memory", "memory.oom_control"
        else:
            continue
        for root, mount_point in mounts.get(kind, []):
            path = _under_mount(mount_point, root, cg_path) / name
            if path.is_file() and path not in found:
                found.append(path)
    if Path(vmstat).is_file():
        found.append(Path(vmstat))
    return found


def _cgroup_mounts(mountinfo: str | Path) -> dict[str, list[tuple[str, Path]]]:
    """{"cgroup2": [(root, mount point)], "memory": [...]} from mountinfo lines such as
    '35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory'."""
    mounts: dict[str, list[tuple[str, Path]]] = {}
    for line in _read_lines(mountinfo):
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        fstype, options = tail[0], tail[2].split(",")
        if fstype == "cgroup2":
            mounts.setdefault("cgroup2", []).append((fields[3], Path(fields[4])))
        elif fstype == "cgroup" and "memory" in options:
            mounts.setdefault("memory", []).append((fields[3], Path(fields[4])))
    return mounts


def _under_mount(mount_point: Path, root: str, cg_path: str) -> Path:
    # A container may mount only its own subtree (root != "/"); the process's path is then relative to it.
    if root != "/" and (cg_path == root or cg_path.startswith(root.rstrip("/") + "/")):
        cg_path = cg_path[len(root):]
    return mount_point / cg_path.lstrip("/")


def read_oom_kills(path: str | Path) -> int | None:
    """The `oom_kill` value of a 'name value' file (memory.events, memory.oom_control, /proc/vmstat);
    None when the file is gone or has no such line (an older kernel)."""
    for line in _read_lines(path):
        name, _, value = line.partition(" ")
        if name == OOM_KEY:
            try:
                return int(value)
            except ValueError:
                return None
    return None


def read_counters(paths) -> dict[Path, int]:
    """Each readable source's `oom_kill` counter; unreadable ones are left out."""
    values = {Path(p): read_oom_kills(p) for p in paths}
    return {p: v for p, v in values.items() if v is not None}


def _read_lines(path: str | Path) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return []


@dataclass(frozen=True)
class WorkerExit:
    pid: int
    rank: int | None        # RANK and LOCAL_RANK of the worker's environment
    local_rank: int | None
    exitcode: int | None    # as subprocess reports it (negative: killed by that signal); None: not seen
    time: float             # when it was seen (Unix time)


class ExitWatch:
    """How each worker process ended, as the kernel reports it, read without reaping it.

    The elastic agent reaps its workers on its own poll (every 0.2 s) and, until it gives the group up,
    reports only the failure with the earliest whole-second timestamp. Here one thread per worker blocks
    in waitid(WNOWAIT): it wakes the moment the worker exits and reads its status, leaving the process for
    the agent to reap as before. Should the agent reap it first, the exit is kept with exitcode None.
    Only the launcher's own children can be watched (the kernel's rule for waitid)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._threads: dict[int, threading.Thread] = {}
        self._ranks: dict[int, tuple[int | None, int | None]] = {}
        self.exits: dict[int, WorkerExit] = {}

    def follow(self, pid: int, rank: int | None, local_rank: int | None) -> None:
        if not hasattr(os, "waitid"):
            return
        with self._lock:
            if pid in self._threads:
                return
            self._ranks[pid] = (rank, local_rank)
            thread = self._threads[pid] = threading.Thread(target=self._wait, args=(pid,), daemon=True,
                                                           name=f"phalanx-exit-watch-{pid}")
        thread.start()

    def followed(self) -> dict[int, tuple[int | None, int | None]]:
        """pid -> (rank, local rank) of every worker followed so far."""
        with self._lock:
            return dict(self._ranks)

    def settle(self, timeout: float = 1.0) -> dict[int, WorkerExit]:
        """The exits seen so far, after giving the watchers of processes that are gone a moment to
        record theirs (the agent logs a failure right after reaping it)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            threads = list(self._threads.items())
        for pid, thread in threads:
            if thread.is_alive() and not _running(pid):
                thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            return dict(self.exits)

    def _wait(self, pid: int) -> None:
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
            code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        except ChildProcessError:  # reaped by the agent first (or not our child)
            code = None
        rank, local_rank = self._ranks[pid]
        with self._lock:
            self.exits[pid] = WorkerExit(pid, rank, local_rank, code, time.time())


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _rank_of(child: psutil.Process) -> tuple[int | None, int | None] | None:
    """(RANK, LOCAL_RANK) from a child's environment; None for a child that is not a worker (yet)."""
    try:
        env = child.environ()
        return int(env["RANK"]), int(env["LOCAL_RANK"]) if "LOCAL_RANK" in env else None
    except (psutil.Error, KeyError, ValueError):
        return None


class MemoryWatch:
    """Started by the launcher before the workers: keeps the peak RSS of all its descendants together
    and of the largest single one (sampled every `interval` seconds), the OOM counters at start, and
    (`exits`) how each worker it saw started ended."""

    def __init__(self, sources=None, interval: float = 0.1, pid: int | None = None):
        self.sources = counter_sources() if sources is None else [Path(p) for p in sources]
        self.interval, self.pid = min(interval, 0.1), pid
        self.peak_total = self.peak_one = 0
        self.baseline: dict[Path, int] = {}
        self.exits = ExitWatch()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> MemoryWatch:
        self.snapshot()
        self._thread = threading.Thread(target=self._run, name="phalanx-memory-watch", daemon=True)
        self._thread.start()
        return self

    def snapshot(self) -> dict[Path, int]:
        """Record the counters as they are now: later rises count as OOM kills. The launcher calls it
        again after each reported failure so that a restart attempt is judged on its own."""
        self.baseline = read_counters(self.sources)
        return self.baseline

    def oom_killed(self) -> bool:
        """Whether any OOM counter rose since the last snapshot."""
        now = read_counters(self.sources)
        return any(now[p] > before for p, before in self.baseline.items() if p in now)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def sample(self) -> None:
        """One reading of the process tree's resident memory (shared pages count in each process); a new
        worker among the children is followed until it exits (ExitWatch)."""
        try:
            children = psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            return
        total = one = 0
        followed = self.exits.followed()
        for child in children:
            try:
                rss = child.memory_info().rss
                mine = child.ppid() == os.getpid()  # waitid: only our own children
            except psutil.Error:  # exited between listing and reading
                continue
            if mine and child.pid not in followed:  # a worker the agent just started
                ranks = _rank_of(child)
                if ranks is not None:
                    self.exits.follow(child.pid, *ranks)
            total, one = total + rss, max(one, rss)
        self.peak_total, self.peak_one = max(self.peak_total, total), max(self.peak_one, one)

    def describe(self) -> str:
        return (f"peak memory seen: {self.peak_total / GB:.1f} GB for all workers, "
                f"{self.peak_one / GB:.1f} GB in one worker")

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)
