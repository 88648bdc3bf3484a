"""The failure account names the root cause: the rank that died by itself (a signal the launcher did not
send, the OOM killer, its own error) before the ranks that failed because a peer vanished or that the
launcher stopped. Pure ranking over synthetic failures, the launcher's reporter over synthetic agent log
lines, the workers' lost-peer classification, and real runs (tests/test_resilience.py has the race)."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys

import pytest
import torch.distributed as tdist
from conftest import REPO, lm_args, srun_env, zygote_python
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from phalanx.core.runfolder import RunFolder, write_json
from phalanx.run.worker import is_lost_peer
from phalanx.tools.failures import (
    Failure,
    FailureReporter,
    GroupFailure,
    cause_rank,
    consequences,
    describe,
    rank_failures,
)
from phalanx.tools.oomwatch import WorkerExit

GLOO = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
        "[127.0.0.1]:21174: Connection reset by peer. This is typically caused by a remote worker hanging or "
        "bugs in the application. Check the logs of the remote worker before reporting an error. GLHF!")
KILLED = Failure(rank=1, pid=11, exitcode=-9, time=100.2)
SURVIVOR = Failure(rank=0, pid=10, exitcode=1, error=GLOO, error_type="RuntimeError", lost_peer=True, time=100.1)


# ---- the ranking, a pure function -------------------------------------------------------------
@pytest.mark.parametrize("order", ["killed first", "survivor first"])
@pytest.mark.parametrize("times", [(100.2, 100.1), (100.1, 100.2), (None, None)], ids=["survivor-earlier",
                                                                                         "killed-earlier", "no-times"])
def test_the_killed_rank_comes_before_the_survivors_gloo_error(order, times):
    killed = Failure(rank=1, pid=11, exitcode=-9, time=times[0])
    survivor = Failure(rank=0, pid=10, exitcode=1, error=GLOO, error_type="RuntimeError", lost_peer=True,
                       time=times[1])
    given = [killed, survivor] if order == "killed first" else [survivor, killed]
    ranked = rank_failures(given)
    assert ranked == [killed, survivor]
    assert describe(ranked[0]) == "rank 1 (pid 11) killed by SIGKILL"
    assert consequences(ranked[1:]) == "rank 0 lost a peer (RuntimeError)"


def test_without_the_lost_peer_mark_the_earlier_error_would_win():
    """Negative control: the same survivor, classified as its own error, is ranked by time and wins."""
    own = Failure(rank=0, pid=10, exitcode=1, error=GLOO, lost_peer=False, time=100.1)
    assert rank_failures([KILLED, own])[0] is own


def test_a_rank_the_launcher_stopped_is_a_consequence_but_another_sigterm_is_a_cause():
    stopped = Failure(rank=0, pid=10, exitcode=-15, stopped=True, time=100.0)
    assert rank_failures([stopped, KILLED]) == [KILLED, stopped]
    assert consequences([stopped]) == "rank 0 stopped by the launcher"
    # a SIGTERM somebody else sent to one worker (no 'closing signal' from the agent) is where it started
    outside = Failure(rank=0, pid=10, exitcode=-15, time=100.0)
    assert rank_failures([KILLED, outside])[0] is outside and cause_rank(outside) == 0
    # stopped by the launcher whatever it then did: exit 1 on the lost peer, or its own SIGTERM exit
    assert cause_rank(Failure(rank=2, pid=12, exitcode=1, stopped=True, lost_peer=True)) == 3


def test_an_oom_kill_comes_first_and_says_out_of_memory():
    oom = Failure(rank=2, pid=12, exitcode=-9, oom=True, time=100.5)
    ranked = rank_failures([SURVIVOR, oom])
    assert ranked[0] is oom
    assert describe(oom, memory="peak memory seen: 3.0 GB for all workers, 1.5 GB in one worker") == (
        "rank 2 (pid 12) killed by SIGKILL: out of memory (the kernel's OOM killer; peak memory seen: "
        "3.0 GB for all workers, 1.5 GB in one worker)")


def test_a_plain_exception_comes_before_an_earlier_lost_peer():
    own = Failure(rank=1, pid=11, exitcode=1, error="ValueError: bad shape", error_type="ValueError", time=100.9)
    assert rank_failures([SURVIVOR, own]) == [own, SURVIVOR]
    assert describe(own) == "rank 1 (pid 11) exited with code 1: ValueError: bad shape"


def test_a_silent_exit_comes_before_a_lost_peer_and_two_causes_go_by_time_then_rank():
    silent = Failure(rank=3, pid=13, exitcode=1, time=101.0)  # no record of its own: not a lost peer either
    assert rank_failures([SURVIVOR, silent]) == [silent, SURVIVOR]
    a, b = Failure(rank=2, pid=12, exitcode=-11, time=5.0), Failure(rank=1, pid=11, exitcode=-6, time=5.0)
    assert rank_failures([a, b]) == [b, a]  # same time: the lower rank
    assert rank_failures([Failure(rank=0, pid=1, exitcode=-6, time=6.0), a])[0] is a


def test_consequences_are_one_short_line_grouped_by_fate():
    rest = [SURVIVOR, Failure(rank=2, pid=12, exitcode=-15, stopped=True),
            Failure(rank=3, pid=13, exitcode=-15, stopped=True), Failure(rank=4, pid=14, exitcode=-11)]
    assert consequences(rest) == ("rank 0 lost a peer (RuntimeError); ranks 2, 3 stopped by the launcher; "
                                  "rank 4 also failed (SIGSEGV)")
    assert consequences([]) is None


def test_several_nodes_name_the_global_and_local_rank():
    f = Failure(rank=5, pid=9, exitcode=-9, local_rank=1)
    assert describe(f, single_node=False) == "rank 5 (local rank 1 on this node) (pid 9) killed by SIGKILL"
    lost = GroupFailure(RuntimeError(), [Failure(rank=4, pid=8, exitcode=1, error=GLOO, lost_peer=True,
                                                 local_rank=0)], single_node=False)
    assert lost.line().endswith("(it lost a peer: the rank that failed first is on another node)")


# ---- the launcher's reporter: the agent's log lines, the exits seen, the workers' records ------
class FakeExits:
    def __init__(self, exits):
        self.exits = {e.pid: e for e in exits}

    def settle(self, timeout=1.0):
        return dict(self.exits)


class FakeMemory:
    def __init__(self, exits=(), oom=False):
        self.exits, self.oom = FakeExits(exits), oom

    def oom_killed(self):
        return self.oom

    def snapshot(self):
        self.oom = False

    def describe(self):
        return "peak memory seen: 2.0 GB for all workers, 1.0 GB in one worker"


def agent_line(msg: str, *args) -> logging.LogRecord:
    level = logging.ERROR if msg.startswith("failed") else logging.WARNING
    return logging.LogRecord(FailureReporter.LOGGER, level, __file__, 1, msg, args, None)


def failed(code, local_rank, pid):
    return agent_line("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", code, local_rank, pid,
                      sys.executable)


def lost_peer_record(folder: RunFolder, rank: int, pid: int) -> None:
    folder.errors.mkdir(parents=True, exist_ok=True)
    write_json(folder.errors / f"rank{rank}.json", {"rank": rank, "pid": pid, "error": GLOO, "type": "RuntimeError",
                                                    "lost_peer": True, "traceback": ""})


def test_the_ci_race_the_agent_logs_the_survivor_and_the_account_names_the_killed_rank(tmp_path, capsys):
    """Both ranks were dead at the agent's poll: it logs rank 0 (earliest whole second, lower rank)."""
    folder = RunFolder(tmp_path)
    lost_peer_record(folder, 0, 100)
    memory = FakeMemory([WorkerExit(101, 1, 1, -9, 50.00), WorkerExit(100, 0, 0, 1, 50.02)])
    reporter = FailureReporter(max_restarts=0, single_node=True, memory=memory, folder=folder)
    reporter.emit(failed(1, 0, 100))
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"phalanx: rank 1 (pid 101) killed by SIGKILL; no restarts left (--max-restarts 0); all "
                     f"workers' output in {folder.logs}", "phalanx: consequences: rank 0 lost a peer (RuntimeError)"]
    # what the agent then raises: every failure, the survivor first in its dict (as torch builds it)
    error = ChildFailedError("worker", {0: process_failure(0, 100, 1), 1: process_failure(1, 101, -9)})
    group = reporter.group_failure(error)
    assert group.line() == "rank 1 (pid 101) killed by SIGKILL" and group.ranked[0].time == 50.0
    assert group.consequences() == "rank 0 lost a peer (RuntimeError)"


def test_without_the_exit_watch_the_raised_list_still_names_the_killed_rank(tmp_path):
    """Negative control of the agent's own order: its list puts the survivor first, same timestamp."""
    folder = RunFolder(tmp_path)
    lost_peer_record(folder, 0, 100)
    reporter = FailureReporter(max_restarts=0, single_node=True, folder=folder)
    error = ChildFailedError("worker", {0: process_failure(0, 100, 1), 1: process_failure(1, 101, -9)})
    first = min(error.failures.items(), key=lambda item: item[1].timestamp)[0]
    assert first == 0  # what phalanx used to report
    assert reporter.group_failure(error).line() == "rank 1 (pid 101) killed by SIGKILL"


def process_failure(local_rank: int, pid: int, exitcode: int) -> ProcessFailure:
    f = ProcessFailure(local_rank=local_rank, pid=pid, exitcode=exitcode, error_file="/nonexistent")
    f.timestamp = 1_000  # the agent's whole-second stamp: equal for both
    return f


def test_ranks_the_agent_stopped_are_consequences(tmp_path, capsys):
    memory = FakeMemory([WorkerExit(201, 1, 1, -9, 7.0), WorkerExit(200, 0, 0, -15, 7.3)])
    reporter = FailureReporter(max_restarts=1, single_node=True, memory=memory, folder=RunFolder(tmp_path))
    reporter.emit(agent_line("Sending process %s closing signal %s", 200, "SIGTERM"))
    reporter.emit(failed(-9, 1, 201))
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("phalanx: rank 1 (pid 201) killed by SIGKILL; restarting all workers from the "
                               "latest checkpoint (restart 1 of 1)")
    assert lines[1] == "phalanx: consequences: rank 0 stopped by the launcher"
    # the next attempt is told on its own: the first attempt's exits are not repeated
    memory.exits.exits[301] = WorkerExit(301, 0, 0, -6, 9.0)
    reporter.emit(failed(-6, 0, 301))
    assert capsys.readouterr().err.splitlines() == [
        f"phalanx: rank 0 (pid 301) killed by SIGABRT; no restarts left (--max-restarts 1); all workers' output "
        f"in {tmp_path / 'logs'}"]


def test_an_oom_kill_is_said_once_and_only_for_a_sigkill_the_agent_did_not_send(tmp_path, capsys):
    memory = FakeMemory([WorkerExit(401, 1, 1, -9, 3.0), WorkerExit(400, 0, 0, -9, 3.5)], oom=True)
    reporter = FailureReporter(max_restarts=1, single_node=True, memory=memory)
    reporter.emit(agent_line("Unable to shutdown process %s via %s, forcefully exiting via %s", 400, "SIGTERM",
                             "SIGKILL"))
    reporter.emit(failed(-9, 1, 401))
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == ("phalanx: rank 1 (pid 401) killed by SIGKILL: out of memory (the kernel's OOM killer; "
                        "peak memory seen: 2.0 GB for all workers, 1.0 GB in one worker); restarting all workers "
                        "from the latest checkpoint (restart 1 of 1)")
    assert lines[1] == "phalanx: consequences: rank 0 stopped by the launcher"


def test_an_exit_status_the_watch_missed_still_names_the_rank(tmp_path, capsys):
    """The agent reaped rank 1 before the watch read it: rank 1 is still named, as having left no word."""
    folder = RunFolder(tmp_path)
    lost_peer_record(folder, 0, 100)
    memory = FakeMemory([WorkerExit(101, 1, 1, None, 50.0), WorkerExit(100, 0, 0, 1, 50.0)])
    FailureReporter(max_restarts=0, single_node=True, memory=memory, folder=folder).emit(failed(1, 0, 100))
    assert capsys.readouterr().err.splitlines()[0].startswith(
        "phalanx: rank 1 (pid 101) ended without an error of its own (exit status not seen); no restarts left")


# ---- the workers' side: what counts as a lost peer -------------------------------------------
def test_lost_peer_is_classified_from_the_exception_type_first():
    assert is_lost_peer(tdist.DistBackendError("NCCL error: remote process exited or there was a network error"))
    assert is_lost_peer(tdist.DistNetworkError("anything at all"))  # the type alone says it
    assert is_lost_peer(RuntimeError(GLOO.removeprefix("RuntimeError: ")))  # how Gloo raises it (torch 2.13)
    assert is_lost_peer(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [::1]:1"))
    try:  # chained: whatever phalanx raises from a lost peer is still a lost peer
        try:
            raise RuntimeError("Connection closed by peer")
        except RuntimeError as inner:
            raise KeyError("while stopping") from inner
    except KeyError as outer:
        assert is_lost_peer(outer)
    assert not is_lost_peer(RuntimeError("injected failure (debug.fault) at step 2"))
    assert not is_lost_peer(ValueError("connection reset by peer"))  # not a collective's error type
    assert not is_lost_peer(ConnectionResetError("the hub download was reset"))


def test_the_rank_record_says_type_and_lost_peer(tmp_path):
    folder = RunFolder(tmp_path)
    folder.mark_rank_error(3, tdist.DistBackendError("NCCL communicator was aborted\nmore"), "trace", lost_peer=True)
    record = json.loads((tmp_path / "errors" / "rank3.json").read_text())
    assert record["type"] == "torch.distributed.DistBackendError" and record["lost_peer"] is True
    assert record["error"] == "DistBackendError: NCCL communicator was aborted" and record["pid"] == os.getpid()
    assert folder.rank_record(os.getpid()) == record and folder.rank_record(os.getpid() + 1) is None
    folder.mark_rank_error(4, ValueError("x"), "trace", lost_peer=False)
    assert json.loads((tmp_path / "errors" / "rank4.json").read_text())["type"] == "ValueError"


def test_a_worker_under_an_outside_launcher_records_its_error_through_the_same_entry(tmp_path, cache_dir):
    """Two `phalanx train` processes with srun's variables (launch.run_as_worker -> worker.serve): rank 1
    raises, rank 0 then loses its peer; each records it, classified, and both exit 1 without hanging."""
    from phalanx.core.dist import free_port

    run, port = tmp_path / "srun", free_port()
    procs = []
    for rank in (0, 1):
        env = srun_env(rank, port, job="4243")
        args = lm_args(run, cache_dir, "train.max_steps=6", "dist.threads_per_worker=1",
                       "debug.fault=raise:rank=1:step=3")
        procs.append(subprocess.Popen([zygote_python(), "-m", "phalanx", *args], cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [1, 1], [o[1][-2000:] for o in outs]
    own = json.loads((run / "errors" / "rank1.json").read_text())
    assert own["error"] == "RuntimeError: injected failure (debug.fault) at step 3" and own["lost_peer"] is False
    assert own["pid"] == procs[1].pid
    peer = json.loads((run / "errors" / "rank0.json").read_text())
    assert peer["lost_peer"] is True, peer["error"]
    assert not (run / "outcome.json").exists()  # no phalanx launcher: nobody to write it


def test_signal_names():
    assert describe(Failure(rank=0, pid=1, exitcode=-signal.SIGSEGV)) == "rank 0 (pid 1) killed by SIGSEGV"
    assert describe(Failure(rank=0, pid=1, exitcode=-77)) == "rank 0 (pid 1) killed by signal 77"
