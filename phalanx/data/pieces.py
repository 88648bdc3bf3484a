"""Streaming input: a corpus cut into pieces of bounded size, each read on its own (by any process).

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

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from ..config import ConfigError
from . import builtin
from .sources import files_of, format_of

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


@dataclass(frozen=True)
class Piece:
    kind: str
    source: str
    start: int
    end: int
    size: int                      # input bytes it stands for (progress, sampling)
    fingerprint: str
    ends_document: bool = False    # text: the file ends here, an end-of-text token follows
    docs: tuple = field(default=(), repr=False)

    def where(self) -> str:
        unit = {"text": "bytes", "jsonl": "bytes", "parquet": "row groups", "docs": "rows"}[self.kind]
        return f"{self.source} {unit} {self.start}-{self.end}"


def _hash(*parts) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(repr(part).encode() if not isinstance(part, bytes) else part)
        h.update(b"\0")
    return h.hexdigest()[:24]


def file_identity(path: Path) -> tuple:
    """Path, size and modification time: cheap, and changes when the file does."""
    st = os.stat(path)
    return (str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


def _cuts(path: Path, size: int, piece_bytes: int, finder) -> list[int]:
    """Offsets where `path` is cut into pieces of about piece_bytes, found by reading small windows."""
    cuts, pos = [0], piece_bytes
    with open(path, "rb") as f:
        while pos < size:
            f.seek(pos - 1)
            buf, base, found = b"", pos - 1, -1
            while found == -1:
                more = f.read(WINDOW)
                if not more:
                    break
                buf += more
                found = finder(buf, 1)
            if found == -1:
                break
            cuts.append(base + found)
            pos = base + found + piece_bytes
    return cuts + [size]


def _file_pieces(path: Path, kind: str, text_field: str, piece_bytes: int) -> list[Piece]:
    ident = file_identity(path)
    if kind == "parquet":
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(path).metadata
        groups, sizes = [0], 0
        for g in range(meta.num_row_groups):
            sizes += meta.row_group(g).total_byte_size
            if sizes >= piece_bytes and g + 1 < meta.num_row_groups:
                groups.append(g + 1)
                sizes = 0
        bounds = groups + [meta.num_row_groups]
        per_group = ident[1] / max(meta.num_row_groups, 1)
        return [Piece("parquet", str(path), a, b, int((b - a) * per_group), _hash(ident, kind, text_field, a, b))
                for a, b in zip(bounds, bounds[1:])]
    cuts = _cuts(path, ident[1], piece_bytes, safe_cut if kind == "text" else line_cut)
    return [Piece(kind, str(path), a, b, b - a, _hash(ident, kind, text_field, a, b, b == ident[1]),
                  ends_document=(kind == "text" and b == ident[1]))
            for a, b in zip(cuts, cuts[1:])]


def _doc_pieces(name: str, docs: Iterator[str], piece_bytes: int) -> Iterator[Piece]:
    """Group streamed documents into pieces of about piece_bytes; fingerprinted by content."""
    batch, size, row = [], 0, 0
    for doc in docs:
        batch.append(doc)
        size += len(doc.encode("utf-8"))
        if size >= piece_bytes:
            yield Piece("docs", name, row, row + len(batch), size, _hash(name, *batch), docs=tuple(batch))
            row, batch, size = row + len(batch), [], 0
    if batch:
        yield Piece("docs", name, row, row + len(batch), size, _hash(name, *batch), docs=tuple(batch))


def plan(spec: str, fmt: str, text_field: str, key: str, split: str, piece_bytes: int) -> Iterator[Piece]:
    """The pieces of a data source, in corpus order. Empty `spec` = the built-in corpus."""
    if not spec:
        yield from _doc_pieces("builtin", iter(builtin.stdlib_docstrings()), piece_bytes)
        return
    if spec.startswith("hf:"):
        yield from _doc_pieces(spec, hub_documents(spec, text_field, split), piece_bytes)
        return
    for path in files_of(spec, key):
        kind = format_of(path, fmt)
        if path.stat().st_size == 0:
            raise ConfigError(f"data file '{path}': empty file")
        if kind == "csv":
            yield from _doc_pieces(str(path), csv_documents(path, text_field), piece_bytes)
        else:
            yield from _file_pieces(path, kind, text_field, piece_bytes)


def plan_size(spec: str, key: str) -> int:
    """Input bytes of a file source (for progress); 0 for streams of unknown size."""
    if not spec or spec.startswith("hf:"):
        return 0
    return sum(p.stat().st_size for p in files_of(spec, key))


# ---- reading -------------------------------------------------------------------------------------
def line_of(path: str, offset: int) -> int:
    """1-based line number of byte `offset` (counted only when an error is reported)."""
    count, done = 1, 0
    with open(path, "rb") as f:
        while done < offset:
            block = f.read(min(1 << 24, offset - done))
            if not block:
                break
            count += block.count(b"\n")
            done += len(block)
    return count


def read_bytes(path: str, start: int, end: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(start)
        return f.read(end - start)


def decode(buf: bytes, path: str, base: int) -> str:
    try:
        return buf.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"data file '{path}' line {line_of(path, base + e.start)}: not valid UTF-8 "
                          f"(byte offset {base + e.start})") from None


def text_chunks(piece: Piece, chunk_bytes: int = 1 << 20) -> Iterator[tuple[str, int]]:
    """A text piece as strings of about chunk_bytes, cut only at safe places; with their byte size."""
    buf = read_bytes(piece.source, piece.start, piece.end)
    pos = 0
    while pos < len(buf):
        cut = safe_cut(buf, pos + chunk_bytes) if pos + chunk_bytes < len(buf) else -1
        end = len(buf) if cut == -1 else cut
        yield decode(buf[pos:end], piece.source, piece.start + pos), end - pos
        pos = end


def jsonl_rows(buf: bytes, path: str, base: int, text_field: str) -> list[str]:
    """The `text_field` of every non-blank line; an error names the file and line."""
    texts, pos = [], 0
    for line in buf.split(b"\n"):
        start, pos = pos, pos + len(line) + 1
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"data file '{path}' line {line_of(path, base + start)}: malformed JSON "
                              f"({getattr(e, 'msg', e)})") from None
        texts.append(text_of(row, text_field, lambda: f"data file '{path}' line {line_of(path, base + start)}"))
    return texts


def text_of(row, text_field: str, where) -> str:
    if not isinstance(row, dict):
        raise ConfigError(f"{where()}: expected a JSON object, got {type(row).__name__}")
    if text_field not in row:
        raise ConfigError(f"{where()}: missing field '{text_field}' (fields: {', '.join(sorted(map(str, row)))[:200]})")
    value = row[text_field]
    if not isinstance(value, str):
        raise ConfigError(f"{where()}: field '{text_field}' should be text, got {type(value).__name__}")
    return value


def documents(piece: Piece, text_field: str, batch_bytes: int = 1 << 20) -> Iterator[tuple[list[str], int]]:
    """Batches of documents of a row piece (jsonl, parquet, docs), with the input bytes they stand for."""
    if piece.kind == "docs":
        batch, size = [], 0
        for doc in piece.docs:
            batch.append(doc)
            size += len(doc)
            if size >= batch_bytes:
                yield batch, size
                batch, size = [], 0
        if batch:
            yield batch, size
    elif piece.kind == "jsonl":
        with open(piece.source, "rb") as f:
            f.seek(piece.start)
            pos = piece.start
            while pos < piece.end:
                buf = f.read(min(batch_bytes, piece.end - pos))
                if pos + len(buf) < piece.end:
                    buf += f.readline()  # complete the last line
                yield jsonl_rows(buf, piece.source, pos, text_field), len(buf)
                pos += len(buf)
    else:  # parquet
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(piece.source)
        _check_column(pf.schema_arrow, text_field, piece.source)
        for batch in pf.iter_batches(batch_size=4096, row_groups=range(piece.start, piece.end), columns=[text_field]):
            texts = batch.column(0).to_pylist()
            bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
            if bad is not None:
                raise ConfigError(f"data file '{piece.source}': a row's field '{text_field}' is {texts[bad]!r}, not text")
            yield texts, int(batch.nbytes)


def _check_column(schema, text_field: str, path) -> None:
    if text_field not in schema.names:
        raise ConfigError(f"data file '{path}': missing field '{text_field}' (fields: {', '.join(schema.names)[:200]})")


def csv_documents(path: Path, text_field: str) -> Iterator[str]:
    import pyarrow.csv as pcsv

    try:
        reader = pcsv.open_csv(path, read_options=pcsv.ReadOptions(block_size=1 << 22))
        _check_column(reader.schema, text_field, path)
        column = reader.schema.get_field_index(text_field)
        for batch in reader:
            for value in batch.column(column).to_pylist():
                yield value if isinstance(value, str) else ("" if value is None else str(value))
    except ConfigError:
        raise
    except Exception as e:  # pyarrow raises several types; the message names the problem
        raise ConfigError(f"data file '{path}': cannot read as CSV ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''})") from None


def hub_documents(spec: str, text_field: str, split: str) -> Iterator[str]:
    """A Hugging Face dataset streamed row by row (a hub name where a network exists, or a local folder)."""
    import datasets

    name, _, subset = spec[3:].partition(":")
    try:
        stream = datasets.load_dataset(name, subset or None, split=split, streaming=True)
        for i, row in enumerate(stream):
            yield text_of(row, text_field, lambda: f"data '{spec}' split '{split}' row {i + 1}")
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"hub dataset '{spec}' split '{split}': {type(e).__name__}: {e}") from None
