"""One-process checks for bench/vs_trl.py, with TRL's own data pipeline and collator (writes JSON).

packing   TRL's packing (best-fit decreasing, padding-free: one flat row per micro-batch, position ids
          restarting per conversation, no attention mask) — is each conversation's loss in a packed
          micro-batch the same as the conversation alone? TRL documents packing for FlashAttention and
          warns of cross-contamination otherwise; here the model uses SDPA. Negative control: the same
          packed row with position ids 0..n-1 (no restart), which must differ.
mask      TRL's assistant_only_loss labels (from the template's {% generation %} markers; with TRL's
          conversational prompt-completion data, its completion-only labels) vs phalanx's character-offset
          mask (phalanx.data.chat.encode.ChatEncoder), conversation by conversation, and the token ids of both
          renderings.
reference the first-step batch's losses computed directly (each conversation alone, fp32 forward, sums
          in float64): mean over phalanx's supervised tokens, and over all predicted tokens.
"""
from __future__ import annotations

import argparse
import json

import numpy as np
import torch
import torch.nn.functional as F
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

from phalanx.data.chat.encode import ChatEncoder, ChatSettings, Encoded
from phalanx.data.chat.template import system_policy


def encode_one(tok, messages: list[dict], max_length: int) -> Encoded | None:
    """phalanx's ids and mask of one conversation (None: dropped), through the encoder preparation uses."""
    got = ChatEncoder(tok, ChatSettings("assistant", "turns", max_length, system_policy(tok))).encode(messages)
    return got if isinstance(got, Encoded) else None


def trainer(base: str, data, max_length: int, packing: bool, work: str) -> SFTTrainer:
    """assistant_only_loss for messages data; prompt-completion data takes TRL's default, completion-only loss."""
    args = SFTConfig(output_dir=work, use_cpu=True, bf16=False, gradient_checkpointing=False, report_to=[],
                     max_length=max_length, packing=packing, assistant_only_loss="messages" in data.column_names,
                     per_device_train_batch_size=2)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    return SFTTrainer(model=model, args=args, train_dataset=data, processing_class=AutoTokenizer.from_pretrained(base))


def token_log_probs(model, **inputs) -> torch.Tensor:
    """Per-position log-probabilities of the next token (TRL's fused head: what its loss sums)."""
    with torch.no_grad():
        return model(**inputs, fused_lm_head=True).log_probs[0].double()


def segment_means(lp: torch.Tensor, labels: torch.Tensor, starts: list[int]) -> list[float]:
    target = labels[0, 1:] != -100
    return [float(lp[a:b - 1][target[a:b - 1]].sum() / target[a:b - 1].sum().clamp(min=1))
            for a, b in zip(starts[:-1], starts[1:])]


def packing_check(base: str, data, max_length: int, work: str) -> dict:
    """Per-conversation mean loss: TRL packed micro-batches (2 rows, flattened) vs each conversation alone."""
    tr = trainer(base, data, max_length, True, work)
    model, rows = tr.model, tr.train_dataset
    worst = control = 0.0
    examples = 0
    for i in range(0, len(rows) - 1, 2):
        batch = tr.data_collator([rows[i], rows[i + 1]])
        pos = batch["position_ids"][0]
        starts = (pos == 0).nonzero().flatten().tolist() + [pos.numel()]
        packed = segment_means(token_log_probs(model, **{k: v for k, v in batch.items() if k != "labels"},
                                               labels=batch["labels"]), batch["labels"], starts)
        alone = []
        for a, b in zip(starts[:-1], starts[1:]):
            labels = batch["labels"][:, a:b]
            alone.append(segment_means(token_log_probs(model, input_ids=batch["input_ids"][:, a:b], labels=labels),
                                       labels, [0, b - a])[0])
        worst = max(worst, *(abs(p - q) for p, q in zip(packed, alone)))
        examples += len(alone)
        one = tr.data_collator([rows[i]])  # negative control: the first row, positions 0..n-1, no restart
        pos = one["position_ids"][0]
        starts = (pos == 0).nonzero().flatten().tolist() + [pos.numel()]
        plain = segment_means(token_log_probs(model, input_ids=one["input_ids"], labels=one["labels"]),
                              one["labels"], starts)
        control = max(control, *(abs(p - q) for p, q in zip(plain, alone)))
    return {"examples": examples, "rows": len(rows), "max_abs_diff": worst, "control_max_abs_diff": control,
            "attn": model.config._attn_implementation}


def mask_check(base: str, data, max_length: int, work: str) -> dict:
    """TRL's assistant_only_loss labels vs phalanx's mask, and the token ids, over every conversation."""
    tr = trainer(base, data, max_length, False, work)
    tok = AutoTokenizer.from_pretrained(base)
    ids_differ = mask_differ = tokens_differ = supervised = total = 0
    lengths = []
    for record, row in zip(data, tr.train_dataset):
        messages = record["messages"] if "messages" in record else record["prompt"] + record["completion"]
        enc = encode_one(tok, messages, max_length)
        trl_mask = np.asarray(row["labels"]) != -100
        lengths.append(len(enc.ids))
        if len(enc.ids) != len(row["input_ids"]) or (enc.ids != np.asarray(row["input_ids"])).any():
            ids_differ += 1
            continue
        differ = int((enc.mask != trl_mask).sum())
        mask_differ, tokens_differ = mask_differ + bool(differ), tokens_differ + differ
        supervised, total = supervised + int(enc.mask.sum()), total + len(enc.ids)
    return {"conversations": len(lengths), "ids_differ": ids_differ, "mask_differ": mask_differ,
            "mask_tokens_differ": tokens_differ, "supervised_fraction": supervised / max(total, 1),
            "lengths": lengths}


def reference(base: str, data, max_length: int) -> dict:
    """Loss of the whole first-step batch (`data`), each conversation alone: float64 sums."""
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    sums = {"assistant": [0.0, 0], "all": [0.0, 0]}
    for record in data:
        enc = encode_one(tok, record["messages"], max_length)
        ids = torch.from_numpy(enc.ids)[None]
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits[0, :-1].double()
        nll = F.cross_entropy(logits, ids[0, 1:], reduction="none")
        target = torch.from_numpy(enc.mask[1:])
        sums["assistant"][0] += float(nll[target].sum())
        sums["assistant"][1] += int(target.sum())
        sums["all"][0] += float(nll.sum())
        sums["all"][1] += len(nll)
    return {k: {"loss": s / n, "tokens": n} for k, (s, n) in sums.items()} | {"conversations": len(data)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--base", required=True)
    p.add_argument("--data", required=True, help="all training conversations (JSONL)")
    p.add_argument("--first", default="", help="the first-step batch (JSONL; needed by the reference part)")
    p.add_argument("--parts", default="packing,mask,reference", help="which checks to run")
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--pack-examples", type=int, default=64, help="conversations in the packing check")
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    parts = a.parts.split(",")
    data = load_dataset("json", data_files=a.data, split="train")
    out = {}
    if "packing" in parts:
        out["packing"] = packing_check(a.base, data.select(range(a.pack_examples)), a.max_length, a.work)
    if "mask" in parts:
        out["mask"] = mask_check(a.base, data, a.max_length, a.work)
    if "reference" in parts:
        first = load_dataset("json", data_files=a.first, split="train")
        out["reference"] = reference(a.base, first, a.max_length)
        out["first_trl_packed_rows"] = len(trainer(a.base, first, a.max_length, True, a.work).train_dataset)
    with open(a.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
