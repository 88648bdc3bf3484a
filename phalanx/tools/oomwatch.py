"""Did the kernel's OOM killer kill a worker, and how much memory did the workers hold?

A worker killed by SIGKILL looks the same whether the OOM killer, a scheduler or a user sent it. The
kernel counts its OOM kills (`oom_kill`) in the cgroup files and in /proc/vmstat, so the launcher reads
those counters when it starts and again when a worker dies: a counter that rose means out of memory.
The RSS peaks come from sampling the launcher's process tree, because a killed worker can no longer
say how much it held. No torch here: the launcher imports this before any worker exists.
"""
from __future__ import annotations

import threading
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


class MemoryWatch:
    """Started by the launcher before the workers: keeps the peak RSS of all its descendants together
    and of the largest single one (sampled every `interval` seconds), and the OOM counters at start."""

    def __init__(self, sources=None, interval: float = 0.1, pid: int | None = None):
        self.sources = counter_sources() if sources is None else [Path(p) for p in sources]
        self.interval, self.pid = min(interval, 0.1), pid
        self.peak_total = self.peak_one = 0
        self.baseline: dict[Path, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "MemoryWatch":
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
        """One reading of the process tree's resident memory (shared pages count in each process)."""
        try:
            children = psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            return
        total = one = 0
        for child in children:
            try:
                rss = child.memory_info().rss
            except psutil.Error:  # exited between listing and reading
                continue
            total, one = total + rss, max(one, rss)
        self.peak_total, self.peak_one = max(self.peak_total, total), max(self.peak_one, one)

    def describe(self) -> str:
        return (f"peak memory seen: {self.peak_total / GB:.1f} GB for all workers, "
                f"{self.peak_one / GB:.1f} GB in one worker")

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)
