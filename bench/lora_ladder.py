"""LoRA on models larger than one device: a ladder of Llama-shaped bf16 bases (width 2048, more layers per
rung), chat fine-tuning with LoRA for 3 steps on 2 processes, each run under a cgroup memory limit, for three
ways to hold the frozen base:

    a  ddp, fp32 base         every rank holds the whole base upcast to fp32 (phalanx before issue 26)
    b  ddp, 16-bit base       every rank holds the whole base in its bf16 (model.base_dtype=auto, bf16 compute)
    c  fsdp, 16-bit base      each rank holds its rows of the bf16 base (+ train.activation_checkpointing=full)

A configuration "can" train a size when its run completes the steps (the issue's rule); whether the end of the
run (final checkpoint, merged export) completed too is its own column.
The bases are random bf16 checkpoints written file by file (one block per file, and an index), so the
generator never holds a model. Per rung: parameters, per-rank private peak (RssAnon sampled every 0.05 s),
the memory plan's figure, median step time. A configuration stops at its first failure.

    python bench/lora_ladder.py [--sizes 0.8,1.0,1.25,...] [--configs a,b,c] [--limit-gb 12] [--steps 3]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from big_models import per_rank, report, run_limited

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
WIDTH, FFN, VOCAB = 2048, 5632, 4096
CONFIGS = {"a ddp, fp32 base": ["train.strategy=ddp", "model.base_dtype=fp32"],
           "b ddp, bf16 base": ["train.strategy=ddp", "model.base_dtype=auto"],
           "c fsdp, bf16 base + AC": ["train.strategy=fsdp", "model.base_dtype=auto",
                                      "train.activation_checkpointing=full"]}


def layers_for(billions: float) -> int:
    per_layer = 4 * WIDTH * WIDTH + 3 * WIDTH * FFN + 2 * WIDTH
    return max(1, round((billions * 1e9 - 2 * VOCAB * WIDTH) / per_layer))


def write_base(folder: Path, layers: int, tokenizer: Path) -> int:
    """A random bf16 Llama base, one file per block (never the whole model in memory); its parameters."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    folder.mkdir(parents=True, exist_ok=True)
    LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=FFN, num_hidden_layers=layers,
                num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=256,
                tie_word_embeddings=False, dtype="bfloat16").save_pretrained(folder)
    shapes = {"self_attn.q_proj.weight": (WIDTH, WIDTH), "self_attn.k_proj.weight": (WIDTH, WIDTH),
              "self_attn.v_proj.weight": (WIDTH, WIDTH), "self_attn.o_proj.weight": (WIDTH, WIDTH),
              "mlp.gate_proj.weight": (FFN, WIDTH), "mlp.up_proj.weight": (FFN, WIDTH),
              "mlp.down_proj.weight": (WIDTH, FFN), "input_layernorm.weight": (WIDTH,),
              "post_attention_layernorm.weight": (WIDTH,)}
    g = torch.Generator().manual_seed(0)
    files = [{"model.embed_tokens.weight": (VOCAB, WIDTH), "model.norm.weight": (WIDTH,),
              "lm_head.weight": (VOCAB, WIDTH)}] + \
        [{f"model.layers.{i}.{k}": v for k, v in shapes.items()} for i in range(layers)]
    weight_map, total = {}, 0
    for k, file in enumerate(files):
        name = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
        tensors = {key: (torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=g) * 0.02)
                   .to(torch.bfloat16) for key, shape in file.items()}
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.numel() for t in tensors.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for f in tokenizer.glob("tokenizer*"):
        shutil.copy(f, folder / f.name)
    return total


def tokenizer(work: Path) -> Path:
    from transformers import PreTrainedTokenizerFast

    sys.path.insert(0, str(REPO))
    from phalanx.data import tokenizer as toks

    out = work / "tokenizer"
    if not out.exists():
        tok = PreTrainedTokenizerFast(tokenizer_object=toks.train_bpe([DATA.read_text()[:300_000]], VOCAB),
                                      **toks.SPECIALS["bpe"])
        tok.save_pretrained(out)
    return out


def conversations(work: Path) -> Path:
    path = work / "talk.jsonl"
    lines = [line for line in DATA.read_text().splitlines() if line.strip()][:2000]
    with open(path, "w") as f:
        for i in range(0, 1900, 2):
            f.write(json.dumps({"messages": [{"role": "user", "content": lines[i]},
                                             {"role": "assistant", "content": lines[i + 1]}]}) + "\n")
    return path


def run_case(work: Path, base: Path, name: str, extra: list[str], args) -> dict:
    run = work / "runs" / name[0]
    shutil.rmtree(run, ignore_errors=True)
    cmd = [sys.executable, "-m", "phalanx", "train", "task=chat", f"data.train={work / 'talk.jsonl'}",
           f"data.cache_dir={work / 'cache'}", f"model.pretrained={base}", "model.lora.r=16",
           "train.precision=bf16", "model.block_size=64", "train.micro_batch_size=1", "train.global_batch_size=2",
           f"train.max_steps={args.steps}", "train.log_every=1", "train.eval_every=0", "train.eval_max_samples=2",
           "train.warmup_steps=1", "log.progress=off", "resume=never", "train.memory_check=warn",
           "data.max_dropped_fraction=1.0", "--run-dir", str(run), "--nproc-per-node", "2", *extra]
    done = run_limited(cmd, "phalanx-lora-ladder", args.limit_gb)
    out, peaks, planned = done.out, done.peaks, done.planned_gb
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] \
        if (run / "metrics.jsonl").exists() else []
    times = [m["step_time_s"] for m in metrics if "step_time_s" in m and m.get("step", 0) > 1]
    steps = max((m["step"] for m in metrics if "loss" in m and "event" not in m), default=0)
    failed = done.code != 0
    why = next((line for line in out.splitlines()[::-1] if "phalanx:" in line), "")[:160] if failed else ""
    shutil.rmtree(run, ignore_errors=True)
    # "can train" = the steps completed; whether the end of the run (checkpoint, merged export) did too is "ok"
    return {"config": name, "ok": not failed, "trained": steps >= args.steps, "steps_done": steps, "why": why,
            "wall_s": round(done.seconds, 1),
            "private_peak_gb": [round(peaks[r] / 2 ** 30, 2) for r in sorted(peaks) if r >= 0],
            "planned_gb": planned, "step_s": statistics.median(times) if times else None}


def table(rows: list[dict]) -> str:
    lines = ["| config | size (B) | parameters | 3 steps | whole run | private peak GB per rank | planned GB | "
             "plan / peak | step s | note |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        peak = max(r["private_peak_gb"], default=0)
        ratio = f"{r['planned_gb'] / peak:.2f}" if r["ok"] and peak and r["planned_gb"] else "-"
        step = f"{r['step_s']:.1f}" if r["step_s"] else "-"
        ok, trained = ("yes" if r["ok"] else "NO"), ("yes" if r["trained"] else f"NO ({r['steps_done']})")
        lines.append(f"| {r['config']} | {r['size_b']} | {r['parameters'] / 1e9:.2f} B | {trained} | {ok} | "
                     f"{per_rank(r['private_peak_gb'])} | {r['planned_gb'] or '-'} | {ratio} | "
                     f"{step} | {r['why']} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="0.8,1.0,1.25,1.6,2.0,2.5,3.1,3.9,4.8")
    p.add_argument("--configs", default="a,b,c", help="letters of the configurations to run")
    p.add_argument("--limit-gb", type=float, default=12.0, help="memory limit of each run (launcher + workers)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--work", default=None)
    args = p.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="phalanx-lora-ladder-"))
    work.mkdir(parents=True, exist_ok=True)
    tok, _ = tokenizer(work), conversations(work)
    wanted = {name: extra for name, extra in CONFIGS.items() if name[0] in args.configs.split(",")}
    failed: set[str] = set()
    rows = []
    for size in [float(s) for s in args.sizes.split(",")]:
        todo = {n: e for n, e in wanted.items() if n not in failed}
        if not todo:
            break
        base = work / "base"
        shutil.rmtree(base, ignore_errors=True)
        parameters = write_base(base, layers_for(size), tok)
        for name, extra in todo.items():
            r = {**run_case(work, base, name, extra, args), "size_b": size, "parameters": parameters}
            rows.append(r)
            print(json.dumps(r), flush=True)
            if not r["trained"]:
                failed.add(name)
    shutil.rmtree(work / "base", ignore_errors=True)
    report(work / "lora_ladder.json", rows, table, f"LoRA r=16, chat, block 64, micro-batch 1, 2 processes, bf16 "
           f"compute, {args.steps} steps, limit {args.limit_gb} GB per run, {os.cpu_count()} cores shared with other "
           f"work; results in {work}")


if __name__ == "__main__":
    main()
