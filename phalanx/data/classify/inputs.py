"""Texts to classify, held in memory: `phalanx predict`'s input file, read by the same checked readers as
training data, and its encoding (training data is streamed into a store instead: store.py).
"""
from __future__ import annotations

from dataclasses import dataclass
import numpy as np

from phalanx.core.config import ConfigError
from phalanx.data import layout, readers, sources
from phalanx.data.classify.store import EncodedSet


@dataclass
class Examples:
    """Texts (and second texts for pairs)."""
    texts: list[str]
    pairs: list[str] | None = None

    def __len__(self) -> int:
        return len(self.texts)

    def take(self, lo: int, hi: int) -> Examples:
        return Examples(self.texts[lo:hi], self.pairs[lo:hi] if self.pairs is not None else None)


def read_inputs(path: str, text_field: str, pair_field: str) -> Examples:
    """Rows of a JSONL/CSV/Parquet file, or one text per non-blank line of a plain-text file."""
    split = sources.Split(path, "--input", "test")
    source = sources.open_source(split, "auto")
    f = source.files[0]
    if len(source.files) == 1 and f.kind == "text" and not pair_field:
        start = readers.content_start(f.blob, "text")  # after a byte-order mark
        texts = [line for line in readers.decode(f.blob.read(start, f.size), f.blob, start).splitlines()
                 if line.strip()]
        if not texts:
            raise ConfigError(f"data file '{path}': no rows (empty file)")
        return Examples(texts)
    fields = ((text_field, "text"),) + (((pair_field, "text"),) if pair_field else ())
    rows = [row for piece in readers.plan(source, fields, 1 << 40)
            for batch, _ in (readers.rows(piece, fields) if piece.kind != "text" else ()) for row in batch]
    return Examples([r[0] for r in rows], [r[1] for r in rows] if pair_field else None)


def encode(tokenizer, ex: Examples, max_length: int, chunk: int = 8192) -> EncodedSet:
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
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return EncodedSet(_flat(ids, layout.token_dtype(len(tokenizer))), _flat(types, np.uint8), offsets,
                      np.zeros(len(lengths), dtype=np.int64))


def _flat(arrays: list, dtype) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype) if arrays else np.zeros(0, dtype=dtype)
