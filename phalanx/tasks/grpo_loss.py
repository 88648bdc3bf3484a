"""GRPO's arithmetic, as TRL 1.16's GRPOTrainer defines it: group-relative advantages, the clipped surrogate with
its KL term, and the three normalisations made global.

Advantages (per completion): r = sum_f w_f r_f (None -> left out; all None -> no reward), A = r - mean of its
group's r, divided by std + 1e-4 (scale_rewards: the group's std, or the whole global batch's; none: not
divided); the std is unbiased (Bessel), as TRL's nanstd. A completion without a reward gets A = 0.

Per completion token t of completion i (ratio = exp(logp - old logp); with num_iterations = 1, old = logp
detached, so the ratio is 1 and its gradient the policy gradient; with mu > 1, old = the log-probs of the policy
that generated the batch, kept for its mu steps):
    l_it = -min(ratio A_i, clip(ratio, 1 - epsilon, 1 + epsilon_high) A_i) + beta (exp(ref - logp) - (ref - logp) - 1)
The loss over the global batch (M: each completion's loss tokens; N: completions; T: loss tokens, all counted over
every micro-batch of every rank by the loop's one all-reduce):
    grpo      sum_i (sum_t l_it / max(|M_i|, 1)) / N
    dr_grpo   sum_i sum_t l_it / (N x max_completion_length)
    dapo      sum_i sum_t l_it / max(T, 1)
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

SCALE_EPS = 1e-4


def combined(rewards: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """(n, F) rewards (NaN = None) -> (n,) weighted sums, NaN where every function said None."""
    total = np.nansum(rewards * weights[None, :], axis=1)
    total[np.isnan(rewards).all(axis=1)] = np.nan
    return total


def nanstd(x: np.ndarray, axis=None) -> np.ndarray:
    """Unbiased std ignoring NaN (NaN for fewer than 2 values), as TRL's nanstd."""
    count = np.sum(~np.isnan(x), axis=axis)
    with warnings.catch_warnings(), np.errstate(invalid="ignore", divide="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN group: its std is NaN
        mean = np.nanmean(x, axis=axis, keepdims=True)
        var = np.nansum((x - mean) ** 2, axis=axis) / (count - 1)
    return np.where(count > 1, np.sqrt(var), np.nan)


def group_stats(total: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray]:
    """Per group of `g` consecutive completions: the mean and unbiased std of their rewards (NaN ignored)."""
    grouped = total.reshape(-1, g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN group: its mean is NaN
        mean = np.nanmean(grouped, axis=1)
    return mean, nanstd(grouped, axis=1)


def advantages(total: np.ndarray, g: int, scale: str, batch_std: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(n,) advantages of completions in groups of `g`, and per group whether its rewards have no spread.
    `batch_std`: the global batch's reward std (scale=batch)."""
    mean, std = group_stats(total, g)
    adv = total - np.repeat(mean, g)
    if scale == "group":
        adv = adv / (np.repeat(std, g) + SCALE_EPS)
    elif scale == "batch":
        adv = adv / (batch_std + SCALE_EPS)
    zero_spread = np.isclose(np.nan_to_num(std, nan=0.0), 0.0)
    return np.nan_to_num(adv, nan=0.0), zero_spread


def batch_moments(total: np.ndarray) -> list[float]:
    """[sum, sum of squares, count] of the rewards that exist: all-reduced, they give the batch's std."""
    ok = total[~np.isnan(total)]
    return [float(ok.sum()), float((ok * ok).sum()), float(ok.size)]


def std_of(moments: list[float]) -> float:
    s, sq, n = moments
    if n < 2:
        return float("nan")
    return float(np.sqrt(max(sq - s * s / n, 0.0) / (n - 1)))


def token_losses(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, epsilon: float, epsilon_high: float,
                 beta: float, ref: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
    """Each loss token's l_it, and its terms for the metrics (ratios clipped low / high, the KL)."""
    ratio = torch.exp(logp - old)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    loss = -torch.min(ratio * adv, clipped * adv)
    terms = {"low": ((ratio < 1 - epsilon) & (adv < 0)), "high": ((ratio > 1 + epsilon_high) & (adv > 0))}
    if beta:
        d = ref - logp
        kl = torch.exp(d) - d - 1
        loss = loss + beta * kl
        terms["kl"] = kl.detach()
    return loss, terms


def aggregate(loss: torch.Tensor, loss_type: str, inv_len: torch.Tensor, completions: float, tokens: float,
              max_completion_length: int) -> torch.Tensor:
    """This micro-batch's part of the global batch's loss (`completions`, `tokens`: the global counts);
    `inv_len`: per loss token, 1 / its completion's loss tokens."""
    if loss_type == "grpo":
        return (loss * inv_len).sum() / completions
    if loss_type == "dr_grpo":
        return loss.sum() / (completions * max_completion_length)
    return loss.sum() / max(tokens, 1.0)
