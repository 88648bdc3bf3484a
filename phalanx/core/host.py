"""What this machine offers the run (torch-free)."""
from __future__ import annotations

import os


def cores() -> int:
    """CPU cores this process may run on (its affinity mask, e.g. under Slurm or taskset)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
