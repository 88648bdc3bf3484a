"""Step timing on CUDA, tested on the CPU: a simulated host clock and GPU queue per rank, fake CUDA events
(recorded when the queue reaches them), and the real StepClock/Telemetry accounting on top.

The simulation has what a DDP step on GPUs has: asynchronous kernel launches, a host wait for the
gradient norm, the gradient all-reduce in the last backward (each GPU waits for the slowest), the
optimizer's kernels running on while the host collates the next step, and the step-start sync on the
host (Gloo). Rank 1's GPU is slower.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from phalanx.core import dist
from phalanx.core.config import Config
from phalanx.run import telemetry as telemetry_mod
from phalanx.run.clock import BACKWARD, DATA, FORWARD, SYNC, StepClock, split
from phalanx.run.telemetry import Telemetry

FWD, BWD, NORM, OPT, H2D, COLLATE, ALLREDUCE = 0.010, 0.020, 0.001, 0.006, 0.0005, 0.002, 0.003


class Timeline:
    """One rank: a host clock and the time at which its GPU queue runs empty (simulated seconds)."""

    def __init__(self):
        self.host = self.gpu = 0.0
        self.syncs = 0

    def launch(self, seconds: float) -> None:
        self.gpu = max(self.gpu, self.host) + seconds
        self.host += 1e-4  # launching is quick; the work runs later

    def wait(self) -> None:  # the host reads a value from the GPU (e.g. float(grad_norm))
        self.host = max(self.host, self.gpu)


class FakeEvent:
    def __init__(self, tl: Timeline):
        self.tl, self.t = tl, None

    def record(self):  # the queue reaches the event once the work queued before it is done
        self.t = max(self.tl.gpu, self.tl.host)

    def query(self):
        return self.t <= self.tl.host

    def synchronize(self):
        self.tl.syncs += 1
        self.tl.host = max(self.tl.host, self.t)

    def elapsed_time(self, other):
        return (other.t - self.t) * 1000.0


def ranks(speeds, on_device=True):
    tls = [Timeline() for _ in speeds]
    clocks = [StepClock(clock=lambda tl=tl: tl.host, event=(lambda tl=tl: FakeEvent(tl)) if on_device else None)
              for tl in tls]
    return tls, clocks


def simulate_step(tls, clocks, speeds, micro=2):
    """One DDP step on every rank, phase by phase in lockstep; returns each rank's StepMarks."""
    for tl, c in zip(tls, clocks):
        c.start()
        tl.host += COLLATE
        tl.launch(H2D)
        c.mark(DATA)
    leave = max(tl.host for tl in tls) + 2e-4  # Gloo all-reduce: everyone leaves when the last arrives
    for tl, c in zip(tls, clocks):
        tl.host = leave
        c.mark(SYNC)
    for k in range(micro):
        for tl, c, s in zip(tls, clocks, speeds):
            tl.launch(FWD * s)
            c.mark(FORWARD)
            tl.launch(BWD * s)
        if k == micro - 1:  # the gradient all-reduce: every GPU waits for the slowest backward
            done = max(tl.gpu for tl in tls) + ALLREDUCE
            for tl in tls:
                tl.gpu = done
        for c in clocks:
            c.mark(BACKWARD)
    out = []
    for tl, c, s in zip(tls, clocks, speeds):
        tl.launch(NORM * s)
        tl.wait()  # float(grad_norm): the step's one host wait
        tl.launch(OPT * s)
        out.append(c.stop())
    return out


def test_split_adds_up_and_gpu_work_lands_in_its_own_phase():
    tls, clocks = ranks([1.0])
    steps = [simulate_step(tls, clocks, [1.0])[0] for _ in range(3)]
    device = clocks[0].read(steps)
    host = [split(m.kinds, m.host) for m in steps]
    for t in device + host:
        assert t.data + t.sync + t.fwd_bwd + t.optimizer == pytest.approx(t.time, abs=1e-12)
    for d, h in zip(device[1:], host[1:]):
        # the GPU's forward+backward (+ all-reduce) is in fwd_bwd, not launch times
        assert d.fwd_bwd == pytest.approx(2 * (FWD + BWD) + ALLREDUCE, rel=1e-6)
        assert h.fwd_bwd < 0.01  # what host clocks saw: launches only ...
        assert h.optimizer > 2 * (FWD + BWD)  # ... and the GPU's work where the host waited, for the norm
        # the optimizer's kernels count in their own step (host clocks: they spill into the next one)
        assert d.optimizer == pytest.approx(NORM + OPT, rel=1e-6)
        # the next step's collation ran while the optimizer was still on the GPU: only the copy is exposed
        assert d.data == pytest.approx(H2D, rel=1e-6) and h.data == pytest.approx(COLLATE + 1e-4, rel=1e-6)
        assert d.local == pytest.approx(d.data + 2 * FWD + BWD + d.optimizer, rel=1e-6)


def test_events_are_read_with_one_synchronize_per_window():
    tls, clocks = ranks([1.0])
    steps = [simulate_step(tls, clocks, [1.0])[0] for _ in range(10)]
    assert len(clocks[0].read(steps)) == 10 and tls[0].syncs == 1
    made = []
    clock = StepClock(clock=lambda: tls[0].host, event=lambda: made.append(FakeEvent(tls[0])) or made[-1])
    for _ in range(2):  # read events are recorded again: no new event per step once warm
        marks = simulate_step(tls, [clock], [1.0])
        clock.read(marks)
    assert len(made) == len(marks[0].kinds)
    # without waiting, only what the GPU has finished is read (the last step's optimizer is still running)
    pending = [simulate_step(tls, [clock], [1.0])[0] for _ in range(3)]
    syncs = tls[0].syncs
    ready = clock.read(pending, wait=False)
    assert len(ready) == 2 and tls[0].syncs == syncs


def run_windows(monkeypatch, speeds, on_device, windows=6, steps_per_window=2):
    """Telemetry of 2 ranks over several log windows; returns rank 0's records and its Telemetry."""
    tls, clocks = ranks(speeds, on_device)
    cfg = Config()
    cfg.log.straggler_margin, cfg.log.straggler_windows = 0.2, 3
    messages = []
    monitor = SimpleNamespace(message=messages.append, log=lambda rec: None)
    model = torch.nn.Linear(2, 2)
    tel = []
    for r in range(2):
        info = dist.DistInfo(rank=r, world_size=2, local_rank=r, local_world_size=2, node_rank=0, attempt=0,
                             backend="nccl", device=torch.device("cpu"))
        tel.append(Telemetry(info, cfg, n_params=6, model=model, wrapped=model, amp_dtype=None, monitor=monitor,
                             clock=clocks[r]))
    records = []
    for w in range(windows):
        for _ in range(steps_per_window):
            for t, marks in zip(tel, simulate_step(tls, clocks, speeds)):
                t.step(SimpleNamespace(loss_sum=torch.tensor(3.0), count=64.0, tokens=64.0, useful=64.0,
                                       local_tokens=32, marks=marks))
        rows = {}
        for r in (1, 0):  # the gather: rank 1's row reaches rank 0
            def gather(values, info, r=r, rows=rows):
                rows[r] = list(values)
                return [rows.get(0, values), rows[1]]
            monkeypatch.setattr(telemetry_mod.dist, "all_gather_floats", gather)
            rec = tel[r].collect((w + 1) * steps_per_window)
        records.append(rec)
    return records, tel[0], messages


@pytest.fixture
def fake_group(monkeypatch):
    monkeypatch.setattr(telemetry_mod.dist, "barrier", lambda info: None)
    return monkeypatch


def test_a_slow_gpu_is_the_straggler_on_device_time(fake_group):
    records, tel, messages = run_windows(fake_group, [1.0, 1.5], on_device=True)
    for rec in records:
        split_sum = sum(rec[f"{k}_time_s"] for k in ("data", "sync", "fwd_bwd", "optimizer"))
        assert split_sum == pytest.approx(sum(rec["ranks/step_time_s"]) / 2, rel=1e-4)
        # every rank's step takes as long (the fast one waits in the all-reduce), but not its busy time
        assert rec["ranks/step_time_s"][0] == pytest.approx(rec["ranks/step_time_s"][1], rel=0.05)
        assert rec["ranks/busy_time_s"][1] > 1.3 * rec["ranks/busy_time_s"][0]
        assert rec["loss"] == pytest.approx(3.0 * 2 * 2 / (64.0 * 2))  # both ranks' loss over the window's targets
    assert [s["rank"] for s in tel.summary()["stragglers"]] == [1]
    assert any("rank 1 is a straggler" in m for m in messages)
    assert tel.pending == []  # every step read at its window


def test_host_clocks_cannot_see_a_slow_gpu(fake_group):
    """Negative control: the same slow GPU timed with host clocks (no events) is named by nobody, and an
    even pair of GPUs is named by nobody either."""
    _, tel, messages = run_windows(fake_group, [1.0, 1.5], on_device=False)
    assert tel.summary()["stragglers"] == [] and not messages
    _, tel, messages = run_windows(fake_group, [1.0, 1.0], on_device=True)
    assert tel.summary()["stragglers"] == [] and not messages


def test_cpu_accounting_is_immediate_and_busy_is_step_minus_waits():
    """On the CPU (no events) a step is accounted when it ends, nothing is kept for later, and busy is
    step - sync - exposed comm (no comm hook at world size 1)."""
    tls, clocks = ranks([1.0], on_device=False)
    info = dist.DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, attempt=0,
                         backend="gloo", device=torch.device("cpu"))
    model = torch.nn.Linear(2, 2)
    tel = Telemetry(info, Config(), n_params=6, model=model, wrapped=model, amp_dtype=None,
                    monitor=SimpleNamespace(message=None, log=None), clock=clocks[0])
    marks = simulate_step(tls, clocks, [1.0])[0]
    tel.step(SimpleNamespace(loss_sum=torch.tensor(0.1, dtype=torch.float32), count=4.0, tokens=4.0, useful=4.0,
                             local_tokens=4, marks=marks))
    assert tel.pending == [] and tel.window["time"] == pytest.approx(marks.host_seconds)
    t = split(marks.kinds, marks.host)
    rec = tel.collect(1)
    assert rec["ranks/busy_time_s"] == [pytest.approx(t.time - t.sync, rel=1e-5)]
    assert rec["fwd_bwd_time_s"] == pytest.approx(marks.host_at(BACKWARD) - marks.host[2], rel=1e-5)
    # the loss read at the log step is the float32 loss exactly, as float(loss) per step gave it
    assert rec["loss"] * 4.0 == float(torch.tensor(0.1, dtype=torch.float32))


def test_a_rollout_is_its_own_slice_of_the_step():
    """A task's rollout (GRPO: generation) between collating and counting is timed apart: data keeps only the
    collate, count and copy, and the five slices add up to the step; a step without one has rollout 0."""
    from phalanx.run.clock import ROLLOUT, TAKEN

    now = [0.0]
    c = StepClock(clock=lambda: now[0])
    c.start()
    for kind, dt in ((TAKEN, 0.01), (ROLLOUT, 2.0), (DATA, 0.02), (SYNC, 0.001), (FORWARD, 0.3), (BACKWARD, 0.5)):
        now[0] += dt
        c.mark(kind)
    now[0] += 0.1
    t = split(*(lambda m: (m.kinds, m.host))(c.stop()))
    assert t.rollout == pytest.approx(2.0) and t.data == pytest.approx(0.03)
    assert t.data + t.rollout + t.sync + t.fwd_bwd + t.optimizer == pytest.approx(t.time)
    tls, clocks = ranks([1.0], on_device=False)
    assert split(*(lambda m: (m.kinds, m.host))(simulate_step(tls, clocks, [1.0])[0])).rollout == 0.0


def test_the_step_trains_on_what_the_tasks_rollout_returns():
    """The loop hands the task its collated micro-batches before counting them; the step counts and trains on
    what the rollout returned (here: every batch doubled), and the rollout's beats reach the watchdog."""
    from phalanx.core.config import Config
    from phalanx.data.samplers import GlobalBatchSampler
    from phalanx.model import precision
    from phalanx.run import train as train_mod
    from phalanx.run.batches import BatchSource
    from phalanx.run.state import TrainState
    from phalanx.tasks.base import TaskBase

    class Task(TaskBase):
        train_set = range(20)

        def collate(self, dataset, indices):
            return {"input_ids": torch.tensor([[float(i)] for i in indices]), "labels": torch.zeros(len(indices))}

        def rollout(self, trainee, batches, step, beat=None):
            beat(0)
            return [{k: torch.cat([v, v]) for k, v in b.items()} for b in batches]

        def loss_sum(self, model, batch):
            return model(batch["input_ids"]).sum()

        useful_tokens = TaskBase.batch_tokens

    cfg = Config()
    cfg.train.global_batch_size, cfg.train.micro_batch_size = 8, 4
    info = dist.DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, attempt=0,
                         backend="gloo", device=torch.device("cpu"))
    task, model, beats = Task(cfg, info), torch.nn.Linear(1, 1), []
    tr = SimpleNamespace(model=model, wrapped=model, forward=model, optimizer=torch.optim.SGD(model.parameters(), 0.1),
                         schedule=SimpleNamespace(apply=lambda opt, step: 0.1),
                         autocast=precision.autocast_factory(info.device, None),
                         scaler=precision.make_scaler(info.device, None))
    run = SimpleNamespace(cfg=cfg, info=info, probe=lambda *a: beats.append(a) or False, clock=StepClock(),
                          batches=BatchSource(task, GlobalBatchSampler(20, 8, 4, 0), 0, 1, info.device, False))
    r = train_mod.train_step(run, tr, task, TrainState(), votes=(False, False))
    assert r.count == 16.0 and r.local_tokens == 16  # 2 micro-batches of 4, each doubled
    assert any(len(a) == 3 and a[1] == train_mod.Phase.ROLLOUT and a[2] == 0 for a in beats)  # the task's beat
    assert split(r.marks.kinds, r.marks.host).rollout >= 0 and "rollout" in r.marks.kinds
