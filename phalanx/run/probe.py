"""The loop's one call per phase of a step: it beats the hang watchdog and fires the test-only fault
(`debug.fault`, core/faults.py) due at that step and phase, so failure handling is tested with real
failures at known places.
"""
from __future__ import annotations

from phalanx.core.faults import Fault, fire
from phalanx.run.watchdog import Phase, Watchdog

# Where in a step each fault kind fires. `slow` is a straggler: it sleeps in its data phase every step.
PHASE_OF = {"kill": Phase.START, "raise": Phase.START, "sleep": Phase.START, "slow": Phase.DATA,
            "nan": Phase.FORWARD, "kill_in_checkpoint": Phase.CHECKPOINT_WRITTEN}


class Probe:
    """`probe(step, phase, micro)`: returns True where a `nan` fault asks the caller to poison its value."""

    def __init__(self, watchdog: Watchdog, fault: Fault | None, rank: int, attempt: int):
        self.watchdog, self.fault, self.rank, self.attempt = watchdog, fault, rank, attempt

    def __call__(self, step: int, phase: Phase, micro: int = 0) -> bool:
        self.watchdog.beat(step, phase, micro)
        f = self.fault
        if f is None or PHASE_OF[f.kind] != phase or not f.applies(self.rank, step, self.attempt):
            return False
        if f.kind == "nan":
            return True
        fire(f)
        return False
