"""Test-only fault injection (`debug.fault`), so failure handling is tested with real failures.

Form: `KIND:key=value:...` with KIND one of kill, raise, sleep, nan, slow, kill_in_checkpoint,
slow_reference and keys rank (default: every rank), step (the optimizer step at which it fires), attempt
(elastic attempt, default 0), seconds (sleep, slow, slow_reference). `slow` fires at every step from `step`
on (a straggler: the rank sleeps in its data phase). `slow_reference` sleeps in every micro-batch of the
precomputed reference pass of preference tuning (before step 0: its step is optional, -1). The loop
reaches faults only through run/probe.py's `Probe`, which also decides the phase of a step where each kind
fires.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from phalanx.core.errors import ConfigError

KINDS = ("kill", "raise", "sleep", "nan", "kill_in_checkpoint", "slow", "slow_reference")
REPEATING = ("slow", "slow_reference")  # fire at every step (or micro-batch) from `step` on


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None = None
    attempt: int = 0
    seconds: float = 0.0

    def applies(self, rank: int, step: int, attempt: int) -> bool:
        at_step = step >= self.step if self.kind in REPEATING else step == self.step
        return at_step and attempt == self.attempt and self.rank in (None, rank)


def parse_fault(text: str) -> Fault | None:
    if not text:
        return None
    kind, *parts = text.split(":")
    if kind not in KINDS:
        raise ConfigError(f"config key 'debug.fault': unknown kind {kind!r}, expected one of {KINDS}")
    fields = {}
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or key not in ("rank", "step", "attempt", "seconds"):
            raise ConfigError(f"config key 'debug.fault': bad part {part!r}, expected rank=, step=, "
                              f"attempt= or seconds=")
        try:
            fields[key] = float(value) if key == "seconds" else int(value)
        except ValueError:
            raise ConfigError(f"config key 'debug.fault': {key} must be a number, got {value!r}") from None
    if kind == "slow_reference":
        fields.setdefault("step", -1)  # the pass runs before step 0
    if "step" not in fields:
        raise ConfigError("config key 'debug.fault': needs step=N")
    return Fault(kind=kind, **fields)


def fire(fault: Fault) -> None:
    """Carry out a process-level fault (the `nan` kind is applied to the loss by the loop)."""
    if fault.kind in ("kill", "kill_in_checkpoint"):
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.kind == "raise":
        raise RuntimeError(f"injected failure (debug.fault) at step {fault.step}")
    elif fault.kind in ("sleep", *REPEATING):
        time.sleep(fault.seconds)
