"""Real pretrained models end to end (issue 31 item 5): phalanx against TRL and the Transformers Trainer on
SmolLM2-135M-Instruct and all-MiniLM-L6-v2 (../shared/models), 2 processes a side x 1 thread, fp32 (bf16 is
emulated on this CPU), the same machine, sides run in turn. Data: SST-2 (../shared/data/sst2), shuffled once
(seed 0): SFT sentences from the front, DPO pairs from sentences after the first 4,000 (never used in SFT);
the validation sentences (the first --val, in file order) are the held-out set of every table.

A chat is the user turn INSTRUCTION + "\\n\\n" + the sentence, the reply its label word ("negative" /
"positive"), rendered by both sides with SmolLM2's own ChatML template (it adds its default system message).
phalanx reads SmolLM2 from --smol: the GGUF file itself where phalanx reads GGUF (model.pretrained=FILE.gguf;
TRL and plain transformers then use the fp32 folder phalanx dequantised into its cache), or a plain folder
(both sides); without phalanx's GGUF support, the file is dequantised here with transformers' GGUF reader.
TRL gets the same chats as conversational prompt-completion records (its default loss for them is on the
completion; SmolLM2's template has no {% generation %} markers, so TRL's assistant_only_loss cannot run):
TRL's completion is the reply, <|im_end|> and the newline the template writes after it, phalanx's targets the
reply through <|im_end|> (the mask check counts the difference).

  sft         chat SFT, LoRA r=16 (alpha 16, dropout 0.05, every linear layer: phalanx's defaults, given to
              TRL's peft LoraConfig too) and full fine-tuning, vs TRL's SFTTrainer (bench/vs_trl.py's sides
              through bench/trl_side.py). Rates: useful (non-pad) tokens/s, supervised tokens/s, peak RSS
              (VmHWM) and sampled peak private memory (RssAnon) per rank, against TRL's defaults (padded,
              gradient checkpointing, random order; global batch 16 chats; target phalanx >= 1.5x) and the
              same math (no gradient checkpointing, TRL's bfd packing where bench/trl_checks.py finds its
              packed loss equal to unpacked here, else group_by_length; target >= 1.0x); medians over
              --repeats alternating runs. Quality: greedy replies (up to 16 new tokens) on the validation
              chats through plain transformers (`generate` on each side's saved model with its template), the
              reply's first label word scored: zero-shot, then after each side's fine-tuning on the same
              --steps x 16 chats (one epoch, global batch 16 chats: phalanx with data.packing=false so a step
              holds the same chats; the same cosine schedule, no warm-up), per seed (Wilson 95%) and over
              --seeds (t 95%).
  dpo         DPO (sigmoid, beta 0.1, full fine-tuning) on the sft table's phalanx LoRA run (first seed) vs
              TRL's DPOTrainer (bench/vs_trl_dpo.py through bench/trl_dpo_side.py), pairs = a sentence with
              its label word chosen and the other rejected: the first-step loss of each side against the
              float64 script (log 2: the policy is its own reference, dropout off), useful tokens/s (same
              math: precomputed references, no gradient checkpointing; TRL's defaults: a reference copy,
              gradient checkpointing), then both sides trained on the same --steps x 16 pairs (padded, the
              same math, first seed) and scored on the held-out pairs made from the validation sentences:
              TRL's rewards/accuracies (the share of pairs whose chosen reply's log-ratio to the reference,
              the SFT model, beats the rejected one's; TRL's completion tokens; plain transformers, fp32)
              and the mean reward margin, and greedy label accuracy after DPO.
  classify    all-MiniLM-L6-v2 (phalanx adds the classification head its checkpoint lacks; the Trainer's
              AutoModelForSequenceClassification does the same) on SST-2 vs the Trainer (bench/vs_trainer.py
              through bench/trainer_side.py --pretrained) at equal steps (--steps x 32 sentences: one epoch
              of as many training rows, lr 1e-4, 10% warm-up): accuracy on all 872 validation sentences per
              seed (Wilson 95%) and over --seeds (t 95%), useful tokens/s of each side's defaults (phalanx:
              length-grouped; Trainer: random order) and the same math (Trainer group_by_length), the seeds'
              runs being the repeats (--repeats does not apply).
  transcript  `phalanx chat RUN --temperature 0` on the sft table's phalanx LoRA run, driven by piped stdin:
              the turns, then its output verbatim.

Cut to fit about 30 minutes of this 2-core machine per table (SmolLM2 trains at ~90-190 useful tokens/s on
2 processes here, by side; a chat is ~62 tokens with the template's system message): sft: 4 timed steps (after 2
untimed) x 2 repeats per side, quality on 8 steps x 16 = 128 chats and on 200 validation sentences, LoRA
only (--quality lora,full adds full fine-tuning); dpo: one seed, 4 timed steps (after 2) x 2 repeats per
side, 8 steps x 16 = 128 pairs, 200 held-out pairs; classify: 250 steps x 32 = 8,000 sentences, 3 seeds.
Estimated from the smoke's timings on a lightly loaded machine: sft ~30 min, dpo ~32, classify ~20,
transcript under 1 (each table several times longer while other heavy jobs share the 2 cores). --smoke
shrinks every table to a check of the code paths (1 seed, 1 repeat, 2 timed steps, 2 training steps (classify
30), 16 validation sentences): sft ~7 min, dpo ~11, classify ~1.5, transcript ~0.2 there (bounded by ~25
process starts of a 135 M model). Finished runs in --work (trained models, each run's measured figures as
JSON) are reused; the dpo table's first-step and timed runs (bench/vs_trl_dpo.py's) always run again.

    python bench/real_models.py --table sft|dpo|classify|transcript|all [--work DIR] [--repeats 2]
        [--seeds 1,2,3] [--steps N] [--rate-steps 6] [--warmup 2] [--val 200] [--quality lora[,full]] [--smoke]
        [--smol FILE.gguf|FOLDER] [--minilm FOLDER]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import dpo_sst2
import numpy as np
import vs_trainer
import vs_trl
import vs_trl_dpo
import vs_trl_runs as runs

REPO = runs.REPO
SHARED = REPO.parent / "shared"
SMOL = SHARED / "models" / "smollm2-135m-instruct-gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM = SHARED / "models" / "all-minilm-l6-v2"
SST2 = dpo_sst2.SST2
WORDS = dpo_sst2.WORDS
INSTRUCTION = "Is the sentiment of this movie review positive or negative? Answer with one word."
NPROC, MICRO, ACCUM = vs_trl.NPROC, vs_trl.PADDED_MICRO, vs_trl.ACCUM  # 16 chats / pairs a step = 4 x 2 x 2
GLOBAL = MICRO * NPROC * ACCUM
DPO_FROM = 4000  # DPO pairs come from the shuffled training sentences after these (SFT takes its chats before)
LORA = {"lora": (["model.lora.r=16"], ["--lora", "16"]), "full": ([], [])}  # (phalanx, trl_side) switches
SFT_LR = {"lora": 5e-4, "full": 3e-5}
DPO_LR, CLASSIFY_LR, MAX_NEW = 1e-5, 1e-4, 16
# NO_WARMUP: the quality runs of SmolLM2 use none. phalanx's warm-up is lr x (step + 1) / warmup from step 0, the
# Transformers schedulers' lr x step / warmup (their first step has lr 0): one step apart, which in 8 steps is ~18%
# of the summed learning rate. Without warm-up both are the same cosine from the peak to 0.1 x peak.
# per table: (full size, --smoke size)
SIZES = {"repeats": (2, 1), "seeds": ("1,2,3", "1"), "rate_steps": (6, 3), "warmup": (2, 1), "val": (200, 16)}
STEPS = ({"sft": 8, "dpo": 8, "classify": 250}, {"sft": 2, "dpo": 2, "classify": 30})  # quality runs' steps


# ---- shared pieces ---------------------------------------------------------------------------------------------
def cached(path: Path, make, *args) -> dict:
    """The JSON at `path` when a finished run left it there, else make(*args) written there."""
    if path.is_file():
        return json.loads(path.read_text())
    value = make(*args)
    path.write_text(json.dumps(value))
    return value


def shuffled_train() -> list[dict]:
    rows = [json.loads(line) for line in (SST2 / "train.jsonl").read_text().splitlines()]
    random.Random(0).shuffle(rows)
    return rows


def validation(n: int) -> list[dict]:
    """The first n validation sentences (text, label)."""
    return [json.loads(line) for line in (SST2 / "validation.jsonl").read_text().splitlines()][:n]


def prompts(rows: list[dict]) -> list[tuple[str, int]]:
    """(user turn, label): what dpo_sst2.accuracy scores."""
    return [(user(r["text"])[0]["content"], r["label"]) for r in rows]


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": f"{INSTRUCTION}\n\n{text}"}]


def reply(label: int) -> list[dict]:
    return [{"role": "assistant", "content": WORDS[label]}]


def write_chats(path: Path, rows: list[dict]) -> tuple[Path, Path]:
    """path.jsonl (phalanx: messages) and path-pc.jsonl (TRL: conversational prompt-completion), same chats."""
    chats, pc = path.with_suffix(".jsonl"), path.with_name(f"{path.name}-pc.jsonl")
    chats.write_text("".join(json.dumps({"messages": user(r["text"]) + reply(r["label"])}) + "\n" for r in rows))
    pc.write_text("".join(json.dumps({"prompt": user(r["text"]), "completion": reply(r["label"])}) + "\n"
                          for r in rows))
    return chats, pc


def write_pairs(path: Path, rows: list[dict]) -> list[dict]:
    """TRL's explicit conversational pairs (phalanx reads the same records): the other label word rejected."""
    pairs = [{"prompt": user(r["text"]), "chosen": reply(r["label"]), "rejected": reply(1 - r["label"])} for r in rows]
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return pairs


def greedy(folder: Path, val: list[tuple[str, int]], work: Path, name: str = "") -> dict:
    """Greedy label accuracy of the model in `folder` (plain transformers), cached under work/acc/ by its run's
    name (RUN/final, or a saved folder's own name)."""
    (work / "acc").mkdir(exist_ok=True)
    name = name or (folder.parent.name if folder.name == "final" else folder.name)
    return cached(work / "acc" / f"{name}-v{len(val)}.json", scored, folder, val)


def scored(folder: Path, val: list[tuple[str, int]]) -> dict:
    right, off = dpo_sst2.accuracy(folder, val, max_new_tokens=MAX_NEW, anywhere=True)
    return {"right": right, "off": off, "n": len(val)}


def acc_cell(r: dict) -> str:
    lo, hi = dpo_sst2.wilson(r["right"], r["n"])
    return f"{r['right']:.1%} ({lo:.1%}-{hi:.1%})"


def header(table: str, a, extra: str) -> float:
    cmd = (f"python bench/real_models.py --table {table} --work {a.work} --seeds {a.seeds} --val {a.val} "
           f"{extra}{' --smoke' if a.smoke else ''}")
    print(f"\n## Table {table}\n\ncommand: {cmd}\nphalanx {runs.phalanx_version()}; {NPROC} processes x 1 thread a "
          f"side, fp32; the machine is shared (load average {open('/proc/loadavg').read().split()[0]} at the start)\n",
          flush=True)
    return time.time()


def footer(table: str, started: float) -> None:
    print(f"\n(table {table}: {(time.time() - started) / 60:.1f} min)", flush=True)


# ---- SmolLM2: the base each side reads, the data ------------------------------------------------------------------
def dequantise(gguf: Path, folder: Path) -> None:
    """Without phalanx's GGUF support: transformers' GGUF reader, rebuilt from the config without its quantization
    entry (save_pretrained refuses a GGUF-loaded model), tied, saved as fp32 safetensors with the tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=False)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)


def smol(a) -> dict:
    """work/sft: the data, and the SmolLM2 base each side reads (s as bench/vs_trl_runs.py's commands take it)."""
    work = Path(a.work) / "sft"
    (work / "data").mkdir(parents=True, exist_ok=True)
    rows, data = shuffled_train(), work / "data"
    chats, pc = write_chats(data / "sft", rows[:a.steps_of["sft"] * GLOBAL])
    rate, rate_pc = write_chats(data / "rate", rows[:2 * a.rate_steps * GLOBAL])
    val, _ = write_chats(data / "val", validation(8))
    spec = Path(a.smol)
    s = {"work": work, "base": spec, "train": rate, "trl_train": rate_pc, "val": val, "sft": chats, "sft_pc": pc}
    if spec.is_dir():
        s["trl_base"] = spec
    elif importlib.util.find_spec("phalanx.model.gguf"):  # phalanx reads the file; TRL its dequantised folder
        runs.phalanx_prepared(s)  # work/prepare-0.log: the rate chats, packed
        marks = [m for m in (work / "cache" / "gguf").glob("*/gguf.json")
                 if Path(json.loads(m.read_text()).get("source", "")).resolve() == spec.resolve()]
        s["trl_base"] = marks[0].parent
    else:
        folder = work / "smol"
        if not (folder / "config.json").is_file():
            dequantise(spec, folder)
        s["base"] = s["trl_base"] = folder
    runs.phalanx_prepared(s)
    return s


def sft_quality_run(s: dict, a, side: str, kind: str, seed: int) -> Path:
    """A model fine-tuned on s["sft"] (phalanx) or s["sft_pc"] (TRL): --steps x 16 chats, one epoch."""
    steps = a.steps_of["sft"]
    lr, warm = SFT_LR[kind], 0  # see NO_WARMUP
    out = s["work"] / f"q-{side}-{kind}-s{seed}-n{steps}"
    if side == "phalanx":
        final = out / "final"
        if not (final / "config.json").is_file():
            runs.run(runs.phalanx_cmd(s, out, steps, MICRO, GLOBAL, NPROC, 1, [
                *LORA[kind][0], "data.packing=false", f"train.seed={seed}", f"train.lr={lr}",
                f"train.warmup_steps={warm}"], data=s["sft"]), Path(f"{out}.log"), s["work"])
        return final
    saved = Path(f"{out}-model")
    if not (saved / "config.json").is_file():
        runs.run(runs.trl_cmd(s, out, steps, MICRO, ACCUM, NPROC, [
            *LORA[kind][1], "--seed", str(seed), "--lr", str(lr), "--warmup", str(warm), "--save", str(saved)],
            data=s["sft_pc"]), Path(f"{out}.log"), s["work"])
    return saved


# ---- table sft ---------------------------------------------------------------------------------------------------
def sft_sides(packing_ok: bool, rows_micro: int) -> dict:
    """bench/vs_trl.py's sides for LoRA and full fine-tuning; TRL's same math without assistant_only_loss (its
    prompt-completion data already takes the loss on the completion only)."""
    packed, padded = {"micro": rows_micro, "unit": "rows"}, {"micro": MICRO, "unit": "conversations"}
    same = ["--gc", "off", "--packing" if packing_ok else "--group"]
    sides = {}
    for kind, (ours, theirs) in LORA.items():
        sides[f"phalanx-{kind}"] = {"tool": "phalanx", **packed, "extra": ours}
        if not packing_ok:
            sides[f"phalanx-padded-{kind}"] = {"tool": "phalanx", **padded, "extra": [*ours, "data.packing=false"]}
        sides[f"trl-defaults-{kind}"] = {"tool": "trl", **padded, "extra": theirs}
        sides[f"trl-same-{kind}"] = {"tool": "trl", **(packed if packing_ok else padded), "extra": [*theirs, *same]}
    return sides


def sft_checks(s: dict, a) -> bool:
    """bench/trl_checks.py on the rate chats (packing and mask); fills s's batch plan; True: TRL packing is the
    same math here."""
    from phalanx.core.config import ModelConfig
    from phalanx.model.build import build_causal_lm

    out = s["work"] / "checks.json"
    if not out.is_file():
        runs.run([sys.executable, str(REPO / "bench" / "trl_checks.py"), "--base", str(s["trl_base"]), "--data",
                  str(s["trl_train"]), "--parts", "packing,mask", "--pack-examples", str(8 if a.smoke else 16),
                  "--max-length", str(runs.BLOCK), "--work", str(s["work"] / "checks"), "--out", str(out)],
                 s["work"] / "checks.log", s["work"])
    checks = json.loads(out.read_text())
    pk, mk = checks["packing"], checks["mask"]
    # vs_trl.py's rule, with an fp32 noise floor for 30 layers (1e-4 nats; the control differs by ~0.5)
    packing_ok = pk["max_abs_diff"] <= 1e-4 and pk["control_max_abs_diff"] > 1e-2
    lengths = np.asarray(mk["lengths"])
    eff = float(re.search(r"packing_efficiency ([\d.]+)", (s["work"] / "prepare-0.log").read_text()).group(1))
    s.update(supervised_fraction=mk["supervised_fraction"], pack_eff=eff,
             rows_micro=max(1, round(GLOBAL * lengths.mean() / (eff * runs.BLOCK) / (NPROC * ACCUM))),
             phalanx_attn=build_causal_lm(ModelConfig(pretrained=str(s["trl_base"])), 0, 0).config._attn_implementation)
    print(f"packing check (TRL bfd packing, {pk['attn']}, {pk['examples']} chats in {pk['rows']} rows): max |packed - "
          f"alone| per-chat loss {pk['max_abs_diff']:.2e}, negative control {pk['control_max_abs_diff']:.2e} -> TRL "
          f"packing {'is' if packing_ok else 'is NOT'} the same math here\nmask check: {mk['conversations']} chats; "
          f"token ids differ in {mk['ids_differ']}; TRL's completion labels differ from phalanx's targets in "
          f"{mk['mask_differ']} ({mk['mask_tokens_differ']} tokens: the newline after <|im_end|>); phalanx's "
          f"supervised fraction {mk['supervised_fraction']:.4f}\nbatches: padded {GLOBAL} chats a step (mean "
          f"{lengths.mean():.1f} tokens); packed {s['rows_micro'] * NPROC * ACCUM} rows of {runs.BLOCK} a step "
          f"(packing efficiency {eff:.3f})", flush=True)
    return packing_ok


def sft_rate(side: str, spec: dict, s: dict, steps, k: int) -> dict:
    """One timed run (bench/vs_trl.py's run_side) in a fresh folder; its checkpoint and export deleted (GBs)."""
    shutil.rmtree(s["work"] / f"{side}-{k}", ignore_errors=True)
    r = vs_trl.run_side(side, spec, s, steps, k)
    for heavy in ("checkpoints", "final"):
        shutil.rmtree(s["work"] / f"{side}-{k}" / heavy, ignore_errors=True)
    return r


def sft_rates(s: dict, a, packing_ok: bool) -> None:
    sides = sft_sides(packing_ok, s["rows_micro"])
    steps = argparse.Namespace(steps=a.rate_steps, warmup=a.warmup, log_every=1)
    (s["work"] / "rates").mkdir(exist_ok=True)
    results: dict = {}
    for k in range(a.repeats):
        for side, spec in sides.items():
            r = cached(s["work"] / "rates" / f"{side}-{k}-n{a.rate_steps}.json", sft_rate, side, spec, s, steps, k)
            results.setdefault(side, []).append(r)
            print(f"{side} run {k}: {r['useful_tps']:.1f} useful tok/s, {r['step_s']:.2f} s/step, private "
                  f"{' / '.join(f'{m:.0f}' for m in r['private_mb'])} MB", flush=True)
    med = {side: vs_trl.median_of(rs) for side, rs in results.items()}
    for kind in LORA:
        print(f"\n### {'LoRA r=16' if kind == 'lora' else 'full fine-tuning'}: rates (steps {a.warmup + 1}-"
              f"{a.rate_steps} timed, median of {a.repeats})")
        group = {side.removesuffix(f"-{kind}"): side for side in sides if side.endswith(f"-{kind}")}
        meds, each = {g: med[side] for g, side in group.items()}, {g: results[side] for g, side in group.items()}
        vs_trl.print_main(meds, each)
        vs_trl.print_ratios(meds, each, "packed" if packing_ok else "padded, group_by_length",
                            "TRL's completion also has the newline after <|im_end|>")
    print("\n| side | peak private MB r0 / r1 (RssAnon, sampled) | phalanx / side |\n|---|---|---|")
    for side, m in med.items():
        ours = med["phalanx-" + side.rsplit("-", 1)[1]]["private_mb"]
        print(f"| {side} | {' / '.join(f'{v:.0f}' for v in m['private_mb'])} | "
              f"{' / '.join(f'{o / v:.2f}x' for o, v in zip(ours, m['private_mb']))} |")


def sft_quality(s: dict, a) -> None:
    val = prompts(validation(a.val))
    zero = greedy(s["trl_base"], val, s["work"], "zero-shot")
    lrs = ", ".join(f"{kind} {SFT_LR[kind]:g}" for kind in a.quality.split(","))
    print(f"\n### Greedy accuracy on {len(val)} validation chats (plain transformers, up to {MAX_NEW} new tokens, the "
          f"reply's first label word), after {a.steps_of['sft']} steps x {GLOBAL} chats (lr {lrs}, cosine, no "
          f"warm-up)\n\nzero-shot: {acc_cell(zero)}, neither word {zero['off']:.1%}\n\n| kind | seed | phalanx "
          "(Wilson 95%) | neither | TRL | neither |\n|---|---|---|---|---|---|")
    for kind in a.quality.split(","):
        got = {"phalanx": [], "trl": []}
        for seed in a.seed_list:
            for side in got:
                final = sft_quality_run(s, a, side, kind, seed)
                got[side].append(greedy(final, val, s["work"]))
            ours, theirs = got["phalanx"][-1], got["trl"][-1]
            print(f"| {kind} | {seed} | {acc_cell(ours)} | {ours['off']:.1%} | {acc_cell(theirs)} | "
                  f"{theirs['off']:.1%} |", flush=True)
        means = {side: dpo_sst2.over_seeds([r["right"] for r in rs]) for side, rs in got.items()}
        diff = dpo_sst2.over_seeds([o["right"] - t["right"] for o, t in zip(got["phalanx"], got["trl"])])
        print(f"| {kind} | mean (t 95%) | {means['phalanx']} | | {means['trl']} | |\n| {kind} | phalanx - TRL, "
              f"seed by seed (t 95%) | {diff} | | | |")


def table_sft(a) -> None:
    started = header("sft", a, f"--repeats {a.repeats} --steps {a.steps_of['sft']} --rate-steps {a.rate_steps} "
                               f"--warmup {a.warmup} --quality {a.quality} --smol {a.smol}")
    s = smol(a)
    print(f"SmolLM2 for phalanx: {s['base']}; for TRL and plain transformers: {s['trl_base']}")
    packing_ok = sft_checks(s, a)
    sft_rates(s, a, packing_ok)
    sft_quality(s, a)
    footer("sft", started)


# ---- table dpo -----------------------------------------------------------------------------------------------
def pair_logps(folder: Path, pairs: list[dict]) -> np.ndarray:
    """[pairs, 2]: the summed log-probs of each pair's chosen and rejected reply under the model in `folder` (plain
    transformers, fp32): TRL's completion tokens, everything after the prompt rendered with the generation prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    seqs = []
    for p in pairs:
        head = len(tok.apply_chat_template(p["prompt"], add_generation_prompt=True, tokenize=True)["input_ids"])
        seqs += [(tok.apply_chat_template(p["prompt"] + p[k], tokenize=True)["input_ids"], head)
                 for k in ("chosen", "rejected")]
    sums = []
    for lo in range(0, len(seqs), 16):
        part = seqs[lo:lo + 16]
        width = max(len(ids) for ids, _ in part)
        ids = torch.tensor([x + [0] * (width - len(x)) for x, _ in part])
        mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x, _ in part])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[:, :-1].float(), -1)
        token = logp.gather(-1, ids[:, 1:, None])[..., 0].double()
        sums += [float(token[row, head - 1:len(x) - 1].sum()) for row, (x, head) in enumerate(part)]
    return np.asarray(sums).reshape(-1, 2)


def preference_scores(policy: Path, ref: np.ndarray, pairs: list[dict]) -> dict:
    """TRL's rewards/accuracies and rewards/margins (beta 0.1) on held-out pairs, reference log-probs `ref`."""
    d = (pair_logps(policy, pairs) - ref) * 0.1  # rewards: beta x log-ratio to the reference
    return {"accuracy": float((d[:, 0] > d[:, 1]).mean()), "margin": float((d[:, 0] - d[:, 1]).mean()),
            "n": len(pairs)}


def table_dpo(a) -> None:
    started = header("dpo", a, f"--repeats {a.repeats} --steps {a.steps_of['dpo']} --rate-steps {a.rate_steps} "
                               f"--warmup {a.warmup} --smol {a.smol}")
    seed = a.seed_list[0]
    sft = sft_quality_run(smol(a), a, "phalanx", "lora", seed)
    work = Path(a.work) / "dpo"
    (work / "acc").mkdir(parents=True, exist_ok=True)
    rows, steps = shuffled_train(), a.steps_of["dpo"]
    train = write_pairs(work / "pairs.jsonl", rows[DPO_FROM:DPO_FROM + steps * GLOBAL])
    write_pairs(work / "rate-pairs.jsonl", rows[DPO_FROM:DPO_FROM + a.rate_steps * GLOBAL])
    write_pairs(work / "first.jsonl", rows[DPO_FROM:DPO_FROM + vs_trl_dpo.PAIRS])
    held = write_pairs(work / "held-out.jsonl", validation(a.val))
    s = {"work": work, "base": sft, "pairs": work / "rate-pairs.jsonl", "first": work / "first.jsonl",
         "pair_len": float(np.mean([sum(n) for n in pair_lengths(sft, train[:32])]))}
    print(f"SFT model (the sft table's phalanx LoRA run, seed {seed}): {sft}; {len(train)} training pairs, mean "
          f"{s['pair_len']:.0f} tokens a pair (both sequences); {len(held)} held-out pairs")
    vs_trl_dpo.first_step(s, sft=0.0)
    vs_trl_dpo.throughput(s, argparse.Namespace(repeats=a.repeats, steps=a.rate_steps, warmup=a.warmup))
    models = {"phalanx": work / f"q-phalanx-s{seed}-n{steps}" / "final", "TRL": work / f"q-trl-s{seed}-n{steps}-model"}
    same = [f"train.seed={seed}", f"train.lr={DPO_LR}", "train.warmup_steps=0", "data.packing=false"]  # NO_WARMUP
    if not (models["phalanx"] / "config.json").is_file():
        out = models["phalanx"].parent
        runs.run(vs_trl_dpo.phalanx_cmd(s, out, steps, MICRO, GLOBAL, NPROC, work / "pairs.jsonl", same),
                 Path(f"{out}.log"), work)
    if not (models["TRL"] / "config.json").is_file():
        out = work / f"q-trl-s{seed}-n{steps}"
        runs.run(vs_trl_dpo.trl_cmd(s, out, steps, MICRO, ACCUM, NPROC, work / "pairs.jsonl", [
            "--precompute", "--gc", "off", "--seed", str(seed), "--lr", str(DPO_LR), "--warmup", "0",
            "--save", str(models["TRL"])]),
            Path(f"{out}.log"), work)
    val = prompts(validation(a.val))
    ref = pair_logps(sft, held)
    print(f"\n### After DPO: {steps} steps x {GLOBAL} pairs (padded, precomputed references, lr {DPO_LR} cosine, no "
          f"warm-up, seed {seed}); held-out: {len(held)} pairs from the validation sentences\n\n| model | "
          "rewards/accuracies (held-out) | rewards/margins | greedy accuracy (Wilson 95%) | neither word |\n"
          "|---|---|---|---|---|")
    base = greedy(sft, val, Path(a.work) / "sft")
    print(f"| SFT (the reference) | - | - | {acc_cell(base)} | {base['off']:.1%} |")
    for name, folder in models.items():
        pref = cached(work / "acc" / f"pref-{name}-s{seed}-n{steps}-v{len(held)}.json", preference_scores, folder,
                      ref, held)
        acc = greedy(folder, val, work)
        print(f"| SFT + DPO, {name} | {pref['accuracy']:.1%} | {pref['margin']:+.3f} | {acc_cell(acc)} | "
              f"{acc['off']:.1%} |", flush=True)
    footer("dpo", started)


def pair_lengths(folder: Path, pairs: list[dict]) -> list[tuple[int, int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    return [tuple(len(tok.apply_chat_template(p["prompt"] + p[k], tokenize=True)["input_ids"])
                  for k in ("chosen", "rejected")) for p in pairs]


# ---- table classify -------------------------------------------------------------------------------------------
def classify_run(side: str, spec: dict, data: dict, work: Path, a, seed: int) -> dict:
    """One run of bench/vs_trainer.py's run_side (10 steps untimed) in a fresh folder: rates, validation accuracy."""
    out = work / f"classify-{side}-s{seed}"
    shutil.rmtree(out, ignore_errors=True)
    r = vs_trainer.run_side(side, "classify", spec, data, work, Path(a.minilm), NPROC, 10, f"s{seed}")
    if side == "phalanx":
        summary = json.loads((out / "summary.json").read_text())
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
        return {**r, "right": summary["eval/accuracy"], "n": summary["eval/samples"]}
    scores = json.loads(Path(f"{out}-eval.json").read_text())
    return {**r, "right": scores["accuracy"], "n": scores["samples"]}


def table_classify(a) -> None:
    steps = a.steps_of["classify"]
    started = header("classify", a, f"--steps {steps} --minilm {a.minilm}")
    work = Path(a.work) / "classify"
    (work / "results").mkdir(parents=True, exist_ok=True)
    micro, total = 16, 32
    train = work / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in shuffled_train()[:steps * total]))
    warm = max(1, steps // 10)
    data = {"phalanx": [f"data.train={train}", f"data.validation={SST2 / 'validation.jsonl'}",
                        f"model.pretrained={a.minilm}", f"train.lr={CLASSIFY_LR}", f"train.warmup_steps={warm}"],
            "trainer": str(train)}
    sides = ["phalanx", "trainer", "trainer-grouped"]
    results: dict = {side: [] for side in sides}
    for seed in a.seed_list:
        spec = {"yaml": "sst2.yaml", "steps": steps, "micro": micro, "global": total, "lr": CLASSIFY_LR,
                "warmup": warm, "weight_decay": 0.01, "beta2": 0.999,
                "phalanx_extra": [f"train.seed={seed}", "train.eval_max_samples=0"],
                "trainer_extra": ["--pretrained", "--seed", str(seed), "--rows", str(steps * total),
                                  "--eval", str(SST2 / "validation.jsonl")]}
        for side in sides:
            r = cached(work / "results" / f"{side}-s{seed}-n{steps}.json", classify_run, side, spec, data, work, a,
                       seed)
            results[side].append(r)
            print(f"{side} seed {seed}: accuracy {r['right']:.1%}, {r['useful_tps']:.0f} useful tok/s, "
                  f"{r['step_s']:.3f} s/step, pad {r['pad']:.3f}", flush=True)
    print(f"\n### all-MiniLM-L6-v2 on SST-2: {steps} steps x {total} sentences (micro {micro} x {NPROC} processes), "
          f"lr {CLASSIFY_LR}, {warm} warm-up steps; accuracy on the {results['phalanx'][0]['n']} validation "
          "sentences\n\n| side | seed | accuracy (Wilson 95%) | useful tok/s | step s | pad fraction |\n"
          "|---|---|---|---|---|---|")
    for side, rs in results.items():
        for seed, r in zip(a.seed_list, rs):
            print(f"| {side} | {seed} | {acc_cell(r)} | {r['useful_tps']:.0f} | {r['step_s']:.3f} | {r['pad']:.3f} |")
        print(f"| {side} | mean (t 95%) / median | {dpo_sst2.over_seeds([r['right'] for r in rs])} | "
              f"{statistics.median(r['useful_tps'] for r in rs):.0f} | "
              f"{statistics.median(r['step_s'] for r in rs):.3f} | {statistics.median(r['pad'] for r in rs):.3f} |")
    tps = {side: statistics.median(r["useful_tps"] for r in rs) for side, rs in results.items()}
    print(f"\n| ratio (useful tokens/s, medians over the seeds' runs) | value |\n|---|---|\n"
          f"| defaults: phalanx / trainer | {tps['phalanx'] / tps['trainer']:.2f}x |\n"
          f"| same math: phalanx / trainer-grouped | {tps['phalanx'] / tps['trainer-grouped']:.2f}x |")
    footer("classify", started)


# ---- table transcript ---------------------------------------------------------------------------------------
def table_transcript(a) -> None:
    started = header("transcript", a, f"--steps {a.steps_of['sft']} --smol {a.smol}")
    seed = a.seed_list[0]
    run = sft_quality_run(smol(a), a, "phalanx", "lora", seed).parent
    val = [json.loads(x)["text"] for x in (SST2 / "validation.jsonl").read_text().splitlines()[-2:]]
    turns = [f"{INSTRUCTION} {val[0]}", f"{INSTRUCTION} {val[1]}", "What is the capital of France?",
             "Write one sentence about the sea."]
    cmd = [sys.executable, "-m", "phalanx", "chat", str(run), "--temperature", "0", "--max-new-tokens", "48"]
    proc = subprocess.run(cmd, input="\n".join(turns) + "\n", capture_output=True, text=True, cwd=REPO,
                          env=runs.env(Path(a.work)))
    print(f"the sft table's phalanx LoRA run (seed {seed}, {a.steps_of['sft']} steps); stdin, one turn a line:\n")
    print("\n".join(f"    {t}" for t in turns))
    print(f"\n$ {' '.join(['phalanx', *cmd[3:]])} < turns   (exit {proc.returncode})\n\nstdout:\n```\n"
          f"{proc.stdout}\n```\nstderr:\n```\n{proc.stderr}\n```")
    footer("transcript", started)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--table", default="all", choices=["sft", "dpo", "classify", "transcript", "all"])
    p.add_argument("--work", default="", help="work folder (finished runs there are reused); default: a new one")
    p.add_argument("--repeats", type=int, help="alternating timed runs per side (sft, dpo)")
    p.add_argument("--seeds", help="seeds of the quality runs (dpo and transcript use the first)")
    p.add_argument("--steps", type=int, help="training steps of the selected table's quality runs (every "
                   "table's under --table all)")
    p.add_argument("--rate-steps", type=int, help="steps of each timed run (sft, dpo)")
    p.add_argument("--warmup", type=int, help="untimed steps at the start of each timed run")
    p.add_argument("--val", type=int, help="validation sentences for greedy accuracy and held-out pairs")
    p.add_argument("--quality", default="lora", help="sft quality runs: lora, full, or lora,full")
    p.add_argument("--smoke", action="store_true", help="every size shrunk to a check of the code paths")
    p.add_argument("--smol", default=str(SMOL), help="SmolLM2: a GGUF file or a plain folder")
    p.add_argument("--minilm", default=str(MINILM), help="all-MiniLM-L6-v2 folder")
    a = p.parse_args()
    from transformers.utils import logging

    logging.disable_progress_bar()  # this process's loads (greedy replies, the pair log-probs)
    for key, sizes in SIZES.items():
        if getattr(a, key, None) is None:
            setattr(a, key, sizes[a.smoke])
    a.steps_of = dict(STEPS[a.smoke])  # --steps: every table's under all, else the table's (transcript: sft's)
    for table in a.steps_of if a.table == "all" else [{"transcript": "sft"}.get(a.table, a.table)]:
        a.steps_of[table] = a.steps or a.steps_of[table]
    a.seed_list = [int(x) for x in a.seeds.split(",")]
    if max(a.steps_of["sft"], 2 * a.rate_steps) * GLOBAL > DPO_FROM:
        p.error(f"SFT chats must stay below the first {DPO_FROM} shuffled sentences (the DPO pairs' part)")
    a.work = a.work or tempfile.mkdtemp(prefix="real-models-")
    Path(a.work).mkdir(parents=True, exist_ok=True)
    version = runs.phalanx_version()
    tables = ["sft", "dpo", "classify", "transcript"] if a.table == "all" else [a.table]
    for table in tables:
        {"sft": table_sft, "dpo": table_dpo, "classify": table_classify, "transcript": table_transcript}[table](a)
    print(f"\n(work folder {a.work}; {' '.join(sys.argv)})")
    if runs.phalanx_version() != version:
        print(f"warning: phalanx/ changed on disk during the benchmark ({version} -> {runs.phalanx_version()})")


if __name__ == "__main__":
    main()
