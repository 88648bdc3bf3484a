"""Sentences to tag, held in memory: `phalanx predict`'s input file (training data is streamed into a store
instead: store.py), read by the same checked readers: CoNLL (the tag column optional) or JSON Lines / Parquet
rows with the run's tokens field.
"""
from __future__ import annotations

from pathlib import Path

from phalanx.core.config import Config, ConfigError
from phalanx.data import readers, sources


def read_sentences(path: str, cfg: Config) -> tuple[list[list[str]], list[str]]:
    """The sentences' words, and the tags a CoNLL input carries in its tag column (all of them, in order)."""
    t = cfg.token_classify
    split = sources.Split(path, "--input", "test")
    known = Path(path).suffix in sources.EXTENSIONS  # another name (WNUT's .annotated) is read as CoNLL
    source = sources.open_source(split, "auto" if known and cfg.data.format != "conll" else "conll")
    f = source.files[0]
    if f.kind == "conll":
        start = readers.content_start(f.blob, "conll")  # after a byte-order mark
        text = readers.decode(f.blob.read(start, f.size), f.blob, start)
        where = lambda n: f"data file '{path}' line {n + 1}"  # noqa: E731
        parsed = readers.conll_sentences(text, (t.token_column, t.tag_column, t.separator), where, 0, tags=False)
        found, carried = [words for words, _, _ in parsed], [tag for _, tags, _ in parsed for tag in tags if tag]
    elif f.kind in ("jsonl", "parquet"):
        fields = ((t.tokens_field, "words"),)
        found = [list(row[0]) for piece in readers.plan(source, fields, 1 << 40)
                 for batch, _ in readers.rows(piece, fields) for row in batch]
        carried = []
    else:
        raise ConfigError(f"--input: '{path}' is {f.kind}; token_classify reads CoNLL (.conll), JSON Lines or Parquet "
                          f"with the field '{t.tokens_field}'")
    if not found:
        raise ConfigError(f"data file '{path}': no sentences")
    return found, carried
