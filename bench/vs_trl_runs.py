"""bench/vs_trl.py's pieces: the shared model and data, each side's command line, and reading back what a
run measured (rates from wall clocks, per-rank peak RSS, effective settings, optimizer state bytes, the
first-step losses)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import psutil

REPO = Path(__file__).resolve().parents[1]
BLOCK = 256  # phalanx's model.block_size = TRL's max_length
OPTIM = {"lr": 3e-4, "warmup": 5, "min_lr_ratio": 0.1, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95}
FIRST_SIZES = (16, 20, 24, 28, 32)  # first-step batch: the first n conversations whose packing is an even row count


def env(work: Path) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1", "HF_DATASETS_CACHE": str(work / "hf-datasets"),
            "PYTHONWARNINGS": "ignore::FutureWarning"}


class Peaks(dict):
    """Peak RSS (VmHWM) in MB of each rank; `.private`: the peak of its sampled RssAnon (private memory), MB."""

    def __init__(self, hwm: dict, private: dict):
        super().__init__(hwm)
        self.private = private


class PeakRss(threading.Thread):
    """Peak RSS (VmHWM) and sampled peak private memory (RssAnon) of each rank process under `pid`: a process
    with LOCAL_RANK in its environment whose parent has none (the workers of torchrun and of phalanx's elastic
    agent)."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.done, self.kind, self.peak, self.private = pid, threading.Event(), {}, {}, {}

    def run(self) -> None:
        while not self.done.wait(0.2):
            self.sample()

    def rank_of(self, p: psutil.Process) -> int:
        if p.pid not in self.kind:
            try:
                own, parent = p.environ(), psutil.Process(p.ppid()).environ()
            except psutil.Error:
                return -1
            if "LOCAL_RANK" in own and "LOCAL_RANK" not in parent:
                self.kind[p.pid] = int(own["RANK"])
            else:  # not a rank, or one forked but not yet exec'd (the parent's environment): ask again
                return -1
        return self.kind[p.pid]

    def sample(self) -> None:
        try:
            kids = psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            return
        for p in kids:
            rank = self.rank_of(p)
            if rank < 0:
                continue
            try:
                status = Path(f"/proc/{p.pid}/status").read_text()
            except OSError:
                continue
            hwm = re.search(r"VmHWM:\s+(\d+) kB", status)  # absent once the process is a zombie
            if hwm:
                self.peak[rank] = max(self.peak.get(rank, 0.0), int(hwm.group(1)) / 1024)
            anon = re.search(r"RssAnon:\s+(\d+) kB", status)
            if anon:
                self.private[rank] = max(self.private.get(rank, 0.0), int(anon.group(1)) / 1024)


def run(cmd: list[str], log: Path, work: Path, timeout: float = 900) -> Peaks:
    """Run `cmd` (output to `log`); returns the peak RSS in MB of each rank (and `.private`, RssAnon)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env(work),
                                start_new_session=True)
        sampler = PeakRss(proc.pid)
        sampler.start()
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the group of the command started here
            code = "timeout"
        sampler.done.set()
        sampler.join()
    if code:
        raise SystemExit(f"failed ({code}): {' '.join(map(str, cmd))}\n{log.read_text()[-3000:]}")
    return Peaks(sampler.peak, sampler.private)


def data_args(s: dict, data: Path | None, extra) -> list[str]:
    return [str(REPO / "examples" / "chat.yaml"), f"model.pretrained={s['base']}", f"data.train={data or s['train']}",
            f"data.validation={s['val']}", f"data.cache_dir={s['work'] / 'cache'}", f"model.block_size={BLOCK}",
            *[x for x in extra if x.startswith("data.")]]


def phalanx_prepared(s: dict, extra=(), data: Path | None = None) -> None:
    """`phalanx prepare` once per data variant, before its first `phalanx train` (untimed either way; it also
    kept the bench running while c8791ca's launcher imported transformers in a thread beside the data step,
    which failed the chat tokenizer's import, since undone)."""
    args = data_args(s, data, extra)
    done = s.setdefault("prepared", set())
    if tuple(args) not in done:
        log = s["work"] / f"prepare-{len(done)}.log"
        run([sys.executable, "-m", "phalanx", "prepare", *args, "--quiet"], log, s["work"])
        done.add(tuple(args))


def phalanx_cmd(s: dict, out: Path, steps: int, micro: int, global_batch: int, nproc: int, log_every: int,
                extra=(), data: Path | None = None) -> list[str]:
    phalanx_prepared(s, extra, data)
    o = OPTIM
    return [sys.executable, "-m", "phalanx", "train", *data_args(s, data, ()), f"train.max_steps={steps}",
            f"train.log_every={log_every}", "train.eval_every=0", "train.eval_max_samples=8",
            "train.checkpoint_every=0", f"train.lr={o['lr']}", f"train.warmup_steps={o['warmup']}",
            f"train.min_lr_ratio={o['min_lr_ratio']}", f"train.weight_decay={o['weight_decay']}",
            f"train.beta1={o['beta1']}", f"train.beta2={o['beta2']}", "train.grad_clip=1.0", "train.precision=fp32",
            f"train.micro_batch_size={micro}", f"train.global_batch_size={global_batch}", "log.progress=off",
            *extra, "--nproc-per-node", str(nproc), "--run-dir", str(out)]


def trl_cmd(s: dict, out: Path, steps: int, micro: int, accum: int, nproc: int, extra=(), data: Path | None = None,
            log_every: int = 10_000) -> list[str]:
    """TRL's side; s["trl_base"] and s["trl_train"], where set, replace s["base"] and s["train"] (a GGUF base that
    phalanx reads itself, data in TRL's prompt-completion format)."""
    o = OPTIM
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            str(REPO / "bench" / "trl_side.py"), "--base", str(s.get("trl_base", s["base"])),
            "--data", str(data or s.get("trl_train", s["train"])),
            "--max-length", str(BLOCK), "--micro", str(micro), "--accum", str(accum), "--steps", str(steps),
            "--lr", str(o["lr"]), "--warmup", str(o["warmup"]), "--min-lr-ratio", str(o["min_lr_ratio"]),
            "--weight-decay", str(o["weight_decay"]), "--beta1", str(o["beta1"]), "--beta2", str(o["beta2"]),
            "--log-every", str(log_every), "--out", str(out), "--work", str(out) + "-trainer", *extra]


def metric_lines(run_dir: Path) -> list[dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if "loss" in m and "event" not in m]


def phalanx_rate(run_dir: Path, warmup: int, supervised_fraction: float) -> dict:
    """Rates over the log windows after `warmup` steps, on rank 0's line times (wall clock)."""
    lines = metric_lines(run_dir)
    first = next(m for m in lines if m["step"] >= warmup)
    later = [m for m in lines if m["step"] > first["step"]]
    n = later[0]["step"] - first["step"]  # steps per window
    useful = sum(m["useful_tokens_per_s"] * m["step_time_s"] * n for m in later)
    slots = sum(m["tokens_per_s"] * m["step_time_s"] * n for m in later)
    wall, steps = later[-1]["time_s"] - first["time_s"], later[-1]["step"] - first["step"]
    split = {k: float(np.mean([m[f"{k}_time_s"] for m in later])) for k in ("data", "sync", "fwd_bwd", "optimizer")}
    return {"useful_tps": useful / wall, "supervised_tps": useful / wall * supervised_fraction, "step_s": wall / steps,
            "efficiency": useful / slots, "tokens_per_step": useful / steps, "split": split}


def phalanx_effective(run_dir: Path, s: dict) -> dict:
    """What phalanx ran with: world size (summary.json), precision (its start line), activation
    checkpointing (the run's config.yaml; phalanx applies it per block itself) and attention (the model
    phalanx's own builder makes for this config)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    start = (run_dir.parent / f"{run_dir.name}.log").read_text()
    precision = re.search(r"precision (\S+?),", start)
    ckpt = re.search(r"^\s+activation_checkpointing: (\S+)", (run_dir / "config.yaml").read_text(), re.M)
    return {"world": summary["world_size"], "precision": precision.group(1) if precision else "?",
            "attn": s["phalanx_attn"], "gc": bool(ckpt) and ckpt.group(1) not in ("none", "false"),
            "trainable": summary["trainable_parameters"]}


def phalanx_version() -> str:
    """The commit and a digest of phalanx/ as it is on disk (other people edit the tree while this runs)."""
    import hashlib

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout
    h = hashlib.sha256()
    for f in sorted((REPO / "phalanx").rglob("*.py")):
        h.update(f.read_bytes())
    return f"{head.strip()} + phalanx/ {h.hexdigest()[:10]}"


def trl_rate(prefix: Path, nproc: int, warmup: int) -> dict:
    files = sorted(prefix.parent.glob(f"{prefix.name}-[0-9]*.jsonl"))
    ranks = [[json.loads(x) for x in f.read_text().splitlines()] for f in files]
    info = ranks[0][-1]
    steps = [[m for m in rows if "step" in m] for rows in ranks]
    timed = [[m for m in rows if m["step"] > warmup] for rows in steps]
    total = {k: sum(m[k] for rows in timed for m in rows) for k in ("tokens", "useful", "supervised")}
    clock = {m["step"]: m["time_s"] for m in steps[0]}
    wall = clock[timed[0][-1]["step"]] - clock[warmup]
    dtype = info["param_dtype"].removeprefix("torch.").replace("float32", "fp32")
    return {"useful_tps": total["useful"] / wall, "supervised_tps": total["supervised"] / wall,
            "step_s": wall / len(timed[0]), "efficiency": total["useful"] / total["tokens"],
            "tokens_per_step": total["useful"] / len(timed[0]), "world": min(info["world_size"], len(files)),
            "precision": dtype + (" autocast" if info["autocast"] else ""), "attn": info["attn"],
            "gc": info["gradient_checkpointing"], "info": info}


def checkpoint_optimizer(run_dir: Path) -> tuple[int, int]:
    """(bytes of the optimizer state, parameters it trains) in the run's last checkpoint, from the DCP
    metadata: every optim.* tensor, and the sizes of the exp_avg moments (one per trained parameter)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    ckpt = run_dir / "checkpoints"
    name = json.loads((ckpt / "latest").read_text())["name"]
    meta = FileSystemReader(str(ckpt / name)).read_metadata().state_dict_metadata
    optim = {k: m for k, m in meta.items() if k.startswith("optim.") and isinstance(m, TensorStorageMetadata)}
    return (sum(int(np.prod(m.size)) * m.properties.dtype.itemsize for m in optim.values()),
            sum(int(np.prod(m.size)) for k, m in optim.items() if k.endswith(".exp_avg")))


def lora_at_gpt2_small(r: int) -> tuple[int, int]:
    """(trained by LoRA, trained by full fine-tuning) parameters of phalanx's LoRA (model.lora.r=r, its default
    targets) on GPT-2 small's shape (12 x 768, vocab 50257; random init, nothing downloaded): the 5% target at a
    realistic size."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from phalanx.core.sections import LoraSettings
    from phalanx.model.lora import apply_lora

    base = GPT2LMHeadModel(GPT2Config())
    full = sum(p.numel() for p in base.parameters())
    model = apply_lora(base, LoraSettings(r=r), [])
    return sum(p.numel() for p in model.parameters() if p.requires_grad), full


# ---- the shared model and data ---------------------------------------------------------------------------
def make_base(pretrained: Path, work: Path) -> list[int]:
    """work/base: the pretrained GPT-2 + tokenizer with phalanx's ChatML template (embeddings grown for its
    two tokens); work/train.jsonl: the built-in conversations that fit in BLOCK tokens (their lengths
    returned); work/val.jsonl: 8 of them (phalanx's data.validation, so no training conversation is held out)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from phalanx.data.builtin import stdlib_conversations
    from phalanx.data.chat.template import ensure_template

    tok = AutoTokenizer.from_pretrained(pretrained)
    ensure_template(tok)
    model = AutoModelForCausalLM.from_pretrained(pretrained)
    model.resize_token_embeddings(len(tok), mean_resizing=True)
    model.save_pretrained(work / "base")
    tok.save_pretrained(work / "base")
    kept, lengths = [], []
    for conv in stdlib_conversations():
        n = len(tok.apply_chat_template(conv["messages"], tokenize=True, return_dict=True)["input_ids"])
        if n <= BLOCK:
            kept.append(json.dumps(conv))
            lengths.append(n)
    (work / "train.jsonl").write_text("\n".join(kept) + "\n")
    (work / "val.jsonl").write_text("\n".join(kept[:8]) + "\n")
    return lengths


def setup(work: Path, per_step: int, divisor: int) -> dict:
    """Untimed: the base model, the data, the one-process checks and the batch plan. Packed rows per
    micro-batch: about as many real tokens per step as `per_step` padded conversations, in rows/divisor."""
    from phalanx.core.config import ModelConfig
    from phalanx.data.units import pack
    from phalanx.model.build import build_causal_lm

    pre = work / "pretrain"
    run([sys.executable, "-m", "phalanx", "train", f"model.block_size={BLOCK}", "train.max_steps=1",
         "train.global_batch_size=8", "train.micro_batch_size=8", "train.eval_every=0", "train.eval_max_samples=8",
         f"data.cache_dir={work / 'cache'}", "log.progress=off", "--nproc-per-node", "1", "--run-dir", str(pre)],
        work / "pretrain.log", work)
    lengths = make_base(pre / "final", work)
    for n in FIRST_SIZES:  # packed rows of the first-step batch split evenly over 2 ranks
        first_rows = len(pack(np.asarray(lengths[:n]), BLOCK)[1]) - 1
        if first_rows % 2 == 0:
            break
    lines = (work / "train.jsonl").read_text().splitlines()
    (work / "first.jsonl").write_text("\n".join(lines[:n]) + "\n")
    run([sys.executable, str(REPO / "bench" / "trl_checks.py"), "--base", str(work / "base"), "--data",
         str(work / "train.jsonl"), "--first", str(work / "first.jsonl"), "--max-length", str(BLOCK),
         "--work", str(work / "checks"), "--out", str(work / "checks.json")], work / "checks.log", work)
    checks = json.loads((work / "checks.json").read_text())
    rows = len(pack(np.asarray(lengths), BLOCK)[1]) - 1
    pack_eff, mean_len = sum(lengths) / (rows * BLOCK), float(np.mean(lengths))
    model = build_causal_lm(ModelConfig(pretrained=str(work / "base")), 0, 0)
    return {"work": work, "base": work / "base", "train": work / "train.jsonl", "val": work / "val.jsonl",
            "first": work / "first.jsonl", "first_n": n, "first_rows": first_rows, "checks": checks,
            "mean_len": mean_len, "pack_eff": pack_eff, "supervised_fraction": checks["mask"]["supervised_fraction"],
            "rows_micro": max(1, round(per_step * mean_len / (pack_eff * BLOCK) / divisor)),
            "phalanx_attn": model.config._attn_implementation}


# ---- the first-step loss -----------------------------------------------------------------------------------
def trl_first_loss(prefix: Path, accum: int) -> tuple[float, float]:
    """(what TRL backpropagates at step 1: the mean over ranks of the sum of its micro-batch losses, since DDP
    averages gradients; the loss TRL logs for step 1)."""
    files = sorted(prefix.parent.glob(f"{prefix.name}-[0-9]*.jsonl"))
    ranks = [[json.loads(x) for x in f.read_text().splitlines()] for f in files]
    objective = sum(sum(m["loss"] for m in rows if "call" in m and m["call"] < accum) for rows in ranks) / len(ranks)
    logged = next(m["logged_loss"] for m in ranks[0] if m.get("step") == 1)
    return objective, logged


def first_step(s: dict, packing_ok: bool, nproc: int) -> None:
    """Step 1 of each side on one global batch = the whole first-step file (so the order cannot differ),
    against the float64 reference of trl_checks.py."""
    n, rows, ref = s["first_n"], s["first_rows"], s["checks"]["reference"]
    trl_rows = s["checks"]["first_trl_packed_rows"]
    cases = [("phalanx, data.packing=false", "phalanx", n // (2 * nproc), n, ["data.packing=false"], "assistant"),
             ("phalanx, packed", "phalanx", 1, rows, [], "assistant"),
             ("TRL assistant_only_loss, padded", "trl", n // (2 * nproc), 2, ["--assistant-only", "--gc", "off"],
              "assistant")]
    if packing_ok and trl_rows % nproc == 0:
        cases.append(("TRL assistant_only_loss, packed", "trl", 1, trl_rows // nproc,
                      ["--assistant-only", "--gc", "off", "--packing"], "assistant"))
    cases.append(("TRL defaults (loss on every token)", "trl", n // (2 * nproc), 2, [], "all"))
    print(f"\nfirst-step loss: one global batch = the first {n} conversations ({rows} packed rows), "
          f"{nproc} processes, accumulation > 1\n\n| run | step-1 loss | reference (float64) | difference |\n"
          "|---|---|---|---|")
    trl_all = None
    for k, (name, tool, micro, size, extra, target) in enumerate(cases):
        out = s["work"] / f"first-{k}"
        if tool == "phalanx":
            run(phalanx_cmd(s, out, 1, micro, size, nproc, 1, extra, data=s["first"]), Path(f"{out}.log"), s["work"])
            loss, note = metric_lines(out)[0]["loss"], ""
        else:
            run(trl_cmd(s, out, 1, micro, size, nproc, extra, data=s["first"], log_every=1), Path(f"{out}.log"),
                s["work"])
            loss, logged = trl_first_loss(out, size)
            note = f" (logged {logged:.6f})"
            trl_all = loss if target == "all" else trl_all
        r = ref[target]["loss"]
        print(f"| {name} | {loss:.6f}{note} | {r:.6f} ({target} tokens: {ref[target]['tokens']}) | {loss - r:+.2e} |")
    if trl_all:
        implied = ref["all"]["loss"] * ref["all"]["tokens"] / trl_all
        print(f"\nTRL defaults: the sum of its per-token losses divided by its step-1 loss gives {implied:.1f}: "
              f"the {ref['all']['tokens']} predicted tokens + {implied - ref['all']['tokens']:.1f} "
              f"(the batch has {ref['conversations']} conversations)")
