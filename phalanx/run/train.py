"""The training loop, top to bottom. Task-agnostic: the task supplies data, loss and metrics.

Runs inside one worker process (started by torchrun/srun, or alone). Every rank executes the same
sequence of collectives: a one-scalar-vector sync at the start of each step (global target count, stop
votes), DDP's gradient all-reduce, and at log/eval/checkpoint steps their reductions.
"""
from __future__ import annotations

import contextlib
import gc
import math
import os
import shutil
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)

from phalanx.core import dist
from phalanx.core.config import (
    Config,
    check_world,
    config_hash,
    load_config,
    relevant_subset,
    save_yaml,
)
from phalanx.core.faults import Probe, parse_fault
from phalanx.core.runfolder import RunFolder, write_json
from phalanx.data.samplers import GlobalBatchSampler
from phalanx.model import precision
from phalanx.model.build import (
    count_parameters,
    quiet_transformers,
    tie_shared,
    unwrap,
    wrap,
)
from phalanx.model.optim import WarmupCosine, build_optimizer, optimizer_impl, restore_impl
from phalanx.run.checkpoint import Checkpointer, set_rng_state
from phalanx.run.evaluate import evaluate
from phalanx.run.monitor import Monitor
from phalanx.run.state import PreemptionFlag, StopTraining, TrainState
from phalanx.run.telemetry import Telemetry
from phalanx.run.watchdog import Watchdog
from phalanx.tasks import get_task


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


def _say(info, text: str) -> None:
    if info.is_main:
        print(text, flush=True)


def train(cfg: Config | str) -> dict:
    """Train inside an existing worker (torchrun/srun), or as a single process. Returns the summary."""
    if not isinstance(cfg, Config):
        cfg = load_config(str(cfg))
    info = dist.setup(cfg.dist.backend, timeout_s=max(cfg.dist.startup_timeout_s, cfg.dist.timeout_s) + 60,
                      threads=cfg.dist.threads_per_worker, nccl=dist.nccl_env(cfg.dist),
                      nccl_timeout_s=cfg.dist.nccl_timeout_s, tune_malloc=cfg.dist.keep_freed_memory)
    watchdog = Watchdog(RunFolder(cfg.run_dir).hang, info.rank, info.world_size, cfg.dist.startup_timeout_s).start()
    try:
        summary = _train(cfg, info, watchdog)
    except BaseException as e:
        if isinstance(e, StopTraining) and info.is_main:
            RunFolder(cfg.run_dir).mark_error(str(e), e.step)
        traceback.clear_frames(e.__traceback__)  # drop the DDP model held by the frames (pitfall 2)
        raise
    finally:
        watchdog.stop()
        gc.collect()
    dist.teardown()
    return summary


@dataclass
class Trainee:
    """The pieces that train. `model` is the raw model (saved, evaluated, exported); `wrapped` adds
    DDP/FSDP to it and `forward` adds torch.compile on top (or is `wrapped`)."""
    model: torch.nn.Module
    wrapped: torch.nn.Module
    forward: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedule: WarmupCosine
    scaler: torch.amp.GradScaler
    autocast: object
    amp_dtype: torch.dtype | None


def build_trainee(cfg: Config, info: dist.DistInfo, task) -> Trainee:
    t = cfg.train
    torch.manual_seed(t.seed)  # identical init on every rank (DDP also broadcasts rank 0's weights)
    model = task.build_model().to(info.device)
    wrapped = wrap(model, t.strategy, info)
    amp_dtype, warnings = precision.check_precision(t.precision, info.device.type)
    for warning in warnings:
        _say(info, f"phalanx: warning: {warning}")
    return Trainee(model=model, wrapped=wrapped, forward=torch.compile(wrapped) if t.compile else wrapped,
                   optimizer=build_optimizer(model, t), schedule=WarmupCosine(t),
                   scaler=precision.make_scaler(info.device, amp_dtype),
                   autocast=precision.autocast_factory(info.device, amp_dtype), amp_dtype=amp_dtype)


@dataclass
class StepResult:
    loss_sum: float     # this rank's summed loss over its micro-batches
    count: float        # target count of the whole global batch (all-reduced)
    tokens: float       # tokens of the global batch, padding included (all-reduced)
    useful: float       # non-padding tokens of the global batch (all-reduced)
    local_tokens: int
    stop: bool          # some rank was asked to stop (preemption): all agree
    checkpoint_due: bool  # time-based checkpoint vote
    grad_norm: float
    lr: float
    times: tuple        # perf_counter marks: start, sync, after sync, after backward, end


@dataclass
class Run:
    """The per-run collaborators every stage of the loop uses."""
    cfg: Config
    info: dist.DistInfo
    folder: RunFolder
    probe: Probe          # one call per phase: hang watchdog beat + injected faults
    monitor: Monitor
    telemetry: Telemetry | None = None


def _train(cfg: Config, info: dist.DistInfo, watchdog: Watchdog) -> dict:
    t, folder = cfg.train, RunFolder(cfg.run_dir)
    t_launch = time.time()
    quiet_transformers()
    accum = check_world(cfg, info.world_size)
    if info.is_main:
        _prepare_run_dir(cfg, folder)

    # ---- data, model, optimizer, resume ------------------------------------------------------
    task = get_task(cfg.task)(cfg, info)
    task.prepare()
    tr = build_trainee(cfg, info, task)
    n_params = count_parameters(tr.model)
    _say(info, f"phalanx: task {cfg.task}, {n_params / 1e6:.2f}M parameters, world size {info.world_size} "
               f"({info.backend}, {torch.get_num_threads()} threads/process), global batch "
               f"{t.global_batch_size} = micro {t.micro_batch_size} x world {info.world_size} x accum {accum}, "
               f"precision {precision.describe(t.precision, tr.amp_dtype)}, strategy "
               f"{t.strategy if info.world_size > 1 else 'single'}, optimizer AdamW {optimizer_impl(tr.optimizer)}")
    ckpt = Checkpointer(folder.root, info, t.keep_checkpoints)
    state = TrainState()
    resumed = _resume(cfg, ckpt, tr, state, info)
    start_step = state.step
    sampler = GlobalBatchSampler(len(task.train_set), t.global_batch_size, t.micro_batch_size, t.seed,
                                 task.train_order(state.data_order))
    monitor = Monitor(folder.root, enabled=info.is_main, progress=cfg.log.progress, max_steps=t.max_steps,
                      start_step=start_step, cfg=cfg)
    if resumed:
        monitor.log(resumed)
    run = Run(cfg, info, folder, Probe(watchdog, parse_fault(cfg.debug.fault), info.rank, info.attempt), monitor)
    run.telemetry = Telemetry(info, cfg, n_params=n_params, model=tr.model, wrapped=tr.wrapped,
                              amp_dtype=tr.amp_dtype, monitor=monitor)
    preempt = PreemptionFlag()
    watchdog.timeout_s = cfg.dist.timeout_s  # start-up is over: the training timeout applies

    # ---- the loop ----------------------------------------------------------------------------
    stop, checkpoint_due, last_ckpt_time, eval_metrics = False, False, time.time(), {}
    first_step_at = None
    while True:
        step = state.step
        last_step = step >= t.max_steps
        if step > start_step and (last_step or (t.eval_every and step % t.eval_every == 0)):
            run.probe(step, "eval")
            eval_metrics = evaluate(task, tr.model, task.val_set, info, t.micro_batch_size, t.eval_max_samples,
                                    tr.autocast)
            monitor.eval(step, eval_metrics)
        if step > start_step and (last_step or stop or checkpoint_due or
                                  (t.checkpoint_every and step % t.checkpoint_every == 0)):
            _save(run, ckpt, tr, state)
            last_ckpt_time = time.time()
        if last_step or stop:
            break

        minutes_due = bool(t.checkpoint_every_minutes) and time.time() - last_ckpt_time > 60 * t.checkpoint_every_minutes
        r = train_step(run, tr, task, sampler, state, votes=(preempt.requested, minutes_due))
        state.step += 1
        state.samples_seen += t.global_batch_size
        state.tokens_seen += int(r.tokens)
        state.train_time_s += r.times[-1] - r.times[0]
        first_step_at = first_step_at or time.time()
        stop, checkpoint_due = r.stop, r.checkpoint_due
        run.telemetry.step(r)

        step = state.step
        if step % t.log_every == 0 or step == t.max_steps or stop:
            # loss, rates, time split, per-rank resources, MFU: one gather on all ranks, the line on rank 0
            monitor.train(step, {**run.telemetry.collect(step), "lr": r.lr, "grad_norm": r.grad_norm,
                                 "tokens_seen": state.tokens_seen, "epoch": state.samples_seen / len(task.train_set)})

    # ---- finish ------------------------------------------------------------------------------
    if stop:
        if info.is_main:
            folder.mark_preempted(state.step, preempt.signal)
        monitor.message(f"phalanx: preempted at step {state.step}; checkpoint written")
        monitor.close()
        return {"preempted": True, "step": state.step}
    export_final(tr.model, task, folder, info)
    summary = {
        "task": cfg.task, "name": cfg.name, "world_size": info.world_size, "global_batch_size": t.global_batch_size,
        "micro_batch_size": t.micro_batch_size, "grad_accum": accum, "steps": state.step,
        "tokens_seen": state.tokens_seen, "samples_seen": state.samples_seen,
        "nan_skipped_steps": state.nan_skips, "parameters": n_params,
        "train_time_s": round(state.train_time_s, 3),
        "tokens_per_s": state.tokens_seen / max(state.train_time_s, 1e-9),
        "wall_time_s": round(time.time() - t_launch, 3),
        "startup_s": round((first_step_at or time.time()) - t_launch, 3),
        "resumed_from_step": start_step, "optimizer_impl": optimizer_impl(tr.optimizer),
        **eval_metrics, **task.summary_extra(), **run.telemetry.summary()}
    if info.is_main:
        write_json(folder.summary, summary)
    shown = ", ".join(f"{k} {v:.4g}" for k, v in eval_metrics.items() if isinstance(v, float))
    monitor.message(f"phalanx: done at step {state.step}" + (f"; final {shown}" if shown else "")
                    + f"; final model in {folder.final}\nnext: " + "\n      ".join(task.next_commands(folder.root)))
    monitor.close()
    return summary


def train_step(run: Run, tr: Trainee, task, sampler: GlobalBatchSampler, state: TrainState,
               votes: tuple[bool, bool]) -> StepResult:
    """One optimizer step: this rank's micro-batches of the global batch, one gradient all-reduce.
    `votes`: this rank asks to stop (preemption) / to checkpoint now (time-based)."""
    step, info = state.step, run.info
    run.probe(step, "start")
    t0 = time.perf_counter()
    global_ids = sampler.global_batch(state.samples_seen)
    micro_ids = sampler.micro_batch_ids(info.rank, info.world_size)
    batches = [dist.to_device(task.collate(task.train_set, ids), info.device)
               for ids in sampler.rank_micro_batches(global_ids, info.rank, info.world_size)]
    local = [sum(task.target_count(b) for b in batches), sum(task.batch_tokens(b) for b in batches),
             sum(task.useful_tokens(b) for b in batches)]
    run.probe(step, "sync")
    t_sync = time.perf_counter()
    # One small collective per step: the global target count (loss normaliser) and the stop votes.
    count, tokens, useful, stop_votes, time_votes = dist.all_reduce([*local, *map(float, votes)], info)
    t1 = time.perf_counter()
    losses = _forward_backward(run, tr, task, batches, micro_ids, count, step)
    t2 = time.perf_counter()
    run.probe(step, "optimizer")
    grad_norm, lr = _optimizer_step(run, tr, state, losses, micro_ids)
    t3 = time.perf_counter()
    return StepResult(loss_sum=float(sum(losses)), count=count, tokens=tokens, useful=useful,
                      local_tokens=local[1], stop=stop_votes > 0, checkpoint_due=time_votes > 0,
                      grad_norm=grad_norm, lr=lr, times=(t0, t_sync, t1, t2, t3))


def _forward_backward(run: Run, tr: Trainee, task, batches, micro_ids, count, step) -> list:
    """Accumulate gradients of loss_sum * world / count, so DDP's average is the global-batch mean."""
    losses, world = [], run.info.world_size
    for k, (batch, mid) in enumerate(zip(batches, micro_ids)):
        torch.manual_seed(micro_seed(run.cfg.train.seed, step, mid))
        with sync_context(tr.wrapped, tr.model, k == len(batches) - 1):
            poison = run.probe(step, "forward", k)
            with tr.autocast():
                loss = task.loss_sum(tr.forward, batch)
            if poison:  # test-only: debug.fault nan
                loss = loss * float("nan")
            run.probe(step, "backward", k)
            tr.scaler.scale(loss * (world / count)).backward()
        losses.append(loss.detach())  # no host sync here: checked only if the step turns out non-finite
    return losses


def _optimizer_step(run: Run, tr: Trainee, state: TrainState, losses, micro_ids) -> tuple[float, float]:
    """Clip, step (or skip a non-finite step consistently on every rank), schedule, zero."""
    t, step = run.cfg.train, state.step
    tr.scaler.unscale_(tr.optimizer)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(tr.model.parameters(), t.grad_clip or math.inf))
    lr = tr.schedule.apply(tr.optimizer, step)
    if math.isfinite(grad_norm):
        tr.scaler.step(tr.optimizer)
        state.consecutive_nan = 0
    else:  # the norm comes from all-reduced gradients, so every rank takes this branch together
        local_bad = next((m for m, l in zip(micro_ids, losses) if not torch.isfinite(l)), math.inf)
        (bad_micro,) = dist.all_reduce([local_bad], run.info, "min")
        if tr.scaler.is_enabled() and not math.isfinite(bad_micro):
            # fp16: finite losses but the scaled gradients overflowed. Routine for dynamic loss scaling:
            # scaler.update() lowers the scale and the step is skipped; not a NaN.
            state.fp16_overflows += 1
            run.monitor.log({"step": step + 1, "event": "fp16_overflow", "loss_scale": tr.scaler.get_scale()})
        else:
            _non_finite(run, state, bad_micro)
    tr.scaler.update()
    tr.optimizer.zero_grad(set_to_none=True)
    return grad_norm, lr


def _non_finite(run: Run, state: TrainState, bad_micro: float) -> None:
    t, step = run.cfg.train, state.step
    state.nan_skips += 1
    state.consecutive_nan += 1
    where = f"step {step}, micro-batch {int(bad_micro)}" if math.isfinite(bad_micro) else f"step {step}"
    if t.nan_policy == "stop" or state.consecutive_nan >= t.max_nan_skips:
        raise StopTraining(f"non-finite loss or gradient norm at {where} (train.nan_policy={t.nan_policy}, "
                           f"{state.nan_skips} skipped so far)", step)
    run.monitor.message(f"warning: non-finite loss or gradient norm at {where}: step skipped")
    run.monitor.log({"step": step + 1, "event": "nan_skip", "where": where})


def _resume(cfg: Config, ckpt: Checkpointer, tr: Trainee, state: TrainState, info) -> dict | None:
    """Load the checkpoint `cfg.resume` selects into the trainee and `state`; the event to log."""
    path = ckpt.latest() if cfg.resume == "auto" else (Path(cfg.resume) if cfg.resume != "never" else None)
    if path is None:
        return None
    t_load = time.perf_counter()
    impl = optimizer_impl(tr.optimizer)
    meta, rank_state = ckpt.load(path, tr.model, tr.optimizer)
    restore_impl(tr.optimizer, impl)  # the checkpoint's may differ: speed only, same state
    state.load_state_dict(meta["train_state"])
    tr.schedule.load_state_dict(meta["schedule"])
    if meta.get("scaler"):
        tr.scaler.load_state_dict(meta["scaler"])
    if rank_state:  # same world size: continue each rank's RNG streams (dropout is seeded per micro-batch)
        set_rng_state(rank_state["rng"])
    _say(info, f"phalanx: resumed from {path} at step {state.step} (saved by world size "
               f"{meta['world_size']}; global sample offset {state.samples_seen}; elastic attempt "
               f"{info.attempt})")
    return {"step": state.step, "event": "resumed", "from": str(path),
            "load_s": round(time.perf_counter() - t_load, 4), "attempt": info.attempt,
            "saved_world_size": meta["world_size"]}


def _save(run: Run, ckpt: Checkpointer, tr: Trainee, state: TrainState) -> None:
    step = state.step
    run.probe(step, "checkpoint")
    meta = {"train_state": state.state_dict(), "schedule": tr.schedule.state_dict(),
            "scaler": tr.scaler.state_dict(), "config_hash": config_hash(run.cfg), "config": relevant_subset(run.cfg)}
    path, seconds = ckpt.save(step, tr.model, tr.optimizer, meta,
                              after_write=lambda: run.probe(step, "checkpoint_written"))
    run.monitor.log({"step": step, "event": "checkpoint", "checkpoint_s": round(seconds, 4), "path": str(path)})


def _prepare_run_dir(cfg: Config, folder: RunFolder) -> None:
    folder.root.mkdir(parents=True, exist_ok=True)
    save_yaml(cfg, folder.config)
    folder.preempted.unlink(missing_ok=True)
    folder.error.unlink(missing_ok=True)


def export_final(model, task, folder: RunFolder, info: dist.DistInfo) -> None:
    """Write RUN/final in the Hugging Face format (safetensors) with the tokenizer, atomically."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if info.is_main:
        final, tmp = folder.final, folder.root / ".final.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        unwrap(model).save_pretrained(tmp, state_dict=tie_shared(full, model))
        task.tokenizer.save_pretrained(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    dist.barrier(info)
