"""GGUF files (llama.cpp, Ollama) as pretrained bases: checked, then dequantised once into a plain folder.

A GGUF file holds quantised weights, the config and the tokenizer (with its chat template). transformers
reads it (`from_pretrained(folder, gguf_file=NAME)`, package `gguf`) and dequantises to fp32, but refuses to
save what it read as quantized; so the model is rebuilt from its config without the quantization entry on
the meta device, given the loaded tensors themselves (no copy), re-tied and saved: a normal fp32 safetensors
folder (config.json says float32, so the `auto` rules of model.base_dtype and train.export_dtype see fp32),
with the tokenizer, the generation config and a marker (`gguf.json`: source, sha256, quant types,
architecture) that base identity (identity.py) and the start line read. Everything that reads a folder then
works unchanged. Where the folder lives and who builds it is the launcher's (tools/launch.py).

The header is read here directly (magic, architecture, each tensor's type): a few milliseconds, where
gguf's GGUFReader parses every metadata value first (~5 s for a 49k-token vocabulary).
"""
from __future__ import annotations

import contextlib
import copy
import io
import json
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from phalanx.core.config import ConfigError

MAGIC = b"GGUF"
MARKER = "gguf.json"
VERSION = 1  # of the folder's layout: in its name, so a changed layout builds anew
SHARD = "2GB"  # save_pretrained's max_shard_size: a large model is written file by file
KEY = "config key 'model.pretrained'"
FOLDER_HOLDS = ("a folder must hold config.json and model.safetensors (or model.safetensors.index.json, or "
                "pytorch_model.bin); a .gguf file is accepted too")
# GGUF metadata value types (gguf.GGUFValueType) -> struct format; 8 = string, 9 = array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class Header:
    """What a GGUF file is: its architecture, model name and tensor types (by elements, most first)."""
    architecture: str
    name: str
    quant_types: tuple[str, ...]


def is_gguf(path: Path) -> bool:
    """A file that starts with the GGUF magic (Ollama's blobs have no .gguf suffix)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def check(path: Path) -> Header:
    """`path` (model.pretrained, not a folder) as a GGUF base: exit 2 for a file that is not one (naming what
    a folder must hold), or for tensor types the gguf package cannot dequantise."""
    if not is_gguf(path):
        raise ConfigError(f"{KEY}: '{path}' is a file without the GGUF magic, not a model folder: {FOLDER_HOLDS}")
    try:
        header = read_header(path)
    except (struct.error, UnicodeDecodeError, ValueError, OSError) as e:
        raise ConfigError(f"{KEY}: '{path}' is not a readable GGUF file ({e})") from None
    refused = [q for q in header.quant_types if not _dequantisable(q)]
    if refused:
        raise ConfigError(f"{KEY}: '{path}' holds tensors of type {', '.join(refused)}, which the gguf package "
                          f"cannot dequantise (its types: {', '.join(header.quant_types)})")
    return header


def read_header(path: Path) -> Header:
    """The architecture, general.name and tensor types of a GGUF file (versions 2 and 3), from its header."""
    with open(path, "rb") as f:
        f.read(4)
        (version,) = struct.unpack("<I", f.read(4))
        order = "<" if version < 1 << 16 else ">"  # a big-endian file's version reads byte-swapped
        version = version if order == "<" else struct.unpack(">I", struct.pack("<I", version))[0]
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version}; versions 2 and 3 are read")
        n_tensors, n_values = struct.unpack(order + "QQ", f.read(16))
        meta = {}
        for _ in range(n_values):
            key = _string(f, order)
            value = _value(f, order, *struct.unpack(order + "I", f.read(4)))
            if key in ("general.architecture", "general.name"):
                meta[key] = value
        elements: dict[str, int] = {}
        for _ in range(n_tensors):
            _string(f, order)
            (dims,) = struct.unpack(order + "I", f.read(4))
            count = 1
            for d in struct.unpack(order + "Q" * dims, f.read(8 * dims)):
                count *= d
            kind, _offset = struct.unpack(order + "IQ", f.read(12))
            name = _type_name(kind)
            elements[name] = elements.get(name, 0) + count
    kinds = tuple(sorted(elements, key=lambda k: -elements[k]))
    return Header(str(meta.get("general.architecture", "")), str(meta.get("general.name", "")), kinds)


def _string(f, order: str) -> str:
    (n,) = struct.unpack(order + "Q", f.read(8))
    return f.read(n).decode("utf-8")


def _value(f, order: str, kind: int):
    """One metadata value; an array is skipped (None): only two strings are needed."""
    if kind == _STRING:
        return _string(f, order)
    if kind == _ARRAY:
        item, n = struct.unpack(order + "IQ", f.read(12))
        if item in _SCALARS:
            f.seek(n * struct.calcsize(_SCALARS[item]), 1)
        else:
            for _ in range(n):
                _value(f, order, item)
        return None
    if kind not in _SCALARS:
        raise ValueError(f"unknown metadata value type {kind}")
    fmt = order + _SCALARS[kind]
    return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]


def _type_name(kind: int) -> str:
    from gguf import GGMLQuantizationType  # lazy: only a GGUF base needs the package

    try:
        return GGMLQuantizationType(kind).name
    except ValueError:
        return f"type {kind}"


def _dequantisable(name: str) -> bool:
    """Whether the gguf package dequantises this tensor type (tried on one block of zeros)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    kind = getattr(GGMLQuantizationType, name, None)
    if kind is None or kind not in GGML_QUANT_SIZES:
        return False
    try:
        dequantize(np.zeros(GGML_QUANT_SIZES[kind][1], np.uint8), kind)
    except NotImplementedError:
        return False
    return True


def folder_name(sha256: str) -> str:
    """The cache folder of a GGUF file's dequantised form: by its content (and this layout's version)."""
    return f"{sha256[:32]}-fp32-v{VERSION}"


def dequantise(path: Path, source: str, sha256: str, header: Header, out: Path) -> None:
    """Write the fp32 folder of the GGUF file `path` into `out` (build_once's temporary folder). A model
    transformers cannot read (its architecture, a tensor type) is exit 2 naming it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from phalanx.model.build import quiet_transformers

    quiet_transformers()
    with _refused(path, header), name_maps_once():  # its GGUF reader draws its own progress bar on stderr
        with contextlib.redirect_stderr(io.StringIO()):
            loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # else save_pretrained refuses the model as quantized
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True, assign=True)  # the loaded tensors, not copies
    model.tie_weights()  # assign gave each tied module its own Parameter object
    model.generation_config = loaded.generation_config
    model.save_pretrained(out, max_shard_size=SHARD)
    tokenizer.save_pretrained(out)
    marker = {"source": source, "file": path.name, "sha256": sha256, "bytes": path.stat().st_size,
              "architecture": header.architecture, "name": header.name, "quant_types": list(header.quant_types),
              "dtype": "float32", "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    (out / MARKER).write_text(json.dumps(marker, indent=1) + "\n")


@contextlib.contextmanager
def name_maps_once():
    """transformers' GGUF reader parses the file's metadata anew for the config, the weights and the tokenizer
    (~9 s each for a 49k-token vocabulary), and builds gguf's tensor-name map of the architecture anew for each
    of the model's modules (397 times for SmolLM2-135M: ~15 s). Both depend only on their arguments, and
    nothing writes to them, so while reading, the first ones are handed out again."""
    import functools

    import gguf

    saved = gguf.get_tensor_name_map, gguf.GGUFReader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(saved[0])
    gguf.GGUFReader = functools.lru_cache(maxsize=None)(saved[1])
    try:
        yield
    finally:
        gguf.get_tensor_name_map, gguf.GGUFReader = saved


@contextlib.contextmanager
def _refused(path: Path, header: Header):
    """transformers refusing the file (an architecture its GGUF reader lacks, a class it cannot build, a
    tensor type) as one line naming it."""
    try:
        yield
    except NotImplementedError as e:  # gguf: "Dequantization for X is not yet implemented"
        raise ConfigError(f"{KEY}: '{path}' cannot be dequantised: {str(e).splitlines()[0]}") from None
    except ValueError as e:
        line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        arch = f" (architecture {header.architecture})" if header.architecture not in line else ""
        raise ConfigError(f"{KEY}: transformers cannot load '{path}'{arch}: {line}") from None


def marker(folder: Path) -> dict | None:
    """The marker of a dequantised GGUF folder, or None for any other folder."""
    try:
        return json.loads((Path(folder) / MARKER).read_text())
    except (OSError, ValueError):
        return None


def describe(spec: str) -> str:
    """The start line's clause for a base dequantised from GGUF ('' for any other model.pretrained)."""
    found = marker(Path(spec)) if spec else None
    if not found:
        return ""
    return (f"base {found['file']} ({', '.join(found['quant_types'])}) dequantised to fp32 in "
            f"{Path(spec)}")


def wait_for(folder: Path, path: Path, timeout_s: float) -> None:
    """Under an outside torchrun/srun the node's first process dequantises; the others wait for the folder to
    appear (build_once renames it into place whole), polling the file system, not in a collective."""
    deadline = time.monotonic() + timeout_s
    while not folder.exists():
        if time.monotonic() > deadline:
            raise ConfigError(f"{KEY}: waited {timeout_s:.0f} s (dist.startup_timeout_s) for the node's first "
                              f"process to dequantise '{path}' into '{folder}'; see that process's error")
        time.sleep(0.2)
