"""phalanx task grpo vs TRL 1.16's GRPOTrainer (transformers generation, no vLLM) on SmolLM2-135M-Instruct with
LoRA r=16, 2 processes, 1 thread each: seconds per step split into rollout (generation, rewards, advantages) and
training, completion tokens/s, reward per step; then generation alone: phalanx's sampler against plain
`model.generate` at the same batch shape (one prompt's G rows), tokens/s.

Same on both sides: the model (the shared GGUF dequantised by phalanx into a plain folder), the prompts (the
built-in arithmetic task's first training questions, conversational), G, max_completion_length, sampling
(temperature 1, top_p 1, top_k 0), the reward (phalanx's math_answer on both), loss dapo, beta 0, group
scaling, LoRA (r 16, alpha 32, dropout 0.05, every linear of the blocks), AdamW lr 1e-5 betas 0.9/0.999 no
weight decay, constant lr, clip 1.0, fp32, one generation per step of P prompts x G completions. TRL's
defaults: the same with gradient checkpointing and bf16 as GRPOConfig defaults them (both on).

    python bench/grpo_vs_trl.py --out grpo-vs-trl.json   # 4 steps of 4 prompts x 8, 32 tokens (TRL's defaults: 2
                                                         # steps: bf16 is emulated on this CPU); ~1.5 hours
    python bench/grpo_vs_trl.py --smoke                  # 2 steps of 2 prompts x 4, 16 tokens: about 12 minutes
    --steps N / --defaults-steps N change the number of steps (the first still a warm-up; --defaults-steps 1 or
    0 leaves TRL's defaults out: at the full shape a step of theirs takes ~20 minutes here)

The first step of each side is a warm-up (left out of the medians) except under --smoke.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from vs_trl_runs import REPO, run

GGUF = REPO.parent / "shared" / "models" / "smollm2-135m-instruct-gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGETS = "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"


def base_folder(work: Path) -> Path:
    from phalanx.core.config import load_config
    from phalanx.tools.launch import resolve_pretrained

    cfg = load_config(None, [f"model.pretrained={GGUF}", f"data.cache_dir={work / 'cache'}"])
    return Path(resolve_pretrained(cfg).model.pretrained)


def write_prompts(work: Path, n: int) -> Path:
    from phalanx.data.grpo import arithmetic

    path = work / "prompts.jsonl"
    with open(path, "w") as f:
        for r in arithmetic.train()[:n]:
            f.write(json.dumps({"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}) + "\n")
    return path


def phalanx_side(a, work: Path, base: Path, data: Path) -> dict:
    out = work / "phalanx"
    run([sys.executable, "-m", "phalanx", "train", "task=grpo", f"model.pretrained={base}", f"data.train={data}",
         f"data.validation={data}", f"data.cache_dir={work / 'cache'}", "model.block_size=256", "model.lora.r=16",
         "model.lora.alpha=32", "model.lora.dropout=0.05", f"model.lora.target_modules={TARGETS}",
         f"grpo.num_generations={a.g}", f"grpo.max_completion_length={a.max_new}", "grpo.loss_type=dapo",
         f"train.global_batch_size={a.prompts}", f"train.micro_batch_size={a.prompts // 2}",
         f"train.max_steps={a.steps}", "train.lr=1e-5", "train.warmup_steps=0", "train.min_lr_ratio=1.0",
         "train.weight_decay=0.0", "train.beta1=0.9", "train.beta2=0.999", "train.grad_clip=1.0",
         "train.precision=fp32", "train.eval_every=0", "train.eval_max_samples=2", "train.log_every=1",
         "train.checkpoint_every=0", "dist.threads_per_worker=1", "log.progress=off",
         "train.memory_check=warn",  # the plan takes each of the 16 rows at model.block_size: ~4x these rows
         "--run-dir", str(out),
         "--nproc-per-node", "2"], work / "phalanx.log", work, timeout=3600)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step_time_s" in r]
    return {"step_s": [r["step_time_s"] for r in steps], "rollout_s": [r["rollout_time_s"] for r in steps],
            "generation_s": [r["time/generation_s"] for r in steps], "reward": [r["rewards/total/mean"] for r in steps],
            "completion_tokens": [r["completions/mean_length"] * a.prompts * a.g for r in steps]}


def trl_side(a, work: Path, base: Path, data: Path, defaults: bool) -> dict:
    out = work / ("trl-defaults.jsonl" if defaults else "trl.jsonl")
    steps = a.defaults_steps if defaults else a.steps
    side = str(REPO / "bench" / "grpo_trl_side.py")
    run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", side,
         "--base", str(base), "--data", str(data), "--out", str(out), "--steps", str(steps), "--prompts",
         str(a.prompts), "--g", str(a.g), "--max-new", str(a.max_new), *(["--defaults"] if defaults else [])],
        work / (out.stem + ".log"), work, timeout=3 * 3600)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    info = next(x["info"] for x in lines if "info" in x)
    ends = [x for x in lines if "time" in x]
    logs = [x["log"] for x in lines if "log" in x and "reward" in x["log"]]
    times = [info["start"]] + [x["time"] for x in ends]
    step_s = [b - e for b, e in zip(times[1:], times[:-1])]
    # transformers 5 hands on_log its values formatted (strings): read them back as numbers
    return {"step_s": step_s, "rollout_s": [x["rollout_s"] for x in ends], "reward": [float(x["reward"]) for x in logs],
            "completion_tokens": [float(x["completions/mean_length"]) * a.prompts * a.g for x in logs], "info": info}


def generation_alone(a, base: Path) -> dict:
    """Tokens/s of phalanx's sampler and of model.generate, each on one prompt's G rows, 1 thread, in turn."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from phalanx.data.grpo import arithmetic
    from phalanx.model.sampling import Sampler, Sampling

    torch.set_num_threads(1)
    tok, model = AutoTokenizer.from_pretrained(base), AutoModelForCausalLM.from_pretrained(base).eval()
    stops = [tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id]
    sampler = Sampler(model, stops, Sampling())
    sides = {"phalanx": [], "generate": []}
    for k, r in enumerate(arithmetic.train()[:a.gen_prompts]):
        ids = tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                      return_dict=False)
        ids = np.asarray(ids["input_ids"] if isinstance(ids, dict) else ids)
        t0 = time.perf_counter()
        got = sampler.generate(ids, list(range(k * a.g, (k + 1) * a.g)), a.max_new)
        sides["phalanx"].append((sum(len(x) for x in got.ids), time.perf_counter() - t0))
        x = torch.as_tensor(ids)[None].repeat(a.g, 1)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=True, temperature=1.0, top_p=1.0,
                                 top_k=0, max_new_tokens=a.max_new, eos_token_id=stops, pad_token_id=stops[0])
        new = out[:, x.shape[1]:]
        ended = torch.isin(new, torch.tensor(stops))
        lengths = torch.where(ended.any(1), ended.int().argmax(1) + 1, torch.full((a.g,), new.shape[1]))
        sides["generate"].append((int(lengths.sum()), time.perf_counter() - t0))
    return {k: {"tokens": sum(t for t, _ in v[1:]), "seconds": sum(s for _, s in v[1:]),
                "tokens_per_s": sum(t for t, _ in v[1:]) / max(sum(s for _, s in v[1:]), 1e-9)}
            for k, v in sides.items()}  # the first prompt warms up


def summary(name: str, got: dict, skip: int) -> dict:
    step, rollout = got["step_s"][skip:], got["rollout_s"][skip:]
    tokens = sum(got["completion_tokens"][skip:])
    out = {"side": name, "step_s": statistics.median(step), "rollout_s": statistics.median(rollout),
           "training_s": statistics.median(s - r for s, r in zip(step, rollout)),
           "completion_tokens_per_s": tokens / sum(step), "reward": got["reward"]}
    if "generation_s" in got:
        out["generation_s"] = statistics.median(got["generation_s"][skip:])
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default="")
    p.add_argument("--work", default="")
    p.add_argument("--steps", type=int, help="phalanx's and TRL's same-math steps (default 4; --smoke 2)")
    p.add_argument("--defaults-steps", type=int, help="TRL's defaults' steps (default 2; 0 leaves them out)")
    a = p.parse_args()
    steps, defaults_steps, a.prompts, a.g, a.max_new, a.gen_prompts = \
        (2, 2, 2, 4, 16, 3) if a.smoke else (4, 2, 4, 8, 32, 5)
    a.steps = a.steps or steps
    a.defaults_steps = defaults_steps if a.defaults_steps is None else a.defaults_steps
    work = Path(a.work or tempfile.mkdtemp(prefix="grpo-vs-trl-"))
    work.mkdir(parents=True, exist_ok=True)
    base, data = base_folder(work), write_prompts(work, a.prompts * a.steps)
    skip = 0 if a.smoke else 1  # the first step warms up
    rows = [summary("phalanx", phalanx_side(a, work, base, data), skip),
            summary("trl-same-math", trl_side(a, work, base, data, False), skip)]
    if a.defaults_steps > skip:  # (--defaults-steps 1 leaves it out: its one step would be the warm-up)
        rows.append(summary("trl-defaults", trl_side(a, work, base, data, True), skip))
    gen = generation_alone(a, base)
    print(f"\n{a.steps} steps x {a.prompts} prompts x G={a.g}, {a.max_new} tokens, 2 processes, work {work}")
    print(f"{'side':16} {'s/step':>8} {'rollout':>8} {'train':>8} {'compl tok/s':>12}  reward per step")
    for r in rows:
        print(f"{r['side']:16} {r['step_s']:8.2f} {r['rollout_s']:8.2f} {r['training_s']:8.2f} "
              f"{r['completion_tokens_per_s']:12.1f}  {[round(x, 3) for x in r['reward']]}")
    for other in rows[1:]:
        k = other["side"]
        print(f"phalanx vs {k}: {other['step_s'] / rows[0]['step_s']:.2f}x per step")
    print(f"generation alone (one prompt's {a.g} rows, 1 thread): phalanx {gen['phalanx']['tokens_per_s']:.1f} tok/s, "
          f"model.generate {gen['generate']['tokens_per_s']:.1f} tok/s")
    if a.out:
        Path(a.out).write_text(json.dumps({"rows": rows, "generation": gen, "settings": vars(a)}, indent=1))


if __name__ == "__main__":
    main()
