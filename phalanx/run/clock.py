"""Step timing: where an optimizer step's time goes, on the host's clock or on the GPU's.

The loop marks the boundaries of a step's phases: its start, data collated, the task's rollout done (where
the task has one: GRPO generates and scores completions), data ready (counted, copied), step-start sync done,
the end of each micro-batch's forward and backward, optimizer done. Every mark
reads the host clock; on CUDA it also records an event on the current stream, whose timestamp is when
the GPU *reached* that point of its queue. Kernels run asynchronously, so host clocks there only see
launch times; the events see the work itself. Events are read in bulk (`read`), when a log window is
collected: one synchronize per window, none per step.

Both the clock and the event factory are injectable, so the accounting is tested on the CPU with a
fake clock and fake events (tests/test_step_clock.py).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

# What each mark ends. FORWARD/BACKWARD repeat once per micro-batch, in that order.
START, TAKEN, ROLLOUT, DATA, SYNC, FORWARD, BACKWARD, END = ("start", "taken", "rollout", "data", "sync", "forward",
                                                             "backward", "end")


@dataclass(frozen=True)
class StepTimes:
    """One step's split, in seconds. data + rollout + sync + fwd_bwd + optimizer == time."""
    time: float
    data: float
    rollout: float      # the task's per-step work before the step's counts (GRPO: generation); 0 for most tasks
    sync: float
    fwd_bwd: float
    optimizer: float
    # The step's segments that hold no collective under DDP: data, the rollout, every micro-batch's forward, the
    # backward of all micro-batches but the last (no_sync: the gradient all-reduce runs in the last one),
    # the optimizer (clip + step on gradients already reduced). What a rank's own speed decides.
    local: float


def split(kinds: list[str], stamps: list[float]) -> StepTimes:
    """The split of one step from its marks' kinds and times (seconds, any common origin)."""
    at = {k: s for k, s in zip(kinds, stamps) if k in (START, TAKEN, ROLLOUT, DATA, SYNC, END)}
    rollout = at[ROLLOUT] - at[TAKEN] if ROLLOUT in at else 0.0  # inside the data segment, told apart
    spans = list(zip(kinds[1:], (b - a for a, b in zip(stamps, stamps[1:]))))  # (kind of the end mark, seconds)
    forward = sum(s for k, s in spans if k == FORWARD)
    backward = [s for k, s in spans if k == BACKWARD]
    last_backward = stamps[len(kinds) - 1 - kinds[::-1].index(BACKWARD)] if backward else at[SYNC]
    data, optimizer = at[DATA] - at[START] - rollout, at[END] - last_backward
    return StepTimes(time=at[END] - at[START], data=data, rollout=rollout, sync=at[SYNC] - at[DATA],
                     fwd_bwd=last_backward - at[SYNC], optimizer=optimizer,
                     local=data + rollout + forward + sum(backward[:-1]) + optimizer)


@dataclass
class StepMarks:
    """The marks of one finished step: kinds, host times (seconds) and, on CUDA, events."""
    kinds: list[str]
    host: list[float]
    events: list | None

    @property
    def host_seconds(self) -> float:
        return self.host[-1] - self.host[0]

    def host_at(self, kind: str) -> float:
        """Host time of the last mark of `kind`."""
        return self.host[len(self.kinds) - 1 - self.kinds[::-1].index(kind)]


def cuda_event():
    import torch

    return torch.cuda.Event(enable_timing=True)


class StepClock:
    """Marks steps; `read` turns finished steps into StepTimes (host clock, or device events if given).

    `event`: a factory of CUDA-event-like objects (record(), query(), synchronize(), elapsed_time(other)
    in milliseconds); None times on the host only (CPU)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, event: Callable[[], object] | None = None):
        self.now, self.event = clock, event
        self._kinds: list[str] = []
        self._host: list[float] = []
        self._events: list = []
        self._spare: list = []  # events already read, recorded again by later steps

    @classmethod
    def for_device(cls, device) -> StepClock:
        return cls(event=cuda_event if device.type == "cuda" else None)

    @property
    def on_device(self) -> bool:
        return self.event is not None

    def start(self) -> None:
        self._kinds, self._host, self._events = [], [], []
        self.mark(START)

    def mark(self, kind: str) -> None:
        if self.event is not None:
            ev = self._spare.pop() if self._spare else self.event()
            ev.record()
            self._events.append(ev)
        self._kinds.append(kind)
        self._host.append(self.now())

    def stop(self) -> StepMarks:
        self.mark(END)
        return StepMarks(self._kinds, self._host, self._events if self.event is not None else None)

    def read(self, steps: list[StepMarks], wait: bool = True) -> list[StepTimes]:
        """The times of `steps` (in order). On the device: with `wait`, all of them after one synchronize
        on the last event (earlier events on the stream are then complete); without, the leading steps
        the GPU has already finished, without waiting."""
        if not self.on_device:
            return [split(s.kinds, s.host) for s in steps]
        if wait and steps:
            steps[-1].events[-1].synchronize()
        out = []
        for s in steps:
            if not wait and not s.events[-1].query():
                break
            first = s.events[0]
            out.append(split(s.kinds, [0.0] + [first.elapsed_time(e) / 1000.0 for e in s.events[1:]]))
            self._spare.extend(s.events)
        return out
