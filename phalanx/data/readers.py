"""Reading a split's files — the middle of the reading seam (sources.py lists and opens a split's files,
this module cuts them into pieces and reads each piece into checked records, store.py keeps them).

Formats, checked: a file's first bytes (compressed, a Parquet file under another name, one JSON array, a
UTF-8 byte-order mark), byte ranges, JSON Lines lines, Parquet row groups, CSV, CoNLL, hub datasets, and the
fields of every row. Any damage is a one-line ConfigError naming the file and its line (JSON Lines, text),
row (CSV, Parquet, hub data) or row group, in a pool worker as in the launcher.

A file is a `Blob`: an fsspec filesystem (local, or whatever fsspec's installed backends reach: s3://,
gs://, ...) and the file's path on it, plus the name messages show. Credentials and endpoints are the
backend's own (environment, its config files); nothing of them passes through phalanx.

A piece is the unit of parallel work and of resumption; it becomes one shard of the token store.
    text      a byte range of a plain-text file (the whole file is one document)
    jsonl     a line-aligned byte range of a JSON Lines file (one document per row)
    conll     a sentence-aligned byte range of a CoNLL file
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
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import fsspec

from phalanx.core.config import ConfigError
from phalanx.data import builtin, cache

Fields = tuple  # ((name, 'text' | 'label'), ...): what each row must hold; ("", "record") = the whole row
BOM = b"\xef\xbb\xbf"  # a UTF-8 byte-order mark: what Windows tools write at the start of a text file
# Files users mistake for text: their signature, what they are, and the command that undoes it.
NOT_TEXT = ((b"\x1f\x8b", "gzip-compressed", "gunzip"), (b"\x28\xb5\x2f\xfd", "zstd-compressed", "unzstd"),
            (b"BZh", "bzip2-compressed", "bunzip2"), (b"\xfd7zXZ\x00", "xz-compressed", "unxz"),
            (b"PK\x03\x04", "a zip archive", "unzip"))
RETRIES = (0.5, 2.0)  # seconds before the 2nd and 3rd try of a read that failed for a transient reason
PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, ValueError)


def is_url(name: str) -> bool:
    """'s3://bucket/key', 'gs://...': a name for an fsspec backend rather than a local path."""
    return "://" in name and not name.startswith("file://")


@dataclass(frozen=True)
class Blob:
    """One file: `path` on the fsspec filesystem `fs`; `name` is what messages show (the local path as
    given, or the URL)."""
    fs: object = field(compare=False, repr=False)
    path: str
    name: str

    def read(self, start: int, end: int) -> bytes:
        """Bytes [start, end), retried on transient errors; damage or absence is a one-line ConfigError."""
        return _retried(lambda: self.fs.cat_file(self.path, start=start, end=end), self.name)

    def open(self):
        """A seekable binary file object (pyarrow reads Parquet and CSV through it)."""
        return _retried(lambda: self.fs.open(self.path, "rb"), self.name)


def blob(name: str) -> Blob:
    """The Blob of a local path or a URL (fsspec keeps one filesystem object per backend and settings)."""
    fs, path = fsspec.core.url_to_fs(name)
    return Blob(fs, path, name)


def _retried(call, name: str):
    for pause in (*RETRIES, None):
        try:
            return call()
        except PERMANENT as e:
            raise ConfigError(f"data file '{name}': cannot read ({one_line(e)})") from None
        except Exception as e:  # a connection reset, a throttled request, a timeout: worth another try
            if pause is None:
                raise ConfigError(f"data file '{name}': cannot read ({one_line(e)})") from None
            time.sleep(pause)


def one_line(e: BaseException, limit: int = 200) -> str:
    """An exception as one printable line: its type and message, control characters escaped."""
    text = " ".join(str(e).split())
    text = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
    text = text if len(text) <= limit else text[:limit - 3] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def columns(fields: Fields) -> list[str] | None:
    """The columns a reader needs: the fields' names, or None (all of them) for a whole-row format."""
    if any(kind == "record" for _, kind in fields):
        return None
    return [n for n, kind in fields if kind != "columns"]


def content_start(file: Blob, kind: str) -> int:
    """Where the text of a text, JSON Lines or CSV file starts: after a UTF-8 byte-order mark, else 0.
    A compressed file, a Parquet file, or (JSON Lines) one top-level JSON array is a ConfigError that
    says what to do, instead of a 'not valid UTF-8' or 'malformed JSON' error on its first line."""
    head, path = file.read(0, 64), file.name
    for magic, what, tool in NOT_TEXT:
        if head.startswith(magic):
            raise ConfigError(f"data file '{path}': {what}; decompress it first ({tool} '{path}'), or convert it "
                              f"to Parquet, which phalanx reads compressed")
    if head.startswith(b"PAR1"):
        raise ConfigError(f"data file '{path}': a Parquet file; name it .parquet or set data.format=parquet")
    start = len(BOM) if head.startswith(BOM) else 0
    if kind == "jsonl" and head[start:].lstrip().startswith(b"["):
        p = Path(path)
        lines = p.with_name(p.stem + ("-lines" if p.suffix == ".jsonl" else "") + ".jsonl")
        raise ConfigError(f"data file '{path}': one top-level JSON array, not JSON Lines (one object per line); "
                          f"convert it to JSON Lines, e.g. jq -c '.[]' '{path}' > '{lines}'")
    return start


def open_parquet(file: Blob, fields: Fields):
    """A `pyarrow.parquet.ParquetFile` whose footer is readable, with rows and the fields' columns."""
    import pyarrow.parquet as pq  # lazy: pyarrow only for Parquet/CSV inputs

    try:
        pf = pq.ParquetFile(file.open())
    except ConfigError:
        raise
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ...: the message names the damage
        raise ConfigError(f"data file '{file.name}': not a readable Parquet file ({one_line(e)})") from None
    if pf.metadata.num_rows == 0:
        raise ConfigError(f"data file '{file.name}': no rows (a Parquet file with 0 rows)")
    _check_columns(pf.schema_arrow, fields, file.name)
    return pf


def _check_columns(schema, fields: Fields, path) -> None:
    for name in columns(fields) or ():
        if name not in schema.names:
            raise ConfigError(f"data file '{path}': missing field '{name}' (fields: {', '.join(schema.names)[:200]})")


def line_of(file: Blob, offset: int) -> int:
    """1-based line number of byte `offset` (counted only when an error is reported)."""
    count, done = 1, 0
    while done < offset:
        block = file.read(done, min(offset, done + (1 << 24)))
        if not block:
            break
        count += block.count(b"\n")
        done += len(block)
    return count


def decode(buf: bytes, file: Blob, base: int) -> str:
    try:
        return buf.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"data file '{file.name}' line {line_of(file, base + e.start)}: not valid UTF-8 "
                          f"(byte offset {base + e.start})") from None


def jsonl_rows(buf: bytes, file: Blob, base: int, fields: Fields) -> list[tuple]:
    """The fields of every non-blank line; an error names the file and line."""
    out, pos = [], 0
    for line in buf.split(b"\n"):
        start, pos = pos, pos + len(line) + 1
        if not line.strip():
            continue

        def where(start=start) -> str:
            return f"data file '{file.name}' line {line_of(file, base + start)}"
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


def jsonl_batches(file: Blob, start: int, end: int, fields: Fields, batch_bytes: int) -> Iterator[tuple[list, int]]:
    """Rows of the line-aligned byte range [start, end) in batches of about batch_bytes (ranged reads: a
    batch's unfinished last line is carried into the next), with the input bytes each stands for."""
    pos, carry = start, b""
    while pos < end:
        buf = carry + file.read(pos, min(end, pos + batch_bytes))
        base, pos = pos - len(carry), min(end, pos + batch_bytes)
        cut = len(buf) if pos == end else buf.rfind(b"\n") + 1
        carry = buf[cut:]
        if cut:
            yield jsonl_rows(buf[:cut], file, base, fields), cut


def values_of(row, fields: Fields, where) -> tuple:
    """The `fields` of one row, checked: text is a string, a label an integer or a string."""
    if not isinstance(row, dict):
        raise ConfigError(f"{where()}: expected a JSON object, got {type(row).__name__}")
    out = []
    for name, kind in fields:
        if kind == "record":  # the whole row; its format checks it (e.g. a conversation)
            out.append(row)
            continue
        if kind == "columns":  # CoNLL's columns: how a .conll file is read, not a field of a record
            out.append(None)
            continue
        if name not in row:
            raise ConfigError(f"{where()}: missing field '{name}' (fields: {', '.join(sorted(map(str, row)))[:200]})")
        value = row[name]
        if kind == "text" and not isinstance(value, str):
            raise ConfigError(f"{where()}: field '{name}' should be text, got {type(value).__name__}")
        if kind == "label" and (isinstance(value, bool) or not isinstance(value, (int, str))):
            raise ConfigError(f"{where()}: field '{name}' should be an integer or a string label, "
                              f"got {type(value).__name__} ({value!r})")
        if kind in ("words", "tags"):
            _check_sequence(value, name, kind, where)
        out.append(value)
    lists = [(name, len(v)) for (name, kind), v in zip(fields, out) if kind in ("words", "tags")]
    if len(lists) == 2 and lists[0][1] != lists[1][1]:
        raise ConfigError(f"{where()}: field '{lists[0][0]}' has {lists[0][1]} words but field '{lists[1][0]}' has "
                          f"{lists[1][1]} tags (one tag per word)")
    return tuple(out)


def _check_sequence(value, name: str, kind: str, where) -> None:
    """A sentence's words (a non-empty list of strings) or tags (a list of integers or strings, not mixed)."""
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{where()}: field '{name}' should be a list of {kind}, got {type(value).__name__}")
    if not value:
        raise ConfigError(f"{where()}: field '{name}' is empty (an empty sentence)")
    if kind == "words":
        bad = next((w for w in value if not isinstance(w, str) or not w.strip()), None)
        if bad is not None:
            raise ConfigError(f"{where()}: field '{name}' should hold non-blank strings, got {bad!r}")
        return
    ints = [isinstance(t, int) and not isinstance(t, bool) for t in value]
    if not (all(ints) or all(isinstance(t, str) for t in value)):
        bad = next(t for t, i in zip(value, ints) if not (i or isinstance(t, str)) or i != ints[0])
        raise ConfigError(f"{where()}: field '{name}' should hold integer or string tags (not mixed), got {bad!r}")


def texts_of(value, kind: str) -> list[str]:
    """The text a row's value holds, for training a tokenizer: a text field, or every string of a record."""
    if kind == "text":
        return [value]
    if kind == "words":
        return [" ".join(value)]
    if kind != "record":
        return []
    if isinstance(value, str):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return [t for item in items for t in texts_of(item, "record")]


def parquet_rows(file: Blob, first: int, last: int, fields: Fields) -> Iterator[tuple[list[tuple], int]]:
    """Checked rows of row groups [first, last), in batches, with the input bytes each stands for."""
    pf = open_parquet(file, fields)
    row = sum(pf.metadata.row_group(g).num_rows for g in range(first))
    for g in range(first, last):
        for batch, values in _row_group_rows(pf, g, fields, file.name, row):
            out = [values_of(r, fields, lambda n=row + i + 1: f"data file '{file.name}' row {n}")
                   for i, r in enumerate(values)]
            row += len(out)
            yield out, int(batch.nbytes)


def _row_group_rows(pf, g: int, fields: Fields, path: str, row: int) -> Iterator[tuple]:
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


def csv_rows(file: Blob, fields: Fields) -> Iterator[tuple]:
    """CSV through pyarrow's streaming reader; text columns are read as text (never as numbers), and
    damage (bad UTF-8, a row with the wrong number of columns) names pyarrow's row number."""
    import pyarrow as pa
    import pyarrow.csv as pcsv

    path = file.name
    texts = {name: pa.string() for name, kind in fields if kind == "text"}
    try:
        if columns(fields) is None:  # a whole-row format: every column is text
            texts = {name: pa.string() for name in pcsv.open_csv(file.open()).schema.names}
        # one thread: pyarrow's messages then carry the row number ('Row #N', the header is row 1)
        reader = pcsv.open_csv(file.open(), read_options=pcsv.ReadOptions(block_size=1 << 22, use_threads=False),
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


def hub_label_names(spec: str, field: str, split: str) -> list[str] | None:
    """The names of a hub dataset's ClassLabel sequence field (e.g. conll2003's ner_tags), or None."""
    import datasets

    name, _, subset = spec[3:].partition(":")
    try:
        features = datasets.load_dataset(name, subset or None, split=split, streaming=True).features
    except Exception as e:
        raise ConfigError(f"hub dataset '{spec}' split '{split}': {one_line(e)}") from None
    feature = (features or {}).get(field)
    inner = getattr(feature, "feature", None)
    return list(inner.names) if isinstance(inner, datasets.ClassLabel) else None


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


# ---- CoNLL ----------------------------------------------------------------------------------------
# Characters a line may hold and still be blank: a byte-order mark or zero-width space/joiners (WNUT 2017's dev
# file has a line of only U+200B), which str.strip() keeps.
INVISIBLE = "\ufeff\u200b\u200c\u200d\u2060"
DOCSTART = "-DOCSTART-"


def is_blank(line: str) -> bool:
    return not line.strip().strip(INVISIBLE).strip()


def conll_spec(fields: Fields) -> tuple[int, int, str]:
    """(word column, tag column, separator) of a CoNLL file, from the fields' 'columns' entry (its name)."""
    return next((name for name, kind in fields if kind == "columns"), (0, -1, "auto"))


def conll_columns(line: str, separator: str) -> list[str]:
    """A line's columns: split on `separator`; auto = on tabs where the line has one (words may hold spaces), else
    on runs of whitespace."""
    if separator == "auto":
        return line.split("\t") if "\t" in line else line.split()
    return line.split(separator) if separator.strip() else line.split()


def conll_sentences(text: str, spec: tuple[int, int, str], where, first_line: int,
                    tags: bool = True) -> list[tuple[list[str], list[str], int]]:
    """(words, tags, first line number) of every sentence in `text` (whole lines; sentences end at blank lines),
    -DOCSTART- lines skipped. `where(n)` names line n for errors. With tags=False a line may hold the word only
    (text to tag)."""
    word_col, tag_col, sep = spec
    out, words, tags_, start = [], [], [], first_line
    for n, raw in enumerate(text.split("\n"), first_line):
        line = raw.rstrip("\r")
        if is_blank(line):
            if words:
                out.append((words, tags_, start))
            words, tags_ = [], []
            continue
        cols = [c.strip(INVISIBLE) for c in conll_columns(line.rstrip("\n"), sep)]
        if cols and cols[0].strip() == DOCSTART:
            continue
        if tags and len(cols) < 2:
            raise ConfigError(f"{where(n)}: a word without a tag ({line.strip()[:60]!r}: no "
                              f"{'tab or space' if sep == 'auto' else repr(sep)} separator)")
        try:
            word = cols[word_col].strip()
            tag = cols[tag_col].strip() if len(cols) > 1 else ""  # text to tag may carry its tags: kept
        except IndexError:
            raise ConfigError(f"{where(n)}: {len(cols)} columns, but token_classify.token_column is {word_col} and "
                              f"token_classify.tag_column is {tag_col}") from None
        if not word or (tags and not tag):
            raise ConfigError(f"{where(n)}: an empty {'word' if not word else 'tag'} ({line.strip()[:60]!r})")
        if not words:
            start = n
        words.append(word)
        tags_.append(tag)
    if words:
        out.append((words, tags_, start))
    return out


def conll_rows(file: Blob, start: int, end: int, fields: Fields) -> list[tuple]:
    """The (words, tags) of every sentence of the sentence-aligned byte range [start, end) of a CoNLL file."""
    text = decode(file.read(start, end), file, start)
    # the line number is counted only for a message (it reads the file up to `start`)
    sentences = conll_sentences(text, conll_spec(fields),
                                lambda n: f"data file '{file.name}' line {line_of(file, start) + n}", 0)
    return [(words, tags, None) for words, tags, _ in sentences]  # None: the 'columns' entry's place


# --- Pieces: a file cut into units of work, and a piece's rows ---

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
        if is_blank(buf[p + 1:nxt].decode("utf-8", "replace")):
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
    made_of: tuple = field(repr=False)  # what it is made from: its fingerprint's parts
    ends_document: bool = False    # text: the file ends here, an end-of-text token follows
    docs: tuple = field(default=(), repr=False)
    file: Blob | None = field(default=None, compare=False, repr=False)  # where its bytes are (not docs)

    @cached_property
    def fingerprint(self) -> str:
        """Its name in the store: a changed input (file identity, range, fields, rows) makes a new one."""
        return cache.fingerprint(*self.made_of)

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
        yield from _doc_pieces(spec, hub_rows(spec, fields, source.split.name), piece_bytes)
        return
    for f in source.files:
        if f.size == 0:
            raise ConfigError(f"data file '{f.blob.name}': no rows (empty file)")
        if f.kind == "text" and (len(fields) > 1 or columns(fields) is None):
            wanted = ", ".join(n for n, _ in fields if n) or "records"
            raise ConfigError(f"data file '{f.blob.name}': plain text has no fields ({wanted}); use JSON Lines, "
                              f"CSV or Parquet")
        if f.kind == "csv":
            content_start(f.blob, f.kind)
            yield from _doc_pieces(f.blob.name, csv_rows(f.blob, fields), piece_bytes)
        else:
            yield from _file_pieces(f, fields, piece_bytes)


def _file_pieces(f, fields: Fields, piece_bytes: int) -> list[Piece]:
    """Pieces of one file (`f`: sources.DataFile) by row groups (Parquet) or safe byte ranges."""
    ident, kind, name = f.identity, f.kind, f.blob.name
    if kind == "parquet":
        meta = open_parquet(f.blob, fields).metadata
        groups, sizes = [0], 0
        for g in range(meta.num_row_groups):
            sizes += meta.row_group(g).total_byte_size
            if sizes >= piece_bytes and g + 1 < meta.num_row_groups:
                groups.append(g + 1)
                sizes = 0
        bounds = groups + [meta.num_row_groups]
        per_group = f.size / max(meta.num_row_groups, 1)
        return [Piece("parquet", name, a, b, int((b - a) * per_group), (ident, kind, fields, a, b),
                      file=f.blob) for a, b in zip(bounds, bounds[1:])]
    finder = {"text": safe_cut, "conll": sentence_cut}.get(kind, line_cut)
    cuts = _cuts(f.blob, content_start(f.blob, kind), f.size, piece_bytes, finder)
    return [Piece(kind, name, a, b, b - a, (ident, kind, fields, a, b, b == f.size),
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
            yield Piece("docs", name, row, row + len(batch), size, (name, *batch), docs=tuple(batch))
            row, batch, size = row + len(batch), [], 0
    if batch:
        yield Piece("docs", name, row, row + len(batch), size, (name, *batch), docs=tuple(batch))


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
        for line, text in _lines(blob(source), start):
            seen += bool(text.strip())
            if seen == k:
                return f"data file '{source}' line {line}"
    if kind == "conll":
        file = blob(source)
        text = decode(file.read(start, file.fs.size(file.path)), file, start)
        first = conll_sentences(text, (0, 0, "auto"), lambda n: "", 0, tags=False)[k][2]
        return f"data file '{source}' line {line_of(file, start) + first}"
    if kind == "parquet":
        meta = open_parquet(blob(source), ()).metadata
        start = sum(meta.row_group(g).num_rows for g in range(start))
    where = "data" if source.startswith("hf:") or source == "builtin" else "data file"
    return f"{where} '{source}' row {start + k + 1}"


def _lines(file: Blob, start: int) -> Iterator[tuple[int, bytes]]:
    """(line number, line) from byte `start` (a line start) on, read in ranged blocks."""
    line, pos, carry = line_of(file, start), start, b""
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
        yield decode(buf[pos:end], piece.file, piece.start + pos), end - pos
        pos = end


def rows(piece: Piece, fields: Fields, batch_bytes: int = 1 << 20) -> Iterator[tuple[list[tuple], int]]:
    """Batches of checked rows of a row piece (jsonl, parquet, docs), with the input bytes they stand for."""
    if piece.kind == "docs":
        for lo in range(0, len(piece.docs), 4096):
            batch = list(piece.docs[lo:lo + 4096])
            yield batch, sum(value_bytes(v) for item in batch for v in item)
    elif piece.kind == "jsonl":
        yield from jsonl_batches(piece.file, piece.start, piece.end, fields, batch_bytes)
    elif piece.kind == "conll":  # a piece is read whole: it is at most data.shard_mb
        yield conll_rows(piece.file, piece.start, piece.end, fields), piece.size
    else:
        yield from parquet_rows(piece.file, piece.start, piece.end, fields)
