"""Beyond one launcher: two launchers (nodes) on this machine, srun's variables, the Slurm and
Kubernetes examples. Every real run here matches `ddp2_reference` (DDP, one launcher, 2 processes)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import (
    REFERENCE,
    REPO,
    SHAKESPEARE,
    final_params,
    lm_args,
    metrics,
    phalanx,
    srun_env,
    train_losses,
    with_worker_zygote,
    zygote_python,
)

EXAMPLES = REPO / "examples"


def _free_port() -> int:
    from phalanx.core.dist import free_port

    return free_port()


def _start(args: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([zygote_python(), "-m", "phalanx", *map(str, args)], cwd=REPO,
                            env=with_worker_zygote({**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(procs: list[subprocess.Popen], timeout: float = 240) -> list[str]:
    outputs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        outputs.append(out)
    codes = [p.returncode for p in procs]
    assert codes == [0] * len(procs), f"exit codes {codes}\n" + "\n----\n".join(o[-3000:] for o in outputs)
    return outputs


def assert_same_run(run: Path, reference: Path) -> None:
    """Same per-step losses and final parameters (bit-identical in practice: see REFERENCE)."""
    got, want = train_losses(run), train_losses(reference)
    assert sorted(got) == sorted(want) == list(range(1, 11))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-6), f"step {step}"
    p_got, p_want = final_params(run), final_params(reference)
    assert p_got.keys() == p_want.keys()
    for name in p_want:
        torch.testing.assert_close(p_got[name], p_want[name], rtol=1e-6, atol=1e-6, msg=name)


# ---- two launchers = two nodes ------------------------------------------------------------------
def test_two_launchers_match_one_launcher(tmp_path, cache_dir, ddp2_reference):
    run, port = tmp_path / "two-nodes", _free_port()
    args = [*lm_args(run, cache_dir, *REFERENCE), "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"test-{port}"]
    t0 = time.perf_counter()
    outputs = _finish([_start(args), _start(args)])
    wall = time.perf_counter() - t0
    assert_same_run(run, ddp2_reference)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2
    # Only global rank 0 writes run-level output: one start line, one metrics stream, one config.
    assert sum(o.count("phalanx: task lm") for o in outputs) == 1
    assert [m["step"] for m in metrics(run) if "loss" in m and "event" not in m] == list(range(1, 11))
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["max_steps"] == 10
    print(f"two launchers: {wall:.1f} s wall")


def test_multinode_flags_are_checked_before_any_worker(tmp_path, cache_dir):
    base = lm_args(tmp_path / "r", cache_dir)
    proc = phalanx(*base, "--nnodes", "2")
    assert proc.returncode == 2 and "--rdzv-endpoint" in proc.stderr
    proc = phalanx(*base, "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1", "--fresh")
    assert proc.returncode == 2 and "--fresh with --rdzv-endpoint" in proc.stderr
    # Elastic 1:3 nodes: every world size in the range must divide the global batch (16 = 4 x 4).
    proc = phalanx(*base, "--nnodes", "1:3", "--rdzv-endpoint", "127.0.0.1:1")
    assert proc.returncode == 2 and "world size (3)" in proc.stderr
    assert not (tmp_path / "r").exists()


def test_nnodes_range_passes_through_to_the_elastic_launcher():
    import torch.distributed.run as trun

    from phalanx.tools.launch import torchrun_args

    argv = torchrun_args(["phalanx.run.worker", "c.yaml"], 2, "1:4", "head:29500", "job7", 3)
    args = trun.get_args_parser().parse_args(argv)
    assert (args.nnodes, args.nproc_per_node, args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id,
            args.max_restarts) == ("1:4", "2", "c10d", "head:29500", "job7", 3)
    assert trun.parse_min_max_nnodes(args.nnodes) == (1, 4)


def test_nodes_sharing_a_cache_folder_both_finish(tmp_path):
    """Two nodes' main processes build the same tokenizer folder; the one that finishes second finds
    the folder in place (a rename cannot replace a non-empty folder) and uses it."""
    from phalanx.data.cache import build_once

    target = tmp_path / "tokenizer-abc"

    def build(tmp: Path) -> None:
        tmp.mkdir()
        (tmp / "vocab.json").write_text("mine")
        target.mkdir()  # meanwhile, the other node renamed its identical build into place
        (target / "vocab.json").write_text("theirs")

    assert build_once(target, build) == target
    assert (target / "vocab.json").read_text() == "theirs"
    assert [p.name for p in tmp_path.iterdir()] == ["tokenizer-abc"]  # no temporary left behind


# ---- Slurm: srun's variables around a real 2-process Gloo run -----------------------------------
def test_slurm_env_maps_ranks():
    from phalanx.core import dist

    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_STEP_ID": "0", "SLURM_LOCALID": "1",
           "SLURM_NODEID": "2", "SLURM_NNODES": "4", "SLURM_NTASKS_PER_NODE": "2(x4)", "SLURM_JOB_ID": "777",
           "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.1"}
    saved = dict(os.environ)
    try:
        for key in ("MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(key, None)
        os.environ.update(env)
        assert dist.under_srun()
        mapped = dist.slurm_env()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert mapped == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                      "GROUP_RANK": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": str(20000 + 777)}


def test_simulated_srun_matches_torchrun(tmp_path, cache_dir, ddp2_reference):
    """Two `python -m phalanx train` processes with srun's variables are the two workers (no launcher); their
    interpreter is the worker zygote's client (tests/cli_zygote.py), which runs `-u -m phalanx` as python does
    (test_remote.py's commands start launcher and workers as fresh interpreters)."""
    run, port = tmp_path / "srun", _free_port()
    procs = []
    python = zygote_python()
    for rank in (0, 1):
        env = srun_env(rank, port, job="4242")
        procs.append(subprocess.Popen([python, "-u", "-m", "phalanx", *lm_args(run, cache_dir, *REFERENCE)],
                                      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outputs = _finish(procs)
    assert "world size 2" in outputs[0] and "phalanx: task lm" not in outputs[1]  # rank 0 is SLURM_PROCID 0
    assert_same_run(run, ddp2_reference)


# ---- the shipped Slurm and Kubernetes examples: their phalanx command lines parse and validate ----
def _expand(command: str, assignments: list[str], env: dict[str, str]) -> list[str]:
    """Let bash do the quoting and ${VAR:-default} expansion, as the real script would."""
    src = "\n".join([*assignments, f"argv=({command})", 'printf "%s\\0" "${argv[@]}"'])
    out = subprocess.run(["bash", "-c", src], env={"PATH": os.environ["PATH"], "HOME": "/home/u", **env},
                         capture_output=True, text=True, check=True)
    return out.stdout.split("\0")[:-1]


def check_train_command(argv: list[str], tmp_path: Path):
    """What `phalanx train` would check before starting workers, with the data path mapped here."""
    from phalanx.cli import _split_config_and_overrides, build_parser, nproc_per_node
    from phalanx.core.config import load_config
    from phalanx.tools.launch import check_flags, check_multinode, preflight

    assert argv[:2] == ["phalanx", "train"], argv
    args, rest = build_parser().parse_known_args(argv[1:])
    assert not [r for r in rest if r.startswith("-")], rest
    config, overrides = _split_config_and_overrides(list(args.items) + rest)
    overrides = [f"data.train={SHAKESPEARE}" if o.startswith("data.train=") else o for o in overrides]
    overrides = [o for o in overrides if not o.startswith("data.cache_dir=")]
    cfg = load_config(str(REPO / config), [*overrides, f"run_dir={tmp_path / 'run'}"])
    args.nproc_per_node = nproc_per_node(args.nproc_per_node, cfg.dist.backend)  # as cmd_train does
    check_flags(args.nproc_per_node, args.nnodes, args.rdzv_endpoint, args.rdzv_id, args.max_restarts)
    check_multinode(args.nnodes, args.rdzv_endpoint, args.fresh)
    preflight(cfg, args.nproc_per_node, args.nnodes)
    return args, cfg


def test_sbatch_command_parses_and_validates(tmp_path):
    script = (EXAMPLES / "slurm" / "train.sbatch").read_text()
    assert "#SBATCH --ntasks-per-node=1" in script  # one launcher per node
    lines = script.replace("\\\n", " ").splitlines()
    assignments = [ln for ln in lines if re.match(r"^[A-Za-z_]+=", ln) and "$(" not in ln]
    srun = next(ln for ln in lines if ln.startswith("srun ") and "phalanx train" in ln)
    assert "--ntasks-per-node=1" in srun
    command = srun[srun.index("phalanx train"):]
    argv = _expand(command, assignments, {"SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "4",
                                          "SLURM_JOB_ID": "1234", "head_node": "node001"})
    args, cfg = check_train_command(argv, tmp_path)
    assert (args.nnodes, args.nproc_per_node, args.rdzv_endpoint, args.rdzv_id) == \
        ("2", 4, "node001:29500", "1234")
    assert cfg.train.global_batch_size == 128 and cfg.model.n_layer == 4


def test_pytorchjob_command_parses_and_validates(tmp_path):
    job = yaml.safe_load((EXAMPLES / "k8s" / "pytorchjob.yaml").read_text())
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"} and specs["Master"]["replicas"] == 1
    pods = sum(spec["replicas"] for spec in specs.values())
    commands = []
    for spec in specs.values():
        (container,) = [c for c in spec["template"]["spec"]["containers"] if c["name"] == "pytorch"]
        assert container["command"] == ["bash", "-c"]
        commands.append(container["args"][0])
    assert commands[0] == commands[1]  # every pod runs the same launcher command
    command = commands[0][commands[0].index("phalanx train"):]
    argv = _expand(command, [], {"MASTER_ADDR": "phalanx-shakespeare-master-0", "MASTER_PORT": "23456"})
    args, _ = check_train_command(argv, tmp_path)
    assert int(args.nnodes) == pods
    assert args.rdzv_endpoint == "phalanx-shakespeare-master-0:23456"
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    assert args.nproc_per_node == gpus
