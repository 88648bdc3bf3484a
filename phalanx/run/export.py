"""RUN/final: the trained model in the Hugging Face format, for plain `transformers` (and phalanx's own
generate/predict/report).

The export is written into RunFolder.final_tmp and renamed to final/ when complete, so a crash mid-write
never leaves a half-written final/. What goes in is the task's: each task has an export hook,
`task.export(model, out, write)` (TaskBase's default is `write(model, task.tokenizer, out)`), and
`write` is `write_hf` below. A task that exports something else passes its own entries (chat with LoRA:
the base's weights with the adapters merged in, model/lora.merged_entries; the adapter in out/adapter).

`write_hf` never gathers a model whole anywhere: its tensors are cut into files of at most
`train.export_shard_mb` (and, for a sharded model or a LoRA merge, at most a quarter of a rank's share of
the export, so the end of a run does not peak above its steps: file_limit), the files are dealt to the
ranks in turn, and each tensor is gathered to the rank that writes its file only; every rank writes its
files on a thread while the gathers go on. One file is model.safetensors (rank 0); more are
model-0000k-of-0000n.safetensors plus the model.safetensors.index.json that from_pretrained reads. A
merged weight is gathered with its layer's adapters, merged in fp32 on its writer, then cast; the merge
goes into the writer's copy of that one tensor (a gathered or cast one; a ddp run's fp32 weight on the CPU
is copied first), so the model is left as it trained.

The weights are written in `train.export_dtype` (`export_dtype`: auto = the pretrained base's own dtype),
cast from the weights as each tensor is written (fp32 master weights; a LoRA base may be stored in 16 bit,
its merge is done in fp32); buffers and integer tensors keep theirs; config.json's `dtype` says the written
one, and `train.export_shard_mb` counts bytes in it.
"""
from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch
import torch.distributed as tdist
from torch.distributed.tensor import DTensor

from phalanx.core import dist
from phalanx.core.sections import TrainConfig
from phalanx.core.runfolder import RunFolder
from phalanx.model.build import export_entries
from phalanx.model.lora import Merged
from phalanx.model.slices import local, rows
from phalanx.model.weights import pretrained_dtype

DEFAULT_SHARD_MB = TrainConfig().export_shard_mb
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MIN_FILE_MB = 16  # files smaller than this only add files
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def export_dtype(choice: str, pretrained: str) -> torch.dtype:
    """train.export_dtype -> the dtype RUN/final's weights are written in: `auto` = the pretrained base's own
    (its config.json's dtype, else its weights'), fp32 when training from scratch."""
    if choice != "auto":
        return DTYPES[choice]
    return pretrained_dtype(pretrained) or torch.float32


def export_final(model: torch.nn.Module, task, folder: RunFolder, info: dist.DistInfo,
                 shard_mb: float = DEFAULT_SHARD_MB, dtype: torch.dtype = torch.float32) -> None:
    """Collective: every rank calls it. Runs the task's export hook into the temporary folder, then
    publishes it as RUN/final."""
    if info.is_main:
        shutil.rmtree(folder.final_tmp, ignore_errors=True)
        folder.final_tmp.mkdir(parents=True)
    dist.barrier(info)
    task.export(model, folder.final_tmp, partial(write_hf, info=info, shard_mb=shard_mb, dtype=dtype))
    dist.barrier(info)
    if info.is_main:
        folder.publish_final()
    dist.barrier(info)


def write_hf(model: torch.nn.Module, tokenizer, out: Path, *, info: dist.DistInfo,
             shard_mb: float = DEFAULT_SHARD_MB, dtype: torch.dtype = torch.float32, entries=None) -> None:
    """Collective: the model (FSDP2 shards included) in the Hugging Face layout, its floating-point
    parameters in `dtype`, with the tokenizer. `entries`: (name, tensor, Merged or None) to write instead of
    the model's own tensors (a LoRA export: the base's weights with the adapters merged in)."""
    params = {id(p) for p in model.parameters()}
    entries = entries if entries is not None else [(n, t, None) for n, t in export_entries(model)]
    entries = [(name, t, _written_dtype(t, id(t) in params, dtype), merge) for name, t, merge in entries]
    write_files(model, entries, Path(out), info, file_limit(entries, shard_mb, info.world_size), dtype)
    if info.is_main:
        tokenizer.save_pretrained(out)


def file_limit(entries, shard_mb: float, world_size: int) -> int:
    """Bytes per file: train.export_shard_mb, and at most what the end of a run can hold without peaking above
    its steps (a writer holds one file while it gathers the next). A sharded model: a quarter of each rank's
    share of the export (a full fine-tuning's freed gradients make the room; the whole 1.2 GB model gathered
    to rank 0 of four that each held 0.3 GB of weights was 1.1 x the steps). A LoRA merge frees no
    gradients: two of its largest tensors (what the steps gathered anyway; the merged 0.6 GB on rank 0 under
    ddp was 1.7 x the steps). Never under MIN_FILE_MB."""
    limit = int(shard_mb * 2**20)
    if any(merge is not None for *_, merge in entries):  # no freed gradients: the steps' gathers are the room
        largest = max(_nbytes(t, d) for _, t, d, _ in entries)
        return min(limit, max(2 * largest, MIN_FILE_MB * 2**20))
    if any(isinstance(t, DTensor) for _, t, *_ in entries):
        share = sum(_nbytes(t, d) for _, t, d, *_ in entries) / world_size
        limit = min(limit, max(int(share / 4), MIN_FILE_MB * 2**20))
    return limit


def _written_dtype(t: torch.Tensor, is_param: bool, dtype: torch.dtype) -> torch.dtype:
    """`dtype` for a floating-point parameter; a buffer or an integer tensor keeps its own."""
    return dtype if is_param and t.is_floating_point() else t.dtype


def plan_files(entries: list[tuple], limit: int) -> list[list[tuple]]:
    """Consecutive tensors into files of at most `limit` bytes (a larger tensor gets a file of its own);
    an entry is (name, tensor) or (name, tensor, the dtype it is written in, ...)."""
    files: list[list] = [[]]
    size = 0
    for entry in entries:
        n = _nbytes(*entry[1:3])
        if files[-1] and size + n > limit:
            files.append([])
            size = 0
        files[-1].append(entry)
        size += n
    return files


def write_files(model: torch.nn.Module, entries, out: Path, info: dist.DistInfo, limit: int,
                dtype: torch.dtype = torch.float32) -> None:
    """Collective. Everything up to `limit` bytes: one model.safetensors (rank 0); more: files of at most
    `limit` bytes and the index, file k written by rank k mod world. The gathers run in file order on every
    rank; a merged weight is gathered (with its adapters), merged in fp32 and cast on its writer only."""
    from safetensors.torch import save_file  # lazy: only the export needs it

    files = plan_files(entries, limit)
    out.mkdir(parents=True, exist_ok=True)  # whichever rank writes first (the run folder is shared)
    names = [SINGLE] if len(files) == 1 else \
        [f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k in range(len(files))]
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = None
        for k, file in enumerate(files):
            writer = k % info.world_size
            tensors = {name: _gather_entry(t, merge, d, writer, info) for name, t, d, merge in file}
            if info.rank == writer:
                if pending is not None:
                    pending.result()  # one file in memory while the next is gathered
                pending = pool.submit(save_file, tensors, str(out / names[k]), metadata={"format": "pt"})
        if pending is not None:
            pending.result()
    if info.is_main:
        if len(files) > 1:
            weight_map = {name: names[k] for k, file in enumerate(files) for name, *_ in file}
            index = {"metadata": {"total_size": sum(_nbytes(t, d) for _, t, d, _ in entries)},
                     "weight_map": weight_map}
            (out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        _save_configs(model, out, dtype)


def _gather_entry(t: torch.Tensor, merge: Merged | None, dtype: torch.dtype, writer: int,
                  info: dist.DistInfo) -> torch.Tensor | None:
    """Collective: the written tensor on `writer` (None elsewhere)."""
    full = gather_to(t, writer, info)
    if merge is None:
        return full if full is None else full.to(dtype)
    adapters = [(a.full_tensor() if isinstance(a, DTensor) else a).detach().float().cpu() for a in merge.adapters]
    return None if full is None else merge.merge(_own_fp32(full, t), adapters).to(dtype).contiguous()


def _own_fp32(full: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`full` in fp32 as a tensor of the writer's own, which the merge may write into (in place, no
    delta-sized temporary). A gathered shard, a tensor moved off the GPU or cast from 16 bit is one already;
    a whole fp32 weight on the CPU (ddp) is the model's own storage, so that one tensor is copied."""
    work = full.float()
    if work.untyped_storage().data_ptr() == local(t).untyped_storage().data_ptr():
        work = work.clone()
    return work


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


def _save_configs(model: torch.nn.Module, out: Path, dtype: torch.dtype) -> None:
    """config.json (and generation_config.json) as save_pretrained writes them, without the weights, saying
    the dtype the weights were written in."""
    config = model.config
    config.dtype = str(dtype).split(".")[1]
    config.architectures = [type(model).__name__.removeprefix("FSDP")]  # FSDP2 renames the model's class
    config.save_pretrained(out)
    if model.can_generate():
        model.generation_config.save_pretrained(out)


def _nbytes(t: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    return t.numel() * (dtype or t.dtype).itemsize
