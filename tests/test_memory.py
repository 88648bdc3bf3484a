"""dist.keep_freed_memory: freed blocks stay in the process instead of being faulted in again."""
from __future__ import annotations

import subprocess
import sys

import pytest

# Allocate and free 16 MB tensors, as a training step does with activations and logits, and count the
# page faults. glibc's own threshold moves with the heap's history, so each fresh process starts from
# its initial setting (128 KiB: every big block goes back to the OS); "on" then calls
# keep_freed_memory(), which must make the blocks reused.
PROBE = """
import ctypes, resource, sys, torch
from phalanx.core.dist import keep_freed_memory
ctypes.CDLL("libc.so.6").mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD: glibc's initial value, held fixed
if sys.argv[1] == "on":
    assert keep_freed_memory()
torch.set_num_threads(1)
for _ in range(3):
    y = [torch.ones(4 << 20) * 2 for _ in range(3)]; del y
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    y = [torch.ones(4 << 20) * 2 for _ in range(3)]; del y
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_keeping_freed_memory_removes_per_step_page_faults():
    faults = {mode: int(subprocess.run([sys.executable, "-c", PROBE, mode], check=True, capture_output=True,
                                       text=True).stdout) for mode in ("off", "on")}
    # 60 blocks of 4096 pages each: handed back to the OS, every page faults in again.
    assert faults["off"] > 100_000, faults
    assert faults["on"] < faults["off"] / 10, faults
