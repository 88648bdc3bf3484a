"""The preference record format: pairs -> two token sequences each (prompt + chosen, prompt + rejected) with
their target masks, built and opened by the one pipeline (prepare.py), then packed by pair.

The tokenizer and its chat template are chat's (chat_store.ChatFormat: a template added where the tokenizer
has none, template.kwargs baked in), so a preference run on a chat run's final/ renders as that run
did. Pair p is sequences 2p (chosen) and 2p+1 (rejected) of the split (`offsets.npy`, `truncated.npy` per
sequence). A pair that cannot be used is dropped and counted with its reason (chat_counts.py, the gate of
data.max_dropped_fraction counts pairs). With data.packing, `finish` packs whole pairs (both replies) into
rows of 2 x model.block_size by best-fit decreasing on the pair lengths (chat_store.pack): a pair is the
unit of packing and sampling, so its two replies are always in one micro-batch on one rank.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from phalanx.core.config import Config, ConfigError
from phalanx.data import chat_counts, chat_store, chat_template, pieces, store
from phalanx.data.chat_encode import ChatSettings, Encoded
from phalanx.data.pref_encode import EncodedPair, PairEncoder
from phalanx.data.pref_records import PairFields, pair_fields, to_pair
from phalanx.data.sources import Split


@dataclass(frozen=True)
class PairJob:
    """What a pool worker needs to encode a piece of pairs (picklable)."""
    tokenizer_dir: str
    fields: PairFields
    pair_format: str
    settings: ChatSettings


@lru_cache(maxsize=2)
def pair_encoder(tokenizer_dir: str, settings: ChatSettings) -> PairEncoder:
    return PairEncoder(chat_store.load_tokenizer(tokenizer_dir), settings)


def row_width(cfg: Config) -> int:
    """A packed row holds whole pairs: 2 x model.block_size tokens (each reply fits model.block_size)."""
    return 2 * cfg.model.block_size


class PreferenceFormat(chat_store.ChatFormat):
    prefix, version = "pref", "pref-store-v1"
    token_arrays = {"ids": None, "mask": "uint8"}
    row_arrays = {"lengths": "uint32", "truncated": "uint8"}

    def fields(self, cfg: Config):
        return (("pair", "record"),)  # the whole record (built-in data: builtin.stdlib_preference_pairs)

    def settings(self, cfg: Config) -> tuple:
        d, p = cfg.data, cfg.preference
        return (p.format, pair_fields(p), "keep_end", cfg.template.system_message, cfg.model.block_size, d.packing,
                d.val_fraction if not d.validation else None)

    def job(self, cfg: Config, split: Split, tok_dir: Path, total: int) -> tuple[PairJob, dict]:
        p, tok = cfg.preference, chat_store.load_tokenizer(str(tok_dir))
        kwargs = cfg.template.kwargs or {}
        policy = chat_template.system_policy(tok, cfg.template.system_message, kwargs)
        settings = ChatSettings("assistant", "keep_end", cfg.model.block_size, policy,
                                json.dumps(kwargs, sort_keys=True))
        return PairJob(str(tok_dir), pair_fields(p), p.format, settings), {}

    def encode(self, job: PairJob, piece: pieces.Piece, writer: store.ShardWriter, progress) -> dict:
        enc = pair_encoder(job.tokenizer_dir, job.settings)
        tally, eot, template, k = chat_counts.Tally(), set(), set(), 0
        for rows, n in pieces.rows(piece, self.fields(None)):
            kept = []
            for (record,) in rows:
                try:
                    pair = to_pair(record, job.fields, job.pair_format, "")
                except ConfigError as e:  # located only now: counting lines is slow, errors are rare
                    raise ConfigError(f"{pieces.locate(piece.source, piece.kind, piece.start, k)}{e}") from None
                try:
                    got = enc.encode(pair)
                except ConfigError as e:  # the template writes no end-of-turn token: every pair would fail
                    raise ConfigError(f"{pieces.locate(piece.source, piece.kind, piece.start, k)}: {e}") from None
                tally.add(k, _counted(got))
                k += 1
                if isinstance(got, EncodedPair):
                    kept.append(got)
            if kept:
                seqs = [s for g in kept for s in (g.chosen, g.rejected)]
                writer.tokens(ids=np.concatenate([s.ids for s in seqs]), mask=np.concatenate([s.mask for s in seqs]))
                writer.rows(lengths=[len(s.ids) for s in seqs], truncated=[s.truncated for s in seqs])
                eot.update(s.end_of_turn for s in seqs)
                template.update(enc.chat.template_tokens([s.ids for s in seqs]))
            progress(n)
        return {**tally.record(), "end_of_turn": sorted(eot - {-1}), "template_tokens": sorted(template)}

    def finish(self, cfg: Config, split: Split, folder: Path, records: list[dict], done: dict[str, dict]) -> dict:
        lengths = np.diff(np.load(folder / "offsets.npy", mmap_mode="r"))
        counts = chat_counts.summary(records)
        if not len(lengths):
            raise ConfigError(f"config key '{split.key}': no pair of '{split.spec or 'built-in data'}' can be trained "
                              f"on ({counts['dropped']} dropped: {chat_store.prepare_reasons(counts)}); raise "
                              f"model.block_size or check the chat template")
        flags = [store.shard_array(folder, r, "truncated") for r in records if r["rows"]]
        np.save(folder / "truncated.npy", np.concatenate(flags).astype(np.uint8))
        sizes = lengths[0::2] + lengths[1::2]
        out = {**counts, "pairs": len(sizes), "supervised_tokens": sum(r["supervised"] for r in records),
               "end_of_turn": sorted({e for r in records for e in r["end_of_turn"]}),
               "template_tokens": sorted({t for r in records for t in r.get("template_tokens", [])})}
        if cfg.data.packing:
            width = row_width(cfg)
            cut = chat_store.training_rows(cfg, len(sizes)) if split.name == "train" else len(sizes)
            parts = [chat_store.pack(sizes[:cut], width), chat_store.pack(sizes[cut:], width, cut)]
            offsets = np.concatenate([parts[0][1], parts[1][1][1:] + parts[0][1][-1]])
            np.save(folder / "pack_order.npy", np.concatenate([p[0] for p in parts]))
            np.save(folder / "pack_offsets.npy", offsets)
            out.update(packed_rows=len(offsets) - 1, train_packed_rows=len(parts[0][1]) - 1,
                       packing_efficiency=round(float(sizes.sum()) / max((len(offsets) - 1) * width, 1), 4))
        return out

    def open(self, cfg: Config, tok_dir: Path, folders: dict[str, Path]) -> PrefData:
        index = store.read_index(folders["train"])
        train, packed = Pairs(folders["train"]), cfg.data.packing
        if "validation" in folders:
            sets = (train.view(packed), Pairs(folders["validation"]).view(packed))
        else:
            cut = index.get("train_packed_rows") if packed else chat_store.training_rows(cfg, train.n)
            sets = (train.view(packed, 0, cut), train.view(packed, cut, None))
        return PrefData(tok_dir, *sets, end_of_turn=index["end_of_turn"], summary=index["summary"],
                        template_tokens=index.get("template_tokens", []))


def _counted(got) -> Encoded | object:
    """What chat's tally counts for a pair: a kept pair as one record (its two sequences' targets)."""
    if not isinstance(got, EncodedPair):
        return got
    mask = np.concatenate([got.chosen.mask, got.rejected.mask])
    return Encoded(np.concatenate([got.chosen.ids, got.rejected.ids]), mask, got.chosen.end_of_turn, got.truncated)


PREFERENCE = PreferenceFormat()


# ---- the workers' side --------------------------------------------------------------------------------
class Pairs:
    """A split's pairs: pair p is sequences 2p (chosen) and 2p+1 (rejected), memory-mapped."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.sequences = chat_store.Conversations(folder)
        self.truncated = np.load(folder / "truncated.npy", mmap_mode="r")
        self.n = self.sequences.n // 2

    def pair(self, p: int) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
        """((chosen ids, targets), (rejected ids, targets)) of pair p."""
        return self.sequences.conversation(2 * p), self.sequences.conversation(2 * p + 1)

    def view(self, packed: bool, lo: int = 0, hi: int | None = None) -> PairSet:
        return PairSet(self, *chat_store.samples(self.folder, self.n, packed, lo, hi))


class PairSet:
    """The samples the sampler hands out: packed rows (each a run of whole pairs of `order`), or single pairs
    (`order` None: sample i is pair offsets[i]). `reference`: the split's stored reference log-probs
    (pairs x [chosen, rejected]) when the run uses precomputed ones (set by the task)."""

    def __init__(self, pairs: Pairs, order: np.ndarray | None, offsets: np.ndarray):
        self.pairs, self.order, self.offsets = pairs, order, offsets
        self.reference: np.ndarray | None = None
        if order is None:
            ends = pairs.sequences.offsets
            first, last = 2 * np.asarray(offsets[:-1]), 2 * np.asarray(offsets[1:])
            self.lengths = np.asarray(ends[last] - ends[first]) if len(offsets) > 1 else np.zeros(0, np.int64)
        else:
            self.lengths = None  # packed rows are all as wide

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def pair_ids(self, i: int) -> list[int]:
        """The pairs of sample i, in order."""
        if self.order is None:
            return [int(self.offsets[i])]
        return [int(p) for p in self.order[int(self.offsets[i]):int(self.offsets[i + 1])]]

    def all_pairs(self) -> range | np.ndarray:
        """Every pair this set's samples hold (a split's part)."""
        if self.order is None:
            return range(int(self.offsets[0]), int(self.offsets[-1])) if len(self) else range(0)
        return np.asarray(self.order[int(self.offsets[0]):int(self.offsets[-1])])


@dataclass
class PrefData:
    tokenizer_dir: Path
    train: PairSet
    validation: PairSet
    end_of_turn: list[int]
    summary: dict
    template_tokens: list[int] = field(default_factory=list)
