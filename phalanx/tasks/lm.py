"""Causal language modelling: packed token blocks, next-token loss, perplexity, generation."""
from __future__ import annotations

import math

import numpy as np
import torch

from phalanx.core.config import Config, ConfigError
from phalanx.data import lm_store, prepare, store
from phalanx.data import tokenizer as toks
from phalanx.data.samplers import WINDOWED, ShardPlan, shuffled_order, windowed_order
from phalanx.model.build import causal_lm
from phalanx.model.head import target_logprobs
from phalanx.tasks.base import TaskBase


class PackedBlocks:
    """Non-overlapping windows of block_size+1 tokens over tokens [lo, hi) of a token store (no padding).
    Window i starts at token lo + i*block_size; windows cross shard boundaries freely."""

    def __init__(self, tokens: store.TokenStore, block_size: int, lo: int = 0, hi: int | None = None):
        self.tokens, self.block_size, self.lo = tokens, block_size, lo
        hi = len(tokens) if hi is None else hi
        self.n = max(0, (hi - lo - 1) // block_size)

    def __len__(self) -> int:
        return self.n

    def token_span(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """Tokens [lo, hi) each window reads (the store's shards it touches: samplers.ShardPlan)."""
        lo = self.lo + np.asarray(indices, dtype=np.int64) * self.block_size
        return lo, lo + self.block_size + 1

    def stores(self) -> list[store.TokenStore]:
        return [self.tokens]

    def batch(self, indices) -> np.ndarray:
        b, lo = self.block_size, self.lo
        return np.stack([self.tokens.slice(lo + int(i) * b, lo + int(i) * b + b + 1) for i in indices]).astype(np.int64)


def blocks(data: lm_store.LMData, block_size: int) -> tuple[PackedBlocks, PackedBlocks]:
    """Training and validation blocks: a separate validation store, or the tail of the training store."""
    train = data.train
    if data.validation is not None:
        return PackedBlocks(train, block_size), PackedBlocks(data.validation, block_size)
    cut = len(train) - data.val_tokens
    return PackedBlocks(train, block_size, 0, cut), PackedBlocks(train, block_size, cut, len(train))


def check_enough(cfg: Config, data: lm_store.LMData) -> None:
    """Enough tokens for one training sequence, and for one validation sequence when one is asked for."""
    d, bs = cfg.data, cfg.model.block_size
    train, val = blocks(data, bs)
    n_train = len(data.train) - data.val_tokens
    if len(train) == 0:
        raise ConfigError(f"config key 'data.train': '{d.train or 'built-in corpus'}' gives {n_train} training "
                          f"tokens; one sequence needs model.block_size + 1 = {bs + 1}; add text or lower "
                          f"model.block_size")
    if len(val) == 0 and (d.validation or d.val_fraction > 0):
        n_val = len(data.validation) if data.validation is not None else data.val_tokens
        where = f"'{d.validation}'" if d.validation else f"data.val_fraction={d.val_fraction} of the training data"
        raise ConfigError(f"validation data {where} gives {n_val} tokens; one sequence needs model.block_size + 1 "
                          f"= {bs + 1}; add text, raise data.val_fraction, or set data.val_fraction=0 (no evaluation)")


class LMTask(TaskBase):
    name = "lm"
    ARCHS = ("gpt2", "llama")
    AUTO_MODEL = "AutoModelForCausalLM"
    FORMAT = lm_store.LM

    # ---- data -------------------------------------------------------------------------------
    @classmethod
    def check_prepared(cls, cfg: Config) -> None:
        check_enough(cfg, prepare.open_prepared(cfg, cls.FORMAT))

    def open_data(self) -> None:
        """Open the prepared stores. Started by an outside torchrun/srun, the node's first process
        prepares them (the others wait for the index files, not in a collective that could time out)."""
        cfg = self.cfg
        data = prepare.open_or_prepare(cfg, lm_store.LM, self.info.is_local_main, cfg.dist.startup_timeout_s)
        self.tokenizer = toks.load_saved(data.tokenizer_dir)
        self.train_set, self.val_set = blocks(data, cfg.model.block_size)
        check_enough(cfg, data)

    def train_order(self, data_order: int):
        """A shuffled order per epoch, computed per global batch (data order 3), so memory per rank does not
        grow with the corpus; or shuffled within windows of shards (4: data.order); older checkpoints keep
        the materialised permutation they started with."""
        if data_order >= WINDOWED:
            return windowed_order(ShardPlan.of(self.train_set), self.cfg.data.order_window)
        return shuffled_order(len(self.train_set), lazy=data_order >= 3)

    # ---- model and steps --------------------------------------------------------------------
    @staticmethod
    def sequence_length(cfg: Config) -> int:
        return cfg.model.block_size

    def next_commands(self, run_dir) -> list[str]:
        return [*super().next_commands(run_dir), f'phalanx generate {run_dir} --prompt "The"']

    @staticmethod
    def model_for(cfg: Config, vocab_size: int, special_id: int):
        """The architecture, on the current default device (no weights are loaded)."""
        return causal_lm(cfg.model, vocab_size, special_id)

    def define_model(self):
        return self.model_for(self.cfg, len(self.tokenizer), self.tokenizer.eos_token_id)

    def collate(self, dataset: PackedBlocks, indices) -> dict:
        blocks = torch.from_numpy(dataset.batch(indices))
        return {"input_ids": blocks[:, :-1].contiguous(), "labels": blocks[:, 1:].contiguous()}

    def useful_tokens(self, batch: dict) -> int:
        return self.batch_tokens(batch)  # packed: no padding

    def loss_sum(self, model, batch: dict) -> torch.Tensor:
        """Every position's next-token loss, the output head run in chunks of rows (model/head.py): never a
        B x T x V tensor."""
        return -target_logprobs(model, {"input_ids": batch["input_ids"]}, batch["labels"], summed=True).logp

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
