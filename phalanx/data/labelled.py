"""Labelled text for classification: label names and ids, the ragged encoded-set format, and the small
in-memory reader `phalanx predict` uses for its input file (training data is streamed: labelled_store.py).

Every problem with the data is a `ConfigError` naming the file and line (JSONL) or row (CSV, Parquet,
hub data). Tokenized splits are stored ragged (one flat id array + offsets), which is what dynamic
padding and length grouping need.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from phalanx.core.config import ConfigError
from phalanx.data import pieces, sources


@dataclass
class Examples:
    """Texts (and second texts for pairs) held in memory: `phalanx predict`'s input file."""
    texts: list[str]
    pairs: list[str] | None = None

    def __len__(self) -> int:
        return len(self.texts)

    def take(self, lo: int, hi: int) -> "Examples":
        return Examples(self.texts[lo:hi], self.pairs[lo:hi] if self.pairs is not None else None)


def read_inputs(path: str, text_field: str, pair_field: str) -> Examples:
    """Rows of a JSONL/CSV/Parquet file (read by the same checked readers as training data), or one text
    per non-blank line of a plain-text file."""
    p = Path(path)
    if sources.format_of(p, "auto") == "text" and not pair_field:
        start = pieces.content_start(p, "text")  # after a byte-order mark
        texts = [line for line in pieces.decode(p.read_bytes()[start:], path, start).splitlines() if line.strip()]
        if not texts:
            raise ConfigError(f"data file '{path}': no rows (empty file)")
        return Examples(texts)
    fields = ((text_field, "text"),) + (((pair_field, "text"),) if pair_field else ())
    rows = [row for piece in pieces.plan(path, "auto", fields, "--input", "test", 1 << 40)
            for batch, _ in (pieces.rows(piece, fields) if piece.kind != "text" else ()) for row in batch]
    return Examples([r[0] for r in rows], [r[1] for r in rows] if pair_field else None)


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
