"""RUN/final: the trained model in the Hugging Face format, for plain `transformers` (and phalanx's own
generate/predict/report).

The export is written into RunFolder.final_tmp and renamed to final/ when complete, so a crash mid-write
never leaves a half-written final/. What goes in is the task's: each task has an export hook,
`task.export(model, out, write)` (TaskBase's default is `write(model, task.tokenizer, out)`), and
`write` is `write_hf` below. A task that exports something else wraps `write` (chat with LoRA: the
merged model, then the adapter in out/adapter).

`write_hf` picks the layout by size. A model up to `train.export_shard_mb` is one model.safetensors
written by rank 0 from the gathered state dict (`save_pretrained`), as before. A larger one is never
gathered whole anywhere: its tensors are cut into files of at most that size
(model-0000k-of-0000n.safetensors, plus the model.safetensors.index.json that from_pretrained reads), the
files are dealt to the ranks in turn, and each tensor is gathered to the rank that writes its file only;
every rank writes its files on a thread while the gathers go on.
"""
from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch
import torch.distributed as tdist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from phalanx.core import dist
from phalanx.core.config import TrainConfig
from phalanx.core.runfolder import RunFolder
from phalanx.model.build import tie_shared
from phalanx.model.slices import local, rows

DEFAULT_SHARD_MB = TrainConfig().export_shard_mb
INDEX = "model.safetensors.index.json"


def export_final(model: torch.nn.Module, task, folder: RunFolder, info: dist.DistInfo,
                 shard_mb: float = DEFAULT_SHARD_MB) -> None:
    """Collective: every rank calls it. Runs the task's export hook into the temporary folder, then
    publishes it as RUN/final."""
    if info.is_main:
        shutil.rmtree(folder.final_tmp, ignore_errors=True)
        folder.final_tmp.mkdir(parents=True)
    dist.barrier(info)
    task.export(model, folder.final_tmp, partial(write_hf, info=info, shard_mb=shard_mb))
    dist.barrier(info)
    if info.is_main:
        folder.publish_final()
    dist.barrier(info)


def write_hf(model: torch.nn.Module, tokenizer, out: Path, *, info: dist.DistInfo,
             shard_mb: float = DEFAULT_SHARD_MB) -> None:
    """Collective: the model (FSDP2 shards included) in the Hugging Face layout, with the tokenizer."""
    entries = export_entries(model)
    if sum(_nbytes(t) for _, t in entries) <= shard_mb * 2**20:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if info.is_main:
            model.save_pretrained(out, state_dict=tie_shared(full, model))
    else:
        write_sharded(model, entries, Path(out), info, int(shard_mb * 2**20))
    if info.is_main:
        tokenizer.save_pretrained(out)


def export_entries(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of what the export holds, in state-dict order: parameters and persistent buffers, a
    tied tensor once under its first name (as save_pretrained writes it). Tensors may be FSDP2 shards."""
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}  # each shared tensor once
    return [(name, tensors[name]) for name in model.state_dict() if name in tensors]


def plan_files(entries: list[tuple[str, torch.Tensor]], limit: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive tensors into files of at most `limit` bytes (a larger tensor gets a file of its own)."""
    files: list[list] = [[]]
    size = 0
    for name, t in entries:
        if files[-1] and size + _nbytes(t) > limit:
            files.append([])
            size = 0
        files[-1].append((name, t))
        size += _nbytes(t)
    return files


def write_sharded(model: torch.nn.Module, entries, out: Path, info: dist.DistInfo, limit: int) -> None:
    """Collective. File k is written by rank k mod world; the gathers run in file order on every rank."""
    from safetensors.torch import save_file  # lazy: only the sharded export needs it

    files = plan_files(entries, limit)
    out.mkdir(parents=True, exist_ok=True)  # whichever rank writes first (the run folder is shared)
    names = [f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k in range(len(files))]
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = None
        for k, file in enumerate(files):
            writer = k % info.world_size
            tensors = {name: gather_to(t, writer, info) for name, t in file}
            if info.rank == writer:
                if pending is not None:
                    pending.result()  # one file in memory while the next is gathered
                pending = pool.submit(save_file, tensors, str(out / names[k]), metadata={"format": "pt"})
        if pending is not None:
            pending.result()
    if info.is_main:
        weight_map = {name: names[k] for k, file in enumerate(files) for name, _ in file}
        index = {"metadata": {"total_size": sum(_nbytes(t) for _, t in entries)}, "weight_map": weight_map}
        (out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        _save_configs(model, out)


def gather_to(t: torch.Tensor, writer: int, info: dist.DistInfo) -> torch.Tensor | None:
    """The whole tensor `t` on rank `writer` (on the CPU, contiguous), None elsewhere. A shard is gathered
    to the writer alone; a tensor every rank holds whole (DDP, buffers) needs no communication."""
    part = rows(t)
    if part is None:
        return t.detach().cpu().contiguous() if info.rank == writer else None
    piece = local(t).detach()
    per_rank = -(-t.shape[0] // info.world_size)
    # on the process group's device (CPU-offloaded shards go to the GPU for NCCL); the last ranks may hold
    # fewer rows, or none
    padded = torch.zeros((per_rank, *t.shape[1:]), dtype=piece.dtype, device=info.device)
    padded[:piece.shape[0]] = piece
    bucket = [torch.empty_like(padded) for _ in range(info.world_size)] if info.rank == writer else None
    tdist.gather(padded, bucket, dst=writer)
    if info.rank != writer:
        return None
    return torch.cat(bucket)[:t.shape[0]].cpu().contiguous()


def _save_configs(model: torch.nn.Module, out: Path) -> None:
    """config.json (and generation_config.json) as save_pretrained writes them, without the weights."""
    config = model.config
    config.dtype = str(next(model.parameters()).dtype).split(".")[1]
    config.architectures = [type(model).__name__.removeprefix("FSDP")]  # FSDP2 renames the model's class
    config.save_pretrained(out)
    if model.can_generate():
        model.generation_config.save_pretrained(out)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
