"""The chat record format: conversations -> token ids and a loss mask (per token) and lengths (per
conversation), built and opened by the one pipeline (prepare.py), then packed.

Each record is rendered with the tokenizer's chat template (template.kwargs baked into it as
defaults, system messages folded where the template refuses them: chat_template.py), each message found in
the rendering by structure (chat_layout.py) and masked (chat_encode.py), a batch of records at a time. A
record that cannot be used is dropped and counted with its reason; `dropped_error` is the gate of
data.max_dropped_fraction (chat_counts.py). Once every shard of a split exists, `finish` packs whole
conversations into rows of `model.block_size` tokens by best-fit decreasing (`pack`), which depends on the
lengths only, never on the preparing processes or the world size: `pack_order.npy` (conversations in row
order) and `pack_offsets.npy` (where each row starts in it). Without `data.validation` the last
`data.val_fraction` of the conversations are held out, and each part is packed on its own (a row never
mixes them).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from phalanx.core.config import Config, ConfigError
from phalanx.data import chat_counts, chat_template, conversations, encoder, pieces, prepare, readers, store
from phalanx.data.chat_encode import ChatEncoder, ChatSettings, Encoded, TiktokenTokens
from phalanx.data.sample import sample_rows
from phalanx.data.sources import Split, splits


SMALL = 1 << 20  # inputs up to this size are tokenized by `tokenizers` directly (no tiktoken check)


@dataclass(frozen=True)
class ChatJob:
    """What a pool worker needs to encode a piece of conversations (picklable)."""
    tokenizer_dir: str
    fields: tuple        # ((format, ChatFields), ...) for the formats a record may have
    chat_format: str     # 'auto' or one of conversations.FORMATS
    settings: ChatSettings
    tokens: str          # 'tiktoken' or 'tokenizers' (encoder.py)


@lru_cache(maxsize=2)
def load_tokenizer(tokenizer_dir: str):
    from phalanx.data.tokenizer import load_saved  # transformers: ~0.5 s, only where chat data is encoded

    return load_saved(tokenizer_dir)


@lru_cache(maxsize=2)
def chat_encoder(tokenizer_dir: str, settings: ChatSettings, tokens: str) -> ChatEncoder:
    """One encoder per process (a pool worker encodes many pieces; its skeletons are reused across them)."""
    fast = encoder.cached(tokenizer_dir, "tiktoken").fast if tokens == "tiktoken" else None
    return ChatEncoder(load_tokenizer(tokenizer_dir), settings, TiktokenTokens(fast) if fast else None)


def training_rows(cfg: Config, n: int) -> int:
    """Conversations of the training store used for training: all, or all but data.val_fraction."""
    return n if cfg.data.validation else max(1, int(round(n * (1 - cfg.data.val_fraction))))


def field_overrides(cfg: Config) -> dict[str, str]:
    c = cfg.chat
    return {"messages": c.messages_field, "prompt": c.prompt_field, "input": c.input_field,
            "completion": c.completion_field, "system": c.system_field}


def _messages(record, formats: dict, chat_format: str, where: str) -> list[dict]:
    fmt = chat_format if chat_format != "auto" else conversations.detect(record, where)
    return conversations.to_messages(record, formats[fmt], where)


class ChatFormat(prepare.RecordFormat):
    prefix, version = "chat", "chat-store-v2"
    tokenizer, needs = "bpe", "eos_token"
    token_arrays = {"ids": None, "mask": "uint8"}
    row_arrays = {"lengths": "uint32"}

    def fields(self, cfg: Config) -> readers.Fields:
        return (("", "record"),)

    def settings(self, cfg: Config) -> tuple:
        d, c = cfg.data, cfg.chat
        return (c.format, tuple(sorted(field_overrides(cfg).items())), c.train_on, c.truncation,
                cfg.template.system_message, cfg.model.block_size, d.packing,
                d.val_fraction if not d.validation else None)

    def tokenizer_variant(self, cfg: Config) -> str:
        """The template with template.kwargs baked in as defaults is part of the tokenizer (RUN/final
        renders as training did), so the kwargs name its folder (checked here: their first use)."""
        kwargs = cfg.template.kwargs or {}
        chat_template.check_kwargs(kwargs)
        return "chat-v2" + (f":{json.dumps(kwargs, sort_keys=True)}" if kwargs else "")

    def adapt_tokenizer(self, cfg: Config, folder: Path) -> None:
        """phalanx's ChatML template (and its two special tokens) for a tokenizer without one; the template
        kwargs written into the template as defaults."""
        from phalanx.data.tokenizer import load_saved

        tok, kwargs = load_saved(folder), cfg.template.kwargs or {}
        if chat_template.ensure_template(tok) or kwargs:
            chat_template.bake_defaults(tok, kwargs)
            for stale in folder.iterdir():
                stale.unlink()
            tok.save_pretrained(folder)

    def job(self, cfg: Config, split: Split, tok_dir: Path, total: int) -> tuple[ChatJob, dict]:
        """The settings, with template.system_message resolved for the template (keep with a template that
        refuses a system role is exit 2 here, before any worker), and the tokenizer implementation."""
        c, tok = cfg.chat, load_tokenizer(str(tok_dir))
        kwargs = cfg.template.kwargs or {}
        policy = chat_template.system_policy(tok, cfg.template.system_message, kwargs)
        settings = ChatSettings(c.train_on, c.truncation, cfg.model.block_size, policy,
                                json.dumps(kwargs, sort_keys=True))
        overrides = field_overrides(cfg)
        fields = tuple((f, conversations.chat_fields(f, overrides)) for f in conversations.FORMATS)
        if 0 < total <= SMALL:  # nothing to gain from a faster tokenizer; skip its check
            kind, why = "tokenizers", f"input under {SMALL >> 20} MB"
        else:
            kind, why = encoder.choose(tok_dir, self._sample_texts(cfg, dict(fields), settings, tok))
        return ChatJob(str(tok_dir), fields, c.format, settings, kind), {"encoder": kind, "encoder_check": why}

    def _sample_texts(self, cfg: Config, formats: dict, settings: ChatSettings, tok) -> list[str]:
        """Rendered conversations from a sample of the training records (the tiktoken check's sample)."""
        shown = []
        for (record,) in sample_rows(cfg, self.fields(cfg), 256 << 10):
            try:
                messages = _messages(record, formats, cfg.chat.format, "")
            except ConfigError:  # said with its place when its piece is encoded
                continue
            shown.append(chat_template.fold_system(messages) if settings.system == "fold" else messages)
        renderer = chat_template.Renderer(tok, json.loads(settings.template_kwargs))
        return [t for t in renderer.many(shown) if isinstance(t, str)]

    def encode(self, job: ChatJob, piece: pieces.Piece, writer: store.ShardWriter, progress) -> dict:
        enc, formats = chat_encoder(job.tokenizer_dir, job.settings, job.tokens), dict(job.fields)
        tally, written, k = chat_counts.Tally(), [], 0
        for rows, n in pieces.rows(piece, self.fields(None)):
            batch = []
            for (record,) in rows:
                try:
                    batch.append(_messages(record, formats, job.chat_format, ""))
                except ConfigError as e:  # located only now: counting lines is slow, errors are rare
                    raise ConfigError(f"{pieces.locate(piece.source, piece.kind, piece.start, k + len(batch))}"
                                      f"{e}") from None
            try:
                results = enc.encode_batch(batch)
            except ConfigError as e:  # the template writes no end-of-turn token: every record would fail
                raise ConfigError(f"{pieces.locate(piece.source, piece.kind, piece.start, k)}: {e}") from None
            kept = []
            for got in results:
                tally.add(k, got)
                k += 1
                if isinstance(got, Encoded):
                    kept.append(got)
            if kept:  # one write per batch: a write per conversation costs more than encoding it
                writer.tokens(ids=np.concatenate([g.ids for g in kept]), mask=np.concatenate([g.mask for g in kept]))
                writer.rows(lengths=[len(g.ids) for g in kept])
            written += kept
            progress(n)
        return {**tally.record(), "end_of_turn": sorted({g.end_of_turn for g in written} - {-1}),
                "template_tokens": sorted(enc.template_tokens([g.ids for g in written]))}

    def finish(self, cfg: Config, split: Split, folder: Path, records: list[dict], done: dict[str, dict]) -> dict:
        lengths = np.diff(np.load(folder / "offsets.npy", mmap_mode="r"))
        counts = chat_counts.summary(records)
        if not len(lengths):
            raise ConfigError(f"config key '{split.key}': no conversation of '{split.spec or 'built-in data'}' has a "
                              f"token to train on after truncation to model.block_size={cfg.model.block_size} "
                              f"({counts['dropped']} dropped: {prepare_reasons(counts)}); raise model.block_size or "
                              f"check chat.train_on and the chat template")
        out = {**counts, "supervised_tokens": sum(r["supervised"] for r in records),
               "end_of_turn": sorted({e for r in records for e in r["end_of_turn"]}),
               "template_tokens": sorted({t for r in records for t in r.get("template_tokens", [])})}
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


def prepare_reasons(counts: dict) -> str:
    return ", ".join(f"{chat_counts.WHY[r]} {n}" for r, n in counts["dropped_by"].items()) or "none"


def dropped_error(cfg: Config) -> str | None:
    """data.max_dropped_fraction over the prepared stores of `cfg` (read from their index: a store over the
    limit is complete, so raising the key does not prepare again)."""
    tok_dir = prepare.tokenizer_folder(cfg, CHAT)
    for split in splits(cfg):
        index = store.read_index(prepare.store_folder(cfg, CHAT, split, tok_dir))
        if index is not None:
            message = chat_counts.gate(split.key, split.spec or "built-in data", index, cfg.data.max_dropped_fraction,
                                       cfg.chat.truncation, cfg.model.block_size)
            if message:
                return message
    return None


CHAT = ChatFormat()


# ---- packing ------------------------------------------------------------------------------------------
class _FirstFit:
    """Capacities 0..size with a list of open rows each; `at_least(c)` finds the smallest capacity >= c
    that has a row from a bit set of the non-empty capacities (a Python int: a shift and the lowest set
    bit), so best fit costs a few operations per conversation."""

    def __init__(self, size: int):
        self.bits = 0
        self.rows: dict[int, list[int]] = {}

    def add(self, capacity: int, row: int) -> None:
        self.rows.setdefault(capacity, []).append(row)
        self.bits |= 1 << capacity

    def take(self, capacity: int) -> int:
        rows = self.rows[capacity]
        row = rows.pop()
        if not rows:
            del self.rows[capacity]
            self.bits &= ~(1 << capacity)
        return row

    def at_least(self, c: int) -> int | None:
        """Smallest capacity >= c with an open row, or None."""
        above = self.bits >> c
        return c + (above & -above).bit_length() - 1 if above else None


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
        return ChatSet(self, *samples(self.folder, self.n, packed, lo, hi))


def samples(folder: Path, n: int, packed: bool, lo: int = 0, hi: int | None = None) -> tuple:
    """(order, offsets) of samples lo..hi of a store of `n` units (conversations, or pairs): packed rows, each
    a run of whole units of `order`, or (order None) one unit per sample, sample i being unit offsets[i]."""
    if packed:
        offsets = np.load(folder / "pack_offsets.npy", mmap_mode="r")
        order = np.load(folder / "pack_order.npy", mmap_mode="r")
        hi = len(offsets) - 1 if hi is None else hi
        return order, offsets[lo:hi + 1]
    hi = n if hi is None else hi
    return None, np.arange(lo, hi + 1, dtype=np.int64)


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
    template_tokens: list[int] = field(default_factory=list)  # special and added tokens the template writes
