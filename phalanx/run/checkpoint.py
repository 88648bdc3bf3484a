"""Checkpoints: DCP shards for model and optimizer, JSON for everything else; atomic; safe to load.

Layout: RUN/checkpoints/step_000100/{*.distcp, .metadata, meta.json, rank_state/rank<r>.json} and
RUN/checkpoints/latest (a text file naming the newest complete checkpoint). A checkpoint is written
into `.tmp-step_000100` and renamed when complete, with meta.json written last, so a torn write never
hides the previous good one. Loading never unpickles arbitrary objects: non-tensor state is JSON, DCP
tensors are read with `weights_only=True`, and DCP's own `.metadata` pickle is read through an
allow-list unpickler before DCP touches it.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from phalanx.core import dist
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


# ---- RNG states as JSON -------------------------------------------------------------------------
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


# ---- saving and loading -------------------------------------------------------------------------
def _split_optim(osd: dict) -> tuple[dict, list]:
    """Optimizer tensors (for DCP) and hyper-parameters (for JSON)."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in osd.get("param_groups", [])]
    return osd.get("state", {}), groups


class Checkpointer:
    def __init__(self, run_dir: str | Path, info: dist.DistInfo, keep: int = 2):
        self.root = RunFolder(run_dir).checkpoints
        self.info, self.keep = info, keep

    def save(self, step: int, model, optimizer, meta: dict, after_write=None) -> tuple[Path, float]:
        """Collective: every rank calls it. Returns the final path and the seconds it took.
        `after_write()` runs once this rank's shards are in the temporary folder (the loop's probe)."""
        t0 = time.perf_counter()
        name = f"step_{step:06d}"
        tmp, final = self.root / f".tmp-{name}", self.root / name
        if self.info.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "rank_state").mkdir(parents=True)
        dist.barrier(self.info)
        msd, osd = get_state_dict(model, optimizer)
        optim_tensors, groups = _split_optim(osd)
        dcp.save({"model": msd, "optim": optim_tensors}, checkpoint_id=str(tmp))
        write_json(tmp / "rank_state" / f"rank{self.info.rank}.json", {"rng": rng_state()}, fsync=True)
        if after_write:
            after_write()
        dist.barrier(self.info)
        if self.info.is_main:
            write_json(tmp / META, {**meta, "step": step, "world_size": self.info.world_size,
                                     "param_groups": groups, "saved_at": time.time()}, fsync=True)
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

    def latest(self) -> Path | None:
        return latest_in(self.root)

    def load(self, path: Path, model, optimizer) -> tuple[dict, dict | None]:
        """Collective. Returns (meta, this rank's saved state or None if the world size changed)."""
        path = Path(path)
        meta = read_meta(path)
        check_safe(path)
        msd, osd = get_state_dict(model, optimizer)
        optim_tensors, _ = _split_optim(osd)
        state = {"model": msd, "optim": optim_tensors}
        dcp.load(state, checkpoint_id=str(path))
        osd["state"] = state["optim"]
        for group, saved in zip(osd["param_groups"], meta.get("param_groups", [])):
            group.update(saved)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=osd)
        rank_file = path / "rank_state" / f"rank{self.info.rank}.json"
        rank_state = None
        if meta.get("world_size") == self.info.world_size and rank_file.is_file():
            rank_state = json.loads(rank_file.read_text())
        return meta, rank_state


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
