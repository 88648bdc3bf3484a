"""Chat: supervised fine-tuning of a causal LM on conversations (`task: chat`).

The loss is the sum over supervised tokens (assistant replies and their end-of-turn tokens, by default)
divided by the all-reduced count of supervised tokens of the whole global batch — the loop's rule for
every task — so gradient accumulation and N processes make the same update as one process. Padding,
system, user and role-header tokens are never in the count.

A sample is a packed row (whole conversations, each attending only to itself: position ids restart at
each conversation and the model builds its own per-layer masks from them; pad slots are a segment of
their own) or, with data.packing=false, one conversation padded per micro-batch (a 2-D padding mask).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from phalanx.core import dist
from phalanx.core.config import Config, ConfigError, base_config, group_by_length
from phalanx.data import prepare, units
from phalanx.data.chat import store as chat_store
from phalanx.data import tokenizer as toks
from phalanx.data.samplers import length_grouped_order, shuffled_order
from phalanx.model.build import attention_in_use, causal_lm, export_entries
from phalanx.model.head import IGNORE, Targets, target_logprobs
from phalanx.model import precision
from phalanx.model.lora import LoraAdapters, adapter_state, check_targets, is_lora, merged_entries
from phalanx.model.shard import Builder
from phalanx.tasks.base import TaskBase

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")


def collate_rows(samples: list[list[tuple[np.ndarray, np.ndarray]]], width: int, pad_id: int,
                 packed: bool = True) -> dict:
    """Rows of whole conversations, `width` tokens each. Token t's label is token t+1 of the same
    conversation where the mask marks it a target, else -100.

    The model builds its own attention masks from what the batch says (a mask built here would be wrong
    for some of them: eager attention adds it to the scores, sliding-window layers need their window, and
    transformers takes any 4-D mask as final). Packed rows: position ids restarting at 0 for each
    conversation and for the pad tail, and no attention mask: transformers then confines each segment to
    itself, per layer type (full, sliding) and attention implementation; the forward must run without a
    key/value cache (use_cache=False), which would turn that detection off. Unpacked rows (one
    conversation each, padded on the right): a 2-D padding mask. Either way nothing `width x width`."""
    b = len(samples)
    ids = np.full((b, width), pad_id, dtype=np.int64)
    labels = np.full((b, width), IGNORE, dtype=np.int64)
    positions = np.zeros((b, width), dtype=np.int64)
    real = np.zeros(b, dtype=np.int64)
    for r, segments in enumerate(samples):
        if not packed and len(segments) != 1:
            raise ValueError(f"an unpacked row holds one conversation, got {len(segments)}")
        t = 0
        for x, m in segments:
            n = len(x)
            ids[r, t:t + n], positions[r, t:t + n] = x, np.arange(n)
            labels[r, t:t + n - 1] = np.where(m[1:], x[1:], IGNORE)
            t += n
        positions[r, t:] = np.arange(width - t)  # the pad tail: a segment of its own (never fully masked)
        real[r] = t
    batch = {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels), "real_tokens": int(real.sum())}
    if packed:
        batch["position_ids"] = torch.from_numpy(positions)
    else:
        batch["attention_mask"] = torch.from_numpy((np.arange(width)[None, :] < real[:, None]).astype(np.int64))
    return batch


def base_positions(cfg: Config) -> int | None:
    """Positions the pretrained base model has (None: from scratch, or unknown without loading it)."""
    raw = base_config(cfg) or {}
    return raw.get("n_positions") or raw.get("max_position_embeddings")


class ChatTask(TaskBase):
    name = "chat"
    ARCHS = ("gpt2", "llama")
    AUTO_MODEL = "AutoModelForCausalLM"
    FORMAT = chat_store.CHAT

    def __init__(self, cfg: Config, info):
        super().__init__(cfg, info)
        self.data: units.UnitData | None = None
        self.base_vocab = 0

    # ---- in the launcher ------------------------------------------------------------------------
    @classmethod
    def check_config(cls, cfg: Config) -> None:
        super().check_config(cfg)
        positions, bs = base_positions(cfg), cfg.model.block_size
        if positions and bs > positions:
            raise ConfigError(f"config key 'model.block_size': {bs} is more than the {positions} positions of "
                              f"'{cfg.model.pretrained}'; lower it to {positions} or less")
        # a 16-bit frozen base needs 16-bit compute without sharding (worker: the real world size)
        device = "cuda" if dist.pick_backend(cfg.dist.backend) == "nccl" else "cpu"
        amp_dtype, _ = precision.check_precision(cfg.train.precision, device)
        precision.base_dtype(cfg.model, cfg.train.strategy, 2, amp_dtype)
        if cfg.model.lora.r and cfg.model.lora.target_modules:
            # the architecture on the meta device (any vocabulary: names are what matter); the input embedding
            # always has rows that train for the chat template, so no target may be it or a head tied to it
            with torch.device("meta"):
                model = causal_lm(cfg.model, 256, 0)
            check_targets(model, cfg.model.lora, token_ids=[0])

    @classmethod
    def check_prepared(cls, cfg: Config) -> None:
        """data.max_dropped_fraction (from the stores' summaries: raising it does not prepare again), and a
        training conversation left after the validation hold-out."""
        too_many = chat_store.dropped_error(cfg)
        if too_many:
            raise ConfigError(too_many)
        if len(prepare.open_prepared(cfg, cls.FORMAT).train) == 0:
            raise ConfigError(f"config key 'data.train': every conversation of '{cfg.data.train or 'built-in data'}' "
                              f"is held out for validation; add conversations or lower data.val_fraction")

    @staticmethod
    def sequence_length(cfg: Config) -> int:
        return cfg.model.block_size

    # ---- in every worker ------------------------------------------------------------------------
    def open_data(self) -> None:
        cfg = self.cfg
        self.data = prepare.open_or_prepare(cfg, chat_store.CHAT, self.info.is_local_main, cfg.dist.startup_timeout_s)
        self.tokenizer = toks.load_saved(self.data.tokenizer_dir)
        self.train_set, self.val_set = self.data.train, self.data.validation

    def train_order(self, data_order: int):
        """Packed rows (all as wide) and data.group_by_length=false: a plain shuffle; else length-grouped."""
        t = self.cfg.train
        if self.train_set.lengths is None or not group_by_length(self.cfg):
            return shuffled_order(len(self.train_set), lazy=True)
        return length_grouped_order(self.train_set.lengths, t.micro_batch_size, unit=t.global_batch_size)

    @staticmethod
    def model_for(cfg: Config, vocab_size: int, special_id: int):
        """The architecture from the config alone (the memory plan reads its shapes on the meta device)."""
        return causal_lm(cfg.model, vocab_size, special_id)

    def define_model(self) -> torch.nn.Module:
        """The architecture, with the base model's vocabulary grown by the chat template's tokens where it
        has none: the loader fills their embedding rows by mean resizing (model/load.py)."""
        model = causal_lm(self.cfg.model, len(self.tokenizer), self.tokenizer.eos_token_id)
        self.base_vocab = model.get_input_embeddings().weight.shape[0]
        if len(self.tokenizer) > self.base_vocab:  # the chat template's tokens (a base model without one)
            model.resize_token_embeddings(len(self.tokenizer), mean_resizing=False)
        return model

    def build_model(self, builder: Builder | None = None) -> torch.nn.Module:
        """The model with its weights (see TaskBase.build_model); under LoRA with peft's adapters, injected
        into the skeleton before it is sharded and initialised by (seed, name) (model/lora.py). Under LoRA
        the embedding rows of the template's tokens train too: those grown for it, and those the base has
        but may never have trained (a base model's end-of-turn token), which would otherwise stay frozen."""
        adapters = LoraAdapters(self.cfg.model.lora, self._adapted_tokens) if self.cfg.model.lora.r else None
        return (builder or Builder(seed=self.cfg.train.seed)).build(self.define_model, self.cfg.model.pretrained,
                                                                     mismatched=self.MISMATCHED, adapters=adapters)

    def _adapted_tokens(self) -> list[int]:
        """The template's token ids (grown for it, or its special tokens): known once define_model ran."""
        return sorted(set(range(self.base_vocab, len(self.tokenizer))) | set(self.data.template_tokens))

    def collate(self, dataset: units.UnitSet, indices) -> dict:
        samples = [dataset.sequences(int(i)) for i in indices]
        width = self.cfg.model.block_size if dataset.lengths is None else \
            max((sum(len(x) for x, _ in s) for s in samples), default=1)
        return collate_rows(samples, width, self.tokenizer.pad_token_id or self.tokenizer.eos_token_id,
                            packed=dataset.lengths is None)

    def target_count(self, batch: dict) -> int:
        return int((batch["labels"] != IGNORE).sum())

    def useful_tokens(self, batch: dict) -> int:
        return int(batch["real_tokens"])

    def target_logps(self, model, batch: dict, correct: bool = False, summed: bool = False) -> Targets:
        """Each supervised token's log-prob (row-major; `summed`: their sum), the output head run only at those
        positions (model/head.py); with `correct`, whether the argmax was the target."""
        inputs, labels = {k: batch[k] for k in MODEL_INPUTS if k in batch}, batch["labels"]
        if "position_ids" in inputs and labels.shape[0] > 1 and attention_in_use(model) == "flash_attention_2":
            # flash attention reads packed conversations from the position ids of a single row only
            inputs, labels = {k: v.reshape(1, -1) for k, v in inputs.items()}, labels.reshape(1, -1)
        return target_logprobs(model, inputs, labels, correct, summed)

    def loss_sum(self, model, batch: dict) -> torch.Tensor:
        return -self.target_logps(model, batch, summed=True).logp

    # ---- evaluation -----------------------------------------------------------------------------
    def eval_sums(self, model, batch: dict) -> list[float]:
        """[loss sum, supervised tokens, correct argmax predictions, samples]: additive across ranks."""
        t = self.target_logps(model, batch, correct=True, summed=True)
        return [float(-t.logp), float(t.correct.numel()), float(t.correct.sum()), float(batch["labels"].shape[0])]

    def eval_metrics(self, sums: list[float]) -> dict:
        loss_sum, tokens, correct, samples = sums
        loss = loss_sum / max(tokens, 1)
        return {"eval/loss": loss, "eval/ppl": math.exp(min(loss, 50.0)),
                "eval/token_accuracy": correct / max(tokens, 1), "eval/tokens": int(tokens),
                "eval/samples": int(samples)}

    # ---- outputs --------------------------------------------------------------------------------
    def export(self, model, out, write) -> None:
        """RUN/final: the model (LoRA: merged into the base) with the tokenizer and its chat template, and a
        generation config that stops at the end of the assistant's turn; LoRA's adapter in final/adapter.
        Under LoRA every rank's part of every adapter goes into final/adapter (gathered: small), and the
        merged model is written file by file by all ranks, each weight merged in fp32 on its writer (the
        model itself is left as it trained)."""
        eos = self.tokenizer.eos_token_id
        stops = [*self.data.end_of_turn, *([eos] if eos is not None else [])]
        entries = None
        if is_lora(model):
            adapter = adapter_state(model)
            if self.info.is_main:
                model.save_pretrained(Path(out) / "adapter", state_dict=adapter)
            entries = merged_entries(model, export_entries(model.get_base_model()))
            model = model.get_base_model()
        model.generation_config.eos_token_id = list(dict.fromkeys(stops))
        model.generation_config.pad_token_id = self.tokenizer.pad_token_id or self.tokenizer.eos_token_id
        write(model, self.tokenizer, out, entries=entries)

    def next_commands(self, run_dir) -> list[str]:
        return [*super().next_commands(run_dir), f'phalanx chat {run_dir}']

    def summary_extra(self) -> dict:
        s = self.data.summary
        keys = ("records", "documents", "truncated", "dropped", "dropped_by", "supervised_tokens",
                "packing_efficiency", "packed_rows")
        return {"train_samples": len(self.train_set), "val_samples": len(self.val_set),
                "vocab_size": len(self.tokenizer), **{f"data_{k}": s[k] for k in keys if k in s}}
