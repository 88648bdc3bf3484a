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

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from phalanx.core.config import ConfigError
from phalanx.data import builtin
from phalanx.data.cache import fingerprint
from phalanx.data.sources import Split, file_identity, files_of, format_of

WINDOW = 1 << 16
Fields = tuple  # ((name, 'text' | 'label'), ...): what each row must hold; ("", "record") = the whole row
BOM = b"\xef\xbb\xbf"  # a UTF-8 byte-order mark: what Windows tools write at the start of a text file
# Files users mistake for text: their signature, what they are, and the command that undoes it.
NOT_TEXT = ((b"\x1f\x8b", "gzip-compressed", "gunzip"), (b"\x28\xb5\x2f\xfd", "zstd-compressed", "unzstd"),
            (b"BZh", "bzip2-compressed", "bunzip2"), (b"\xfd7zXZ\x00", "xz-compressed", "unxz"),
            (b"PK\x03\x04", "a zip archive", "unzip"))


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


def one_line(e: BaseException, limit: int = 200) -> str:
    """An exception as one printable line: its type and message, control characters escaped."""
    text = " ".join(str(e).split())
    text = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
    text = text if len(text) <= limit else text[:limit - 3] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def content_start(path: Path | str, kind: str) -> int:
    """Where the text of a text, JSON Lines or CSV file starts: after a UTF-8 byte-order mark, else 0.
    A compressed file, a Parquet file, or (JSON Lines) one top-level JSON array is a ConfigError that
    says what to do, instead of a 'not valid UTF-8' or 'malformed JSON' error on its first line."""
    with open(path, "rb") as f:
        head = f.read(64)
    for magic, what, tool in NOT_TEXT:
        if head.startswith(magic):
            raise ConfigError(f"data file '{path}': {what}; decompress it first ({tool} '{path}'), or convert it "
                              f"to Parquet, which phalanx reads compressed")
    if head.startswith(b"PAR1"):
        raise ConfigError(f"data file '{path}': a Parquet file; name it .parquet or set data.format=parquet")
    start = len(BOM) if head.startswith(BOM) else 0
    if kind == "jsonl" and head[start:].lstrip().startswith(b"["):
        path = Path(path)
        lines = path.with_name(path.stem + ("-lines" if path.suffix == ".jsonl" else "") + ".jsonl")
        raise ConfigError(f"data file '{path}': one top-level JSON array, not JSON Lines (one object per line); "
                          f"convert it to JSON Lines, e.g. jq -c '.[]' '{path}' > '{lines}'")
    return start


def open_parquet(path: Path | str, fields: Fields):
    """A `pyarrow.parquet.ParquetFile` whose footer is readable, with rows and the fields' columns."""
    import pyarrow.parquet as pq  # lazy: pyarrow only for Parquet/CSV inputs

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ...: the message names the damage
        raise ConfigError(f"data file '{path}': not a readable Parquet file ({one_line(e)})") from None
    if pf.metadata.num_rows == 0:
        raise ConfigError(f"data file '{path}': no rows (a Parquet file with 0 rows)")
    _check_columns(pf.schema_arrow, fields, path)
    return pf


def _cuts(path: Path, start: int, size: int, piece_bytes: int, finder) -> list[int]:
    """Offsets where `path` is cut into pieces of about piece_bytes, found by reading small windows."""
    cuts, pos = [start], start + piece_bytes
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


def _file_pieces(path: Path, kind: str, fields: Fields, piece_bytes: int) -> list[Piece]:
    ident = file_identity(path)
    if kind == "parquet":
        meta = open_parquet(path, fields).metadata
        groups, sizes = [0], 0
        for g in range(meta.num_row_groups):
            sizes += meta.row_group(g).total_byte_size
            if sizes >= piece_bytes and g + 1 < meta.num_row_groups:
                groups.append(g + 1)
                sizes = 0
        bounds = groups + [meta.num_row_groups]
        per_group = ident[1] / max(meta.num_row_groups, 1)
        return [Piece("parquet", str(path), a, b, int((b - a) * per_group), fingerprint(ident, kind, fields, a, b))
                for a, b in zip(bounds, bounds[1:])]
    cuts = _cuts(path, content_start(path, kind), ident[1], piece_bytes, safe_cut if kind == "text" else line_cut)
    return [Piece(kind, str(path), a, b, b - a, fingerprint(ident, kind, fields, a, b, b == ident[1]),
                  ends_document=(kind == "text" and b == ident[1]))
            for a, b in zip(cuts, cuts[1:])]


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


def plan(split: Split, fmt: str, fields: Fields, piece_bytes: int) -> Iterator[Piece]:
    """The pieces of a split's data, in corpus order. `fmt` is data.format; `fields` are the (name, kind)
    pairs each row must have, kind 'text' or 'label' (plain text files have no fields)."""
    spec = split.spec
    if not spec:
        whole = columns(fields) is None  # a whole-row format reads the built-in conversations
        items = builtin.stdlib_conversations() if whole else builtin.stdlib_docstrings()
        yield from _doc_pieces("builtin", ((item,) for item in items), piece_bytes)
        return
    if spec.startswith("hf:"):
        yield from _doc_pieces(spec, hub_rows(spec, fields, split.name), piece_bytes)
        return
    for path in files_of(spec, split.key):
        kind = format_of(path, fmt)
        if path.stat().st_size == 0:
            raise ConfigError(f"data file '{path}': no rows (empty file)")
        if kind == "text" and (len(fields) > 1 or columns(fields) is None):
            wanted = ", ".join(n for n, _ in fields if n) or "records"
            raise ConfigError(f"data file '{path}': plain text has no fields ({wanted}); use JSON Lines, CSV "
                              f"or Parquet")
        if kind == "csv":
            content_start(path, kind)
            yield from _doc_pieces(str(path), csv_rows(path, fields), piece_bytes)
        else:
            yield from _file_pieces(path, kind, fields, piece_bytes)


def columns(fields: Fields) -> list[str] | None:
    """The columns a reader needs: the fields' names, or None (all of them) for a whole-row format."""
    return None if any(kind == "record" for _, kind in fields) else [n for n, _ in fields]


def value_bytes(value) -> int:
    """Input bytes a row's value stands for (piece sizes, progress): text as UTF-8, a nested record as JSON."""
    if isinstance(value, str):
        return len(value.encode("utf-8"))
    if isinstance(value, (dict, list)):
        return len(json.dumps(value, ensure_ascii=False).encode("utf-8"))
    return 0


def texts_of(value, kind: str) -> list[str]:
    """The text a row's value holds, for training a tokenizer: a text field, or every string of a record."""
    if kind == "text":
        return [value]
    if kind != "record":
        return []
    if isinstance(value, str):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return [t for item in items for t in texts_of(item, "record")]


def plan_size(split: Split) -> int:
    """Input bytes of a file source (for progress); 0 for streams of unknown size."""
    if not split.spec or split.spec.startswith("hf:"):
        return 0
    return sum(p.stat().st_size for p in files_of(split.spec, split.key))


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


def locate(source: str, kind: str, start: int, k: int) -> str:
    """'data file X line L' (JSON Lines) or '... row R' for row k of the piece (source, kind, start)."""
    if kind == "jsonl":
        line, seen = line_of(source, start), -1
        with open(source, "rb") as f:
            f.seek(start)
            for offset, text in enumerate(f):
                seen += bool(text.strip())
                if seen == k:
                    return f"data file '{source}' line {line + offset}"
    if kind == "parquet":
        import pyarrow.parquet as pq  # lazy: only Parquet inputs need it

        meta = pq.ParquetFile(source).metadata
        start = sum(meta.row_group(g).num_rows for g in range(start))
    where = "data" if source.startswith("hf:") or source == "builtin" else "data file"
    return f"{where} '{source}' row {start + k + 1}"


def read_bytes(path: str, start: int, end: int) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(start)
            return f.read(end - start)
    except OSError as e:  # removed or unreadable since it was planned: one line, also from a pool worker
        raise ConfigError(f"data file '{path}': cannot read ({one_line(e)})") from None


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


def jsonl_rows(buf: bytes, path: str, base: int, fields: Fields) -> list[tuple]:
    """The fields of every non-blank line; an error names the file and line."""
    out, pos = [], 0
    for line in buf.split(b"\n"):
        start, pos = pos, pos + len(line) + 1
        if not line.strip():
            continue

        def where(start=start) -> str:
            return f"data file '{path}' line {line_of(path, base + start)}"
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{where()}: not valid UTF-8 (byte offset {base + start + e.start})") from None
        try:
            row = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where()}: malformed JSON ({e.msg})") from None
        out.append(values_of(row, fields, where))
    return out


def values_of(row, fields: Fields, where) -> tuple:
    """The `fields` of one row, checked: text is a string, a label an integer or a string."""
    if not isinstance(row, dict):
        raise ConfigError(f"{where()}: expected a JSON object, got {type(row).__name__}")
    out = []
    for name, kind in fields:
        if kind == "record":  # the whole row; its format checks it (e.g. a conversation)
            out.append(row)
            continue
        if name not in row:
            raise ConfigError(f"{where()}: missing field '{name}' (fields: {', '.join(sorted(map(str, row)))[:200]})")
        value = row[name]
        if kind == "text" and not isinstance(value, str):
            raise ConfigError(f"{where()}: field '{name}' should be text, got {type(value).__name__}")
        if kind == "label" and (isinstance(value, bool) or not isinstance(value, (int, str))):
            raise ConfigError(f"{where()}: field '{name}' should be an integer or a string label, "
                              f"got {type(value).__name__} ({value!r})")
        out.append(value)
    return tuple(out)


def rows(piece: Piece, fields: Fields, batch_bytes: int = 1 << 20) -> Iterator[tuple[list[tuple], int]]:
    """Batches of checked rows of a row piece (jsonl, parquet, docs), with the input bytes they stand for."""
    if piece.kind == "docs":
        for lo in range(0, len(piece.docs), 4096):
            batch = list(piece.docs[lo:lo + 4096])
            yield batch, sum(value_bytes(v) for item in batch for v in item)
    elif piece.kind == "jsonl":
        yield from _jsonl_batches(piece, fields, batch_bytes)
    else:
        yield from _parquet_rows(piece, fields)


def _jsonl_batches(piece: Piece, fields: Fields, batch_bytes: int) -> Iterator[tuple[list[tuple], int]]:
    try:
        with open(piece.source, "rb") as f:
            f.seek(piece.start)
            pos = piece.start
            while pos < piece.end:
                buf = f.read(min(batch_bytes, piece.end - pos))
                if pos + len(buf) < piece.end:
                    buf += f.readline()  # complete the last line
                yield jsonl_rows(buf, piece.source, pos, fields), len(buf)
                pos += len(buf)
    except OSError as e:  # removed or unreadable since it was planned: one line, also from a pool worker
        raise ConfigError(f"data file '{piece.source}': cannot read ({one_line(e)})") from None


def _parquet_rows(piece: Piece, fields: Fields) -> Iterator[tuple[list[tuple], int]]:
    pf = open_parquet(piece.source, fields)
    row = sum(pf.metadata.row_group(g).num_rows for g in range(piece.start))
    for g in range(piece.start, piece.end):
        for batch, values in _row_group(pf, g, fields, piece.source, row):
            out = [values_of(r, fields, lambda n=row + i + 1: f"data file '{piece.source}' row {n}")
                   for i, r in enumerate(values)]
            row += len(out)
            yield out, int(batch.nbytes)


def _row_group(pf, g: int, fields: Fields, path: str, row: int) -> Iterator[tuple]:
    """(batch, its rows as dicts) of row group g; damage found while reading (a corrupt page, bad
    UTF-8) is a ConfigError naming the row group or row: in a pool worker as in the launcher."""
    batches = pf.iter_batches(batch_size=4096, row_groups=[g], columns=columns(fields))
    while True:
        try:
            batch = next(batches, None)
            if batch is None:
                return
            values = batch.to_pylist()
        except UnicodeDecodeError:
            raise ConfigError(_bad_utf8_row(batch, fields, path, row)) from None
        except Exception as e:  # pyarrow's ArrowInvalid, OSError (thrift, decompression), ...
            raise ConfigError(f"data file '{path}' row group {g + 1} of {pf.metadata.num_row_groups}: cannot "
                              f"read ({one_line(e)})") from None
        yield batch, values
        row += batch.num_rows


def _bad_utf8_row(batch, fields: Fields, path: str, row: int) -> str:
    import pyarrow as pa

    for name in columns(fields) or batch.schema.names:
        for i, value in enumerate(batch.column(name).cast(pa.binary()).to_pylist()):
            try:
                (value or b"").decode("utf-8")
            except UnicodeDecodeError:
                return f"data file '{path}' row {row + i + 1}: field '{name}' is not valid UTF-8"
    return f"data file '{path}' rows {row + 1}-{row + batch.num_rows}: not valid UTF-8"


def _check_columns(schema, fields: Fields, path) -> None:
    for name in columns(fields) or ():
        if name not in schema.names:
            raise ConfigError(f"data file '{path}': missing field '{name}' (fields: {', '.join(schema.names)[:200]})")


def csv_rows(path: Path, fields: Fields) -> Iterator[tuple]:
    """CSV through pyarrow's streaming reader; text columns are read as text (never as numbers), and
    damage (bad UTF-8, a row with the wrong number of columns) names pyarrow's row number."""
    import pyarrow as pa
    import pyarrow.csv as pcsv

    texts = {name: pa.string() for name, kind in fields if kind == "text"}
    try:
        if columns(fields) is None:  # a whole-row format: every column is text
            texts = {name: pa.string() for name in pcsv.open_csv(path).schema.names}
        # one thread: pyarrow's messages then carry the row number ('Row #N', the header is row 1)
        reader = pcsv.open_csv(path, read_options=pcsv.ReadOptions(block_size=1 << 22, use_threads=False),
                               convert_options=pcsv.ConvertOptions(column_types=texts))
        _check_columns(reader.schema, fields, path)
        row = 0
        for batch in reader:
            for r in (batch.select(columns(fields)) if columns(fields) is not None else batch).to_pylist():
                row += 1
                yield values_of(r, fields, lambda row=row: f"data file '{path}' row {row}")
    except ConfigError:
        raise
    except Exception as e:  # pyarrow raises several types; the message names the problem
        raise ConfigError(f"data file '{path}': cannot read as CSV ({one_line(e)})") from None


def hub_rows(spec: str, fields: Fields, split: str) -> Iterator[tuple]:
    """A Hugging Face dataset streamed row by row (a hub name where a network exists, or a local folder)."""
    import datasets  # lazy: ~1 s of start-up, only for hub data

    name, _, subset = spec[3:].partition(":")
    try:
        stream = datasets.load_dataset(name, subset or None, split=split, streaming=True)
        for i, row in enumerate(stream):
            yield values_of(row, fields, lambda i=i: f"data '{spec}' split '{split}' row {i + 1}")
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"hub dataset '{spec}' split '{split}': {one_line(e)}") from None
