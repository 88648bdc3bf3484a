"""Which worker failed first, and why: the launcher's one-line account of a failed worker group.

When one rank dies the others follow: their next collective finds its socket closed (Gloo: "Connection
closed/reset by peer"), and the elastic agent stops whoever is left with SIGTERM, then SIGKILL after its
shutdown timeout. The agent knows every failure of the attempt once it has stopped the group, but it logs
only the one with the earliest timestamp (whole seconds; ties go to the lower local rank) and hands over
the full list (ChildFailedError) only when no restart is left (torch.distributed.elastic: SubprocessContext
_poll/_close, LocalElasticAgent._monitor_workers, launcher.api.launch_agent). Picking by order names a
survivor whose Gloo error came before the agent's next poll (every 0.2 s) instead of the rank that was
killed. So every failure of an attempt is gathered — the agent's log line and list, the exit status of
each worker (oomwatch.ExitWatch), each worker's own error record (RUN/errors/rank<r>.json, written by
run/worker.py), the pids the agent itself signalled — and ranked by cause (`rank_failures`).
"""
from __future__ import annotations

import logging
import signal
import sys
from dataclasses import dataclass, field

from phalanx.core.runfolder import RunFolder
from phalanx.tools.oomwatch import MemoryWatch

# The agent's log lines this module reads (torch.distributed.elastic.multiprocessing.api, torch 2.13).
FAILED = "failed (exitcode"                       # args: exitcode, local_rank, pid, entry point
STOPPING = ("Sending process", "Unable to shutdown process", "Closing process")  # args[0]: the pid


@dataclass(frozen=True)
class Failure:
    """One worker that ended with a non-zero status, and what is known of why."""
    rank: int | None              # global rank (None: unknown, several nodes)
    pid: int | None
    exitcode: int | None          # as subprocess reports it (negative: killed by that signal); None: not seen
    stopped: bool = False         # the agent signalled it while stopping the group: not a cause
    oom: bool = False             # a SIGKILL the agent did not send, while the OOM counter rose
    error: str | None = None      # its own error record: "Type: first line"
    error_type: str | None = None
    lost_peer: bool = False       # its own error is the group's: a peer vanished under a collective
    time: float | None = None
    local_rank: int | None = None


def cause_rank(f: Failure) -> int:
    """0: failed by itself (a signal the agent did not send, the OOM killer, its own error);
    1: failed without a word (non-zero exit, no record); 2: lost a peer; 3: stopped by the agent."""
    if f.stopped:
        return 3
    if f.oom or (f.exitcode is not None and f.exitcode < 0) or (f.error and not f.lost_peer):
        return 0
    return 2 if f.lost_peer else 1


def rank_failures(failures) -> list[Failure]:
    """Root cause first: by cause_rank, then by when the failure was seen, then by rank."""
    return sorted(failures, key=lambda f: (cause_rank(f), f.time if f.time is not None else float("inf"),
                                           f.rank if f.rank is not None else sys.maxsize))


def who(f: Failure, single_node: bool) -> str:
    if single_node or f.local_rank is None:
        return f"rank {f.rank if f.rank is not None else f.local_rank}"
    if f.rank is None:
        return f"local rank {f.local_rank} on this node"
    return f"rank {f.rank} (local rank {f.local_rank} on this node)"


def signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def describe(f: Failure, single_node: bool = True, memory: str = "") -> str:
    """'rank 1 (pid 7) killed by SIGKILL', '... exited with code 1: ValueError: bad', ..."""
    if f.exitcode is None:
        why = f"failed: {f.error}" if f.error else "ended without an error of its own (exit status not seen)"
    elif f.exitcode < 0:
        why = f"killed by {signal_name(f.exitcode)}"
        if f.oom:
            why += f": out of memory (the kernel's OOM killer; {memory})" if memory else ": out of memory"
    else:
        why = f"exited with code {f.exitcode}" + (f": {f.error}" if f.error else "")
    return f"{who(f, single_node)} (pid {f.pid}) {why}"


def consequences(rest: list[Failure], single_node: bool = True) -> str | None:
    """The failures after the cause, in one short line: 'rank 0 lost a peer (RuntimeError); ranks 2, 3
    stopped by the launcher' (printed after 'consequences: ')."""
    groups: dict[str, list[str]] = {}
    for f in rest:
        kind = f.error_type or (f.error or "").partition(":")[0] or None
        if f.stopped:
            phrase = "stopped by the launcher"
        elif f.lost_peer:
            phrase = f"lost a peer ({kind})" if kind else "lost a peer"
        else:
            how = signal_name(f.exitcode) if f.exitcode is not None and f.exitcode < 0 else \
                f"exit code {f.exitcode}" if f.exitcode is not None else "exit status not seen"
            phrase = f"also failed ({how}{', ' + kind if kind else ''})"
        groups.setdefault(phrase, []).append(str(f.rank) if f.rank is not None else f"local {f.local_rank}")
    items = [f"rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)} {phrase}" for phrase, ranks in groups.items()]
    return "; ".join(items) or None


@dataclass
class GroupFailure:
    """How a worker group failed (what launch.run_workers returns): the failures ranked root cause first,
    and the error torch raised (ChildFailedError, or SignalException when the launcher got a signal)."""
    error: BaseException | None = None
    ranked: list[Failure] = field(default_factory=list)
    single_node: bool = True
    memory: str = ""

    def line(self) -> str:
        if self.ranked:
            cause = self.ranked[0]
            text = describe(cause, self.single_node, self.memory)
            if cause.lost_peer and not self.single_node:
                text += " (it lost a peer: the rank that failed first is on another node)"
            return text
        sigval = getattr(self.error, "sigval", None)  # SignalException: the launcher itself got a signal
        if sigval is not None:
            return f"the launcher received {signal.Signals(sigval).name}"
        text = str(self.error or "").strip()
        return text.splitlines()[0] if text else repr(self.error)

    def consequences(self) -> str | None:
        return consequences(self.ranked[1:], self.single_node)


class FailureReporter(logging.Handler):
    """Says in phalanx's words which worker failed and why, and whether the group restarts, once per
    failed attempt (when the agent logs its 'failed (exitcode ...)' line, after it has stopped the
    group). It also notes the pids the agent signals while stopping a group ('Sending process P closing
    signal SIGTERM', then 'Unable to shutdown process P ... SIGKILL'): those deaths are not causes."""

    LOGGER = "torch.distributed.elastic.multiprocessing.api"

    def __init__(self, max_restarts: int, single_node: bool, memory: MemoryWatch | None = None,
                 folder: RunFolder | None = None):
        super().__init__(logging.WARNING)
        self.max_restarts, self.single_node, self.failures = max_restarts, single_node, 0
        self.memory, self.folder = memory, folder
        self.stopped: set[int] = set()     # pids the agent signalled
        self.accounted: set[int] = set()   # pids of failures already told (earlier attempts)
        self.last: list[Failure] = []      # the latest attempt's failures, ranked

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        msg = str(record.msg)
        if msg.startswith(STOPPING) and args:
            self.stopped.add(_int(args[0]))
            return
        if not msg.startswith(FAILED) or len(args) < 3:
            return  # another message, or a torch whose wording changed: its own log line still says it
        self.failures += 1
        self.last = rank_failures(self._attempt(_int(args[0]), _int(args[1]), _int(args[2])))
        self.accounted |= {f.pid for f in self.last}
        group = GroupFailure(None, self.last, self.single_node, self._memory_text())
        if self.memory is not None:
            self.memory.snapshot()  # the next attempt's OOM kills are its own
        restart = (f"restarting all workers from the latest checkpoint (restart {self.failures} of "
                   f"{self.max_restarts})" if self.failures <= self.max_restarts else
                   f"no restarts left (--max-restarts {self.max_restarts})")
        where = f"; all workers' output in {self.folder.logs}" if self.folder is not None else ""
        print(f"phalanx: {group.line()}; {restart}{where}", file=sys.stderr, flush=True)
        if group.consequences():
            print(f"phalanx: consequences: {group.consequences()}", file=sys.stderr, flush=True)

    def group_failure(self, error: BaseException) -> GroupFailure:
        """The account of the last attempt from the error the launcher got: ChildFailedError lists every
        failure of the group with its exit status (rank -> ProcessFailure), SignalException none."""
        told = {f.pid: f for f in self.last}
        ranked = []
        for rank, pf in (getattr(error, "failures", None) or {}).items():
            seen = told.get(pf.pid)
            when = seen.time if seen and seen.time is not None else pf.timestamp  # (whole seconds)
            ranked.append(self._failure(pf.pid, rank, pf.local_rank, pf.exitcode, when, oom=seen and seen.oom))
        return GroupFailure(error, rank_failures(ranked), self.single_node, self._memory_text())

    def _attempt(self, code: int | None, local_rank: int | None, pid: int | None) -> list[Failure]:
        """Every worker of this attempt that ended badly: those ExitWatch saw, and the one the agent logged."""
        exits = self.memory.exits.settle() if self.memory is not None else {}
        found = {e.pid: (e.rank, e.local_rank, e.exitcode, e.time) for e in exits.values()
                 if e.pid not in self.accounted and e.exitcode != 0}
        rank, _, seen_code, when = found.get(pid, (None, None, None, None))
        if self.single_node and rank is None:
            rank = local_rank
        found[pid] = (rank, local_rank, code if code is not None else seen_code, when)
        oom = self.memory is not None and self.memory.oom_killed()
        return [self._failure(p, r, lr, c, t, oom=oom) for p, (r, lr, c, t) in found.items()]

    def _failure(self, pid, rank, local_rank, exitcode, when, oom) -> Failure:
        record = self.folder.rank_record(pid) if self.folder is not None and pid is not None else None
        record = record or {}
        stopped = pid in self.stopped
        killed = exitcode == -signal.SIGKILL and not stopped
        return Failure(rank=rank, pid=pid, exitcode=exitcode, stopped=stopped, oom=bool(oom and killed),
                       error=record.get("error"), error_type=_short(record.get("type")),
                       lost_peer=bool(record.get("lost_peer")), time=when, local_rank=local_rank)

    def _memory_text(self) -> str:
        return self.memory.describe() if self.memory is not None else ""


def failure_line_of(failure) -> str:
    """One line for a failed worker group (what launch.run_workers returned): the root cause."""
    if isinstance(failure, GroupFailure):
        return failure.line()
    return GroupFailure(failure).line()


def _short(type_name: str | None) -> str | None:
    return type_name.rpartition(".")[2] if type_name else None


def _int(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
