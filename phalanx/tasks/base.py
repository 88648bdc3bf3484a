"""The task interface: what the training loop (train.py), the evaluator and the launcher call on a task.

A task is a small object; adding one never touches the loop. `TaskBase` holds what the tasks share.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch

from phalanx.core.config import Config, ConfigError
from phalanx.data import prepare
from phalanx.data.sample import check_sample
from phalanx.model.shard import Builder


class Task(Protocol):
    name: str
    train_set: Any      # len() and the indices the sampler hands out
    val_set: Any
    tokenizer: Any      # saved with the final model

    # ---- in the launcher, before any worker starts (static: no task object yet)
    @classmethod
    def check_config(cls, cfg: Config) -> None: ...
    @staticmethod
    def preflight(cfg: Config) -> None: ...
    @staticmethod
    def prepare_data(cfg: Config, workers: int = 0, progress: bool = True) -> dict: ...  # split -> summary
    @staticmethod
    def sequence_length(cfg: Config) -> int: ...
    @staticmethod
    def rows_per_sample(cfg: Config) -> int: ...  # rows of sequence_length one sample of a micro-batch trains
    @staticmethod
    def is_prepared(cfg: Config) -> bool: ...

    # ---- in every worker
    def open_data(self) -> None: ...  # the prepared data, memory-mapped: sets train_set, val_set, tokenizer
    def train_order(self, data_order: int): ...
    def build_model(self, builder=None) -> torch.nn.Module: ...
    # once the model is built, before a checkpoint is loaded; beat(k): the hang watchdog; progress: a display
    def attach(self, trainee, beat=None, progress=None) -> None: ...
    def collate(self, dataset, indices) -> dict: ...
    # this rank's host micro-batches of a step, before they are counted: the task's work on the model (GRPO:
    # generate and score completions) gives the batches the step trains on
    def rollout(self, trainee, batches: list[dict], step: int, beat=None) -> list[dict]: ...
    # steps in a row that draw the same global batch (GRPO's num_iterations; 1 for the others), and the task's
    # own per-rank state that a checkpoint must hold (GRPO: a generation batch still in use), by name
    repeats: int
    def rank_states(self) -> dict: ...
    @classmethod
    def check_resume(cls, cfg: Config, meta: dict, worlds: list[int]) -> None: ...
    def batch_tokens(self, batch: dict) -> int: ...
    def useful_tokens(self, batch: dict) -> int: ...
    # a training step: counts summed over the global batch (one all-reduce), then each micro-batch's part of
    # the global batch's loss given those totals, and sums for the task's own training metrics
    def step_counts(self, batch: dict) -> list[float]: ...
    def step_loss(self, model, batch: dict, totals: list[float]) -> tuple[torch.Tensor, torch.Tensor | None]: ...
    def train_metrics(self, sums: list[float]) -> dict: ...
    def eval_sums(self, model, batch: dict) -> list[float]: ...
    def eval_metrics(self, sums: list[float]) -> dict: ...
    # A task whose metric is not a sum over batches (entity F1) sets EVAL_OUTPUTS = True: its eval_sums returns
    # (sums, one output per sample), the evaluator gathers the outputs in sample order across the ranks and calls
    # eval_metrics(sums, outputs) on every rank
    EVAL_OUTPUTS: bool
    def summary_extra(self) -> dict: ...
    def next_commands(self, run_dir) -> list[str]: ...


class TaskBase:
    """Shared parts: the architectures a task trains, and batch counts of the `input_ids`/`labels` form."""
    name = ""
    ARCHS: tuple[str, ...] = ()
    FORMAT: prepare.RecordFormat  # the record format of the task's stores (data/prepare.py)
    MISMATCHED = "error"  # a pretrained tensor of another shape: an error, or "init" (initialised anew)
    EVAL_OUTPUTS = False  # eval_sums returns sums only (see Task.EVAL_OUTPUTS)
    repeats = 1  # each global batch is one step's

    @staticmethod
    def rows_per_sample(cfg: Config) -> int:
        return 1

    def __init__(self, cfg: Config, info):
        self.cfg, self.info = cfg, info
        self.train_set = self.val_set = self.tokenizer = None

    @classmethod
    def check_config(cls, cfg: Config) -> None:
        if not cfg.model.pretrained and cfg.model.arch not in cls.ARCHS:
            raise ConfigError(f"config key 'model.arch': task '{cls.name}' needs {' or '.join(cls.ARCHS)}, "
                              f"got {cfg.model.arch!r}")

    # ---- data -------------------------------------------------------------------------------
    @classmethod
    def check_resume(cls, cfg: Config, meta: dict, worlds: list[int]) -> None:
        """In the launcher: whether the checkpoint of meta.json `meta` resumes on these world sizes (any, here)."""

    @classmethod
    def preflight(cls, cfg: Config) -> None:
        """Bounded checks in the launcher (files exist, UTF-8, JSON, fields on a sample)."""
        check_sample(cfg, cls.FORMAT.fields(cfg))

    @classmethod
    def prepare_data(cls, cfg: Config, workers: int = 0, progress: bool = True) -> dict:
        """The data step (`phalanx prepare`, or the launcher before workers start): tokenizer + stores."""
        summaries = prepare.prepare(cfg, cls.FORMAT, workers, progress)
        cls.check_prepared(cfg)
        return summaries

    @classmethod
    def check_prepared(cls, cfg: Config) -> None:
        """What the prepared stores must hold for training to start (exit 2 in the launcher otherwise)."""

    @classmethod
    def is_prepared(cls, cfg: Config) -> bool:
        """The task's stores for `cfg` exist and are current."""
        return prepare.is_prepared(cfg, cls.FORMAT)

    # ---- model ------------------------------------------------------------------------------
    def build_model(self, builder: Builder | None = None) -> torch.nn.Module:
        """The model with its weights (the task's `define_model`): built by `builder` (the trainer's:
        sharded, checkpointed, on its device), or whole on the CPU."""
        return (builder or Builder(seed=self.cfg.train.seed)).build(self.define_model, self.cfg.model.pretrained,
                                                                     mismatched=self.MISMATCHED)

    def next_commands(self, run_dir) -> list[str]:
        """What to run on the finished run (printed at the end of training)."""
        return [f"phalanx report {run_dir}"]

    def attach(self, trainee, beat=None, progress=None) -> None:
        """Called once the trainer built the model (run/trainee.Trainee), before a checkpoint is loaded into it:
        the model holds its initial weights (preference tuning computes its reference from them). `beat(k)`,
        if given, tells the hang watchdog that long work done here finished its k-th micro-batch; `progress(total,
        done)`, if given (the main rank), makes its progress display (run/monitor.PassProgress)."""

    # ---- the training step ------------------------------------------------------------------
    def rollout(self, trainee, batches: list[dict], step: int, beat=None) -> list[dict]:
        """This rank's host micro-batches of step `step` as the step trains on them: most tasks train on what
        collate gave. A task that works on the model first (GRPO: generation, rewards) returns new batches
        (on the host: the loop counts and copies them), calling `beat(k)` per unit of its work (the hang
        watchdog); the loop times it as the step's rollout."""
        return batches

    def rank_states(self) -> dict:
        """Per-rank state a checkpoint holds beside the loop's (run/checkpoint.CheckpointDict.per_rank): none."""
        return {}

    def step_counts(self, batch: dict) -> list[float]:
        """This micro-batch's counts that normalise the loss, counted on the host; the loop sums them over
        the global batch in the step's one all-reduce. Here: its targets."""
        return [float(self.target_count(batch))]

    def step_loss(self, model, batch: dict, totals: list[float]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This micro-batch's part of the global batch's loss (summed over every micro-batch of every rank it
        is the step's loss), given `totals` (step_counts summed over the global batch), and the sums of the
        task's training metrics (a 1-D tensor, additive over micro-batches and ranks; None: none). Here: the
        summed target losses over the global batch's target count."""
        return self.loss_sum(model, batch) / totals[0], None

    def train_metrics(self, sums: list[float]) -> dict:
        """The training metrics from step_loss's sums over a log window, summed over the ranks."""
        return {}

    def target_count(self, batch: dict) -> int:
        return int(batch["labels"].numel())

    def batch_tokens(self, batch: dict) -> int:
        return int(batch["input_ids"].numel())

    def export(self, model, out, write) -> None:
        """Write the final model into `out` (RUN/final while it is written); every rank calls it.
        `write(model, tokenizer, out)` is the run's Hugging Face writer (collective); a task that exports
        something else (chat with LoRA: the merged model, then out/adapter) wraps it."""
        write(model, self.tokenizer, out)
