"""RUN/final: the trained model in the Hugging Face format, for plain `transformers` (and phalanx's own
generate/predict/report).

The export is written into RunFolder.final_tmp and renamed to final/ when complete, so a crash mid-write
never leaves a half-written final/. What goes in is the task's: each task has an export hook,
`task.export(model, out, write)` (TaskBase's default is `write(model, task.tokenizer, out)`), and
`write` is `write_hf` below. A task that exports something else wraps `write` (chat with LoRA: the
merged model, then the adapter in out/adapter); a sharded writer for models larger than one device
replaces `write_hf` without touching the hooks.
"""
from __future__ import annotations

import shutil
from functools import partial
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from phalanx.core import dist
from phalanx.core.runfolder import RunFolder
from phalanx.model.build import tie_shared, unwrap


def export_final(model: torch.nn.Module, task, folder: RunFolder, info: dist.DistInfo) -> None:
    """Collective: every rank calls it. Runs the task's export hook into the temporary folder, then
    publishes it as RUN/final."""
    if info.is_main:
        shutil.rmtree(folder.final_tmp, ignore_errors=True)
        folder.final_tmp.mkdir(parents=True)
    dist.barrier(info)
    task.export(model, folder.final_tmp, partial(write_hf, info=info))
    dist.barrier(info)
    if info.is_main:
        folder.publish_final()
    dist.barrier(info)


def write_hf(model: torch.nn.Module, tokenizer, out: Path, *, info: dist.DistInfo) -> None:
    """Collective: the full state dict is gathered (FSDP2 shards included) to the CPU, and rank 0 writes
    it with `save_pretrained` (safetensors), with the tokenizer."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if info.is_main:
        unwrap(model).save_pretrained(out, state_dict=tie_shared(full, model))
        tokenizer.save_pretrained(out)
