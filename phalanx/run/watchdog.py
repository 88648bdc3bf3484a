"""Hang diagnosis: a per-rank thread that notices when the loop stops making progress.

The loop calls `beat(step, phase)` at each phase of a step (through run/probe.py). If no beat arrives within
the timeout, the thread writes this rank's Python stacks (all threads) and its last position to
RUN/hang/rank<r>.txt and ends the process with HANG_EXIT, so the job stops instead of waiting forever. Before exiting it
waits (briefly) for the other ranks' files: the launcher stops the whole group as soon as one worker
exits, so a rank that exited at once would cut off the peers' reports. The launcher then
compares the ranks' positions: the rank(s) furthest behind are the ones that never reached the
collective the others are waiting in.
"""
from __future__ import annotations

import faulthandler
import json
import os
import threading
import time
from enum import Enum
from pathlib import Path

from phalanx.core.runfolder import EXIT_HANG as HANG_EXIT


class Phase(str, Enum):  # not StrEnum: that is Python 3.11+, the floor is 3.10
    """The phases of step s, in the order a rank passes them (a rank at an earlier one is behind): first what
    s finished steps earned (evaluation, checkpoint), then the step itself; at the last step, the export."""
    EVAL = "eval"
    CHECKPOINT = "checkpoint"
    CHECKPOINT_WRITTEN = "checkpoint_written"   # this rank's shards are on disk
    START = "start"                             # (step -1: start-up, the position before any beat)
    REFERENCE = "reference"                     # step -1 only: the precomputed reference pass of preference
                                                # tuning, one beat per micro-batch (after start-up, before step 0)
    DATA = "data"                               # this rank's micro-batches are read and collated
    ROLLOUT = "rollout"                         # the task's per-step work on the model (GRPO: generation),
                                                # one beat per unit of it
    SYNC = "sync"                               # the step's one-vector all-reduce (counts, stop votes)
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    EXPORT = "export"                           # RUN/final, after the last checkpoint

    def __str__(self) -> str:  # as StrEnum prints: the value, on every Python version
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


_ORDER = {phase.value: i for i, phase in enumerate(Phase)}


class Watchdog:
    def __init__(self, folder: Path, rank: int, world_size: int, timeout_s: float):
        self.folder, self.rank, self.world_size, self.timeout_s = Path(folder), rank, world_size, timeout_s
        self.position = {"step": -1, "micro": 0, "phase": Phase.START.value}
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="phalanx-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def beat(self, step: int, phase: Phase, micro: int = 0) -> None:
        self.position = {"step": step, "micro": micro, "phase": phase.value}
        self._last = time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                self._dump(idle)
                self._wait_for_peers()
                os._exit(HANG_EXIT)

    def _dump(self, idle: float) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / f"rank{self.rank}.txt", "w") as f:
            f.write(json.dumps({"rank": self.rank, "pid": os.getpid(), "idle_s": round(idle, 1),
                                **self.position}) + "\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)

    def _wait_for_peers(self) -> None:
        """Peers stuck in the same collective stop beating at about the same time, so their reports follow
        within about one timeout; the cap keeps a lost peer (another node's folder) from holding us long."""
        deadline = time.monotonic() + min(self.timeout_s, 30.0) + 2.0
        wanted = {f"rank{r}.txt" for r in range(self.world_size)}
        while time.monotonic() < deadline:
            if wanted <= {f.name for f in self.folder.glob("rank*.txt")}:
                return
            time.sleep(0.2)


def _key(pos: dict) -> tuple:
    """Where a rank is, as a sortable tuple. Micro-batch numbers order only the phases that repeat per
    micro-batch (forward/backward; the reference pass before step 0): a rank at the optimizer is past every
    micro-batch."""
    phase = _ORDER.get(pos.get("phase"), _ORDER[Phase.START])
    if _ORDER[Phase.FORWARD] <= phase <= _ORDER[Phase.BACKWARD]:
        stage, micro = 1, pos.get("micro", 0)
    elif phase == _ORDER[Phase.REFERENCE]:
        stage, micro = 0, pos.get("micro", 0)
    else:
        stage, micro = (0 if phase < _ORDER[Phase.FORWARD] else 2), 0
    return pos.get("step", -1), stage, micro, phase


def summarize(folder: Path) -> str | None:
    """One paragraph naming the stuck rank(s), from the files the ranks wrote; None if no hang."""
    files = sorted(Path(folder).glob("rank*.txt"))
    if not files:
        return None
    positions = {}
    for f in files:
        try:
            pos = json.loads(f.read_text().splitlines()[0])
            positions[int(pos["rank"])] = pos
        except (ValueError, IndexError, KeyError):
            continue
    if not positions:
        return None
    behind = min(_key(p) for p in positions.values())
    stuck = sorted(r for r, p in positions.items() if _key(p) == behind)
    waiting = sorted(set(positions) - set(stuck))
    where = positions[stuck[0]]
    if waiting:
        text = (f"hang: rank(s) {', '.join(map(str, stuck))} did not reach the collective at step "
                f"{where['step']} (last stage: {where['phase']}); rank(s) {', '.join(map(str, waiting))} "
                f"waited for them")
    else:
        text = (f"hang: all {len(stuck)} rank(s) stopped at step {where['step']} stage {where['phase']} "
                f"(same collective on every rank: a network or peer failure)")
    return text + f". Stacks: {folder}/rank<r>.txt"
