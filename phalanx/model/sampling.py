"""Generation for training in the loop (GRPO's rollouts): one small interface, and phalanx's own sampler.

`Generator.generate(prompt, seeds, max_new)` writes one completion per seed for one prompt. The interface is
all the task knows, so another backend (vLLM on GPUs) can stand behind it later.

`Sampler` is phalanx's: a KV-cached decoding loop over the model's own forward (the prompt run once, its cache
repeated for the rows), each row drawing from its own torch.Generator seeded by the caller. A call holds one
prompt's group only, so a row's logits never depend on what else is in the batch (a batch's shape changes the
low bits of the logits, and transformers' `generate` draws from the global RNG): completions are a function of
(weights, prompt, seed), whatever the world size or the micro-batch. A row stops at a stop token (the
assistant's end-of-turn, or EOS); the rows left keep decoding as a smaller batch.

Under FSDP2 every forward is collective (each unit's weights are gathered from all ranks), so the ranks decode
in lockstep: `agree(done)` (an all-reduce) says whether every rank's group is done, and a rank whose group ended
first keeps making one-token forwards until then. The cost: each decoding step gathers the whole model once,
plus one scalar all-reduce.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class Completions:
    ids: list[np.ndarray]     # per row: the tokens written, through the stop token where one came
    truncated: np.ndarray     # bool per row: it reached max_new without a stop token
    entropy: np.ndarray       # per row: the summed entropy (nats) of the distribution each token was drawn from


class Generator(Protocol):
    def generate(self, prompt: np.ndarray, seeds: list[int], max_new: int) -> Completions: ...


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False       # argmax (evaluation); the seeds are then unused


def row_seed(*parts: int) -> int:
    """A generator seed from integers (seed, step, prompt index, k): independent streams per row."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1, dtype=np.uint64)[0] >> 1)


class Sampler:
    """Sampling with a KV cache through `model`'s forward (a transformers causal LM, possibly under peft). Run
    on the unwrapped model: DDP's forward would wait for a backward that never comes."""

    def __init__(self, model: torch.nn.Module, stop_ids: list[int], sampling: Sampling, autocast=None,
                 agree: Callable[[bool], bool] | None = None):
        self.model, self.sampling = model, sampling
        self.stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long)
        self.autocast = autocast or contextlib.nullcontext
        self.agree = agree  # sharded weights: whether every rank is done (see the module's docstring)

    @torch.no_grad()
    def generate(self, prompt: np.ndarray, seeds: list[int], max_new: int) -> Completions:
        from transformers import DynamicCache

        model, n = self.model, len(seeds)
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()  # no dropout while sampling
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        tokens = np.zeros((n, max_new), dtype=np.int64)
        lengths = np.full(n, max_new, dtype=np.int64)
        entropy = np.zeros(n, dtype=np.float64)
        stops = self.stops.to(device)
        try:
            with self.autocast():
                cache = DynamicCache()  # filled in place by each forward (transformers 5's `cache` argument)
                out = model(input_ids=torch.as_tensor(prompt, device=device)[None], cache=cache, use_cache=True,
                            logits_to_keep=1)
                cache.batch_repeat_interleave(n)
                logits = out.logits[:, -1].float().expand(n, -1)
                live = np.arange(n)  # the rows still writing, in cache order
                for t in range(max_new):
                    picked, h = self._pick(logits, [gens[r] for r in live])
                    entropy[live] += h
                    tokens[live, t] = picked.cpu().numpy()
                    stopped = torch.isin(picked, stops).cpu().numpy()
                    lengths[live[stopped]] = t + 1
                    if stopped.all() or t == max_new - 1:
                        break
                    if self.agree is not None:  # not done here: every rank makes this step's forward
                        self.agree(False)
                    if stopped.any():  # finished rows leave the batch (and the cache)
                        keep = np.flatnonzero(~stopped)
                        cache.batch_select_indices(torch.as_tensor(keep, device=device))
                        live, picked = live[keep], picked[torch.as_tensor(keep, device=device)]
                    out = model(input_ids=picked[:, None], cache=cache, use_cache=True)
                    logits = out.logits[:, -1].float()
                while self.agree is not None and not self.agree(True):  # the other ranks' forwards gather too
                    model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=False,
                          logits_to_keep=1)
        finally:
            model.train(was_training)
        truncated = lengths == max_new
        if max_new:  # a stop token as the very last token is not a truncation
            truncated &= ~np.isin(tokens[:, max_new - 1], self.stops.numpy())
        return Completions([tokens[r, :lengths[r]] for r in range(n)], truncated, entropy)

    def _pick(self, logits: torch.Tensor, gens: list[torch.Generator]) -> tuple[torch.Tensor, np.ndarray]:
        """Each row's next token, drawn with its own generator, and the entropy of the tempered distribution
        (before top-k / top-p, as TRL measures it)."""
        s = self.sampling
        if s.greedy:
            return logits.argmax(-1), np.zeros(logits.shape[0])
        z = logits / s.temperature
        logp = F.log_softmax(z, -1)
        h = -(logp.exp() * logp).nan_to_num().sum(-1).double().cpu().numpy()
        if s.top_k and s.top_k < z.shape[-1]:
            kth = torch.topk(z, s.top_k, dim=-1).values[:, -1:]
            z = z.masked_fill(z < kth, -torch.inf)
        if s.top_p < 1.0:
            order = torch.sort(z, dim=-1, descending=True)
            probs = F.softmax(order.values, -1)
            before = probs.cumsum(-1) - probs  # the mass of the tokens ranked above each
            z = z.scatter(-1, order.indices, order.values.masked_fill(before >= s.top_p, -torch.inf))
        probs = F.softmax(z, -1).cpu()
        picked = [torch.multinomial(probs[r], 1, generator=g) for r, g in enumerate(gens)]
        return torch.cat(picked).to(logits.device), h
