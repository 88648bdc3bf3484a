"""Tasks plug into the task-agnostic loop in train.py through the `Task` interface (base.py).

`get_task(name)` imports only the chosen task's module (each pulls in its own model family).
"""
from __future__ import annotations

import importlib
import sys

from phalanx.core.config import Config
from phalanx.core.registry import task_spec
from phalanx.data.hub import check_hub_names
from phalanx.tasks.base import Task


def get_task(name: str) -> type[Task]:
    """The Task class registered under `name` (core/registry.py); only its module is imported."""
    module, _, cls = task_spec(name).impl.partition(":")
    return getattr(importlib.import_module(module), cls)


def prepare_data(cfg: Config, workers: int = 0, progress: bool | None = None) -> dict:
    """The data step (`phalanx prepare`, or the launcher before any worker starts): bounded pre-flight
    checks on a sample, then the tokenizer and the stores. A data error is a ConfigError (exit 2)."""
    task = get_task(cfg.task)
    task.check_config(cfg)
    # hub names usable (cached or reachable) before anything reads them; a hub dataset already streamed
    # into phalanx's store is not read again
    check_hub_names(cfg, data=not task.is_prepared(cfg))
    task.preflight(cfg)
    if progress is None:  # the bar follows log.progress (auto = only on an interactive terminal)
        progress = cfg.log.progress == "bar" or (cfg.log.progress == "auto" and sys.stderr.isatty())
    return task.prepare_data(cfg, workers or cfg.data.prepare_workers, progress)
