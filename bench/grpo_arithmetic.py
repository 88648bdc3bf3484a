"""What GRPO teaches on this machine: examples/grpo.yaml (SmolLM2-135M-Instruct, LoRA r=16, the built-in
arithmetic task) for --steps steps per seed, 2 processes; greedy accuracy (math_answer) on the task's fixed
200 held-out questions before (a run with lr 0: the base model, LoRA's B starting at 0) and after; then GSM8K
for a few steps, to show its format runs end to end (reward per step, accuracy on a few test questions).

    python bench/grpo_arithmetic.py [--seeds 0,1,2] [--steps 30] [--prompts 8] [--lr 3e-5] [--temperature 1.0]
                                    [--eval-samples 200]
                                    [--gsm8k-steps 3] [--work DIR]

--prompts is train.global_batch_size (prompts per step, each with grpo.num_generations = 8 completions), --lr
train.lr and --temperature grpo.temperature (sampling in training; evaluation is greedy); their defaults are
examples/grpo.yaml's. --before ACC skips the base model's evaluation (its figure from an earlier run).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from vs_trl_runs import REPO, run

GSM8K = REPO.parent / "shared" / "data" / "gsm8k"


def train(work: Path, name: str, *overrides: str) -> list[dict]:
    out = work / name
    run([sys.executable, "-m", "phalanx", "train", str(REPO / "examples" / "grpo.yaml"),
         f"data.cache_dir={work / 'cache'}", "log.progress=off", "train.log_every=1", *overrides,
         "--run-dir", str(out), "--nproc-per-node", "2"], work / f"{name}.log", work, timeout=4 * 3600)
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def last(rows: list[dict], key: str):
    return next((r[key] for r in reversed(rows) if key in r), None)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--eval-samples", type=int, default=200)
    p.add_argument("--before", type=float, default=None)
    p.add_argument("--gsm8k-steps", type=int, default=3)
    p.add_argument("--work", default="")
    a = p.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="grpo-arithmetic-"))
    work.mkdir(parents=True, exist_ok=True)
    common = ["train.checkpoint_every=0", "train.eval_every=0", f"train.global_batch_size={a.prompts}",
              f"train.micro_batch_size={max(1, a.prompts // 4)}", f"train.eval_max_samples={a.eval_samples}"]
    before = a.before if a.before is not None else \
        last(train(work, "before", *common, "train.lr=0", "train.max_steps=1"), "eval/accuracy")
    print(f"held-out accuracy before: {before:.3f}", flush=True)
    for seed in a.seeds.split(","):
        rows = train(work, f"seed{seed}", *common, f"train.seed={seed}", f"train.max_steps={a.steps}",
                     f"train.lr={a.lr}", f"grpo.temperature={a.temperature}")
        steps = [r for r in rows if "rewards/total/mean" in r]
        print(f"seed {seed}: after {a.steps} steps {last(rows, 'eval/accuracy'):.3f}; reward per step "
              f"{[round(r['rewards/total/mean'], 3) for r in steps]}; {sum(r['step_time_s'] for r in steps) / 60:.1f} "
              f"min of steps", flush=True)
    if not a.gsm8k_steps:
        return
    rows = train(work, "gsm8k", *common[:4], f"train.lr={a.lr}", f"grpo.temperature={a.temperature}",
                 f"data.train={GSM8K / 'train.jsonl'}",
                 f"data.validation={GSM8K / 'test.jsonl'}", "grpo.prompt_field=question",
                 "grpo.max_completion_length=256", "model.block_size=512", "train.eval_max_samples=16",
                 "train.activation_checkpointing=full",  # G x 512-token rows: ~16 GB per rank without it
                 f"train.max_steps={a.gsm8k_steps}")
    steps = [r for r in rows if "rewards/total/mean" in r]
    print(f"gsm8k: reward per step {[round(r['rewards/total/mean'], 3) for r in steps]}, completion length "
          f"{[round(r['completions/mean_length'], 1) for r in steps]}, accuracy on 16 test questions "
          f"{last(rows, 'eval/accuracy')}")


if __name__ == "__main__":
    main()
