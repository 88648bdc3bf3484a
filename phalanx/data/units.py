"""A store of units of whole sequences with target masks, packed into rows: the one store under chat (a unit
is a conversation: data/chat/store.py) and preference tuning (a unit is a pair, its chosen and its rejected
sequence: data/pref/store.py). Each of those record formats says how a record becomes a unit; what a store
of units is, how it is finished, packed, opened, sampled, shown and gated is written here once.

Per token: ids and a target mask; per sequence: its length and whether it was truncated. Sequence s of a
split is ids/mask[offsets[s]:offsets[s+1]]; unit u is sequences u*k .. u*k+k-1 (k = the format's
`sequences`). A record that cannot be used is dropped and counted with its reason (counts.py; the gate of
data.max_dropped_fraction is `dropped_error`). Once every shard of a split exists, `finish` packs whole
units into rows of k x model.block_size tokens by best-fit decreasing on their lengths (`pack`: a function
of the lengths only, never of the preparing processes or the world size): pack_order.npy (units in row
order) and pack_offsets.npy (where each row starts in it). Without data.validation the last
data.val_fraction of the units are held out, and each part is packed on its own (a row never mixes them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from phalanx.core.config import Config, ConfigError
from phalanx.data import counts, layout, prepare, store
from phalanx.data.sources import Split, splits


class UnitFormat(prepare.RecordFormat):
    """A record format whose store holds units of `sequences` sequences (see the module docstring); a
    subclass says how a record is read and encoded (fields, settings, job, encode)."""
    sequences = 1                      # per unit
    unit = "conversation"              # what a unit is called (summaries, --show, errors)
    names: tuple[str, ...] = ("",)     # each sequence's name in --show
    token_arrays = {"ids": None, "mask": "uint8"}
    row_arrays = {"lengths": "uint32", "truncated": "uint8"}

    def width(self, cfg: Config) -> int:
        """A packed row's tokens: k x model.block_size (each sequence fits model.block_size)."""
        return self.sequences * cfg.model.block_size

    def write(self, writer: store.ShardWriter, kept: list) -> None:
        """One write of a batch of kept units (each with `.sequences`: ids, mask, truncated): a write per unit
        costs more than encoding it."""
        seqs = [s for unit in kept for s in unit.sequences]
        if seqs:
            writer.tokens(ids=np.concatenate([s.ids for s in seqs]), mask=np.concatenate([s.mask for s in seqs]))
            writer.rows(lengths=[len(s.ids) for s in seqs], truncated=[s.truncated for s in seqs])

    def finish(self, cfg: Config, split: Split, folder: Path, records: list[dict], done: dict[str, dict]) -> dict:
        lengths = np.diff(np.load(folder / "offsets.npy", mmap_mode="r"))
        summary = counts.summary(records)
        if not len(lengths):
            raise ConfigError(f"config key '{split.key}': no {self.unit} of '{split.spec or 'built-in data'}' has a "
                              f"token to train on after truncation to model.block_size={cfg.model.block_size} "
                              f"({summary['dropped']} dropped: {reasons(summary)}); raise model.block_size or "
                              f"check the chat template and the task's record settings")
        flags = [layout.shard_array(folder, r, "truncated") for r in records if r["rows"]]
        np.save(folder / "truncated.npy", np.concatenate(flags).astype(np.uint8))
        sizes = lengths.reshape(-1, self.sequences).sum(1)
        out = {**summary, f"{self.unit}s": len(sizes), "supervised_tokens": sum(r["supervised"] for r in records),
               "end_of_turn": sorted({e for r in records for e in r["end_of_turn"]}),
               "template_tokens": sorted({t for r in records for t in r.get("template_tokens", [])})}
        if cfg.data.packing:
            width = self.width(cfg)
            cut = training_units(cfg, len(sizes)) if split.name == "train" else len(sizes)
            parts = [pack(sizes[:cut], width), pack(sizes[cut:], width, cut)]
            offsets = np.concatenate([parts[0][1], parts[1][1][1:] + parts[0][1][-1]])
            np.save(folder / "pack_order.npy", np.concatenate([p[0] for p in parts]))
            np.save(folder / "pack_offsets.npy", offsets)
            out.update(packed_rows=len(offsets) - 1, train_packed_rows=len(parts[0][1]) - 1,
                       packing_efficiency=round(float(sizes.sum()) / max((len(offsets) - 1) * width, 1), 4))
        return out

    def open(self, cfg: Config, tok_dir: Path, folders: dict[str, Path]) -> UnitData:
        index = layout.read_index(folders["train"])
        train, packed = Units(folders["train"], self.sequences), cfg.data.packing
        if "validation" in folders:
            sets = (train.view(packed), Units(folders["validation"], self.sequences).view(packed))
        else:
            cut = index.get("train_packed_rows") if packed else training_units(cfg, train.n)
            sets = (train.view(packed, 0, cut), train.view(packed, cut, None))
        return UnitData(tok_dir, *sets, end_of_turn=index["end_of_turn"], summary=index["summary"],
                        template_tokens=index.get("template_tokens", []))


def training_units(cfg: Config, n: int) -> int:
    """Units of the training store used for training: all, or all but data.val_fraction."""
    return n if cfg.data.validation else max(1, int(round(n * (1 - cfg.data.val_fraction))))


def reasons(summary: dict) -> str:
    return ", ".join(f"{counts.WHY[r]} {n}" for r, n in summary.get("dropped_by", {}).items()) or "none"


def dropped_error(cfg: Config, fmt: UnitFormat, truncation: str = "keep_end") -> str | None:
    """data.max_dropped_fraction over the prepared stores of `cfg` (read from their index: a store over the
    limit is complete, so raising the key does not prepare again); `truncation`: the task's setting, for the
    fix the message names."""
    tok_dir = prepare.tokenizer_folder(cfg, fmt)
    for split in splits(cfg):
        index = layout.read_index(prepare.store_folder(cfg, fmt, split, tok_dir))
        message = index and counts.gate(split.key, split.spec or "built-in data", index,
                                        cfg.data.max_dropped_fraction, truncation, cfg.model.block_size)
        if message:
            return message
    return None


# ---- packing ------------------------------------------------------------------------------------------
class _FirstFit:
    """Capacities 0..size with a list of open rows each; `at_least(c)` finds the smallest capacity >= c
    that has a row from a bit set of the non-empty capacities (a Python int: a shift and the lowest set
    bit), so best fit costs a few operations per unit."""

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
    """Best-fit decreasing: units (ids first + i) longest first, each into the open row whose free space fits
    it most tightly, else a new row. Returns (unit ids in row order, row offsets). Deterministic: a function
    of the lengths only."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and lengths.max() > block:
        raise ValueError(f"a unit of {lengths.max()} tokens does not fit a row of {block}")
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
class Units:
    """A split's units, memory-mapped: sequence s is ids/mask[offsets[s]:offsets[s+1]], unit u its
    `sequences` consecutive sequences; `truncated` per sequence."""

    def __init__(self, folder: Path, sequences: int = 1):
        self.folder, self.k = folder, sequences
        self.ids, self.mask = store.TokenStore(folder, "ids"), store.TokenStore(folder, "mask")
        self.offsets = np.load(folder / "offsets.npy", mmap_mode="r")
        self.truncated = np.load(folder / "truncated.npy", mmap_mode="r")
        self.n = (len(self.offsets) - 1) // sequences

    def sequence(self, s: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = int(self.offsets[s]), int(self.offsets[s + 1])
        return self.ids[lo:hi].astype(np.int64), self.mask[lo:hi].astype(bool)

    def unit(self, u: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Unit u's sequences' (ids, targets)."""
        return [self.sequence(self.k * u + j) for j in range(self.k)]

    def view(self, packed: bool, lo: int = 0, hi: int | None = None) -> UnitSet:
        """Samples lo..hi: packed rows, each a run of whole units of pack_order, or (unpacked) one unit each."""
        if packed:
            offsets = np.load(self.folder / "pack_offsets.npy", mmap_mode="r")
            order = np.load(self.folder / "pack_order.npy", mmap_mode="r")
            hi = len(offsets) - 1 if hi is None else hi
            return UnitSet(self, order, offsets[lo:hi + 1])
        hi = self.n if hi is None else hi
        return UnitSet(self, None, np.arange(lo, hi + 1, dtype=np.int64))


class UnitSet:
    """The samples the sampler hands out: packed rows (each a run of whole units of `order`), or single units
    (`order` None: sample i is unit offsets[i]). `reference`: per-unit values a task attaches (preference
    tuning's stored reference log-probs), or None."""

    def __init__(self, units: Units, order: np.ndarray | None, offsets: np.ndarray):
        self.units, self.order, self.offsets = units, order, offsets
        self.reference: np.ndarray | None = None
        if order is None:
            ends, k = units.offsets, units.k
            self.lengths = np.asarray(ends[k * np.asarray(offsets[1:])] - ends[k * np.asarray(offsets[:-1])]) \
                if len(offsets) > 1 else np.zeros(0, np.int64)
        else:
            self.lengths = None  # packed rows are all as wide

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def unit_ids(self, i: int) -> list[int]:
        """The units of sample i, in order."""
        if self.order is None:
            return [int(self.offsets[i])]
        return [int(u) for u in self.order[int(self.offsets[i]):int(self.offsets[i + 1])]]

    def sequences(self, i: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Sample i's sequences' (ids, targets), unit by unit."""
        return [s for u in self.unit_ids(i) for s in self.units.unit(u)]

    def all_units(self) -> range | np.ndarray:
        """Every unit this set's samples hold (a split's part)."""
        if self.order is None:
            return range(int(self.offsets[0]), int(self.offsets[-1])) if len(self) else range(0)
        return np.asarray(self.order[int(self.offsets[0]):int(self.offsets[-1])])


@dataclass
class UnitData:
    tokenizer_dir: Path
    train: UnitSet
    validation: UnitSet
    end_of_turn: list[int]
    summary: dict
    template_tokens: list[int] = field(default_factory=list)  # special and added tokens the template writes


# ---- --show ---------------------------------------------------------------------------------------------
def show(cfg: Config, fmt: UnitFormat, n: int) -> str:
    """The first `n` training units (in the order of the records) as the model sees them: what a unit's
    sequences share before their first target (a pair's prompt) once, then each sequence with its targets in
    [[...]]."""
    from phalanx.data.tokenizer import load_saved  # transformers: only where units are shown

    data = prepare.open_prepared(cfg, fmt)
    tok, units, out = load_saved(data.tokenizer_dir), data.train.units, []
    for u in np.sort(np.asarray(data.train.all_units()))[:n]:
        seqs = units.unit(int(u))
        head = _shared_head(seqs) if len(seqs) > 1 else 0
        parts = [f"{name or fmt.unit} {len(ids) - head} tokens, {int(mask.sum())} targets"
                 for name, (ids, mask) in zip(fmt.names, seqs)]
        cut = any(units.truncated[units.k * int(u) + j] for j in range(units.k))
        lines = [f"--- {fmt.unit} {int(u)} ({'; '.join(([f'prompt {head} tokens'] if head else []) + parts)}"
                 f"{'; truncated' if cut else ''})"]
        if head:
            lines.append(f"[prompt]\n{tok.decode(seqs[0][0][:head].tolist())}")
        for name, (ids, mask) in zip(fmt.names, seqs):
            lines.append((f"[{name}]\n" if name else "") + marked(tok, ids[head:], mask[head:]))
        out.append("\n".join(lines))
    return "\n".join(out)


def _shared_head(seqs: list) -> int:
    """Tokens all sequences share before any of them has a target."""
    ids = [s[0] for s in seqs]
    n = min(len(x) for x in ids)
    same = int(np.argmin(np.append(np.all([x[:n] == ids[0][:n] for x in ids], axis=0), False)))
    return min(same, *(int(np.argmax(m)) for _, m in seqs))


def marked(tok, ids: np.ndarray, mask: np.ndarray) -> str:
    """The tokens decoded, runs of targets in [[...]]."""
    parts, start = [], 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or mask[k] != mask[start]:
            text = tok.decode(ids[start:k].tolist())
            parts.append(f"[[{text}]]" if mask[start] else text)
            start = k
    return "".join(parts)
