"""What a training run carries from step to step, and the deliberate stops of the loop.

`TrainState` is what a checkpoint holds about the run's progress (`state_dict()` is versioned;
`load_state_dict()` also reads the plain dicts of checkpoints written before it existed).
"""
from __future__ import annotations

import dataclasses
import signal
from dataclasses import dataclass


@dataclass
class TrainState:
    VERSION = 3
    step: int = 0                 # optimizer steps done
    samples_seen: int = 0         # the sampler's global offset: resumes the sample order on any world size
                                  # (with data_order, all of the sampler's state: it needs no entry of its own)
    tokens_seen: int = 0
    nan_skips: int = 0            # steps skipped for a non-finite loss or gradient norm
    consecutive_nan: int = 0
    fp16_overflows: int = 0       # fp16 loss-scaler overflows (skipped steps that are not NaN)
    train_time_s: float = 0.0
    # How the task orders samples (Task.train_order): 4 = shards in shuffled windows, samples shuffled within
    # each (data.order=windowed, the default with data.store_url; lm only, the other tasks order as 3); 3 =
    # shuffles computed per batch (Feistel), length groups of whole global batches; 2 = a stored
    # permutation, groups of whole global batches; 1 (any
    # checkpoint without the field) = a stored permutation, groups of single micro-batches. A resume keeps
    # its run's order, so an epoch in progress still sees every sample once.
    data_order: int = 3

    def advance(self, samples: int, tokens: int, seconds: float) -> None:
        """One optimizer step done: `samples` is the global batch (the sampler's offset moves by it)."""
        self.step += 1
        self.samples_seen += samples
        self.tokens_seen += tokens
        self.train_time_s += seconds

    def state_dict(self) -> dict:
        return {"version": self.VERSION, **dataclasses.asdict(self)}

    def load_state_dict(self, saved: dict) -> None:
        known = {f.name for f in dataclasses.fields(self)}
        self.data_order = 1
        for key, value in saved.items():  # version 0 (no "version" key) has a subset of the fields
            if key in known:
                setattr(self, key, value)


class StopTraining(RuntimeError):
    """A deliberate stop with a message for the user (e.g. non-finite loss under nan_policy=stop)."""

    def __init__(self, message: str, step: int | None = None):
        super().__init__(message)
        self.step = step


class PreemptionFlag:
    """Set by SIGTERM/SIGINT/SIGUSR1; the ranks agree on it at the next step's sync."""

    def __init__(self):
        self.signal = None
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signal = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        return self.signal is not None
