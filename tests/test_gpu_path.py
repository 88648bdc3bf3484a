"""The GPU path's logic, tested on the CPU: which GPU each process and sweep trial gets, and how many
processes a node runs (issue: fix what would crash or misplace work on CUDA + NCCL)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from phalanx.core import dist
from phalanx.core.errors import ConfigError
from phalanx.core.host import gpu_ids
from phalanx.tools.sweep import plan_slots


def sweep(parallel: int, nproc: int):
    return SimpleNamespace(parallel=parallel, nproc_per_trial=nproc)


@pytest.mark.parametrize("visible, count, expected", [
    (None, 3, ["0", "1", "2"]),
    ("4,5,6,7", 4, ["4", "5", "6", "7"]),
    ("GPU-1a2b,GPU-3c4d", 2, ["GPU-1a2b", "GPU-3c4d"]),
    ("MIG-aaaa, MIG-bbbb", 2, ["MIG-aaaa", "MIG-bbbb"]),
    ("2,-1,3", 1, ["2"]),          # CUDA stops at the first invalid entry
    ("", 0, []),
])
def test_gpu_ids_follow_the_parents_list(visible, count, expected):
    assert gpu_ids(visible, count) == expected


def test_sweep_slots_map_through_the_schedulers_gpus():
    """A job given GPUs 4-7 runs its trials on those, never on 0-3 (someone else's)."""
    slots = plan_slots(sweep(2, 2), ["4", "5", "6", "7"], oversubscribe=False, cpus=list(range(16)))
    assert [s.gpus for s in slots] == [["4", "5"], ["6", "7"]]
    assert all(s.threads == 4 for s in slots)  # 16 cores over 4 processes: the trials do not contend
    uuids = plan_slots(sweep(2, 1), ["GPU-a", "GPU-b"], oversubscribe=False, cpus=[0, 1])
    assert [s.gpus for s in uuids] == [["GPU-a"], ["GPU-b"]]


def test_oversubscribed_gpu_slots_never_repeat_a_gpu_within_a_trial():
    slots = plan_slots(sweep(3, 2), ["0", "1"], oversubscribe=True, cpus=[0, 1])
    for s in slots:
        assert len(set(s.gpus)) == len(s.gpus) == 2  # never CUDA_VISIBLE_DEVICES="0,0"
    with pytest.raises(ConfigError, match="nproc_per_trial 3 = 3 processes but 2 GPU"):
        plan_slots(sweep(1, 3), ["0", "1"], oversubscribe=True, cpus=[0, 1])
    with pytest.raises(ConfigError, match="--oversubscribe"):
        plan_slots(sweep(3, 2), ["0", "1"], oversubscribe=False, cpus=[0, 1])


def test_each_local_process_gets_its_own_gpu():
    assert [dist.device_index(r, 4, 4, per_task_gpu=False) for r in range(4)] == [0, 1, 2, 3]
    # srun --gpus-per-task=1: every task sees one GPU, its own
    assert [dist.device_index(r, 4, 1, per_task_gpu=True) for r in range(4)] == [0, 0, 0, 0]
    assert dist.device_index(0, 1, 1, per_task_gpu=False) == 0
    # one launcher, 2 processes, 1 visible GPU: an error, not both ranks on cuda:0
    with pytest.raises(ConfigError, match="2 processes on this node but 1 visible GPU"):
        dist.device_index(1, 2, 1, per_task_gpu=False)
    with pytest.raises(ConfigError, match="3 processes on this node but 2 visible GPU"):
        dist.device_index(2, 3, 2, per_task_gpu=False)


def test_launcher_refuses_more_nccl_processes_than_gpus():
    assert dist.check_gpu_count("nccl", 2, 2) is None
    assert dist.check_gpu_count("gloo", 8, 0) is None
    problem = dist.check_gpu_count("nccl", 4, 2)
    assert "4 processes but 2 visible GPU(s)" in problem and "--nproc-per-node 2" in problem


def test_nproc_auto_is_one_without_a_gpu(monkeypatch):
    assert dist.auto_nproc("gloo") == (1, "no GPU: one process")
    monkeypatch.setattr(dist.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist.torch.cuda, "device_count", lambda: 8)
    assert dist.auto_nproc("nccl")[0] == 8


@pytest.mark.parametrize("name, bf16, fp32", [
    ("NVIDIA H100 80GB HBM3", 989, 67),
    ("NVIDIA H100 NVL", 835, 60),           # not the SXM peak
    ("NVIDIA H100 PCIe", 756, 51),
    ("NVIDIA H200", 989, 67),
    ("NVIDIA GH200 480GB", 989, 67),        # its own entry, not hidden behind H200
    ("NVIDIA A100-SXM4-80GB", 312, 19.5),
    ("NVIDIA A100 80GB PCIe", 312, 19.5),
    ("NVIDIA L40", 181, 90.5),              # not L4
    ("NVIDIA L4", 121, 30.3),
    ("NVIDIA A10", 125, 31.2),
    ("Tesla V100-SXM2-16GB", 125, 15.7),
    ("NVIDIA GeForce RTX 4090", 165, 82.6),
])
def test_mfu_peak_matches_the_exact_gpu_model(monkeypatch, name, bf16, fp32):
    import torch

    from phalanx.run import telemetry

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    cuda = torch.device("cuda", 0)
    assert telemetry.peak_tflops(0.0, cuda, torch.bfloat16) == (bf16, name)
    assert telemetry.peak_tflops(0.0, cuda, None) == (fp32, name)


@pytest.mark.parametrize("name", ["NVIDIA A10G", "NVIDIA L40G", "NVIDIA H800", "Some Future GPU"])
def test_unlisted_gpus_get_no_borrowed_peak(monkeypatch, name):
    import torch

    from phalanx.run import telemetry

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    peak, source = telemetry.peak_tflops(0.0, torch.device("cuda", 0), torch.bfloat16)
    assert peak == 0.0 and "set log.peak_tflops" in source
    assert telemetry.peak_tflops(500.0, torch.device("cuda", 0), torch.bfloat16) == (500.0, "log.peak_tflops")


def test_doctor_reads_gpu_memory_without_a_context_of_its_own(monkeypatch, capsys):
    """doctor's own process never touches a GPU (an exclusive-process GPU would then refuse its NCCL
    workers); the child's `free` is already net of one context, so the estimate does not subtract another."""
    import torch

    from phalanx.tools import doctor

    def no_context(*a):
        raise AssertionError("doctor created a CUDA context in its own process")

    monkeypatch.setattr(torch.cuda, "mem_get_info", no_context)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(doctor, "gpu_memory", lambda: [("NVIDIA H200", 100 * doctor.GB, 140 * doctor.GB)])
    avail = doctor.check_devices(doctor.Report(), 1)
    assert avail["cuda"] == 100 * doctor.GB
    assert "cuda:0" in capsys.readouterr().out
    from phalanx.core.config import load_config

    rep = doctor.Report()
    doctor.check_memory(rep, load_config(None, []), 1, 1, "nccl", avail)
    (line,) = [d for v, c, d in rep.lines if c == "memory plan"]
    assert "vs 100.00 GB per GPU" in line


def load_strategies():
    import importlib.util

    from conftest import REPO

    spec = importlib.util.spec_from_file_location("strategies", REPO / "bench" / "strategies.py")
    strategies = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(strategies)
    return strategies


def test_two_launchers_on_one_gpu_machine_get_their_own_gpus(monkeypatch):
    """bench/strategies.py's '2 launchers x1' case: each launcher sees its own GPU (else both take cuda:0)."""
    import torch

    strategies = load_strategies()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert [strategies.launcher_gpus(i, 1, 2) for i in range(2)] == [{"CUDA_VISIBLE_DEVICES": "4"},
                                                                     {"CUDA_VISIBLE_DEVICES": "5"}]
    assert [strategies.launcher_gpus(i, 2, 2) for i in range(2)] == [{"CUDA_VISIBLE_DEVICES": "4,5"},
                                                                     {"CUDA_VISIBLE_DEVICES": "6,7"}]
    assert strategies.launcher_gpus(0, 2, 1) == {}  # one launcher: the environment as it is
    with pytest.raises(RuntimeError, match="need 6 GPUs, 4 visible"):
        strategies.launcher_gpus(0, 3, 2)


def test_bench_contention_check_does_not_misfire_on_gpus(tmp_path):
    """A GPU rank mostly waits for its device: low CPU use there is not contention."""
    import json

    from phalanx.tools import bench

    rows = [{"step": s, "loss": 1.0, "tokens_per_s": 1000.0, "step_time_s": 0.1, "ranks/cpu_percent": [15.0, 12.0],
             "ranks/host_peak_mb": [900.0, 900.0], "ranks/cuda_peak_mb": [5000.0, 5000.0],
             "fwd_bwd_time_s": 0.09, "optimizer_time_s": 0.01} for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    on_gpu = bench.measure(tmp_path, warmup=1, threads=8)
    assert on_gpu["quiet_steps"] == 4
    for r in rows:
        del r["ranks/cuda_peak_mb"]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert bench.measure(tmp_path, warmup=1, threads=8)["quiet_steps"] == 0  # on CPU it is contention


# ---- item 8: host-device waits (counts on the host, scalars on Gloo, prefetch) ----------------------
class IdTask:
    """Collates a micro-batch as its sample ids; records the thread that collated it."""

    def __init__(self, n):
        self.train_set, self.threads = list(range(n)), []

    def collate(self, dataset, ids):
        import threading

        import torch

        self.threads.append(threading.current_thread().name)
        return {"input_ids": torch.tensor([dataset[int(i)] for i in ids]), "tag": "host"}


@pytest.mark.parametrize("start", [0, 40, 96])  # a fresh run and two resume offsets (one mid-epoch)
def test_prefetched_batches_are_the_synchronous_ones_in_order(start):
    """Across epoch boundaries (50 samples, 16 per step: steps straddle them) and from a resume offset,
    rank 1 of 2 gets exactly the micro-batches (and ids) of the inline path, collated on the thread."""
    import torch

    from phalanx.data.samplers import GlobalBatchSampler
    from phalanx.run.batches import BatchSource

    def steps(prefetch):
        task = IdTask(50)
        sampler = GlobalBatchSampler(50, 16, 4, seed=3)
        source = BatchSource(task, sampler, 1, 2, torch.device("cpu"), prefetch=prefetch)
        try:
            out = [source.take(start + 16 * s) for s in range(12)]
            # a take at an offset nobody prefetched (never in the loop) is still right
            out.append(source.take(start))
        finally:
            source.close()
        return [(ids, [b["input_ids"].tolist() for b in bs]) for ids, bs in out], task.threads

    inline, inline_threads = steps(False)
    ahead, ahead_threads = steps(True)
    assert ahead == inline
    assert set(inline_threads) == {"MainThread"}
    # inline only the first step and the unexpected offset (2 micro-batches each); the rest ahead on the thread
    assert ahead_threads.count("MainThread") == 4
    assert sum(t.startswith("phalanx-batches") for t in ahead_threads) >= 11 * 2
    assert sum(len(b) for _, bs in inline[:-1] for b in bs) == 12 * 8  # rank 1's half of 12 batches of 16


def test_tokens_are_counted_on_the_host_batch_before_the_copy(monkeypatch):
    """train_step counts (target_count, batch_tokens, useful_tokens) on the host batches, and only the
    copies it moved reach the model; the counts are the ones of the batch."""
    import torch

    from phalanx.core.config import Config
    from phalanx.data.samplers import GlobalBatchSampler
    from phalanx.model import precision
    from phalanx.run import train as train_mod
    from phalanx.run.batches import BatchSource
    from phalanx.run.clock import StepClock
    from phalanx.run.state import TrainState
    from phalanx.tasks.base import TaskBase

    class Task(IdTask):
        def count(self, batch):
            assert batch["tag"] == "host", "counted after the copy to the device"
            return int(batch["input_ids"].numel())

        target_count = batch_tokens = count
        step_counts, step_loss, rollout = TaskBase.step_counts, TaskBase.step_loss, TaskBase.rollout  # TaskBase's

        def useful_tokens(self, batch):
            return self.count(batch) - 1

        def loss_sum(self, model, batch):
            assert batch["tag"] == "device"
            return model(batch["input_ids"].float()[:, None]).sum()

    monkeypatch.setattr(train_mod.dist, "to_device", lambda batch, device: {**batch, "tag": "device"})
    cfg = Config()
    cfg.train.global_batch_size, cfg.train.micro_batch_size = 8, 4
    info = dist.DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, attempt=0,
                         backend="gloo", device=torch.device("cpu"))
    task, model = Task(20), torch.nn.Linear(1, 1)
    tr = SimpleNamespace(model=model, wrapped=model, forward=model, optimizer=torch.optim.SGD(model.parameters(), 0.1),
                         schedule=SimpleNamespace(apply=lambda opt, step: 0.1),
                         autocast=precision.autocast_factory(info.device, None),
                         scaler=precision.make_scaler(info.device, None))
    run = SimpleNamespace(cfg=cfg, info=info, probe=lambda *a: False, clock=StepClock(),
                          batches=BatchSource(task, GlobalBatchSampler(20, 8, 4, 0), 0, 1, info.device, False))
    r = train_mod.train_step(run, tr, task, TrainState(), votes=(False, False))
    assert (r.count, r.tokens, r.useful, r.local_tokens) == (8.0, 8.0, 6.0, 8)
    assert torch.is_tensor(r.loss_sum) and r.grad_norm > 0


def test_scalar_collectives_run_on_a_gloo_group_next_to_nccl(monkeypatch):
    """dist.setup with NCCL makes a Gloo group (every rank, right after the default group), and the step's
    scalars are reduced and gathered there, in host tensors, never on the GPU; with Gloo the default group
    (already on the host) is used."""
    import torch

    calls = []
    monkeypatch.setattr(dist.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(dist.torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(dist.tdist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist.tdist, "init_process_group", lambda backend, **kw: calls.append(("init", backend)))
    monkeypatch.setattr(dist.tdist, "new_group", lambda **kw: calls.append(("new_group", kw["backend"])) or "GLOO")
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(dist.torch, "set_num_threads", lambda n: None)
    info = dist.setup("nccl", timeout_s=5, threads=1, tune_malloc=False)
    assert calls == [("init", "nccl"), ("new_group", "gloo")]
    assert info.device == torch.device("cuda", 1) and info.scalar_group == "GLOO"

    seen = []

    def all_reduce(t, op=None, group=None):
        seen.append((t.device.type, group))

    def all_gather(out, t, group=None):
        seen.append((t.device.type, group))
        for o in out:
            o.copy_(t)

    monkeypatch.setattr(dist.tdist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist.tdist, "all_gather", all_gather)
    assert dist.all_reduce([1.0, 2.0], info) == [1.0, 2.0]
    assert dist.all_gather_floats([3.0], info) == [[3.0], [3.0]]
    assert seen == [("cpu", "GLOO"), ("cpu", "GLOO")]
    gloo = dist.DistInfo(rank=0, world_size=2, local_rank=0, local_world_size=2, node_rank=0, attempt=0,
                         backend="gloo", device=torch.device("cpu"))
    dist.all_reduce([1.0], gloo)
    assert seen[-1] == ("cpu", None)  # the default group


# ---- wirings: train.tf32, the launcher's GPU count ------------------------------------------------
@pytest.fixture
def tf32_flags():
    import torch

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_tf32_is_applied_on_cuda_only(tf32_flags):
    import torch

    from phalanx.model.precision import set_tf32

    assert set_tf32(True, "cuda") is True
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert torch.get_float32_matmul_precision() == "high"
    assert set_tf32(False, "cuda") is False
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    mkldnn = torch.backends.mkldnn.matmul.fp32_precision
    torch.backends.cuda.matmul.allow_tf32 = True
    assert set_tf32(False, "cpu") is None and torch.backends.cuda.matmul.allow_tf32  # CPU: untouched
    assert torch.backends.mkldnn.matmul.fp32_precision == mkldnn


@pytest.mark.parametrize("tf32", [True, False])
def test_the_worker_applies_train_tf32_and_says_it(tf32_flags, tf32):
    """build_trainee (every worker, before the model's first matmul) applies train.tf32 on a CUDA device,
    and the start line says it. The 'GPU' is the CPU here: the model's .to() is a no-op."""
    import torch

    from phalanx.core.config import Config
    from phalanx.run import train as train_mod

    class Model(torch.nn.Linear):
        def to(self, *args, **kwargs):
            return self

    cfg = Config()
    cfg.train.tf32, cfg.train.precision, cfg.train.optimizer_impl = tf32, "fp32", "foreach"
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not tf32
    info = dist.DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, attempt=0,
                         backend="nccl", device=torch.device("cuda", 0))
    tr = train_mod.build_trainee(cfg, info, SimpleNamespace(build_model=lambda builder: Model(2, 2)))
    assert torch.backends.cuda.matmul.allow_tf32 is tf32 and torch.backends.cudnn.allow_tf32 is tf32
    assert train_mod.start_line(cfg, info, tr, 1).endswith(f", tf32 {'on' if tf32 else 'off'}")
    cpu = dataclasses_replace(info, backend="gloo", device=torch.device("cpu"))
    assert "tf32" not in train_mod.start_line(cfg, cpu, tr, 1)


def dataclasses_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)


def test_launcher_preflight_refuses_more_nccl_processes_than_gpus(monkeypatch, tmp_path, capsys):
    """`phalanx train --nproc-per-node 2` with NCCL and one visible GPU: exit 2 with the numbers, before
    any data is prepared or worker started (the run folder is not even made); one process passes."""
    from phalanx import cli
    from phalanx.core.config import load_config
    from phalanx.tools import launch

    monkeypatch.setattr(dist.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(dist.tdist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(launch, "prepare_data", lambda cfg: pytest.fail("data prepared before the check"))
    run = tmp_path / "run"
    code = cli.main(["train", "dist.backend=nccl", "train.precision=fp32", "--nproc-per-node", "2",
                     "--run-dir", str(run)])
    assert code == 2 and not run.exists()
    assert "2 processes but 1 visible GPU(s)" in capsys.readouterr().err
    cfg = load_config(None, ["dist.backend=nccl", "train.precision=fp32", f"run_dir={run}"])
    launch.preflight(cfg, 1, "1")  # one process per GPU: fine
    monkeypatch.setattr(dist.torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ConfigError, match="1 processes but 0 visible GPU"):
        launch.preflight(cfg, 1, "1")


def test_bench_mfu_uses_the_exact_gpu_peak(monkeypatch):
    """gpu_check.sh's throughput table: bench/strategies.py's MFU column reads phalanx's peak table (a dict
    keyed by exact model since issue 19 item 9; iterating it as the old (pattern, bf16, fp32) rows crashed
    the report after every run had finished, on the H200)."""
    import torch

    strategies = load_strategies()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    assert strategies.gpu_peak_tflops(True) == 989 and strategies.gpu_peak_tflops(False) == 67
    row = {"name": "bf16 x1", "nproc": 1, "params": 1_000_000, "tokens_per_s": 1e5}
    assert strategies.mfu(row, "cuda").endswith("%")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 NVL")
    assert strategies.gpu_peak_tflops(True) == 835
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA L40")  # not "L4"
    assert strategies.gpu_peak_tflops(True) == 181
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Some GPU")
    assert strategies.mfu(row, "cuda") == "? (unknown GPU)"
