"""Tasks plug into the task-agnostic loop in train.py through the same few methods.

A task object has: `prepare()` (builds `train_set`, `val_set`, `tokenizer`), `train_order()` (an epoch
order for the sampler, or None for a plain shuffle), `build_model()`, `collate(dataset, indices)`,
`target_count(batch)`, `useful_tokens(batch)` (non-padding), `loss_sum(model, batch)` (summed over targets: the loop normalises by the
global count), `batch_tokens(batch)`, `eval_sums(model, batch)` / `eval_metrics(sums)` (exact,
all-reduced evaluation), `export(model, folder)` and `summary_extra()`.
"""
from __future__ import annotations


def get_task(name: str):
    if name == "lm":
        from .lm import LMTask
        return LMTask
    if name == "classify":
        from .classify import ClassifyTask
        return ClassifyTask
    raise ValueError(f"unknown task {name!r}")
