"""The classification record format: rows -> token ids and segment ids (per token), row lengths and label
codes (per row), built and opened by the one pipeline (prepare.py).

Each piece's shard records the raw labels it holds; once every shard of the training split exists, the
label names are fixed (`classify.labels`, or the training labels sorted) and each split gets `labels.npy`
(class ids), beside the pipeline's `offsets.npy`. Workers memory-map all of it: example i is
ids[offsets[i]:offsets[i+1]] of the split's token stream. Without `data.validation` the last rows of the
training store are held out. Every problem with the data is a `ConfigError` naming the file and line
(JSON Lines) or row (CSV, Parquet, hub data).
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


class EncodedSet(store.RaggedRows):
    """Tokenized examples stored ragged: example i is ids[offsets[i]:offsets[i+1]] (and its token types)."""

    def __init__(self, ids, types, offsets: np.ndarray, labels: np.ndarray):
        super().__init__((ids, types), offsets)
        self.ids, self.types, self.labels = ids, types, labels

    def __len__(self) -> int:
        return len(self.labels)

    def example(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.ids[lo:hi], self.types[lo:hi]

    def rows(self, lo: int, hi: int) -> EncodedSet:
        """Examples [lo, hi) (offsets stay positions in the same streams)."""
        return EncodedSet(self.ids, self.types, self.offsets[lo:hi + 1], self.labels[lo:hi])

    @classmethod
    def open(cls, folder: Path) -> EncodedSet:
        return cls(store.TokenStore(folder, "ids"), store.TokenStore(folder, "types"),
                   np.load(folder / "offsets.npy", mmap_mode="r"), np.load(folder / "labels.npy", mmap_mode="r"))


@dataclass
class ClassifyData:
    tokenizer_dir: Path
    names: list[str]
    train: EncodedSet
    validation: EncodedSet


@dataclass(frozen=True)
class ClassifyJob:
    """What a pool worker needs to encode a piece of rows (picklable)."""
    tokenizer_dir: str
    max_length: int
    fields: tuple


@lru_cache(maxsize=4)
def _tokenizer(tokenizer_dir: str, max_length: int):
    """The raw `tokenizers` backend with the truncation `transformers` applies for truncation=True."""
    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(max_length, strategy="longest_first")
    return tok


def training_rows(cfg: Config, rows: int) -> int:
    """Rows of the training store used for training: all, or all but the last data.val_fraction."""
    return rows if cfg.data.validation else max(1, int(round(rows * (1 - cfg.data.val_fraction))))


class ClassifyFormat(prepare.RecordFormat):
    prefix, version = "classify", "classify-store-v2"
    tokenizer, needs = "wordpiece", "pad_token"
    token_arrays = {"ids": None, "types": "uint8"}
    row_arrays = {"lengths": "uint32", "codes": "uint32"}

    def fields(self, cfg: Config) -> readers.Fields:
        c = cfg.classify
        pair = ((c.text_pair_field, "text"),) if c.text_pair_field else ()
        return ((cfg.data.text_field, "text"), *pair, (c.label_field, "label"))

    def settings(self, cfg: Config) -> tuple:
        d, c = cfg.data, cfg.classify
        return c.max_length, tuple(c.labels), (d.val_fraction if not d.validation else None)

    def identity(self, cfg: Config, split: Split) -> list:
        """A validation split's labels depend on the training labels: its store is current only while the
        training data is unchanged too."""
        own = source_identity(split, cfg.data.format)
        return own if split.name == "train" else [own, source_identity(splits(cfg)[0], cfg.data.format)]

    def job(self, cfg: Config, split: Split, tok_dir: Path, total: int) -> tuple[ClassifyJob, dict]:
        return ClassifyJob(str(tok_dir), cfg.classify.max_length, self.fields(cfg)), {}

    def encode(self, job: ClassifyJob, piece: readers.Piece, writer: store.ShardWriter, progress) -> dict:
        tok, pair = _tokenizer(job.tokenizer_dir, job.max_length), len(job.fields) == 3
        labels: dict = {}  # raw label -> its code in this shard
        for rows, n in readers.rows(piece, job.fields):
            encoded = tok.encode_batch([(r[0], r[1]) if pair else r[0] for r in rows], add_special_tokens=True)
            if encoded:
                writer.tokens(ids=np.concatenate([e.ids for e in encoded]),
                              types=np.concatenate([e.type_ids for e in encoded]))
            writer.rows(lengths=[len(e.ids) for e in encoded],
                        codes=[labels.setdefault(r[-1], len(labels)) for r in rows])
            progress(n)
        return {"documents": writer.counts["rows"], "labels": list(labels)}

    def finish(self, cfg: Config, split: Split, folder: Path, records: list[dict], done: dict[str, dict]) -> dict:
        """Label names from the training rows (the train split), then every row's class id: labels.npy."""
        rows = sum(r["rows"] for r in records)
        train = records if split.name == "train" else done["train"]["shards"]
        if split.name == "train":
            names = label_names(_first_seen(folder, records, training_rows(cfg, rows)), cfg.classify.labels)
        else:
            names = done["train"]["labels"]
        first = next(r["labels"][0] for r in train if r["labels"])  # the first training label: int or str
        lookup = class_lookup(names, bool(cfg.classify.labels), type(first))
        out = np.lib.format.open_memmap(folder / "labels.npy", mode="w+", dtype=np.int64, shape=(rows,))
        row = 0
        for record in records:
            codes = layout.shard_array(folder, record, "codes")
            classes = [lookup.get(value, -1) for value in record["labels"]]  # per code
            if -1 in classes:
                code = classes.index(-1)
                known = "classify.labels" if cfg.classify.labels else "the training data"
                raise ConfigError(f"{locate(record, int(np.argmax(codes == code)))}: label {record['labels'][code]!r} "
                                  f"is not one of the labels of {known} ({', '.join(names)[:200]})")
            out[row:row + len(codes)] = np.asarray(classes, dtype=np.int64)[codes]
            row += len(codes)
        out.flush()
        held_out = split.name == "train" and not cfg.data.validation
        held = {"held_out": rows - training_rows(cfg, rows)} if held_out else {}
        return {"labels": names, **held}

    def open(self, cfg: Config, tok_dir: Path, folders: dict[str, Path]) -> ClassifyData:
        names = layout.read_index(folders["train"])["labels"]
        train = EncodedSet.open(folders["train"])
        if "validation" in folders:
            return ClassifyData(tok_dir, names, train, EncodedSet.open(folders["validation"]))
        cut = training_rows(cfg, len(train))
        return ClassifyData(tok_dir, names, train.rows(0, cut), train.rows(cut, len(train)))


CLASSIFY = ClassifyFormat()


# ---- labels ---------------------------------------------------------------------------------------
def label_names(labels: list[tuple], configured: list[str]) -> list[str]:
    """Class names in id order: `classify.labels` when given, else the training labels sorted. `labels` are
    the distinct training labels, each with a function naming where it was first seen."""
    first, kind = labels[0][0], type(labels[0][0])
    odd = next(((v, where) for v, where in labels if type(v) is not kind), None)
    if odd is not None:
        raise ConfigError(f"{odd[1]()}: label {odd[0]!r} mixes integer and string labels "
                          f"(the first label is {first!r})")
    if configured:
        names = list(configured)
        if len(set(names)) != len(names):
            raise ConfigError(f"config key 'classify.labels': repeated names in {names}")
    else:
        names = [str(v) for v in sorted(v for v, _ in labels)]
    if len(names) < 2:
        raise ConfigError(f"config key 'classify.labels': classification needs at least 2 labels, found {names}")
    return names


def class_lookup(names: list[str], configured: bool, kind: type) -> dict:
    """Raw label -> class id: a configured name or index, or a discovered value of the labels' type."""
    if configured:
        return {**{n: i for i, n in enumerate(names)}, **{i: i for i in range(len(names))}}
    return {kind(n): i for i, n in enumerate(names)}


def _first_seen(folder: Path, records: list[dict], rows: int) -> list[tuple]:
    """Distinct labels of the first `rows` rows in first-seen order, each with a function naming where."""
    seen: dict = {}
    for record in records:
        codes = np.asarray(layout.shard_array(folder, record, "codes")[:max(rows, 0)])
        rows -= len(codes)
        for code in dict.fromkeys(codes.tolist()):
            value = record["labels"][code]
            if value not in seen:
                seen[value] = (record, int(np.argmax(codes == code)))
    return [(value, lambda r=r, k=k: locate(r, k)) for value, (r, k) in seen.items()]


def locate(record: dict, k: int) -> str:
    """Where row k of a shard came from (counted only for messages)."""
    return readers.locate(record["source"], record["kind"], record["range"][0], k)
