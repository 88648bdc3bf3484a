"""Causal language modelling: packed token blocks, next-token loss, perplexity, generation."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..config import Config
from ..data import builtin, cache, sources, tokenizer as toks
from ..model import build_causal_lm

IGNORE = -100


class PackedBlocks:
    """Non-overlapping windows of block_size+1 tokens over one token array (no padding)."""

    def __init__(self, tokens: np.ndarray, block_size: int):
        self.tokens, self.block_size = tokens, block_size
        self.n = max(0, (len(tokens) - 1) // block_size)

    def __len__(self) -> int:
        return self.n

    def batch(self, indices) -> np.ndarray:
        b = self.block_size
        return np.stack([self.tokens[i * b: i * b + b + 1] for i in indices]).astype(np.int64)


def _chunks(doc: str, lines_per_chunk: int = 2000) -> list[str]:
    # Line boundaries are pre-token boundaries for byte-level BPE, so chunking does not change the ids.
    lines = doc.splitlines(keepends=True)
    return ["".join(lines[i:i + lines_per_chunk]) for i in range(0, len(lines), lines_per_chunk)] or [doc]


def tokenize_documents(tokenizer, docs: list[str]) -> np.ndarray:
    """Token ids of all documents, each followed by the end-of-text token."""
    eos = tokenizer.eos_token_id
    backend = tokenizer.backend_tokenizer
    out = []
    for doc in docs:
        for enc in backend.encode_batch(_chunks(doc), add_special_tokens=False):
            out.append(np.asarray(enc.ids, dtype=np.int64))
        out.append(np.asarray([eos], dtype=np.int64))
    ids = np.concatenate(out)
    return ids.astype(cache.token_dtype(len(tokenizer)))


class LMTask:
    name = "lm"

    def __init__(self, cfg: Config, info):
        self.cfg, self.info = cfg, info
        self.train_set = self.val_set = self.tokenizer = None

    # ---- data -------------------------------------------------------------------------------
    def _source_fingerprint(self) -> str:
        d = self.cfg.data
        files = [] if not d.train or d.train.startswith("hf:") else sources.files_of(d.train, "data.train")
        vfiles = [] if not d.validation or d.validation.startswith("hf:") else \
            sources.files_of(d.validation, "data.validation")
        return cache.fingerprint("lm", d.train or f"builtin-{sys.version_info[:2]}-{builtin.MAX_CHARS}",
                                 d.validation, d.val_fraction, d.format, d.text_field, *files, *vfiles)

    def _documents(self) -> tuple[list[str], list[str]]:
        d = self.cfg.data
        docs = sources.read_documents(d.train, d.format, d.text_field, "data.train") if d.train \
            else builtin.stdlib_docstrings()
        if d.validation:
            return docs, sources.read_documents(d.validation, d.format, d.text_field, "data.validation",
                                                split="validation")
        return sources.split_holdout(docs, d.val_fraction)

    @staticmethod
    def preflight(cfg: Config) -> None:
        """Read the data once in the launcher so bad files fail before any worker starts."""
        d = cfg.data
        for spec, key, split in ((d.train, "data.train", "train"), (d.validation, "data.validation", "validation")):
            if spec and not spec.startswith("hf:"):
                sources.read_documents(spec, d.format, d.text_field, key, split)

    def prepare(self) -> None:
        d, info = self.cfg.data, self.info
        root = cache.cache_root(d.cache_dir)
        src = self._source_fingerprint()
        wait = self.cfg.dist.startup_timeout_s
        docs = None

        def documents():
            nonlocal docs
            docs = docs or self._documents()
            return docs

        if d.tokenizer:
            self.tokenizer = toks.load_pretrained(d.tokenizer)
            tok_fp = cache.fingerprint(d.tokenizer, *( [d.tokenizer] if Path(d.tokenizer).is_file() else []))
        elif self.cfg.model.pretrained:
            self.tokenizer = toks.load_pretrained(self.cfg.model.pretrained)
            tok_fp = cache.fingerprint("pretrained", self.cfg.model.pretrained)
        else:
            tok_fp = cache.fingerprint(src, "bpe", d.vocab_size)
            tok_dir = cache.build_once(root / f"tokenizer-{tok_fp}",
                                       lambda tmp: toks.train_bpe(documents()[0], d.vocab_size).save_pretrained(tmp),
                                       is_builder=info.is_local_main, timeout_s=wait)
            self.tokenizer = toks.load_saved(tok_dir)
        if self.tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no end-of-text token (eos_token)")
        arrays = {}
        for i, split in enumerate(("train", "validation")):
            path = root / f"tokens-{cache.fingerprint(src, tok_fp, split)}.npy"
            arrays[split] = cache.load_tokens(cache.build_once(
                path, lambda tmp, i=i: cache.save_tokens(tokenize_documents(self.tokenizer, documents()[i] or [""]), tmp),
                is_builder=info.is_local_main, timeout_s=wait))
        bs = self.cfg.model.block_size
        self.train_set = PackedBlocks(arrays["train"], bs)
        self.val_set = PackedBlocks(arrays["validation"], bs)
        if len(self.train_set) == 0:
            raise ValueError(f"data.train: {len(arrays['train'])} tokens is less than one block of "
                             f"{bs + 1}; lower model.block_size or add text")

    def train_order(self):
        return None

    # ---- model and steps --------------------------------------------------------------------
    def build_model(self):
        return build_causal_lm(self.cfg.model, len(self.tokenizer), self.tokenizer.eos_token_id)

    def collate(self, dataset: PackedBlocks, indices) -> dict:
        blocks = torch.from_numpy(dataset.batch(indices))
        return {"input_ids": blocks[:, :-1].contiguous(), "labels": blocks[:, 1:].contiguous()}

    def target_count(self, batch: dict) -> int:
        return int(batch["labels"].numel())

    def batch_tokens(self, batch: dict) -> int:
        return int(batch["input_ids"].numel())

    def useful_tokens(self, batch: dict) -> int:
        return self.batch_tokens(batch)  # packed: no padding

    def loss_sum(self, model, batch: dict) -> torch.Tensor:
        logits = model(input_ids=batch["input_ids"]).logits
        return F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(),
                               ignore_index=IGNORE, reduction="sum")

    # ---- evaluation -------------------------------------------------------------------------
    def eval_sums(self, model, batch: dict) -> list[float]:
        loss = self.loss_sum(model, batch)
        return [float(loss), float(self.target_count(batch)), float(batch["input_ids"].shape[0])]

    def eval_metrics(self, sums: list[float]) -> dict:
        loss_sum, tokens, samples = sums
        loss = loss_sum / max(tokens, 1)
        return {"eval/loss": loss, "eval/ppl": math.exp(min(loss, 50.0)), "eval/tokens": int(tokens),
                "eval/samples": int(samples)}

    # ---- outputs ----------------------------------------------------------------------------
    def summary_extra(self) -> dict:
        return {"train_blocks": len(self.train_set), "val_blocks": len(self.val_set),
                "vocab_size": len(self.tokenizer)}


def generate(run_dir: str, prompt: str, max_new_tokens: int = 100, temperature: float = 0.8,
             top_k: int = 50, seed: int = 0) -> str:
    """Sample a continuation of `prompt` from RUN/final (a plain transformers model)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(run_dir) / "final"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    torch.manual_seed(seed)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    limit = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", 1024)
    ids = ids[:, -(limit - max_new_tokens):] if ids.shape[1] + max_new_tokens > limit else ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                             temperature=temperature or None, top_k=top_k,
                             pad_token_id=tokenizer.eos_token_id, attention_mask=torch.ones_like(ids))
    return tokenizer.decode(out[0], skip_special_tokens=True)

