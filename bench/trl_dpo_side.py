"""The other side of bench/vs_trl_dpo.py: TRL 1.16's DPOTrainer, as a user would write it. Run with torchrun.

Model and tokenizer from --base (a GPT-2 whose tokenizer carries the bench's ChatML template), pairs from
--data (TRL's explicit conversational format: prompt, chosen, rejected as lists of messages). Everything
not set below stays at TRL's defaults; the bench sets what must match phalanx (AdamW lr/betas/weight decay,
warm-up + cosine to min_lr_ratio, clip 1.0, max_length, fp32, micro-batch and accumulation, beta, the loss)
and the case's switches: --precompute (precompute_ref_log_probs: no reference forward per step), --gc
on|off|default (gradient checkpointing; TRL's default is on), --lora R (peft LoRA: the reference is the
model with its adapters off), --sft-weight (loss_type [sigmoid, sft] with weights [1, w]), --seed, --save DIR
(rank 0 writes the trained model, LoRA merged, and the tokenizer: plain transformers loads it).

Each rank writes --out-RANK.jsonl: one line per optimizer step (wall time at its end; the slots and real
tokens of the micro-batches it consumed, counted on the collated batches: chosen and rejected rows), one line
per compute_loss call in training (the loss TRL backpropagates) and a last "info" line with what ran.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from hf_sides import add_trl_args, lora_config, train_counted
from trl import DPOConfig, DPOTrainer


class CountingCollator:
    """Wraps TRL's collator: (slots, real tokens) of each batch, in the order made."""

    def __init__(self, collate):
        self.collate, self.batches = collate, []

    def __call__(self, features):
        batch = self.collate(features)
        self.batches.append((batch["input_ids"].numel(), int(batch["attention_mask"].sum())))
        return batch


class ProbedDPOTrainer(DPOTrainer):
    """DPOTrainer unchanged but for a record of each training compute_loss call."""

    probes: list

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if model.training:
            value = loss[0] if isinstance(loss, tuple) else loss
            self.probes.append({"loss": float(value.detach().double()),
                                "pairs": int(inputs["input_ids"].shape[0] // 2)})
        return loss


class StepClock(TrainerCallback):
    """Wall time at the end of each optimizer step; step i consumed batches (i-1)*accum .. i*accum-1 (the
    collator also ran the precompute pass first: those batches are skipped)."""

    def __init__(self, trainer, collator, accum: int, out: str):
        self.trainer, self.collator, self.accum, self.out = trainer, collator, accum, out
        self.times, self.first_batch, self.began = [], 0, 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self.first_batch, self.began = len(self.collator.batches), time.time()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.time())

    def on_train_end(self, args, state, control, **kwargs):
        t, model = self.trainer, self.trainer.model
        with open(self.out, "w") as f:
            for step, at in enumerate(self.times, start=1):
                lo = self.first_batch + (step - 1) * self.accum
                counts = self.collator.batches[lo: lo + self.accum]
                f.write(json.dumps({"step": step, "time_s": at, "tokens": sum(c[0] for c in counts),
                                    "useful": sum(c[1] for c in counts)}) + "\n")
            for k, p in enumerate(t.probes):
                f.write(json.dumps({"call": k, **p}) + "\n")
            f.write(json.dumps({"info": True, "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                                "param_dtype": str(next(model.parameters()).dtype),
                                "gradient_checkpointing": bool(getattr(model, "is_gradient_checkpointing", False)),
                                "ref_model": t.ref_model is not None, "precompute": t.precompute_ref_logps,
                                "attn": getattr(model.config, "_attn_implementation", "?"),
                                "train_begin_s": self.began,
                                "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}) + "\n")


def main() -> None:
    p = argparse.ArgumentParser()
    add_trl_args(p, "pairs, JSONL (prompt, chosen, rejected)", lr=1e-4, weight_decay=0.0)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--sft-weight", type=float, default=0.0)
    p.add_argument("--precompute", action="store_true", help="precompute_ref_log_probs=True")
    p.add_argument("--lora", type=int, default=0, help="peft LoRA rank (0 = full fine-tuning)")
    p.add_argument("--save", default="", help="write the trained model (LoRA merged) and tokenizer here")
    p.add_argument("--out", required=True)
    p.add_argument("--work", required=True)
    a = p.parse_args()
    gc = {} if a.gc == "default" else {"gradient_checkpointing": a.gc == "on"}
    loss = {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, a.sft_weight]} if a.sft_weight else {}
    args = DPOConfig(
        output_dir=a.work, max_steps=a.steps, per_device_train_batch_size=a.micro,
        gradient_accumulation_steps=a.accum, learning_rate=a.lr, warmup_steps=a.warmup,
        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": a.min_lr_ratio},
        weight_decay=a.weight_decay, adam_beta1=0.9, adam_beta2=0.95, max_grad_norm=1.0, bf16=False,
        use_cpu=not torch.cuda.is_available(), ddp_backend="gloo", seed=a.seed, max_length=a.max_length, beta=a.beta,
        precompute_ref_log_probs=a.precompute, logging_steps=10_000, save_strategy="no", report_to=[],
        disable_tqdm=True, **gc, **loss)
    tok = AutoTokenizer.from_pretrained(a.base)
    model = AutoModelForCausalLM.from_pretrained(a.base, dtype=torch.float32)
    data = load_dataset("json", data_files=a.data, split="train")
    trainer = ProbedDPOTrainer(model=model, args=args, train_dataset=data, processing_class=tok,
                               peft_config=lora_config(a.lora, 16, 0.0))
    train_counted(trainer, tok, a, CountingCollator, StepClock)


if __name__ == "__main__":
    main()
