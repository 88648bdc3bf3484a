"""The weight files of a pretrained folder: which files hold the model, fetching only those from the hub,
and reading a tensor's rows from them.

Which files: a folder with `model.safetensors.index.json` is read through the index's `weight_map` (the
files it names, each key from the file the index gives), else `model.safetensors`; a folder with only
PyTorch weights likewise through `pytorch_model.bin.index.json`, else `pytorch_model.bin`. Other files are
never opened: a stale `model.safetensors` beside newer shards, or Mistral's `consolidated.safetensors`
(another key layout), would otherwise be read too. (transformers' `from_pretrained` prefers a single
`model.safetensors` when both are there; phalanx trusts the index, which names every file it wrote.)

safetensors files are read through safetensors' `safe_open`/`get_slice`: a rank reads only the rows it
holds, each file opened per tensor read (its mapped pages are file-backed and last one read; a mapping
held open for the whole load would keep every page read resident). A `.bin` file is read through
torch.load's memory map.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from phalanx.core.config import ConfigError, hub_name

# transformers' own file names (transformers.utils: SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME,
# WEIGHTS_INDEX_NAME, WEIGHTS_NAME), as (index, single file), safetensors first
LAYOUTS = (("model.safetensors.index.json", "model.safetensors"),
           ("pytorch_model.bin.index.json", "pytorch_model.bin"))
CONFIG = "config.json"

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def weight_files(folder: Path) -> dict[str, str] | str | None:
    """What holds the weights of `folder`: the index's weight_map (key -> file name) when there is an
    index, else the one weight file's name; None when neither is there."""
    for index, single in LAYOUTS:
        if (folder / index).is_file():
            weight_map = json.loads((folder / index).read_text()).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ConfigError(f"config key 'model.pretrained': '{folder / index}' has no weight_map")
            return weight_map
        if (folder / single).is_file():
            return single
    return None


def file_names(found: dict[str, str] | str) -> list[str]:
    """The weight files that `weight_files` found, each once, in order."""
    return sorted(set(found.values())) if isinstance(found, dict) else [found]


def pretrained_folder(spec: str) -> Path:
    """The local folder of `model.pretrained`: the folder itself, or the hub model's cached snapshot. From
    the hub come the JSON files first (configs, and the index if there is one), then only the weight files
    the index names, or the single weight file (safetensors first, then PyTorch's)."""
    folder = Path(hub_name(spec))
    if folder.is_dir():
        return folder
    from huggingface_hub import snapshot_download  # lazy: only a hub name needs it

    name = hub_name(spec)
    folder = Path(snapshot_download(name, allow_patterns=["*.json"]))
    for index, single in LAYOUTS:
        wanted = file_names(weight_files(folder)) if (folder / index).is_file() else [single]
        folder = Path(snapshot_download(name, allow_patterns=wanted))
        if (folder / index).is_file() or (folder / single).is_file():
            break
    return folder  # with no weights found, Checkpoint says so


class SafetensorsFile:
    """One .safetensors file through safetensors' own reader: the header once, then row ranges of a tensor
    (`safe_open(...).get_slice(key)[lo:hi]`: only those rows are read). The file is opened per read, so its
    mapping (file-backed pages, never private memory) lasts one tensor's read, not the whole load."""

    def __init__(self, path: Path):
        from safetensors import safe_open  # lazy: the launcher's checks read headers only here

        self.path, self._open = path, safe_open
        try:
            with safe_open(str(path), framework="pt") as f:
                self.entries = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for damaged headers
            raise ConfigError(f"config key 'model.pretrained': '{path}' is not a readable safetensors file "
                              f"({str(e).splitlines()[0]})") from None

    def shape(self, key: str) -> tuple[int, ...]:
        return self.entries[key][1]

    def dtype(self, key: str) -> torch.dtype:
        return _DTYPES[self.entries[key][0]]

    def read(self, key: str, part: slice | None = None) -> torch.Tensor:
        with self._open(str(self.path), framework="pt") as f:
            if part is None or not self.entries[key][1]:  # the whole tensor (a scalar has no rows)
                return f.get_tensor(key)
            return f.get_slice(key)[part.start:part.stop]


class TorchBinFile:
    """A PyTorch .bin checkpoint, memory-mapped (older Hugging Face models)."""

    def __init__(self, path: Path):
        self.tensors = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        self.entries = self.tensors

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].shape)

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key].dtype

    def read(self, key: str, part: slice | None = None) -> torch.Tensor:
        t = self.tensors[key]
        return (t if part is None or t.dim() == 0 else t[part]).clone()


class Checkpoint:
    """The weight files of a pretrained folder, by tensor name (headers only until a tensor is read)."""

    def __init__(self, folder: Path):
        found = weight_files(folder)
        if found is None:
            raise ConfigError(f"config key 'model.pretrained': '{folder}' has none of "
                              f"{', '.join(name for layout in LAYOUTS for name in layout)}")
        opener = SafetensorsFile if file_names(found)[0].endswith(".safetensors") else TorchBinFile
        opened = {}
        for name in file_names(found):
            if not (folder / name).is_file():
                raise ConfigError(f"config key 'model.pretrained': '{folder / name}', named by the index, is missing")
            opened[name] = opener(folder / name)
        if isinstance(found, dict):  # each key from the file the index names (and only keys it names)
            self.files = {k: opened[f] for k, f in found.items() if k in opened[f].entries}
            lost = sorted(k for k, f in found.items() if k not in opened[f].entries)
            if lost:
                raise ConfigError(f"config key 'model.pretrained': the index of '{folder}' names '{lost[0]}' in "
                                  f"'{found[lost[0]]}', which does not hold it ({len(lost)} such keys)")
        else:
            self.files = {k: f for f in opened.values() for k in f.entries}
        self.folder = folder

    def keys(self) -> list[str]:
        return list(self.files)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.files[key].shape(key))

    def dtype(self, key: str) -> torch.dtype:
        return self.files[key].dtype(key)

    def read(self, key: str, part: slice | None = None) -> torch.Tensor:
        return self.files[key].read(key, part)


def checkpoint_dtype(folder: Path) -> torch.dtype:
    """The dtype a pretrained folder was saved in: its config.json's `dtype` (`torch_dtype` in older ones),
    else the most common floating dtype of its weights."""
    config = json.loads((folder / CONFIG).read_text()) if (folder / CONFIG).is_file() else {}
    named = config.get("dtype") or config.get("torch_dtype")
    if isinstance(named, str) and isinstance(getattr(torch, named, None), torch.dtype):
        return getattr(torch, named)
    ckpt = Checkpoint(folder)
    counts: dict[torch.dtype, int] = {}
    for key in ckpt.keys():
        if ckpt.dtype(key).is_floating_point:
            counts[ckpt.dtype(key)] = counts.get(ckpt.dtype(key), 0) + math.prod(ckpt.shape(key))
    return max(counts, key=counts.get) if counts else torch.float32


def pretrained_dtype(spec: str) -> torch.dtype | None:
    """The dtype model.pretrained was saved in (checkpoint_dtype); None when training from scratch."""
    return checkpoint_dtype(pretrained_folder(spec)) if spec else None
