"""The worker's start line: what runs (task, size, world, batch arithmetic, precision, strategy, optimizer,
attention), what a pretrained build added, and under LoRA what is stored in which dtype and what computes."""
from __future__ import annotations

import torch

from phalanx.core import dist
from phalanx.core.config import Config
from phalanx.model import gguf, precision
from phalanx.model.build import attention_in_use, count_parameters
from phalanx.model.lora import trainable_parameters
from phalanx.model.optim import optimizer_impl


def start_line(cfg: Config, info: dist.DistInfo, tr, accum: int) -> str:
    """`tr`: the run's Trainee (run/train.py)."""
    t = cfg.train
    attention = attention_in_use(tr.model)  # what runs: model.attn_implementation, or the model's default
    auto = " (auto)" if cfg.model.attn_implementation == "auto" else ""
    base = gguf.describe(cfg.model.pretrained)  # a base dequantised from GGUF: which file, where
    return (f"phalanx: task {cfg.task}, {count_parameters(tr.model) / 1e6:.2f}M parameters, world size "
            f"{info.world_size} ({info.backend}, {torch.get_num_threads()} threads/process), global batch "
            f"{t.global_batch_size} = micro {t.micro_batch_size} x world {info.world_size} x accum {accum}, "
            f"precision {precision.describe(t.precision, tr.amp_dtype)}, strategy "
            f"{t.strategy if info.world_size > 1 else 'single'}, optimizer AdamW {optimizer_impl(tr.optimizer)}"
            + (f", attention {attention}{auto}" if attention else "")
            + (f", tf32 {'on' if t.tf32 else 'off'}" if info.device.type == "cuda" else "")
            + (f", {lora_clause(cfg, tr)}" if cfg.model.lora.r else "")
            + (", dropout off (preference.disable_dropout)" if cfg.task == "preference"
               and cfg.preference.disable_dropout else "")
            + (f", {tr.added}" if tr.added else "")
            + (f", {base}" if base else ""))


def lora_clause(cfg: Config, tr) -> str:
    """e.g. 'LoRA r=8: 0.39M adapters + token rows in fp32 (AdamW fp32), frozen base stored bf16 (auto), compute
    bf16'."""
    stored = precision.name(tr.frozen_dtype)
    how = f"{stored} (auto)" if cfg.model.base_dtype == "auto" else stored
    return (f"LoRA r={cfg.model.lora.r}: {trainable_parameters(tr.model) / 1e6:.2f}M trainable in fp32 (their "
            f"gradients and AdamW state fp32), frozen base stored {how}, compute {precision.name(tr.amp_dtype)}")
