"""The preference losses and their metrics, from each reply's summed log-probs (pure tensor math).

Each loss is TRL 1.16's (DPOTrainer._compute_loss; simpo: trl.experimental.cpo.CPOTrainer.cpo_loss), with
r = log pi(reply) - log pi_ref(reply) summed over the reply's target tokens and d = r_chosen - r_rejected:

    sigmoid  -log sigmoid(beta d)                                        (DPO)
    hinge    max(0, 1 - beta d)
    ipo      (r_chosen / n_chosen - r_rejected / n_rejected - 1 / (2 beta))^2   (n: the reply's targets)
    simpo    -log sigmoid(beta (lp_chosen / n_chosen - lp_rejected / n_rejected) - gamma)  (no reference)

Rewards are beta r (simpo: beta x the mean log-prob), as TRL logs them. The pair math runs in float64 (a
few numbers per pair), so a pair's loss is its float64 value from the summed log-probs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# The training-metric sums, in order (additive over micro-batches, ranks and steps)
SUMS = ("pairs", "loss", "chosen_rewards", "rejected_rewards", "correct", "chosen_logps", "rejected_logps",
        "truncated", "chosen_nll", "chosen_tokens")


def sequence_logps(logp: torch.Tensor, segments: torch.Tensor, n: int) -> torch.Tensor:
    """Each sequence's summed log-prob of its targets (float64, `n` sequences), from each target's log-prob
    `logp` and the sequence `segments` names for it (-1: none)."""
    keep = segments >= 0
    return torch.zeros(n, dtype=torch.float64, device=logp.device).index_add(
        0, segments[keep], logp[keep].double())


def pair_losses(settings, logps: torch.Tensor, ref: torch.Tensor | None,
                tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair losses and rewards ([chosen, rejected] per pair) from (pairs, 2) summed log-probs of the
    policy and the reference (None: simpo) and the replies' target counts."""
    beta, n = settings.beta, tokens.to(logps).clamp_min(1)
    if settings.loss == "simpo":
        mean = logps / n
        return -F.logsigmoid(beta * (mean[:, 0] - mean[:, 1]) - settings.simpo_gamma), beta * mean.detach()
    ratio = logps - ref.to(logps)
    d = ratio[:, 0] - ratio[:, 1]
    if settings.loss == "sigmoid":
        losses = -F.logsigmoid(beta * d)
    elif settings.loss == "hinge":
        losses = torch.relu(1 - beta * d)
    elif settings.loss == "ipo":
        per_token = ratio / n
        losses = (per_token[:, 0] - per_token[:, 1] - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown preference loss {settings.loss!r}")
    return losses, beta * ratio.detach()


def metric_sums(losses: torch.Tensor, rewards: torch.Tensor, logps: torch.Tensor, chosen_nll: torch.Tensor,
                tokens: torch.Tensor, truncated: int) -> torch.Tensor:
    """The SUMS of one micro-batch (detached, float64)."""
    pairs = float(len(losses))
    return torch.stack([torch.tensor(pairs, dtype=torch.float64, device=losses.device), losses.detach().sum(),
                        rewards[:, 0].sum(), rewards[:, 1].sum(), (rewards[:, 0] > rewards[:, 1]).double().sum(),
                        logps[:, 0].detach().sum(), logps[:, 1].detach().sum(),
                        torch.tensor(float(truncated), dtype=torch.float64, device=losses.device),
                        chosen_nll.detach(), tokens[:, 0].to(torch.float64).sum()])


def metrics(sums: list[float], sft_weight: float, prefix: str = "") -> dict:
    """rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies, logps/chosen, logps/rejected
    (means over pairs), the pair loss, the chosen replies' NLL per token, the loss (pair loss + sft_weight x
    NLL) and the pairs and truncated ones."""
    s = dict(zip(SUMS, sums))
    pairs = max(s["pairs"], 1.0)
    out = {"rewards/chosen": s["chosen_rewards"] / pairs, "rewards/rejected": s["rejected_rewards"] / pairs,
           "rewards/margins": (s["chosen_rewards"] - s["rejected_rewards"]) / pairs,
           "rewards/accuracies": s["correct"] / pairs, "logps/chosen": s["chosen_logps"] / pairs,
           "logps/rejected": s["rejected_logps"] / pairs, "pair_loss": s["loss"] / pairs,
           "nll/chosen": s["chosen_nll"] / max(s["chosen_tokens"], 1.0), "pairs": int(s["pairs"]),
           "pairs_truncated": int(s["truncated"])}
    out["loss"] = out["pair_loss"] + sft_weight * out["nll/chosen"]  # as the training step normalises it
    return {f"{prefix}{k}": v for k, v in out.items()}
