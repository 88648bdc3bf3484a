"""Length grouping vs a plain shuffle, by quality at equal steps as well as by speed (chooses the defaults of
`data.group_by_length`).

Grouping puts conversations (or sentences) of similar length into the same optimizer step: less padding, but
every step then sees one length band, and length correlates with content. Each setting trains the same
model on the same data for the same steps, over several seeds, and is scored on held-out data:

  chat      5,000 training chats, a third each SST-2 sentiment questions (one-word reply), Shakespeare "next
            line" requests (a line as the reply) and "how many words are in this line" (a number that grows
            with the prompt): lengths and content differ by kind, as in real SFT mixtures. Unpacked
            (data.packing=false, the mode the key applies to), group_by_length true vs false; packed rows
            (the chat default, always shuffled) for reference. Scores: reply loss
            (eval/loss, held-out, all three kinds), and the greedy accuracy of "how many words" replies on
            300 held-out lines (the model's own `generate`, exact answer; answering the most common count,
            8, every time scores 26.3%).
  classify  SST-2 (the first 8,000 training rows), group_by_length true vs false; eval/accuracy on the
            872 validation sentences.

Speed: the median step time and the padding fraction (`pad_fraction`) of each run. The same 1-process CLI
runs as a user would start them (`phalanx train`), one setting after another within each seed.

    python bench/order_quality.py [--seeds 1,2,3] [--steps 150] [--tasks chat,classify]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
MODEL = ["model.n_layer=4", "model.n_head=4", "model.n_embd=128", "data.vocab_size=2048"]
OPTIM = ["train.global_batch_size=32", "train.micro_batch_size=8", "train.lr=1e-3", "train.warmup_steps=15",
         "train.log_every=10", "log.progress=off", "dist.threads_per_worker=2"]
SETTINGS = {"chat": {"grouped": ["data.packing=false", "data.group_by_length=true"],
                     "shuffled": ["data.packing=false", "data.group_by_length=false"],
                     "packed": ["data.packing=true", "train.global_batch_size=8", "train.micro_batch_size=2"]},
            "classify": {"grouped": ["data.group_by_length=true"], "shuffled": ["data.group_by_length=false"]}}


def sentiment(text: str) -> str:
    return f"Is this review positive or negative? {text.strip()}"


def count_question(line: str) -> tuple[str, str]:
    words = line.split()
    return f"How many words are in this line? {line}", str(len(words))


def chat_data(work: Path) -> tuple[Path, Path, list[tuple[str, str]]]:
    """Training and held-out chats, and the held-out questions whose greedy replies are scored.

    Three kinds, as in real SFT mixtures whose lengths go with their content: SST-2 sentiment (a one-word
    reply), Shakespeare "what line follows" (a line as the reply) and "how many words are in this line"
    (the answer grows with the prompt's length: the case where a step of one length band sees one answer)."""
    import random

    sst = [json.loads(line) for line in (DATA / "sst2" / "train.jsonl").read_text().splitlines()][:1700]
    val = [json.loads(line) for line in (DATA / "sst2" / "validation.jsonl").read_text().splitlines()]
    lines = [x.strip() for x in (DATA / "tinyshakespeare" / "input.txt").read_text().splitlines() if x.strip()]
    label = {0: "negative", 1: "positive"}

    def chat(q: str, a: str) -> str:
        return json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})

    train = [chat(sentiment(r["text"]), label[r["label"]]) for r in sst]
    train += [chat(f"What line follows: {lines[i]}", lines[i + 1]) for i in range(0, 3300, 2)]
    train += [chat(*count_question(lines[i])) for i in range(4000, 5650)]
    held_counts = [count_question(lines[i]) for i in range(20000, 20300)]
    held = [chat(sentiment(r["text"]), label[r["label"]]) for r in val[:300]]
    held += [chat(f"What line follows: {lines[i]}", lines[i + 1]) for i in range(21000, 21600, 2)]
    held += [chat(q, a) for q, a in held_counts]
    random.Random(0).shuffle(train)  # the file order must not carry the kinds in runs
    (work / "train.jsonl").write_text("\n".join(train) + "\n")
    (work / "held.jsonl").write_text("\n".join(held) + "\n")
    return work / "train.jsonl", work / "held.jsonl", held_counts


def train(task: str, data: list[str], extra: list[str], seed: int, steps: int, out: Path, cache: Path) -> dict:
    cmd = [sys.executable, "-m", "phalanx", "train", f"task={task}", *data, f"data.cache_dir={cache}", *MODEL,
           *OPTIM, f"train.max_steps={steps}", f"train.eval_every={steps}", f"train.seed={seed}", *extra,
           "--run-dir", str(out), "--nproc-per-node", "1"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)}\n{proc.stderr[-3000:]}")
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps_ = [m for m in lines if "loss" in m and "event" not in m and m["step"] > 10]
    evals = [m for m in lines if any(k.startswith("eval/") for k in m)]
    return {"eval": evals[-1], "step_s": statistics.median(m["step_time_s"] for m in steps_),
            "pad": statistics.mean(m.get("pad_fraction", 0.0) for m in steps_)}


def greedy_accuracy(final: Path, questions: list[tuple[str, str]]) -> float:
    """Exact-word accuracy of the greedy reply (transformers' own generate on RUN/final)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(final), AutoModelForCausalLM.from_pretrained(final).eval()
    right = 0
    with torch.no_grad():
        for q, a in questions:
            ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)["input_ids"]
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
            right += tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip() == a
    return right / len(questions)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--tasks", default="chat,classify")
    a = p.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cache = work / "cache"
        train_chats, held_chats, questions = chat_data(work)
        data = {"chat": [f"data.train={train_chats}", f"data.validation={held_chats}", "model.block_size=128",
                         "data.max_dropped_fraction=0.2"],
                "classify": [f"data.train={DATA / 'sst2' / 'train.jsonl'}", "data.max_length=64",
                             f"data.validation={DATA / 'sst2' / 'validation.jsonl'}", "model.arch=bert"]}
        if "classify" in a.tasks:  # 8,000 training rows
            rows = (DATA / "sst2" / "train.jsonl").read_text().splitlines()[:8000]
            (work / "sst.jsonl").write_text("\n".join(rows) + "\n")
            data["classify"][0] = f"data.train={work / 'sst.jsonl'}"
        results = []
        for task in a.tasks.split(","):
            for seed in seeds:
                for name, extra in SETTINGS[task].items():
                    out = work / f"{task}-{name}-{seed}"
                    r = train(task, data[task], extra, seed, a.steps, out, cache)
                    if task == "chat":
                        r["greedy_accuracy"] = greedy_accuracy(out / "final", questions)
                    results.append({"task": task, "setting": name, "seed": seed, **r})
                    print(json.dumps({k: v for k, v in results[-1].items() if k != "eval"} |
                                     {k: v for k, v in r["eval"].items() if k.startswith("eval/")}), flush=True)
        print_table(results, a.steps, seeds)


def print_table(results: list[dict], steps: int, seeds: list[int]) -> None:
    print(f"\n{steps} steps, seeds {seeds}; mean (min-max) over seeds; 1 process, 2 threads; shared 2-core machine")
    print("| task | setting | held-out reply/eval loss | greedy word-count accuracy | eval accuracy | step s "
          "| pad fraction |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for task in dict.fromkeys(r["task"] for r in results):
        for setting in dict.fromkeys(r["setting"] for r in results if r["task"] == task):
            rs = [r for r in results if r["task"] == task and r["setting"] == setting]

            def cell(values, fmt="{:.3f}"):
                values = [v for v in values if v is not None]
                if not values:
                    return "-"
                return f"{fmt.format(statistics.mean(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"

            print(f"| {task} | {setting} | {cell([r['eval']['eval/loss'] for r in rs])} | "
                  f"{cell([r.get('greedy_accuracy') for r in rs], '{:.1%}')} | "
                  f"{cell([r['eval'].get('eval/accuracy') for r in rs], '{:.1%}')} | "
                  f"{cell([r['step_s'] for r in rs])} | {cell([r['pad'] for r in rs], '{:.2f}')} |")


if __name__ == "__main__":
    main()
