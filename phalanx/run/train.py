"""The training loop, top to bottom. Task-agnostic: the task supplies data, loss and metrics.

Runs inside one worker process (started by torchrun/srun, or alone). Every rank executes the same
sequence of collectives: a one-scalar-vector sync at the start of each step (the task's counts of the
global batch that normalise its loss, tokens, stop votes), DDP's gradient all-reduce, and at
log/eval/checkpoint steps their reductions. On CUDA the host
waits for the GPU once per step, for the gradient norm (the NaN/skip decision needs it): the scalar
collectives run on a Gloo group on the host, tokens are counted on the host batch before it is copied,
and the loss and the step timers are read only at log steps.
"""
from __future__ import annotations

import contextlib
import gc
import math
import time
import traceback
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from phalanx.core import dist
from phalanx.core.config import (
    Config,
    check_world,
    config_hash,
    load_config,
    relevant_subset,
    save_yaml,
)
from phalanx.core.faults import parse_fault
from phalanx.core.runfolder import RunFolder, write_json
from phalanx.data.cache import cache_root
from phalanx.data.samplers import GlobalBatchSampler, order_version
from phalanx.data.store import plan_digest
from phalanx.model.build import count_parameters, quiet_transformers
from phalanx.model.identity import base_identity
from phalanx.model.lora import trainable_parameters
from phalanx.model.optim import optimizer_impl
from phalanx.run.batches import BatchSource
from phalanx.run.checkpoint import CheckpointDict, Checkpointer, resolve_resume
from phalanx.run.clock import BACKWARD, DATA, FORWARD, ROLLOUT, SYNC, TAKEN, StepClock, StepMarks
from phalanx.run.evaluate import evaluate
from phalanx.run.memphases import PhasePeaks
from phalanx.run.export import export_dtype, export_final
from phalanx.run.monitor import Monitor, PassProgress
from phalanx.run.probe import Probe
from phalanx.run.startline import start_line
from phalanx.run.trainee import Trainee, build_trainee, checkpoint_dict, say
from phalanx.run.state import PreemptionFlag, StopTraining, TrainState
from phalanx.run.telemetry import Telemetry
from phalanx.run.watchdog import Phase, Watchdog
from phalanx.tasks import get_task


def train(cfg: Config | str) -> dict:
    """Train inside an existing worker (torchrun/srun), or as a single process. Returns the summary."""
    if not isinstance(cfg, Config):
        cfg = load_config(str(cfg))
    info = dist.setup(cfg.dist.backend, timeout_s=max(cfg.dist.startup_timeout_s, cfg.dist.timeout_s) + 60,
                      threads=cfg.dist.threads_per_worker, nccl=dist.nccl_env(cfg.dist),
                      nccl_timeout_s=cfg.dist.nccl_timeout_s,
                      # fsdp: memory per rank is the point (dist.return_freed_memory)
                      tune_malloc=cfg.dist.keep_freed_memory and cfg.train.strategy != "fsdp")
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


def _train(cfg: Config, info: dist.DistInfo, watchdog: Watchdog) -> dict:
    """Set up (data, model, optimizer, resume), loop, then export and summarise (or stop preempted)."""
    t, folder, started_at, memory = cfg.train, RunFolder(cfg.run_dir), time.time(), PhasePeaks()
    quiet_transformers()
    accum = check_world(cfg, info.world_size)
    if info.is_main:
        _prepare_run_dir(cfg, folder)

    # ---- data, model, optimizer, resume ------------------------------------------------------
    task = get_task(cfg.task)(cfg, info)
    task.open_data()
    watchdog.beat(-1, Phase.START)  # each start-up stage gets dist.startup_timeout_s, not their sum
    tr = build_trainee(cfg, info, task)
    watchdog.beat(-1, Phase.START)
    probe = Probe(watchdog, parse_fault(cfg.debug.fault), info.rank, info.attempt, memory)
    # before a checkpoint is loaded (the model holds its initial weights); a long pass beats the watchdog
    task.attach(tr, beat=lambda micro: probe(-1, Phase.REFERENCE, micro),
                progress=partial(PassProgress, cfg.log.progress) if info.is_main else None)
    say(info, start_line(cfg, info, tr, accum))
    state = TrainState(data_order=order_version(cfg.data.order, cfg.data.store_url))  # a resume keeps its own
    checkpointer, saved = Checkpointer(folder.root, info, t.keep_checkpoints), checkpoint_dict(tr, state)
    saved.per_rank.update(task.rank_states())
    resumed = _resume(cfg, checkpointer, saved, state, info)
    sampler = GlobalBatchSampler(len(task.train_set), t.global_batch_size, t.micro_batch_size, t.seed,
                                 task.train_order(state.data_order), repeat=task.repeats)
    monitor = Monitor(folder.root, enabled=info.is_main, progress=cfg.log.progress, max_steps=t.max_steps,
                      start_step=state.step, cfg=cfg)
    if resumed:
        monitor.log(resumed)
    clock = StepClock.for_device(info.device)
    run = Run(cfg, info, folder, probe, monitor, checkpointer, saved, start_step=state.step, started_at=started_at,
              clock=clock, shard_plan=shard_plan(cfg, task),
              # once per run, by the rank that writes meta.json (the launcher's hashing cached the digests)
              base_model=base_identity(cfg.model.pretrained, cache_root(cfg.data.cache_dir)) if info.is_main else "",
              telemetry=Telemetry(info, cfg, n_params=count_parameters(tr.model), model=tr.model, wrapped=tr.wrapped,
                                  amp_dtype=tr.amp_dtype, monitor=monitor, clock=clock, memory=memory),
              preempt=PreemptionFlag(),
              # prefetch on CUDA only: on the CPU the collating thread would take cores from the step itself
              batches=BatchSource(task, sampler, info.rank, info.world_size, info.device,
                                  prefetch=info.device.type == "cuda"))
    watchdog.timeout_s = cfg.dist.timeout_s  # start-up is over: the training timeout applies

    # ---- the loop, then the finish -------------------------------------------------------------
    try:
        stopped, eval_metrics, first_step_at = _loop(run, tr, task, state)
    finally:
        run.batches.close()
    if stopped:
        if info.is_main:
            folder.mark_preempted(state.step, run.preempt.signal)
        monitor.message(f"phalanx: preempted at step {state.step}; checkpoint written")
        monitor.close()
        return {"preempted": True, "step": state.step}
    run.probe(state.step, Phase.EXPORT)
    # counted before the export: a LoRA export merges the adapters into the base in place
    counts = {"parameters": count_parameters(tr.model),
              "trainable_parameters": trainable_parameters(tr.model)}
    export_final(tr.model, task, folder, info, t.export_shard_mb, export_dtype(t.export_dtype, cfg.model.pretrained))
    return _finish(run, tr, task, state, eval_metrics, accum, counts, first_step_at)


def shard_plan(cfg: Config, task) -> dict:
    """The training store's shard plan, for meta.json: the windowed order follows it, so a resume under that order
    is refused when the store is cut otherwise (tools/launch.check_shard_plan). Empty for a task without stores."""
    stores = task.train_set.stores() if hasattr(task.train_set, "stores") else []
    return {"digest": plan_digest(stores[0].shards), "shard_mb": cfg.data.shard_mb} if stores else {}


def _resume(cfg: Config, checkpointer: Checkpointer, saved: CheckpointDict, state: TrainState, info) -> dict | None:
    """Load the checkpoint `cfg.resume` selects into the objects of `saved` (`state` among them); the event
    to log."""
    path = resolve_resume(cfg)
    if path is None:
        return None
    t_load = time.perf_counter()
    meta = checkpointer.load(path, saved)
    say(info, f"phalanx: resumed from {path} at step {state.step} (saved by world size "
               f"{meta['world_size']}; global sample offset {state.samples_seen}; elastic attempt "
               f"{info.attempt})")
    return {"step": state.step, "event": "resumed", "from": str(path),
            "load_s": round(time.perf_counter() - t_load, 4), "attempt": info.attempt,
            "saved_world_size": meta["world_size"]}


@dataclass
class Run:
    """The per-run collaborators every stage of the loop uses."""
    cfg: Config
    info: dist.DistInfo
    folder: RunFolder
    probe: Probe                  # one call per phase: hang watchdog beat + injected faults
    monitor: Monitor
    checkpointer: Checkpointer
    saved: CheckpointDict         # what each checkpoint saves
    start_step: int               # the step this attempt started (or resumed) at
    started_at: float             # time.time() when the worker started
    clock: StepClock              # marks each step's phases (host clock; CUDA events)
    shard_plan: dict              # the training store's shard plan (shard_plan), for meta.json
    base_model: str               # the pretrained base's identity (model/identity.py), on the main rank ('' else)
    telemetry: Telemetry
    preempt: PreemptionFlag
    batches: BatchSource          # this rank's micro-batches of each step, on the host


def _loop(run: Run, tr: Trainee, task, state: TrainState) -> tuple[bool, dict, float | None]:
    """Steps until train.max_steps or a stop all ranks agreed on. At the top of each pass, what the steps
    so far earned: evaluation and checkpoint on their intervals, and both at the last step (the same code).
    Returns (stopped early, the last evaluation's metrics, when the first step ended)."""
    t, monitor = run.cfg.train, run.monitor
    stop, checkpoint_due, last_ckpt_time, eval_metrics = False, False, time.time(), {}
    first_step_at, task_sums = None, None  # task_sums: the task's training-metric sums since the last log line
    while True:
        step = state.step
        last_step = step >= t.max_steps
        if step > run.start_step and (last_step or _due(step, t.eval_every)):
            run.probe(step, Phase.EVAL)
            eval_metrics = evaluate(task, tr.model, task.val_set, run.info, t.micro_batch_size, t.eval_max_samples,
                                    tr.autocast)
            monitor.eval(step, eval_metrics)
        if step > run.start_step and (last_step or stop or checkpoint_due or _due(step, t.checkpoint_every)):
            _save(run, state)
            last_ckpt_time = time.time()
        if last_step or stop:
            return stop, eval_metrics, first_step_at

        minutes_due = (bool(t.checkpoint_every_minutes)
                       and time.time() - last_ckpt_time > 60 * t.checkpoint_every_minutes)
        r = train_step(run, tr, task, state, votes=(run.preempt.requested, minutes_due))
        state.advance(t.global_batch_size, int(r.tokens), r.marks.host_seconds)
        first_step_at = first_step_at or time.time()
        stop, checkpoint_due = r.stop, r.checkpoint_due
        run.telemetry.step(r)
        if r.task_sums is not None:
            task_sums = r.task_sums if task_sums is None else task_sums + r.task_sums

        step = state.step
        if step % t.log_every == 0 or step == t.max_steps or stop:
            # loss, rates, time split, per-rank resources, MFU: one gather on all ranks, the line on rank 0
            monitor.train(step, {**run.telemetry.collect(step), **_task_metrics(run, task, task_sums), "lr": r.lr,
                                 "grad_norm": r.grad_norm, "tokens_seen": state.tokens_seen,
                                 "epoch": run.batches.sampler.epochs(state.samples_seen)})
            task_sums = None


def _task_metrics(run: Run, task, task_sums: torch.Tensor | None) -> dict:
    """The task's training metrics over the log window: its sums all-reduced (every rank has some or none)."""
    if task_sums is None:
        return {}
    sums = dist.all_reduce(task_sums.tolist(), run.info)
    return task.train_metrics(sums) if run.info.is_main else {}


def _due(step: int, every: int) -> bool:
    return bool(every) and step % every == 0


def _save(run: Run, state: TrainState) -> None:
    step = state.step
    run.probe(step, Phase.CHECKPOINT)
    path, seconds = run.checkpointer.save(step, run.saved,
                                          {"config_hash": config_hash(run.cfg), "config": relevant_subset(run.cfg),
                                           "base_model": run.base_model, "shard_plan": run.shard_plan},
                                          after_write=lambda: run.probe(step, Phase.CHECKPOINT_WRITTEN))
    run.monitor.log({"step": step, "event": "checkpoint", "checkpoint_s": round(seconds, 4), "path": str(path)})


@dataclass
class StepResult:
    loss_sum: torch.Tensor  # this rank's part of the step's loss x `count`, on the device (read at log steps)
    count: float        # the task's first count of the whole global batch (all-reduced): the log window's weight
    tokens: float       # tokens of the global batch, padding included (all-reduced)
    useful: float       # non-padding tokens of the global batch (all-reduced)
    local_tokens: int
    stop: bool          # some rank was asked to stop (preemption): all agree
    checkpoint_due: bool  # time-based checkpoint vote
    grad_norm: float
    lr: float
    marks: StepMarks    # the step's phase marks (run/clock.py), read by telemetry
    task_sums: torch.Tensor | None = None  # this rank's sums of the task's training metrics (task.step_loss)


def train_step(run: Run, tr: Trainee, task, state: TrainState, votes: tuple[bool, bool]) -> StepResult:
    """One optimizer step: this rank's micro-batches of the global batch, one gradient all-reduce.
    `votes`: this rank asks to stop (preemption) / to checkpoint now (time-based)."""
    step, info, clock = state.step, run.info, run.clock
    run.probe(step, Phase.START)
    clock.start()
    run.probe(step, Phase.DATA)
    micro_ids, host = run.batches.take(state.samples_seen)
    clock.mark(TAKEN)
    run.probe(step, Phase.ROLLOUT)  # the task's work on the model first (GRPO: generate, score); most have none
    host = task.rollout(tr, host, step, beat=lambda k: run.probe(step, Phase.ROLLOUT, k))
    clock.mark(ROLLOUT)
    # Counted on the host batches: a count read from the GPU would wait for everything queued there.
    counts = [sum(c) for c in zip(*(task.step_counts(b) for b in host))]
    local = [sum(task.batch_tokens(b) for b in host), sum(task.useful_tokens(b) for b in host)]
    batches = [dist.to_device(b, info.device) for b in host]
    run.probe(step, Phase.SYNC)
    clock.mark(DATA)
    # One small collective per step: the task's counts (its loss normalisers), tokens and the stop votes.
    *totals, tokens, useful, stop_votes, time_votes = dist.all_reduce([*counts, *local, *map(float, votes)], info)
    clock.mark(SYNC)
    losses, sums = _forward_backward(run, tr, task, batches, micro_ids, totals, step)
    run.probe(step, Phase.OPTIMIZER)
    grad_norm, lr = _optimizer_step(run, tr, state, losses, micro_ids)
    marks = clock.stop()
    return StepResult(loss_sum=sum(losses) * totals[0], count=totals[0], tokens=tokens, useful=useful,
                      local_tokens=local[0], stop=stop_votes > 0, checkpoint_due=time_votes > 0, grad_norm=grad_norm,
                      lr=lr, marks=marks, task_sums=sums)


def micro_seed(seed: int, step: int, micro_id: int) -> int:
    """Seed for one micro-batch's randomness (dropout), independent of which rank runs it."""
    return int(np.random.SeedSequence([seed, step, micro_id]).generate_state(1)[0])


def sync_context(wrapped, model, last: bool, fsdp_every_micro_batch: bool = True):
    """Whether this micro-batch's backward reduces its gradients: always the step's last one; under DDP no other
    (no_sync: its buckets hold the accumulated gradient anyway); under FSDP2 every one by default, so each rank
    accumulates its shard only (train.fsdp_sync=step: the last one only, the gradient kept unsharded)."""
    fsdp = wrapped is model and hasattr(model, "set_requires_gradient_sync")
    if last or (fsdp and fsdp_every_micro_batch) or (wrapped is model and not fsdp):
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


def _forward_backward(run: Run, tr: Trainee, task, batches, micro_ids, totals, step) -> tuple[list, object]:
    """Accumulate gradients of each micro-batch's part of the global-batch loss (the task divides by the
    step's all-reduced counts) times the world size, so DDP's average is the global-batch loss's gradient.
    Returns the parts and the sums of the task's training metrics."""
    losses, world, sums = [], run.info.world_size, None
    for k, (batch, mid) in enumerate(zip(batches, micro_ids)):
        torch.manual_seed(micro_seed(run.cfg.train.seed, step, mid))
        with sync_context(tr.wrapped, tr.model, k == len(batches) - 1, run.cfg.train.fsdp_sync == "micro_batch"):
            poison = run.probe(step, Phase.FORWARD, k)
            with tr.autocast():
                loss, metric_sums = task.step_loss(tr.forward, batch, totals)
            if poison:  # test-only: debug.fault nan
                loss = loss * float("nan")
            run.clock.mark(FORWARD)
            run.probe(step, Phase.BACKWARD, k)
            tr.scaler.scale(loss * world).backward()
            run.clock.mark(BACKWARD)
        losses.append(loss.detach())  # no host sync here: checked only if the step turns out non-finite
        if metric_sums is not None:
            sums = metric_sums if sums is None else sums + metric_sums
    return losses, sums


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
        local_bad = next((m for m, loss in zip(micro_ids, losses) if not torch.isfinite(loss)), math.inf)
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


def _finish(run: Run, tr: Trainee, task, state: TrainState, eval_metrics: dict, accum: int, counts: dict,
            first_step_at: float | None) -> dict:
    """The summary (RUN/summary.json) and the closing lines."""
    cfg, info, t, now = run.cfg, run.info, run.cfg.train, time.time()
    summary = {
        "task": cfg.task, "name": cfg.name, "world_size": info.world_size, "global_batch_size": t.global_batch_size,
        "micro_batch_size": t.micro_batch_size, "grad_accum": accum, "steps": state.step,
        "tokens_seen": state.tokens_seen, "samples_seen": state.samples_seen,
        "nan_skipped_steps": state.nan_skips, **counts,
        "train_time_s": round(state.train_time_s, 3),
        "tokens_per_s": state.tokens_seen / max(state.train_time_s, 1e-9),
        "wall_time_s": round(now - run.started_at, 3),
        "startup_s": round((first_step_at or now) - run.started_at, 3),
        "resumed_from_step": run.start_step, "optimizer_impl": optimizer_impl(tr.optimizer),
        **eval_metrics, **task.summary_extra(), **run.telemetry.summary()}
    if info.is_main:
        write_json(run.folder.summary, summary)
    shown = ", ".join(f"{k} {v:.4g}" for k, v in eval_metrics.items() if isinstance(v, float))
    run.monitor.message(f"phalanx: done at step {state.step}" + (f"; final {shown}" if shown else "")
                        + f"; final model in {run.folder.final}\nnext: "
                        + "\n      ".join(task.next_commands(run.folder.root)))
    run.monitor.close()
    return summary


def _prepare_run_dir(cfg: Config, folder: RunFolder) -> None:
    folder.root.mkdir(parents=True, exist_ok=True)
    save_yaml(cfg, folder.config)
    folder.preempted.unlink(missing_ok=True)
    folder.error.unlink(missing_ok=True)
