"""Which files a data source names, and their formats. Reading them is streamed: pieces.py.

Every problem is a `ConfigError` (exit code 2, one line).
"""
from __future__ import annotations

from pathlib import Path

from phalanx.core.config import ConfigError

EXTENSIONS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "jsonl", ".json": "jsonl",
              ".csv": "csv", ".parquet": "parquet"}


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
