"""The training loop, top to bottom. Task-agnostic: the task supplies data, loss and metrics.

Runs inside one worker process (started by torchrun/srun, or alone). Every rank executes the same
sequence of collectives: a one-scalar-vector sync at the start of each step (global target count, stop
votes), DDP's gradient all-reduce, and at log/eval/checkpoint steps their reductions.
"""
from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import signal
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from . import dist, precision
from .checkpoint import Checkpointer, set_rng_state
from .data.samplers import GlobalBatchSampler
from .config import Config, check_world, config_hash, load_config, relevant_subset, save_yaml
from .evaluate import evaluate
from .faults import fire, parse_fault
from .model import count_parameters, tie_shared, unwrap, wrap
from .monitor import Monitor
from .optim import WarmupCosine, build_optimizer
from .tasks import get_task
from .telemetry import Telemetry
from .watchdog import Watchdog

PREEMPTED = "PREEMPTED"   # marker file: the run stopped cleanly on a signal and can be resumed
ERROR = "error.json"      # marker file: why the run stopped with an error (read by the launcher)


class StopTraining(RuntimeError):
    """A deliberate stop with a message for the user (e.g. non-finite loss under nan_policy=stop)."""


class PreemptionFlag:
    """Set by SIGTERM/SIGINT/SIGUSR1; the ranks agree on it at the next step's sync."""

    def __init__(self):
        self.signal = None
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signal = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        return self.signal is not None


def micro_seed(seed: int, step: int, micro_id: int) -> int:
    """Seed for one micro-batch's randomness (dropout), independent of which rank runs it."""
    return int(np.random.SeedSequence([seed, step, micro_id]).generate_state(1)[0])


def sync_context(wrapped, model, sync: bool):
    """Skip the gradient all-reduce on non-final micro-steps (DDP no_sync / FSDP2 equivalent)."""
    if sync or wrapped is model and not hasattr(model, "set_requires_gradient_sync"):
        return contextlib.nullcontext()
    if hasattr(wrapped, "no_sync"):
        return wrapped.no_sync()
    return _fsdp_no_sync(model)


@contextlib.contextmanager
def _fsdp_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def _say(info, text: str) -> None:
    if info.is_main:
        print(text, flush=True)


def train(cfg: Config | str) -> dict:
    """Train inside an existing worker (torchrun/srun), or as a single process. Returns the summary."""
    if not isinstance(cfg, Config):
        cfg = load_config(str(cfg))
    info = dist.setup(cfg.dist.backend, timeout_s=max(cfg.dist.startup_timeout_s, cfg.dist.timeout_s) + 60,
                      threads=cfg.dist.threads_per_worker, nccl=dist.nccl_env(cfg.dist),
                      nccl_timeout_s=cfg.dist.nccl_timeout_s)
    watchdog = Watchdog(Path(cfg.run_dir) / "hang", info.rank, cfg.dist.startup_timeout_s).start()
    try:
        summary = _train(cfg, info, watchdog)
    except BaseException as e:
        if isinstance(e, StopTraining) and info.is_main:
            _write_json(Path(cfg.run_dir) / ERROR, {"error": str(e), "step": getattr(e, "step", None)})
        traceback.clear_frames(e.__traceback__)  # drop the DDP model held by the frames (pitfall 2)
        raise
    finally:
        watchdog.stop()
        gc.collect()
    dist.teardown()
    return summary


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2), encoding="utf-8")
    os.replace(tmp, path)


def _train(cfg: Config, info: dist.DistInfo, watchdog: Watchdog) -> dict:
    t, run_dir = cfg.train, Path(cfg.run_dir)
    t_launch = time.time()
    import transformers  # noqa: F401  (quiet its warnings on every rank)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    accum = check_world(cfg, info.world_size)
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_yaml(cfg, run_dir / "config.yaml")
        (run_dir / PREEMPTED).unlink(missing_ok=True)
        (run_dir / ERROR).unlink(missing_ok=True)

    # ---- data, model, optimizer --------------------------------------------------------------
    task = get_task(cfg.task)(cfg, info)
    task.prepare()
    torch.manual_seed(t.seed)  # identical init on every rank (DDP also broadcasts rank 0's weights)
    model = task.build_model().to(info.device)   # the raw model: saved and exported, never the wrapper
    n_params = count_parameters(model)
    wrapped = wrap(model, t.strategy, info)
    compiled = torch.compile(wrapped) if t.compile else wrapped  # forward only; `model` is what is saved
    optimizer = build_optimizer(model, t)
    schedule = WarmupCosine(t)
    amp_dtype, warnings = precision.check_precision(t.precision, info.device.type)
    scaler = precision.make_scaler(info.device, amp_dtype)
    autocast = precision.autocast_factory(info.device, amp_dtype)
    for warning in warnings:
        _say(info, f"phalanx: warning: {warning}")

    _say(info, f"phalanx: task {cfg.task}, {n_params / 1e6:.2f}M parameters, world size {info.world_size} "
               f"({info.backend}, {torch.get_num_threads()} threads/process), global batch "
               f"{t.global_batch_size} = micro {t.micro_batch_size} x world {info.world_size} x accum {accum}, "
               f"precision {precision.describe(t.precision, amp_dtype)}, strategy "
               f"{t.strategy if info.world_size > 1 else 'single'}")

    # ---- resume ------------------------------------------------------------------------------
    ckpt = Checkpointer(run_dir, info, t.keep_checkpoints)
    state = {"step": 0, "samples_seen": 0, "tokens_seen": 0, "nan_skips": 0, "train_time_s": 0.0}
    resume_from = ckpt.latest() if cfg.resume == "auto" else (Path(cfg.resume) if cfg.resume != "never" else None)
    resumed_event = None
    if resume_from is not None:
        t_load = time.perf_counter()
        meta, rank_state = ckpt.load(resume_from, model, optimizer)
        state.update(meta["train_state"])
        schedule.load_state_dict(meta["schedule"])
        if meta.get("scaler"):
            scaler.load_state_dict(meta["scaler"])
        if rank_state:
            set_rng_state(rank_state["rng"])
        _say(info, f"phalanx: resumed from {resume_from} at step {state['step']} (saved by world size "
                   f"{meta['world_size']}; global sample offset {state['samples_seen']}; elastic attempt "
                   f"{info.attempt})")
        resumed_event = {"step": state["step"], "event": "resumed", "from": str(resume_from),
                         "load_s": round(time.perf_counter() - t_load, 4), "attempt": info.attempt,
                         "saved_world_size": meta["world_size"]}
    start_step = state["step"]

    sampler = GlobalBatchSampler(len(task.train_set), t.global_batch_size, t.micro_batch_size, t.seed,
                                 task.train_order())
    monitor = Monitor(run_dir, enabled=info.is_main, progress=cfg.log.progress, max_steps=t.max_steps,
                      start_step=start_step, cfg=cfg)
    if resumed_event:
        monitor.log(resumed_event)
    telemetry = Telemetry(info, cfg, n_params=n_params, model=model, wrapped=wrapped, amp_dtype=amp_dtype,
                          monitor=monitor)
    preempt = PreemptionFlag()
    fault = parse_fault(cfg.debug.fault)
    watchdog.timeout_s = cfg.dist.timeout_s

    def save(step: int) -> None:
        watchdog.beat(step, "checkpoint")
        hook = (lambda: fire(fault)) if fault and fault.kind == "kill_in_checkpoint" and \
            fault.applies(info.rank, step, info.attempt) else None
        meta = {"train_state": state, "schedule": schedule.state_dict(), "scaler": scaler.state_dict(),
                "config_hash": config_hash(cfg), "config": relevant_subset(cfg)}
        path, seconds = ckpt.save(step, model, optimizer, meta, fault_hook=hook)
        monitor.log({"step": step, "event": "checkpoint", "checkpoint_s": round(seconds, 4), "path": str(path)})

    # ---- the loop ----------------------------------------------------------------------------
    stop_reason, time_due, last_ckpt_time, eval_metrics = None, False, time.time(), {}
    window = {"loss": 0.0, "tokens": 0, "targets": 0.0, "useful": 0.0, "time": 0.0, "steps": 0}
    first_step_at = None
    while True:
        step = state["step"]
        last_step = step >= t.max_steps
        if step > start_step and (last_step or (t.eval_every and step % t.eval_every == 0)):
            watchdog.beat(step, "eval")
            eval_metrics = evaluate(task, model, task.val_set, info, t.micro_batch_size, t.eval_max_samples,
                                    autocast)
            monitor.eval(step, eval_metrics)
        if step > start_step and (last_step or stop_reason or (t.checkpoint_every and step % t.checkpoint_every == 0)
                                  or time_due):
            save(step)
            last_ckpt_time = time.time()
        if last_step or stop_reason:
            break

        # ---- one optimizer step: accum micro-batches, one gradient all-reduce ------------------
        watchdog.beat(step, "start")
        if fault and fault.kind in ("kill", "raise", "sleep") and fault.applies(info.rank, step, info.attempt):
            fire(fault)
        t0 = time.perf_counter()
        global_ids = sampler.global_batch(state["samples_seen"])
        micro_ids = sampler.micro_batch_ids(info.rank, info.world_size)
        batches = [to_device(task.collate(task.train_set, ids), info.device)
                   for ids in sampler.rank_micro_batches(global_ids, info.rank, info.world_size)]
        local_count = sum(task.target_count(b) for b in batches)
        local_tokens = sum(task.batch_tokens(b) for b in batches)
        local_useful = sum(task.useful_tokens(b) for b in batches)
        ckpt_minutes_due = t.checkpoint_every_minutes and time.time() - last_ckpt_time > 60 * t.checkpoint_every_minutes
        if fault and fault.kind == "slow" and fault.applies(info.rank, step, info.attempt):
            fire(fault)  # test-only straggler: this rank's data phase is slow
        t_sync = time.perf_counter()
        watchdog.beat(step, "sync")
        count, tokens, useful, stop_votes, time_votes = dist.all_reduce(
            [local_count, local_tokens, local_useful, float(preempt.requested), float(bool(ckpt_minutes_due))], info)
        t1 = time.perf_counter()
        loss_local = torch.zeros((), dtype=torch.float64, device=info.device)
        bad_micro = math.inf
        for k, (batch, mid) in enumerate(zip(batches, micro_ids)):
            torch.manual_seed(micro_seed(t.seed, step, mid))
            with sync_context(wrapped, model, k == len(batches) - 1):
                watchdog.beat(step, "forward", k)
                with autocast():
                    loss = task.loss_sum(compiled, batch)
                if fault and fault.kind == "nan" and fault.applies(info.rank, step, info.attempt):
                    loss = loss * float("nan")
                watchdog.beat(step, "backward", k)
                scaler.scale(loss * (info.world_size / count)).backward()
            loss_local += loss.detach()
            if bad_micro == math.inf and not math.isfinite(float(loss.detach())):
                bad_micro = mid
        t2 = time.perf_counter()
        watchdog.beat(step, "optimizer")
        scaler.unscale_(optimizer)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip or math.inf))
        lr = schedule.apply(optimizer, step)
        if math.isfinite(grad_norm):
            scaler.step(optimizer)
            state["consecutive_nan"] = 0
        elif scaler.is_enabled() and not math.isfinite(dist.all_reduce([bad_micro], info, "min")[0]):
            # fp16: finite losses but the scaled gradients overflowed. Routine for dynamic loss scaling:
            # scaler.update() lowers the scale and the step is skipped; not a NaN (same on every rank).
            state["fp16_overflows"] = state.get("fp16_overflows", 0) + 1
            monitor.log({"step": step + 1, "event": "fp16_overflow", "loss_scale": scaler.get_scale()})
        else:  # identical on every rank: the norm is computed from all-reduced gradients
            (bad_micro,) = dist.all_reduce([bad_micro], info, "min")
            state["nan_skips"] += 1
            state["consecutive_nan"] = state.get("consecutive_nan", 0) + 1
            where = f"step {step}, micro-batch {int(bad_micro)}" if math.isfinite(bad_micro) else f"step {step}"
            if t.nan_policy == "stop" or state["consecutive_nan"] >= t.max_nan_skips:
                err = StopTraining(f"non-finite loss or gradient norm at {where} (train.nan_policy="
                                   f"{t.nan_policy}, {state['nan_skips']} skipped so far)")
                err.step = step
                raise err
            monitor.message(f"warning: non-finite loss or gradient norm at {where}: step skipped")
            monitor.log({"step": step + 1, "event": "nan_skip", "where": where})
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()

        state["step"] += 1
        state["samples_seen"] += t.global_batch_size
        state["tokens_seen"] += int(tokens)
        state["train_time_s"] += t3 - t0
        first_step_at = first_step_at or time.time()
        stop_reason = "preempted" if stop_votes > 0 else None
        time_due = time_votes > 0
        window["loss"] += float(loss_local)
        window["tokens"] += int(tokens)
        window["targets"] += count
        window["useful"] += useful
        window["steps"] += 1
        window["time"] += t3 - t0
        telemetry.step(t0, t_sync, t1, t2, t3, local_tokens)

        # ---- log ---------------------------------------------------------------------------
        step = state["step"]
        if step % t.log_every == 0 or step == t.max_steps or stop_reason:
            (loss_sum,) = dist.all_reduce([window["loss"]], info)
            target_sum = window["targets"]
            n = window["steps"]
            monitor.train(step, {
                "loss": loss_sum / target_sum, "lr": lr, "grad_norm": grad_norm,
                "tokens_per_s": window["tokens"] / window["time"], "step_time_s": window["time"] / n,
                "useful_tokens_per_s": window["useful"] / window["time"],
                "pad_fraction": 1 - window["useful"] / max(window["tokens"], 1),
                "tokens_seen": state["tokens_seen"], "epoch": state["samples_seen"] / len(task.train_set),
                **telemetry.collect(step)})  # time split, per-rank resources, MFU (a gather on all ranks)
            window = {k: 0.0 if isinstance(v, float) else 0 for k, v in window.items()}

    # ---- finish ------------------------------------------------------------------------------
    if stop_reason == "preempted":
        if info.is_main:
            _write_json(run_dir / PREEMPTED, {"step": state["step"], "signal": preempt.signal})
        monitor.message(f"phalanx: preempted at step {state['step']}; checkpoint written")
        monitor.close()
        return {"preempted": True, "step": state["step"]}
    export_final(model, task, run_dir, info)
    summary = {
        "task": cfg.task, "name": cfg.name, "world_size": info.world_size, "global_batch_size": t.global_batch_size,
        "micro_batch_size": t.micro_batch_size, "grad_accum": accum, "steps": state["step"],
        "tokens_seen": state["tokens_seen"], "samples_seen": state["samples_seen"],
        "nan_skipped_steps": state["nan_skips"], "parameters": n_params,
        "train_time_s": round(state["train_time_s"], 3),
        "tokens_per_s": state["tokens_seen"] / max(state["train_time_s"], 1e-9),
        "wall_time_s": round(time.time() - t_launch, 3),
        "startup_s": round((first_step_at or time.time()) - t_launch, 3),
        "resumed_from_step": start_step, **eval_metrics, **task.summary_extra(), **telemetry.summary()}
    if info.is_main:
        _write_json(run_dir / "summary.json", summary)
    monitor.message(f"phalanx: done at step {state['step']}; final model in {run_dir / 'final'}")
    monitor.close()
    return summary


def export_final(model, task, run_dir: Path, info: dist.DistInfo) -> None:
    """Write RUN/final in the Hugging Face format (safetensors) with the tokenizer, atomically."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if info.is_main:
        import shutil
        final, tmp = run_dir / "final", run_dir / ".final.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        unwrap(model).save_pretrained(tmp, state_dict=tie_shared(full, model))
        task.tokenizer.save_pretrained(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    dist.barrier(info)
