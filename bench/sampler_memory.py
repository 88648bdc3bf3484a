"""The sampler's per-rank cost of a shuffled order, stored (data orders 1-2) vs computed per batch (3).

Builds the epoch order for --blocks samples (default 78 M: 128-token blocks of ~10 G tokens, ~40 GB of
text) and draws --batches global batches of --batch, under tracemalloc: peak memory and time.

    python bench/sampler_memory.py [--blocks 78000000] [--batches 2048] [--batch 32]
"""
from __future__ import annotations

import argparse
import time
import tracemalloc

import numpy as np

from phalanx.data.samplers import FeistelPermutation, permutation


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=78_000_000)
    p.add_argument("--batches", type=int, default=2048)
    p.add_argument("--batch", type=int, default=32)
    a = p.parse_args()
    print("| order | peak memory MB | epoch set-up + batches s |\n|---|---|---|")
    for name, make in (("stored permutation (data orders 1-2)",
                        lambda: permutation(a.blocks, np.random.default_rng(1))),
                       ("Feistel, per batch (data order 3)",
                        lambda: FeistelPermutation(a.blocks, np.random.default_rng(1)))):
        tracemalloc.start()
        t0 = time.perf_counter()
        order = make()
        for start in range(0, a.batch * a.batches, a.batch):
            order[start:start + a.batch]
        seconds = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
        print(f"| {name} | {peak:.1f} | {seconds:.2f} |")
    print(f"\n({a.blocks:,} samples, {a.batches} batches of {a.batch})")


if __name__ == "__main__":
    main()
