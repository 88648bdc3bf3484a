"""Shared helpers: real `phalanx` processes on small configs over the shared offline data sets."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
SHAKESPEARE = DATA / "tinyshakespeare" / "input.txt"
SST2 = DATA / "sst2"

# A model small enough that a step takes milliseconds; same shape family as the real configs.
TINY_LM = ["model.n_layer=2", "model.n_head=2", "model.n_embd=64", "model.block_size=32",
           "data.vocab_size=512", "train.micro_batch_size=4", "train.global_batch_size=16",
           "train.log_every=1", "train.eval_every=0", "train.warmup_steps=2", "train.lr=3e-3",
           "train.eval_max_samples=64", "log.progress=lines"]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("token-cache")


@pytest.fixture(scope="module")
def s3():
    """A real S3-compatible server on 127.0.0.1 (tests/s3server.py), this process's environment pointed at it."""
    from s3server import S3Server

    with S3Server() as server:
        yield server


@pytest.fixture(scope="session")
def tok(tmp_path_factory) -> str:
    """A tokenizer trained on Tiny Shakespeare's first 2,000 non-empty lines (the object-storage tests)."""
    from test_prepare import tokenizer_dir

    lines = [line for line in SHAKESPEARE.read_text(encoding="utf-8").splitlines() if line.strip()][:2000]
    return str(tokenizer_dir(tmp_path_factory.mktemp("tok"), "\n".join(lines)))


@pytest.fixture(scope="module")
def pg():
    """A real one-process Gloo group, as a lone `phalanx train` worker makes it (one per test module)."""
    import torch  # here, not at the top: most test modules never load torch in this process
    import torch.distributed as tdist

    import phalanx.core.dist as pdist

    saved_env, threads = dict(os.environ), torch.get_num_threads()
    owned = not tdist.is_initialized()
    try:
        info = pdist.setup("gloo", timeout_s=60, threads=threads, tune_malloc=False)
    finally:  # env:// is read only by init; RANK/WORLD_SIZE must not leak into later subprocess tests
        os.environ.clear()
        os.environ.update(saved_env)
    assert (info.rank, info.world_size, info.backend) == (0, 1, "gloo") and tdist.is_initialized()
    yield info
    if owned:
        pdist.teardown()
    os.environ.clear()
    os.environ.update(saved_env)
    torch.set_num_threads(threads)


def phalanx(*args, timeout: float = 120, env: dict | None = None, check: bool = False,
            fresh_process: bool = False, input: str | None = None) -> subprocess.CompletedProcess:
    """Run the real CLI in its own process (as a user would): forked from this pytest worker's pre-imported
    zygote for that environment (tests/cli_zygote.py), or `python -m phalanx` when `fresh_process` (start-up
    under test)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    argv = [str(a) for a in args]
    if not fresh_process:
        proc = _ZYGOTE.run(argv, full_env, timeout, input)
    else:
        proc = subprocess.run([sys.executable, "-m", "phalanx", *argv], cwd=REPO, env=full_env, input=input,
                              capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"phalanx {' '.join(map(str, args))} exited {proc.returncode}\n"
                             f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}")
    return proc


def with_worker_zygote(env: dict) -> dict:
    """`env` for a command that starts torchrun itself (a `phalanx` launcher, `python -m torch.distributed.run`):
    its workers come from the pre-imported worker zygote (torchrun's PYTHON_EXEC; tests/cli_zygote.py) of this
    pytest worker's usual environment (OMP_NUM_THREADS may differ: the worker sets its threads from it)."""
    return {**env, "PYTHON_EXEC": _ZYGOTE.python_exec({**os.environ, "PYTHONUNBUFFERED": "1"})}


def zygote_python() -> str:
    """The worker zygote's client as an interpreter: `[zygote_python(), "-m", MODULE, ...]` runs the module as
    `python -m` does, pre-imported (a `phalanx` launcher, an srun-style worker, `torch.distributed.run`); the
    variables it runs with are its own `env`."""
    return with_worker_zygote({})["PYTHON_EXEC"]


# Variables that differ between commands without a zygote of their own: nothing reads them at import time (a
# command's process still gets its whole environment). pytest names the running test; in-process tests make
# libraries set the others in this process (each would otherwise start a new zygote: ~10 s of CPU).
RUNTIME_ONLY = {"PYTEST_CURRENT_TEST", "TOKENIZERS_PARALLELISM", "TORCHINDUCTOR_CACHE_DIR", "KMP_DUPLICATE_LIB_OK",
                "KMP_INIT_AT_FORK",
                # the S3 server's (tests/s3server.py): botocore reads them when a client is made
                "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                "AWS_EC2_METADATA_DISABLED"}


class Zygote:
    """Pre-imported `phalanx` processes for this pytest worker (tests/cli_zygote.py), one per environment (a
    fixture may point the environment elsewhere; the two most recent are kept): a command then runs without
    its ~8 s of imports."""

    def __init__(self):
        self.procs: dict[frozenset, subprocess.Popen] = {}
        self.python_execs: dict[int, str] = {}  # zygote pid -> the PYTHON_EXEC that hands workers to it

    def python_exec(self, env: dict) -> str:
        return self.python_execs[self._get(env).pid]

    def _get(self, env: dict) -> subprocess.Popen:
        key = frozenset((k, v) for k, v in env.items() if k not in RUNTIME_ONLY)
        proc = self.procs.pop(key, None)
        if proc is None or proc.poll() is not None:
            proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("cli_zygote.py"))], cwd=REPO,
                                    env=dict(key), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            ready = json.loads(proc.stdout.readline())
            assert ready["ready"] is True
            self.python_execs[proc.pid] = ready["python_exec"]
        while len(self.procs) > 1:  # the least recently used goes
            old = self.procs.pop(next(iter(self.procs)))
            old.stdin.close()  # its loop ends and it removes its folder; its worker zygote dies with it
            try:
                old.wait(timeout=10)
            except subprocess.TimeoutExpired:
                old.kill()
                old.wait()
        self.procs[key] = proc
        return proc

    def run(self, argv: list[str], env: dict, timeout: float, input: str | None = None) -> subprocess.CompletedProcess:
        import signal
        import tempfile
        import threading

        proc = self._get(env)
        with tempfile.TemporaryDirectory(prefix="phalanx-cli-") as tmp:
            out, err, stdin = Path(tmp) / "stdout", Path(tmp) / "stderr", Path(tmp) / "stdin"
            if input is not None:
                stdin.write_text(input, encoding="utf-8")
            proc.stdin.write(json.dumps({"argv": argv, "env": env, "cwd": str(REPO), "out": str(out), "err": str(err),
                                         "in": str(stdin) if input is not None else None}) + "\n")
            proc.stdin.flush()
            pid = json.loads(proc.stdout.readline())["pid"]
            # a thread, not select(): a quick command's {"rc"} may already sit in the text stream's buffer
            replies: list[dict] = []
            reader = threading.Thread(target=lambda: replies.append(json.loads(proc.stdout.readline())), daemon=True)
            reader.start()
            reader.join(timeout)
            timed_out = reader.is_alive()
            if timed_out:  # as subprocess.run: kill it, then raise
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                reader.join()
            rc = replies[0]["rc"]
            stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        if timed_out:
            raise subprocess.TimeoutExpired(["phalanx", *argv], timeout, stdout, stderr)
        return subprocess.CompletedProcess(["phalanx", *argv], rc, stdout, stderr)


_ZYGOTE = Zygote()


def srun_env(rank: int, port: int, job: str) -> dict:
    """The environment srun gives task `rank` of a 2-task, 1-node step (what phalanx reads to be a worker)."""
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**clean, "PYTHONUNBUFFERED": "1", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),
            "SLURM_NTASKS": "2", "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_STEP_ID": "0",
            "SLURM_JOB_ID": job, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in metrics(run_dir) if "loss" in m and "event" not in m}


def final_params(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(run_dir) / "final" / "model.safetensors"))


def runs_at(tmp_path_factory, name: str, args_of, worlds=(1, 2)) -> dict:
    """The same `phalanx` command (args_of(run_dir)) at each world size: {world: run folder}."""
    runs = {}
    for n in worlds:
        runs[n] = tmp_path_factory.mktemp(f"{name}-{n}")
        phalanx(*args_of(runs[n]), "--nproc-per-node", n, check=True, timeout=180)
    return runs


def assert_same_losses(got_run: Path, want_run: Path, steps: int, rel: float = 1e-5) -> dict:
    """Both runs logged every step 1..steps with losses within `rel`; returns want_run's losses."""
    got, want = train_losses(got_run), train_losses(want_run)
    assert sorted(want) == list(range(1, steps + 1)) and sorted(got) == sorted(want)
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=rel), f"step {step}"
    return want


def paired_params(run_dir: Path, ref_dir: Path):
    """(name, got, want) over both runs' final parameters (the same names), copies. GPT-2's key bias gets no
    gradient in exact math (softmax ignores a shift shared by all keys), so its "gradient" is rounding noise
    that Adam scales up to lr-sized steps, falling by the CPU's kernels (AVX2 here: ~1e-6 apart): it is checked
    to stay noise in both runs and zeroed; the query and value biases compare like every other parameter."""
    got_all, want_all = final_params(run_dir), final_params(ref_dir)
    assert got_all.keys() == want_all.keys()
    for name in want_all:
        got, want = got_all[name].clone(), want_all[name].clone()
        if name.endswith("attn.c_attn.bias"):
            key = slice(got.numel() // 3, 2 * got.numel() // 3)
            assert got[key].abs().max() < 1e-4 and want[key].abs().max() < 1e-4, name
            got[key] = want[key] = 0
        yield name, got, want


def tiny_llama(folder: Path):
    """A tiny random Llama (seed 0) saved in shards of 40 KB with their index, as hub repos ship one."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1))
    model.save_pretrained(folder, max_shard_size="40KB")
    return model


def lm_args(run_dir: Path, cache: Path, *extra) -> list[str]:
    return ["train", f"data.train={SHAKESPEARE}", f"data.cache_dir={cache}", "--run-dir", str(run_dir),
            *TINY_LM, *extra]


# One thread per worker: a run then gives bit-identical losses however its two workers are started
# (one launcher, two launchers, srun), since the thread count changes the order of float sums. Gloo
# also on a GPU machine: two workers of one node, or two "nodes" on one machine, would share a GPU.
REFERENCE = ["train.max_steps=10", "train.checkpoint_every=5", "train.eval_max_samples=9",
             "dist.threads_per_worker=1", "dist.backend=gloo"]


@pytest.fixture(scope="session")
def ddp2_reference(tmp_path_factory, cache_dir) -> Path:
    """TINY_LM + REFERENCE under DDP at 2 processes: the trajectory multi-node, srun and FSDP runs match."""
    run = tmp_path_factory.mktemp("ddp2-reference")
    phalanx(*lm_args(run, cache_dir, *REFERENCE), "--nproc-per-node", 2, check=True, timeout=240)
    return run


def small_gpt2_base(folder: Path, chars: int, vocab: int, positions: int, width: int, **config) -> Path:
    """`folder`: a small pretrained GPT-2 (2 layers, 2 heads, seed 0) and a BPE tokenizer trained on the first
    `chars` characters of Tiny Shakespeare, without a chat template (as a pretraining run's final/)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    from phalanx.data import tokenizer as toks

    tok = PreTrainedTokenizerFast(tokenizer_object=toks.train_bpe([SHAKESPEARE.read_text()[:chars]], vocab),
                                  **toks.SPECIALS["bpe"])
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=positions, n_embd=width, n_layer=2, n_head=2,
                               eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id, **config)
                    ).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder



SMOLLM2_GGUF = REPO.parent / "shared" / "models" / "smollm2-135m-instruct-gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_folder(cache_dir) -> Path:
    """The shared SmolLM2-135M-Instruct (GGUF Q4_1) dequantised once per session through phalanx's own
    resolution (tools/launch.resolve_pretrained) into the session cache: a plain fp32 folder (config,
    safetensors, tokenizer with its chat template). Runs with data.cache_dir=cache_dir and
    model.pretrained=SMOLLM2_GGUF find it there and do not dequantise again."""
    if not SMOLLM2_GGUF.is_file():
        pytest.skip(f"{SMOLLM2_GGUF} is not there (see ../shared/models/README.md)")
    from phalanx.core.config import load_config
    from phalanx.tools.launch import resolve_pretrained

    cfg = load_config(None, [f"model.pretrained={SMOLLM2_GGUF}", f"data.cache_dir={cache_dir}"])
    return Path(resolve_pretrained(cfg).model.pretrained)
