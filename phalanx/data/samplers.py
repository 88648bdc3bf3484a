"""Deterministic distributed sampling by global sample offset.

The training order is one stream: epoch 0's permutation, then epoch 1's, ... each seeded by
(seed, epoch) as in `DistributedSampler.set_epoch`. Optimizer step s consumes stream positions
[s*G, (s+1)*G) for the global batch size G, so:
  * every sample is used exactly once per epoch, with no padding duplicates and nothing dropped
    (a global batch may straddle an epoch boundary);
  * the position is a single *global* offset, so a checkpoint resumes on any number of processes;
  * a global batch is cut into micro-batches the same way whatever the world size (micro-batch j goes
    to rank j % world at accumulation step j // world), so N processes see the same micro-batches as one.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

EpochOrder = Callable[[int, np.random.Generator], np.ndarray]


def permutation(n: int, rng: np.random.Generator) -> np.ndarray:
    """rng.permutation(n), the same numbers, in uint32: the order array is the one thing per rank that
    grows with the corpus (one integer per sample), so it is kept at 4 bytes per sample, not 8."""
    order = np.arange(n, dtype=np.uint32 if n < 2**32 else np.int64)
    rng.shuffle(order)
    return order


class FeistelPermutation:
    """A seeded bijection of range(n) evaluated per position: `perm[a:b]` costs O(b - a) time and memory,
    whatever n. A balanced Feistel network on the smallest even number of bits covering n (a bijection of
    [0, 2^bits), at most 4n), restricted to [0, n) by cycle-walking: a value >= n is mapped again until it
    falls inside, which keeps it a bijection. Rounds use a splitmix64 finaliser of (half, round key)."""
    ROUNDS = 6
    CHUNK = 1 << 16
    _C1, _C2, _GOLDEN = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)

    def __init__(self, n: int, rng: np.random.Generator):
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = np.uint64((bits + 1) // 2)
        self.mask = np.uint64((1 << int(self.half)) - 1)
        self.keys = rng.integers(0, 2**63, size=self.ROUNDS, dtype=np.uint64)
        self._cached: tuple[int, np.ndarray] = (-1, np.empty(0, dtype=np.int64))

    def __len__(self) -> int:
        return self.n

    def _round(self, r: np.ndarray, key: np.uint64) -> np.ndarray:
        x = (r + key) * self._GOLDEN  # uint64 arrays wrap modulo 2^64 (no overflow warning for arrays)
        x ^= x >> np.uint64(30)
        x *= self._C1
        x ^= x >> np.uint64(27)
        x *= self._C2
        x ^= x >> np.uint64(31)
        return x & self.mask

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ self._round(right, key)
        return (left << self.half) | right

    def _values(self, start: int, stop: int) -> np.ndarray:
        out = self._encrypt(np.arange(start, stop, dtype=np.uint64))
        outside = out >= self.n
        while outside.any():
            out[outside] = self._encrypt(out[outside])
            outside = out >= self.n
        return out.astype(np.int64)

    def _chunk(self, c: int) -> np.ndarray:
        """Positions [c * CHUNK, (c + 1) * CHUNK): computed together (numpy's per-call cost and the longest
        cycle-walk are paid once per 64K positions, not per batch) and the latest chunk kept (512 KB)."""
        if self._cached[0] != c:
            self._cached = (c, self._values(c * self.CHUNK, min(self.n, (c + 1) * self.CHUNK)))
        return self._cached[1]

    def __getitem__(self, s: slice) -> np.ndarray:
        start, stop, _ = s.indices(self.n)
        parts, pos = [], start
        while pos < stop:
            c = pos // self.CHUNK
            base = c * self.CHUNK
            hi = min(stop, base + self.CHUNK)
            parts.append(self._chunk(c)[pos - base:hi - base])
            pos = hi
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


def shuffled_order(n: int, lazy: bool = False) -> EpochOrder:
    """A random order of range(n) per epoch. lazy (data order 3): a FeistelPermutation, nothing stored;
    else (data orders 1-2) the materialised permutation, one integer per sample per rank."""
    if lazy:
        return lambda epoch, rng: FeistelPermutation(n, rng)
    return lambda epoch, rng: permutation(n, rng)


def length_grouped_order(lengths: Sequence[int], micro_batch_size: int, mega_batches: int = 64,
                         unit: int | None = None) -> EpochOrder:
    """Shuffle, cut into mega-batches, sort each by length, cut into units, shuffle those.

    A unit is `unit` consecutive positions (default: one micro-batch). Within a unit samples have similar
    lengths, so padding to the longest in a micro-batch wastes little, while the order stays random at
    the unit level. With the global batch as the unit, all ranks' micro-batches of one step come from
    one sorted run and take about the same time; with single micro-batches shuffled (the order of
    checkpoints written before data order 2), a step pairs a long micro-batch on one rank with a short
    one on another, which then waits at the gradient all-reduce (~25% of the step on SST-2, 2 ranks).
    """
    lengths = np.asarray(lengths)
    n = len(lengths)
    unit = unit or micro_batch_size
    mega = -(-micro_batch_size * mega_batches // unit) * unit  # mega_batches micro-batches, whole units

    def order(epoch: int, rng: np.random.Generator) -> np.ndarray:
        perm = permutation(n, rng)
        # The stream is cut into units at multiples of `unit` counted from epoch 0, so when n is not a
        # multiple, epoch e starts `lead` positions before a cut: those samples complete the previous
        # epoch's last unit, and the groups start after them (else every unit of the epoch would
        # straddle two groups).
        lead = min((-epoch * n) % unit, n)
        rest = perm[lead:]
        chunks = []
        for start in range(0, len(rest), mega):
            block = rest[start:start + mega]
            chunks.append(block[np.argsort(-lengths[block], kind="stable")])
        grouped = np.concatenate(chunks) if chunks else rest
        units = [grouped[i:i + unit] for i in range(0, len(grouped), unit)]
        # Keep a trailing short unit last so all others stay full within the epoch.
        head, tail = (units[:-1], units[-1:]) if len(grouped) % unit else (units, [])
        picks = rng.permutation(len(head))
        return np.concatenate([perm[:lead]] + [head[i] for i in picks] + tail)

    return order


# ---- shards: the windowed order (data order 4) and what the order needs next ---------------------------
GLOBAL, WINDOWED = 3, 4  # data order versions (run/state.py) of data.order=global / windowed


def order_version(order: str, store_url: str) -> int:
    """The data order a fresh run records: windowed when asked, or by default for a remote store."""
    return WINDOWED if order == "windowed" or (order == "auto" and bool(store_url)) else GLOBAL


def lookahead_shards(version: int, window: int, global_batch: int) -> int:
    """At most how many shards the order needs at once (the cache must hold them): the windows a global
    batch draws from (two, while a window holds at least a global batch of samples) and the one after
    them, each of which may end in the first shard of the next; or two global batches of samples that may
    each cross a shard boundary; and two for an evaluation reading the held-out tail."""
    return 3 * (window + 1) + 2 if version >= WINDOWED else 4 * global_batch + 2


class ShardPlan:
    """Which shards a dataset's samples touch, for samples in corpus order over one token stream cut into
    shards (`starts`: where each shard starts, one more for the end). `span(indices)` gives each sample's
    token range (lo, hi). Sample i belongs to the shard of its first token: group k holds samples
    [bounds[k], bounds[k + 1]), and reach[k] is the last shard those touch."""

    def __init__(self, n: int, span, starts: np.ndarray):
        self.span, self.starts = span, np.asarray(starts, dtype=np.int64)
        shards = len(self.starts) - 1
        self.bounds = np.array([self._first_from(int(self.starts[k]), n) for k in range(shards)] + [n], np.int64)
        self.reach = np.arange(shards, dtype=np.int64)
        for k in range(shards):
            if self.bounds[k + 1] > self.bounds[k]:
                self.reach[k] = self.shards_of(np.array([self.bounds[k + 1] - 1])).max()

    @classmethod
    def of(cls, dataset) -> ShardPlan:
        """The plan of a task's dataset (`token_span`, `stores()`: its TokenStores, one stream)."""
        return cls(len(dataset), dataset.token_span, dataset.stores()[0].starts)

    def _first_from(self, token: int, n: int) -> int:
        lo, hi = 0, n  # the first sample whose first token is at or after `token`
        while lo < hi:
            mid = (lo + hi) // 2
            if self.span(np.array([mid]))[0][0] >= token:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def shards_of(self, indices: np.ndarray) -> np.ndarray:
        """The shards samples `indices` read, each once, in order of first need."""
        if not len(indices):
            return np.zeros(0, dtype=np.int64)
        lo, hi = self.span(np.asarray(indices))
        first = np.searchsorted(self.starts, lo, side="right") - 1
        last = np.searchsorted(self.starts, np.maximum(hi - 1, lo), side="right") - 1
        ranges = np.concatenate([np.arange(a, b + 1) for a, b in zip(first, last)])
        _, at = np.unique(ranges, return_index=True)
        return ranges[np.sort(at)]

    def window_shards(self, w: int, window: int) -> np.ndarray:
        """Shards the samples of window w (its groups [w * window, (w + 1) * window)) read."""
        a, b = w * window, min((w + 1) * window, len(self.reach))
        return np.arange(a, max(int(self.reach[a:b].max()) + 1, b))


class WindowedPermutation:
    """One epoch of the windowed order: windows of `window` consecutive shard groups in a shuffled order,
    the samples of each in a shuffled order (a FeistelPermutation per window: nothing per sample is
    stored). A function of the rng (seed, epoch) and the plan only."""

    def __init__(self, plan: ShardPlan, window: int, rng: np.random.Generator):
        groups = len(plan.bounds) - 1
        count = -(-groups // window)
        self.window = window
        self.edges = plan.bounds[np.minimum(np.arange(count + 1) * window, groups)]
        self.perm = rng.permutation(count)
        self.keys = rng.integers(0, 2**63, size=count, dtype=np.uint64)
        self.cum = np.concatenate([[0], np.cumsum(np.diff(self.edges)[self.perm])]).astype(np.int64)
        self._inner: dict[int, FeistelPermutation] = {}

    def __len__(self) -> int:
        return int(self.cum[-1])

    def slot_of(self, pos: int) -> int:
        return int(np.searchsorted(self.cum, pos, side="right")) - 1

    def _within(self, w: int) -> FeistelPermutation:
        if w not in self._inner:
            if len(self._inner) > 4:
                self._inner.clear()
            size = int(self.edges[w + 1] - self.edges[w])
            self._inner[w] = FeistelPermutation(size, np.random.default_rng(int(self.keys[w])))
        return self._inner[w]

    def __getitem__(self, s: slice) -> np.ndarray:
        start, stop, _ = s.indices(len(self))
        parts, pos = [], start
        while pos < stop:
            slot = self.slot_of(pos)
            w, base = int(self.perm[slot]), int(self.cum[slot])
            hi = min(stop, int(self.cum[slot + 1]))
            parts.append(self.edges[w] + self._within(w)[pos - base:hi - base])
            pos = hi
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


def windowed_order(plan: ShardPlan, window: int) -> EpochOrder:
    """Data order 4: see WindowedPermutation."""
    return lambda epoch, rng: WindowedPermutation(plan, window, rng)


class GlobalBatchSampler:
    """Maps a global sample offset to the indices of the next global batch, and to this rank's share."""

    def __init__(self, num_samples: int, global_batch_size: int, micro_batch_size: int, seed: int,
                 order: EpochOrder | None = None, repeat: int = 1):
        if num_samples < 1:
            raise ValueError("the training set is empty")
        self.n = num_samples
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.order = order or shuffled_order(num_samples)
        self.repeat = repeat  # each global batch is drawn this many steps in a row (GRPO's num_iterations)
        self._cache: dict[int, np.ndarray] = {}
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose permutation is used next (derived from the offset by `global_batch`)."""
        self.epoch = epoch
        self._cache = {e: v for e, v in self._cache.items() if e >= epoch}

    def epoch_indices(self, epoch: int) -> np.ndarray:
        if epoch not in self._cache:
            rng = np.random.default_rng([self.seed, epoch])
            self._cache[epoch] = self.order(epoch, rng)
        return self._cache[epoch]

    def stream(self, start: int, count: int) -> np.ndarray:
        out, pos = [], start
        while pos < start + count:
            epoch, within = divmod(pos, self.n)
            take = min(self.n - within, start + count - pos)
            out.append(self.epoch_indices(epoch)[within:within + take])
            pos += take
        return np.concatenate(out)

    def source(self, offset: int) -> int:
        """The offset in the order that the step at global sample offset `offset` draws from: itself, or with
        `repeat` r the first of the r steps that share its global batch (TRL's RepeatSampler, per batch)."""
        g = self.global_batch_size * self.repeat
        return offset if self.repeat == 1 else offset // g * self.global_batch_size

    def epochs(self, offset: int) -> float:
        """Passes over the training set up to global sample offset `offset`."""
        return self.source(offset) / self.n

    def global_batch(self, offset: int) -> np.ndarray:
        offset = self.source(offset)
        epoch = offset // self.n
        if epoch != self.epoch:
            self.set_epoch(epoch)
        return self.stream(offset, self.global_batch_size)

    def shards_ahead(self, offset: int, plan: ShardPlan) -> list[int]:
        """The shards the order needs from global offset `offset` on, in order of need: with the windowed
        order, those of the windows the next global batch draws from and of the window after them; with
        another, those of the next two global batches."""
        g, offset = self.global_batch_size, self.source(offset)
        order = self.epoch_indices(offset // self.n)
        if not isinstance(order, WindowedPermutation):
            return plan.shards_of(self.stream(offset, 2 * g)).tolist()
        windows, pos = [], offset
        while pos < offset + g:
            epoch, within = divmod(pos, self.n)
            order = self.epoch_indices(epoch)
            slot = order.slot_of(within)
            windows.append(int(order.perm[slot]))
            pos = epoch * self.n + int(order.cum[slot + 1])
        epoch, within = divmod(pos, self.n)  # the window after them (maybe the next epoch's first)
        windows.append(int(self.epoch_indices(epoch).perm[self.epoch_indices(epoch).slot_of(within)]))
        shards = np.concatenate([plan.window_shards(w, order.window) for w in windows])
        return list(dict.fromkeys(shards.tolist()))

    def rank_micro_batches(self, global_indices: np.ndarray, rank: int, world_size: int) -> list[np.ndarray]:
        """This rank's micro-batches, in accumulation order."""
        m = self.micro_batch_size
        micro = [global_indices[i:i + m] for i in range(0, len(global_indices), m)]
        return micro[rank::world_size]

    def micro_batch_ids(self, rank: int, world_size: int) -> list[int]:
        """Global micro-batch numbers of this rank's micro-batches (seeds dropout per micro-batch)."""
        total = self.global_batch_size // self.micro_batch_size
        return list(range(total))[rank::world_size]
