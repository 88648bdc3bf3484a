"""The distributed sampler: every sample once per epoch across ranks, deterministic, reshuffled per epoch."""
from __future__ import annotations

import numpy as np
import pytest

from phalanx.data.samplers import GlobalBatchSampler, length_grouped_order
from phalanx.run.evaluate import eval_shard


def epoch_assignments(n, global_bs, micro, world, seed, epoch, order=None):
    """(rank -> indices) for all positions of `epoch` in the stream, as the training loop would consume them."""
    per_rank = {r: [] for r in range(world)}
    s = GlobalBatchSampler(n, global_bs, micro, seed, order)
    steps = (n * (epoch + 1) + global_bs - 1) // global_bs + 1
    pos = 0
    for step in range(steps):
        g = s.global_batch(step * global_bs)
        for r in range(world):
            for k, mb in enumerate(s.rank_micro_batches(g, r, world)):
                j = r + k * world  # global micro-batch number
                for t, idx in enumerate(mb):
                    p = step * global_bs + j * micro + t
                    if epoch * n <= p < (epoch + 1) * n:
                        per_rank[r].append(int(idx))
        pos += global_bs
    return per_rank


@pytest.mark.parametrize("n,world", [(100, 1), (100, 2), (101, 3), (37, 4), (64, 2), (99, 2), (103, 1), (102, 4)])
@pytest.mark.parametrize("grouped", [False, True])
def test_every_sample_exactly_once_per_epoch_disjoint_across_ranks(n, world, grouped):
    micro = 4
    gbs = micro * world * 2
    lengths = np.random.default_rng(0).integers(1, 50, size=n)
    order = length_grouped_order(lengths, micro, mega_batches=4) if grouped else None
    for epoch in (0, 1, 2):
        per_rank = epoch_assignments(n, gbs, micro, world, seed=7, epoch=epoch, order=order)
        all_idx = [i for r in per_rank for i in per_rank[r]]
        assert sorted(all_idx) == list(range(n)), f"epoch {epoch}: not a cover without repeats"
        for a in range(world):
            for b in range(a + 1, world):
                assert not set(per_rank[a]) & set(per_rank[b])


def test_order_is_deterministic_and_changes_with_epoch():
    a = GlobalBatchSampler(1000, 32, 8, seed=3)
    b = GlobalBatchSampler(1000, 32, 8, seed=3)
    c = GlobalBatchSampler(1000, 32, 8, seed=4)
    assert np.array_equal(a.epoch_indices(0), b.epoch_indices(0))
    assert not np.array_equal(a.epoch_indices(0), a.epoch_indices(1))
    assert not np.array_equal(a.epoch_indices(0), c.epoch_indices(0))
    a.set_epoch(1)
    assert np.array_equal(a.global_batch(1000), b.epoch_indices(1)[:32])


def test_global_batch_is_world_size_independent():
    """The same micro-batches exist whatever the world size; only their assignment to ranks differs."""
    s = GlobalBatchSampler(500, 48, 8, seed=1)
    g = s.global_batch(96)
    for world in (1, 2, 3, 6):
        micro = sorted(tuple(mb) for r in range(world) for mb in s.rank_micro_batches(g, r, world))
        assert micro == sorted(tuple(g[i:i + 8]) for i in range(0, 48, 8))


def test_length_grouping_reduces_padding():
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 120, size=4000)
    micro = 16

    def pad_fraction(order):
        mbs = [order[i:i + micro] for i in range(0, len(order), micro)]
        padded = sum(len(mb) * lengths[mb].max() for mb in mbs)
        return 1 - lengths.sum() / padded

    grouped = length_grouped_order(lengths, micro)(0, np.random.default_rng(1))
    plain = np.random.default_rng(1).permutation(len(lengths))
    assert sorted(grouped) == list(range(len(lengths)))
    assert pad_fraction(grouped) < 0.1 < pad_fraction(plain)


def test_grouped_order_is_deterministic_and_changes_with_epoch():
    lengths = np.random.default_rng(0).integers(1, 60, size=203)
    a = GlobalBatchSampler(203, 16, 4, seed=5, order=length_grouped_order(lengths, 4, mega_batches=8))
    b = GlobalBatchSampler(203, 16, 4, seed=5, order=length_grouped_order(lengths, 4, mega_batches=8))
    c = GlobalBatchSampler(203, 16, 4, seed=6, order=length_grouped_order(lengths, 4, mega_batches=8))
    for epoch in (0, 1, 2):
        assert np.array_equal(a.epoch_indices(epoch), b.epoch_indices(epoch))
        assert sorted(a.epoch_indices(epoch)) == list(range(203))
    assert not np.array_equal(a.epoch_indices(0), a.epoch_indices(1))
    assert not np.array_equal(a.epoch_indices(0), c.epoch_indices(0))


def test_grouping_stays_aligned_with_micro_batches_in_later_epochs():
    """n not a multiple of the micro-batch: epoch e starts mid micro-batch, and the groups follow it."""
    lengths = np.random.default_rng(0).integers(5, 120, size=4001)
    micro, gbs = 16, 64
    s = GlobalBatchSampler(len(lengths), gbs, micro, seed=2, order=length_grouped_order(lengths, micro))
    stream = s.stream(0, 3 * len(lengths) + 3)  # epochs 0, 1, 2 as the loop consumes them
    mbs = [stream[i:i + micro] for i in range(0, len(stream) - micro + 1, micro)]
    for epoch in (0, 1, 2):
        inside = mbs[epoch * len(lengths) // micro + 1:(epoch + 1) * len(lengths) // micro - 1]
        padded = sum(len(mb) * lengths[mb].max() for mb in inside)
        assert 1 - sum(lengths[mb].sum() for mb in inside) / padded < 0.1, f"epoch {epoch}"


@pytest.mark.parametrize("n,world", [(872, 3), (10, 4), (3, 4)])
def test_eval_shards_cover_exactly(n, world):
    got = [i for r in range(world) for i in eval_shard(n, r, world)]
    assert got == list(range(n))


def test_compact_permutation_is_numpys_permutation():
    """The uint32 order array is the very permutation rng.permutation gives (trajectories unchanged)."""
    from phalanx.data.samplers import permutation

    for n in (1, 17, 100_003):
        got = permutation(n, np.random.default_rng([3, 1]))
        assert got.dtype == np.uint32 and np.array_equal(got, np.random.default_rng([3, 1]).permutation(n))


def test_grouping_by_global_batch_balances_the_ranks_of_a_step():
    """Unit = global batch: a step's micro-batches are one sorted run, so the ranks' longest sequences
    (what each rank's step time follows) are close; unit = micro-batch pairs unrelated lengths."""
    lengths = np.random.default_rng(0).integers(3, 60, size=8000)
    micro, gbs, world = 32, 64, 2

    def mean_gap(unit):
        s = GlobalBatchSampler(len(lengths), gbs, micro, seed=3,
                               order=length_grouped_order(lengths, micro, unit=unit))
        gaps = []
        for step in range(len(lengths) // gbs):
            g = s.global_batch(step * gbs)
            longest = [lengths[np.concatenate(s.rank_micro_batches(g, r, world))].max() for r in range(world)]
            gaps.append(max(longest) - min(longest))
        return np.mean(gaps), s.stream(0, len(lengths))

    by_step, order = mean_gap(gbs)
    by_micro, _ = mean_gap(micro)
    assert sorted(order) == list(range(len(lengths)))
    assert by_step < 1.0 < 5 * by_step < by_micro
    legacy = length_grouped_order(lengths, micro)(0, np.random.default_rng(1))
    assert np.array_equal(legacy, length_grouped_order(lengths, micro, unit=micro)(0, np.random.default_rng(1)))


@pytest.mark.parametrize("n", [1, 2, 3, 7, 1000, 65_536, 65_537, 200_003])
def test_feistel_order_is_a_permutation_computed_per_slice(n):
    from phalanx.data.samplers import FeistelPermutation

    full = FeistelPermutation(n, np.random.default_rng([3, 0]))[0:n]
    assert np.array_equal(np.sort(full), np.arange(n))
    again = FeistelPermutation(n, np.random.default_rng([3, 0]))
    cuts = sorted({0, n, n // 3, n // 2, max(0, n - 5)})
    assert np.array_equal(np.concatenate([again[a:b] for a, b in zip(cuts, cuts[1:])]), full)
    if n >= 1000:
        other = FeistelPermutation(n, np.random.default_rng([3, 1]))[0:n]  # next epoch: another order
        assert (other != full).mean() > 0.99
        assert abs(np.corrcoef(np.arange(n), full)[0, 1]) < 0.05  # no trace of the identity


def test_lazy_order_keeps_sampler_guarantees_and_memory_flat():
    """Data order 3: every sample once per epoch, any world size sees the same batches, and the sampler
    holds no per-sample array however large the corpus."""
    from phalanx.data.samplers import shuffled_order

    n, gbs = 1003, 24
    s = GlobalBatchSampler(n, gbs, 4, seed=9, order=shuffled_order(n, lazy=True))
    stream = np.concatenate([s.global_batch(off) for off in range(0, 3 * n - gbs, gbs)])
    for epoch in range(2):
        assert np.array_equal(np.sort(stream[epoch * n:(epoch + 1) * n]), np.arange(n))
    huge = GlobalBatchSampler(4_000_000_000, gbs, 4, seed=9, order=shuffled_order(4_000_000_000, lazy=True))
    batch = huge.global_batch(123_456_789 * gbs)
    assert len(set(batch.tolist())) == gbs and batch.max() < 4_000_000_000
    assert sum(getattr(v, "nbytes", 0) for v in vars(huge.epoch_indices(0)).values()) < 2**20


def _sharded_blocks(shards: int = 40, block: int = 8, seed: int = 0):
    """A token stream cut into shards of uneven sizes, read as blocks of block+1 tokens (LM's windows:
    a block crosses into the next shard), and its ShardPlan."""
    from phalanx.data.samplers import ShardPlan

    starts = np.concatenate([[0], np.cumsum(np.random.default_rng(seed).integers(20, 60, size=shards))])
    n = int((starts[-1] - 1) // block)

    def span(idx):
        lo = np.asarray(idx, dtype=np.int64) * block
        return lo, lo + block + 1
    return n, ShardPlan(n, span, starts)


def test_windowed_order_keeps_the_sampler_guarantees_and_batches_near_their_shards():
    """Data order 4: every sample once per epoch, a function of (seed, epoch, position) only; a global batch
    draws from at most two windows, and shards_ahead always holds what the next batch reads (across epoch
    boundaries too) within the lookahead the cache is checked against. The global order's batches
    spread over the whole store (the control)."""
    from phalanx.data.samplers import WINDOWED, lookahead_shards, shuffled_order, windowed_order

    n, plan = _sharded_blocks()
    gbs, window = 16, 4
    s = GlobalBatchSampler(n, gbs, 4, seed=5, order=windowed_order(plan, window))
    stream = np.concatenate([s.global_batch(off) for off in range(0, 3 * n - gbs, gbs)])
    for epoch in range(2):
        assert np.array_equal(np.sort(stream[epoch * n:(epoch + 1) * n]), np.arange(n))
    again = GlobalBatchSampler(n, gbs, 4, seed=5, order=windowed_order(plan, window))
    assert np.array_equal(again.stream(n + 37, 300), s.stream(n + 37, 300))  # resumed anywhere: the same
    assert not np.array_equal(s.stream(0, n), s.stream(n, n))  # epochs differ
    limit = lookahead_shards(WINDOWED, window, gbs)
    spread = {}
    for name, sampler in (("windowed", s), ("global", GlobalBatchSampler(n, gbs, 4, 5, shuffled_order(n, True)))):
        touched = []
        for off in range(0, 2 * n, gbs):
            need, ahead = plan.shards_of(sampler.stream(off, gbs)), sampler.shards_ahead(off, plan)
            assert set(need.tolist()) <= set(ahead), (name, off)
            touched.append(len(need))
            if name == "windowed":
                assert len(ahead) <= limit - 2
                groups = np.searchsorted(plan.bounds, sampler.stream(off, gbs), side="right") - 1
                assert len(set((groups // window).tolist())) <= 2
        spread[name] = np.mean(touched)
    assert spread["windowed"] * 2 < spread["global"], spread
