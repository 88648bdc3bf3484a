"""phalanx task preference vs TRL 1.16's DPOTrainer: the first-step loss, useful tokens/s, peak memory per rank.

Same machine, 1 thread per process; TRL through torchrun + bench/trl_dpo_side.py (the world size each side
ran with is read back). Same model: a 4 x 256 GPT-2 (BPE 4096 trained by phalanx on its built-in corpus, one
pretraining step, 256 positions) whose tokenizer gets a ChatML template that writes nothing after a reply's
<|im_end|> (so TRL's completion tokens, everything after the prompt with the generation prompt, are exactly
phalanx's targets: the reply through its end-of-turn token). Same data: phalanx's built-in pairs (a built-in
conversation's last reply vs the same words shuffled) whose sequences fit 256 tokens, as TRL's explicit
conversational records. Same math where it says so: DPO sigmoid, beta 0.1, AdamW lr 1e-4, betas 0.9/0.95,
no weight decay, warm-up + cosine to 0.1 x lr, clip 1.0, fp32, a global batch of 16 pairs (padded: micro 4
x 2 processes x accumulation 2; packed rows sized to carry about as many pairs).

1. First-step loss: one global batch = the first 16 pairs, with an NLL term on the chosen replies (weight 1:
   TRL's loss_type [sigmoid, sft]) so the value depends on the data (DPO alone is log 2 at step 1, the
   policy being its reference), against a float64 script over per-token log-probs (plain transformers).
2. Useful tokens/s (real tokens of both replies' sequences per second, steady steps after --warmup):
   phalanx (packed, precomputed reference), phalanx-padded (data.packing=false), TRL with the same math
   (precompute_ref_log_probs, no gradient checkpointing; padded: its padding_free is off in 1.16) and TRL's
   defaults (a reference model forward every step, gradient checkpointing). Medians over --repeats, sides
   run in turn.
3. Peak RSS per rank (VmHWM of each rank process) on a 12 x 512 GPT-2 (~38 M parameters), 2 processes, a
   few steps: full fine-tuning with precomputed references vs a second model (phalanx reference=model, TRL's
   default ref copy), and LoRA r=16 with the adapters-off reference on both sides.

    python bench/vs_trl_dpo.py [--steps 14] [--warmup 4] [--repeats 2] [--parts first,throughput,memory]
"""
from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
from vs_trl_runs import REPO, phalanx_version, run

BLOCK, PAIRS, NPROC, ACCUM, MICRO = 256, 16, 2, 2, 4
OPTIM = ["train.lr=1e-4", "train.warmup_steps=2", "train.min_lr_ratio=0.1", "train.weight_decay=0.0",
         "train.beta1=0.9", "train.beta2=0.95", "train.grad_clip=1.0", "train.precision=fp32"]
TEMPLATE = ("{% for message in messages %}{% if not loop.first %}{{ '\\n' }}{% endif %}"
            "{{ '<|im_start|>' + message['role'] + '\\n' }}{% if message['role'] == 'assistant' %}{% generation %}"
            "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{% else %}"
            "{{ message['content'] + '<|im_end|>' }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}{{ '\\n<|im_start|>assistant\\n' }}{% endif %}")


# ---- the shared model and data ----------------------------------------------------------------------
def make_base(work: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pre = work / "pretrain"
    run([sys.executable, "-m", "phalanx", "train", f"model.block_size={BLOCK}", "train.max_steps=1",
         "train.global_batch_size=8", "train.micro_batch_size=8", "train.eval_every=0", "train.eval_max_samples=8",
         f"data.cache_dir={work / 'cache'}", "log.progress=off", "--nproc-per-node", "1", "--run-dir", str(pre)],
        work / "pretrain.log", work)
    tok = AutoTokenizer.from_pretrained(pre / "final")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(pre / "final")
    model.resize_token_embeddings(len(tok), mean_resizing=True)
    model.save_pretrained(work / "base")
    tok.save_pretrained(work / "base")
    return work / "base"


def make_big(work: Path, base: Path) -> Path:
    """A 12 x 512 GPT-2 (random init) with the bench tokenizer: for memory, where the model must show."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tok = AutoTokenizer.from_pretrained(base)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=BLOCK, n_embd=512, n_layer=12, n_head=8,
                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).save_pretrained(work / "big")
    tok.save_pretrained(work / "big")
    return work / "big"


def make_pairs(work: Path, base: Path) -> list[int]:
    """work/pairs.jsonl: the built-in pairs whose sequences fit BLOCK; work/first.jsonl: the first PAIRS."""
    from transformers import AutoTokenizer

    from phalanx.data.builtin import stdlib_preference_pairs

    tok = AutoTokenizer.from_pretrained(base)
    kept, sizes = [], []
    for pair in stdlib_preference_pairs():
        n = [len(tok.apply_chat_template(pair["prompt"] + pair[k], tokenize=True)["input_ids"])
             for k in ("chosen", "rejected")]
        if max(n) <= BLOCK:
            kept.append(json.dumps(pair))
            sizes.append(sum(n))
    (work / "pairs.jsonl").write_text("\n".join(kept) + "\n")
    (work / "first.jsonl").write_text("\n".join(kept[:PAIRS]) + "\n")
    return sizes


def float64_first(base: Path, first: Path, sft: float) -> dict:
    """The step-1 loss from per-token log-probs in float64 (each sequence alone, plain transformers): DPO
    sigmoid at the policy == reference start is log 2 per pair; + sft x the chosen targets' mean NLL."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(base), AutoModelForCausalLM.from_pretrained(base).eval()
    nll, tokens = 0.0, 0
    for line in first.read_text().splitlines():
        pair = json.loads(line)
        head = tok.apply_chat_template(pair["prompt"], add_generation_prompt=True, tokenize=True)["input_ids"]
        ids = tok.apply_chat_template(pair["prompt"] + pair["chosen"], tokenize=True)["input_ids"]
        assert ids[:len(head)] == head
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)
        targets = torch.tensor(ids[len(head):])
        nll -= float(logp[len(head) - 1:-1].gather(-1, targets[:, None]).sum())
        tokens += len(targets)
    return {"loss": math.log(2) + sft * nll / tokens, "chosen_tokens": tokens}


# ---- each side's command line and what it measured ----------------------------------------------------
def phalanx_cmd(s: dict, out: Path, steps: int, micro: int, global_batch: int, nproc: int, data: Path,
                extra=(), base: Path | None = None) -> list[str]:
    return [sys.executable, "-m", "phalanx", "train", "task=preference", f"model.pretrained={base or s['base']}",
            f"data.train={data}", "data.val_fraction=0", f"data.cache_dir={s['work'] / 'cache'}",
            f"model.block_size={BLOCK}", "preference.beta=0.1", f"train.max_steps={steps}", "train.log_every=1",
            "train.eval_every=0", "train.checkpoint_every=0", f"train.micro_batch_size={micro}",
            f"train.global_batch_size={global_batch}", "log.progress=off", *OPTIM, *extra,
            "--nproc-per-node", str(nproc), "--run-dir", str(out), "--fresh"]


def trl_cmd(s: dict, out: Path, steps: int, micro: int, accum: int, nproc: int, data: Path, extra=(),
            base: Path | None = None) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            str(REPO / "bench" / "trl_dpo_side.py"), "--base", str(base or s["base"]), "--data", str(data),
            "--max-length", str(BLOCK), "--micro", str(micro), "--accum", str(accum), "--steps", str(steps),
            "--lr", "1e-4", "--warmup", "2", "--min-lr-ratio", "0.1", "--weight-decay", "0.0", "--beta", "0.1",
            "--out", str(out), "--work", str(out) + "-trainer", *extra]


def phalanx_rate(run_dir: Path, warmup: int) -> dict:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "useful_tokens_per_s" in m]
    first = next(m for m in steps if m["step"] == warmup)
    later = [m for m in steps if m["step"] > warmup]
    useful = sum(m["useful_tokens_per_s"] * m["step_time_s"] for m in later)
    slots = sum(m["tokens_per_s"] * m["step_time_s"] for m in later)
    summary = json.loads((run_dir / "summary.json").read_text())
    # the precomputed reference pass's last progress line (non-padding tokens/s), where this run made it
    passes = re.findall(r"reference pass .*\|\s*([\d.]+) tok/s", Path(f"{run_dir}.log").read_text())
    return {"useful_tps": useful / (later[-1]["time_s"] - first["time_s"]), "efficiency": useful / slots,
            "pairs_per_step": float(np.mean([m["pairs"] for m in later])), "world": summary["world_size"],
            "reference": summary["reference"], "pass_tps": float(passes[-1]) if passes else None}


def trl_rate(prefix: Path, warmup: int) -> dict:
    ranks = [[json.loads(x) for x in f.read_text().splitlines()]
             for f in sorted(prefix.parent.glob(f"{prefix.name}-[0-9]*.jsonl"))]
    info = ranks[0][-1]
    steps = [[m for m in rows if "step" in m] for rows in ranks]
    later = [[m for m in rows if m["step"] > warmup] for rows in steps]
    clock = {m["step"]: m["time_s"] for m in steps[0]}
    useful = sum(m["useful"] for rows in later for m in rows)
    slots = sum(m["tokens"] for rows in later for m in rows)
    reference = "precomputed" if info["precompute"] else "second model" if info["ref_model"] else "adapters off"
    return {"useful_tps": useful / (clock[later[0][-1]["step"]] - clock[warmup]), "efficiency": useful / slots,
            "pairs_per_step": float(PAIRS), "world": info["world_size"], "reference": reference,
            "gc": info["gradient_checkpointing"]}


# ---- the three parts -------------------------------------------------------------------------------------
def first_step(s: dict, sft: float = 1.0) -> None:
    """Step 1 of each side on the first PAIRS pairs, DPO sigmoid + `sft` x NLL of the chosen replies (0: plain
    DPO, log 2 with the policy its own reference), against float64_first."""
    ref = float64_first(s["base"], s["first"], sft)
    run([sys.executable, "-m", "phalanx", "prepare", "task=preference", f"model.pretrained={s['base']}",
         f"data.train={s['first']}", "data.val_fraction=0", f"data.cache_dir={s['work'] / 'cache'}",
         f"model.block_size={BLOCK}", "--quiet"], s["work"] / "first-prepare.log", s["work"])
    rows = int(re.search(r"train_packed_rows (\d+)", (s["work"] / "first-prepare.log").read_text()).group(1))
    cases = [("phalanx, packed, 1 process", "phalanx", 1, rows, rows, []),
             ("phalanx, padded, 1 process", "phalanx", 1, PAIRS, PAIRS, ["data.packing=false"]),
             ("phalanx, padded, 2 processes x accumulation 2", "phalanx", 2, PAIRS // 4, PAIRS, ["data.packing=false"]),
             (f"TRL DPOTrainer{' [sigmoid, sft]' if sft else ''}, 1 process", "trl", 1, PAIRS, 1, [])]
    print(f"\n### First-step loss: one global batch = the first {PAIRS} pairs, DPO sigmoid + {sft:g} x NLL of the "
          f"chosen replies ({ref['chosen_tokens']} target tokens)\n\n| run | step-1 loss | float64 reference | "
          "difference |\n|---|---|---|---|")
    for k, (name, tool, nproc, micro, size, extra) in enumerate(cases):
        out = s["work"] / f"first-{k}"
        if tool == "phalanx":
            run(phalanx_cmd(s, out, 1, micro, size, nproc, s["first"], [f"preference.sft_weight={sft}", *extra]),
                Path(f"{out}.log"), s["work"])
            loss = next(json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()
                        if '"loss"' in x)
        else:
            run(trl_cmd(s, out, 1, micro, size, nproc, s["first"], ["--sft-weight", str(sft), "--gc", "off"]),
                Path(f"{out}.log"), s["work"])
            loss = next(json.loads(x)["loss"] for x in Path(f"{out}-0.jsonl").read_text().splitlines() if '"call"' in x)
        print(f"| {name} | {loss:.7f} | {ref['loss']:.7f} | {loss - ref['loss']:+.1e} |")


SIDES = {"phalanx": ("phalanx", []), "phalanx-padded": ("phalanx", ["data.packing=false"]),
         "trl-same": ("trl", ["--precompute", "--gc", "off"]), "trl-defaults": ("trl", [])}


def throughput(s: dict, a) -> None:
    rows_micro = max(1, round(PAIRS * s["pair_len"] / (0.9 * 2 * BLOCK) / (NPROC * ACCUM)))
    results: dict[str, list] = {k: [] for k in SIDES}
    for k in range(a.repeats):
        for side, (tool, extra) in SIDES.items():
            out = s["work"] / f"{side}-{k}"
            if tool == "phalanx":
                packed = "data.packing=false" not in extra
                micro = rows_micro if packed else MICRO
                run(phalanx_cmd(s, out, a.steps, micro, micro * NPROC * ACCUM, NPROC, s["pairs"], extra),
                    Path(f"{out}.log"), s["work"])
                results[side].append(phalanx_rate(out, a.warmup))
            else:
                run(trl_cmd(s, out, a.steps, MICRO, ACCUM, NPROC, s["pairs"], extra), Path(f"{out}.log"), s["work"])
                results[side].append(trl_rate(out, a.warmup))
    base = statistics.median(r["useful_tps"] for r in results["phalanx"])
    print(f"\n### Useful tokens/s ({NPROC} processes x 1 thread, steps {a.warmup + 1}-{a.steps}, median of "
          f"{a.repeats})\n\n| side | reference | useful tokens/s | phalanx / side | pairs per step | "
          "real / slots | world |\n|---|---|---|---|---|---|---|")
    for side, rs in results.items():
        tps = statistics.median(r["useful_tps"] for r in rs)
        note = " (gradient checkpointing)" if rs[0].get("gc") else ""
        print(f"| {side}{note} | {rs[0]['reference']} | {tps:,.0f} | {base / tps:.2f}x | {rs[0]['pairs_per_step']:.1f} "
              f"| {statistics.median(r['efficiency'] for r in rs):.2f} | {rs[0]['world']} |")
    passes = [r["pass_tps"] for rs in results.values() for r in rs if r.get("pass_tps")]
    if passes:  # the pass runs once per base and data (then cached): forward only, against a training step's rate
        print(f"\nphalanx's precomputed reference pass (forward only, eval mode, over the same pairs): "
              f"{statistics.median(passes):,.0f} non-padding tokens/s = {statistics.median(passes) / base:.2f}x the "
              f"training steps' useful tokens/s ({len(passes)} pass(es))")


def memory(s: dict) -> None:
    big = make_big(s["work"], s["base"])
    same = ["data.packing=false"]  # one pair per micro-batch, as TRL's micro-batch of 1
    cases = [("phalanx full, precomputed reference", "phalanx", same),
             ("phalanx full, reference=model (a second copy)", "phalanx", [*same, "preference.reference=model"]),
             ("phalanx full, precomputed, dist.keep_freed_memory=false", "phalanx",
              [*same, "dist.keep_freed_memory=false"]),
             ("TRL full, precompute_ref_log_probs", "trl", ["--precompute", "--gc", "off"]),
             ("TRL full, defaults (a second copy, gradient checkpointing)", "trl", []),
             ("TRL full, a second copy, no gradient checkpointing", "trl", ["--gc", "off"]),
             ("phalanx LoRA r=16, adapters off", "phalanx", [*same, "model.lora.r=16"]),
             ("phalanx LoRA r=16, adapters off, dist.keep_freed_memory=false", "phalanx",
              [*same, "model.lora.r=16", "dist.keep_freed_memory=false"]),
             ("TRL LoRA r=16 (peft), adapters off", "trl", ["--lora", "16", "--gc", "off"])]
    print("\n### Peak RSS per rank (MB), 12 x 512 GPT-2 (~38 M parameters, fp32), 2 processes, 4 steps of 4 pairs "
          "(micro-batch: 1 pair, accumulation 2)\n\n| case | rank 0 | rank 1 |\n|---|---|---|")
    for k, (name, tool, extra) in enumerate(cases):
        out = s["work"] / f"mem-{k}"
        cmd = phalanx_cmd(s, out, 4, 1, 4, NPROC, s["first"], extra, base=big) if tool == "phalanx" else \
            trl_cmd(s, out, 4, 1, 2, NPROC, s["first"], extra, base=big)
        peak = run(cmd, Path(f"{out}.log"), s["work"])
        print(f"| {name} | {peak.get(0, float('nan')):,.0f} | {peak.get(1, float('nan')):,.0f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--parts", default="first,throughput,memory", help="which parts to run")
    p.add_argument("--work", default="")
    a = p.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="vs-trl-dpo-"))
    work.mkdir(parents=True, exist_ok=True)
    base = make_base(work)
    sizes = make_pairs(work, base)
    s = {"work": work, "base": base, "pairs": work / "pairs.jsonl", "first": work / "first.jsonl",
         "pair_len": float(np.mean(sizes))}
    print(f"phalanx {phalanx_version()}; {len(sizes)} pairs, mean {s['pair_len']:.0f} tokens per pair (both "
          f"sequences); work folder {work}; the machine is shared (other jobs ran on its 2 cores)")
    for part in a.parts.split(","):
        {"first": lambda: first_step(s), "throughput": lambda: throughput(s, a), "memory": lambda: memory(s)}[part]()


if __name__ == "__main__":
    main()
