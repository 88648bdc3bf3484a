"""Pretrained weights, read slice by slice: each rank reads from the checkpoint files only the rows it holds.

safetensors files are read with plain positioned reads (the header gives each tensor's byte range; a
row range of a row-major tensor is one contiguous range), not through a memory map: mapped file pages
would count in the process's resident memory as long as the file stays open, and no rank needs more
than its own rows. 16-bit checkpoints are upcast into the fp32 master weights as they are copied.
A folder with only PyTorch `.bin` files (older checkpoints) is read through torch.load's memory map.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from phalanx.core.config import ConfigError, hub_name
from phalanx.model.init import name_seed
from phalanx.model.slices import local, rows, write_local

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def pretrained_folder(spec: str) -> Path:
    """The local folder of `model.pretrained`: the folder itself, or the hub model's cached snapshot
    (weights and configs only; hub names were checked before the workers started)."""
    folder = Path(hub_name(spec))
    if folder.is_dir():
        return folder
    from huggingface_hub import snapshot_download  # lazy: only a hub name needs it

    folder = Path(snapshot_download(hub_name(spec), allow_patterns=["*.json", "*.safetensors"]))
    if not any(folder.glob("*.safetensors")):  # a model shipped as pytorch_model*.bin only
        folder = Path(snapshot_download(hub_name(spec), allow_patterns=["*.json", "pytorch_model*.bin"]))
    return folder


class SafetensorsFile:
    """One .safetensors file: its header, and reads of row ranges of its tensors."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        self.base = 8 + n
        header.pop("__metadata__", None)
        self.entries = {k: (v["dtype"], tuple(v["shape"]), *v["data_offsets"]) for k, v in header.items()}

    def shape(self, key: str) -> tuple[int, ...]:
        return self.entries[key][1]

    def read(self, key: str, part: slice | None = None) -> torch.Tensor:
        code, shape, start, _ = self.entries[key]
        dtype = _DTYPES[code]
        if not shape:  # a scalar
            part, shape = None, (1,)
        lo, hi = (0, shape[0]) if part is None else (part.start, part.stop)
        row = math.prod(shape[1:]) * dtype.itemsize
        out = torch.empty((hi - lo, *shape[1:]), dtype=dtype)
        if out.numel():
            view = memoryview(out.view(torch.uint8).numpy()).cast("B")
            with open(self.path, "rb", buffering=0) as f:
                done, offset = 0, self.base + start + lo * row
                while done < len(view):
                    got = os.preadv(f.fileno(), [view[done:]], offset + done)
                    if got <= 0:
                        raise OSError(f"{self.path}: truncated while reading '{key}'")
                    done += got
        return out.reshape(self.entries[key][1]) if not self.entries[key][1] else out


class TorchBinFile:
    """A PyTorch .bin checkpoint, memory-mapped (older Hugging Face models)."""

    def __init__(self, path: Path):
        self.tensors = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        self.entries = self.tensors

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].shape)

    def read(self, key: str, part: slice | None = None) -> torch.Tensor:
        t = self.tensors[key]
        return (t if part is None or t.dim() == 0 else t[part]).clone()


class Checkpoint:
    """The weight files of a pretrained folder, by tensor name (nothing is read until asked)."""

    def __init__(self, folder: Path):
        files = sorted(folder.glob("*.safetensors"))
        opener = SafetensorsFile
        if not files:
            files, opener = sorted(folder.glob("pytorch_model*.bin")), TorchBinFile
        if not files:
            raise ConfigError(f"config key 'model.pretrained': '{folder}' has no .safetensors or pytorch_model.bin "
                              f"weights")
        self.files = {}
        for f in files:
            opened = opener(f)
            self.files.update({k: opened for k in opened.entries})

    def key_for(self, name: str, prefix: str) -> str | None:
        """The checkpoint's key for the model's tensor `name`: the same name, or without/with the base model's
        prefix (a checkpoint of the bare model, e.g. GPT-2's hub weights), or LayerNorm's older gamma/beta."""
        names = [name]
        if prefix and name.startswith(prefix + "."):
            names.append(name[len(prefix) + 1:])
        elif prefix:
            names.append(f"{prefix}.{name}")
        for n in list(names):
            if n.endswith(".weight"):
                names.append(n[:-len("weight")] + "gamma")
            elif n.endswith(".bias"):
                names.append(n[:-len("bias")] + "beta")
        return next((n for n in names if n in self.files), None)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.files[key].shape(key)

    def read(self, key: str, part: slice | None = None) -> torch.Tensor:
        return self.files[key].read(key, part)


@torch.no_grad()
def load_pretrained(todo: dict[str, torch.Tensor], folder: Path, *, prefix: str, seed: int, growable: set[str],
                    mismatched: str) -> set[str]:
    """Fill the tensors of `todo` (qualified name -> this rank's tensor) that the checkpoint has; returns
    their names. A tensor in `growable` (the token embeddings of a model whose vocabulary grew, e.g. for a
    chat template's tokens) whose checkpoint has fewer rows gets its new rows by mean resizing.
    Another shape mismatch is an error, or (`mismatched="init"`, a classifier's new head) left to init."""
    ckpt = Checkpoint(folder)
    loaded = set()
    for name, t in todo.items():
        key = ckpt.key_for(name, prefix)
        if key is None:
            continue
        saved = tuple(ckpt.shape(key))
        if saved == tuple(t.shape):
            local(t).copy_(ckpt.read(key, rows(t)).reshape(local(t).shape))
        elif name in growable and saved[1:] == tuple(t.shape[1:]) and saved[0] < t.shape[0]:
            write_local(t, grown_rows(ckpt.read(key).float(), t.shape[0], name_seed(seed, name)))
        elif mismatched == "init":
            continue
        else:
            raise ConfigError(f"config key 'model.pretrained': '{key}' has shape {list(saved)} in '{folder}', the "
                              f"model needs {list(t.shape)}")
        loaded.add(name)
    return loaded


def grown_rows(old: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """`old` with rows added up to `n`, drawn as transformers' mean resizing does (from a normal around the
    mean old row with 1e-9 x their covariance, or the mean where that is not positive definite), so new
    tokens start where the old ones are, with a generator of their own."""
    mean = old.mean(0)
    centred = old - mean
    covariance = 1e-9 * (centred.T @ centred) / old.shape[0]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if torch.distributions.constraints.positive_definite.check(covariance).all():
            new = torch.distributions.MultivariateNormal(mean, covariance_matrix=covariance).sample((n - old.shape[0],))
        else:
            new = mean.expand(n - old.shape[0], -1).clone()
    return torch.cat([old, new])
