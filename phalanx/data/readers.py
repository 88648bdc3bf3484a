"""Reading each input format, checked: a file's first bytes (compressed, a Parquet file under another name,
one JSON array, a UTF-8 byte-order mark), JSON Lines lines, Parquet row groups, CSV, hub datasets, and the
fields of every row. Any damage is a one-line ConfigError naming the file and its line (JSON Lines, text),
row (CSV, Parquet, hub data) or row group, in a pool worker as in the launcher. pieces.py decides which
part of a file is read; this module reads it.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from phalanx.core.config import ConfigError

Fields = tuple  # ((name, 'text' | 'label'), ...): what each row must hold; ("", "record") = the whole row
BOM = b"\xef\xbb\xbf"  # a UTF-8 byte-order mark: what Windows tools write at the start of a text file
# Files users mistake for text: their signature, what they are, and the command that undoes it.
NOT_TEXT = ((b"\x1f\x8b", "gzip-compressed", "gunzip"), (b"\x28\xb5\x2f\xfd", "zstd-compressed", "unzstd"),
            (b"BZh", "bzip2-compressed", "bunzip2"), (b"\xfd7zXZ\x00", "xz-compressed", "unxz"),
            (b"PK\x03\x04", "a zip archive", "unzip"))


def one_line(e: BaseException, limit: int = 200) -> str:
    """An exception as one printable line: its type and message, control characters escaped."""
    text = " ".join(str(e).split())
    text = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
    text = text if len(text) <= limit else text[:limit - 3] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def columns(fields: Fields) -> list[str] | None:
    """The columns a reader needs: the fields' names, or None (all of them) for a whole-row format."""
    return None if any(kind == "record" for _, kind in fields) else [n for n, _ in fields]


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


def _check_columns(schema, fields: Fields, path) -> None:
    for name in columns(fields) or ():
        if name not in schema.names:
            raise ConfigError(f"data file '{path}': missing field '{name}' (fields: {', '.join(schema.names)[:200]})")


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


def row_group_rows(pf, g: int, fields: Fields, path: str, row: int) -> Iterator[tuple]:
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
