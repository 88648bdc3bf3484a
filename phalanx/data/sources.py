"""Which data a config names — the first step of the reading seam: its splits, each split's files listed
once through one fsspec filesystem (a local path, or an object-storage URL: s3://bucket/prefix, gs://,
az://, ... whatever fsspec's installed backends reach), their formats, and what identifies them.
readers.py cuts the listed files into pieces and reads them.

Every problem is a `ConfigError` (exit code 2, one line).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import fsspec

from phalanx.core.config import Config, ConfigError
from phalanx.core.errors import redact
from phalanx.data import builtin, readers
from phalanx.data.readers import Blob

EXTENSIONS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "jsonl", ".json": "jsonl",
              ".csv": "csv", ".parquet": "parquet", ".conll": "conll"}


@dataclass(frozen=True)
class Split:
    """One split of the data: its source ('' = the built-in corpus, a file or folder, an object-storage URL
    of an object or prefix, or hf:NAME), the config key that names it (for messages), and its name
    ('train' or 'validation'; a hub dataset's split)."""
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


@dataclass(frozen=True)
class DataFile:
    """One listed input file: where its bytes are, its format, size, and identity (what changes when the
    file does: a local file's resolved path, size and modification time; an object's URL, size and ETag)."""
    blob: Blob
    kind: str
    size: int
    identity: tuple


@dataclass(frozen=True)
class Source:
    """A split's data as listed once: its files (none for the built-in corpus and hub datasets)."""
    split: Split
    files: tuple[DataFile, ...]

    @property
    def size(self) -> int:
        """Input bytes (for progress); 0 for streams of unknown size."""
        return sum(f.size for f in self.files)

    def identity(self) -> list:
        """What the data is, cheaply: every file's identity and format; a hub name; for the built-in
        corpus, the Python version and size it is read with."""
        if not self.split.spec:
            return ["builtin", list(sys.version_info[:2]), builtin.MAX_CHARS]
        if self.split.spec.startswith("hf:"):
            return [self.split.spec]
        return [[*f.identity, f.kind] for f in self.files]


def open_source(split: Split, fmt: str) -> Source:
    """List a split's files (a file, a folder or prefix searched recursively, in sorted order)."""
    if not split.spec or split.spec.startswith("hf:"):
        return Source(split, ())
    listed = _remote_files(split) if readers.is_url(split.spec) else _local_files(split)
    return Source(split, tuple(DataFile(b, format_of(b.name, fmt), size, ident) for b, size, ident in listed))


def _local_files(split: Split) -> list[tuple[Blob, int, tuple]]:
    spec, key, p = split.spec, split.key, Path(split.spec)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in EXTENSIONS)
        if not files:
            raise ConfigError(f"config key '{key}': folder '{spec}' holds no data files "
                              f"({', '.join(sorted(EXTENSIONS))})")
    elif p.is_file():
        files = [p]
    else:
        raise ConfigError(f"config key '{key}': file '{spec}' not found")
    fs = fsspec.filesystem("file")
    out = []
    for f in files:
        ident = file_identity(f)
        out.append((Blob(fs, ident[0], str(f)), ident[1], ident))
    return out


def _remote_files(split: Split) -> list[tuple[Blob, int, tuple]]:
    """An object, or every object under a prefix with a known extension; one listing request per prefix."""
    spec, key = split.spec, split.key
    try:
        fs, root = fsspec.core.url_to_fs(spec)
        fs.invalidate_cache(root)  # fsspec keeps listings: a file changed since the last one counts
        infos = fs.find(root, detail=True, withdirs=False)
        fs.invalidate_cache(root)  # and keeps none: s3fs answers 'not found' from a kept listing
    except ImportError as e:  # the backend's package (gcsfs, adlfs, ...) is not installed
        raise ConfigError(f"config key '{key}': '{spec}' needs a package that is not installed "
                          f"({readers.one_line(e)})") from None
    except Exception as e:  # credentials, endpoint, a bucket that does not exist: the backend says which
        raise ConfigError(f"config key '{key}': cannot list '{spec}' ({readers.one_line(e)})") from None
    protocol = spec.split("://", 1)[0]
    whole = {name: info for name, info in infos.items() if name.rstrip("/") == root.rstrip("/")}
    picked = whole or {n: i for n, i in infos.items() if PurePosixPath(n).suffix in EXTENSIONS}
    if not picked:
        what = "holds no data files" if infos else "not found"
        raise ConfigError(f"config key '{key}': '{spec}' {what}" +
                          (f" ({', '.join(sorted(EXTENSIONS))})" if infos else ""))
    out = []
    for name in sorted(picked):
        info, url = picked[name], redact(f"{protocol}://{name}")  # what messages, records and the index show
        version = info.get("ETag") or info.get("etag") or info.get("md5Hash") or info.get("mtime") or ""
        out.append((Blob(fs, name, url), int(info["size"]), (url, int(info["size"]), str(version).strip('"'))))
    return out


def format_of(path: str | Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    suffix = PurePosixPath(str(path)).suffix
    if suffix not in EXTENSIONS:
        raise ConfigError(f"data file '{path}': unknown extension '{suffix}'; set data.format")
    return EXTENSIONS[suffix]


def file_identity(path: Path) -> tuple:
    """Path, size and modification time: cheap, and changes when the file does."""
    st = os.stat(path)
    return (str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


def source_identity(split: Split, fmt: str) -> list:
    """What the data of a split is (Source.identity), listing its files."""
    return open_source(split, fmt).identity()
