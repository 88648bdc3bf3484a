"""The output head only where the loss needs it (model/head.py), before and after: peak private memory per
rank and useful tokens/s of the same runs on the commit before it (a git worktree) and on this tree.

Models: the real SmolLM2-135M-Instruct (vocabulary 49,152, tied) and a Llama-3-style model built from its
config with Llama-3's 128,256-token vocabulary (random weights; 8 layers of SmolLM2's width, so that the
vocabulary is what differs; SmolLM2's tokenizer, whose ids all fit). Tasks: chat on the built-in
conversations (packed rows: a few percent of the positions are supervised) and causal LM on WikiText-2
(every position a target). Full fine-tuning, fp32, 2 processes, micro-batch 4 x block 256, no accumulation;
the sides alternate within each repeat, medians over repeats. Memory: each rank's sampled peak RssAnon over
the whole run, and summary.json's steps' private peak.

    python bench/head_path.py [--smollm2 FOLDER_OR_GGUF] [--before d09a425] [--repeats 2] [--steps 5]
                              [--models smollm2,llama3]
    python bench/head_path.py --kernel [--repeats 2]     # the head alone: chunked vs unchunked
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from big_models import worktree
from vs_trl_runs import phalanx_rate, run

REPO = Path(__file__).resolve().parents[1]
WIKITEXT = REPO.parent / "shared" / "data" / "wikitext2" / "validation.txt"
SMOLLM2 = REPO.parent / "shared" / "models" / "smollm2-135m-instruct-gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
BEFORE = "d09a425"  # the last commit before model/head.py
TASKS = {"chat": ["task=chat"], "lm": ["task=lm", f"data.train={WIKITEXT}"]}


def plain_folder(base: Path, work: Path) -> Path:
    """A folder as it is; a GGUF dequantised once into work/cache by phalanx's own resolution."""
    if base.is_dir():
        return base
    from phalanx.core.config import load_config
    from phalanx.tools.launch import resolve_pretrained

    cfg = load_config(None, [f"model.pretrained={base}", f"data.cache_dir={work / 'cache'}"], check_paths=False)
    return Path(resolve_pretrained(cfg).model.pretrained)


def llama3_style(smollm2: Path, out: Path) -> Path:
    """Llama-3's vocabulary (128,256) on 8 of SmolLM2's layers, random weights (seed 0), SmolLM2's tokenizer."""
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(smollm2)
    config.vocab_size, config.num_hidden_layers = 128_256, 8
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(smollm2).save_pretrained(out)
    return out


def command(tree: Path, base: Path, task: str, run_dir: Path, cache: Path, steps: int) -> list[str]:
    return ["env", "-C", str(tree), f"PYTHONPATH={tree}", sys.executable, "-m", "phalanx", "train", *TASKS[task],
            f"model.pretrained={base}", "model.block_size=256", "train.micro_batch_size=4",
            "train.global_batch_size=8", f"train.max_steps={steps}", "train.warmup_steps=1", "train.lr=1e-5",
            "train.log_every=1", "train.eval_every=0", "train.eval_max_samples=8", "train.precision=fp32",
            "train.memory_check=warn", "log.progress=off", f"data.cache_dir={cache}", "resume=never",
            "--nproc-per-node", "2", "--run-dir", str(run_dir)]


def one(tree: Path, base: Path, task: str, work: Path, steps: int, tag: str) -> dict:
    out = work / tag
    shutil.rmtree(out, ignore_errors=True)
    peaks = run(command(tree, base, task, out, work / "cache", steps), work / f"{tag}.log", work, timeout=3600)
    summary = json.loads((out / "summary.json").read_text())
    rate = phalanx_rate(out, 2, 1.0)
    shutil.rmtree(out / "final", ignore_errors=True)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    return {"useful_tps": rate["useful_tps"], "step_s": rate["step_s"],
            "private_gb": max(peaks.private.values()) / 1024,
            "steps_gb": max(summary.get("private_peak_mb/steps", [0])) / 1024}


def kernel(repeats: int) -> None:
    """The head alone, one process, 1 thread: phalanx's chunked head (TargetLogProbSum: the loss of lm and chat)
    against the unchunked cross-entropy, forward and backward, for 1,024 targets of width 576."""
    import time

    import torch
    import torch.nn.functional as F

    from phalanx.model.head import TargetLogProbSum

    torch.set_num_threads(1)
    n, width = 1024, 576
    print("| vocabulary | unchunked cross-entropy s | phalanx's chunked head s | chunked / unchunked |\n"
          "|---|---|---|---|")

    def unchunked(h, w, t):
        return F.cross_entropy(F.linear(h, w).float(), t, reduction="sum")

    def chunked(h, w, t):
        return -TargetLogProbSum.apply(h, w, None, t, None, False, True)[0]

    for vocab in (49_152, 128_256):
        torch.manual_seed(0)
        h = torch.randn(n, width, requires_grad=True)
        w = (torch.randn(vocab, width) * 0.02).requires_grad_()
        t = torch.randint(0, vocab, (n,))
        sides = {"unchunked": unchunked, "chunked": chunked}
        took = {side: [] for side in sides}
        for _ in range(repeats):
            for side, loss in sides.items():
                h.grad = w.grad = None
                start = time.perf_counter()
                loss(h, w, t).backward()
                took[side].append(time.perf_counter() - start)
        a, b = statistics.median(took["unchunked"]), statistics.median(took["chunked"])
        print(f"| {vocab:,} | {a:.2f} | {b:.2f} | {b / a:.2f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smollm2", type=Path, default=SMOLLM2, help="SmolLM2-135M-Instruct: a folder, or its GGUF "
                    "(dequantised by this tree's phalanx: the commit before cannot read GGUF)")
    ap.add_argument("--before", default=BEFORE)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--models", default="smollm2,llama3", help="rows to run: smollm2, llama3 or both")
    ap.add_argument("--kernel", action="store_true", help="only the head alone in one process (seconds)")
    args = ap.parse_args()
    if args.kernel:
        return kernel(args.repeats)
    work = args.work or Path(tempfile.mkdtemp(prefix="head-path-"))
    work.mkdir(parents=True, exist_ok=True)
    trees = {"before": worktree(args.before, work), "after": REPO}
    smollm2 = plain_folder(args.smollm2, work)
    models = args.models.split(",")
    bases = {name: make() for key, name, make in [
        ("smollm2", "SmolLM2-135M (V 49,152)", lambda: smollm2),
        ("llama3", "Llama-3-style (V 128,256)", lambda: llama3_style(smollm2, work / "llama3-style"))]
        if key in models}
    print(f"# bench/head_path.py: before = {args.before}, after = this tree; {' '.join(sys.argv[1:])}\n")
    print("| model | task | side | useful tokens/s | s/step | peak private GB/rank (sampled) | steps' peak GB |")
    print("|---|---|---|---|---|---|---|")
    ratios = []
    for name, base in bases.items():
        for task in TASKS:
            got = {side: [] for side in trees}
            for r in range(args.repeats):
                for side, tree in trees.items():
                    tag = f"{base.name}-{task}-{side}-{r}"
                    got[side].append(one(tree, base, task, work, args.steps, tag))
            med = {side: {k: statistics.median(x[k] for x in v) for k in v[0]} for side, v in got.items()}
            for side, m in med.items():
                print(f"| {name} | {task} | {side} | {m['useful_tps']:.0f} | {m['step_s']:.2f} | "
                      f"{m['private_gb']:.2f} | {m['steps_gb']:.2f} |", flush=True)
            b, a = med["before"], med["after"]
            ratios.append((name, task, a["useful_tps"] / b["useful_tps"], a["private_gb"] / b["private_gb"]))
    print("\n| model | task | tokens/s after / before | peak memory after / before |\n|---|---|---|---|")
    for name, task, speed, memory in ratios:
        print(f"| {name} | {task} | {speed:.2f} | {memory:.2f} |")


if __name__ == "__main__":
    main()
