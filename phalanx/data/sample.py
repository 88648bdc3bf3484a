"""Bounded reads of the training data before the full pass: the sample a tokenizer is trained on (and the
encoder is checked on), and the launcher's pre-flight check of every file.
"""
from __future__ import annotations

from phalanx.core.config import Config, ConfigError
from phalanx.data import readers
from phalanx.data.sources import DataFile, open_source, splits


def sample_rows(cfg: Config, fields: readers.Fields, budget: int) -> list[tuple]:
    """A deterministic sample of about `budget` bytes of the training rows, spread over the whole corpus
    for text and JSON Lines files (the head of the stream for other sources), and excluding the
    validation tail when validation is held out of the training data. A plain-text window is one row."""
    d = cfg.data
    source = open_source(splits(cfg)[0], d.format)
    files = source.files
    if not files or any(f.kind not in ("text", "jsonl") for f in files):
        out, size = [], 0
        for piece in readers.plan(source, fields, budget):
            batches = readers.rows(piece, fields) if piece.kind != "text" else \
                (([(text,)], n) for text, n in readers.text_chunks(piece))
            for batch, n in batches:
                out.extend(batch)
                size += n
                if size >= budget:
                    return out
        return out
    usable = int(source.size * (1 - (0 if d.validation else d.val_fraction)))
    count = max(1, -(-min(usable, budget) // (1 << 20)))   # windows of about 1 MB
    width = min(usable, budget) // count
    out = []
    for i in range(count):
        pos = i * usable // count
        k = 0
        while pos >= files[k].size:
            pos, k = pos - files[k].size, k + 1
        out.extend(_window(files[k], pos, min(pos + width, files[k].size), fields))
    return out


def _window(f: DataFile, lo: int, hi: int, fields: readers.Fields) -> list[tuple]:
    """Whole lines of the file's bytes [lo, hi) as one text row, or as JSON Lines rows."""
    buf = f.blob.read(lo, hi)
    start = readers.content_start(f.blob, f.kind) if lo == 0 else buf.find(b"\n") + 1
    end = len(buf) if hi == f.size else buf.rfind(b"\n") + 1
    if start <= 0 and lo or end <= start:
        return []
    if f.kind == "jsonl":
        return readers.jsonl_rows(buf[start:end], f.blob, lo + start, fields)
    if f.kind == "conll":  # whole lines; a window's first sentence may be the end of one, which is still checked
        text = readers.decode(buf[start:end], f.blob, lo + start)
        where = lambda n: f"data file '{f.blob.name}' line {readers.line_of(f.blob, lo + start) + n}"  # noqa: E731
        return [(w, t, None) for w, t, _ in readers.conll_sentences(text, readers.conll_spec(fields), where, 0)]
    return [(readers.decode(buf[start:end], f.blob, lo + start),)]


def check_sample(cfg: Config, fields: readers.Fields, head: int = 1 << 20, windows: int = 4,
                 width: int = 1 << 18) -> None:
    """Launcher pre-flight on a bounded sample: every file exists and has a known format; its head and a
    few windows spread over it decode as UTF-8 and parse as JSON Lines with the fields; a Parquet file's
    footer is readable. The full pass during preparation still reports any later problem with its file
    and line."""
    for split in splits(cfg):
        for f in open_source(split, cfg.data.format).files:
            size = f.size
            if size == 0:
                raise ConfigError(f"data file '{f.blob.name}': no rows (empty file)")
            if f.kind == "parquet":
                readers.open_parquet(f.blob, fields)  # the footer: readable, has rows and the fields
                continue
            readers.content_start(f.blob, f.kind)  # not compressed, not one JSON array
            if f.kind == "csv":
                continue
            spans = [(0, min(size, head))] + [(size * (i + 1) // (windows + 1), size * (i + 1) // (windows + 1) + width)
                                             for i in range(windows) if size > head]
            for lo, hi in spans:
                _window(f, lo, min(hi, size), fields)
