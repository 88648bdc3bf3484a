"""Checkpoints: one dict of stateful objects, stored as DCP shards (tensors) and JSON; atomic; safe to load.

What a checkpoint holds is a `CheckpointDict`: named objects with `state_dict()`/`load_state_dict()`
(torch.distributed.checkpoint's `Stateful`, as torchtitan's CheckpointManager keeps them), grouped by where
their state is stored. This module knows only that layout, never what the entries are (train.py builds
the dict; stateful.py adapts model, optimizer and RNG).

Layout: RUN/checkpoints/step_000100/{*.distcp, .metadata, meta.json, rank_state/rank<r>.json} and
RUN/checkpoints/latest (a text file naming the newest complete checkpoint). `sharded` entries are DCP
keys, `shared` entries keys of meta.json (with step, world_size, saved_at and the caller's provenance),
`per_rank` entries keys of rank_state/rank<r>.json. A checkpoint is written into `.tmp-step_000100` and
renamed when complete, with meta.json written last, so a torn write never hides the previous good one.
Loading never unpickles arbitrary objects: non-tensor state is JSON, DCP tensors are read with
`weights_only=True`, and DCP's own `.metadata` pickle is read through an allow-list unpickler before
DCP touches it.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from phalanx.core import dist
from phalanx.core.config import Config
from phalanx.core.runfolder import RunFolder, write_json

LATEST = "latest"
META = "meta.json"


class CheckpointError(RuntimeError):
    pass


# ---- safety -------------------------------------------------------------------------------------
_ALLOWED_MODULE_PREFIXES = ("torch.distributed.checkpoint",)
_ALLOWED_GLOBALS = {("torch", "Size"), ("torch", "device"), ("collections", "OrderedDict"),
                    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
                    ("torch", "layout"), ("torch", "memory_format"), ("torch", "dtype"),
                    ("torch.serialization", "_get_layout"),  # maps a layout name like 'torch.strided'
                    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath")}
_TORCH_ENUMS = (torch.dtype, torch.layout, torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        refused = CheckpointError(f"refusing to load: the checkpoint's metadata references {module}.{name}, "
                                  f"which is not checkpoint metadata")
        if "." in name:  # pickle protocol 4 follows a dotted name attribute by attribute: out of any module
            raise refused
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module in _ALLOWED_MODULE_PREFIXES or module.startswith(tuple(p + "." for p in _ALLOWED_MODULE_PREFIXES)):
            found = super().find_class(module, name)
            if isinstance(found, type):  # metadata classes only, not functions or modules imported there
                return found
            raise refused
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_ENUMS):
            return getattr(torch, name)  # dtypes/layouts pickle as module attributes
        raise refused


def check_safe(path: Path) -> None:
    """Refuse a checkpoint folder whose DCP metadata could run code or would unpickle objects."""
    md_file = path / ".metadata"
    if not md_file.is_file():
        raise CheckpointError(f"checkpoint '{path}': no DCP .metadata file")
    try:
        metadata = _MetadataUnpickler(io.BytesIO(md_file.read_bytes())).load()
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint '{path}': {e}") from None
    except Exception as e:
        raise CheckpointError(f"checkpoint '{path}': unreadable metadata ({type(e).__name__})") from None
    for key, item in getattr(metadata, "state_dict_metadata", {}).items():
        if isinstance(item, BytesStorageMetadata):
            raise CheckpointError(f"checkpoint '{path}': entry '{key}' is a pickled object; only tensors "
                                  f"are loaded")


# ---- the checkpoint dict ------------------------------------------------------------------------
@dataclass
class CheckpointDict:
    """Everything a checkpoint holds, by where each entry's state is stored. An entry that a checkpoint
    lacks, or saved empty (a disabled fp16 loss scaler), keeps its fresh state when loading, so older
    checkpoints stay loadable as entries are added."""
    sharded: dict[str, Stateful]                                   # tensors: DCP shards, resharded on load
    shared: dict[str, Stateful] = field(default_factory=dict)      # JSON in meta.json, the same on every rank
    per_rank: dict[str, Stateful] = field(default_factory=dict)    # JSON per rank; loaded at the same world size


def _load_json(entries: dict[str, Stateful], saved: dict) -> None:
    for name, obj in entries.items():
        if saved.get(name):
            obj.load_state_dict(saved[name])


class Checkpointer:
    def __init__(self, run_dir: str | Path, info: dist.DistInfo, keep: int = 2):
        self.root = RunFolder(run_dir).checkpoints
        self.info, self.keep = info, keep

    def save(self, step: int, states: CheckpointDict, provenance: dict | None = None,
             after_write=None) -> tuple[Path, float]:
        """Collective: every rank calls it. Returns the final path and the seconds it took. `provenance`
        (e.g. the config that made the checkpoint) goes into meta.json as is; `after_write()` runs once this
        rank's shards are in the temporary folder (the loop's probe)."""
        t0 = time.perf_counter()
        name = f"step_{step:06d}"
        tmp, final = self.root / f".tmp-{name}", self.root / name
        if self.info.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "rank_state").mkdir(parents=True)
        dist.barrier(self.info)
        dcp.save(dict(states.sharded), checkpoint_id=str(tmp))  # DCP calls each entry's state_dict()
        write_json(tmp / "rank_state" / f"rank{self.info.rank}.json",
                   {name: obj.state_dict() for name, obj in states.per_rank.items()}, fsync=True)
        if after_write:
            after_write()
        dist.barrier(self.info)
        if self.info.is_main:
            meta = {**{name: obj.state_dict() for name, obj in states.shared.items()}, **(provenance or {}),
                    "step": step, "world_size": self.info.world_size, "saved_at": time.time()}
            write_json(tmp / META, meta, fsync=True)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            write_json(self.root / LATEST, {"name": name}, fsync=True)
            self._prune()
        dist.barrier(self.info)
        return final, time.perf_counter() - t0

    def _prune(self) -> None:
        complete = self.complete()
        for old in complete[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(".tmp-step_*"):
            shutil.rmtree(stale, ignore_errors=True)

    def complete(self) -> list[Path]:
        return complete_in(self.root)

    def load(self, path: Path, states: CheckpointDict) -> dict:
        """Collective: load the checkpoint at `path` into `states`; returns its meta.json. Per-rank entries
        load only if the world size is the one that saved them (each rank then continues its own)."""
        path = Path(path)
        meta = read_meta(path)
        check_safe(path)
        _load_json(states.shared, meta)  # before the tensors: the optimizer applies its groups with them
        # DCP asks each entry for its state_dict() as the template, reads into it, then load_state_dict()
        dcp.load(dict(states.sharded), checkpoint_id=str(path))
        rank_file = path / "rank_state" / f"rank{self.info.rank}.json"
        if meta.get("world_size") == self.info.world_size and rank_file.is_file():
            _load_json(states.per_rank, json.loads(rank_file.read_text()))
        return meta


def resolve_resume(cfg: Config) -> Path | None:
    """The checkpoint `cfg.resume` selects: auto = the run folder's newest complete one (None if it has
    none), never = None, else that folder. The launcher checks it; each worker (each elastic attempt)
    resolves it again, since the run may have written newer ones since."""
    if cfg.resume == "never":
        return None
    if cfg.resume == "auto":
        return latest_in(RunFolder(cfg.run_dir).checkpoints)
    return Path(cfg.resume)


def complete_in(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first (by step number: names stop sorting as text past 999,999)."""
    found = [p for p in Path(root).glob("step_*") if (p / META).is_file() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def latest_in(root: Path) -> Path | None:
    """The newest complete checkpoint: the one `latest` names if complete, else the newest found."""
    root = Path(root)
    try:
        named = root / json.loads((root / LATEST).read_text())["name"]
        if (named / META).is_file():
            return named
    except (OSError, ValueError, KeyError):
        pass
    complete = complete_in(root)
    return complete[-1] if complete else None


def read_meta(path: Path) -> dict:
    try:
        return json.loads((Path(path) / META).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint '{path}': no readable {META} ({type(e).__name__})") from None
