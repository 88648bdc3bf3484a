"""The pieces that train, built once per worker: the model (with its adapters), its wrapper, the
optimizer, schedule, loss scaler and autocast, and what a checkpoint of them holds."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from phalanx.core import dist
from phalanx.core.config import Config
from phalanx.model import precision
from phalanx.model.build import model_builder, wrap
from phalanx.model.optim import WarmupCosine, build_optimizer
from phalanx.model.weights import pretrained_dtype
from phalanx.run.checkpoint import CheckpointDict
from phalanx.run.state import TrainState
from phalanx.run.stateful import ModelState, OptimizerState, RNGState


@dataclass
class Trainee:
    """The pieces that train. `model` is the raw model (saved, evaluated, exported); `wrapped` adds
    DDP/FSDP to it and `forward` adds torch.compile on top (or is `wrapped`)."""
    model: torch.nn.Module
    wrapped: torch.nn.Module
    forward: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedule: WarmupCosine
    scaler: torch.amp.GradScaler
    autocast: object
    amp_dtype: torch.dtype | None
    added: str = ""  # what a pretrained build added to the checkpoint (a new head, grown rows), for the start line
    frozen_dtype: torch.dtype | None = None  # LoRA: the dtype the frozen base is stored in (None: fp32)


def build_trainee(cfg: Config, info: dist.DistInfo, task) -> Trainee:
    t = cfg.train
    precision.set_tf32(t.tf32, info.device.type)  # before the first matmul (CUDA only)
    amp_dtype, warnings = precision.check_precision(t.precision, info.device.type)
    for warning in warnings:
        say(info, f"phalanx: warning: {warning}")
    torch.manual_seed(t.seed)  # a defined global stream (the model and its adapters are initialised by name)
    frozen_dtype = precision.base_dtype(cfg.model, t.strategy, info.world_size, amp_dtype,
                                        partial(pretrained_dtype, cfg.model.pretrained))
    builder = model_builder(t, info.device, info.world_size, amp_dtype, frozen_dtype)
    model = task.build_model(builder)
    wrapped = wrap(model, t.strategy, info)
    return Trainee(model=model, wrapped=wrapped, forward=torch.compile(wrapped) if t.compile else wrapped,
                   optimizer=build_optimizer(model, t), schedule=WarmupCosine(t),
                   scaler=precision.make_scaler(info.device, amp_dtype),
                   autocast=precision.autocast_factory(info.device, amp_dtype), amp_dtype=amp_dtype,
                   added=builder.report.clause(), frozen_dtype=frozen_dtype)


def checkpoint_dict(tr: Trainee, state: TrainState) -> CheckpointDict:
    """What a checkpoint holds: every object whose state a resumed run needs, by name. The sampler has no
    entry: its position is `state.samples_seen` (with `state.data_order`)."""
    optim = OptimizerState(tr.model, tr.optimizer)
    # A model with frozen parameters (LoRA) saves only what trains; the base is rebuilt from model.pretrained,
    # whose identity the checkpoint records (a resume onto another base is refused).
    frozen = any(not p.requires_grad for p in tr.model.parameters())
    return CheckpointDict(
        sharded={"model": ModelState(tr.model, trainable_only=frozen), "optim": optim},
        shared={"train_state": state, "schedule": tr.schedule, "scaler": tr.scaler, "param_groups": optim.groups},
        per_rank={"rng": RNGState()})  # dropout is seeded per micro-batch; other streams continue per rank


def say(info, text: str) -> None:
    """A line on stdout from the main rank."""
    if info.is_main:
        print(text, flush=True)
