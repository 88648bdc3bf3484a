"""This rank's micro-batches of each step, on the host: sample ids from the sampler, then collated.

The ids always come from the sampler on the main thread, so the order is the sampler's whatever runs
the collation. On CUDA the next step's micro-batches are collated and pinned on a background thread
while the current step computes (`non_blocking` copies from pinned memory overlap the GPU; from
ordinary memory they are synchronous), and the loop counts tokens on these host copies before moving
them, so no count waits for the GPU. On the CPU everything runs inline, as it always has.

On a store kept on object storage (data.store_url), each step first tells the node-local cache which
shards the order needs next (`GlobalBatchSampler.shards_ahead`: the next window with the windowed order)
and releases this rank's maps of the others, so the node's downloader fetches exactly those and may
evict the rest.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from phalanx.data.samplers import ShardPlan


def pin(batch: dict) -> dict:
    return {k: v.pin_memory() if torch.is_tensor(v) else v for k, v in batch.items()}


class BatchSource:
    """`take(offset)`: (micro-batch ids, host micro-batches) of the step at a global sample offset.

    With `prefetch`, the step at offset + global batch is submitted to a one-thread pool as soon as a
    step is taken; a `take` at any other offset (never in the loop) collates inline. `task.collate` runs
    on that thread then, so it must not use global random state (none does: it reads and pads)."""

    def __init__(self, task, sampler, rank: int, world_size: int, device: torch.device, prefetch: bool):
        self.task, self.sampler, self.rank, self.world_size = task, sampler, rank, world_size
        self.pinned = device.type == "cuda"
        self.pool = None
        if prefetch:
            # The thread's CUDA calls (pinning) must use this rank's GPU: by default a new thread is on
            # device 0, and would create a context there from every rank.
            init = (torch.cuda.set_device, (device,)) if self.pinned else (None, ())
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="phalanx-batches", initializer=init[0],
                                           initargs=init[1])
        self.ahead: tuple[int, list[int], Future] | None = None
        stores = task.train_set.stores() if hasattr(task.train_set, "stores") else []  # (chat's packed rows
        # are not contiguous in the store: their shards are fetched as they are read)
        self.cached = [s for s in stores if s.cache is not None]
        self.plan = ShardPlan.of(task.train_set) if self.cached else None
        self.followed: list[int] = []

    def follow(self, offset: int) -> None:
        """The cache's lookahead from the step at `offset` (a remote store only)."""
        if self.plan is None:
            return
        shards = self.sampler.shards_ahead(offset, self.plan)
        if shards == self.followed:  # the same windows as the last step's: nothing to tell
            return
        self.followed = shards
        wanted: dict[int, tuple] = {}
        for st in self.cached:
            st.keep_only(set(shards))
            wanted.setdefault(id(st.cache), (st.cache, []))[1].extend(st.file_of(k) for k in shards)
        for cache, names in wanted.values():
            cache.want(names)

    def take(self, offset: int) -> tuple[list[int], list[dict]]:
        self.follow(offset)
        if self.ahead is not None and self.ahead[0] == offset:
            _, micro_ids, future = self.ahead
            batches = future.result()
        else:
            micro_ids, ids = self._ids(offset)
            batches = self._collate(ids)
        self.ahead = None
        if self.pool is not None:
            nxt = offset + self.sampler.global_batch_size
            next_micro, next_ids = self._ids(nxt)
            self.ahead = (nxt, next_micro, self.pool.submit(self._collate, next_ids))
        return micro_ids, batches

    def _ids(self, offset: int) -> tuple[list[int], list]:
        global_ids = self.sampler.global_batch(offset)
        return (self.sampler.micro_batch_ids(self.rank, self.world_size),
                self.sampler.rank_micro_batches(global_ids, self.rank, self.world_size))

    def _collate(self, ids: list) -> list[dict]:
        batches = [self.task.collate(self.task.train_set, i) for i in ids]
        return [pin(b) for b in batches] if self.pinned else batches

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
