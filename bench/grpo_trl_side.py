"""The other side of bench/grpo_vs_trl.py: TRL 1.16's GRPOTrainer with transformers generation (no vLLM), as a
user would write it. Run with torchrun.

Model from --base (a plain transformers folder with its tokenizer and chat template), prompts from --data
(TRL's conversational format: "prompt" a list of messages, "answer" the reference). The reward is phalanx's
math_answer (the same function on both sides). Everything not set below stays at TRL's defaults; the bench
sets what must match phalanx (G, lengths, sampling, the loss, LoRA, lr, batch) and, with --defaults, leaves
gradient checkpointing and bf16 at TRL's defaults (both on).

Rank 0 writes --out: one line per optimizer step (wall time at its end, the seconds spent in
_generate_and_score_completions: generation, rewards, advantages), TRL's logged metrics, and an "info" line.
"""
from __future__ import annotations

import argparse
import json
import time

import torch.distributed as dist
from datasets import load_dataset
from peft import LoraConfig
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from phalanx.tasks.grpo_rewards import math_answer

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class TimedGRPO(GRPOTrainer):
    """GRPOTrainer timing its rollout (generation + rewards + advantages) per call."""
    rollout_s: list = []

    def _generate_and_score_completions(self, inputs):
        t0 = time.perf_counter()
        out = super()._generate_and_score_completions(inputs)
        TimedGRPO.rollout_s.append(time.perf_counter() - t0)
        return out


class Steps(TrainerCallback):
    def __init__(self, out: str):
        self.out, self.lines = out, []

    def on_step_end(self, args, state, control, **kw):
        self.lines.append({"step": state.global_step, "time": time.time(), "rollout_s": sum(TimedGRPO.rollout_s)})
        TimedGRPO.rollout_s.clear()

    def on_log(self, args, state, control, logs=None, **kw):
        self.lines.append({"log": logs, "step": state.global_step})


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("--base", "--data", "--out"):
        p.add_argument(name, required=True)
    for name, default in (("--steps", 4), ("--prompts", 4), ("--g", 8), ("--max-new", 32), ("--seed", 0)):
        p.add_argument(name, type=int, default=default)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--defaults", action="store_true")
    a = p.parse_args()
    world = int(__import__("os").environ.get("WORLD_SIZE", "1"))
    per_device = a.prompts * a.g // world  # TRL counts completions
    extra = {} if a.defaults else {"gradient_checkpointing": False, "bf16": False}
    cfg = GRPOConfig(output_dir=a.out + ".trainer", max_steps=a.steps, per_device_train_batch_size=per_device,
                     gradient_accumulation_steps=1, num_generations=a.g, max_completion_length=a.max_new,
                     temperature=1.0, top_p=1.0, top_k=0, loss_type="dapo", beta=0.0, scale_rewards="group",
                     learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                     max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[], seed=a.seed,
                     use_cpu=True, dataloader_num_workers=0, **extra)
    data = load_dataset("json", data_files=a.data, split="train")
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=TARGETS, task_type="CAUSAL_LM")
    steps = Steps(a.out)
    trainer = TimedGRPO(model=a.base, reward_funcs=[math_answer("answer")], args=cfg, train_dataset=data,
                        peft_config=lora, callbacks=[steps])
    t0 = time.time()
    trainer.train()
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(a.out, "w") as f:
            for line in steps.lines:
                f.write(json.dumps(line) + "\n")
            f.write(json.dumps({"info": {"world_size": world, "per_device": per_device, "start": t0,
                                         "gradient_checkpointing": cfg.gradient_checkpointing, "bf16": cfg.bf16}})
                    + "\n")


if __name__ == "__main__":
    main()
