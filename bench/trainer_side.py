"""The other side of bench/vs_trainer.py: the Transformers Trainer, as a user would write it.

Run with torchrun. Same model architecture and tokenizer as a phalanx run (read from that run's final/
folder: config.json and the tokenizer; the weights start from a fresh init, as phalanx's do), same data,
micro-batch and global batch. Classification: `datasets.map` tokenization with truncation, the Trainer's
DataCollatorWithPadding (dynamic padding). Language model: the run_clm.py recipe (tokenize, concatenate,
cut into blocks, labels = input ids). Each rank writes one JSON line per optimizer step to --out-RANK.jsonl:
the wall time at the end of the step and the tokens (all, and non-padding) of the batch it consumed, so the
bench computes useful tokens/s from wall clocks exactly as for phalanx.

Everything not listed under "same math" stays at the Trainer's defaults (sampling, optimizer, clipping);
`--group` sets train_sampling_strategy="group_by_length". `--pretrained` starts from --final's weights (a real
model; a classification head the checkpoint lacks is initialised by transformers, as it says), `--seed` sets
the Trainer's seed, and `--eval FILE` (classify) has rank 0 score FILE after training: accuracy to
--out-eval.json.
"""
from __future__ import annotations

import argparse
import json
import time
from itertools import chain

import torch
from datasets import load_dataset
from hf_sides import add_step_args
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
)


class CountingCollator:
    """Wraps the collator to record each batch's token counts, in the order batches are made."""

    def __init__(self, collate):
        self.collate, self.batches = collate, []

    def __call__(self, features):
        batch = self.collate(features)
        mask = batch.get("attention_mask")
        ids = batch["input_ids"]
        self.batches.append((ids.numel(), int(mask.sum()) if mask is not None else ids.numel()))
        return batch


class StepClock(TrainerCallback):
    """One line per optimizer step: end time and the batches consumed by it (step i takes batches
    (i-1)*accum .. i*accum-1; the data loader may collate one batch ahead, so counts are matched by index,
    not by time)."""

    def __init__(self, collator: CountingCollator, accum: int, out: str):
        self.collator, self.accum, self.out, self.times = collator, accum, out, []

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.time())

    def on_train_end(self, args, state, control, **kwargs):
        with open(self.out, "w") as f:
            for step, t in enumerate(self.times, start=1):
                counts = self.collator.batches[(step - 1) * self.accum: step * self.accum]
                tokens, useful = sum(c[0] for c in counts), sum(c[1] for c in counts)
                f.write(json.dumps({"step": step, "time_s": t, "tokens": tokens, "useful": useful}) + "\n")


def classification_data(tok, path: str, rows: int, max_length: int):
    data = load_dataset("json", data_files=path, split=f"train[:{rows}]")
    data = data.map(lambda b: tok(b["text"], truncation=True, max_length=max_length), batched=True,
                    remove_columns=["text"])
    return data.rename_column("label", "labels"), DataCollatorWithPadding(tok)


def lm_data(tok, path: str, block: int):
    data = load_dataset("text", data_files=path, split="train", sample_by="document")
    data = data.map(lambda b: tok(b["text"]), batched=True, remove_columns=["text"])

    def group(batch):  # run_clm.py's group_texts
        ids = list(chain(*batch["input_ids"]))
        n = len(ids) // block * block
        blocks = [ids[i:i + block] for i in range(0, n, block)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    return data.map(group, batched=True, remove_columns=data.column_names), default_data_collator


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--task", choices=["classify", "lm"], required=True)
    p.add_argument("--final", required=True, help="a phalanx run's final/ folder: model config + tokenizer")
    p.add_argument("--data", required=True)
    p.add_argument("--rows", type=int, default=8000)
    p.add_argument("--max-length", type=int, default=128, help="classify: truncation length")
    p.add_argument("--block", type=int, default=128, help="lm: tokens per sequence")
    add_step_args(p, lr=5e-4, weight_decay=0.0)
    p.add_argument("--beta2", type=float, default=0.999)
    p.add_argument("--group", action="store_true", help="train_sampling_strategy=group_by_length")
    p.add_argument("--pretrained", action="store_true", help="start from --final's weights (else a fresh init)")
    p.add_argument("--eval", default="", help="classify: score this file after training (rank 0)")
    p.add_argument("--out", required=True, help="prefix of the per-rank step files")
    p.add_argument("--work", required=True)
    a = p.parse_args()
    args = TrainingArguments(
        output_dir=a.work, max_steps=a.steps, per_device_train_batch_size=a.micro,
        gradient_accumulation_steps=a.accum, learning_rate=a.lr, warmup_steps=a.warmup,
        weight_decay=a.weight_decay, adam_beta2=a.beta2, logging_steps=10_000, save_strategy="no",
        report_to=[], disable_tqdm=True, ddp_backend="gloo", use_cpu=not torch.cuda.is_available(),
        train_sampling_strategy="group_by_length" if a.group else "random", seed=a.seed)
    tok = AutoTokenizer.from_pretrained(a.final)
    config = AutoConfig.from_pretrained(a.final)
    with args.main_process_first():  # rank 0 writes the datasets cache, the others read it (the recipe)
        if a.task == "classify":
            data, collate = classification_data(tok, a.data, a.rows, a.max_length)
        else:
            data, collate = lm_data(tok, a.data, a.block)
    auto = AutoModelForSequenceClassification if a.task == "classify" else AutoModelForCausalLM
    labels = {"num_labels": len(set(data["labels"]))} if a.task == "classify" else {}
    model = auto.from_pretrained(a.final, **labels) if a.pretrained else auto.from_config(config)
    collator = CountingCollator(collate)
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collator)
    trainer.add_callback(StepClock(collator, a.accum, f"{a.out}-{args.process_index}.jsonl"))
    trainer.train()
    if a.eval and trainer.is_world_process_zero():
        evaluate(model, tok, a.eval, a.max_length, f"{a.out}-eval.json")


@torch.no_grad()
def evaluate(model, tok, path: str, max_length: int, out: str) -> None:
    """Accuracy of the trained classifier on every row of `path` (text, label), batches of 64."""
    data, collate = classification_data(tok, path, 10**9, max_length)
    model.eval()
    right = 0
    for lo in range(0, len(data), 64):
        batch = collate([data[i] for i in range(lo, min(lo + 64, len(data)))])
        labels = batch.pop("labels")
        right += int((model(**batch).logits.argmax(-1) == labels).sum())
    with open(out, "w") as f:
        json.dump({"accuracy": right / len(data), "samples": len(data)}, f)


if __name__ == "__main__":
    main()
