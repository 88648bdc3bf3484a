"""Streaming input: a corpus cut into pieces of bounded size, each read on its own (by any process) —
the middle step of the reading seam: sources.py lists and opens a split's files, this module plans
them into pieces and reads a piece through readers.py.

A piece is the unit of parallel work and of resumption; it becomes one shard of the token store.
    text      a byte range of a plain-text file (the whole file is one document)
    jsonl     a line-aligned byte range of a JSON Lines file (one document per row)
    parquet   a range of row groups of a Parquet file (one document per row)
    docs      documents carried in the piece itself: CSV record batches, hub datasets, the built-in
              corpus, which are streamed by the preparing process rather than read by range
Pieces depend on the data and `piece_bytes` only, never on the number of workers, so the store is the
same whoever encodes it.

Where text is cut matters for the ids: the GPT-2 split pattern joins a run of whitespace across a
newline, and a space to the word after it. A cut right after a newline is invisible to it when the next
line starts with one space or tab and then a visible character, or with a visible character right after
a newline that itself follows a visible character (`safe_cut`); only such places are used.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field

from phalanx.core.config import ConfigError
from phalanx.data import builtin, readers
from phalanx.data.cache import fingerprint
from phalanx.data.readers import Blob, Fields

WINDOW = 1 << 16


def _visible(byte: int) -> bool:
    return 0x21 <= byte <= 0x7E  # ASCII, not whitespace: never part of a whitespace run


def safe_cut(buf: bytes, pos: int) -> int:
    """The first offset >= pos in `buf` where text can be cut without changing its pre-tokens, or -1."""
    p = buf.find(b"\n", max(pos - 1, 1))
    while p != -1 and p + 2 < len(buf):
        nxt = buf[p + 1]
        if _visible(nxt) and _visible(buf[p - 1]):
            return p + 1
        if nxt in (0x20, 0x09) and _visible(buf[p + 2]):
            return p + 1
        p = buf.find(b"\n", p + 1)
    return -1


def line_cut(buf: bytes, pos: int) -> int:
    """JSON Lines: any line start."""
    p = buf.find(b"\n", max(pos - 1, 0))
    return -1 if p == -1 else p + 1


def sentence_cut(buf: bytes, pos: int) -> int:
    """CoNLL: the start of the line after a blank one (a sentence never spans two pieces)."""
    p = buf.find(b"\n", max(pos - 1, 0))
    while p != -1:
        nxt = buf.find(b"\n", p + 1)
        if nxt == -1:
            return -1
        if readers.is_blank(buf[p + 1:nxt].decode("utf-8", "replace")):
            return nxt + 1
        p = nxt
    return -1


@dataclass(frozen=True)
class Piece:
    kind: str
    source: str                    # the file's name as messages show it (a path or URL), or the stream's
    start: int
    end: int
    size: int                      # input bytes it stands for (progress, sampling)
    fingerprint: str
    ends_document: bool = False    # text: the file ends here, an end-of-text token follows
    docs: tuple = field(default=(), repr=False)
    file: Blob | None = field(default=None, compare=False, repr=False)  # where its bytes are (not docs)

    def where(self) -> str:
        unit = {"text": "bytes", "jsonl": "bytes", "conll": "bytes", "parquet": "row groups", "docs": "rows"}[self.kind]
        return f"{self.source} {unit} {self.start}-{self.end}"


# ---- planning ------------------------------------------------------------------------------------
def plan(source, fields: Fields, piece_bytes: int) -> Iterator[Piece]:
    """The pieces of a split's data (`source`: sources.Source, its files listed once), in corpus order.
    `fields` are the (name, kind) pairs each row must have, kind 'text' or 'label' (plain text files
    have no fields)."""
    spec = source.split.spec
    if not spec:
        rows = (item if isinstance(item, tuple) else (item,) for item in builtin.records(fields))  # a row, or one value
        yield from _doc_pieces("builtin", rows, piece_bytes)
        return
    if spec.startswith("hf:"):
        yield from _doc_pieces(spec, readers.hub_rows(spec, fields, source.split.name), piece_bytes)
        return
    for f in source.files:
        if f.size == 0:
            raise ConfigError(f"data file '{f.blob.name}': no rows (empty file)")
        if f.kind == "text" and (len(fields) > 1 or readers.columns(fields) is None):
            wanted = ", ".join(n for n, _ in fields if n) or "records"
            raise ConfigError(f"data file '{f.blob.name}': plain text has no fields ({wanted}); use JSON Lines, "
                              f"CSV or Parquet")
        if f.kind == "csv":
            readers.content_start(f.blob, f.kind)
            yield from _doc_pieces(f.blob.name, readers.csv_rows(f.blob, fields), piece_bytes)
        else:
            yield from _file_pieces(f, fields, piece_bytes)


def _file_pieces(f, fields: Fields, piece_bytes: int) -> list[Piece]:
    """Pieces of one file (`f`: sources.DataFile) by row groups (Parquet) or safe byte ranges."""
    ident, kind, name = f.identity, f.kind, f.blob.name
    if kind == "parquet":
        meta = readers.open_parquet(f.blob, fields).metadata
        groups, sizes = [0], 0
        for g in range(meta.num_row_groups):
            sizes += meta.row_group(g).total_byte_size
            if sizes >= piece_bytes and g + 1 < meta.num_row_groups:
                groups.append(g + 1)
                sizes = 0
        bounds = groups + [meta.num_row_groups]
        per_group = f.size / max(meta.num_row_groups, 1)
        return [Piece("parquet", name, a, b, int((b - a) * per_group), fingerprint(ident, kind, fields, a, b),
                      file=f.blob) for a, b in zip(bounds, bounds[1:])]
    finder = {"text": safe_cut, "conll": sentence_cut}.get(kind, line_cut)
    cuts = _cuts(f.blob, readers.content_start(f.blob, kind), f.size, piece_bytes, finder)
    return [Piece(kind, name, a, b, b - a, fingerprint(ident, kind, fields, a, b, b == f.size),
                  ends_document=(kind == "text" and b == f.size), file=f.blob)
            for a, b in zip(cuts, cuts[1:])]


def _cuts(file: Blob, start: int, size: int, piece_bytes: int, finder) -> list[int]:
    """Offsets where `file` is cut into pieces of about piece_bytes, found by reading small windows."""
    cuts, pos = [start], start + piece_bytes
    while pos < size:
        buf, base, found = b"", pos - 1, -1
        while found == -1 and base + len(buf) < size:
            buf += file.read(base + len(buf), min(size, base + len(buf) + WINDOW))
            found = finder(buf, 1)
        if found == -1:
            break
        cuts.append(base + found)
        pos = base + found + piece_bytes
    return cuts + [size]


def _doc_pieces(name: str, items: Iterator[tuple], piece_bytes: int) -> Iterator[Piece]:
    """Group streamed rows into pieces of about piece_bytes of text; fingerprinted by content."""
    batch, size, row = [], 0, 0
    for item in items:
        batch.append(item)
        size += sum(map(value_bytes, item))
        if size >= piece_bytes:
            yield Piece("docs", name, row, row + len(batch), size, fingerprint(name, *batch), docs=tuple(batch))
            row, batch, size = row + len(batch), [], 0
    if batch:
        yield Piece("docs", name, row, row + len(batch), size, fingerprint(name, *batch), docs=tuple(batch))


def value_bytes(value) -> int:
    """Input bytes a row's value stands for (piece sizes, progress): text as UTF-8, a nested record as JSON."""
    if isinstance(value, str):
        return len(value.encode("utf-8"))
    if isinstance(value, (dict, list)):
        return len(json.dumps(value, ensure_ascii=False).encode("utf-8"))
    return 0


# ---- reading a piece -------------------------------------------------------------------------
def locate(source: str, kind: str, start: int, k: int) -> str:
    """'data file X line L' (JSON Lines) or '... row R' for row k of the piece (source, kind, start)."""
    if kind == "jsonl":
        seen = -1
        for line, text in _lines(readers.blob(source), start):
            seen += bool(text.strip())
            if seen == k:
                return f"data file '{source}' line {line}"
    if kind == "conll":
        file = readers.blob(source)
        text = readers.decode(file.read(start, file.fs.size(file.path)), file, start)
        first = readers.conll_sentences(text, (0, 0, "auto"), lambda n: "", 0, tags=False)[k][2]
        return f"data file '{source}' line {readers.line_of(file, start) + first}"
    if kind == "parquet":
        meta = readers.open_parquet(readers.blob(source), ()).metadata
        start = sum(meta.row_group(g).num_rows for g in range(start))
    where = "data" if source.startswith("hf:") or source == "builtin" else "data file"
    return f"{where} '{source}' row {start + k + 1}"


def _lines(file: Blob, start: int) -> Iterator[tuple[int, bytes]]:
    """(line number, line) from byte `start` (a line start) on, read in ranged blocks."""
    line, pos, carry = readers.line_of(file, start), start, b""
    while True:
        block = file.read(pos, pos + (1 << 20))
        pos += len(block)
        lines = (carry + block).split(b"\n")
        carry = lines.pop() if block else b""  # an unfinished last line waits for the next block
        for text in lines:
            yield line, text
            line += 1
        if not block:
            return


def text_chunks(piece: Piece, chunk_bytes: int = 1 << 20) -> Iterator[tuple[str, int]]:
    """A text piece as strings of about chunk_bytes, cut only at safe places; with their byte size."""
    buf = piece.file.read(piece.start, piece.end)
    pos = 0
    while pos < len(buf):
        cut = safe_cut(buf, pos + chunk_bytes) if pos + chunk_bytes < len(buf) else -1
        end = len(buf) if cut == -1 else cut
        yield readers.decode(buf[pos:end], piece.file, piece.start + pos), end - pos
        pos = end


def rows(piece: Piece, fields: Fields, batch_bytes: int = 1 << 20) -> Iterator[tuple[list[tuple], int]]:
    """Batches of checked rows of a row piece (jsonl, parquet, docs), with the input bytes they stand for."""
    if piece.kind == "docs":
        for lo in range(0, len(piece.docs), 4096):
            batch = list(piece.docs[lo:lo + 4096])
            yield batch, sum(value_bytes(v) for item in batch for v in item)
    elif piece.kind == "jsonl":
        yield from readers.jsonl_batches(piece.file, piece.start, piece.end, fields, batch_bytes)
    elif piece.kind == "conll":  # a piece is read whole: it is at most data.shard_mb
        yield readers.conll_rows(piece.file, piece.start, piece.end, fields), piece.size
    else:
        yield from readers.parquet_rows(piece.file, piece.start, piece.end, fields)
