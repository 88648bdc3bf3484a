"""The one preparation pipeline (data/prepare.py): the same summary shape for every task, `phalanx prepare`
on each task's example config, a record format with its own arrays and finish step (what chat builds on),
and stores that depend on another split's data."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from conftest import REPO, SHAKESPEARE, SST2, phalanx
from tokenizers import Tokenizer

from phalanx.core.config import load_config
from phalanx.data import layout, prepare, readers, store
from phalanx.data import tokenizer as toks
from phalanx.data.sources import Split, open_source
from phalanx.tasks.classify import ClassifyTask
from phalanx.tasks.lm import LMTask

COMMON = set(prepare.SUMMARY) - {"reused"}
CLASSIFY = ["task=classify", "model.arch=bert", "data.vocab_size=400", "classify.max_length=32"]


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def sst2_rows(split: str, n: int) -> list[dict]:
    return [json.loads(line) for line in (SST2 / f"{split}.jsonl").read_text().splitlines()[:n]]


def test_both_tasks_give_one_summary_shape_and_reuse_it(tmp_path):
    lm = load_config(None, [f"data.train={SHAKESPEARE}", f"data.cache_dir={tmp_path / 'lm'}", "data.vocab_size=300"])
    train = jsonl(tmp_path / "t.jsonl", sst2_rows("train", 300))
    val = jsonl(tmp_path / "v.jsonl", sst2_rows("validation", 50))
    cls = load_config(None, [*CLASSIFY, f"data.train={train}", f"data.validation={val}",
                             f"data.cache_dir={tmp_path / 'cls'}"])
    for task, cfg, splits in ((LMTask, lm, ["train"]), (ClassifyTask, cls, ["train", "validation"])):
        first = task.prepare_data(cfg, 1, progress=False)
        assert list(first) == splits
        for s in first.values():
            assert COMMON <= s.keys() and "reused" not in s, sorted(s)
            assert s["documents"] > 0 and s["tokens"] > 0 and s["store_bytes"] > 0 and s["mb_per_s"] > 0
        again = task.prepare_data(cfg, 1, progress=False)
        assert all(s.pop("reused") and s == first[k] for k, s in again.items())
    assert first["train"]["documents"] == 300 and first["validation"]["documents"] == 50
    assert first["train"]["labels"] == first["validation"]["labels"] == ["0", "1"]


def test_phalanx_prepare_runs_on_every_tasks_example_config(tmp_path):
    """`phalanx prepare examples/sst2.yaml data.train=... data.validation=...` ended in KeyError 'mb_per_s'."""
    train = jsonl(tmp_path / "t.jsonl", sst2_rows("train", 400))
    val = jsonl(tmp_path / "v.jsonl", sst2_rows("validation", 60))
    runs = {"sst2.yaml": ([f"data.train={train}", f"data.validation={val}"], ["400 documents", "60 documents"]),
            "shakespeare.yaml": ([f"data.train={SHAKESPEARE}"], ["encoder tokenizers"])}
    outputs = {}
    for config, (data, expected) in runs.items():
        args = ["prepare", REPO / "examples" / config, *data, f"data.cache_dir={tmp_path / 'cache'}",
                "data.vocab_size=500", "--quiet"]
        proc = phalanx(*args, timeout=120)
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]
        outputs[config] = proc.stdout
        lines = [line.removeprefix("phalanx: ") for line in proc.stdout.splitlines()
                 if line.startswith(("phalanx: train:", "phalanx: validation:"))]  # each split's summary, once
        assert [line.split(":")[0] for line in lines] == ["train", "validation"][:len(data)], proc.stdout
        assert all(text in line and "prepared in" in line for text, line in zip(expected, lines)), lines
        again = [line for line in phalanx(*args, timeout=120, check=True).stdout.splitlines() if line.strip()]
        assert len(again) == len(lines) and all("already prepared" in line for line in again), again
    # classification: the label names (the example's classify.labels) with each split
    assert outputs["sst2.yaml"].count("labels ['negative', 'positive']") >= 2


class MaskedFormat(prepare.RecordFormat):
    """A format of the shape chat needs: ids and a per-token mask, ragged rows, and a finish step that
    plans over the whole split (here: rows by decreasing length)."""
    prefix, version = "masked", "masked-v1"
    token_arrays = {"ids": None, "mask": "uint8"}
    row_arrays = {"lengths": "uint32"}

    def fields(self, cfg):
        return (("text", "text"),)

    def job(self, cfg, split, tok_dir, total):
        return str(tok_dir), {"note": "toy"}

    def encode(self, job, piece, writer, progress):
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(job) / "tokenizer.json"))
        for rows, n in readers.rows(piece, (("text", "text"),)):
            encoded = [e.ids for e in tok.encode_batch([r[0] for r in rows], add_special_tokens=False)]
            ids = np.concatenate([np.asarray(e, dtype=np.int64) for e in encoded])
            writer.tokens(ids=ids, mask=ids % 2)
            writer.rows(lengths=[len(e) for e in encoded])
            progress(n)
        return {"documents": writer.counts["rows"]}

    def finish(self, cfg, split, folder, records, done):
        lengths = np.diff(np.load(folder / "offsets.npy"))
        np.save(folder / "plan.npy", np.argsort(-lengths, kind="stable"))
        return {"longest": int(lengths.max())}

    def open(self, cfg, tok_dir, folders):
        return {name: store.TokenStore(folder, "mask") for name, folder in folders.items()}


def test_a_record_format_with_a_mask_rows_and_a_finish_step(tmp_path):
    rows = [{"text": line} for line in SHAKESPEARE.read_text().splitlines() if line.strip()][:3000]
    data = jsonl(tmp_path / "d.jsonl", rows)
    fmt, out = MaskedFormat(), {}
    for workers in (1, 2):  # several pieces; with 2 the pool's processes encode them
        cfg = load_config(None, [f"data.train={data}", f"data.cache_dir={tmp_path / f'c{workers}'}",
                                 "data.vocab_size=300", "data.shard_mb=0.01", "data.val_fraction=0"])
        summary = prepare.prepare(cfg, fmt, workers, progress=False)["train"]
        folder = Path(summary["folder"])
        assert summary["shards"] > 4 and summary["note"] == "toy" and summary["documents"] == len(rows)
        index = layout.read_index(folder)
        assert index["format"] == "masked" and index["longest"] == summary["longest"]
        ids, mask = store.TokenStore(folder), prepare.open_prepared(cfg, fmt)["train"]
        offsets = np.load(folder / "offsets.npy")
        assert len(ids) == len(mask) == offsets[-1] and np.array_equal(mask[0:len(mask)], ids[0:len(ids)] % 2)
        tok = Tokenizer.from_file(str(next((tmp_path / f"c{workers}").glob("tokenizer-*")) / "tokenizer.json"))
        for i in (0, 1, 1234, len(rows) - 1):
            expected = tok.encode(rows[i]["text"], add_special_tokens=False).ids
            assert ids[int(offsets[i]):int(offsets[i + 1])].tolist() == expected
        assert np.load(folder / "plan.npy").shape == (len(rows),)
        out[workers] = {p.name: p.read_bytes() for p in folder.iterdir() if p.suffix in (".bin", ".npy")}
    assert out[1] == out[2]  # byte-identical whatever the number of processes
    # a shard with an array missing is not taken as finished: it is encoded again
    shard = next(p for p in folder.glob("*.mask.bin"))
    shard.unlink()
    (folder / layout.INDEX).unlink()
    prepare.prepare(cfg, fmt, 1, progress=False)
    again = {p.name: p.read_bytes() for p in folder.iterdir() if p.suffix in (".bin", ".npy")}
    assert shard.is_file() and again == out[2]


def test_a_validation_store_follows_the_training_labels(tmp_path):
    """Label ids of the validation split come from the training labels: a changed training file with a new
    label rebuilds the (unchanged) validation split's store, which is memory-mapped by the workers."""
    train = jsonl(tmp_path / "t.jsonl", [{"text": f"text {i}", "label": ("neg", "pos")[i % 2]} for i in range(60)])
    val = jsonl(tmp_path / "v.jsonl", [{"text": f"other {i}", "label": ("pos", "neg")[i % 2]} for i in range(20)])
    raw = tmp_path / "tok-raw"  # a named tokenizer: it stays the same when the training data changes
    toks.save_trained(toks.train_wordpiece(["text other"] * 10, 300), "wordpiece", raw)
    toks.load_saved(raw).save_pretrained(tmp_path / "tok")
    cfg = load_config(None, [*CLASSIFY, f"data.train={train}", f"data.validation={val}",
                             f"data.cache_dir={tmp_path / 'c'}", f"data.tokenizer={tmp_path / 'tok'}"])

    def opened():
        ClassifyTask.prepare_data(cfg, 1, progress=False)
        task = ClassifyTask(cfg, SimpleNamespace(is_local_main=True))
        task.open_data()
        return task

    task = opened()
    assert task.names == ["neg", "pos"] and [task.names[k] for k in task.val_set.labels[:2]] == ["pos", "neg"]
    assert isinstance(task.val_set.ids, store.TokenStore) and isinstance(task.val_set.offsets, np.memmap)
    jsonl(train, [{"text": f"text {i}", "label": ("neg", "pos", "aaa")[i % 3]} for i in range(60)])
    task = opened()
    assert task.names == ["aaa", "neg", "pos"]
    assert [task.names[k] for k in task.val_set.labels[:2]] == ["pos", "neg"]  # new ids, same labels


def test_split_and_piece_plans_name_their_source():
    source = open_source(Split(str(SHAKESPEARE), "data.train", "train"), "auto")
    plan = list(readers.plan(source, (("text", "text"),), 1 << 18))
    assert len(plan) > 3 and {p.source for p in plan} == {str(SHAKESPEARE)} and plan[-1].ends_document
    assert source.size == SHAKESPEARE.stat().st_size
