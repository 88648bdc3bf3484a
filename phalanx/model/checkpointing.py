"""Activation checkpointing per transformer block (`train.activation_checkpointing`).

A checkpointed block keeps only its inputs in the forward pass and recomputes its activations in the
backward pass. torch's non-reentrant checkpoint is used: it works under DDP (and no_sync), FSDP2, with
frozen parameters (LoRA: the block's input needs no gradient) and with keyword arguments, and it restores
the RNG state before recomputing, so dropout draws the same masks twice and losses and gradients are
bitwise those of a run without checkpointing. Only the block's `forward` is wrapped (the module, its name
and its parameters' names stay), so FSDP2's hooks stay outside the recomputed region: a block's
parameters are gathered once for the backward, as without checkpointing.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from phalanx.model.shard import transformer_blocks


def checkpointed_blocks(n_blocks: int, mode: str, every: int) -> list[int]:
    """Indices of the blocks to checkpoint: none, all (full), or blocks 0, k, 2k, ... (every_k)."""
    if mode == "none":
        return []
    step = 1 if mode == "full" else every
    return list(range(0, n_blocks, step))


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int = 1) -> int:
    """Checkpoint the chosen blocks of `model` (before it is sharded or wrapped); returns how many."""
    blocks = transformer_blocks(model)
    chosen = checkpointed_blocks(len(blocks), mode, every)
    for i in chosen:
        _checkpoint_forward(blocks[i])
    return len(chosen)


def _checkpoint_forward(block: nn.Module) -> None:
    inner = block.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        if not (block.training and torch.is_grad_enabled()):  # evaluation: nothing to save for a backward
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    block.forward = forward
