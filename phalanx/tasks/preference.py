"""Preference tuning (`task: preference`): DPO and its common variants on pairs of a better (chosen) and a
worse (rejected) reply to the same prompt, from a chat model (a chat run's final/) or any causal LM.

The data are chat's, per pair (data/pref/store.py): both replies rendered with the chat template as
`task: chat` renders, their targets the reply tokens through the end-of-turn token. The model, LoRA and the
export are chat's (ChatTask): RUN/final is a chat model for `phalanx chat` and plain transformers.

The loss (preference.loss, tasks/pref_loss.py) is the sum of the per-pair losses divided by the number of
pairs in the whole global batch, plus preference.sft_weight x the chosen replies' summed NLL divided by
their target tokens in the whole global batch: both counts come from the loop's one all-reduce per step, so
gradient accumulation and N processes make the same update as one process. A pair is the unit of packing
and sampling: packed rows hold whole pairs (position ids restart at each sequence, as chat packs), an
unpacked sample is one pair as two padded rows. The reference (preference.reference) is in
tasks/pref_reference.py.
"""
from __future__ import annotations

import numpy as np
import torch

from phalanx.core.config import Config, ConfigError
from phalanx.data import prepare, units
from phalanx.data import tokenizer as toks
from phalanx.data.pref import store as pref_store
from phalanx.data.pref.store import PREFERENCE
from phalanx.tasks import pref_loss, pref_reference
from phalanx.tasks.chat import IGNORE, ChatTask, collate_rows


class PreferenceTask(ChatTask):
    name = "preference"
    FORMAT = PREFERENCE

    def __init__(self, cfg: Config, info):
        super().__init__(cfg, info)
        self.reference = pref_reference.Reference("none", self)

    # ---- in the launcher ------------------------------------------------------------------------
    @classmethod
    def check_config(cls, cfg: Config) -> None:
        super().check_config(cfg)
        pref_reference.check(cfg)

    @classmethod
    def check_prepared(cls, cfg: Config) -> None:
        """data.max_dropped_fraction over pairs, and a training pair left after the validation hold-out."""
        too_many = pref_store.dropped_error(cfg)
        if too_many:
            raise ConfigError(too_many)
        if len(prepare.open_prepared(cfg, PREFERENCE).train) == 0:
            raise ConfigError(f"config key 'data.train': every pair of '{cfg.data.train or 'built-in data'}' is held "
                              f"out for validation; add pairs or lower data.val_fraction")

    @staticmethod
    def sequence_length(cfg: Config) -> int:
        return PREFERENCE.width(cfg)  # a packed row, or a pair's two rows of up to model.block_size

    # ---- in every worker ------------------------------------------------------------------------
    def open_data(self) -> None:
        cfg = self.cfg
        self.data = prepare.open_or_prepare(cfg, PREFERENCE, self.info.is_local_main, cfg.dist.startup_timeout_s)
        self.tokenizer = toks.load_saved(self.data.tokenizer_dir)
        self.train_set, self.val_set = self.data.train, self.data.validation

    def build_model(self, builder=None) -> torch.nn.Module:
        """Chat's model (with its adapters), without dropout under preference.disable_dropout."""
        return self.without_dropout(super().build_model(builder))

    def without_dropout(self, model: torch.nn.Module) -> torch.nn.Module:
        """`model` with every dropout zeroed (disable_dropout) where preference.disable_dropout asks (as TRL's
        DPOConfig.disable_dropout does, for the policy and the reference copy); the model itself."""
        if self.cfg.preference.disable_dropout:
            disable_dropout(model)
        return model

    def attach(self, trainee, beat=None, progress=None) -> None:
        self.reference = pref_reference.attach(self, trainee, beat, progress)

    def collate(self, dataset: units.UnitSet, indices) -> dict:
        groups = [dataset.unit_ids(int(i)) for i in indices]
        width = PREFERENCE.width(self.cfg) if dataset.order is not None else None
        batch = self.collate_pairs(dataset.units, groups, width)
        if dataset.reference is not None:
            batch["ref_logps"] = torch.from_numpy(np.asarray(dataset.reference[[p for g in groups for p in g]]))
        return batch

    def collate_pairs(self, pairs: units.Units, groups: list[list[int]], width: int | None) -> dict:
        """Samples of whole pairs (`groups`: each sample's pairs) as rows: packed rows of `width` tokens, or
        (width None) each sequence its own row, padded. With `segments` (the sequence each target belongs to:
        2k = the k-th pair's chosen reply, 2k + 1 its rejected one, -1 none), `seq_tokens` (pairs x [chosen,
        rejected] target counts), and the counts of pairs, truncated pairs and samples."""
        flat = [p for g in groups for p in g]
        packed = width is not None
        seqs = [[s for p in g for s in pairs.unit(p)] for g in groups]
        rows = seqs if packed else [[s] for row in seqs for s in row]
        batch = collate_rows(rows, width or max(len(row[0][0]) for row in rows),
                             self.tokenizer.pad_token_id or self.tokenizer.eos_token_id, packed=packed)
        labels = batch["labels"].numpy()
        segments, s = np.full(labels.shape, -1, dtype=np.int64), 0
        for r, row in enumerate(rows):
            t = 0
            for ids, _ in row:
                segments[r, t:t + len(ids) - 1] = s  # the positions whose label is this sequence's next token
                t, s = t + len(ids), s + 1
            if packed:  # a pad tail longer than the model's positions: segments of at most model.block_size
                batch["position_ids"][r, t:] %= self.cfg.model.block_size
        segments[labels == IGNORE] = -1
        counts = np.bincount(segments[segments >= 0], minlength=s).reshape(-1, 2)
        batch.update(segments=torch.from_numpy(segments), seq_tokens=torch.from_numpy(counts), pairs=len(flat),
                     truncated=int(np.asarray(pairs.truncated)[2 * np.asarray(flat, dtype=np.int64)].sum()),
                     samples=len(groups))
        return batch

    def step_counts(self, batch: dict) -> list[float]:
        """[pairs, chosen-reply targets]: the normalisers of the pair losses and of the NLL term."""
        return [float(batch["pairs"]), float(batch["seq_tokens"][:, 0].sum())]

    def target_count(self, batch: dict) -> int:
        return int(batch["pairs"])

    def sequence_logps(self, model, batch: dict) -> torch.Tensor:
        """(pairs, 2) summed log-probs of each pair's chosen and rejected targets under `model`."""
        targets = batch["labels"] != IGNORE  # the head runs only there (model/head.py)
        logps = pref_loss.sequence_logps(self.target_logps(model, batch).logp, batch["segments"][targets],
                                         2 * batch["pairs"])
        return logps.view(-1, 2)

    def _terms(self, model, batch: dict):
        ref = self.reference.logps(batch)  # first: its logits are freed before the policy's graph is built
        logps = self.sequence_logps(model, batch)
        losses, rewards = pref_loss.pair_losses(self.cfg.preference, logps, ref, batch["seq_tokens"])
        return losses, rewards, logps

    def step_loss(self, model, batch: dict, totals: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
        pairs, chosen_tokens = totals
        losses, rewards, logps = self._terms(model, batch)
        nll = -logps[:, 0].sum()
        loss = losses.sum() / pairs
        if self.cfg.preference.sft_weight:
            loss = loss + self.cfg.preference.sft_weight * nll / max(chosen_tokens, 1.0)
        return loss, pref_loss.metric_sums(losses, rewards, logps, nll, batch["seq_tokens"], batch["truncated"])

    def train_metrics(self, sums: list[float]) -> dict:
        out = pref_loss.metrics(sums, self.cfg.preference.sft_weight)
        out.pop("loss")  # the loop logs the loss itself
        return out

    # ---- evaluation -----------------------------------------------------------------------------
    def eval_sums(self, model, batch: dict) -> list[float]:
        """pref_loss.SUMS and the samples: additive across ranks."""
        losses, rewards, logps = self._terms(model, batch)
        sums = pref_loss.metric_sums(losses, rewards, logps, -logps[:, 0].sum(), batch["seq_tokens"],
                                     batch["truncated"])
        return [*sums.tolist(), float(batch["samples"])]

    def eval_metrics(self, sums: list[float]) -> dict:
        return {**pref_loss.metrics(sums[:-1], self.cfg.preference.sft_weight, "eval/"), "eval/samples": int(sums[-1])}

    # ---- outputs --------------------------------------------------------------------------------
    def summary_extra(self) -> dict:
        s = self.data.summary
        keys = ("records", "pairs", "truncated", "dropped", "dropped_by", "supervised_tokens", "packing_efficiency",
                "packed_rows")
        return {"train_samples": len(self.train_set), "val_samples": len(self.val_set),
                "vocab_size": len(self.tokenizer), "reference": self.reference.name,
                **{f"data_{k}": s[k] for k in keys if k in s}}


def disable_dropout(model: torch.nn.Module) -> None:
    """TRL's rule (trl.trainer.utils.disable_dropout_in_model: every nn.Dropout gets p = 0; peft's LoRA dropout
    is one), and what it misses: the attention of the Llama family (llama, mistral, qwen2, qwen3, gemma2,
    gemma3, phi3) keeps the config's attention_dropout as a float and hands it to the attention kernel in
    training mode. Every float attribute whose name ends in `dropout` is zeroed too (GPT-2's attention reads
    its nn.Dropout's p). The config is left as it is: the exported model keeps the base's settings."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if name.endswith("dropout") and isinstance(value, float):
                setattr(module, name, 0.0)
