"""phalanx chat SFT vs TRL's SFTTrainer: defaults, the same math, the first-step loss, LoRA vs full.

Same machine, 2 processes a side (TRL through torchrun + bench/trl_side.py: `accelerate launch --cpu
--num_processes 2` silently runs one process on this machine — the world size each side ran with is
read back and printed), 1 thread each. Same model: a 4 x 256 GPT-2 (BPE 4096 trained by phalanx on its
built-in corpus, 256 positions) whose tokenizer gets phalanx's ChatML template (`ensure_template`, with
{% generation %} markers) before save_pretrained, so both sides render and mask with one template. Same
data: the built-in conversations (stdlib docstrings) that fit in 256 tokens, as JSONL. Same optimizer:
AdamW lr 3e-4, betas 0.9/0.95, weight decay 0.1 (matrices and embeddings), linear warm-up then cosine to
0.1 x lr, clip 1.0, fp32 on both. Same max length 256. Global batch: 16 conversations (micro 4 x 2
processes x accumulation 2) when padded; packed rows are sized to carry about as many real tokens
(micro rows x 2 x 2).
Sides, run alternately (each repeat runs every side once, in turn):
  phalanx         its defaults: packed rows, loss on assistant tokens
  phalanx-lora    the same with model.lora.r=16
  trl-defaults    TRL's defaults: padded, random order, loss on every token, gradient checkpointing on
  trl-same        the same math as phalanx: assistant_only_loss, and packing (TRL's bfd, padding-free)
                  when the packing check shows TRL's packed per-conversation loss equals the unpacked one
                  here; otherwise padded + group_by_length (then phalanx-padded joins: data.packing=false)
  phalanx-padded, trl-grouped  (optional, --sides) the padded pair: data.packing=false vs assistant-only,
                  group_by_length
Useful tokens/s = real (non-pad) tokens/s; supervised tokens/s = tokens in that side's loss (TRL's counted
per batch; phalanx's = its useful tokens x the supervised fraction of the data); packing efficiency =
real tokens / token slots computed; peak RSS per rank = VmHWM of each rank's process (sampled from /proc).
Rates from wall clocks after the first --warmup steps; medians over --repeats runs.

    python bench/vs_trl.py [--repeats 3] [--steps 25] [--warmup 5] [--sides ...]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from vs_trl_runs import (BLOCK, checkpoint_optimizer, first_step, lora_at_gpt2_small, phalanx_cmd,
                         phalanx_effective, phalanx_rate, phalanx_version, run, setup, trl_cmd, trl_rate)

PADDED_MICRO, ACCUM, NPROC = 4, 2, 2  # padded global batch: 4 x 2 x 2 = 16 conversations
TARGETS = {"defaults": 1.5, "same": 1.0, "lora_state": 0.05}


def sides_for(packing_ok: bool, chosen: str) -> list[str]:
    if chosen:
        return chosen.split(",")
    base = ["phalanx", "trl-defaults", "trl-same", "phalanx-lora"]
    return base if packing_ok else ["phalanx", "phalanx-padded", "trl-defaults", "trl-same", "phalanx-lora"]


def side_spec(side: str, packing_ok: bool, rows_micro: int) -> dict:
    """What a side runs: its tool, batch shape and switches."""
    packed = {"micro": rows_micro, "unit": "rows"}
    padded = {"micro": PADDED_MICRO, "unit": "conversations"}
    return {
        "phalanx": {"tool": "phalanx", **packed, "extra": []},
        "phalanx-lora": {"tool": "phalanx", **packed, "extra": ["model.lora.r=16"]},
        "phalanx-padded": {"tool": "phalanx", **padded, "extra": ["data.packing=false"]},
        "trl-defaults": {"tool": "trl", **padded, "extra": []},
        "trl-same": {"tool": "trl", **(packed if packing_ok else padded),
                     "extra": ["--assistant-only", "--gc", "off", *(["--packing"] if packing_ok else ["--group"])]},
        "trl-grouped": {"tool": "trl", **padded, "extra": ["--assistant-only", "--gc", "off", "--group"]},
    }[side]


def run_side(side: str, spec: dict, s: dict, a, k: int) -> dict:
    out = s["work"] / f"{side}-{k}"
    if spec["tool"] == "phalanx":
        rss = run(phalanx_cmd(s, out, a.steps, spec["micro"], spec["micro"] * NPROC * ACCUM, NPROC, a.log_every,
                              spec["extra"]), Path(f"{out}.log"), s["work"])
        r = phalanx_rate(out, a.warmup, s["supervised_fraction"])
        r.update(phalanx_effective(out, s))
    else:
        rss = run(trl_cmd(s, out, a.steps, spec["micro"], ACCUM, NPROC, spec["extra"]), Path(f"{out}.log"), s["work"])
        r = trl_rate(out, NPROC, a.warmup)
    r["rss_mb"] = [rss.get(rank, float("nan")) for rank in range(NPROC)]
    r["private_mb"] = [rss.private.get(rank, float("nan")) for rank in range(NPROC)]
    if r["world"] != NPROC:
        raise SystemExit(f"{side} ran with world size {r['world']}, not {NPROC}")
    return r


def median_of(runs: list[dict]) -> dict:
    keys = ("useful_tps", "supervised_tps", "step_s", "efficiency", "tokens_per_step")
    med = {m: statistics.median(r[m] for r in runs) for m in keys}
    for mem in ("rss_mb", "private_mb"):
        med[mem] = [statistics.median(r[mem][i] for r in runs) for i in range(NPROC)]
    med["split"] = {m: statistics.median(r["split"][m] for r in runs) for m in runs[0].get("split", {})}
    return {**runs[-1], **med}


def print_main(med: dict, results: dict) -> None:
    print("\n| side | useful tok/s (median) | runs | supervised tok/s | step s | packing eff. | real tok/step "
          "| peak RSS MB r0 / r1 | precision | attention | grad. ckpt | world |\n" + "|---" * 12 + "|")
    for side, m in med.items():
        runs = ", ".join(f"{r['useful_tps']:.0f}" for r in results[side])
        print(f"| {side} | {m['useful_tps']:.0f} | {runs} | {m['supervised_tps']:.0f} | {m['step_s']:.3f} "
              f"| {m['efficiency']:.3f} | {m['tokens_per_step']:.0f} | {m['rss_mb'][0]:.0f} / {m['rss_mb'][1]:.0f} "
              f"| {m['precision']} | {m['attn']} | {'on' if m['gc'] else 'off'} | {m['world']} |")


def print_ratios(med: dict, results: dict, same: str, defaults_loss: str = "TRL's loss covers every token") -> None:
    """Ratios of medians, and paired: the median over repeats of the ratio within each repeat (the two
    sides of a repeat ran minutes apart, so a drifting shared machine moves both)."""
    print("\n| ratio (phalanx / TRL) | of medians | paired (per repeat) | target |\n|---|---|---|---|")

    def row(name, ours, theirs, key, target=None):
        if ours in med and theirs in med:
            pairs = [o[key] / t[key] for o, t in zip(results[ours], results[theirs])]
            print(f"| {name} | {med[ours][key] / med[theirs][key]:.2f}x | {statistics.median(pairs):.2f}x "
                  f"({', '.join(f'{v:.2f}' for v in pairs)}) | {f'>= {target}x' if target else ''} |")

    row("defaults: phalanx / trl-defaults, useful tok/s", "phalanx", "trl-defaults", "useful_tps", TARGETS["defaults"])
    row(f"defaults: supervised tok/s ({defaults_loss})", "phalanx", "trl-defaults", "supervised_tps")
    row(f"same math: phalanx / trl-same ({same}), useful tok/s", "phalanx", "trl-same", "useful_tps", TARGETS["same"])
    row("same math: supervised tok/s", "phalanx", "trl-same", "supervised_tps")
    row("padded same math: phalanx-padded / trl-grouped, useful tok/s", "phalanx-padded", "trl-grouped", "useful_tps")
    row("padded: phalanx-padded / trl-same (grouped), useful tok/s", "phalanx-padded", "trl-same", "useful_tps")
    row("packed vs padded phalanx, useful tok/s", "phalanx", "phalanx-padded", "useful_tps")
    for ours, theirs in (("phalanx", "trl-defaults"), ("phalanx", "trl-same")):
        if ours in med and theirs in med:
            rss = [o / t for o, t in zip(med[ours]["rss_mb"], med[theirs]["rss_mb"])]
            print(f"| peak RSS per rank: {ours} / {theirs} | {' / '.join(f'{v:.2f}x' for v in rss)} | | |")


def print_lora(med: dict, results: dict) -> None:
    if "phalanx" not in med or "phalanx-lora" not in med:
        return
    full, lora = results["phalanx"][-1], results["phalanx-lora"][-1]
    print("\n| phalanx (parameters trained = AdamW moments in the checkpoint) | parameters trained | optimizer state "
          "bytes | median step s |\n|---|---|---|---|")
    for name, r, m in (("full fine-tuning", full, med["phalanx"]), ("LoRA r=16", lora, med["phalanx-lora"])):
        print(f"| {name} | {r['trained']:,} | {r['optimizer_bytes']:,} | {m['step_s']:.3f} |")
    print(f"| LoRA / full | {lora['trained'] / full['trained']:.2%} | "
          f"{lora['optimizer_bytes'] / full['optimizer_bytes']:.2%} (target < {TARGETS['lora_state']:.0%}) | "
          f"{med['phalanx-lora']['step_s'] / med['phalanx']['step_s']:.2f}x |")
    trained, full_ft = lora_at_gpt2_small(16)
    print(f"| the same LoRA on GPT-2 small's shape (computed, not run) | {trained:,} vs {full_ft:,} | "
          f"{trained / full_ft:.2%} of full's | |")
    if lora["trainable"] != lora["trained"]:
        print(f"\nnote: phalanx's summary.json says trainable_parameters={lora['trainable']} for the LoRA run "
              f"({lora['trained']:,} trained): it is counted after the export merged the adapters in place")


def print_split(med: dict) -> None:
    print("\n| phalanx side | data s | sync s | fwd+bwd s | optimizer s | step s (median) |\n|---|---|---|---|---|---|")
    for side, m in med.items():
        if m.get("split"):
            sp = m["split"]
            print(f"| {side} | {sp['data']:.4f} | {sp['sync']:.4f} | {sp['fwd_bwd']:.4f} | {sp['optimizer']:.4f} "
                  f"| {m['step_s']:.3f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--warmup", type=int, default=5, help="steps not timed")
    p.add_argument("--log-every", type=int, default=5, help="phalanx's train.log_every (its timing windows)")
    p.add_argument("--sides", default="", help="comma-separated sides (default: see the docstring)")
    p.add_argument("--skip-first-step", action="store_true")
    a = p.parse_args()
    started, version = time.time(), phalanx_version()
    s = setup(Path(tempfile.mkdtemp(prefix="phalanx-vs-trl-")), PADDED_MICRO * NPROC * ACCUM, NPROC * ACCUM)
    checks = s["checks"]
    pk = checks["packing"]
    packing_ok = pk["max_abs_diff"] <= 1e-5 and pk["control_max_abs_diff"] > 1e-3
    print(f"packing check (TRL bfd packing, {pk['attn']}, {pk['examples']} conversations in {pk['rows']} rows, "
          f"micro-batches of 2 rows): max |packed - alone| per-conversation loss {pk['max_abs_diff']:.2e}; negative "
          f"control (no position restart) {pk['control_max_abs_diff']:.2e} -> TRL packing "
          f"{'is' if packing_ok else 'is NOT'} the same math here")
    mk = checks["mask"]
    print(f"mask check: {mk['conversations']} conversations; token ids differ in {mk['ids_differ']}; TRL's "
          f"assistant_only_loss labels differ from phalanx's mask in {mk['mask_differ']} ({mk['mask_tokens_differ']} "
          f"tokens); supervised fraction {mk['supervised_fraction']:.4f}")
    print(f"batches: padded {PADDED_MICRO * NPROC * ACCUM} conversations/step (mean {s['mean_len']:.1f} tokens); "
          f"packed {s['rows_micro'] * NPROC * ACCUM} rows/step (phalanx packing efficiency {s['pack_eff']:.3f})",
          flush=True)
    if not a.skip_first_step:
        first_step(s, packing_ok, NPROC)
    sides = sides_for(packing_ok, a.sides)
    specs = {side: side_spec(side, packing_ok, s["rows_micro"]) for side in sides}
    results: dict = {}
    for k in range(a.repeats):
        for side in sides:
            r = run_side(side, specs[side], s, a, k)
            results.setdefault(side, []).append(r)
            print(f"{side} run {k}: {r['useful_tps']:.0f} useful tok/s, {r['supervised_tps']:.0f} supervised tok/s, "
                  f"{r['step_s']:.3f} s/step, eff {r['efficiency']:.3f}, RSS {r['rss_mb']}", flush=True)
    med = {side: median_of(runs) for side, runs in results.items()}
    for side in ("phalanx", "phalanx-lora"):
        if side in results:
            last = results[side][-1]
            last["optimizer_bytes"], last["trained"] = checkpoint_optimizer(s["work"] / f"{side}-{a.repeats - 1}")
    print_main(med, results)
    print_ratios(med, results, "packed" if packing_ok else "padded, group_by_length")
    print_lora(med, results)
    print_split(med)
    print(f"\n({NPROC} processes x 1 thread a side on a {Path('/proc/cpuinfo').read_text().count('processor')}-core "
          f"machine shared with other work; median of {a.repeats} alternating runs of {a.steps} steps, first "
          f"{a.warmup} untimed; block {BLOCK}; {(time.time() - started) / 60:.1f} min in all; work folder {s['work']}; "
          f"{' '.join(sys.argv)}; phalanx {version})")
    if phalanx_version() != version:
        print(f"warning: phalanx/ changed on disk during the benchmark ({version} -> {phalanx_version()}): "
              f"its runs did not all measure the same code")


if __name__ == "__main__":
    main()
