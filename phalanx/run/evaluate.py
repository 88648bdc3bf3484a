"""Exact distributed evaluation: every validation sample is evaluated once, whatever the world size.

Samples are split into contiguous shards of uneven size (no padding duplicates). Each rank runs the
same number of forward passes (a rank with fewer samples runs a throw-away batch), so sharded models
(FSDP) whose forward is itself collective never hang. Per-rank sums are all-reduced in float64 and the
task turns them into metrics; the sample count is checked against the data set size.
"""
from __future__ import annotations

import math

import torch

from phalanx.core import dist


def eval_shard(n: int, rank: int, world_size: int) -> range:
    """Contiguous, uneven-but-exact shard of n evaluation samples: every sample on exactly one rank."""
    return range(rank * n // world_size, (rank + 1) * n // world_size)


@torch.no_grad()
def evaluate(task, model, dataset, info: dist.DistInfo, micro_batch_size: int, max_samples: int = 0,
             autocast=None) -> dict:
    n = len(dataset) if not max_samples else min(max_samples, len(dataset))
    if n == 0:
        return {}
    shard = eval_shard(n, info.rank, info.world_size)
    rounds = math.ceil(math.ceil(n / info.world_size) / micro_batch_size)
    was_training = model.training
    model.eval()
    # A task whose metric is not a sum over batches (entity F1) also returns each batch's outputs: gathered in
    # sample order (contiguous shards, rank order) and given whole to eval_metrics on every rank.
    gathers = getattr(task, "EVAL_OUTPUTS", False)
    totals, outputs = None, []
    for b in range(rounds):
        ids = list(shard[b * micro_batch_size:(b + 1) * micro_batch_size])
        real = bool(ids)
        batch = task.collate(dataset, ids if real else [0])
        batch = dist.to_device(batch, info.device)
        with autocast() if autocast else torch.autocast(info.device.type, enabled=False):
            sums = task.eval_sums(model, batch)
        if gathers:
            sums, out = sums
            outputs += out if real else []
        totals = totals or [0.0] * len(sums)
        if real:
            totals = [a + b for a, b in zip(totals, sums)]
    model.train(was_training)
    reduced = dist.all_reduce(totals, info)
    if gathers:
        metrics = task.eval_metrics(reduced, [o for part in dist.all_gather_objects(outputs, info) for o in part])
    else:
        metrics = task.eval_metrics(reduced)
    if metrics.get("eval/samples") != n:
        raise RuntimeError(f"evaluation saw {metrics.get('eval/samples')} samples, expected {n}")
    return metrics
