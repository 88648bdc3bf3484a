"""The other side of bench/vs_trl.py: TRL's SFTTrainer, as a user would write it. Run with torchrun.

Model and tokenizer from --base (a GPT-2 saved with save_pretrained whose tokenizer already carries
phalanx's ChatML template with {% generation %} markers: both sides render and mask with the same
template; or a real model with its own template), conversations from --data (messages format, or TRL's
conversational prompt-completion format: then the loss is on the completion, TRL's default for it).
Everything not set below stays at TRL's defaults; the bench sets what must match phalanx (AdamW lr/betas/
weight decay, warm-up + cosine to min_lr_ratio, clip 1.0, max_length = phalanx's block size, fp32,
micro-batch and accumulation) and the case's switches: --assistant-only (assistant_only_loss), --packing
(TRL's best-fit-decreasing packing, padding-free), --group (train_sampling_strategy="group_by_length"),
--gc on|off|default (gradient checkpointing; TRL's default is on), --lora R (a peft LoraConfig with r=R,
--lora-alpha, --lora-dropout, every linear layer but the head: phalanx's model.lora defaults), --seed,
--save DIR (rank 0 writes the trained model, LoRA merged, and the tokenizer: plain transformers loads it).

Each rank writes --out-RANK.jsonl: one line per optimizer step (wall time at its end; the tokens, real
tokens and supervised tokens of the micro-batches it consumed, counted on the collated batches), one line
per compute_loss call (the loss TRL backpropagates, for the first-step comparison) and a last "info" line
with what actually ran: world size, parameter dtype and autocast, attention implementation, gradient
checkpointing, optimizer, number of training rows.
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
from trl import SFTConfig, SFTTrainer


class CountingCollator:
    """Wraps TRL's collator: (slots, real tokens, supervised tokens) of each batch, in the order made."""

    def __init__(self, collate):
        self.collate, self.batches = collate, []

    def __call__(self, features):
        batch = self.collate(features)
        ids = batch["input_ids"]
        if "attention_mask" in batch:
            real = int(batch["attention_mask"].sum())
        elif "cu_seq_lens_q" in batch:  # padding-free: one flat row, its sequences end at cu_seq_lens[-1]
            real = int(batch["cu_seq_lens_q"][-1])
        else:
            real = ids.numel()
        supervised = int((batch["labels"][..., 1:] != -100).sum())  # what TRL's loss counts
        self.batches.append((ids.numel(), real, supervised))
        return batch


class ProbedSFTTrainer(SFTTrainer):
    """SFTTrainer unchanged but for a record of each compute_loss call (the loss it returns, whether
    autocast is on) — the math is TRL's own."""

    probes: list

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if model.training:
            value = loss[0] if isinstance(loss, tuple) else loss
            self.probes.append({"loss": float(value.detach().double()), "autocast": torch.is_autocast_enabled("cpu"),
                                "dtype": str(value.dtype), "num_items": None if num_items_in_batch is None
                                else float(num_items_in_batch)})
        return loss


class StepClock(TrainerCallback):
    """Wall time at the end of each optimizer step; step i consumed batches (i-1)*accum .. i*accum-1."""

    def __init__(self, trainer: ProbedSFTTrainer, collator: CountingCollator, accum: int, out: str):
        self.trainer, self.collator, self.accum, self.out = trainer, collator, accum, out
        self.times, self.logged, self.gc = [], {}, None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.gc = bool(getattr(self.trainer.model, "is_gradient_checkpointing", False))

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.time())

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.logged[state.global_step] = logs["loss"]

    def on_train_end(self, args, state, control, **kwargs):
        t = self.trainer
        model = t.model
        with open(self.out, "w") as f:
            for step, at in enumerate(self.times, start=1):
                counts = self.collator.batches[(step - 1) * self.accum: step * self.accum]
                f.write(json.dumps({"step": step, "time_s": at, "tokens": sum(c[0] for c in counts),
                                    "useful": sum(c[1] for c in counts), "supervised": sum(c[2] for c in counts),
                                    "logged_loss": self.logged.get(step)}) + "\n")
            for k, p in enumerate(t.probes):
                f.write(json.dumps({"call": k, **p}) + "\n")
            opt = t.optimizer.optimizer if hasattr(t.optimizer, "optimizer") else t.optimizer
            info = {"info": True, "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                    "trainer_world_size": args.world_size, "param_dtype": str(next(model.parameters()).dtype),
                    "bf16": args.bf16, "fp16": args.fp16, "autocast": any(p["autocast"] for p in t.probes),
                    "attn": model.config._attn_implementation, "gradient_checkpointing": self.gc,
                    "optimizer": f"{type(opt).__name__} fused={opt.defaults.get('fused')}",
                    "padding_free": t.padding_free, "train_rows": len(t.train_dataset),
                    "train_real_tokens": sum(len(x) for x in t.train_dataset["input_ids"])}
            f.write(json.dumps(info) + "\n")


def main() -> None:
    p = argparse.ArgumentParser()
    add_trl_args(p, "conversations, JSONL: messages or prompt-completion format", lr=3e-4, weight_decay=0.1)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--assistant-only", action="store_true", help="assistant_only_loss=True")
    p.add_argument("--packing", action="store_true", help="packing=True (TRL's bfd: padding-free)")
    p.add_argument("--group", action="store_true", help="train_sampling_strategy=group_by_length")
    p.add_argument("--lora", type=int, default=0, help="peft LoRA rank (0 = full fine-tuning)")
    p.add_argument("--lora-alpha", type=float, default=16.0)
    p.add_argument("--lora-dropout", type=float, default=0.05)
    p.add_argument("--save", default="", help="write the trained model (LoRA merged) and tokenizer here")
    p.add_argument("--log-every", type=int, default=10_000, help="TRL's logging_steps")
    p.add_argument("--out", required=True, help="prefix of the per-rank step files")
    p.add_argument("--work", required=True)
    a = p.parse_args()
    gc = {} if a.gc == "default" else {"gradient_checkpointing": a.gc == "on"}
    args = SFTConfig(
        output_dir=a.work, max_steps=a.steps, per_device_train_batch_size=a.micro,
        gradient_accumulation_steps=a.accum, learning_rate=a.lr, warmup_steps=a.warmup,
        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": a.min_lr_ratio},
        weight_decay=a.weight_decay, adam_beta1=a.beta1, adam_beta2=a.beta2, max_grad_norm=1.0,
        bf16=False, use_cpu=not torch.cuda.is_available(), ddp_backend="gloo", seed=a.seed,
        max_length=a.max_length, assistant_only_loss=a.assistant_only, packing=a.packing,
        train_sampling_strategy="group_by_length" if a.group else "random",
        logging_steps=a.log_every, save_strategy="no", report_to=[], disable_tqdm=True, **gc)
    tok = AutoTokenizer.from_pretrained(a.base)
    model = AutoModelForCausalLM.from_pretrained(a.base, dtype=torch.float32)
    data = load_dataset("json", data_files=a.data, split="train")
    trainer = ProbedSFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok,
                               peft_config=lora_config(a.lora, a.lora_alpha, a.lora_dropout))
    train_counted(trainer, tok, a, CountingCollator, StepClock)


if __name__ == "__main__":
    main()
