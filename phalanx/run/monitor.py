"""Metrics and progress: rank 0 writes RUN/metrics.jsonl (and optional sinks) and shows progress.

Every value's unit is in its key (`tokens_per_s`, `step_time_s`, `rss_mb`); training lines carry `step`,
`loss`, `lr`, `tokens_per_s`, `step_time_s`; evaluation lines carry `step` and keys starting `eval/`;
lines with an `event` key (checkpoint, straggler, nan_skip) mark things that happened. Per-rank values
are lists indexed by rank under keys starting `ranks/` (see telemetry.py for what each time means).
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

from phalanx.run.sinks import open_sinks


class Progress:
    """A tqdm bar on an interactive terminal, plain log lines otherwise."""

    def __init__(self, mode: str, total: int, start: int):
        interactive = sys.stderr.isatty()
        self.mode = ("bar" if interactive else "lines") if mode == "auto" else mode
        self.bar = None
        if self.mode == "bar":
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

    def update(self, step: int, rec: dict, eta_s: float) -> None:
        if self.mode == "off":
            return
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix(loss=f"{rec.get('loss', float('nan')):.4f}",
                                 tok_s=f"{rec.get('tokens_per_s', 0):.0f}", refresh=True)
            return
        print(f"step {step:>6} | loss {rec.get('loss', float('nan')):.4f} | lr {rec.get('lr', 0):.2e} | "
              f"{rec.get('tokens_per_s', 0):>8.0f} tok/s | {rec.get('step_time_s', 0) * 1000:.0f} ms/step | "
              f"eta {_fmt_time(eta_s)}", flush=True)

    def message(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        elif self.mode != "off":
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class PassProgress:
    """The pass's progress on the main rank, as log.progress asks (auto: a bar on an interactive terminal, else
    lines; off: nothing): pairs done / total (those an earlier, killed pass wrote count as done), pairs/s and
    (non-padding) tokens/s of this pass, and the time left. Lines after the first micro-batch (the first
    estimate), then every EVERY_S seconds, and at the end, like the training loop's:
    `reference pass   1,024/3,000 pairs | 12.3 pairs/s |     4567 tok/s | eta 2:41`."""
    EVERY_S = 30.0

    def __init__(self, mode: str, total: int, done: int):
        self.mode = ("bar" if sys.stderr.isatty() else "lines") if mode == "auto" else mode
        self.total, self.done, self.pairs, self.tokens = total, done, 0, 0.0
        self.t0 = self.shown = time.perf_counter()
        self.first, self.bar = True, None
        if self.mode == "bar":
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=done, unit="pair", desc="reference pass", file=sys.stderr,
                            dynamic_ncols=True, mininterval=0.5)

    def update(self, pairs: int, tokens: float) -> None:
        self.done, self.pairs, self.tokens = self.done + pairs, self.pairs + pairs, self.tokens + tokens
        now = time.perf_counter()
        elapsed = max(now - self.t0, 1e-9)
        if self.bar is not None:
            self.bar.set_postfix(tok_s=f"{self.tokens / elapsed:.0f}", refresh=False)
            self.bar.update(pairs)
        elif self.mode == "lines" and (self.first or now - self.shown >= self.EVERY_S or self.done >= self.total):
            rate = self.pairs / elapsed
            eta = (self.total - self.done) / rate if rate > 0 else math.inf
            print(f"reference pass {self.done:>8,}/{self.total:,} pairs | {rate:.1f} pairs/s | "
                  f"{self.tokens / elapsed:>8.0f} tok/s | eta {_fmt_time(eta)}", flush=True)
            self.first, self.shown = False, now

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _fmt_time(seconds: float) -> str:
    """An eta in the progress lines: m:ss or h:mm:ss."""
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Monitor:
    """Rank 0's view of the run. Other ranks get a Monitor that does nothing."""

    def __init__(self, run_dir: Path, *, enabled: bool, progress: str, max_steps: int, start_step: int,
                 cfg=None):
        """`cfg` (the run's Config) selects the optional sinks under `log.*`; without it, JSONL only."""
        self.enabled, self.max_steps = enabled, max_steps
        self.sinks = []
        self.progress = None
        self.t_start, self.start_step = time.time(), start_step
        if enabled:
            from phalanx.core.config import shown_dict

            self.sinks = open_sinks(cfg.log if cfg else None, Path(run_dir), start_step=start_step,
                                    name=cfg.name if cfg else Path(run_dir).name,
                                    config=shown_dict(cfg) if cfg else {})  # a URL's secret redacted
            self.progress = Progress(progress, max_steps, start_step)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        record = {"time_s": round(time.time(), 3), **record}
        for sink in self.sinks:
            sink.write(record)

    def train(self, step: int, rec: dict) -> None:
        if not self.enabled:
            return
        self.log({"step": step, **rec})
        done = step - self.start_step
        rate = done / max(time.time() - self.t_start, 1e-9)
        self.progress.update(step, rec, (self.max_steps - step) / rate if rate > 0 else float("inf"))

    def eval(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        self.log({"step": step, **metrics})
        shown = ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()
                          if not isinstance(v, (list, dict)))
        self.progress.message(f"eval @ step {step}: {shown}")

    def message(self, text: str) -> None:
        if self.enabled:
            self.progress.message(text)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        if self.progress:
            self.progress.close()
