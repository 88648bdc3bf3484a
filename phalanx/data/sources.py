"""Which data a config names: its splits, the files each names, their formats, and what identifies them.
Reading them is streamed: pieces.py cuts them into pieces, readers.py reads each format.

Every problem is a `ConfigError` (exit code 2, one line).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from phalanx.core.config import Config, ConfigError
from phalanx.data import builtin

EXTENSIONS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "jsonl", ".json": "jsonl",
              ".csv": "csv", ".parquet": "parquet"}


@dataclass(frozen=True)
class Split:
    """One split of the data: its source ('' = the built-in corpus, a file or folder, or hf:NAME), the config
    key that names it (for messages), and its name ('train' or 'validation'; a hub dataset's split)."""
    spec: str
    key: str
    name: str


def splits(cfg: Config) -> list[Split]:
    """The training split, and the validation split when `data.validation` names one (otherwise validation
    is held out of the training data when the store is opened)."""
    d = cfg.data
    out = [Split(d.train, "data.train", "train")]
    if d.validation:
        out.append(Split(d.validation, "data.validation", "validation"))
    return out


def files_of(spec: str, key: str) -> list[Path]:
    p = Path(spec)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in EXTENSIONS)
        if not files:
            raise ConfigError(f"config key '{key}': folder '{spec}' holds no data files "
                              f"({', '.join(sorted(EXTENSIONS))})")
        return files
    if not p.is_file():
        raise ConfigError(f"config key '{key}': file '{spec}' not found")
    return [p]


def format_of(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    if path.suffix not in EXTENSIONS:
        raise ConfigError(f"data file '{path}': unknown extension '{path.suffix}'; set data.format")
    return EXTENSIONS[path.suffix]


def file_identity(path: Path) -> tuple:
    """Path, size and modification time: cheap, and changes when the file does."""
    st = os.stat(path)
    return (str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


def source_identity(split: Split, fmt: str) -> list:
    """What the data of a split is, cheaply: every file's identity and format; a hub name; for the built-in
    corpus, the Python version and size it is read with."""
    if not split.spec:
        return ["builtin", list(sys.version_info[:2]), builtin.MAX_CHARS]
    if split.spec.startswith("hf:"):
        return [split.spec]
    return [[*file_identity(p), format_of(p, fmt)] for p in files_of(split.spec, split.key)]
