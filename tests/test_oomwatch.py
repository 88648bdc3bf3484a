"""A worker killed by the OOM killer is reported as out of memory, with the peak memory the launcher saw;
how each worker exited is read without taking it from the elastic agent (ExitWatch)."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

from phalanx.tools import oomwatch
from phalanx.tools.failures import Failure, FailureReporter, describe
from phalanx.tools.oomwatch import (
    GB,
    ExitWatch,
    MemoryWatch,
    counter_sources,
    read_counters,
    read_oom_kills,
)

CGROUP2_EVENTS = "low 0\nhigh 0\nmax {n}\noom {n}\noom_kill {n}\noom_group_kill 0\n"
CGROUP1_OOM_CONTROL = "oom_kill_disable 0\nunder_oom 0\noom_kill {n}\n"
VMSTAT = ("nr_free_pages 2965442\nnr_zone_inactive_anon 1088\nnr_zone_active_anon 1346712\n"
          "pgfault 912373650\npgmajfault 10822\nnuma_hit 1021933443\noom_kill {n}\n"
          "compact_stall 0\nthp_fault_alloc 26915\nswap_ra 0\n")
FORMATS = {"memory.events": CGROUP2_EVENTS, "memory.oom_control": CGROUP1_OOM_CONTROL, "vmstat": VMSTAT}


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_each_format_gives_its_oom_kill_counter(tmp_path):
    for name, text in FORMATS.items():
        assert read_oom_kills(write(tmp_path / name, text.format(n=3))) == 3, name
    # oom_kill_disable is not the counter; a kernel without the line and a missing file give None
    assert read_oom_kills(write(tmp_path / "old", "oom_kill_disable 1\nunder_oom 0\n")) is None
    assert read_oom_kills(tmp_path / "missing") is None
    assert read_counters([tmp_path / "vmstat", tmp_path / "missing"]) == {tmp_path / "vmstat": 3}


def test_a_rise_in_any_counter_is_an_oom_kill_and_no_rise_is_not(tmp_path):
    for name, text in FORMATS.items():
        path = write(tmp_path / name, text.format(n=1))
        others = [write(tmp_path / f"other-{o}", t.format(n=0)) for o, t in FORMATS.items() if o != name]
        watch = MemoryWatch(sources=[path, *others, tmp_path / "missing"])
        watch.snapshot()
        assert not watch.oom_killed(), name
        write(path, text.format(n=2))
        assert watch.oom_killed(), name
        watch.snapshot()  # as after a reported failure: the next attempt starts clean
        assert not watch.oom_killed(), name


def test_counter_files_are_found_from_the_process_cgroups(tmp_path):
    v1 = write(tmp_path / "fs/memory/job/42/memory.oom_control", CGROUP1_OOM_CONTROL.format(n=0))
    v2 = write(tmp_path / "fs/unified/user.slice/app/memory.events", CGROUP2_EVENTS.format(n=0))
    vmstat = write(tmp_path / "vmstat", VMSTAT.format(n=0))
    cgroup = write(tmp_path / "cgroup", "9:name=systemd:/\n4:cpu,memory:/job/42\n1:cpu:/\n0::/user.slice/app\n")
    mountinfo = write(tmp_path / "mountinfo", (
        f"31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
        f"35 31 0:32 / {tmp_path}/fs/memory rw,relatime - cgroup cgroup rw,cpu,memory\n"
        f"36 31 0:33 / {tmp_path}/fs/cpu rw,relatime - cgroup cgroup rw,cpu\n"
        f"41 31 0:38 / {tmp_path}/fs/unified rw,relatime - cgroup2 cgroup2 rw\n"))
    assert counter_sources(cgroup, mountinfo, vmstat) == [v1, v2, vmstat]
    # a container that mounts only its own subtree: the cgroup path is taken relative to the mount's root
    inner = write(tmp_path / "fs2/memory.oom_control", CGROUP1_OOM_CONTROL.format(n=0))
    write(tmp_path / "mountinfo2", f"35 31 0:32 /job/42 {tmp_path}/fs2 rw - cgroup cgroup rw,memory\n")
    assert counter_sources(cgroup, tmp_path / "mountinfo2", tmp_path / "none") == [inner]
    # nothing there (not Linux, no /proc): no sources, and nothing ever counts as an OOM kill
    assert counter_sources(tmp_path / "none", tmp_path / "none", tmp_path / "none") == []
    assert not MemoryWatch(sources=[]).start().oom_killed()


def oom_watch(tmp_path, killed: bool) -> MemoryWatch:
    path = write(tmp_path / "memory.oom_control", CGROUP1_OOM_CONTROL.format(n=0))
    watch = MemoryWatch(sources=[path])
    watch.snapshot()
    watch.peak_total, watch.peak_one = int(23.4 * GB), int(12.1 * GB)
    write(path, CGROUP1_OOM_CONTROL.format(n=1 if killed else 0))
    return watch


def failed(code, local_rank, pid) -> logging.LogRecord:
    return logging.LogRecord(FailureReporter.LOGGER, logging.ERROR, __file__, 1,
                             "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s",
                             (code, local_rank, pid, sys.executable), None)


def test_the_account_says_out_of_memory_only_for_an_oom_kill(tmp_path, capsys):
    oom = ("rank 1 (pid 123) killed by SIGKILL: out of memory (the kernel's OOM killer; "
           "peak memory seen: 23.4 GB for all workers, 12.1 GB in one worker)")
    for killed, code, want in [(True, -9, oom), (False, -9, "rank 1 (pid 123) killed by SIGKILL"),
                               # another signal or an exit code keeps its wording even when the counter rose
                               (True, -15, "rank 1 (pid 123) killed by SIGTERM"),
                               (True, 1, "rank 1 (pid 123) exited with code 1")]:
        FailureReporter(max_restarts=0, single_node=True, memory=oom_watch(tmp_path, killed)).emit(failed(code, 1, 123))
        assert capsys.readouterr().err.splitlines()[0] == f"phalanx: {want}; no restarts left (--max-restarts 0)"
    assert describe(Failure(rank=None, pid=7, exitcode=-15, local_rank=0), single_node=False) == \
        "local rank 0 on this node (pid 7) killed by SIGTERM"


def test_failure_reporter_prints_the_oom_line_then_judges_the_next_attempt_afresh(tmp_path, capsys):
    reporter = FailureReporter(max_restarts=1, single_node=True, memory=oom_watch(tmp_path, killed=True))
    reporter.emit(failed(-9, 1, 123))
    reporter.emit(failed(-9, 1, 124))  # the counter did not rise again: a plain SIGKILL this time
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == ("phalanx: rank 1 (pid 123) killed by SIGKILL: out of memory (the kernel's OOM killer; "
                        "peak memory seen: 23.4 GB for all workers, 12.1 GB in one worker); "
                        "restarting all workers from the latest checkpoint (restart 1 of 1)")
    assert lines[1] == "phalanx: rank 1 (pid 124) killed by SIGKILL; no restarts left (--max-restarts 1)"


def test_exit_watch_reads_each_status_and_leaves_the_process_to_its_owner():
    """A child killed by SIGKILL and one that exits 3: the watch sees both statuses, and Popen (the
    agent's reaper) still gets them: waitid(WNOWAIT) does not reap."""
    watch = ExitWatch()
    killed = subprocess.Popen([sys.executable, "-c", "import os, signal, time; time.sleep(0.3); "
                               "os.kill(os.getpid(), signal.SIGKILL)"])
    exits3 = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3); raise SystemExit(3)"])
    watch.follow(killed.pid, 1, 1)
    watch.follow(exits3.pid, 0, 0)
    deadline = time.monotonic() + 10
    while len(watch.exits) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert watch.exits[killed.pid].exitcode == -signal.SIGKILL and watch.exits[killed.pid].rank == 1
    assert watch.exits[exits3.pid].exitcode == 3 and watch.exits[exits3.pid].time <= time.time()
    assert killed.wait(timeout=5) == -signal.SIGKILL and exits3.wait(timeout=5) == 3  # still theirs to reap


def test_exit_watch_keeps_an_exit_it_was_too_late_for_with_no_status():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=10)  # reaped by its owner before the watch looked
    watch = ExitWatch()
    watch.follow(child.pid, 0, 0)
    assert watch.settle(timeout=5)[child.pid].exitcode is None


def test_memory_watch_follows_only_its_own_worker_children():
    """A child with RANK in its environment is followed; one without is not (not a worker)."""
    watch = MemoryWatch(sources=[], interval=0.02).start()
    env = {**os.environ, "RANK": "4", "LOCAL_RANK": "0"}
    try:
        worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1); raise SystemExit(5)"], env=env)
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"],
                                 env={k: v for k, v in os.environ.items() if k != "RANK"})
        deadline = time.monotonic() + 10
        while worker.pid not in watch.exits.exits and time.monotonic() < deadline:
            time.sleep(0.05)
        worker.wait(timeout=10)
        other.wait(timeout=10)
    finally:
        watch.stop()
    assert watch.exits.exits[worker.pid].exitcode == 5 and watch.exits.exits[worker.pid].rank == 4
    assert other.pid not in watch.exits.followed()


def test_the_sampler_sees_a_child_that_allocates_200_mb():
    watch = MemoryWatch(sources=[], interval=0.02).start()
    try:
        # bytes * n writes every page, so the memory is resident (a zeroed bytearray might not be)
        child = subprocess.Popen([sys.executable, "-c", "import time; b = b'x' * (200 << 20); time.sleep(1)"])
        deadline = time.monotonic() + 5
        while watch.peak_one < 150 * 2 ** 20 and time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.05)
        child.wait(timeout=5)
    finally:
        watch.stop()
    assert watch.peak_one >= 150 * 2 ** 20, watch.describe()
    assert watch.peak_total >= watch.peak_one
    assert not watch._thread.is_alive()


def test_the_real_sources_of_this_machine_are_readable():
    # whatever this machine has (cgroup v1, v2, or only /proc/vmstat), each source found has a counter
    sources = oomwatch.counter_sources()
    assert set(read_counters(sources)) == set(sources)
