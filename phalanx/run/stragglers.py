"""Straggler detection from per-rank busy times gathered at log intervals (pure Python, no torch).

A rank's *busy* time is its step time minus the time it spent blocked in collectives waiting for the
others: in a synchronous data-parallel step every rank's wall-clock step time is the same (the fast
ones wait), so only the busy time shows who is slow. A rank is named when its busy time exceeds the
median over ranks by more than `margin` in `windows` consecutive log windows. With an even number of
ranks the lower median is used, so with two ranks the slower one is compared with the faster one. The
first log window of a run is skipped: it holds one-time costs (allocator warm-up, lazy imports) that
differ between ranks.
"""
from __future__ import annotations

import statistics


class StragglerDetector:
    def __init__(self, margin: float = 0.2, windows: int = 3, skip: int = 1):
        self.margin, self.windows, self.skip = margin, windows, skip
        self.streak: dict[int, int] = {}
        self.slow_windows: dict[int, int] = {}
        self.ratio_sum: dict[int, float] = {}
        self.first_step: dict[int, int] = {}
        self.total_windows = 0

    def update(self, step: int, busy_s: list[float]) -> list[int]:
        """Account one log window; returns the ranks named for the first time at this window."""
        if len(busy_s) < 2:
            return []
        if self.skip > 0:
            self.skip -= 1
            return []
        self.total_windows += 1
        median = statistics.median_low(busy_s)
        named = []
        for rank, t in enumerate(busy_s):
            slow = median > 0 and t > median * (1 + self.margin)
            self.streak[rank] = self.streak.get(rank, 0) + 1 if slow else 0
            if slow:
                self.slow_windows[rank] = self.slow_windows.get(rank, 0) + 1
                self.ratio_sum[rank] = self.ratio_sum.get(rank, 0.0) + t / median
            if self.streak[rank] >= self.windows and rank not in self.first_step:
                self.first_step[rank] = step
                named.append(rank)
        return named

    def slowdown(self, rank: int) -> float:
        """Mean busy time over the median in the windows where `rank` was slow (1.5 = 50% slower)."""
        return self.ratio_sum.get(rank, 0.0) / max(self.slow_windows.get(rank, 0), 1)

    def summary(self) -> list[dict]:
        return [{"rank": r, "first_step": s, "slow_windows": self.slow_windows[r],
                 "windows": self.total_windows, "slowdown": round(self.slowdown(r), 3)}
                for r, s in sorted(self.first_step.items())]


def detect(records: list[dict], margin: float = 0.2, windows: int = 3) -> list[dict]:
    """Replay the detector over metrics.jsonl records (for a run that ended without a summary)."""
    det = StragglerDetector(margin, windows)
    for rec in records:
        busy = rec.get("ranks/busy_time_s")
        if isinstance(busy, list) and "step" in rec:
            det.update(rec["step"], [float(b) for b in busy])
    return det.summary()
