"""Reinforcement learning with verifiable rewards (`task: grpo`): GRPO, Dr. GRPO and DAPO on a chat model.

A step's samples are prompts: train.global_batch_size counts prompts (TRL's counts completions), and each
brings grpo.num_generations (G) completions, all generated and trained on the rank that drew the prompt. The
loop's rollout seam (TaskBase.rollout) turns this rank's prompt micro-batches into training micro-batches:

1. generation: the current policy (the unwrapped model: no DDP forward) writes G completions per prompt with
   phalanx's sampler (model/sampling.py), one group per call, each row seeded by (train.seed, step, the
   prompt's index in the training set, k): completions do not depend on the world size or the micro-batch;
2. rewards (tasks/grpo_rewards.py) and group-relative advantages (tasks/grpo_loss.py); scale_rewards=batch
   all-reduces the rewards' moments (one small collective);
3. with grpo.beta > 0, the reference's per-token log-probs (LoRA's adapters off, or a frozen copy);
4. training rows: prompt + completion, right-padded, the completion's tokens the only targets (the output head
   runs only there, model/head.py, at the sampling temperature as TRL scores);
5. with grpo.num_iterations = mu > 1, the old policy's per-token log-probs (no dropout), and the rows are kept:
   the next mu - 1 steps draw the same prompts (the sampler repeats each global batch mu times, as TRL's
   RepeatSampler) and train on these rows again against those log-probs, without generating. A checkpoint holds
   the kept rows per rank (GenerationBatch), so a resume inside a generation batch trains on the same ones.

step_counts gives [completions, loss tokens]; the loop sums them over the global batch in its one all-reduce,
so each micro-batch's loss part is divided by global counts: 1, N processes and accumulation make one update.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from phalanx.core import dist
from phalanx.core.config import Config, ConfigError
from phalanx.data import tokenizer as toks
from phalanx.data.grpo import store
from phalanx.data.samplers import shuffled_order
from phalanx.model.build import model_builder
from phalanx.model.head import IGNORE, target_logprobs
from phalanx.model.sampling import Sampler, Sampling, row_seed
from phalanx.tasks import grpo_loss as L
from phalanx.tasks.chat import ChatTask
from phalanx.tasks.grpo_rewards import load_rewards, score, weights_of
from phalanx.tasks.pref_reference import Frozen
from phalanx.tasks.preference import disable_dropout

# Sums the rollout adds to the step's training metrics (additive over steps and ranks), then the loss's own,
# then (sum, sum of squares, count) per reward function
ROLLOUT = ("steps", "completions", "completion_tokens", "truncated", "groups", "zero_spread_groups", "reward_sum",
           "reward_sq", "reward_n", "entropy_sum", "generation_s", "reference_s")
LOSS = ("loss_tokens", "clip_low", "clip_high", "kl_sum")


class GRPOTask(ChatTask):
    name = "grpo"

    @staticmethod
    def rows_per_sample(cfg: Config) -> int:
        return cfg.grpo.num_generations  # a micro-batch's sample is a prompt: it trains on its G completions

    def __init__(self, cfg: Config, info):
        super().__init__(cfg, info)
        self.rewards = load_rewards(cfg)
        self.weights = weights_of(cfg)
        self.reference = None        # the frozen copy (grpo.reference resolved to model)
        self.lengths = [np.inf, -np.inf]  # completion length min / max over the log window (global)
        self.repeats = cfg.grpo.num_iterations
        self.generated_lengths = [np.inf, -np.inf]  # the last generation batch's shortest and longest completion
        self.generation = GenerationBatch()  # the generation batch the steps train on while num_iterations > 1

    # ---- in the launcher ------------------------------------------------------------------------
    @classmethod
    def check_config(cls, cfg: Config) -> None:
        g = cfg.grpo
        if not cfg.model.pretrained:
            raise ConfigError("config key 'model.pretrained': task grpo starts from a trained chat model (e.g. "
                              "runs/chat/final, or a GGUF or hub name); a model from scratch has nothing to sample")
        if g.max_completion_length >= cfg.model.block_size:
            raise ConfigError(f"config key 'grpo.max_completion_length': {g.max_completion_length} leaves no room for "
                              f"a prompt in model.block_size={cfg.model.block_size}")
        if g.beta and reference_kind(cfg) == "adapters_off" and not cfg.model.lora.r:
            raise ConfigError("config key 'grpo.reference': adapters_off needs LoRA (model.lora.r > 0)")
        load_rewards(cfg)
        super().check_config(cfg)

    @classmethod
    def check_resume(cls, cfg: Config, meta: dict, worlds: list[int]) -> None:
        mu, step, saved = cfg.grpo.num_iterations, int(meta.get("step", 0)), meta.get("world_size")
        if mu > 1 and step % mu and any(w != saved for w in worlds):
            raise ConfigError(f"config key 'grpo.num_iterations': the checkpoint at step {step} is inside a generation "
                              f"batch (one every {mu} steps) and was saved by {saved} processes, each keeping its own "
                              f"completions: resume it with {saved} processes (here {', '.join(map(str, worlds))}), "
                              f"or from a checkpoint at a multiple of {mu} steps")

    @classmethod
    def preflight(cls, cfg: Config) -> None:
        """The data step reads every record (a prompt set is small), so its checks are the preflight."""

    @classmethod
    def prepare_data(cls, cfg: Config, workers: int = 0, progress: bool = True) -> dict:
        summaries = store.prepare_prompts(cfg)
        cls.check_prepared(cfg)
        return summaries

    @classmethod
    def check_prepared(cls, cfg: Config) -> None:
        too_many = store.dropped_error(cfg)
        if too_many:
            raise ConfigError(too_many)

    @classmethod
    def is_prepared(cls, cfg: Config) -> bool:
        return store.is_prepared(cfg)

    # ---- in every worker ------------------------------------------------------------------------
    def open_data(self) -> None:
        cfg = self.cfg
        if self.info.is_local_main and not store.is_prepared(cfg):  # a worker started without the launcher
            store.prepare_prompts(cfg)
        deadline = time.time() + cfg.dist.startup_timeout_s
        while not store.is_prepared(cfg):
            if time.time() > deadline:
                raise TimeoutError("the prompt sets were not prepared in dist.startup_timeout_s")
            time.sleep(0.2)
        self.data = store.open_prompts(cfg)
        self.data.end_of_turn = [self.data.end_of_turn]  # chat's export reads a list
        self.data.template_tokens = []  # LoRA: only rows grown for a template train (ChatTask._adapted_tokens)
        self.tokenizer = toks.load_saved(self.data.tokenizer_dir)
        self.train_set, self.val_set = self.data.train, self.data.validation

    def train_order(self, data_order: int):
        return shuffled_order(len(self.train_set), lazy=True)

    def build_model(self, builder=None) -> torch.nn.Module:
        model = super().build_model(builder)
        if self.cfg.grpo.disable_dropout:
            disable_dropout(model)
        return model

    def attach(self, trainee, beat=None, progress=None) -> None:
        """The reference (grpo.beta > 0 without LoRA): a frozen copy of the initial model, built as the policy."""
        self.trainee = trainee
        if self.cfg.grpo.beta and reference_kind(self.cfg) == "model":
            builder = model_builder(self.cfg.train, self.info.device, self.info.world_size, trainee.amp_dtype, None)
            self.reference = builder.build(self.define_model, self.cfg.model.pretrained, mismatched=self.MISMATCHED,
                                           adapters=Frozen()).eval()

    def collate(self, dataset: store.PromptSet, indices) -> dict:
        items = [dataset.prompt(int(i)) for i in indices]
        return {"prompt_index": [int(i) for i in indices], "prompt_ids": [ids for ids, _ in items],
                "records": [r for _, r in items]}

    # ---- the rollout ----------------------------------------------------------------------------
    def sharded(self) -> bool:
        """FSDP2-sharded weights: every forward is collective, so ranks generate in lockstep."""
        return self.cfg.train.strategy == "fsdp" and self.info.world_size > 1

    def sampler(self, model, greedy: bool = False) -> Sampler:
        g, stops = self.cfg.grpo, [*self.data.end_of_turn, self.tokenizer.eos_token_id]
        sampling = Sampling(g.temperature, g.top_p, g.top_k, greedy)
        agree = (lambda done: dist.all_reduce([float(not done)], self.info, "max")[0] == 0) if self.sharded() else None
        return Sampler(model, [s for s in stops if s is not None], sampling, getattr(self.trainee, "autocast", None),
                       agree)

    def rank_states(self) -> dict:
        return {"grpo_generation": self.generation} if self.repeats > 1 else {}

    def rollout(self, trainee, batches: list[dict], step: int, beat=None) -> list[dict]:
        first = step - step % self.repeats  # the step that generated the batch this one trains on
        if step != first:
            return self._again(batches, step, first)
        out = self._generate(trainee, batches, step, beat)
        if self.repeats > 1:
            t0 = time.perf_counter()
            for b in out:
                b["old_logps"] = self._old_logps(trainee.model, b)
            out[0]["rollout_sums"][ROLLOUT.index("reference_s")] += time.perf_counter() - t0  # reference/old log-probs
            self.generation.keep(step, [b["prompt_index"] for b in batches], out, self.generated_lengths)
        return out

    def _again(self, batches: list[dict], step: int, first: int) -> list[dict]:
        """A later step of a generation batch: the kept rows, their rollout sums without the generation's time."""
        kept = self.generation
        if kept.step != first:
            raise ConfigError(f"config key 'grpo.num_iterations': step {step + 1} trains on the completions generated "
                              f"at step {first + 1}, which this rank does not hold: a checkpoint inside a generation "
                              f"batch (num_iterations={self.repeats}) resumes on the number of processes that saved "
                              f"it, since each rank keeps its own completions; resume with that --nproc-per-node, or "
                              f"from a checkpoint at a multiple of {self.repeats} steps")
        if kept.prompts != [b["prompt_index"] for b in batches]:
            raise RuntimeError(f"step {step + 1} drew other prompts than its generation batch (step {first + 1})")
        self.lengths = [min(self.lengths[0], kept.lengths[0]), max(self.lengths[1], kept.lengths[1])]
        timed = [ROLLOUT.index("generation_s"), ROLLOUT.index("reference_s")]
        out = []
        for b in kept.batches:
            sums = b["rollout_sums"].clone()
            sums[timed] = 0.0
            out.append({**b, "rollout_sums": sums})
        return out

    def _generate(self, trainee, batches: list[dict], step: int, beat=None) -> list[dict]:
        cfg, g = self.cfg, self.cfg.grpo
        sampler, t0 = self.sampler(trainee.model), time.perf_counter()
        made = []  # per micro-batch: [(prompt index, prompt ids, record, Completions)]
        for k, b in enumerate(batches):
            groups = []
            for idx, ids, record in zip(b["prompt_index"], b["prompt_ids"], b["records"]):
                seeds = [row_seed(cfg.train.seed, step, idx, j) for j in range(g.num_generations)]
                groups.append((idx, ids, record, sampler.generate(ids, seeds, g.max_completion_length)))
            made.append(groups)
            if beat:
                beat(k)
        generation_s = time.perf_counter() - t0
        flat = [(record, c, j) for groups in made for _, _, record, comps in groups for j, c in
                enumerate(zip(comps.ids, comps.truncated, comps.entropy))]
        rewards = self._score(flat)
        total = L.combined(rewards, self.weights)
        batch_std = None
        if g.scale_rewards == "batch":
            batch_std = L.std_of(dist.all_reduce(L.batch_moments(total), self.info))
        adv, zero_spread = L.advantages(total, g.num_generations, g.scale_rewards, batch_std)
        lengths = np.array([len(c[0]) for _, c, _ in flat])
        lo, hi = dist.all_reduce([-float(lengths.min()), float(lengths.max())], self.info, "max")
        self.generated_lengths = [-lo, hi]
        self.lengths = [min(self.lengths[0], -lo), max(self.lengths[1], hi)]
        t1 = time.perf_counter()
        out, start = [], 0
        for groups in made:
            n = len(groups) * g.num_generations
            out.append(self._rows(groups, adv[start:start + n]))
            out[-1]["row_rewards"] = torch.from_numpy(total[start:start + n].copy())  # for tests and debugging
            start += n
        if g.beta:
            for b in out:
                b["ref_logps"] = self._reference_logps(trainee.model, b)
        sums = self._rollout_sums(flat, rewards, total, zero_spread, generation_s, time.perf_counter() - t1)
        for i, b in enumerate(out):
            b["rollout_sums"] = sums if i == 0 else torch.zeros_like(sums)
        if self.info.is_main and g.log_completions_every and (step + 1) % g.log_completions_every == 0:
            self._log_completions(step + 1, made, rewards, adv)
        return out

    def _score(self, flat: list) -> np.ndarray:
        prompts, completions, ids, fields = [], [], [], []
        for record, (tokens, _, _), _ in flat:
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            conv = record["conversational"]
            prompts.append(record["messages"] if conv else record["messages"][-1]["content"])
            completions.append([{"role": "assistant", "content": text}] if conv else text)
            ids.append([int(t) for t in tokens])
            fields.append(record["fields"])
        return score(self.rewards, prompts, completions, ids, fields)

    def _rows(self, groups: list, adv: np.ndarray) -> dict:
        """Training rows of one micro-batch: prompt + completion, right-padded; the completion's tokens are the
        targets (all of them unless mask_truncated_completions drops a truncated one)."""
        g = self.cfg.grpo
        rows = [(ids, c, tr) for _, ids, _, comps in groups for c, tr in zip(comps.ids, comps.truncated)]
        width = max(len(p) + len(c) for p, c, _ in rows)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        input_ids = np.full((len(rows), width), pad, dtype=np.int64)
        labels = np.full((len(rows), width), IGNORE, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        active = np.zeros(len(rows), dtype=np.int64)
        for r, (p, c, truncated) in enumerate(rows):
            n = len(p) + len(c)
            input_ids[r, :n], mask[r, :n] = np.concatenate([p, c]), 1
            if not (g.mask_truncated_completions and truncated):
                labels[r, len(p) - 1:n - 1] = c
                active[r] = len(c)
        row_of = np.repeat(np.arange(len(rows)), active)  # each target's row, in row-major order
        return {"input_ids": torch.from_numpy(input_ids), "attention_mask": torch.from_numpy(mask),
                "labels": torch.from_numpy(labels), "completions": len(rows),
                "token_adv": torch.from_numpy(adv[row_of].astype(np.float32)),
                "token_inv_len": torch.from_numpy(1.0 / np.maximum(active[row_of], 1)).float(),
                "real_tokens": int(mask.sum())}

    def _token_logps(self, model, batch: dict) -> torch.Tensor:
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        return target_logprobs(model, inputs, batch["labels"], temperature=self.cfg.grpo.temperature).logp

    @torch.no_grad()
    def _old_logps(self, model, batch: dict) -> torch.Tensor:
        """The policy's per-token log-probs as it generated (eval mode: no dropout noise in the old policy)."""
        was_training = model.training
        model.eval()
        try:
            with self.trainee.autocast():
                return self._token_logps(model, batch)
        finally:
            model.train(was_training)

    @torch.no_grad()
    def _reference_logps(self, model, batch: dict) -> torch.Tensor:
        """The reference's per-token log-probs (eval mode): the frozen copy, or the policy with adapters off."""
        if self.reference is not None:
            with self.trainee.autocast():
                return self._token_logps(self.reference, batch)
        was_training, trainable = model.training, [p for p in model.parameters() if p.requires_grad]
        model.eval()
        try:
            with model.disable_adapter(), self.trainee.autocast():
                return self._token_logps(model, batch)
        finally:
            model.train(was_training)
            for p in trainable:  # peft's disable_adapter may leave trainable-token rows frozen
                p.requires_grad_(True)

    def _rollout_sums(self, flat, rewards, total, zero_spread, generation_s, reference_s) -> torch.Tensor:
        lengths = np.array([len(c[0]) for _, c, _ in flat], dtype=np.float64)
        ok = total[~np.isnan(total)]
        head = [1.0, len(flat), lengths.sum(), sum(bool(c[1]) for _, c, _ in flat), len(zero_spread),
                float(zero_spread.sum()), ok.sum(), (ok * ok).sum(), ok.size, sum(c[2] for _, c, _ in flat),
                generation_s, reference_s]
        per_fn = []
        for j in range(rewards.shape[1]):
            col = rewards[:, j][~np.isnan(rewards[:, j])]
            per_fn += [col.sum(), (col * col).sum(), col.size]
        return torch.tensor([*head, 0.0, 0.0, 0.0, 0.0, *per_fn], dtype=torch.float64)

    def _log_completions(self, step: int, made, rewards: np.ndarray, adv: np.ndarray) -> None:
        """A few of this rank's completions with their rewards, to RUN/completions.jsonl (TRL's log_completions)."""
        lines, i = [], 0
        for groups in made:
            for _, _, record, comps in groups:
                for c in comps.ids:
                    if len(lines) < self.cfg.grpo.log_completions_count:
                        lines.append({"step": step, "prompt": record["messages"][-1]["content"],
                                      "completion": self.tokenizer.decode(c, skip_special_tokens=True),
                                      "rewards": {r.name: _finite(rewards[i, j]) for j, r in enumerate(self.rewards)},
                                      "advantage": float(adv[i])})
                    i += 1
        path = Path(self.cfg.run_dir) / "completions.jsonl"
        with open(path, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)

    # ---- the training step ----------------------------------------------------------------------
    def step_counts(self, batch: dict) -> list[float]:
        """[completions, loss tokens]: the normalisers of grpo / dr_grpo and of dapo."""
        return [float(batch["completions"]), float(batch["token_adv"].numel())]

    def batch_tokens(self, batch: dict) -> int:
        return int(batch["input_ids"].numel()) if "input_ids" in batch else 0

    def useful_tokens(self, batch: dict) -> int:
        return int(batch.get("real_tokens", 0))

    def step_loss(self, model, batch: dict, totals: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.cfg.grpo
        logp = self._token_logps(model, batch)
        adv = batch["token_adv"]
        old = batch.get("old_logps")  # num_iterations > 1; on-policy, the current log-probs detached (ratio 1)
        old = logp.detach() if old is None else old
        losses, terms = L.token_losses(logp, old, adv, g.epsilon, g.epsilon_high or g.epsilon, g.beta,
                                       batch.get("ref_logps"))
        loss = L.aggregate(losses, g.loss_type, batch["token_inv_len"], totals[0], totals[1], g.max_completion_length)
        own = torch.tensor([float(adv.numel()), float(terms["low"].sum()), float(terms["high"].sum()),
                            float(terms["kl"].sum()) if "kl" in terms else 0.0], dtype=torch.float64)
        sums = batch["rollout_sums"].to("cpu", torch.float64).clone()
        sums[len(ROLLOUT):len(ROLLOUT) + len(LOSS)] += own
        return loss, sums

    def train_metrics(self, sums: list[float]) -> dict:
        s = dict(zip(ROLLOUT + LOSS, sums))
        steps, world = max(s["steps"], 1.0), self.info.world_size
        n, tokens = max(s["completions"], 1.0), max(s["loss_tokens"], 1.0)
        # TRL's names, grouped under a '/' so that `phalanx report` draws them (reward -> rewards/total/mean, ...)
        out = {"rewards/total/mean": _mean(s["reward_sum"], s["reward_n"]),
               "rewards/total/std": _std(s["reward_sum"], s["reward_sq"], s["reward_n"]),
               "completions/mean_length": s["completion_tokens"] / n,
               "completions/min_length": float(self.lengths[0]), "completions/max_length": float(self.lengths[1]),
               "completions/clipped_ratio": s["truncated"] / n,
               "rewards/frac_zero_std": s["zero_spread_groups"] / max(s["groups"], 1.0),
               "policy/entropy": s["entropy_sum"] / max(s["completion_tokens"], 1.0),
               "clip_ratio/low_mean": s["clip_low"] / tokens, "clip_ratio/high_mean": s["clip_high"] / tokens,
               "clip_ratio/region_mean": (s["clip_low"] + s["clip_high"]) / tokens,
               # per step, the mean over ranks (each rank generates its own prompts' completions)
               "time/generation_s": s["generation_s"] / steps, "time/reference_s": s["reference_s"] / steps,
               "completions/per_step": s["completions"] / (steps / world)}
        if self.cfg.grpo.beta:
            out["policy/kl"] = s["kl_sum"] / tokens
        base = len(ROLLOUT) + len(LOSS)
        for j, r in enumerate(self.rewards):
            total, sq, count = sums[base + 3 * j:base + 3 * j + 3]
            out[f"rewards/{r.name}/mean"], out[f"rewards/{r.name}/std"] = _mean(total, count), _std(total, sq, count)
        self.lengths = [np.inf, -np.inf]
        return out

    # ---- evaluation -----------------------------------------------------------------------------
    def eval_sums(self, model, batch: dict) -> list[float]:
        """Greedy completions of the held-out prompts: [samples, completion tokens, reward sum, reward count,
        then (sum, count) per reward function]."""
        sampler = self.sampler(getattr(model, "module", model), greedy=True)
        most = self.cfg.grpo.eval_max_tokens or self.cfg.grpo.max_completion_length
        prompts = list(zip(batch["prompt_ids"], batch["records"]))
        calls = len(prompts)
        if self.sharded():  # a rank with fewer prompts this round generates as often (throw-aways), in lockstep
            calls = int(dist.all_reduce([float(calls)], self.info, "max")[0])
        flat = []
        for k in range(calls):
            ids, record = prompts[min(k, len(prompts) - 1)]
            c = sampler.generate(ids, [0], most)
            if k < len(prompts):
                flat.append((record, (c.ids[0], c.truncated[0], c.entropy[0]), 0))
        rewards = self._score(flat)
        total = L.combined(rewards, self.weights)
        out = [float(len(flat)), float(sum(len(c[0]) for _, c, _ in flat)), float(np.nansum(total)),
               float((~np.isnan(total)).sum())]
        for j in range(rewards.shape[1]):
            out += [float(np.nansum(rewards[:, j])), float((~np.isnan(rewards[:, j])).sum())]
        return out

    def eval_metrics(self, sums: list[float]) -> dict:
        samples, tokens, total, count = sums[:4]
        out = {"eval/reward": _mean(total, count), "eval/completions/mean_length": tokens / max(samples, 1.0),
               "eval/samples": int(samples)}
        out["eval/rewards/total/mean"] = out["eval/reward"]  # beside its training curve in `phalanx report`
        for j, r in enumerate(self.rewards):
            out[f"eval/rewards/{r.name}/mean"] = _mean(sums[4 + 2 * j], sums[5 + 2 * j])
            if r.name == "math_answer":
                out["eval/accuracy"] = out[f"eval/rewards/{r.name}/mean"]
        return out

    # ---- outputs --------------------------------------------------------------------------------
    def summary_extra(self) -> dict:
        s = self.data.summary
        return {"train_samples": len(self.train_set), "val_samples": len(self.val_set),
                "vocab_size": len(self.tokenizer), "loss_type": self.cfg.grpo.loss_type,
                **{f"data_{k}": s[k] for k in ("records", "documents", "truncated", "dropped", "dropped_by")}}


class GenerationBatch:
    """This rank's rows of the generation batch in use (num_iterations > 1), as a checkpoint's per-rank JSON:
    tensors as (dtype, shape, values), exact for float32/float64 and integers."""

    def __init__(self):
        self.step, self.prompts, self.batches, self.lengths = None, [], [], [np.inf, -np.inf]

    def keep(self, step: int, prompts: list, batches: list[dict], lengths: list[float]) -> None:
        self.step, self.prompts, self.batches, self.lengths = step, prompts, batches, list(lengths)

    def state_dict(self) -> dict:
        if self.step is None:
            return {}
        rows = [{k: {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape),
                     "values": v.flatten().tolist()} if torch.is_tensor(v) else v for k, v in b.items()}
                for b in self.batches]
        return {"step": self.step, "prompts": self.prompts, "lengths": self.lengths, "batches": rows}

    def load_state_dict(self, state: dict) -> None:
        def tensor(v):
            if not (isinstance(v, dict) and "dtype" in v):
                return v
            return torch.tensor(v["values"], dtype=getattr(torch, v["dtype"])).reshape(v["shape"])
        self.keep(state["step"], state["prompts"], [{k: tensor(v) for k, v in b.items()} for b in state["batches"]],
                  state["lengths"])


def reference_kind(cfg: Config) -> str:
    r = cfg.grpo.reference
    return ("adapters_off" if cfg.model.lora.r else "model") if r == "auto" else r


def _mean(total: float, count: float) -> float:
    return total / count if count else float("nan")


def _std(total: float, sq: float, count: float) -> float:
    if count < 2:
        return float("nan")
    return float(np.sqrt(max(sq - total * total / count, 0.0) / (count - 1)))


def _finite(v: float) -> float | None:
    return None if np.isnan(v) else float(v)

