"""The other side of bench/ner_wnut.py: the transformers token-classification guide's recipe, as users run it.

Run with torchrun. AutoModelForTokenClassification from the pretrained encoder (its new head initialised by
transformers), the guide's tokenize_and_align_labels (is_split_into_words, truncation=True, the label on each
word's first subword via word_ids(), -100 elsewhere), DataCollatorForTokenClassification, the Trainer with its
defaults except what the bench sets alike for both sides (steps, micro-batch, learning rate, weight decay,
seed; --group: train_sampling_strategy="group_by_length", the same math as phalanx's length-grouped batches).
Each rank writes one JSON line per optimizer step (bench/trainer_side.py's StepClock). After training rank 0
tags every --predict FILE (CoNLL) the recipe's way: a word whose first subword was truncated away gets no
prediction (counted, and scored as O), and writes --out-FILE-NAME.json.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from datasets import Dataset
from trainer_side import CountingCollator, StepClock
from transformers import (
    AutoModelForTokenClassification,
    AutoTokenizer,
    DataCollatorForTokenClassification,
    Trainer,
    TrainingArguments,
)

from phalanx.data import readers


def read_conll(path: str) -> list[tuple[list[str], list[str]]]:
    text = Path(path).read_text(encoding="utf-8").removeprefix("\ufeff")
    return [(w, t) for w, t, _ in readers.conll_sentences(text, (0, -1, "auto"), lambda n: f"{path} line {n}", 0)]


def tokenize_and_align_labels(tok, label2id: dict, max_length: int | None):
    """The guide's function (labels on first subwords through word_ids())."""
    def run(examples):
        enc = tok(examples["tokens"], truncation=True, is_split_into_words=True, max_length=max_length)
        labels = []
        for i, tags in enumerate(examples["ner_tags"]):
            previous, row = None, []
            for word in enc.word_ids(batch_index=i):
                row.append(-100 if word is None or word == previous else label2id[tags[word]])
                previous = word
            labels.append(row)
        enc["labels"] = labels
        return enc
    return run


@torch.no_grad()
def tag(model, tok, sentences: list[list[str]], max_length: int | None) -> tuple[list[list[str]], int]:
    """Predicted tags per word (truncated words: 'O'), and how many words got no prediction."""
    model.eval()
    out, dropped = [], 0
    for lo in range(0, len(sentences), 32):
        chunk = sentences[lo:lo + 32]
        enc = tok(chunk, truncation=True, is_split_into_words=True, max_length=max_length, padding=True,
                  return_tensors="pt")
        pred = model(**enc).logits.argmax(-1)
        for i, words in enumerate(chunk):
            tags, previous = ["O"] * len(words), None
            seen = set()
            for pos, word in enumerate(enc.word_ids(batch_index=i)):
                if word is not None and word != previous:
                    tags[word] = model.config.id2label[int(pred[i, pos])]
                    seen.add(word)
                previous = word
            dropped += len(words) - len(seen)
            out.append(tags)
    return out, dropped


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--train", required=True, help="CoNLL")
    p.add_argument("--labels", required=True, help="JSON list of the label names")
    p.add_argument("--micro", type=int, required=True)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--group", action="store_true")
    p.add_argument("--max-length", type=int, default=0, help="0: the tokenizer's own limit (the guide)")
    p.add_argument("--predict", action="append", default=[], help="CoNLL files to tag after training (rank 0)")
    p.add_argument("--out", required=True)
    p.add_argument("--work", required=True)
    a = p.parse_args()
    args = TrainingArguments(
        output_dir=a.work, max_steps=a.steps, per_device_train_batch_size=a.micro,
        gradient_accumulation_steps=a.accum, learning_rate=a.lr, weight_decay=a.weight_decay,
        logging_steps=10_000, save_strategy="no", report_to=[], disable_tqdm=True, ddp_backend="gloo",
        use_cpu=not torch.cuda.is_available(), seed=a.seed,
        train_sampling_strategy="group_by_length" if a.group else "random")
    names = json.loads(a.labels)
    label2id = {n: i for i, n in enumerate(names)}
    tok = AutoTokenizer.from_pretrained(a.model)
    max_length = a.max_length or None
    rows = read_conll(a.train)
    data = Dataset.from_dict({"tokens": [w for w, _ in rows], "ner_tags": [t for _, t in rows]})
    data = data.map(tokenize_and_align_labels(tok, label2id, max_length), batched=True,
                    remove_columns=["tokens", "ner_tags"])
    labelled = sum(sum(1 for x in row if x != -100) for row in data["labels"])
    model = AutoModelForTokenClassification.from_pretrained(a.model, num_labels=len(names), label2id=label2id,
                                                            id2label=dict(enumerate(names)))
    collator = CountingCollator(DataCollatorForTokenClassification(tok))
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collator)
    trainer.add_callback(StepClock(collator, a.accum, f"{a.out}-{args.process_index}.jsonl"))
    trainer.train()
    if trainer.is_world_process_zero():
        result = {"train_words": sum(len(w) for w, _ in rows), "train_labelled_words": labelled}
        for path in a.predict:
            sentences = read_conll(path)
            tags, dropped = tag(model, tok, [w for w, _ in sentences], max_length)
            result[Path(path).name] = {"pred": tags, "dropped_words": dropped}
        Path(f"{a.out}-pred.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
