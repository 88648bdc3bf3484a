"""The loop's one call per phase of a step: it beats the hang watchdog, opens the memory phase a step,
evaluation, checkpoint or export starts (run/memphases.py), and fires the test-only fault (`debug.fault`,
core/faults.py) due at that step and phase, so failure handling is tested with real failures at known
places.
"""
from __future__ import annotations

from phalanx.core.faults import Fault, fire
from phalanx.run.memphases import PhasePeaks
from phalanx.run.watchdog import Phase, Watchdog

# Where in a step each fault kind fires. `slow` is a straggler: it sleeps in its data phase every step;
# `slow_reference` in every micro-batch of the precomputed reference pass (before step 0).
PHASE_OF = {"kill": Phase.START, "raise": Phase.START, "sleep": Phase.START, "slow": Phase.DATA,
            "nan": Phase.FORWARD, "kill_in_checkpoint": Phase.CHECKPOINT_WRITTEN,
            "slow_reference": Phase.REFERENCE}


class Probe:
    """`probe(step, phase, micro)`: returns True where a `nan` fault asks the caller to poison its value."""

    def __init__(self, watchdog: Watchdog, fault: Fault | None, rank: int, attempt: int,
                 memory: PhasePeaks | None = None):
        self.watchdog, self.fault, self.rank, self.attempt = watchdog, fault, rank, attempt
        self.memory, self.first_step = memory, True

    def __call__(self, step: int, phase: Phase, micro: int = 0) -> bool:
        self.watchdog.beat(step, phase, micro)
        if self.memory is not None:
            self._memory_phase(phase)
        f = self.fault
        if f is None or PHASE_OF[f.kind] != phase or not f.applies(self.rank, step, self.attempt):
            return False
        if f.kind == "nan":
            return True
        fire(f)
        return False

    def _memory_phase(self, phase: Phase) -> None:
        if phase == Phase.START:
            self.memory.step_started(self.first_step)
            self.first_step = False
        elif phase in (Phase.EVAL, Phase.CHECKPOINT, Phase.EXPORT):
            self.memory.enter(phase.value)
