"""Per-rank cost accounting: where each step's time goes, CPU and memory, FLOPs and MFU, stragglers.

The loop marks each step's phases (run/clock.py); each rank sums them over the log window. Only at log
intervals does one all_gather of a few floats per rank (on the host: the scalar group) bring every
rank's numbers to rank 0, which turns them into metric keys (global ones, and `ranks/...` lists indexed
by rank) and checks for stragglers. Times are seconds per optimizer step, averaged over the window and
the ranks.

On the CPU (Gloo) the marks are host clock readings: the phases are what the process spent in them.
On CUDA they are also CUDA events on the current stream, and every time below is *device* time: the
time between the moments the GPU reached two marks in its queue. Kernels run asynchronously, so a host
clock would see launch times, count the GPU's work wherever the host next waits (the gradient norm)
and let the optimizer's kernels spill into the next step. The events are read when the window is
collected: one synchronize per log window, none per step.

  step_time_s          CPU: host time from the step's start to the optimizer's end. CUDA: from the GPU
                       reaching the step's start to finishing its optimizer kernels (the optimizer's
                       work counts in its own step; idle time between steps, e.g. logging, in none)
  data_time_s          CPU: collate + count + copy of this rank's micro-batches. CUDA: how long the GPU
                       waited for them: the part of that host work (prefetched on a thread) not hidden
                       behind the previous step's GPU work, plus the host-to-device copies
  rollout_time_s       the task's own per-step work on the model before the step (GRPO: generating and
                       scoring completions); 0 for tasks without one
  sync_time_s          the step-start scalar all-reduce (target count, stop votes), including waiting
                       there for slower ranks. CUDA: the part of it the GPU sat idle for
  fwd_bwd_time_s       forward + backward of all micro-batches, including the part of DDP's gradient
                       all-reduce that is not hidden behind backward (CUDA: on the GPU)
  optimizer_time_s     unscale, clip (the gradient-norm read is the step's one host wait), optimizer
                       step, zero_grad (CUDA: on the GPU, including its wait for the host's launches)
  (these five add up to step_time_s, on either device)
  comm_time_s          wall time during which a DDP gradient all-reduce was in flight (a comm hook that
                       does DDP's default averaging all-reduce and records launch and completion);
                       it overlaps backward, so it is not a fifth slice of the split
  comm_exposed_time_s  the part of fwd_bwd after the last gradient bucket was launched, when backward
                       has nothing left to do but wait for communication
  ranks/busy_time_s    time a rank worked rather than waited for others. CPU: step - sync -
                       comm_exposed. CUDA: the step's segments that hold no collective under DDP: data,
                       every micro-batch's forward, the backward of all micro-batches but the last
                       (no_sync), the optimizer. The last backward is left out whole: it holds the
                       gradient all-reduce, which NCCL runs on its own stream, where a fast GPU waits
                       for the slow one. So a slow GPU's busy time is the larger, though every rank's
                       step time is the same. Under FSDP forward/backward gather parameters (and
                       DDP broadcasts a model's buffers at each forward, e.g. BERT's position ids):
                       those waits are in busy too, and a straggler stands out less

With `log.telemetry: false` only the loss, the rates, pad fraction and the four-way split are kept: no comm
hook, no per-rank resource sampling, no per-rank lists, no straggler check, no FLOPs/MFU.

Gradient communication is timed for DDP on Gloo only: NCCL futures complete when work is queued on
a stream (host clocks would not see it) and FSDP has no comm hook; the comm keys are absent then.
"""
from __future__ import annotations

import math
import os
import statistics
import time

import psutil
import torch
import torch.distributed as tdist
from torch.nn.parallel import DistributedDataParallel

from phalanx.core import dist
from phalanx.run.clock import BACKWARD, StepClock
from phalanx.run.memphases import PhasePeaks
from phalanx.run.stragglers import StragglerDetector

MB = 2 ** 20
# Sums over a log window, per rank. loss: this rank's summed loss; targets/global_tokens/useful: the
# step's all-reduced totals (equal on every rank); tokens: this rank's own.
WINDOW = ("steps", "time", "data", "rollout", "sync", "fwd_bwd", "optimizer", "comm", "comm_exposed", "busy",
          "tokens", "samples", "loss", "targets", "global_tokens", "useful")
READ_AHEAD = 32  # on CUDA, unread steps past this many are read where the GPU has finished them (no wait)
RESOURCES = ("cpu_percent", "rss_mb", "host_peak_mb", "cuda_allocated_mb", "cuda_peak_mb")

# Dense (no sparsity) peak TFLOP/s per GPU model: (16-bit tensor cores, fp32), from NVIDIA's datasheets.
# Keyed by the model and its form factor as torch.cuda.get_device_name spells them (gpu_model), matched
# exactly: "H100 NVL" is not the SXM part, "L40" is not "L4", "A10G" is not "A10". A model not listed
# has no MFU unless log.peak_tflops is set.
GPU_PEAK_TFLOPS = {("H100", ""): (989, 67), ("H100", "PCIe"): (756, 51), ("H100", "NVL"): (835, 60),
                   ("H200", ""): (989, 67), ("H200", "NVL"): (835, 60), ("GH200", ""): (989, 67),
                   ("B200", ""): (2250, 80), ("A100", ""): (312, 19.5), ("A100", "PCIe"): (312, 19.5),
                   ("L40S", ""): (362, 91.6), ("L40", ""): (181, 90.5), ("L4", ""): (121, 30.3),
                   ("A10", ""): (125, 31.2), ("V100", ""): (125, 15.7), ("V100", "PCIe"): (112, 14),
                   ("T4", ""): (65, 8.1), ("RTX 4090", ""): (165, 82.6), ("RTX 3090", ""): (71, 35.6)}
_VENDOR_WORDS = {"NVIDIA", "Tesla", "GeForce", "Quadro"}
_FORM_FACTORS = {"PCIe": "PCIe", "NVL": "NVL"}  # SXM parts (e.g. "A100-SXM4-80GB", "H100 80GB HBM3") are the default


def gpu_model(name: str) -> tuple[str, str]:
    """('H100', 'NVL') from 'NVIDIA H100 NVL'; ('A100', '') from 'NVIDIA A100-SXM4-80GB'."""
    words = [w for w in name.replace("-", " ").split() if w not in _VENDOR_WORDS]
    if not words:
        return "", ""
    model = " ".join(words[:2]) if words[0] == "RTX" and len(words) > 1 else words[0]
    form = next((_FORM_FACTORS[w] for w in words[1:] if w in _FORM_FACTORS), "")
    return model, form


def flops_per_token(n_params: int, n_layer: int, d_model: int, seq_len: float) -> float:
    """Training FLOPs per token: 6N for the weight matmuls (forward 2N, backward 4N) plus 12·L·d·T for
    attention scores and weighted values (PaLM appendix B, as in nanoGPT's estimate_mfu)."""
    return 6.0 * n_params + 12.0 * n_layer * d_model * seq_len


def peak_tflops(configured: float, device: torch.device, amp_dtype) -> tuple[float, str]:
    """Peak TFLOP/s of one device (GPU) or one node's CPUs (configured only), and where it came from."""
    if configured:
        return configured, "log.peak_tflops"
    if device.type != "cuda":
        return 0.0, "unknown (set log.peak_tflops)"
    name = torch.cuda.get_device_name(device)
    peaks = GPU_PEAK_TFLOPS.get(gpu_model(name))
    if peaks is None:
        return 0.0, f"unknown GPU {name!r} (set log.peak_tflops)"
    return float(peaks[0] if amp_dtype in (torch.bfloat16, torch.float16) else peaks[1]), name


def host_peak_mb() -> float:
    """Peak resident memory of this process (the kernel's high-water mark)."""
    try:
        import resource
    except ImportError:  # Windows
        return psutil.Process().memory_info().peak_wset / MB
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / MB if os.uname().sysname == "Darwin" else peak / 1024


class CommTimer:
    """DDP comm hook: DDP's default gradient averaging, plus launch/completion times of each bucket."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.spans: list[tuple[float, float]] = []
        self.overhead_s = 0.0

    @classmethod
    def attach(cls, wrapped, info) -> CommTimer | None:
        if not isinstance(wrapped, DistributedDataParallel) or info.backend != "gloo":
            return None
        timer = cls(info.world_size)
        wrapped.register_comm_hook(None, timer._hook)
        return timer

    def _hook(self, state, bucket):
        t_in = time.perf_counter()
        buffer = bucket.buffer().div_(self.world_size)
        launched = time.perf_counter()
        fut = tdist.all_reduce(buffer, async_op=True).get_future()
        t_back = time.perf_counter()

        def done(f):
            self.spans.append((launched, time.perf_counter()))
            return f.value()[0]

        out = fut.then(done)
        # Counted as overhead: everything but the all-reduce call (the div_ is work DDP does anyway).
        self.overhead_s += (launched - t_in) + (time.perf_counter() - t_back)
        return out

    def take(self, backward_end: float) -> tuple[float, float]:
        """(in-flight seconds, exposed seconds) of the step whose backward returned at `backward_end`."""
        spans, self.spans = sorted(self.spans), []
        if not spans:
            return 0.0, 0.0
        busy, cur_start, cur_end = 0.0, *spans[0]
        for start, end in spans[1:]:
            if start > cur_end:
                busy, cur_start = busy + cur_end - cur_start, start
            cur_end = max(cur_end, end)
        busy += cur_end - cur_start
        return busy, max(0.0, backward_end - spans[-1][0])


class Telemetry:
    """One per rank, made on every rank just before the loop (its constructor has a barrier).
    `step()` after every optimizer step; `collect()` on every rank at log steps (a gather)."""

    def __init__(self, info, cfg, *, n_params: int, model, wrapped, amp_dtype, monitor, clock: StepClock | None = None,
                 memory: PhasePeaks | None = None):
        """`model` is the raw model (its config gives layers and width), `wrapped` what DDP returned,
        `clock` the loop's step clock (host clock only if not given), `memory` the run's per-phase peaks
        (they reset the kernel's high-water mark, so the whole run's comes from them)."""
        self.memory = memory
        log_cfg = cfg.log
        self.info, self.monitor, self.n_params = info, monitor, n_params
        self.clock = clock or StepClock()
        self.pending: list = []  # (marks, comm) of steps whose times are not read yet
        self.loss = None  # CUDA: this rank's loss sum over the window, on the GPU in float64 (as exact as Python's)
        self.full = log_cfg.telemetry
        self.comm = CommTimer.attach(wrapped, info) if self.full else None
        self.comm_measured = self.full and (self.comm is not None or info.world_size == 1)
        self.samples_per_step = cfg.train.global_batch_size / info.world_size
        mcfg = getattr(model, "config", None)
        self.n_layer = getattr(mcfg, "num_hidden_layers", 0) or 0
        self.d_model = getattr(mcfg, "hidden_size", 0) or 0
        self.peak_tflops, self.peak_source = peak_tflops(log_cfg.peak_tflops, info.device, amp_dtype)
        # GPU peaks are per device; a configured CPU peak is per node (its processes share the cores).
        self.peak_units = info.world_size if info.device.type == "cuda" else \
            max(1, info.world_size // max(info.local_world_size, 1))
        self.stragglers = StragglerDetector(log_cfg.straggler_margin, log_cfg.straggler_windows)
        self.process = psutil.Process()
        self.process.cpu_percent(None)  # start the CPU-time interval that the first collect() reads
        self.window = dict.fromkeys(WINDOW, 0.0)
        self.overhead_s = self.train_s = 0.0
        self.peaks = {"host_peak_mb": 0.0, "cuda_peak_mb": 0.0}
        # Start every rank's clock together: otherwise the first step of a rank that finished set-up
        # early absorbs the others' set-up time while it waits in the step-start all-reduce.
        dist.barrier(info)

    def step(self, r) -> None:
        """Account one optimizer step (train.StepResult): its phase marks, this rank's tokens and loss, and
        the step's global totals. Times are added when read: at once on the CPU, at collect() on CUDA."""
        w = self.window
        for key, value in (("steps", 1), ("tokens", r.local_tokens), ("samples", self.samples_per_step),
                           ("targets", r.count), ("global_tokens", r.tokens), ("useful", r.useful)):
            w[key] += value
        if self.clock.on_device:  # no host read: the sum stays queued on the GPU until collect()
            loss = r.loss_sum.detach().double()
            self.loss = loss if self.loss is None else self.loss + loss
        else:
            w["loss"] += float(r.loss_sum)
        self.pending.append((r.marks, self.comm.take(r.marks.host_at(BACKWARD)) if self.comm else (0.0, 0.0)))
        if not self.clock.on_device or len(self.pending) > READ_AHEAD:
            self._account(wait=False)
        self.train_s += r.marks.host_seconds
        self.overhead_s += self.clock.now() - r.marks.host[-1]

    def _account(self, wait: bool) -> None:
        """Add the read times of pending steps to the window (all of them with `wait`)."""
        times = self.clock.read([m for m, _ in self.pending], wait)
        w = self.window
        for t, (_, (comm, exposed)) in zip(times, self.pending):
            busy = t.local if self.clock.on_device else t.time - t.sync - exposed
            for key, value in (("time", t.time), ("data", t.data), ("rollout", t.rollout), ("sync", t.sync),
                               ("fwd_bwd", t.fwd_bwd),
                               ("optimizer", t.optimizer), ("comm", comm), ("comm_exposed", exposed), ("busy", busy)):
                w[key] += value
        del self.pending[:len(times)]

    def _resources(self) -> list[float]:
        cuda = self.info.device.type == "cuda"
        rss = self.process.memory_info().rss / MB
        # The kernel updates the high-water mark lazily (per-thread counters), so it can trail RSS a little.
        peak = max(host_peak_mb(), self.memory.peak_mb()) if self.memory else host_peak_mb()
        return [self.process.cpu_percent(None), rss, max(rss, peak),
                torch.cuda.memory_allocated(self.info.device) / MB if cuda else math.nan,
                torch.cuda.max_memory_allocated(self.info.device) / MB if cuda else math.nan]

    def collect(self, step: int) -> dict:
        """Gather the window from every rank (a collective: all ranks call it); rank 0 gets the keys."""
        start = self.clock.now()
        if self.loss is not None:  # CUDA: waits for the GPU, once a window
            self.window["loss"], self.loss = float(self.loss), None
        self._account(wait=True)
        resources = self._resources() if self.full else []
        rows = dist.all_gather_floats([self.window[k] for k in WINDOW] + resources, self.info)
        self.window = dict.fromkeys(WINDOW, 0.0)
        record = {}
        if self.info.is_main and rows[0][0] > 0:
            names = WINDOW + (RESOURCES if self.full else ())
            cols = {name: [row[i] for row in rows] for i, name in enumerate(names)}
            record = self._record(cols)
            if self.full:
                self._check_stragglers(step, record["ranks/busy_time_s"])
        self.overhead_s += self.clock.now() - start
        return record

    def _record(self, cols: dict) -> dict:
        steps = cols["steps"]

        def per_step(key):
            return [v / n for v, n in zip(cols[key], steps)]

        wall = cols["time"][0]  # rank 0's clock: the global rates below all use one time base
        global_tokens, useful = cols["global_tokens"][0], cols["useful"][0]
        rec = {"loss": sum(cols["loss"]) / cols["targets"][0], "tokens_per_s": global_tokens / wall,
               "step_time_s": wall / steps[0], "useful_tokens_per_s": useful / wall,
               "pad_fraction": 1 - useful / max(global_tokens, 1)}
        rec.update({f"{k}_time_s": _r(statistics.fmean(per_step(k)))
                    for k in ("data", "rollout", "sync", "fwd_bwd", "optimizer")})
        if self.comm_measured:
            rec["comm_time_s"] = _r(statistics.fmean(per_step("comm")))
            rec["comm_exposed_time_s"] = _r(statistics.fmean(per_step("comm_exposed")))
        if not self.full:
            return rec
        # (other ranks' windows also hold their wait for rank 0's logging, a few % on tiny steps)
        tokens, samples = sum(cols["tokens"]), sum(cols["samples"])
        rec["samples_per_s"] = _r(samples / wall)
        fpt = flops_per_token(self.n_params, self.n_layer, self.d_model, tokens / max(samples, 1))
        rec["flops_per_token"] = _r(fpt)
        rec["model_tflops"] = _r(fpt * tokens / wall / 1e12)
        if self.peak_tflops:
            rec["mfu"] = _r(rec["model_tflops"] / (self.peak_tflops * self.peak_units))
        rec["ranks/tokens_per_s"] = [_r(t / s) for t, s in zip(cols["tokens"], cols["time"])]
        rec["ranks/samples_per_s"] = [_r(n / s) for n, s in zip(cols["samples"], cols["time"])]
        rec["ranks/step_time_s"] = [_r(v) for v in per_step("time")]
        rec["ranks/busy_time_s"] = [_r(v) for v in per_step("busy")]
        for key in RESOURCES:
            if key in cols and not any(math.isnan(v) for v in cols[key]):
                rec[f"ranks/{key}"] = [round(v, 1) for v in cols[key]]
        for key in self.peaks:
            if f"ranks/{key}" in rec:
                rec[key] = max(rec[f"ranks/{key}"])
                self.peaks[key] = max(self.peaks[key], rec[key])
        return rec

    def _check_stragglers(self, step: int, busy: list[float]) -> None:
        for rank in self.stragglers.update(step, busy):
            median = statistics.median_low(busy)
            text = (f"rank {rank} is a straggler: busy {busy[rank] * 1e3:.1f} ms/step vs median "
                    f"{median * 1e3:.1f} ms (more than {self.stragglers.margin:.0%} slower for "
                    f"{self.stragglers.windows} log windows in a row)")
            self.monitor.message(f"warning: {text}")
            self.monitor.log({"step": step, "event": "straggler", "rank": rank, "message": text})

    def summary(self) -> dict:
        """What the run's measurement found and cost (for summary.json; complete on rank 0)."""
        overhead = self.overhead_s + (self.comm.overhead_s if self.comm else 0.0)
        out = {"stragglers": self.stragglers.summary(), "metrics_overhead_s": round(overhead, 4),
               "metrics_overhead_pct": round(100 * overhead / max(self.train_s, 1e-9), 3),
               "threads_per_process": torch.get_num_threads(),
               "peak_tflops": self.peak_tflops, "peak_tflops_source": self.peak_source}
        out.update({k: v for k, v in self.peaks.items() if v})
        if self.memory is not None:  # collective: every rank's private peak per phase
            out.update(self.memory.summary(self.info))
        return out


def _r(x: float) -> float:
    """Six significant digits: enough for any plot, and metrics.jsonl stays small."""
    return float(f"{x:.6g}")
