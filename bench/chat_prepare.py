"""Chat data preparation: `phalanx prepare` vs TRL's SFTTrainer preparing the same file before its first step
(not a test; prints a Markdown table).

    python bench/chat_prepare.py [--mb 30] [--nproc 2] [--block 512] [--work DIR] [--repeats 1]

Data: about --mb MB of conversations in the messages format (~280 bytes each, as in the issue's 30 MB /
107,000), generated into --work (a temporary folder by default; never committed): one or two exchanges, a
system prompt on a third of them, user turns from Tiny Shakespeare lines, replies from SST-2 sentences and
Shakespeare lines, all from ../shared/data. Base: a 2-layer GPT-2 with a 4096-token BPE trained on Tiny
Shakespeare (phalanx's trainer, as `phalanx train` makes one) whose tokenizer carries phalanx's ChatML
template, saved with save_pretrained, so both sides render the same template with the same tokenizer.

Sides, each a fresh process timed from its start to the end (the whole tree's peak RSS sampled every 50 ms):
  phalanx            `phalanx prepare` (task=chat, model.pretrained=BASE, data.prepare_workers=--nproc, a
                     fresh cache): tokenizer copy, render, mask, write the store and pack it
  trl                `load_dataset("json")` + `SFTTrainer(...)` with dataset_num_proc=--nproc, max_length=--block,
                     TRL's defaults otherwise (unpacked), in a fresh HF_DATASETS_CACHE: its preparation
                     happens in the constructor, before the first step
  trl-packed         the same with packing=True (TRL's best-fit decreasing)
Each repeat runs every side once, in turn; medians over repeats.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from prepare import measure  # bench/prepare.py: wall time and peak RSS of a process tree

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
SIDES = ("phalanx", "trl", "trl-packed")
SYSTEMS = ["You are a helpful assistant.", "Answer in one sentence.", "Speak as in a play."]


def make_data(path: Path, mb: float, seed: int = 0) -> int:
    """Conversations until `mb` MB; returns how many."""
    lines = [x.strip() for x in (DATA / "tinyshakespeare" / "input.txt").read_text().splitlines() if x.strip()]
    sst = [json.loads(x)["text"] for x in (DATA / "sst2" / "train.jsonl").read_text().splitlines()]
    rng, size, n = random.Random(seed), 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while size < mb * 1e6:
            messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 1 / 3 else []
            for _ in range(rng.choice((1, 1, 2))):
                messages.append({"role": "user", "content": " ".join(rng.choice(lines) for _ in range(2))})
                messages.append({"role": "assistant", "content": rng.choice(sst if rng.random() < 0.5 else lines)})
            line = json.dumps({"messages": messages}) + "\n"
            f.write(line)
            size, n = size + len(line.encode()), n + 1
    return n


def make_base(folder: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    from phalanx.data import tokenizer as toks
    from phalanx.data.chat.template import ensure_template

    tok = PreTrainedTokenizerFast(tokenizer_object=toks.train_bpe([(DATA / "tinyshakespeare" / "input.txt")
                                                                   .read_text()], 4096), **toks.SPECIALS["bpe"])
    ensure_template(tok)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=1024, n_embd=64, n_layer=2, n_head=2,
                               eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)).save_pretrained(folder)
    tok.save_pretrained(folder)


def trl_child(a: argparse.Namespace) -> None:
    """Runs in its own process: the TRL side, as a user writes it."""
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tok = AutoTokenizer.from_pretrained(a.base)
    data = load_dataset("json", data_files=str(a.data), split="train")
    args = SFTConfig(output_dir=str(a.out), dataset_num_proc=a.nproc, max_length=a.block, packing=a.packing,
                     report_to=[], use_cpu=True)
    trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(a.base), args=args, train_dataset=data,
                         processing_class=tok)
    rows = trainer.train_dataset
    tokens = sum(len(x) for x in rows["input_ids"])
    (a.out / "result.json").write_text(json.dumps({"rows": len(rows), "tokens": tokens}))


def run_side(side: str, a: argparse.Namespace, work: Path, data: Path, base: Path, k: int) -> dict:
    out = work / f"{side}-{k}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    if side == "phalanx":
        cmd = [sys.executable, "-m", "phalanx", "prepare", "--quiet", "task=chat", f"data.train={data}",
               f"model.pretrained={base}", f"data.cache_dir={out / 'cache'}", f"data.prepare_workers={a.nproc}",
               f"model.block_size={a.block}", "data.max_dropped_fraction=1"]
        got = measure(cmd, out / "log.txt")
        index = json.loads(next((out / "cache").glob("chat-*/index.json")).read_text())
        got.update(rows=index["summary"]["documents"], tokens=index["summary"]["tokens"])
    else:
        cmd = [sys.executable, __file__, "--trl-child", "--data", str(data), "--base", str(base), "--out", str(out),
               "--nproc", str(a.nproc), "--block", str(a.block), *(["--packing"] if side == "trl-packed" else [])]
        got = measure(cmd, out / "log.txt", env={"HF_DATASETS_CACHE": str(out / "hf-cache")})
        got.update(json.loads((out / "result.json").read_text()))
    return got


def table(results: dict[str, list[dict]], size: int, n: int, a: argparse.Namespace) -> list[str]:
    ref = statistics.median(r["wall_s"] for r in results["phalanx"])
    lines = [f"{n:,} conversations, {size / 1e6:.1f} MB, {a.nproc} processes a side, max length {a.block}, "
             f"median of {a.repeats}; machine: {os.cpu_count()} cores, shared with other work",
             "", "| side | seconds | MB/s | x phalanx time | peak RSS (tree) | rows | tokens |",
             "|---|---|---|---|---|---|---|"]
    for side, runs in results.items():
        wall = statistics.median(r["wall_s"] for r in runs)
        peak = statistics.median(r["peak_tree_bytes"] for r in runs)
        lines.append(f"| {side} | {wall:.1f} | {size / 1e6 / wall:.2f} | {wall / ref:.2f} | {peak / 1e9:.2f} GB | "
                     f"{runs[0]['rows']:,} | {runs[0]['tokens']:,} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=30.0)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--block", type=int, default=512)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--sides", default=",".join(SIDES))
    p.add_argument("--trl-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--packing", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--base", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.trl_child:
        return trl_child(a)
    work = a.work or Path(tempfile.mkdtemp(prefix="chat-prepare-"))
    work.mkdir(parents=True, exist_ok=True)
    data, base = work / "conversations.jsonl", work / "base"
    t0 = time.time()
    n = make_data(data, a.mb)
    if not (base / "config.json").is_file():
        make_base(base)
    print(f"data and base in {time.time() - t0:.1f} s: {data}", file=sys.stderr)
    sides = a.sides.split(",")
    results: dict[str, list[dict]] = {s: [] for s in sides}
    for k in range(a.repeats):
        for side in sides:
            results[side].append(run_side(side, a, work, data, base, k))
            print(f"{side}: {results[side][-1]['wall_s']:.1f} s", file=sys.stderr)
    print("\n".join(table(results, data.stat().st_size, n, a)))
    if a.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
