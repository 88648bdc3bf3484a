"""What this machine offers the run (torch-free)."""
from __future__ import annotations

import os


def cores() -> int:
    """CPU cores this process may run on (its affinity mask, e.g. under Slurm or taskset)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def gpu_ids(visible: str | None, count: int) -> list[str]:
    """The GPUs this process may hand out, as CUDA_VISIBLE_DEVICES entries: the parent's own list (indices,
    UUIDs or MIG names, as a scheduler set it) when there is one, else 0..count-1. A child given a
    sub-list of these sees exactly those devices. CUDA stops reading the list at its first invalid
    entry; an empty list (or '-1') hides every GPU."""
    if visible is None:
        return [str(i) for i in range(count)]
    ids = []
    for entry in (e.strip() for e in visible.split(",")):
        if not entry or entry.startswith("-"):
            break
        ids.append(entry)
    return ids[:count] if count else ids
