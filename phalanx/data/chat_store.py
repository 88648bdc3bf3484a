"""The chat record format: conversations -> token ids and a loss mask (per token) and lengths (per
conversation), built and opened by the one pipeline (prepare.py), then packed.

Each record is rendered with the tokenizer's chat template and masked from its character offsets
(conversations.py); a record left with nothing to train on (e.g. truncated before its first reply) is
dropped and counted. Once every shard of a split exists, `finish` packs whole conversations into rows of
`model.block_size` tokens by best-fit decreasing (`pack`), which depends on the lengths only, never on
the preparing processes or the world size: `pack_order.npy` (conversations in row order) and
`pack_offsets.npy` (where each row starts in it). Without `data.validation` the last `data.val_fraction`
of the conversations are held out, and each part is packed on its own (a row never mixes them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from phalanx.core.config import Config, ConfigError
from phalanx.data import conversations, pieces, prepare, readers, store
from phalanx.data.sources import Split


@dataclass(frozen=True)
class ChatJob:
    """What a pool worker needs to encode a piece of conversations (picklable)."""
    tokenizer_dir: str
    fields: tuple        # ((format, ChatFields), ...) for the formats a record may have
    chat_format: str     # 'auto' or one of conversations.FORMATS
    train_on: str
    truncation: str
    block_size: int


@lru_cache(maxsize=2)
def load_tokenizer(tokenizer_dir: str):
    from phalanx.data.tokenizer import load_saved  # transformers: ~2 s, only where chat data is encoded

    return load_saved(tokenizer_dir)


def training_rows(cfg: Config, n: int) -> int:
    """Conversations of the training store used for training: all, or all but data.val_fraction."""
    return n if cfg.data.validation else max(1, int(round(n * (1 - cfg.data.val_fraction))))


def field_overrides(cfg: Config) -> dict[str, str]:
    d = cfg.data
    return {"messages": d.messages_field, "prompt": d.prompt_field, "input": d.input_field,
            "completion": d.completion_field, "system": d.system_field}


class ChatFormat(prepare.RecordFormat):
    prefix, version = "chat", "chat-store-v1"
    tokenizer, needs = "bpe", "eos_token"
    token_arrays = {"ids": None, "mask": "uint8"}
    row_arrays = {"lengths": "uint32"}

    def fields(self, cfg: Config) -> readers.Fields:
        return (("", "record"),)

    def settings(self, cfg: Config) -> tuple:
        d = cfg.data
        return (d.chat_format, tuple(sorted(field_overrides(cfg).items())), d.train_on, d.truncation,
                cfg.model.block_size, d.packing, d.val_fraction if not d.validation else None)

    tokenizer_variant = "chatml-v1"

    def adapt_tokenizer(self, folder: Path) -> None:
        """A tokenizer without a chat template gets phalanx's ChatML one (and its two special tokens)."""
        from phalanx.data.tokenizer import load_saved

        tok = load_saved(folder)
        if conversations.ensure_template(tok):
            for stale in folder.iterdir():
                stale.unlink()
            tok.save_pretrained(folder)

    def job(self, cfg: Config, split: Split, tok_dir: Path, total: int) -> tuple[ChatJob, dict]:
        overrides = field_overrides(cfg)
        fields = tuple((f, conversations.chat_fields(f, overrides)) for f in conversations.FORMATS)
        return ChatJob(str(tok_dir), fields, cfg.data.chat_format, cfg.data.train_on, cfg.data.truncation,
                       cfg.model.block_size), {}

    def encode(self, job: ChatJob, piece: pieces.Piece, writer: store.ShardWriter, progress) -> dict:
        tok, formats = load_tokenizer(job.tokenizer_dir), dict(job.fields)
        k = kept = dropped = supervised = 0
        ends: set[int] = set()
        for rows, n in pieces.rows(piece, self.fields(None)):
            for (record,) in rows:
                try:
                    fmt = job.chat_format if job.chat_format != "auto" else conversations.detect(record, "")
                    messages = conversations.to_messages(record, formats[fmt], "")
                    enc = conversations.encode(tok, messages, job.train_on, job.block_size, job.truncation, "")
                except ConfigError as e:  # located only now: counting lines is slow, errors are rare
                    where = pieces.locate(piece.source, piece.kind, piece.start, k)
                    raise ConfigError(f"{where}{str(e)}") from None
                k += 1
                if enc is None:
                    dropped += 1
                    continue
                writer.tokens(ids=enc.ids, mask=enc.mask)
                writer.rows(lengths=[len(enc.ids)])
                kept, supervised = kept + 1, supervised + int(enc.mask.sum())
                ends.add(enc.end_of_turn)
            progress(n)
        return {"documents": kept, "dropped": dropped, "supervised": supervised, "end_of_turn": sorted(ends - {-1})}

    def finish(self, cfg: Config, split: Split, folder: Path, records: list[dict], done: dict[str, dict]) -> dict:
        lengths = np.diff(np.load(folder / "offsets.npy", mmap_mode="r"))
        dropped = sum(r["dropped"] for r in records)
        if not len(lengths):
            raise ConfigError(f"config key '{split.key}': no conversation of '{split.spec or 'built-in data'}' has a "
                              f"token to train on after truncation to model.block_size={cfg.model.block_size} "
                              f"({dropped} dropped); raise model.block_size or check data.train_on")
        ends = sorted({e for r in records for e in r["end_of_turn"]})
        out = {"dropped": dropped, "supervised_tokens": sum(r["supervised"] for r in records), "end_of_turn": ends}
        if cfg.data.packing:
            cut = training_rows(cfg, len(lengths)) if split.name == "train" else len(lengths)
            parts = [pack(lengths[:cut], cfg.model.block_size), pack(lengths[cut:], cfg.model.block_size, cut)]
            order = np.concatenate([p[0] for p in parts])
            offsets = np.concatenate([parts[0][1], parts[1][1][1:] + parts[0][1][-1]])
            np.save(folder / "pack_order.npy", order)
            np.save(folder / "pack_offsets.npy", offsets)
            slots = (len(offsets) - 1) * cfg.model.block_size
            out.update(packed_rows=len(offsets) - 1, train_packed_rows=len(parts[0][1]) - 1,
                       packing_efficiency=round(float(lengths.sum()) / max(slots, 1), 4))
        return out

    def open(self, cfg: Config, tok_dir: Path, folders: dict[str, Path]) -> ChatData:
        index = store.read_index(folders["train"])
        train = Conversations.open(folders["train"])
        packed = cfg.data.packing
        if "validation" in folders:
            val = Conversations.open(folders["validation"])
            sets = (train.view(packed), val.view(packed))
        else:
            rows = index.get("train_packed_rows") if packed else training_rows(cfg, train.n)
            sets = (train.view(packed, 0, rows), train.view(packed, rows, None))
        return ChatData(tok_dir, *sets, end_of_turn=index["end_of_turn"], summary=index["summary"],
                        template_tokens=index.get("template_tokens", []))


CHAT = ChatFormat()


# ---- packing ------------------------------------------------------------------------------------------
class _FirstFit:
    """Capacities 0..size with a set of open rows each; `at_least(c)` finds the smallest capacity >= c
    that has a row (a segment tree over 'non-empty'), so best-fit costs O(log size) per conversation."""

    def __init__(self, size: int):
        self.n = 1 << (size + 1).bit_length()
        self.tree = np.zeros(2 * self.n, dtype=bool)
        self.rows: dict[int, list[int]] = {}

    def add(self, capacity: int, row: int) -> None:
        self.rows.setdefault(capacity, []).append(row)
        i = capacity + self.n
        while i and not self.tree[i]:
            self.tree[i] = True
            i //= 2

    def take(self, capacity: int) -> int:
        rows = self.rows[capacity]
        row = rows.pop()
        if not rows:
            del self.rows[capacity]
            i = capacity + self.n
            self.tree[i] = False
            while i > 1 and not (self.tree[i] or self.tree[i ^ 1]):
                i //= 2
                self.tree[i] = False
        return row

    def at_least(self, c: int) -> int | None:
        """Smallest capacity >= c with an open row, or None."""
        i, lo, hi = 1, 0, self.n - 1
        if not self.tree[1]:
            return None
        return self._find(i, lo, hi, c)

    def _find(self, i: int, lo: int, hi: int, c: int) -> int | None:
        if hi < c or not self.tree[i]:
            return None
        if lo == hi:
            return lo
        mid = (lo + hi) // 2
        left = self._find(2 * i, lo, mid, c)
        return left if left is not None else self._find(2 * i + 1, mid + 1, hi, c)


def pack(lengths: np.ndarray, block: int, first: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Best-fit decreasing: conversations (ids first + i) longest first, each into the open row whose
    free space fits it most tightly, else a new row. Returns (conversation ids in row order, row offsets).
    Deterministic: a function of the lengths only."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and lengths.max() > block:
        raise ValueError(f"a conversation of {lengths.max()} tokens does not fit a row of {block}")
    row_of = np.empty(len(lengths), dtype=np.int64)
    free, rows = _FirstFit(block), 0
    for i in np.argsort(-lengths, kind="stable"):
        size = int(lengths[i])
        capacity = free.at_least(size)
        if capacity is None:
            row, left = rows, block - size
            rows += 1
        else:
            row, left = free.take(capacity), capacity - size
        row_of[i] = row
        if left:
            free.add(left, row)
    order = np.argsort(row_of, kind="stable")
    offsets = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(row_of, minlength=rows), out=offsets[1:])
    return (order + first).astype(np.int64), offsets


# ---- the workers' side --------------------------------------------------------------------------------
class Conversations:
    """A split's conversations: conversation i is ids/mask[offsets[i]:offsets[i+1]] (memory-mapped)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.ids, self.mask = store.TokenStore(folder, "ids"), store.TokenStore(folder, "mask")
        self.offsets = np.load(folder / "offsets.npy", mmap_mode="r")
        self.n = len(self.offsets) - 1

    @classmethod
    def open(cls, folder: Path) -> Conversations:
        return cls(folder)

    def conversation(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.ids[lo:hi].astype(np.int64), self.mask[lo:hi].astype(bool)

    def view(self, packed: bool, lo: int = 0, hi: int | None = None) -> ChatSet:
        if packed:
            offsets = np.load(self.folder / "pack_offsets.npy", mmap_mode="r")
            order = np.load(self.folder / "pack_order.npy", mmap_mode="r")
            hi = len(offsets) - 1 if hi is None else hi
            return ChatSet(self, order, offsets[lo:hi + 1])
        hi = self.n if hi is None else hi
        return ChatSet(self, None, np.arange(lo, hi + 1, dtype=np.int64))


class ChatSet:
    """The samples the sampler hands out: packed rows (each a run of whole conversations of `order`), or
    single conversations (`order` None: sample i is conversation offsets[i])."""

    def __init__(self, conversations: Conversations, order: np.ndarray | None, offsets: np.ndarray):
        self.conversations, self.order, self.offsets = conversations, order, offsets
        n = len(offsets) - 1
        if order is None:
            ends = conversations.offsets
            self.lengths = np.asarray(ends[offsets[1:]] - ends[offsets[:-1]]) if n else np.zeros(0, np.int64)
        else:
            self.lengths = None  # packed rows are all model.block_size wide

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def segments(self, i: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Sample i as its conversations' (ids, mask), in order."""
        if self.order is None:
            return [self.conversations.conversation(int(self.offsets[i]))]
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        return [self.conversations.conversation(int(c)) for c in self.order[lo:hi]]


@dataclass
class ChatData:
    tokenizer_dir: Path
    train: ChatSet
    validation: ChatSet
    end_of_turn: list[int]
    summary: dict
    template_tokens: list[int] = field(default_factory=list)  # special tokens the chat template writes
