"""Text classification: exact distributed evaluation, 1 vs 2 process equivalence, pairs and string labels,
predict, and bad input (exit 2, one line). Real processes through the CLI, Gloo on CPU."""
from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import REPO, SST2, assert_same_losses, metrics, phalanx, runs_at

from phalanx.core.config import ConfigError, load_config
from phalanx.data.classify import store as classify_store
from phalanx.tasks.classify import ClassifyTask, classification_metrics

SMALL = ["task=classify", "model.arch=bert", "model.n_layer=2", "model.n_head=2", "model.n_embd=64",
         "data.vocab_size=1000", "classify.max_length=64", "train.micro_batch_size=8", "train.global_batch_size=16",
         "train.log_every=1", "train.eval_every=0", "train.warmup_steps=2", "train.lr=1e-3", "log.progress=lines",
         "dist.threads_per_worker=1"]  # one thread: OpenMP spinning on a busy 2-core machine costs 10x


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def sst2_subset(folder: Path, n: int) -> Path:
    lines = (SST2 / "train.jsonl").read_text(encoding="utf-8").splitlines()[:n]
    path = folder / f"sst2-train-{n}.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def cls_args(run: Path, cache: Path, train: Path, val: Path, *extra, config: str = "") -> list[str]:
    return ["train", *([config] if config else []), f"data.train={train}", f"data.validation={val}",
            f"data.cache_dir={cache}", "--run-dir", str(run), *SMALL, *extra]


def last_eval(run: Path) -> dict:
    return [m for m in metrics(run) if "eval/accuracy" in m][-1]


# ---- 1 vs 2 processes, and exact evaluation of a fixed model at 1, 2, 3 --------------------------------
@pytest.fixture(scope="module")
def sst2_runs(tmp_path_factory, cache_dir):
    """examples/sst2.yaml, smaller, at 1 and 2 processes (grouping and dropout on); eval on all 872 rows."""
    data = tmp_path_factory.mktemp("sst2data")
    train = sst2_subset(data, 480)
    return runs_at(tmp_path_factory, "sst2", lambda run: cls_args(
        run, cache_dir, train, SST2 / "validation.jsonl", "train.max_steps=12", "model.dropout=0.1",
        "data.group_by_length=true", config=str(REPO / "examples" / "sst2.yaml")))


def test_one_and_two_processes_give_the_same_losses_with_grouping(sst2_runs):
    assert_same_losses(sst2_runs[2], sst2_runs[1], 12)
    lines = [m for m in metrics(sst2_runs[2]) if "pad_fraction" in m]
    assert lines and all(0 <= m["pad_fraction"] < 0.2 and m["useful_tokens_per_s"] > 0 for m in lines)
    summary = json.loads((sst2_runs[2] / "summary.json").read_text())
    assert summary["labels"] == ["negative", "positive"] and summary["eval/samples"] == 872
    assert {"eval/per_class", "eval/confusion_matrix", "eval/macro_f1"} <= summary.keys()
    assert sum(map(sum, summary["eval/confusion_matrix"])) == 872


@pytest.fixture(scope="module")
def fixed_model_evals(sst2_runs, tmp_path_factory, cache_dir):
    """The trained 1-process model, loaded as model.pretrained and evaluated (lr=0) at 1, 2 and 3 processes."""
    out = {}
    for n in (1, 2, 3):
        run = tmp_path_factory.mktemp(f"fixed-{n}")
        train = sst2_subset(tmp_path_factory.mktemp("data"), 48)
        phalanx(*cls_args(run, cache_dir, train, SST2 / "validation.jsonl",
                          f"model.pretrained={sst2_runs[1] / 'final'}", "train.lr=0", "train.max_steps=1",
                          "train.global_batch_size=48",
                          config=str(REPO / "examples" / "sst2.yaml")),
                "--nproc-per-node", n, check=True, timeout=180)
        out[n] = last_eval(run)
    return out


def test_eval_of_a_fixed_model_is_identical_at_1_2_3_processes(fixed_model_evals, sst2_runs):
    e1 = fixed_model_evals[1]
    for n in (2, 3):  # 872 = 3 x 290 + 2: uneven shards
        e = fixed_model_evals[n]
        assert e["eval/samples"] == 872
        assert e["eval/accuracy"] == e1["eval/accuracy"] and e["eval/macro_f1"] == e1["eval/macro_f1"]
        assert e["eval/confusion_matrix"] == e1["eval/confusion_matrix"]
        assert e["eval/loss"] == pytest.approx(e1["eval/loss"], rel=1e-6)
    # and it is the trained model (the pretrained folder loaded, nothing changed with lr=0)
    assert e1["eval/accuracy"] == last_eval(sst2_runs[1])["eval/accuracy"]


# ---- multi-class string labels, text pairs, CSV, predict -----------------------------------------------
NLI = ["contradiction", "entailment", "neutral"]


def nli_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    words = "the a film movie story cast plot good bad long short funny dull bright dark".split()
    rows = []
    for _ in range(n):
        premise = " ".join(rng.choices(words, k=rng.randint(3, 20)))
        label = rng.choice(NLI)
        hypothesis = {"entailment": premise.split()[0], "contradiction": "not " + premise.split()[-1],
                      "neutral": " ".join(rng.choices(words, k=rng.randint(2, 6)))}[label]
        rows.append({"premise": premise, "hypothesis": hypothesis, "gold": label})
    return rows


@pytest.fixture(scope="module")
def pair_run(tmp_path_factory, cache_dir):
    folder = tmp_path_factory.mktemp("nli")
    train = write_jsonl(folder / "train.jsonl", nli_rows(160, 0))
    val = write_jsonl(folder / "val.jsonl", nli_rows(37, 1))
    run = folder / "run"
    phalanx(*cls_args(run, cache_dir, train, val, "data.text_field=premise", "classify.text_pair_field=hypothesis",
                      "classify.label_field=gold", "train.max_steps=6"),
            "--nproc-per-node", 2, check=True, timeout=180)
    return SimpleNamespace(run=run, val=val, folder=folder)


def test_text_pairs_with_string_labels_train_and_export(pair_run):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    summary = json.loads((pair_run.run / "summary.json").read_text())
    assert summary["labels"] == NLI and summary["eval/samples"] == 37
    assert set(summary["eval/per_class"]) == set(NLI)
    model = AutoModelForSequenceClassification.from_pretrained(pair_run.run / "final")
    assert model.config.id2label == dict(enumerate(NLI)) and model.config.label2id == {n: i for i, n in enumerate(NLI)}
    tok = AutoTokenizer.from_pretrained(pair_run.run / "final")
    enc = tok("the film", "not dull", return_tensors="pt")
    assert 1 in enc["token_type_ids"][0].tolist()  # the pair's second segment
    assert model(**enc).logits.shape == (1, 3)


def test_predict_two_processes_matches_one_and_keeps_input_order(pair_run):
    out = pair_run.folder / "pred.jsonl"
    phalanx("predict", pair_run.run, "--input", pair_run.val, "--output", out, "--nproc-per-node", 2,
            check=True, timeout=120)
    two = [json.loads(line) for line in out.read_text().splitlines()]
    one = [json.loads(line) for line in phalanx("predict", pair_run.run, "--input", pair_run.val,
                                                 check=True, timeout=120).stdout.splitlines()]
    assert len(one) == len(two) == 37
    for a, b in zip(one, two):
        assert set(a["probabilities"]) == set(NLI) and a["label"] in NLI
        assert sum(a["probabilities"].values()) == pytest.approx(1, abs=1e-4)
        assert a["label"] == max(a["probabilities"], key=a["probabilities"].get)
        for name in NLI:
            assert b["probabilities"][name] == pytest.approx(a["probabilities"][name], abs=1e-5)
    # input order, and the same numbers a plain transformers user gets from final/ row by row
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(pair_run.run / "final").eval()
    tok = AutoTokenizer.from_pretrained(pair_run.run / "final")
    for line, got in zip(pair_run.val.read_text().splitlines(), two):
        row = json.loads(line)
        with torch.no_grad():
            probs = torch.softmax(model(**tok(row["premise"], row["hypothesis"], return_tensors="pt")).logits, -1)[0]
        assert [got["probabilities"][n] for n in NLI] == pytest.approx(probs.tolist(), abs=1e-5)


def test_csv_multiclass_distilbert_trains_and_predicts_text_lines(tmp_path, cache_dir):
    rng = random.Random(3)
    topics = {"sport": "ball goal team", "music": "song band guitar", "food": "bread soup salt",
              "tech": "code chip data"}
    lines = ["text,topic"] + [f"{' '.join(rng.choices(topics[t].split(), k=rng.randint(1, 9)))},{t}"
                              for t in rng.choices(sorted(topics), k=120)]
    (tmp_path / "train.csv").write_text("\n".join(lines[:101]) + "\n")
    (tmp_path / "val.csv").write_text("\n".join(lines[:1] + lines[101:]) + "\n")
    run = tmp_path / "run"
    phalanx(*cls_args(run, cache_dir, tmp_path / "train.csv", tmp_path / "val.csv", "model.arch=distilbert",
                      "classify.label_field=topic", "train.max_steps=4"), check=True, timeout=180)
    assert json.loads((run / "summary.json").read_text())["labels"] == sorted(topics)
    (tmp_path / "new.txt").write_text("goal team\n\nsoup bread salt\nchip\n")
    out = phalanx("predict", run, "--input", tmp_path / "new.txt", check=True).stdout.splitlines()
    assert len(out) == 3 and all(json.loads(o)["label"] in topics for o in out)


# ---- bad input: exit 2, one line naming the file and line, before any worker starts ----------------------
def _bad_cases(t: Path):
    ok = write_jsonl(t / "ok.jsonl", [{"text": "good", "label": 1}, {"text": "bad", "label": 0}])
    return {
        "missing text field": (write_jsonl(t / "a.jsonl", [{"sentence": "x", "label": 0}]), ok,
                               "a.jsonl' line 1: missing field 'text'"),
        "missing label field": (write_jsonl(t / "b.jsonl", [{"text": "x", "label": 0}, {"text": "y", "label": 1},
                                                            {"text": "z"}]), ok,
                                "b.jsonl' line 3: missing field 'label'"),
        "empty file": (_write(t / "c.jsonl", b""), ok, "c.jsonl': no rows (empty file)"),
        "malformed JSON line": (_write(t / "d.jsonl", b'{"text": "x", "label": 0}\n{"text": "y", "label": \n'),
                                ok, "d.jsonl' line 2: malformed JSON"),
        "non-UTF-8": (_write(t / "e.jsonl", b'{"text": "x", "label": 0}\n{"text": "\xff\xfe", "label": 1}\n'),
                      ok, "e.jsonl' line 2: not valid UTF-8"),
        "unknown validation label": (ok, write_jsonl(t / "f.jsonl", [{"text": "x", "label": 1},
                                                                     {"text": "y", "label": 7}]),
                                     "f.jsonl' line 2: label 7 is not one of the labels of the training data"),
        "float label": (write_jsonl(t / "g.jsonl", [{"text": "x", "label": 0.5}]), ok,
                        "g.jsonl' line 1: field 'label' should be an integer or a string label"),
    }


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("case", ["missing text field", "missing label field", "empty file", "malformed JSON line",
                                  "non-UTF-8", "unknown validation label", "float label"])
def test_bad_input_exits_2_with_one_line(case, tmp_path):
    train, val, fragment = _bad_cases(tmp_path)[case]
    proc = phalanx("train", "task=classify", "model.arch=bert", f"data.train={train}", f"data.validation={val}",
                   "--run-dir", tmp_path / "run", "--nproc-per-node", 2, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert fragment in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "phalanx: task" not in proc.stdout  # no worker started


def test_predict_bad_input_exits_2(pair_run, tmp_path):
    bad = write_jsonl(tmp_path / "in.jsonl", [{"premise": "a"}])  # no hypothesis
    proc = phalanx("predict", pair_run.run, "--input", bad, "--nproc-per-node", 2, timeout=60)
    assert proc.returncode == 2 and "in.jsonl' line 1: missing field 'hypothesis'" in proc.stderr


# ---- in-process units ----------------------------------------------------------------------------------
def test_classification_metrics_match_hand_computed():
    conf = np.array([[5, 1, 0], [2, 3, 0], [0, 0, 0]])  # class 2 neither true nor predicted
    m = classification_metrics(conf, ["a", "b", "c"])
    p_a, r_a, p_b, r_b = 5 / 7, 5 / 6, 3 / 4, 3 / 5
    f_a, f_b = 2 * p_a * r_a / (p_a + r_a), 2 * p_b * r_b / (p_b + r_b)
    assert m["eval/accuracy"] == pytest.approx(8 / 11) and m["eval/samples"] == 11
    assert m["eval/macro_f1"] == pytest.approx((f_a + f_b) / 2)  # absent class left out, as scikit-learn
    assert m["eval/per_class"]["b"] == pytest.approx({"precision": p_b, "recall": r_b, "f1": f_b, "support": 5})
    assert m["eval/confusion_matrix"] == conf.tolist()


def test_label_names_discovered_sorted_or_configured():
    def seen(*values):
        return [(v, lambda i=i: f"row {i + 1}") for i, v in enumerate(values)]
    assert classify_store.label_names(seen(10, 2, 7), []) == ["2", "7", "10"]  # numeric order, not string order
    names = ["2", "7", "10"]
    assert [classify_store.class_lookup(names, False, int)[v] for v in (10, 2, 2, 7)] == [2, 0, 0, 1]
    assert classify_store.label_names(seen("pos", "neg"), []) == ["neg", "pos"]
    assert [classify_store.class_lookup(["pos", "neg"], True, str)[v] for v in ("pos", "neg", 1)] == [0, 1, 1]
    with pytest.raises(ConfigError, match="at least 2 labels"):
        classify_store.label_names(seen("pos"), [])
    with pytest.raises(ConfigError, match="row 2: label 'one' mixes integer and string"):
        classify_store.label_names(seen(1, "one"), [])


def test_streamed_store_matches_transformers_encoding_and_holds_out_the_last_rows(tmp_path, cache_dir):
    """Rows in many tiny pieces (2 encoding processes): ids equal the transformers tokenizer's on each row,
    labels and lengths follow the rows, and without data.validation the last rows are held out."""
    rows = [json.loads(line) for line in (SST2 / "train.jsonl").read_text().splitlines()[:600]]
    train = write_jsonl(tmp_path / "t.jsonl", rows)
    cfg = load_config(None, [*SMALL, f"data.train={train}", "data.val_fraction=0.25", "data.shard_mb=0.003",
                             f"data.cache_dir={tmp_path / 'c'}"])
    ClassifyTask.prepare_data(cfg, workers=2, progress=False)
    task = ClassifyTask(cfg, SimpleNamespace(is_local_main=True))
    task.open_data()
    assert len(task.train_set) == 450 and len(task.val_set) == 150
    index = json.loads(next((tmp_path / "c").glob("classify-*/index.json")).read_text())  # one store: train
    assert len(index["shards"]) > 10
    enc = task.tokenizer([r["text"] for r in rows], truncation=True, max_length=64)["input_ids"]
    for split, offset in ((task.train_set, 0), (task.val_set, 450)):
        for i in range(len(split)):
            assert split.example(i)[0].tolist() == enc[offset + i]
            assert task.names[split.labels[i]] == str(rows[offset + i]["label"])


@pytest.mark.parametrize("arch", ["bert", "roberta", "distilbert"])
def test_each_arch_pads_dynamically_truncates_and_takes_pairs(arch, tmp_path, cache_dir):
    rows = [{"a": " ".join(["word"] * k), "b": "other words", "y": k % 2} for k in (1, 3, 40, 2, 5, 4)]
    train = write_jsonl(tmp_path / "t.jsonl", rows)
    cfg = load_config(None, [*SMALL, f"model.arch={arch}", f"data.train={train}", f"data.validation={train}",
                             "data.text_field=a", "classify.text_pair_field=b", "classify.label_field=y",
                             "classify.max_length=16", f"data.cache_dir={cache_dir}"])
    task = ClassifyTask(cfg, SimpleNamespace(is_local_main=True))
    task.open_data()
    assert max(task.train_set.lengths) == 16  # truncated
    batch = task.collate(task.train_set, [0, 1])  # short ones: padded to their own longest only
    assert batch["input_ids"].shape[1] == max(task.train_set.lengths[:2]) < 16
    assert task.useful_tokens(batch) == sum(task.train_set.lengths[:2])
    assert ("token_type_ids" in batch) == (arch == "bert")
    torch.manual_seed(0)
    model = task.build_model()
    loss = task.loss_sum(model, task.collate(task.train_set, range(6)))
    assert torch.isfinite(loss) and task.target_count(batch) == 2
