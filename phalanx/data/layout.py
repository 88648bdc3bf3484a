"""The on-disk layout of a store (store.py writes and maps it; remote/place.py moves it): the index, each
shard's record and array files, and how a token id is stored. Nothing here reads more than a shard's record.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

INDEX = "index.json"


def token_dtype(vocab_size: int) -> np.dtype:
    """The one rule for token ids: 2 bytes when every id fits, else 4."""
    return np.dtype(np.uint16 if vocab_size <= 65536 else np.uint32)


def read_index(folder: Path) -> dict | None:
    try:
        return json.loads((Path(folder) / INDEX).read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def array_file(fp: str, name: str) -> str:
    """A shard's file of array `name`: token ids keep the plain `<fp>.bin` of the first store format."""
    return f"{fp}.bin" if name == "ids" else f"{fp}.{name}.bin"


def arrays_of(record: dict) -> dict[str, tuple[str, str]]:
    """name -> (dtype, 'tokens' | 'rows') of a shard record's arrays (a record with only ids lists none)."""
    return record.get("arrays") or {"ids": (record["dtype"], "tokens")}


def shard_record(folder: Path, fp: str) -> dict | None:
    """The record of a finished shard, or None (its .json is written only after its arrays are complete)."""
    try:
        record = json.loads((folder / f"{fp}.json").read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    for name, (dtype, per) in arrays_of(record).items():
        data = folder / array_file(fp, name)
        if not data.is_file() or data.stat().st_size != record[per] * np.dtype(dtype).itemsize:
            return None
    return record


def shard_array(folder: Path, record: dict, name: str) -> np.ndarray:
    """One array of a shard, memory-mapped (an empty one as an empty array: it cannot be mapped)."""
    dtype, per = arrays_of(record)[name]
    if not record[per]:
        return np.zeros(0, dtype=dtype)
    return np.memmap(Path(folder) / array_file(record["fingerprint"], name), dtype=dtype, mode="r",
                     shape=(record[per],))
