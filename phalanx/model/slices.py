"""Which rows of a model tensor this rank holds, and writing them.

FSDP2 shards every parameter on dim 0 the way `torch.chunk` splits it: ceil(n / world) rows per rank, the
last ranks fewer or none. Anything else (a parameter under DDP or at world size 1, a buffer) is held whole.
Named initialisation, pretrained loading and the sharded export all go through these two functions, so
they agree on who holds what.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard


def rows(t: torch.Tensor) -> slice | None:
    """The rows of the full tensor `t` that this rank holds; None = all of it."""
    if not isinstance(t, DTensor):
        return None
    placements = t.placements
    if len(placements) != 1 or not isinstance(placements[0], Shard) or placements[0].dim != 0:
        raise ValueError(f"expected a tensor sharded on dim 0 over a 1-D mesh, got placements {placements}")
    n, world, rank = t.shape[0], t.device_mesh.size(), t.device_mesh.get_local_rank()
    per_rank = -(-n // world)
    lo = min(n, rank * per_rank)
    hi = min(n, lo + per_rank)
    if t.to_local().shape[0] != hi - lo:  # a sharding other than torch.chunk's would be caught here
        raise ValueError(f"local shard of {tuple(t.shape)} has {t.to_local().shape[0]} rows, expected {hi - lo}")
    return slice(lo, hi)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t` as a plain tensor (writes go into the model)."""
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def write_local(t: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's rows of `full` (the whole tensor, on any device, any float dtype) into `t`."""
    part = rows(t)
    local(t).copy_(full if part is None else full[part])
