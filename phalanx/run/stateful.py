"""Adapters that give the model, the optimizer and the RNG streams the `state_dict()`/`load_state_dict()`
pair (torch.distributed.checkpoint's `Stateful`), so a checkpoint is one dict of such objects
(checkpoint.py's `CheckpointDict`). TrainState, the schedule and the loss scaler have the pair already.

Model and optimizer states are keyed by parameter names (not optimizer indices), through
torch.distributed.checkpoint.state_dict, so DDP and FSDP2 checkpoints load into either and DCP reshards
them to another world size.
"""
from __future__ import annotations

import random

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from phalanx.model.optim import optimizer_impl, restore_impl


class ModelState:
    """The model's tensors. `trainable_only` keeps just the parameters that train (LoRA: the adapters; the
    frozen base is rebuilt from `model.pretrained`), and then loads non-strictly."""

    def __init__(self, model: torch.nn.Module, trainable_only: bool = False):
        self.model, self.trainable_only = model, trainable_only
        self.options = StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)

    def state_dict(self) -> dict:
        state = get_model_state_dict(self.model, options=self.options)
        if self.trainable_only:  # torch's option keeps a frozen tied weight under its second name (lm_head)
            trainable = {n for n, p in self.model.named_parameters(remove_duplicate=False) if p.requires_grad}
            state = {k: v for k, v in state.items() if k in trainable}
        return state

    def load_state_dict(self, state: dict) -> None:
        set_model_state_dict(self.model, state, options=self.options)


class OptimizerState:
    """The optimizer's per-parameter tensors (step, exp_avg, exp_avg_sq). Its hyper-parameters are another
    entry, `groups` (JSON, not tensors), which this one applies when it loads: the two make one torch
    state dict. The implementation (fused/foreach/loop) stays this run's: it changes speed, not state."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer
        self.impl = optimizer_impl(optimizer)
        self.groups = ParamGroups(optimizer)

    def state_dict(self) -> dict:
        return get_optimizer_state_dict(self.model, self.optimizer)["state"]

    def load_state_dict(self, state: dict) -> None:
        full = get_optimizer_state_dict(self.model, self.optimizer)
        full["state"] = state
        for group, saved in zip(full["param_groups"], self.groups.saved):
            group.update(saved)
        set_optimizer_state_dict(self.model, self.optimizer, full)
        restore_impl(self.optimizer, self.impl)


class ParamGroups:
    """The optimizer's param groups without their parameters (lr, betas, weight decay, ...). Loading keeps
    them for OptimizerState, which applies them together with the tensors."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer, self.saved = optimizer, []

    def state_dict(self) -> list[dict]:
        return [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]

    def load_state_dict(self, saved: list[dict]) -> None:
        self.saved = saved


class RNGState:
    """This process's random streams (Python, NumPy, torch CPU, this rank's CUDA device), as JSON."""

    def state_dict(self) -> dict:
        return rng_state()

    def load_state_dict(self, state: dict) -> None:
        set_rng_state(state)


def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {"python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
             "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
             "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # This rank's device only: get_rng_state_all() would create a context on every GPU.
        state["cuda"] = [torch.cuda.get_rng_state().tolist()]
    return state


def set_rng_state(state: dict) -> None:
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available() and torch.cuda.is_initialized():
        saved = state["cuda"]  # one entry (this rank's device), or one per device in older checkpoints
        mine = saved[torch.cuda.current_device()] if len(saved) > 1 else saved[0]
        torch.cuda.set_rng_state(torch.tensor(mine, dtype=torch.uint8))
