"""Long packed rows (issue 24, item 7): what one chat micro-batch costs to collate, and the attention masks
the model then builds for itself, at widths 1k-32k.

Collate: time (best of --repeat) and peak host memory (tracemalloc: numpy's allocations) of phalanx's
collate (position ids only, no mask) against the dense `rows x width x width` boolean mask it built before.
Model side: transformers builds the masks from the restarting position ids, one per layer type (full and
sliding) for sdpa and eager, a block mask per layer type for flex_attention; the table gives the bytes that
stay alive through the forward (and backward) and the time to build them (flex: a second call, its first
compiles for the shape; that first call is its own column), for a config with both layer types. Dense
masks larger than --max-dense-gib are not built: their size follows from their shape, shown as "(shape)"
(the smaller widths check that formula against the built tensors).

    python bench/long_context.py [--widths 1024,4096,16384,32768] [--rows 1] [--window 4096] [--repeat 3]
"""
from __future__ import annotations

import argparse
import time
import tracemalloc
from functools import partial

import numpy as np
import torch

from phalanx.model.build import quiet_transformers
from phalanx.tasks.chat import collate_rows

GIB, MIB = 2 ** 30, 2 ** 20
DENSE_BYTES = {"sdpa": 1, "eager": 4}  # a bool mask; a float mask in the embeddings' dtype (fp32 master weights)


def packed_rows(rows: int, width: int, seed: int = 0) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """`rows` rows filled with conversations of 64 to min(2048, width / 4) tokens (random ids, ~half
    supervised), then a pad tail."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(rows):
        row, left = [], width
        while left > 64:
            n = int(min(left, rng.integers(64, min(2048, width // 4) + 1)))
            row.append((rng.integers(0, 32000, n), rng.random(n) < 0.5))
            left -= n
        out.append(row)
    return out


def dense_mask_before(samples, width: int) -> np.ndarray:
    """The block-diagonal causal mask phalanx's collate built before issue 24 (for comparison only)."""
    segment = np.zeros((len(samples), width), dtype=np.int64)
    for r, segments in enumerate(samples):
        t = 0
        for k, (x, _) in enumerate(segments):
            segment[r, t:t + len(x)] = k
            t += len(x)
        segment[r, t:] = len(segments)
    return ((segment[:, :, None] == segment[:, None, :]) & np.tril(np.ones((width, width), dtype=bool)))[:, None]


def collate_before(samples, width: int) -> tuple[dict, np.ndarray]:
    return collate_rows(samples, width, 0), dense_mask_before(samples, width)


def measure(fn, repeat: int) -> tuple[float, int, object]:
    """(best seconds, peak traced bytes, the result)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
        del out
    tracemalloc.start()
    out = fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return best, peak, out


def tensor_bytes(mask) -> int:
    if mask is None:
        return 0
    if torch.is_tensor(mask):
        return mask.numel() * mask.element_size()
    return sum(t.numel() * t.element_size() for t in vars(mask).values() if torch.is_tensor(t))  # a BlockMask


def model_masks(config, impl: str, positions: torch.Tensor, max_dense: float) -> tuple[int, float, float, bool]:
    """(bytes, seconds, first call's seconds, built) of the masks a model with full and sliding layers builds
    for one forward."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    rows, width = positions.shape
    if impl in DENSE_BYTES and 2 * rows * width * width * DENSE_BYTES[impl] > max_dense * GIB:
        return 2 * rows * width * width * DENSE_BYTES[impl], float("nan"), float("nan"), False
    config._attn_implementation = impl
    embeds = torch.empty(rows, width, 1)  # only its shape, dtype and device are read
    times = []
    for _ in range(2 if impl == "flex_attention" else 1):
        t0 = time.perf_counter()
        masks = [make(config=config, inputs_embeds=embeds, attention_mask=None, cache=None, position_ids=positions)
                 for make in (create_causal_mask, create_sliding_window_causal_mask)]
        times.append(time.perf_counter() - t0)
    total = sum(tensor_bytes(m) for m in masks)
    if impl in DENSE_BYTES:  # the shape formula the larger widths rely on
        assert total == 2 * rows * width * width * DENSE_BYTES[impl], (impl, width, total)
    return total, times[-1], times[0], True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", default="1024,4096,16384,32768")
    p.add_argument("--rows", type=int, default=1, help="rows in the micro-batch")
    p.add_argument("--window", type=int, default=4096, help="the sliding layers' window")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--max-dense-gib", type=float, default=4.0, help="larger dense masks: size from the shape")
    p.add_argument("--implementations", default="sdpa,eager,flex_attention")
    args = p.parse_args()
    quiet_transformers()
    from transformers import Qwen2Config

    config = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         use_sliding_window=True, sliding_window=args.window, max_window_layers=1)
    assert sorted(config.layer_types) == ["full_attention", "sliding_attention"]
    impls = args.implementations.split(",")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.rows} row(s) per micro-batch; "
          f"model side: one full and one sliding layer type (window {args.window})")
    print("\n| width | collate ms | collate peak MiB | before: collate ms | before: peak MiB | before: mask MiB | "
          + " | ".join(f"{i} masks MiB | {i} build s" for i in impls) + " |")
    print("|---" * (6 + 2 * len(impls)) + "|")
    for width in map(int, args.widths.split(",")):
        samples = packed_rows(args.rows, width)
        new_s, new_peak, batch = measure(partial(collate_rows, samples, width, 0), args.repeat)
        assert "attention_mask" not in batch and all(v.dim() <= 2 for v in batch.values() if torch.is_tensor(v))
        old_s, old_peak, old = measure(partial(collate_before, samples, width), args.repeat)
        old_bytes = old[1].nbytes
        del old
        cells = []
        for impl in impls:
            size, seconds, first, built = model_masks(config, impl, batch["position_ids"], args.max_dense_gib)
            cells.append(f"{size / MIB:,.3f}{'' if built else ' (shape)'} | "
                         + ("-" if seconds != seconds else f"{seconds:.3f}")
                         + (f" (first {first:.1f})" if impl == "flex_attention" and first == first else ""))
        print(f"| {width} | {new_s * 1e3:.2f} | {new_peak / MIB:.2f} | {old_s * 1e3:,.0f} | {old_peak / MIB:,.0f} | "
              f"{old_bytes / MIB:,.0f} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
