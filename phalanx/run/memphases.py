"""Peak memory per phase of a run, per rank: build, first step, steps, evaluation, checkpoint, export.

The kernel's high-water mark of resident memory (VmHWM) only rises, so a whole-run peak cannot say which
phase reached it. Each phase starts by resetting it (`/proc/self/clear_refs` with 5: VmHWM := VmRSS now) and
ends by reading it; its private part is VmHWM less the file-backed and shared pages resident at that
moment (RssFile + RssShmem: libraries, mapped stores), i.e. the anonymous memory the phase peaked at (an
over-estimate only if file pages shrank during the phase). The phases follow the loop's probe calls
(run/probe.py): a step's start opens `first_step` (the first of this attempt) or `steps`, evaluation,
checkpoint and export open theirs. Where /proc is not Linux's, nothing is measured.
"""
from __future__ import annotations

from pathlib import Path

from phalanx.core import dist

MB = 2 ** 20
PHASES = ("build", "first_step", "steps", "eval", "checkpoint", "export")
_CLEAR, _STATUS = Path("/proc/self/clear_refs"), Path("/proc/self/status")


def _status() -> dict[str, int]:
    out = {}
    for line in _STATUS.read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssFile", "RssShmem"):
            out[key] = int(value.split()[0]) * 1024
    return out


class PhasePeaks:
    """One per worker, made before the model is built (it opens `build`)."""

    def __init__(self):
        self.enabled = _CLEAR.exists() and _STATUS.exists()
        self.private: dict[str, float] = {}   # phase -> peak private bytes
        self.hwm = 0.0                         # the whole run's VmHWM, across the resets
        self.phase = ""
        self.enter("build")

    def enter(self, phase: str) -> None:
        """Close the current phase and open `phase` (a no-op when it is the one open)."""
        if not self.enabled or phase == self.phase:
            return
        self._close()
        try:
            _CLEAR.write_text("5")
        except OSError:  # not permitted here: keep the whole-run mark only
            self.enabled = False
            return
        self.phase = phase

    def step_started(self, first: bool) -> None:
        self.enter("first_step" if first else "steps")

    def _close(self) -> None:
        if not self.phase:
            return
        s = _status()
        self.hwm = max(self.hwm, s["VmHWM"])
        private = s["VmHWM"] - s.get("RssFile", 0) - s.get("RssShmem", 0)
        self.private[self.phase] = max(self.private.get(self.phase, 0.0), private)

    def peak_mb(self) -> float:
        """The whole run's peak resident memory so far (VmHWM across the resets), in MiB."""
        if not self.enabled:
            return 0.0
        return max(self.hwm, _status()["VmHWM"]) / MB

    def summary(self, info) -> dict:
        """Collective: every rank's peak private memory per phase, in MiB (summary.json)."""
        self._close()
        self.phase = ""
        mine = [self.private.get(p, float("nan")) / MB for p in PHASES]
        rows = dist.all_gather_floats(mine, info)
        if not self.enabled:
            return {}
        out = {f"private_peak_mb/{p}": [round(r[i], 1) for r in rows] for i, p in enumerate(PHASES)
               if all(r[i] == r[i] for r in rows)}  # NaN: a phase this run did not reach
        whole = [max((v for v in r if v == v), default=0.0) for r in rows]
        out["private_peak_mb"] = [round(v, 1) for v in whole]
        return out
