"""Does preference tuning work? SST-2 as chats: the sentence as the user turn, its label word ("negative" /
"positive") as the reply. Chat SFT on one part of the training split (a small GPT from scratch), then DPO
(task preference, the rejected reply the other label word) on another part, from the SFT run's final/;
greedy replies on the 872 validation sentences (plain transformers `generate` with the saved template),
scored by whether the reply starts with the right word. Accuracy after SFT alone and after SFT + DPO, per seed
(a Wilson 95% interval over the 872 sentences) and over the seeds (mean, t 95% interval), and how many replies
start with neither word (DPO lowers both replies' log-probs: mass can leave the two words altogether).
--sft-weights adds DPO runs with an NLL term on the chosen reply (preference.sft_weight, RPO-style) beside
plain DPO (0). With --control, also SFT continued on the DPO part (its chosen replies) for as many steps: more
supervised data instead of preferences. Runs whose final/ is already in --work are reused.

    python bench/dpo_sst2.py [--seeds 1,2,3] [--sft 4000] [--dpo 4000] [--sft-steps 200] [--dpo-steps 100]
        [--sft-weights 0,1] [--control] [--work DIR]
"""
from __future__ import annotations

import argparse
import json
import math
import random
import re
import statistics
import sys
import tempfile
from pathlib import Path

from vs_trl_runs import REPO, phalanx_version, run

SST2 = REPO.parent / "shared" / "data" / "sst2"
WORDS = ("negative", "positive")
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
MODEL = ["model.n_layer=4", "model.n_head=4", "model.n_embd=256", "model.block_size=128", "data.vocab_size=2048",
         "dist.threads_per_worker=2", "log.progress=off", "train.eval_every=0", "train.checkpoint_every=0",
         "train.log_every=10", "train.global_batch_size=16", "train.micro_batch_size=8"]


def write_data(work: Path, n_sft: int, n_dpo: int) -> list[tuple[str, int]]:
    rows = [json.loads(line) for line in (SST2 / "train.jsonl").read_text().splitlines()]
    random.Random(0).shuffle(rows)  # one fixed split for every seed
    sft, dpo = rows[:n_sft], rows[n_sft:n_sft + n_dpo]

    def chat(r):
        return {"messages": [{"role": "user", "content": r["text"]},
                             {"role": "assistant", "content": WORDS[r["label"]]}]}

    (work / "sft.jsonl").write_text("".join(json.dumps(chat(r)) + "\n" for r in sft))
    (work / "more-sft.jsonl").write_text("".join(json.dumps(chat(r)) + "\n" for r in dpo))
    (work / "pairs.jsonl").write_text("".join(json.dumps({"prompt": r["text"], "chosen": WORDS[r["label"]],
                                                          "rejected": WORDS[1 - r["label"]]}) + "\n" for r in dpo))
    return [(r["text"], r["label"]) for r in map(json.loads, (SST2 / "validation.jsonl").read_text().splitlines())]


def first_word(reply: str) -> int | None:
    """The label (an index of WORDS) of the first label word in a reply, in any case; None: neither is there."""
    found = [(m.start(), k) for k, w in enumerate(WORDS) if (m := re.search(rf"\b{w}\b", reply, re.I))]
    return min(found)[1] if found else None


def accuracy(final: Path, val: list[tuple[str, int]], max_new_tokens: int = 4,
             anywhere: bool = False) -> tuple[float, float]:
    """Greedy replies (up to `max_new_tokens` new tokens) with the saved chat template: (right = the reply starts
    with the label word, off = it starts with neither word), as fractions of the sentences. `anywhere`: the
    reply's first label word counts, wherever it stands (a model that answers in sentences)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    tok, model = AutoTokenizer.from_pretrained(final), AutoModelForCausalLM.from_pretrained(final).eval()
    tok.padding_side = "left"
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    right = off = 0
    for lo in range(0, len(val), 64):
        batch = val[lo:lo + 64]
        ids = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
               ["input_ids"] for t, _ in batch]
        width = max(map(len, ids))
        inputs = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        with torch.no_grad():
            out = model.generate(inputs, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=pad)
        for (_, label), row in zip(batch, out[:, width:]):
            reply = tok.decode(row, skip_special_tokens=True).strip()
            said = first_word(reply) if anywhere else next((k for k, w in enumerate(WORDS) if reply.startswith(w)),
                                                           None)
            right += said == label
            off += said is None
    return right / len(val), off / len(val)


def wilson(p: float, n: int) -> tuple[float, float]:
    z = 1.96
    centre, half = (p + z * z / (2 * n)) / (1 + z * z / n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (
        1 + z * z / n)
    return centre - half, centre + half


def over_seeds(values: list[float]) -> str:
    mean = statistics.fmean(values)
    if len(values) < 2:
        return f"{mean:.1%}"
    half = T975[len(values) - 1] * statistics.stdev(values) / math.sqrt(len(values))
    return f"{mean:.1%} ({mean - half:.1%} to {mean + half:.1%})"


def trained(cmd: list[str], run_dir: Path, work: Path) -> Path:
    """run_dir/final, trained by `cmd` unless a finished run is there already."""
    if not (run_dir / "final" / "config.json").is_file():
        run([*cmd, "--run-dir", str(run_dir)], Path(f"{run_dir}.log"), work)
    return run_dir / "final"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--sft", type=int, default=4000)
    p.add_argument("--dpo", type=int, default=4000)
    p.add_argument("--sft-steps", type=int, default=200)
    p.add_argument("--dpo-steps", type=int, default=100)
    p.add_argument("--dpo-lr", type=float, default=1e-4)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--sft-weights", default="0", help="preference.sft_weight of each DPO variant (0 = plain DPO)")
    p.add_argument("--control", action="store_true", help="also SFT on the DPO part for --dpo-steps steps")
    p.add_argument("--work", default="")
    a = p.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="dpo-sst2-"))
    work.mkdir(parents=True, exist_ok=True)
    val = write_data(work, a.sft, a.dpo)
    cache = f"data.cache_dir={work / 'cache'}"
    weights = [float(w) for w in a.sft_weights.split(",")]
    names = ["SFT", *[f"SFT + DPO{f' + {w:g} x NLL' if w else ''}" for w in weights],
             *(["SFT + more SFT"] if a.control else [])]
    results: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    print(f"phalanx {phalanx_version()}; SFT on {a.sft} SST-2 training phrases ({a.sft_steps} steps), DPO on "
          f"{a.dpo} others ({a.dpo_steps} steps, beta {a.beta}, lr {a.dpo_lr}); {len(val)} validation sentences; "
          f"work folder {work}; the machine is shared\n\naccuracy (Wilson 95%) / replies with neither word\n\n"
          f"| seed | {' | '.join(names)} |\n|---|{'---|' * len(names)}", flush=True)
    dpo_args = [f"data.train={work / 'pairs.jsonl'}", cache, "data.val_fraction=0.02", f"train.max_steps={a.dpo_steps}",
                f"train.lr={a.dpo_lr}", "train.warmup_steps=10", *MODEL]
    for seed in map(int, a.seeds.split(",")):
        sft = trained([sys.executable, "-m", "phalanx", "train", "task=chat", f"data.train={work / 'sft.jsonl'}",
                       cache, "data.val_fraction=0.02", f"train.seed={seed}", f"train.max_steps={a.sft_steps}",
                       "train.lr=1e-3", "train.warmup_steps=20", *MODEL], work / f"sft-{seed}", work)
        finals = [sft]
        for w in weights:
            finals.append(trained([sys.executable, "-m", "phalanx", "train", "task=preference",
                                   f"model.pretrained={sft}", f"train.seed={seed}", f"preference.beta={a.beta}",
                                   f"preference.sft_weight={w}", *dpo_args],
                                  work / (f"dpo-{seed}" + (f"-nll{w:g}" if w else "")), work))
        if a.control:
            finals.append(trained([sys.executable, "-m", "phalanx", "train", "task=chat", f"model.pretrained={sft}",
                                   f"data.train={work / 'more-sft.jsonl'}", f"train.seed={seed}", *dpo_args[1:]],
                                  work / f"more-{seed}", work))
        for name, final in zip(names, finals):
            results[name].append(accuracy(final, val))
        cells = []
        for name in names:
            right, off = results[name][-1]
            lo, hi = wilson(right, len(val))
            cells.append(f"{right:.1%} ({lo:.1%}-{hi:.1%}) / {off:.1%}")
        print(f"| {seed} | {' | '.join(cells)} |", flush=True)
    print("| mean (t 95%) / mean | " + " | ".join(
        f"{over_seeds([r for r, _ in v])} / {statistics.fmean(o for _, o in v):.1%}" for v in results.values()) + " |")


if __name__ == "__main__":
    main()
