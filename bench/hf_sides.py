"""What the Hugging Face sides of the benches share (bench/trainer_side.py, trl_side.py, trl_dpo_side.py): the
step flags every side takes, peft's LoRA as phalanx's model.lora defaults set it, and training with a side's
counting collator and step clock, then saving the result."""
from __future__ import annotations


def add_step_args(p, lr: float, weight_decay: float) -> None:
    """The optimizer-step flags: micro-batch, accumulation, steps, lr, warm-up, weight decay, seed."""
    p.add_argument("--micro", type=int, required=True, help="per-device batch: examples, pairs or packed rows")
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--weight-decay", type=float, default=weight_decay)
    p.add_argument("--seed", type=int, default=1337)


def add_trl_args(p, data_help: str, lr: float, weight_decay: float) -> None:
    """A TRL side's flags: its base and data, the length, the step flags, the cosine floor, gradient checkpointing."""
    p.add_argument("--base", required=True, help="model + tokenizer (with its chat template) folder")
    p.add_argument("--data", required=True, help=data_help)
    p.add_argument("--max-length", type=int, default=256)
    add_step_args(p, lr, weight_decay)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--gc", choices=["default", "on", "off"], default="default", help="gradient checkpointing")


def lora_config(r: int, alpha: float, dropout: float):
    """peft's LoRA on every linear layer but the head (phalanx's model.lora targets); None for r = 0."""
    if not r:
        return None
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules="all-linear", task_type="CAUSAL_LM")


def train_counted(trainer, tok, a, counting, clock) -> None:
    """Train with the side's counting collator and step clock (per-rank lines in --out-RANK.jsonl); then rank 0
    writes the trained model (LoRA merged) and the tokenizer to --save, where given."""
    trainer.probes = []
    trainer.data_collator = collator = counting(trainer.data_collator)
    trainer.add_callback(clock(trainer, collator, a.accum, f"{a.out}-{trainer.args.process_index}.jsonl"))
    trainer.train()
    if a.save and trainer.is_world_process_zero():
        trained = trainer.model.merge_and_unload() if a.lora else trainer.model
        trained.save_pretrained(a.save)
        tok.save_pretrained(a.save)
