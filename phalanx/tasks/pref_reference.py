"""The reference model's log-probs for preference tuning (`preference.reference`).

    adapters_off  the policy itself with its LoRA adapters disabled, under no_grad: no second copy (ddp or
                  fsdp: the same sharded model, one more forward per micro-batch)
    model         a frozen copy built like the policy by the trainer's Builder (sharded under fsdp, its
                  weights loaded from model.pretrained, stored in preference.reference_dtype)
    precomputed   one distributed pass before training (and before a checkpoint is loaded: the policy still
                  holds its initial weights) writes every pair's reference log-probs beside the prepared
                  pairs, in a folder named by a key of what they depend on: the base's content identity
                  (model/identity.py; from scratch: the architecture and seed), the store (its data, tokenizer
                  and template, truncation: the store folder and index), the pass's compute precision, stored
                  dtype and attention implementation. Later runs with the same key read it; a run whose key
                  differs computes its own, never reads another's. The pass is cut into chunks of CHUNK pairs,
                  each written when done, so a killed pass resumes (on any world size) where it stopped; it
                  beats the hang watchdog per micro-batch and shows its progress on the main rank.
    none          simpo needs no reference.

Every kind runs the reference in eval mode (no dropout) under the step's autocast, so the three agree.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from phalanx.core import dist
from phalanx.core.config import Config, ConfigError
from phalanx.data.cache import cache_root
from phalanx.data.store import read_index
from phalanx.model.build import attention_in_use, model_builder
from phalanx.model.identity import base_identity
from phalanx.model.lora import is_lora

CHUNK = 256  # pairs per written piece of the precomputed pass
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def kind(cfg: Config) -> str:
    """preference.reference resolved: none (simpo), adapters_off, model or precomputed."""
    p = cfg.preference
    if p.loss == "simpo":
        return "none"
    if p.reference == "auto":
        return "adapters_off" if cfg.model.lora.r else "precomputed"
    return p.reference


def check(cfg: Config) -> None:
    """The preference section against the rest of the config (the launcher, before any worker starts)."""
    p = cfg.preference
    if p.loss == "simpo" and p.reference != "auto":
        raise ConfigError(f"config key 'preference.reference': {p.reference}, but preference.loss=simpo uses no "
                          f"reference; leave it auto")
    if p.reference == "adapters_off" and not cfg.model.lora.r:
        raise ConfigError("config key 'preference.reference': adapters_off needs LoRA (model.lora.r > 0); full "
                          "fine-tuning uses precomputed or model")
    if (kind(cfg) == "model" and p.reference_dtype != "fp32" and cfg.train.precision == "fp32"
            and cfg.train.strategy != "fsdp"):
        raise ConfigError(f"config key 'preference.reference_dtype': a {p.reference_dtype} reference would meet fp32 "
                          f"activations under ddp; set train.precision=bf16 (or fp16), or keep fp32")


class Frozen:
    """The Builder's adapter hook for a frozen copy: every parameter frozen on the meta skeleton (so the
    Builder stores it in its frozen dtype), nothing added."""

    def inject(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.requires_grad_(False)

    def is_adapter(self, name: str) -> bool:
        return False

    def base_name(self, name: str) -> str:
        return name

    def init(self, model, skeleton, seed: int, todo: dict) -> None:
        pass


class Reference:
    """`logps(batch)`: the reference's (pairs, 2) summed log-probs of a micro-batch, or None (simpo)."""

    def __init__(self, name: str, task, model: torch.nn.Module | None = None):
        self.name, self.task, self.model = name, task, model

    def logps(self, batch: dict) -> torch.Tensor | None:
        if self.name == "none":
            return None
        if self.name == "precomputed":
            return batch["ref_logps"]
        return reference_logps(self.task, self.model, batch)


@torch.no_grad()
def reference_logps(task, model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """A model's (pairs, 2) summed log-probs in eval mode (no dropout); a LoRA policy with its adapters off."""
    was_training = model.training
    # peft's disable_adapter clears requires_grad on the adapters registered when it starts and sets it on
    # those registered when it ends; under FSDP2 the root's parameters are swapped between the two (unsharded
    # by the forward), so the sharded trainable-token rows the optimizer holds would stay frozen: restore them
    trainable = [p for p in model.parameters() if p.requires_grad]
    model.eval()
    try:
        with model.disable_adapter() if is_lora(model) else contextlib.nullcontext():
            return task.sequence_logps(model, batch)
    finally:
        model.train(was_training)
        for p in trainable:
            p.requires_grad_(True)


def attach(task, trainee, beat=None, progress=None) -> Reference:
    """The run's reference, built or computed now (the policy holds its initial weights). `beat(k)`: the hang
    watchdog's beat, once per micro-batch of a precomputed pass; `progress(total, done)`: its progress display."""
    name = kind(task.cfg)
    if name == "adapters_off":
        return Reference(name, task, trainee.model)
    if name == "model":
        return Reference(name, task, frozen_copy(task, trainee))
    if name == "precomputed":
        precompute(task, trainee, beat, progress)
    return Reference(name, task)


def frozen_copy(task, trainee) -> torch.nn.Module:
    """The reference model: built like the policy (its Builder: sharded under fsdp), without adapters, every
    parameter frozen and stored in preference.reference_dtype; without dropout as the policy
    (preference.disable_dropout), although it only ever runs in eval mode."""
    cfg, info = task.cfg, task.info
    builder = model_builder(cfg.train, info.device, info.world_size, trainee.amp_dtype,
                            DTYPES[cfg.preference.reference_dtype])
    return task.without_dropout(builder.build(task.define_model, cfg.model.pretrained, mismatched=task.MISMATCHED,
                                              adapters=Frozen())).eval()


# ---- precomputed ------------------------------------------------------------------------------
def key(cfg: Config, trainee, folder: Path) -> dict:
    """What the stored log-probs of the store in `folder` depend on."""
    m = cfg.model
    if m.pretrained:
        base = base_identity(m.pretrained, cache_root(cfg.data.cache_dir))
    else:  # from scratch: the architecture and the seed that initialise it
        base = {k: v for k, v in asdict(m).items() if k not in ("lora", "base_dtype")} | {"seed": cfg.train.seed}
    index = read_index(folder) or {}
    return {"version": 1, "base": base, "store": folder.name, "sources": index.get("sources"),
            "created": index.get("created"), "precision": str(trainee.amp_dtype or "fp32"),
            "stored": str(trainee.frozen_dtype or torch.float32), "attention": attention_in_use(trainee.model)}


def folder_of(store: Path, what: dict) -> Path:
    digest = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return store / f"reference-{digest}"


def precompute(task, trainee, beat=None, progress=None) -> None:
    """Every pair's reference log-probs for the training and validation pairs: read where this key's were
    written, else computed now by all ranks (and written by each node's first process); `beat(k)` once per
    micro-batch of the pass."""
    done: dict[Path, np.ndarray] = {}
    for dataset in (task.train_set, task.val_set):
        pairs = dataset.units
        if pairs.folder not in done:
            what, t0 = key(task.cfg, trainee, pairs.folder), time.perf_counter()
            out = folder_of(pairs.folder, what)
            done[pairs.folder] = stored(out, what, pairs.n)
            how = "read from"
            if done[pairs.folder] is None:
                done[pairs.folder], how = compute(task, trainee, pairs, out, what, beat, progress), "computed into"
            if task.info.is_main:
                print(f"phalanx: reference log-probs of {pairs.n:,} pairs {how} {out} in "
                      f"{time.perf_counter() - t0:.1f} s", flush=True)
        dataset.reference = done[pairs.folder]


def stored(out: Path, what: dict, n: int) -> np.ndarray | None:
    """The log-probs written for exactly this key (its key.json, written last, says so), else None."""
    try:
        if json.loads((out / "key.json").read_text()) != json.loads(json.dumps(what, default=str)):
            return None
        values = np.load(out / "logps.npy")
    except (OSError, ValueError):
        return None
    return values if values.shape == (n, 2) else None


def compute(task, trainee, pairs, out: Path, what: dict, beat=None, progress=None) -> np.ndarray:
    """The distributed pass: chunks not yet written are dealt to the ranks in turn, one per rank per round, each
    run in micro-batches. After every micro-batch the ranks gather its log-probs (with the pairs and tokens
    done, for the progress line), so a rank waits at most one of another's micro-batches, and each calls
    `beat(k)` (the hang watchdog) per micro-batch: a chunk may take longer than dist.startup_timeout_s, and the
    main rank's `progress(total, done)` display (run/monitor.PassProgress) is updated. At the
    end of a round each node's first process writes its chunks. Under FSDP every rank runs a forward in each
    micro-batch of the round (a rank with less runs throw-away batches: FSDP's forwards are collective)."""
    info, micro, beat = task.info, task.cfg.train.micro_batch_size, beat or (lambda k: None)
    collective = task.cfg.train.strategy == "fsdp" and info.world_size > 1
    if info.is_local_main:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier(info)
    chunks = math.ceil(pairs.n / CHUNK)
    # missing on any node is missing: every rank then deals the same list
    missing = dist.all_reduce([float(not (out / _chunk(c)).is_file()) for c in range(chunks)], info, "max")
    todo = [c for c, m in enumerate(missing) if m]
    progress = (progress if info.is_main and progress else _Silent)(
        pairs.n, pairs.n - sum(len(_pairs_of(c, pairs.n)) for c in todo))
    model, k = trainee.model, 0
    try:
        for r in range(0, len(todo), info.world_size):
            dealt = todo[r:r + info.world_size]  # rank j runs chunk dealt[j]
            ids = _pairs_of(dealt[info.rank], pairs.n) if info.rank < len(dealt) else range(0)
            got: list[list[float]] = [[] for _ in dealt]
            for b in range(math.ceil(max(len(_pairs_of(c, pairs.n)) for c in dealt) / micro)):
                beat(k)
                k += 1
                sub, flat, tokens = list(ids[b * micro:(b + 1) * micro]), [], 0
                if sub or collective:
                    batch = task.collate_pairs(pairs, [[p] for p in (sub or [0])], None)
                    tokens = task.useful_tokens(batch) if sub else 0
                    with trainee.autocast():
                        values = reference_logps(task, model, dist.to_device(batch, info.device))
                    flat = values.double().flatten().tolist() if sub else []
                rows = dist.all_gather_floats([*flat, *[0.0] * (2 * micro - len(flat)), len(flat) // 2, tokens], info)
                for j in range(len(dealt)):
                    got[j].extend(rows[j][:2 * int(rows[j][-2])])
                progress.update(int(sum(row[-2] for row in rows)), sum(row[-1] for row in rows))
            if info.is_local_main:
                for c, values in zip(dealt, got):
                    _save(out / _chunk(c), np.asarray(values).reshape(-1, 2))
    finally:
        progress.close()
    dist.barrier(info)
    if info.is_local_main:
        values = np.concatenate([np.load(out / _chunk(c)) for c in range(chunks)])
        _save(out / "logps.npy", values)
        (out / "key.tmp").write_text(json.dumps(what, sort_keys=True, default=str))
        os.replace(out / "key.tmp", out / "key.json")  # last: the folder is complete
        for c in range(chunks):
            (out / _chunk(c)).unlink(missing_ok=True)
    dist.barrier(info)
    return np.load(out / "logps.npy")


class _Silent:
    """No progress display (the other ranks; a caller that gives none)."""

    def __init__(self, total: int, done: int):
        pass

    def update(self, pairs: int, tokens: float) -> None:
        pass

    def close(self) -> None:
        pass


def _pairs_of(c: int, n: int) -> range:
    """The pairs of chunk c (of n pairs)."""
    return range(c * CHUNK, min(n, (c + 1) * CHUNK))


def _chunk(c: int) -> str:
    return f"chunk-{c:06d}.npy"


def _save(path: Path, values: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, values)
    os.replace(tmp, path)
