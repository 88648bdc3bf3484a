"""Bounded reads of the training data before the full pass: the sample a tokenizer is trained on (and the
encoder is checked on), and the launcher's pre-flight check of every file.
"""
from __future__ import annotations

from pathlib import Path

from phalanx.core.config import Config, ConfigError
from phalanx.data import pieces, readers
from phalanx.data.sources import files_of, format_of, splits


def sample_rows(cfg: Config, fields: readers.Fields, budget: int) -> list[tuple]:
    """A deterministic sample of about `budget` bytes of the training rows, spread over the whole corpus
    for text and JSON Lines files (the head of the stream for other sources), and excluding the
    validation tail when validation is held out of the training data. A plain-text window is one row."""
    d, train = cfg.data, splits(cfg)[0]
    files = [] if not d.train or d.train.startswith("hf:") else files_of(d.train, train.key)
    kinds = [format_of(p, d.format) for p in files]
    if not files or any(k not in ("text", "jsonl") for k in kinds):
        out, size = [], 0
        for piece in pieces.plan(train, d.format, fields, budget):
            batches = pieces.rows(piece, fields) if piece.kind != "text" else \
                (([(text,)], n) for text, n in pieces.text_chunks(piece))
            for batch, n in batches:
                out.extend(batch)
                size += n
                if size >= budget:
                    return out
        return out
    sizes = [p.stat().st_size for p in files]
    usable = int(sum(sizes) * (1 - (0 if d.validation else d.val_fraction)))
    count = max(1, -(-min(usable, budget) // (1 << 20)))   # windows of about 1 MB
    width = min(usable, budget) // count
    out = []
    for i in range(count):
        pos = i * usable // count
        k = 0
        while pos >= sizes[k]:
            pos, k = pos - sizes[k], k + 1
        out.extend(_window(files[k], kinds[k], pos, min(pos + width, sizes[k]), sizes[k], fields))
    return out


def _window(path: Path, kind: str, lo: int, hi: int, size: int, fields: readers.Fields) -> list[tuple]:
    """Whole lines of path[lo:hi] as one text row, or as JSON Lines rows."""
    buf = readers.read_bytes(str(path), lo, hi)
    start = readers.content_start(path, kind) if lo == 0 else buf.find(b"\n") + 1
    end = len(buf) if hi == size else buf.rfind(b"\n") + 1
    if start <= 0 and lo or end <= start:
        return []
    if kind == "jsonl":
        return readers.jsonl_rows(buf[start:end], str(path), lo + start, fields)
    return [(readers.decode(buf[start:end], str(path), lo + start),)]


def check_sample(cfg: Config, fields: readers.Fields, head: int = 1 << 20, windows: int = 4,
                 width: int = 1 << 18) -> None:
    """Launcher pre-flight on a bounded sample: every file exists and has a known format; its head and a
    few windows spread over it decode as UTF-8 and parse as JSON Lines with the fields; a Parquet file's
    footer is readable. The full pass during preparation still reports any later problem with its file
    and line."""
    d = cfg.data
    for split in splits(cfg):
        if not split.spec or split.spec.startswith("hf:"):
            continue
        for path in files_of(split.spec, split.key):
            kind, size = format_of(path, d.format), path.stat().st_size
            if size == 0:
                raise ConfigError(f"data file '{path}': no rows (empty file)")
            if kind == "parquet":
                readers.open_parquet(path, fields)  # the footer: readable, has rows and the fields
                continue
            readers.content_start(path, kind)  # not compressed, not one JSON array
            if kind == "csv":
                continue
            spans = [(0, min(size, head))] + [(size * (i + 1) // (windows + 1), size * (i + 1) // (windows + 1) + width)
                                             for i in range(windows) if size > head]
            for lo, hi in spans:
                _window(path, kind, lo, min(hi, size), size, fields)
