"""Labelled text for classification: label names and ids, the ragged encoded-set format, and the small
in-memory reader `phalanx predict` uses for its input file (training data is streamed: labelled_store.py).

Every problem with the data is a `ConfigError` naming the file and line (JSONL) or row (CSV, Parquet,
hub data). Tokenized splits are stored ragged (one flat id array + offsets), which is what dynamic
padding and length grouping need.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..config import ConfigError
from . import sources


@dataclass
class Examples:
    """Rows of one split. `spans` maps the first row of each source file to its name (for messages)."""
    texts: list[str]
    pairs: list[str] | None
    labels: list | None
    spans: list[tuple[int, str]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.texts)

    def where(self, i: int) -> str:
        """'data file X line L' (JSONL) or 'data file X row R' for row i (0-based, over all files)."""
        starts = [s for s, _ in self.spans]
        k = max(0, bisect.bisect_right(starts, i) - 1)
        start, name = self.spans[k] if self.spans else (0, "?")
        return _location(name, i - start)

    def take(self, lo: int, hi: int) -> "Examples":
        cut = (lambda xs: xs[lo:hi] if xs is not None else None)
        spans = [(s - lo, n) for s, n in self.spans if s < hi]  # a negative start: the file began before lo
        return Examples(cut(self.texts), cut(self.pairs), cut(self.labels), spans)


def _location(name: str, row: int) -> str:
    path = Path(name)
    if path.suffix == ".jsonl" and path.is_file():
        seen = -1  # blank lines are skipped when reading, so count only non-blank ones
        with open(path, encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                seen += bool(line.strip())
                if seen == row:
                    return f"data file '{name}' line {lineno}"
    kind = "data" if name.startswith("hf:") else "data file"
    return f"{kind} '{name}' row {row + 1}"


def _rows_of_file(path: Path, fmt: str, text_field: str) -> list[dict]:
    if sources.format_of(path, fmt) == "text":  # plain text: one example per non-blank line
        text = sources.read_records(str(path), "text", "data")[0]["text"]
        rows = [{text_field: line} for line in text.splitlines() if line.strip()]
        if not rows:
            raise ConfigError(f"data file '{path}': no rows (empty file)")
        return rows
    return sources.read_records(str(path), fmt, "data")


def read_examples(spec: str, fmt: str, text_field: str, pair_field: str, label_field: str | None, key: str,
                  split: str = "train") -> Examples:
    """Texts (+ second texts when `pair_field`) and raw labels (when `label_field`) of a data source."""
    if spec.startswith("hf:"):
        parts = [(spec, sources.read_records(spec, fmt, key, split))]
    else:
        parts = [(str(p), _rows_of_file(p, fmt, text_field)) for p in sources.files_of(spec, key)]
    ex = Examples([], [] if pair_field else None, [] if label_field else None)
    for name, rows in parts:
        offset = len(ex.texts)
        ex.spans.append((offset, name))

        def at(i, offset=offset):  # row i of this part, named by file and line
            return ex.where(offset + i)
        ex.texts += sources.field_values(rows, text_field, at, "text")
        if pair_field:
            ex.pairs += sources.field_values(rows, pair_field, at, "text")
        if label_field:
            ex.labels += sources.field_values(rows, label_field, at, "label")
    if not ex.texts:
        raise ConfigError(f"config key '{key}': '{spec}' holds no examples")
    return ex


def label_names(labels: list[tuple], configured: list[str]) -> list[str]:
    """Class names in id order: `data.labels` when given, else the training labels sorted. `labels` are
    the distinct training labels, each with a function naming where it was first seen."""
    first, kind = labels[0][0], type(labels[0][0])
    odd = next(((v, where) for v, where in labels if type(v) is not kind), None)
    if odd is not None:
        raise ConfigError(f"{odd[1]()}: label {odd[0]!r} mixes integer and string labels (the first label is {first!r})")
    if configured:
        names = list(configured)
        if len(set(names)) != len(names):
            raise ConfigError(f"config key 'data.labels': repeated names in {names}")
    else:
        names = [str(v) for v in sorted(v for v, _ in labels)]
    if len(names) < 2:
        raise ConfigError(f"config key 'data.labels': classification needs at least 2 labels, found {names}")
    return names


def class_lookup(names: list[str], configured: bool, kind: type) -> dict:
    """Raw label -> class id: a configured name or index, or a discovered value of the labels' type."""
    if configured:
        return {**{n: i for i, n in enumerate(names)}, **{i: i for i in range(len(names))}}
    return {kind(n): i for i, n in enumerate(names)}


class EncodedSet:
    """Tokenized examples stored ragged: example i is ids[offsets[i]:offsets[i+1]]."""

    FILES = ("ids", "types", "offsets", "labels")

    def __init__(self, ids: np.ndarray, types: np.ndarray, offsets: np.ndarray, labels: np.ndarray):
        self.ids, self.types, self.offsets, self.labels = ids, types, offsets, labels
        self.lengths = np.diff(offsets)

    def __len__(self) -> int:
        return len(self.labels)

    def example(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self.offsets[i], self.offsets[i + 1]
        return self.ids[lo:hi], self.types[lo:hi]

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        for name in self.FILES:
            np.save(folder / f"{name}.npy", getattr(self, name))

    @classmethod
    def load(cls, folder: Path) -> "EncodedSet":
        return cls(*(np.load(folder / f"{name}.npy", mmap_mode="r") for name in cls.FILES))


def encode(tokenizer, ex: Examples, max_length: int, labels: np.ndarray | None,
           chunk: int = 8192) -> EncodedSet:
    """Tokenize with the tokenizer's special tokens, truncated to `max_length` (pairs: longest first)."""
    ids, types, lengths = [], [], []
    for lo in range(0, len(ex), chunk):
        pairs = ex.pairs[lo:lo + chunk] if ex.pairs is not None else None
        enc = tokenizer(ex.texts[lo:lo + chunk], pairs, truncation=True, max_length=max_length,
                        return_token_type_ids=True, return_attention_mask=False)
        for seq, typ in zip(enc["input_ids"], enc["token_type_ids"]):
            ids.append(np.asarray(seq))
            types.append(np.asarray(typ))
            lengths.append(len(seq))
    dtype = np.uint16 if len(tokenizer) <= 65536 else np.uint32
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = (lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dtype=dt))
    return EncodedSet(flat(ids, dtype), flat(types, np.uint8), offsets,
                      labels if labels is not None else np.zeros(len(lengths), dtype=np.int64))
