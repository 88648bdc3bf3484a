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
    (line,) = [d for v, c, d in rep.lines if c == "memory estimate"]
    assert "vs 100.00 GB available per GPU" in line


def test_two_launchers_on_one_gpu_machine_get_their_own_gpus(monkeypatch):
    """bench/strategies.py's '2 launchers x1' case: each launcher sees its own GPU (else both take cuda:0)."""
    import importlib.util

    import torch
    from conftest import REPO

    spec = importlib.util.spec_from_file_location("strategies", REPO / "bench" / "strategies.py")
    strategies = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(strategies)
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
