"""Damaged input of every supported format: one ConfigError line naming the file (and line, row or row
group) and what is wrong, exit 2 through the CLI, and no index left behind — also when the damage is found
only while encoding in the worker pool. Each damage has an intact twin that prepares (the control)."""
from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO, SHAKESPEARE, phalanx
from test_prepare import tokenizer_dir
from tokenizers import Tokenizer

from phalanx.core.config import ConfigError, load_config
from phalanx.data import prepare as pipeline
from phalanx.data import layout, store
from phalanx.data.lm_store import LM
from phalanx.data import tokenizer as toks
from phalanx.tasks.classify import ClassifyTask

LINES = [line for line in SHAKESPEARE.read_text(encoding="utf-8").splitlines() if line.strip()][:4000]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> str:
    """A saved tokenizer: no tokenizer training, so nothing reads the data before the encoding pool."""
    return str(tokenizer_dir(tmp_path_factory.mktemp("tok"), "\n".join(LINES[:2000])))


def cfg_for(data, cache: Path, *extra):
    return load_config(None, [f"data.train={data}", f"data.cache_dir={cache}", "data.vocab_size=300",
                              "data.tokenizer_sample_mb=0.2", "data.val_fraction=0", *extra])


def prepare(data, cache: Path, *extra, workers: int = 1) -> dict:
    return pipeline.prepare(cfg_for(data, cache, *extra), LM, workers, progress=False)


def assert_fails(data, cache: Path, message: str, *extra, workers: int = 1) -> str:
    """Preparing fails with a one-line ConfigError containing `message`; no index or temporary file is left."""
    with pytest.raises(ConfigError) as err:
        prepare(data, cache, *extra, workers=workers)
    text = str(err.value)
    assert message in text and "\n" not in text, text
    assert not list(cache.rglob(layout.INDEX)) and not list(cache.rglob("*.tmp")) and not list(cache.rglob("*.claim"))
    return text


def store_ids(cache: Path) -> np.ndarray:
    tokens = store.TokenStore(next(cache.glob("store-*")))
    return tokens.slice(0, len(tokens))


def write_parquet(path: Path, n: int = 20000, group: int = 2000) -> Path:
    pq.write_table(pa.table({"text": [LINES[i % len(LINES)] for i in range(n)]}), path, row_group_size=group)
    return path


def corrupt_page(good: Path, bad: Path, group: int) -> None:
    """Garbles a data page of one row group; the footer stays intact, so planning cannot see it."""
    data = bytearray(good.read_bytes())
    start = pq.ParquetFile(good).metadata.row_group(group).column(0).data_page_offset
    for i in range(start + 40, start + 400):
        data[i] = (data[i] * 7 + 13) % 256
    bad.write_bytes(bytes(data))


def jsonl(path: Path, rows, prefix: bytes = b"") -> Path:
    path.write_bytes(prefix + "".join(json.dumps(r) + "\n" for r in rows).encode())
    return path


# ---- Parquet -------------------------------------------------------------------------------------------
def test_corrupt_and_truncated_parquet_is_found_when_planning(tmp_path):
    good = write_parquet(tmp_path / "good.parquet")
    prepare(good, tmp_path / "ok")  # control: the intact file prepares
    (tmp_path / "random.parquet").write_bytes(os.urandom(3000))
    (tmp_path / "cut.parquet").write_bytes(good.read_bytes()[:good.stat().st_size // 2])
    for name in ("random.parquet", "cut.parquet"):
        assert_fails(tmp_path / name, tmp_path / f"c-{name}",
                     f"data file '{tmp_path / name}': not a readable Parquet file (ArrowInvalid: Parquet magic bytes")


def test_a_corrupt_data_page_found_in_the_worker_pool_is_one_line_naming_the_row_group(tmp_path, tok):
    good = write_parquet(tmp_path / "good.parquet")
    corrupt_page(good, tmp_path / "bad.parquet", group=7)
    extra = (f"data.tokenizer={tok}", "data.shard_mb=0.02")  # several pieces: the 2-process pool encodes them
    prepare(good, tmp_path / "ok", *extra, workers=2)  # control
    assert_fails(tmp_path / "bad.parquet", tmp_path / "c", f"data file '{tmp_path / 'bad.parquet'}' row group 8 of 10: "
                 "cannot read (", *extra, workers=2)
    assert list((tmp_path / "c").glob("store-*/*.bin"))  # the pieces other processes finished are kept for reuse


def test_parquet_with_no_rows_wrong_columns_or_bad_utf8(tmp_path):
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    assert_fails(tmp_path / "empty.parquet", tmp_path / "c1", "empty.parquet': no rows (a Parquet file with 0 rows)")
    pq.write_table(pa.table({"body": LINES[:50]}), tmp_path / "cols.parquet")
    assert_fails(tmp_path / "cols.parquet", tmp_path / "c2", "cols.parquet': missing field 'text' (fields: body)")
    texts = [s.encode() for s in LINES[:300]]
    texts[123] = b"bad \xff byte"
    bad = pa.array(texts, pa.binary()).view(pa.string())  # written unchecked, as a broken writer would
    pq.write_table(pa.table({"text": bad}), tmp_path / "utf8.parquet")
    assert_fails(tmp_path / "utf8.parquet", tmp_path / "c3", "utf8.parquet' row 124: field 'text' is not valid UTF-8")
    pq.write_table(pa.table({"text": LINES[:300]}), tmp_path / "fine.parquet")
    prepare(tmp_path / "fine.parquet", tmp_path / "ok")  # control


# ---- JSON Lines and text -------------------------------------------------------------------------------
def test_a_byte_order_mark_at_the_start_is_accepted_with_the_same_ids(tmp_path, tok):
    rows = [{"text": line} for line in LINES[:500]]
    plain, marked = jsonl(tmp_path / "plain.jsonl", rows), jsonl(tmp_path / "bom.jsonl", rows, b"\xef\xbb\xbf")
    text = "\n".join(LINES[:500]) + "\n"
    (tmp_path / "plain.txt").write_text(text, encoding="utf-8")
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbf" + text.encode())
    for a, b in ((plain, marked), (tmp_path / "plain.txt", tmp_path / "bom.txt")):
        prepare(a, tmp_path / f"c-{a.name}", f"data.tokenizer={tok}")
        prepare(b, tmp_path / f"c-{b.name}", f"data.tokenizer={tok}")
        assert np.array_equal(store_ids(tmp_path / f"c-{a.name}"), store_ids(tmp_path / f"c-{b.name}"))
    # control: a mark anywhere else is not skipped (JSON Lines: an error naming the line)
    jsonl(tmp_path / "mid.jsonl", rows)
    data = (tmp_path / "mid.jsonl").read_bytes().split(b"\n")
    data[2] = b"\xef\xbb\xbf" + data[2]
    (tmp_path / "mid.jsonl").write_bytes(b"\n".join(data))
    assert_fails(tmp_path / "mid.jsonl", tmp_path / "c-mid", "mid.jsonl' line 3: malformed JSON",
                 f"data.tokenizer={tok}")


def test_compressed_files_and_json_arrays_say_what_to_do(tmp_path):
    rows = [{"text": line} for line in LINES[:200]]
    (tmp_path / "z.jsonl").write_bytes(gzip.compress(jsonl(tmp_path / "plain.jsonl", rows).read_bytes()))
    assert_fails(tmp_path / "z.jsonl", tmp_path / "c1",
                 f"data file '{tmp_path / 'z.jsonl'}': gzip-compressed; decompress it")
    (tmp_path / "z.txt").write_bytes(gzip.compress(b"some text\n" * 100))
    assert_fails(tmp_path / "z.txt", tmp_path / "c2", "z.txt': gzip-compressed; decompress it")
    for name, text in (("one.json", json.dumps(rows)), ("pretty.json", json.dumps(rows, indent=2)),
                       ("array.jsonl", "\n" + json.dumps(rows))):
        (tmp_path / name).write_text(text, encoding="utf-8")
        message = assert_fails(tmp_path / name, tmp_path / f"c-{name}",
                               f"data file '{tmp_path / name}': one top-level JSON array, not JSON Lines")
        assert "convert it to JSON Lines" in message and "malformed" not in message
    prepare(tmp_path / "plain.jsonl", tmp_path / "ok")  # control: the same rows as JSON Lines


def test_bad_utf8_deep_in_a_file_is_found_by_the_pool_naming_the_line(tmp_path, tok):
    """Far from the launcher's sampled windows: only the full pass in the pool sees it."""
    lines = (LINES * 8)[:30000]
    good = tmp_path / "good.txt"
    good.write_text("\n".join(lines) + "\n", encoding="utf-8")
    data = good.read_bytes().split(b"\n")
    data[21000] = data[21000][:5] + b"\xc3\x28" + data[21000][5:]
    (tmp_path / "bad.txt").write_bytes(b"\n".join(data))
    rows = [{"text": line} for line in lines]
    rows_bad = jsonl(tmp_path / "bad.jsonl", rows).read_bytes().split(b"\n")
    rows_bad[21000] = rows_bad[21000].replace(b'"text": "', b'"text": "\xff', 1)
    (tmp_path / "bad.jsonl").write_bytes(b"\n".join(rows_bad))
    extra = (f"data.tokenizer={tok}", "data.shard_mb=0.05")
    prepare(good, tmp_path / "ok", *extra, workers=2)  # control
    for name in ("bad.txt", "bad.jsonl"):
        assert_fails(tmp_path / name, tmp_path / f"c-{name}", f"'{tmp_path / name}' line 21001: not valid UTF-8",
                     *extra, workers=2)


def test_a_failed_preparation_removes_the_index_of_older_data(tmp_path, tok):
    data = tmp_path / "d.jsonl"
    jsonl(data, [{"text": line} for line in LINES[:300]])
    prepare(data, tmp_path / "c", f"data.tokenizer={tok}")
    assert list((tmp_path / "c").rglob(layout.INDEX))
    data.write_text('{"text": "fine"}\n{"text": broken\n', encoding="utf-8")  # the file changed, and is damaged
    assert_fails(data, tmp_path / "c", "d.jsonl' line 2: malformed JSON", f"data.tokenizer={tok}")


# ---- CSV and classification fields ---------------------------------------------------------------------
def test_csv_damage_names_the_row(tmp_path, tok):
    (tmp_path / "good.csv").write_text("text,label\n" + "".join(f'"{t}",1\n' for t in LINES[:100]), encoding="utf-8")
    prepare(tmp_path / "good.csv", tmp_path / "ok")  # control
    (tmp_path / "cols.csv").write_text("text,label\nhello,1\na,b,c\nok,1\n", encoding="utf-8")
    assert_fails(tmp_path / "cols.csv", tmp_path / "c1", "cols.csv': cannot read as CSV (ArrowInvalid: CSV parse "
                 "error: Row #3: Expected 2 columns, got 3")
    (tmp_path / "utf8.csv").write_bytes(b"text,label\nhello,1\nbad \xff,0\nok,1\n")
    assert_fails(tmp_path / "utf8.csv", tmp_path / "c2", "Row #3: CSV conversion error to string: invalid UTF8")
    (tmp_path / "random.csv").write_bytes(os.urandom(3000))
    assert_fails(tmp_path / "random.csv", tmp_path / "c3", "random.csv': ")
    (tmp_path / "nums.csv").write_text("text,label\n007,1\n1.50,0\n", encoding="utf-8")
    prepare(tmp_path / "nums.csv", tmp_path / "nums", f"data.tokenizer={tok}")
    ref = Tokenizer.from_file(str(Path(tok) / "tokenizer.json"))
    eos = ref.token_to_id(toks.EOS)
    ids = [i for t in ("007", "1.50") for i in ref.encode(t, add_special_tokens=False).ids + [eos]]
    assert store_ids(tmp_path / "nums").tolist() == ids  # text columns stay text: not 7 and 1.5


def test_classification_rows_with_wrong_fields_name_the_row(tmp_path):
    def prepare_classify(data: Path, cache: str):
        cfg = load_config(None, ["task=classify", "model.arch=bert", "data.vocab_size=300", "classify.max_length=16",
                                 f"data.train={data}", f"data.cache_dir={tmp_path / cache}"])
        return ClassifyTask.prepare_data(cfg, 1, False)

    rows = [{"text": line, "label": i % 2} for i, line in enumerate(LINES[:200])]
    columns = {"text": [r["text"] for r in rows], "label": [r["label"] for r in rows]}
    pq.write_table(pa.table(columns), tmp_path / "ok.parquet")
    prepare_classify(tmp_path / "ok.parquet", "ok")  # control
    pq.write_table(pa.table({"text": [r["text"] for r in rows]}), tmp_path / "nolabel.parquet")
    with pytest.raises(ConfigError, match="nolabel.parquet': missing field 'label' \\(fields: text\\)"):
        prepare_classify(tmp_path / "nolabel.parquet", "c1")
    rows[77]["label"] = 1.5
    with pytest.raises(ConfigError, match="float.jsonl' line 78: field 'label' should be an integer or a string"):
        prepare_classify(jsonl(tmp_path / "float.jsonl", rows), "c2")
    assert not list((tmp_path / "c1").rglob(layout.INDEX)) and not list((tmp_path / "c2").rglob(layout.INDEX))


# ---- through the CLI: exit 2, one line on stderr, nothing left ------------------------------------------
def test_the_issue_command_corrupt_parquet_is_exit_2_with_one_line(tmp_path):
    bad = tmp_path / "corrupt.parquet"
    bad.write_bytes(os.urandom(3000))
    proc = phalanx("train", REPO / "examples" / "shakespeare.yaml", f"data.train={bad}",
                   f"data.cache_dir={tmp_path / 'c'}", "--run-dir", tmp_path / "run", timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"phalanx: error: data file '{bad}': not a readable Parquet file (ArrowInvalid: Parquet magic bytes not "
        f"found in footer. Either the file is corrupted or this is not a parquet file.)"]
    assert "Traceback" not in proc.stdout + proc.stderr and not list(tmp_path.rglob(layout.INDEX))


def test_pool_damage_through_prepare_is_exit_2_with_one_line(tmp_path, tok):
    corrupt_page(write_parquet(tmp_path / "good.parquet"), tmp_path / "bad.parquet", group=4)
    proc = phalanx("prepare", f"data.train={tmp_path / 'bad.parquet'}", f"data.cache_dir={tmp_path / 'c'}",
                   f"data.tokenizer={tok}", "data.shard_mb=0.02", "--workers", 2, "--quiet", timeout=90)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"phalanx: error: data file '{tmp_path / 'bad.parquet'}' row group "
                                                   f"5 of 10: cannot read ("), lines
    assert not list(tmp_path.rglob(layout.INDEX)) and not list(tmp_path.rglob(".*.tmp"))


def test_a_file_gone_after_planning_is_one_line_from_the_readers(tmp_path):
    """What a pool worker meets when a file is removed or replaced by a folder while it is prepared."""
    from phalanx.data import readers
    from phalanx.data.sources import Split, open_source

    text, rows = tmp_path / "t.txt", jsonl(tmp_path / "r.jsonl", [{"text": line} for line in LINES[:100]])
    text.write_text("\n".join(LINES[:100]) + "\n", encoding="utf-8")
    plans = {p: list(readers.plan(open_source(Split(str(p), "data.train", "train"), "auto"), (("text", "text"),),
                                 1 << 20)) for p in (text, rows)}
    assert [len(list(readers.text_chunks(plans[text][0]))),
            len(list(readers.rows(plans[rows][0], (("text", "text"),))))] == [1, 1]  # control: readable while there
    for path in (text, rows):
        path.unlink()
    with pytest.raises(ConfigError, match=f"data file '{text}': cannot read \\(FileNotFoundError: "):
        list(readers.text_chunks(plans[text][0]))
    with pytest.raises(ConfigError, match=f"data file '{rows}': cannot read \\(FileNotFoundError: "):
        list(readers.rows(plans[rows][0], (("text", "text"),)))
