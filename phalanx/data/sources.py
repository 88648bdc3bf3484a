"""Reading training data: local files (text, JSONL, CSV, Parquet), hub datasets, the built-in corpus.

Plain text and JSONL are read here so that a malformed line is reported with its file and line number;
CSV and Parquet go through Hugging Face `datasets`; 'hf:NAME[:CONFIG]' loads a hub dataset with the
same code where a network exists. Every problem is a `ConfigError` (exit code 2, one line).
"""
from __future__ import annotations

import json
from pathlib import Path

from ..config import ConfigError

EXTENSIONS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "jsonl", ".json": "jsonl",
              ".csv": "csv", ".parquet": "parquet"}


def files_of(spec: str, key: str) -> list[Path]:
    p = Path(spec)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in EXTENSIONS)
        if not files:
            raise ConfigError(f"config key '{key}': folder '{spec}' holds no data files "
                              f"({', '.join(sorted(EXTENSIONS))})")
        return files
    if not p.is_file():
        raise ConfigError(f"config key '{key}': file '{spec}' not found")
    return [p]


def format_of(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    if path.suffix not in EXTENSIONS:
        raise ConfigError(f"data file '{path}': unknown extension '{path.suffix}'; set data.format")
    return EXTENSIONS[path.suffix]


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError(f"data file '{path}' line {line}: not valid UTF-8 (byte offset {e.start})") from None


def _read_jsonl(path: Path) -> list[dict]:
    text = _read_text(path)
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"data file '{path}' line {e.lineno}: malformed JSON ({e.msg})") from None
        return [r for r in rows]
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"data file '{path}' line {lineno}: malformed JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ConfigError(f"data file '{path}' line {lineno}: expected a JSON object, got "
                              f"{type(row).__name__}")
        rows.append(row)
    return rows


def _read_table(path: Path, fmt: str) -> list[dict]:
    import datasets  # heavy import, only for tabular formats

    datasets.disable_progress_bars()
    try:
        ds = datasets.Dataset.from_csv(str(path)) if fmt == "csv" else datasets.Dataset.from_parquet(str(path))
    except Exception as e:  # datasets raises many types; the message names the problem
        raise ConfigError(f"data file '{path}': cannot read as {fmt} ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''})") from None
    return ds.to_list()


def _read_hub(spec: str, split: str) -> list[dict]:
    import datasets

    name, _, subset = spec[3:].partition(":")
    try:
        return datasets.load_dataset(name, subset or None, split=split).to_list()
    except Exception as e:
        raise ConfigError(f"hub dataset '{spec}' split '{split}': {type(e).__name__}: {e}") from None


def read_records(spec: str, fmt: str, key: str, split: str = "train") -> list[dict]:
    """All rows of a data source as dicts; plain text files give one row {'text': content}."""
    if spec.startswith("hf:"):
        return _read_hub(spec, split)
    rows = []
    for path in files_of(spec, key):
        kind = format_of(path, fmt)
        if kind == "text":
            rows.append({"text": _read_text(path)})
        elif kind == "jsonl":
            rows.extend(_read_jsonl(path))
        else:
            rows.extend(_read_table(path, kind))
        if not rows:
            raise ConfigError(f"data file '{path}': no rows (empty file)")
    return rows


def field_values(rows: list[dict], field: str, where, kind: str = "text") -> list:
    """Column `field` of `rows`: text, or (kind="label") an integer or string label. `where(i)` names
    row i's place ('data file X line L') in the error when a value is missing or of the wrong type."""
    out = []
    for i, row in enumerate(rows):
        if field not in row:
            raise ConfigError(f"{where(i)}: missing field '{field}' (fields: {', '.join(sorted(map(str, row)))[:200]})")
        value = row[field]
        if kind == "text" and not isinstance(value, str):
            raise ConfigError(f"{where(i)}: field '{field}' should be text, got {type(value).__name__}")
        if kind == "label" and (isinstance(value, bool) or not isinstance(value, (int, str))):
            raise ConfigError(f"{where(i)}: field '{field}' should be an integer or a string label, "
                              f"got {type(value).__name__} ({value!r})")
        out.append(value)
    return out


def read_documents(spec: str, fmt: str, text_field: str, key: str, split: str = "train") -> list[str]:
    """Documents for language modelling (one per text file, one per row otherwise)."""
    rows = read_records(spec, fmt, key, split)
    docs = field_values(rows, "text" if _is_plain(spec, fmt) else text_field, lambda i: f"data '{spec}' row {i + 1}")
    if not any(d.strip() for d in docs):
        raise ConfigError(f"data '{spec}': contains no text")
    return docs


def _is_plain(spec: str, fmt: str) -> bool:
    if spec.startswith("hf:"):
        return False
    return all(format_of(p, fmt) == "text" for p in files_of(spec, "data"))


def split_holdout(docs: list[str], fraction: float) -> tuple[list[str], list[str]]:
    """Hold out the last `fraction` of the data: documents, or characters of a single document."""
    if fraction <= 0:
        return docs, []
    if len(docs) == 1:
        text = docs[0]
        cut = int(len(text) * (1 - fraction))
        return [text[:cut]], [text[cut:]]
    cut = max(1, int(round(len(docs) * (1 - fraction))))
    return docs[:cut], docs[cut:]
