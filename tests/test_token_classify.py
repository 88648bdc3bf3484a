"""Token classification: formats and bad input, alignment (WordPiece, byte-level BPE), windows (every word
once), 1 vs 2 processes with accumulation, metrics equal to seqeval on 1, 2 and 3 processes, predict, export.
Real processes through the CLI (Gloo on CPU) on tiny encoders built from transformers configs, with the real
all-MiniLM-L6-v2 tokenizer (WordPiece) and WNUT 2017 sentences."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import DATA, REPO, metrics, phalanx, train_losses

from phalanx.core.config import ConfigError, load_config
from phalanx.data import prepare, readers
from phalanx.data.tokcls import labels as tag_names
from phalanx.data.tokcls import windows as win
from phalanx.data.tokcls.store import TOKCLS, TaggedSet

WNUT = DATA / "wnut17"
MINILM = REPO.parent / "shared" / "models" / "all-minilm-l6-v2"


# ---- fixtures: tiny encoders, small data ------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory) -> Path:
    """A 2-layer BERT (hidden 32) with MiniLM's real WordPiece tokenizer, saved as a bare encoder (no head: the
    run adds one), dropout on."""
    import torch
    from transformers import BertConfig, BertModel

    folder = tmp_path_factory.mktemp("tiny-bert")
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.1)
              ).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(MINILM / name, folder / name)
    return folder


def byte_level_tokenizer(folder: Path):
    """A RoBERTa-style byte-level BPE (<s> ... </s>, no prefix space as saved) trained on WNUT words."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    from phalanx.data import tokenizer as toks

    text = (WNUT / "wnut17train.conll").read_text(encoding="utf-8")
    words = " ".join(line.split("\t")[0] for line in text.splitlines()[:20000] if "\t" in line)
    raw = toks.train_bpe([words], 600)
    raw.add_special_tokens(["<s>", "</s>", "<pad>"])
    raw.post_processor = processors.RobertaProcessing(("</s>", raw.token_to_id("</s>")),
                                                      ("<s>", raw.token_to_id("<s>")), add_prefix_space=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<|endoftext|>", cls_token="<s>", sep_token="</s>")
    tok.save_pretrained(folder)
    return tok


def conll_text(sentences: list[tuple[list[str], list[str]]]) -> str:
    return "".join("".join(f"{w}\t{t}\n" for w, t in zip(words, tags)) + "\n" for words, tags in sentences)


def wnut(name: str, n: int, skip: int = 0) -> list[tuple[list[str], list[str]]]:
    text = (WNUT / name).read_text(encoding="utf-8")
    found = readers.conll_sentences(text, (0, -1, "auto"), str, 0)
    return [(w, t) for w, t, _ in found[skip:skip + n]]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """64 WNUT training sentences; 41 validation sentences: 40 dev ones and one of 10 dev sentences joined
    (longer than the 32-subword window, so it is split)."""
    folder = tmp_path_factory.mktemp("tokcls-data")
    dev = wnut("emerging.dev.conll", 50)
    long = ([w for s in dev[40:50] for w in s[0]], [t for s in dev[40:50] for t in s[1]])
    val = dev[:20] + [long] + dev[20:40]
    (folder / "train.conll").write_text(conll_text(wnut("wnut17train.conll", 64)), encoding="utf-8")
    (folder / "val.conll").write_text(conll_text(val), encoding="utf-8")
    return folder, val


def small(tiny: Path, folder: Path, cache: Path, run: Path, *extra) -> list:
    return ["train", "task=token_classify", f"model.pretrained={tiny}", f"data.train={folder / 'train.conll'}",
            f"data.validation={folder / 'val.conll'}", f"data.cache_dir={cache}", "--run-dir", str(run),
            "token_classify.max_length=32", "token_classify.stride=8", "train.micro_batch_size=4",
            "train.global_batch_size=8", "train.log_every=1", "train.eval_every=0", "train.warmup_steps=1",
            "train.lr=3e-4", "log.progress=lines", "dist.threads_per_worker=1", *extra]


def cfg_for(tiny: Path, train: Path, val: Path | None, cache: Path, *extra):
    items = [f"data.{k}={v}" for k, v in (("train", train), ("validation", val or ""), ("cache_dir", cache))]
    return load_config(None, ["task=token_classify", f"model.pretrained={tiny}", "token_classify.max_length=32",
                              "token_classify.stride=8", *items, *extra])


# ---- formats ----------------------------------------------------------------------------------------------
def test_conll_blank_lines_docstart_and_separators(tmp_path, tiny_bert, cache_dir):
    """A BOM, a line of only a zero-width space or a BOM, a line of one tab, -DOCSTART-; a word holding a space
    (tab separator); the same sentences from JSONL with string tags, and with integer tags + names: one store."""
    raw = ("\ufeff-DOCSTART-\tO\n\nNew York\tB-LOC\nrocks\tO\n\u200b\nPeter\tB-PER\nBlackburn\tI-PER\n\t\n"
           "\ufeff\nvisits\tO\nParis\tB-LOC\n")
    (tmp_path / "a.conll").write_text(raw, encoding="utf-8")
    found = readers.conll_sentences(raw.removeprefix("\ufeff"), (0, -1, "auto"), str, 0)
    sentences = [["New York", "rocks"], ["Peter", "Blackburn"], ["visits", "Paris"]]
    assert [w for w, _, _ in found] == sentences
    assert "\u200b".strip() and "\ufeff".strip() and readers.is_blank("\u200b\ufeff ")  # control: strip() keeps them
    tags = [["B-LOC", "O"], ["B-PER", "I-PER"], ["O", "B-LOC"]]
    names = ["O", "B-LOC", "B-PER", "I-PER"]
    (tmp_path / "s.jsonl").write_text("".join(json.dumps({"tokens": w, "ner_tags": t}) + "\n"
                                              for w, t in zip(sentences, tags)), encoding="utf-8")
    (tmp_path / "i.jsonl").write_text("".join(json.dumps({"words": w, "tags": [names.index(x) for x in t]}) + "\n"
                                              for w, t in zip(sentences, tags)), encoding="utf-8")
    import datasets  # a hub-style dataset (a local folder as hf:) whose integer tags are named by its features

    features = datasets.Features({"tokens": datasets.Sequence(datasets.Value("string")),
                                  "ner_tags": datasets.Sequence(datasets.ClassLabel(names=names))})
    (tmp_path / "hub").mkdir()
    datasets.Dataset.from_dict({"tokens": sentences, "ner_tags": [[names.index(x) for x in t] for t in tags]},
                               features=features).to_parquet(str(tmp_path / "hub" / "train.parquet"))
    stores = {}
    for name, extra in (("a.conll", []), ("s.jsonl", []),
                        ("i.jsonl", ["token_classify.tokens_field=words", "token_classify.tags_field=tags",
                                     f"token_classify.labels=[{','.join(names)}]"]), ("hf:", [])):
        train = f"hf:{tmp_path / 'hub'}" if name == "hf:" else tmp_path / name
        cfg = cfg_for(tiny_bert, train, None, cache_dir, "data.val_fraction=0", *extra)
        summary = prepare.prepare(cfg, TOKCLS, workers=1, progress=False)["train"]
        assert (summary["sentences"], summary["words"], summary["labels"], summary["scheme"]) == (3, 6, names, "IOB2")
        data = prepare.open_prepared(cfg, TOKCLS)
        stores[name] = [np.asarray(data.train.example(i)[0]).tolist() for i in range(3)], data.train.gold()
    assert stores["a.conll"][0] == stores["s.jsonl"][0] == stores["i.jsonl"][0] == stores["hf:"][0]
    gold = [[names[i] for i in g] for g in stores["a.conll"][1]]
    for other in ("i.jsonl", "hf:"):
        assert gold == tags and [g.tolist() for g in stores[other][1]] == [g.tolist() for g in stores["a.conll"][1]]


def test_conll_pieces_cut_only_between_sentences(tmp_path):
    """A CoNLL file planned into pieces of ~300 bytes: each piece starts after a blank line (WNUT's train file
    ends sentences with a lone tab), and the pieces' sentences are the file's."""
    from phalanx.data import readers, sources

    path = tmp_path / "train.conll"
    shutil.copy(WNUT / "wnut17train.conll", path)
    source = sources.open_source(sources.Split(str(path), "data.train", "train"), "auto")
    fields = (("tokens", "words"), ("ner_tags", "tags"), ((0, -1, "auto"), "columns"))
    planned = list(readers.plan(source, fields, 300))[:40]
    assert len(planned) == 40 and all(p.kind == "conll" for p in planned)
    got = [(list(r[0]), list(r[1])) for p in planned for rows, _ in readers.rows(p, fields) for r in rows]
    assert got == wnut("wnut17train.conll", len(got)) and len(got) > 40
    raw = path.read_bytes()
    assert all(raw[p.start - 2:p.start] in (b"\n\n", b"\t\n") for p in planned[1:])


def test_a_tokenizer_trained_here_learns_the_words(tmp_path, cache_dir):
    """Without a pretrained model a WordPiece is trained on the training words (not on nothing: then every
    subword would be [UNK])."""
    (tmp_path / "t.conll").write_text(conll_text(wnut("wnut17train.conll", 300)), encoding="utf-8")
    cfg = load_config(None, ["task=token_classify", "model.arch=bert", "data.vocab_size=400",
                             f"data.train={tmp_path / 't.conll'}", f"data.cache_dir={cache_dir}"])
    prepare.prepare(cfg, TOKCLS, workers=1, progress=False)
    data = prepare.open_prepared(cfg, TOKCLS)
    ids = np.concatenate([np.asarray(data.train.example(i)[0]) for i in range(len(data.train))])
    from tokenizers import Tokenizer
    unk = Tokenizer.from_file(str(data.tokenizer_dir / "tokenizer.json")).token_to_id("[UNK]")
    assert (ids == unk).mean() < 0.05


def test_label_order_and_scheme():
    assert tag_names.ordered(["I-PER", "O", "B-PER", "B-LOC", "I-LOC"]) == ["O", "B-LOC", "I-LOC", "B-PER", "I-PER"]
    names = ["O", "B-PER", "I-PER"]
    assert tag_names.scheme(names, 0) == "IOB2" and tag_names.scheme(names, 1) == "IOB1"
    assert tag_names.inside_starts(["O", "I-PER", "I-PER", "B-PER", "I-LOC"]) == 2
    assert tag_names.scheme(["O", "S-PER", "B-PER", "E-PER"], 0) == "BIOES"
    assert tag_names.scheme(["NOUN", "VERB"], 0) == "plain"
    assert tag_names.continuation(["O", "B-PER", "I-PER", "B-LOC"]) == [0, 2, 2, 3]


def _bad(t: Path) -> dict:
    ok = t / "ok.conll"
    ok.write_text("a\tO\nb\tB-X\n", encoding="utf-8")

    def put(name: str, text: str) -> Path:
        (t / name).write_text(text, encoding="utf-8")
        return t / name
    return {
        "no separator": (put("a.conll", "w\tO\nx\tB-X\n\nlonely\ny\tO\n"), ok,
                         "a.conll' line 4: a word without a tag ('lonely': no tab or space separator)"),
        "length mismatch": (put("b.jsonl", '{"tokens": ["a"], "ner_tags": ["O"]}\n'
                                           '{"tokens": ["a", "b"], "ner_tags": ["O"]}\n'), ok,
                            "b.jsonl' line 2: field 'tokens' has 2 words but field 'ner_tags' has 1 tags"),
        "empty sentence": (put("c.jsonl", '{"tokens": [], "ner_tags": []}\n'), ok,
                           "c.jsonl' line 1: field 'tokens' is empty (an empty sentence)"),
        "integer tags without names": (put("d.jsonl", '{"tokens": ["a", "b"], "ner_tags": [0, 1]}\n'), ok,
                                       "config key 'token_classify.labels': the tags are integers"),
    }


@pytest.mark.parametrize("case", ["no separator"])
def test_bad_input_exits_2_naming_file_and_line(case, tmp_path):
    train, val, fragment = _bad(tmp_path)[case]
    proc = phalanx("train", "task=token_classify", "model.arch=bert", f"data.train={train}",
                   f"data.validation={val}", f"data.cache_dir={tmp_path / 'cache'}", "--run-dir", tmp_path / "run",
                   "--nproc-per-node", 2, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert fragment in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "phalanx: task" not in proc.stdout  # no worker started


@pytest.mark.parametrize("case", ["no separator", "length mismatch", "empty sentence", "integer tags without names"])
def test_bad_input_in_the_data_step_names_file_and_line(case, tmp_path, tiny_bert, cache_dir):
    """The launcher's data step, in process (the case above shows such an error is exit 2 before any worker)."""
    train, val, fragment = _bad(tmp_path)[case]
    with pytest.raises(ConfigError) as e:
        prepare.prepare(cfg_for(tiny_bert, train, val, cache_dir), TOKCLS, workers=1, progress=False)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_a_window_longer_than_the_encoder_is_refused(tiny_bert):
    from phalanx.tasks.token_classify import TokenClassifyTask

    TokenClassifyTask.check_config(load_config(None, ["task=token_classify", f"model.pretrained={tiny_bert}",
                                                      "token_classify.max_length=64"]))  # its 64 positions
    with pytest.raises(ConfigError, match="'token_classify.max_length': 65 is more than the 64 positions"):
        TokenClassifyTask.check_config(load_config(None, ["task=token_classify", f"model.pretrained={tiny_bert}",
                                                          "token_classify.max_length=65"]))


def test_unknown_validation_tag_is_counted_and_scored_as_missed(tmp_path, tiny_bert, cache_dir):
    (tmp_path / "t.conll").write_text("a\tO\nb\tB-X\nc\tI-X\n", encoding="utf-8")
    (tmp_path / "v.conll").write_text("a\tO\nb\tB-NEW\nc\tI-NEW\n\nd\tB-X\n", encoding="utf-8")
    cfg = cfg_for(tiny_bert, tmp_path / "t.conll", tmp_path / "v.conll", cache_dir)
    summary = prepare.prepare(cfg, TOKCLS, workers=1, progress=False)["validation"]
    assert summary["unknown_tags"] == {"B-NEW": 1, "I-NEW": 1}
    data = prepare.open_prepared(cfg, TOKCLS)
    assert data.gold_names == ["O", "B-X", "I-X", "B-NEW", "I-NEW"] and data.names == ["O", "B-X", "I-X"]


# ---- alignment ------------------------------------------------------------------------------------------------
def _first_subwords_by_transformers(tok, words: list[str]) -> tuple[list[int], list[int]]:
    """transformers' ids with is_split_into_words, and each word's first subword position (word_ids())."""
    enc = tok(words, is_split_into_words=True)
    seen, out = set(), []
    for pos, w in enumerate(enc.word_ids()):
        if w is not None and w not in seen:
            seen.add(w)
            out.append(pos)
    return enc["input_ids"], out


def test_wordpiece_alignment_labels_first_subwords_like_transformers(tiny_bert):
    """The real MiniLM WordPiece: 'Pietersen', "don't", 'Ixtapa' split into several subwords; our window equals
    transformers' encoding with is_split_into_words, labels on first subwords, B- -> I- for the rest on request."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MINILM)
    words = ["On", "the", "18th", "Kevin", "Pietersen", "don't", "visit", "\u200b", "Ixtapa"]
    tags = [0, 0, 0, 1, 2, 0, 0, 0, 3]  # O O O B-PER I-PER O O O B-LOC
    backend = win.unpadded(tok.backend_tokenizer)  # its tokenizer.json pads to 128
    specials = win.specials_of(backend)
    pieces = win.word_pieces(backend, [words], specials.unk)[0]
    assert all(len(p) >= 1 for p in pieces) and pieces[7].tolist() == [tok.unk_token_id]  # no word dropped
    (w,) = win.windows(pieces, tags, specials, 64, 8)
    ids, firsts = _first_subwords_by_transformers(tok, words)  # the normalizer empties word 7: no subword there
    keep = w.words != 7
    assert w.ids[keep].tolist() == ids
    ours = np.flatnonzero(w.words[keep] >= 0)  # first subwords, positions without the unknown token
    assert ours.tolist() == firsts
    owned = np.flatnonzero(w.words >= 0)
    assert w.words[owned].tolist() == list(range(len(words)))
    assert [len(p) for p in pieces] == [1, 1, 1, 1, 2, 3, 1, 1, 3]
    from phalanx.tasks.token_classify import IGNORE
    labels = np.full(len(w.ids), IGNORE)
    labels[owned] = np.asarray(tags)
    assert labels.tolist().count(IGNORE) == len(w.ids) - len(words)
    later = np.flatnonzero(w.words == win.CONTINUED)
    assert len(later) == sum(len(p) - 1 for p in pieces) and (w.tags[later] >= 0).all()
    cont = np.asarray(tag_names.continuation(["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]))
    assert cont[w.tags[later]].tolist() == [2, 0, 0, 4, 4]  # Pietersen's later subword I-PER; Ixtapa's I-LOC


def test_byte_level_bpe_gets_add_prefix_space(tmp_path, cache_dir):
    """A byte-level BPE saved without add_prefix_space: the prepared tokenizer has it, so a word is encoded as it
    is inside a sentence (with its space); without it the ids differ (control)."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    folder = tmp_path / "bpe"
    byte_level_tokenizer(folder)
    (tmp_path / "t.conll").write_text(conll_text(wnut("wnut17train.conll", 20)), encoding="utf-8")
    cfg = load_config(None, ["task=token_classify", "model.arch=roberta", f"data.tokenizer={folder}",
                             f"data.train={tmp_path / 't.conll'}", f"data.cache_dir={cache_dir}", "model.n_layer=1",
                             "model.n_head=2", "model.n_embd=32"])
    prepare.prepare(cfg, TOKCLS, workers=1, progress=False)
    tok_dir = prepare.tokenizer_folder(cfg, TOKCLS)
    ours = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    plain = Tokenizer.from_file(str(folder / "tokenizer.json"))
    words = ["the", "world", "is", "big"]
    specials = win.specials_of(ours)
    pieces = win.word_pieces(ours, [words], specials.unk)[0]
    # each word as it is inside the sentence: with the space before it (the first one too, as a prefix space)
    reference = plain.encode(" the world is big", add_special_tokens=False).ids
    assert np.concatenate(pieces).tolist() == reference
    assert np.concatenate(win.word_pieces(plain, [words], 0)[0]).tolist() != reference  # control: no prefix space
    (w,) = win.windows(pieces, [0, 0, 0, 0], specials, 32, 8)
    assert w.ids[0] == ours.token_to_id("<s>") and w.ids[-1] == ours.token_to_id("</s>")
    saved = AutoTokenizer.from_pretrained(tok_dir)  # what RUN/final saves and transformers loads
    assert saved(words, is_split_into_words=True)["input_ids"] == w.ids.tolist()
    import torch

    from phalanx.tasks.token_classify import TokenClassifyTask
    model = TokenClassifyTask.model_for(cfg, ours.get_vocab_size(), ours.token_to_id("<pad>"), ["O", "B-X", "I-X"])
    assert type(model).__name__ == "RobertaForTokenClassification"
    assert model(input_ids=torch.tensor([w.ids])).logits.shape == (1, len(w.ids), 3)


# ---- windows ----------------------------------------------------------------------------------------------
def test_windows_predict_every_word_once_with_the_most_context():
    rng = np.random.default_rng(0)
    for trial in range(40):
        counts = rng.integers(1, 6, size=int(rng.integers(1, 400))).tolist()
        if trial == 0:
            counts[5] = 70  # one word longer than a window: cut, still owned
        budget, stride = int(rng.integers(8, 40)), int(rng.integers(0, 20))
        plan = win.plan(counts, budget, stride)
        owned = [i for _, _, lo, hi in plan for i in range(lo, hi)]
        assert owned == list(range(len(counts)))  # each word once, in order
        pos = np.concatenate([[0], np.cumsum(counts)])
        for a, b, lo, hi in plan:
            assert b - a == 1 or pos[b] - pos[a] <= budget
            for i in range(lo, hi):  # no other window gives word i more context on its shorter side
                mine = min(pos[i] - pos[a], pos[b] - pos[i + 1])
                assert all(min(pos[i] - pos[a2], pos[b2] - pos[i + 1]) <= mine
                           for a2, b2, _, _ in plan if a2 <= i < b2)
        for (a, b, _, _), (a2, _, _, _) in zip(plan, plan[1:]):
            assert a < a2 <= b  # consecutive windows overlap or touch, always move on
    # control: truncation at the window (the Trainer recipe) predicts only the words that fit
    counts = [2] * 100
    truncated = sum(1 for p in np.cumsum(counts) if p <= 30)
    assert truncated < 100 and len([1 for _, _, lo, hi in win.plan(counts, 30, 8) for _ in range(lo, hi)]) == 100


# ---- training: 1 vs 2 processes, metrics = seqeval at 1, 2, 3, predict, export ------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_bert, data, cache_dir):
    """6 steps at 1 process (accumulation 2) and at 2 processes (none); the 1-process model then evaluated at 3
    processes (lr 0, one step)."""
    folder, _ = data
    out = {}
    for n in (1, 2):
        run = tmp_path_factory.mktemp(f"tokcls-{n}")
        phalanx(*small(tiny_bert, folder, cache_dir, run, "train.max_steps=6"), "--nproc-per-node", n, check=True,
                timeout=240)
        out[n] = run
    run = tmp_path_factory.mktemp("tokcls-fixed-3")
    phalanx(*small(tiny_bert, folder, cache_dir, run, f"model.pretrained={out[1] / 'final'}", "train.lr=0",
                   "train.max_steps=1", "train.micro_batch_size=2", "train.global_batch_size=6"),
            "--nproc-per-node", 3, check=True, timeout=240)
    out[3] = run
    return out


def last_eval(run: Path) -> dict:
    return [m for m in metrics(run) if "eval/f1" in m][-1]


def test_one_and_two_processes_with_accumulation_give_the_same_losses(runs):
    l1, l2 = train_losses(runs[1]), train_losses(runs[2])
    assert sorted(l1) == list(range(1, 7)) and sorted(l2) == sorted(l1)
    for step in l1:
        assert l2[step] == pytest.approx(l1[step], rel=1e-5), f"step {step}"
    assert len(set(round(v, 6) for v in l1.values())) > 1  # it trains
    summary = json.loads((runs[1] / "summary.json").read_text())
    assert summary["grad_accum"] == 2 and summary["scheme"] == "IOB2" and summary["labels"][0] == "O"


def test_metrics_equal_seqeval_on_the_gathered_words_at_1_2_3_processes(runs, data):
    """The eval figures at 1, 2 and 3 processes (41 sentences, one of them in windows: the 2- and 3-rank shards
    cut between windows) equal seqeval run here on the exported model's word predictions (the 3-process run
    evaluates the 1-process model unchanged)."""
    import torch
    from seqeval import metrics as sq
    from seqeval.scheme import IOB2

    from phalanx.model.build import load_token_classifier
    from phalanx.tasks.token_classify import tag_sentences

    _, val = data
    y_true = [t for _, t in val]
    for evaluated, model_run in ((runs[1], runs[1]), (runs[2], runs[2]), (runs[3], runs[1])):
        model, tok = load_token_classifier(model_run / "final")
        tagged = tag_sentences(model, tok, [w for w, _ in val], 32, 8, 16, torch.device("cpu"))
        names = [model.config.id2label[i] for i in range(model.config.num_labels)]
        y_pred = [[names[i] for i in ids] for ids, _ in tagged]
        assert len({t for p in y_pred for t in p}) > 3  # varied predictions: their order shows in the figures
        expected = {"eval/f1": sq.f1_score(y_true, y_pred), "eval/precision": sq.precision_score(y_true, y_pred),
                    "eval/recall": sq.recall_score(y_true, y_pred), "eval/accuracy": sq.accuracy_score(y_true, y_pred),
                    "eval/strict_f1": sq.f1_score(y_true, y_pred, mode="strict", scheme=IOB2)}
        # control: the same predictions with the first sentence's words gathered last score otherwise
        flat = [t for p in y_pred for t in p]
        flat = flat[len(y_pred[0]):] + flat[:len(y_pred[0])]
        cuts = np.cumsum([0] + [len(t) for t in y_true])
        moved = [flat[a:b] for a, b in zip(cuts, cuts[1:])]
        assert sq.accuracy_score(y_true, moved) != pytest.approx(expected["eval/accuracy"], abs=1e-9)
        got = last_eval(evaluated)
        assert got["eval/words"] == sum(len(t) for t in y_true) and got["eval/sentences"] == 41
        for key, value in expected.items():
            assert got[key] == pytest.approx(value, abs=1e-12), (evaluated, key)
    assert {k: v for k, v in last_eval(runs[3]).items() if k.startswith("eval/") and k != "eval/loss"} == \
        {k: v for k, v in last_eval(runs[1]).items() if k.startswith("eval/") and k != "eval/loss"}


def test_predict_writes_conll_and_jsonl_with_entities(runs, data, tmp_path):
    _, val = data
    # the first sentence with its tags (one the model has no label for), the others words only
    first = "".join(f"{w}\t{'B-alien' if k == 0 else t}\n" for k, (w, t) in enumerate(zip(*val[0])))
    (tmp_path / "in.conll").write_text(first + "\n" + "".join("".join(f"{w}\n" for w in words) + "\n"
                                                              for words, _ in val[1:]), encoding="utf-8")
    proc = phalanx("predict", runs[1], "--input", tmp_path / "in.conll", "--output", tmp_path / "out.conll",
                   check=True)
    assert "carry tags the model has no label for" in proc.stderr and "B-alien (1)" in proc.stderr
    blocks = (tmp_path / "out.conll").read_text(encoding="utf-8").strip("\n").split("\n\n")
    assert len(blocks) == len(val)
    for block, (words, _) in zip(blocks, val):
        lines = [line.split("\t") for line in block.splitlines()]
        assert [w for w, _ in lines] == words  # every word, the long sentence's too, in order
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"tokens": w}) + "\n" for w, _ in val), encoding="utf-8")
    phalanx("predict", runs[1], "--input", tmp_path / "in.jsonl", "--output", tmp_path / "out.jsonl",
            "--nproc-per-node", 2, check=True)
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["tokens"] for r in rows] == [w for w, _ in val]
    conll_tags = [[line.split("\t")[1] for line in b.splitlines()] for b in blocks]
    assert [r["tags"] for r in rows] == conll_tags  # 2 processes, JSONL == 1 process, CoNLL
    from seqeval.metrics.sequence_labeling import get_entities
    for r in rows:
        assert len(r["scores"]) == len(r["tokens"]) and all(0 < s <= 1 for s in r["scores"])
        spans = get_entities(r["tags"])
        assert [(e["type"], e["start"], e["end"] - 1) for e in r["entities"]] == spans
        assert all(e["words"] == r["tokens"][e["start"]:e["end"]] for e in r["entities"])


def test_export_loads_in_transformers_and_runs_in_the_pipeline(runs):
    from transformers import AutoModelForTokenClassification, AutoTokenizer, pipeline

    final = runs[1] / "final"
    model = AutoModelForTokenClassification.from_pretrained(final)
    summary = json.loads((runs[1] / "summary.json").read_text())
    assert [model.config.id2label[i] for i in range(model.config.num_labels)] == summary["labels"]
    assert model.config.label2id == {n: i for i, n in enumerate(summary["labels"])}
    tagger = pipeline("token-classification", model=model, tokenizer=AutoTokenizer.from_pretrained(final),
                      ignore_labels=[])
    out = tagger("Peter Blackburn visited Paris with New York friends yesterday")
    assert len(out) >= 9 and all(o["entity"] in summary["labels"] for o in out)


def test_eval_stores_each_validation_word_once(data, tiny_bert, cache_dir):
    folder, val = data
    cfg = cfg_for(tiny_bert, folder / "train.conll", folder / "val.conll", cache_dir)
    prepare.prepare(cfg, TOKCLS, workers=1, progress=False)
    validation: TaggedSet = prepare.open_prepared(cfg, TOKCLS).validation
    assert len(validation) > len(val)  # the long sentence is in several windows
    assert sum(len(g) for g in validation.gold()) == sum(len(t) for _, t in val)
    assert int(np.asarray(validation.lengths).max()) <= 32



def test_show_prints_each_word_once_beside_its_subwords_and_label(data, tiny_bert, cache_dir):
    folder, val = data
    cfg = cfg_for(tiny_bert, folder / "val.conll", None, cache_dir, "data.val_fraction=0")
    prepare.prepare(cfg, TOKCLS, workers=1, progress=False)
    shown = TOKCLS.show(cfg, 21).split("--- sentence ")[1:]
    long = shown[20]  # the sentence longer than a window
    assert "[window 1:" in long and long.startswith(f"20 ({len(val[20][0])} words, ")
    labelled = [line.split() for line in long.splitlines()[1:] if line.strip() and not line.startswith("[")
                and not line.rstrip().endswith("-100")]
    assert [row[0] for row in labelled] == val[20][0] and [row[-1] for row in labelled] == val[20][1]


def test_collate_labels_first_subwords_or_all_of_them():
    """A word of three subwords tagged B-PER: labelled on its first subword, or B-PER then I-PER twice with
    label_all_subwords; padding, special tokens and an unknown validation tag (id past the labels) are IGNORE."""
    from types import SimpleNamespace

    from phalanx.tasks.token_classify import IGNORE, TokenClassifyTask

    specials = win.Specials((101,), (102,), 100)
    made = [win.windows(p, t, specials, 32, 8)[0] for p, t in
            (([np.array([5]), np.array([6, 7, 8])], [0, 1]), ([np.array([9])], [3]))]  # id 3: not a model label
    ids = np.concatenate([w.ids for w in made])
    offsets = np.cumsum([0] + [len(w.ids) for w in made])
    labels = np.concatenate([np.where(w.tags >= 0, w.tags, -1) for w in made])
    dataset = TaggedSet(ids, np.concatenate([w.words for w in made]), labels, offsets, np.array([2, 1]),
                        np.array([0, 0]))
    for every, expected in ((False, [IGNORE, 0, 1, IGNORE, IGNORE, IGNORE]), (True, [IGNORE, 0, 1, 2, 2, IGNORE])):
        cfg = load_config(None, ["task=token_classify", f"token_classify.label_all_subwords={str(every).lower()}"])
        task = TokenClassifyTask(cfg, None)
        task.tokenizer, task.names = SimpleNamespace(pad_token_id=0), ["O", "B-PER", "I-PER"]
        task.continued = np.asarray(tag_names.continuation(task.names) + [IGNORE])
        batch = task.collate(dataset, [0, 1])
        assert batch["labels"][0].tolist() == expected
        assert batch["labels"][1].tolist() == [IGNORE] * 6  # tag id 3: no label of the model; padded
        assert batch["owned"][1].tolist() == [False, True, False, False, False, False]
        assert task.target_count(batch) == (4 if every else 2)
