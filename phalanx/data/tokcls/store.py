"""The token classification record format: tagged sentences -> windows (rows) of subword ids, each token's
owned word and tag (per token), built and opened by the one pipeline (prepare.py).

A piece's shard holds every window of its sentences: ids, `words` (the owned word's index in its sentence at
its first subword, windows.CONTINUED at its later subwords, windows.OUTSIDE elsewhere) and `tags` (the raw
tag's code in this shard on every subword of an owned word), with each window's length, owned words and index
in its sentence. Once every shard of the training split exists the label names are fixed
(`token_classify.labels`, or the training tags in labels.ordered's order), the scheme is detected, and each
split gets `labels.npy` (per token: the label id, -1 where nothing is predicted). A validation tag outside the
training labels gets an id after them (the model never predicts it: a missed entity), and is counted.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from phalanx.core.config import Config, ConfigError
from phalanx.data import layout, prepare, readers, store
from phalanx.data.sources import Split, source_identity, splits
from phalanx.data.tokcls import labels as tags
from phalanx.data.tokcls import windows as win


class TaggedSet(store.RaggedRows):
    """Windows stored ragged: window i is tokens offsets[i]:offsets[i+1] of the split's streams (ids, words)
    and of labels (per token); `owned` and `window` per window."""

    def __init__(self, ids, words, labels, offsets: np.ndarray, owned: np.ndarray, window: np.ndarray):
        super().__init__((ids, words), offsets)
        self.ids, self.words, self.labels = ids, words, labels
        self.owned, self.window = owned, window

    def __len__(self) -> int:
        return len(self.owned)

    def example(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.ids[lo:hi], self.words[lo:hi], np.asarray(self.labels[lo:hi])

    def rows(self, lo: int, hi: int) -> TaggedSet:
        return TaggedSet(self.ids, self.words, self.labels, self.offsets[lo:hi + 1], self.owned[lo:hi],
                         self.window[lo:hi])

    def gold(self, n: int | None = None) -> list[np.ndarray]:
        """The label ids of the words each of the first n windows owns, in word order."""
        out = []
        for i in range(len(self) if n is None else n):
            _, words, labels = self.example(i)
            out.append(labels[np.asarray(words) >= 0].astype(np.int64))
        return out

    @classmethod
    def open(cls, folder: Path) -> TaggedSet:
        arr = lambda name: np.load(folder / f"{name}.npy", mmap_mode="r")  # noqa: E731
        return cls(store.TokenStore(folder, "ids"), store.TokenStore(folder, "words"), arr("labels"), arr("offsets"),
                   arr("owned"), arr("window"))


@dataclass
class TaggedData:
    tokenizer_dir: Path
    names: list[str]        # the model's labels, in id order
    gold_names: list[str]   # the validation's: names, then tags only it has
    scheme: str
    train: TaggedSet
    validation: TaggedSet


@dataclass(frozen=True)
class TagJob:
    """What a pool worker needs to encode a piece of sentences (picklable)."""
    tokenizer_dir: str
    max_length: int
    stride: int
    fields: tuple


@lru_cache(maxsize=4)
def _tokenizer(tokenizer_dir: str) -> tuple[Tokenizer, win.Specials]:
    tok = win.unpadded(Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json")))
    return tok, win.specials_of(tok)


def fields_of(cfg: Config) -> readers.Fields:
    t = cfg.token_classify
    return ((t.tokens_field, "words"), (t.tags_field, "tags"), ((t.token_column, t.tag_column, t.separator), "columns"))


def training_rows(cfg: Config, window: np.ndarray) -> int:
    """Windows of the training store used for training: all, or up to the sentence where the last
    data.val_fraction of the windows starts (a sentence's windows stay together)."""
    rows = len(window)
    if cfg.data.validation:
        return rows
    cut = max(1, int(round(rows * (1 - cfg.data.val_fraction))))
    starts = np.flatnonzero(np.asarray(window[cut:]) == 0)
    return cut + int(starts[0]) if len(starts) else rows


def add_prefix_space(folder: Path) -> None:
    """A byte-level BPE (RoBERTa, GPT-2) encodes a word alone as if it began the text; words inside a sentence
    follow a space, so the pre-tokenizer must add one (transformers' add_prefix_space=True)."""
    import json

    path = folder / "tokenizer.json"
    spec = json.loads(path.read_text(encoding="utf-8"))
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    byte_level = [p for p in parts if p.get("type") == "ByteLevel"]
    if not byte_level:
        return
    for p in byte_level:
        p["add_prefix_space"] = True
    path.write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    config = folder / "tokenizer_config.json"  # transformers' own classes read it (RobertaTokenizer)
    if config.is_file():
        values = json.loads(config.read_text(encoding="utf-8"))
        config.write_text(json.dumps({**values, "add_prefix_space": True}, indent=2), encoding="utf-8")


class TokenClassifyFormat(prepare.RecordFormat):
    prefix, version = "tokcls", "tokcls-store-v1"
    tokenizer, needs = "wordpiece", "pad_token"
    token_arrays = {"ids": None, "words": "int32", "tags": "int32"}
    row_arrays = {"lengths": "uint32", "owned": "uint32", "window": "uint32"}

    def tokenizer_variant(self, cfg: Config) -> str:
        return "words-add-prefix-space"

    def adapt_tokenizer(self, cfg: Config, folder: Path) -> None:
        add_prefix_space(folder)

    def fields(self, cfg: Config) -> readers.Fields:
        return fields_of(cfg)

    def settings(self, cfg: Config) -> tuple:
        t, d = cfg.token_classify, cfg.data
        return tuple(t.labels), t.max_length, t.stride, (d.val_fraction if not d.validation else None)

    def identity(self, cfg: Config, split: Split) -> list:
        """A validation split's label ids depend on the training tags: current only while those are unchanged."""
        own = source_identity(split, cfg.data.format)
        return own if split.name == "train" else [own, source_identity(splits(cfg)[0], cfg.data.format)]

    def job(self, cfg: Config, split: Split, tok_dir: Path, total: int) -> tuple[TagJob, dict]:
        t = cfg.token_classify
        return TagJob(str(tok_dir), t.max_length, t.stride, self.fields(cfg)), {}

    def encode(self, job: TagJob, piece: readers.Piece, writer: store.ShardWriter, progress) -> dict:
        tok, specials = _tokenizer(job.tokenizer_dir)
        codes: dict = {}  # raw tag -> its code in this shard
        sentences = words = 0
        for rows, n in readers.rows(piece, job.fields):
            split = [list(r[0]) for r in rows]
            for sentence, subwords, row in zip(split, win.word_pieces(tok, split, specials.unk), rows):
                sentence_codes = [codes.setdefault(t, len(codes)) for t in row[1]]
                made = win.windows(subwords, sentence_codes, specials, job.max_length, job.stride)
                writer.tokens(ids=np.concatenate([w.ids for w in made]), words=np.concatenate([w.words for w in made]),
                              tags=np.concatenate([w.tags for w in made]))
                writer.rows(lengths=[len(w.ids) for w in made], owned=[w.owned for w in made],
                            window=[w.window for w in made])
                sentences, words = sentences + 1, words + len(sentence)
            progress(n)
        return {"documents": sentences, "words": words, "labels": list(codes)}

    def finish(self, cfg: Config, split: Split, folder: Path, records: list[dict], done: dict[str, dict]) -> dict:
        """Label names from the training split, then every token's label id: labels.npy."""
        configured = list(cfg.token_classify.labels)
        train = records if split.name == "train" else done["train"]["shards"]
        kinds = {type(v) for r in train for v in r["labels"]} | {type(v) for r in records for v in r["labels"]}
        if len(kinds) > 1:
            raise ConfigError(f"{_where_first(folder, records, lambda v: isinstance(v, int))}: integer and string "
                              f"tags are mixed in the data")
        if split.name == "train":
            names = configured or (tags.ordered(v for r in records for v in r["labels"]) if str in kinds else None)
            if names is None and split.spec.startswith("hf:"):  # integer tags: the dataset's ClassLabel names
                names = readers.hub_label_names(split.spec, cfg.token_classify.tags_field, split.name)
            if names is None:
                raise ConfigError("config key 'token_classify.labels': the tags are integers; name them in id order "
                                  "(e.g. [O, B-PER, I-PER, ...]) or use data whose features name them")
            if len(set(names)) != len(names) or len(names) < 2:
                raise ConfigError(f"config key 'token_classify.labels': needs at least 2 distinct names, got {names}")
        else:
            names = done["train"]["labels"]
        known = {**{n: i for i, n in enumerate(names)}, **({i: i for i in range(len(names))} if int in kinds else {})}
        gold, unknown = list(names), {}
        out = np.lib.format.open_memmap(folder / "labels.npy", mode="w+", dtype=np.int32,
                                        shape=(sum(r["tokens"] for r in records),))
        at = 0
        for record in records:
            codes, words = (layout.shard_array(folder, record, a) for a in ("tags", "words"))
            ids = []
            for code, value in enumerate(record["labels"]):
                if value in known:
                    ids.append(known[value])
                    continue
                if split.name == "train":
                    raise ConfigError(f"{_where_code(folder, record, code)}: tag {value!r} is not one of "
                                      f"token_classify.labels ({', '.join(map(str, names))[:200]})")
                name = str(value)
                if name not in gold:
                    gold.append(name)
                ids.append(gold.index(name))
                unknown[name] = unknown.get(name, 0) + int(((codes == code) & (words >= 0)).sum())
            table = np.asarray(ids + [-1], dtype=np.int32)  # code -1 (no tag) -> -1
            out[at:at + len(codes)] = table[np.asarray(codes, dtype=np.int64)]
            at += len(codes)
        out.flush()
        for name in ("owned", "window"):  # split-wide row arrays, as offsets.npy
            np.save(folder / f"{name}.npy", np.concatenate(
                [np.asarray(layout.shard_array(folder, r, name), dtype=np.int64) for r in records] or [np.zeros(0)]))
        extras = {"sentences": sum(r["documents"] for r in records), "words": sum(r["words"] for r in records),
                  "windows": sum(r["rows"] for r in records)}
        if split.name == "train":
            window = np.load(folder / "window.npy")
            extras.update(labels=names, scheme=tags.scheme(names, _inside_starts(folder, records, names)))
            if not cfg.data.validation:
                extras["held_out_windows"] = len(window) - training_rows(cfg, window)
        else:
            extras.update(gold_labels=gold, **({"unknown_tags": unknown} if unknown else {}))
        return extras

    def show(self, cfg: Config, n: int) -> str:
        """`phalanx prepare --show N`."""
        return show(cfg, n)

    def open(self, cfg: Config, tok_dir: Path, folders: dict[str, Path]) -> TaggedData:
        index = layout.read_index(folders["train"])
        names, scheme = index["labels"], index["scheme"]
        train = TaggedSet.open(folders["train"])
        if "validation" in folders:
            gold = layout.read_index(folders["validation"])["gold_labels"]
            return TaggedData(tok_dir, names, gold, scheme, train, TaggedSet.open(folders["validation"]))
        cut = training_rows(cfg, train.window)
        return TaggedData(tok_dir, names, names, scheme, train.rows(0, cut), train.rows(cut, len(train)))


TOKCLS = TokenClassifyFormat()


def _inside_starts(folder: Path, records: list[dict], names: list[str]) -> int:
    """I-X tags that start an entity (after O, another type or a sentence start) in the training words: IOB1's
    mark (labels.scheme). Every word is owned once, and word 0 of each sentence starts it."""
    words = np.concatenate([np.asarray(layout.shard_array(folder, r, "words")) for r in records])
    first = words >= 0
    label = np.load(folder / "labels.npy", mmap_mode="r")[first]
    split = [tags.split_tag(n) for n in names]
    prefix, kind = np.asarray([p for p, _ in split]), np.asarray([k for _, k in split])
    p, k = prefix[label], kind[label]
    starts = words[first] == 0
    before_p, before_k = np.roll(p, 1), np.roll(k, 1)
    return int(((p == "I") & (starts | ~np.isin(before_p, ["B", "I"]) | (before_k != k))).sum())


def _where_code(folder: Path, record: dict, code: int) -> str:
    """Where the first word with tag code `code` of a shard came from."""
    codes, words = layout.shard_array(folder, record, "tags"), layout.shard_array(folder, record, "words")
    token = int(np.argmax((np.asarray(codes) == code) & (np.asarray(words) >= 0)))
    lengths, window = layout.shard_array(folder, record, "lengths"), layout.shard_array(folder, record, "window")
    row = int(np.searchsorted(np.cumsum(lengths), token, side="right"))
    sentence = int((np.asarray(window[:row + 1]) == 0).sum()) - 1
    return readers.locate(record["source"], record["kind"], record["range"][0], sentence)


def _where_first(folder: Path, records: list[dict], odd) -> str:
    for record in records:
        for code, value in enumerate(record["labels"]):
            if odd(value):
                return _where_code(folder, record, code)
    return "data"


# ---- --show ---------------------------------------------------------------------------------------------
def show(cfg: Config, n: int) -> str:
    """The first `n` training sentences as training sees them: each word (from the data), its subwords and its
    label, per window (the words a window holds but another owns are marked '(ctx)')."""
    from phalanx.data.sources import open_source

    data = prepare.open_prepared(cfg, TOKCLS)
    tok = Tokenizer.from_file(str(Path(data.tokenizer_dir) / "tokenizer.json"))
    fields = fields_of(cfg)
    source = open_source(splits(cfg)[0], cfg.data.format)
    texts = []
    for piece in readers.plan(source, fields, 1 << 20):
        for rows, _ in readers.rows(piece, fields):
            texts += [list(r[0]) for r in rows[:n - len(texts)]]
        if len(texts) >= n:
            break
    train, out, row = data.train, [], 0
    for s, words in enumerate(texts):
        count = 1 + int(np.argmax(np.append(np.asarray(train.window[row + 1:]) == 0, True)))
        out.append(f"--- sentence {s} ({len(words)} words, {count} window{'s' if count > 1 else ''})")
        for k in range(count):
            ids, owner, labels = train.example(row + k)
            if count > 1:
                out.append(f"[window {k}: {len(ids)} subwords]")
            out += _side_by_side(tok, words, np.asarray(ids), np.asarray(owner), labels, data.names)
        row += count
    return "\n".join(out)


def _side_by_side(tok, words: list[str], ids: np.ndarray, owner: np.ndarray, labels: np.ndarray,
                  names: list[str]) -> list[str]:
    lines, current = [], None
    for token, w, label in zip(ids, owner, labels):
        if w >= 0:
            current = [words[w], [tok.id_to_token(int(token))], names[label] if 0 <= label < len(names) else "?"]
            lines.append(current)
        elif w == win.CONTINUED and current is not None:
            current[1].append(tok.id_to_token(int(token)))
        else:  # a special token, or context: a subword of a word another window predicts
            current = None
            lines.append(["", [tok.id_to_token(int(token))], "-100"])
    width = max((len(w) for w, _, _ in lines), default=4) + 2
    sub = max((len(" ".join(s)) for _, s, _ in lines), default=8) + 2
    return [f"  {w:<{width}}{' '.join(s):<{sub}}{label}" for w, s, label in lines]
