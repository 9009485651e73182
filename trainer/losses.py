"""Advantage estimation and the policy losses.

GRPO, as we implement it (departures from the paper, Shao et al. 2024):

* Advantages are group-normalised outcome rewards, ``A_i = (r_i - mean(r)) / (std(r) + eps)`` with the *population*
  std of the group; every model token of a sample gets its sample's advantage.
* Token-level averaging (as DAPO argues): the loss is summed over every model token of the whole batch and divided by
  the batch's model-token count, not averaged per sequence first. Micro-batches pass the global count as ``denom``.
* No KL term in the loss (the reference-KL belongs to a later issue); the PPO-style ratio is taken against
  ``old_logprobs`` (the trainer's own log-probs before the update; with one optimizer step per batch they equal the
  current ones detached, so the ratio is 1 and the clip is inactive).
* Off-policy correction (asynchronous rollouts): each token's loss is multiplied by a truncated importance weight
  ``min(pi_old / pi_behaviour, C)`` (detached), where ``pi_behaviour`` is the engine's log-prob when it sampled it.
* Metric ``is_approx_k3_kl``: the k3 estimator of KL(behaviour || old), ``mean(r - 1 - log r)`` with
  ``r = pi_old / pi_behaviour`` over model tokens: how far the engine's policy drifted from the trainer's.
"""

from __future__ import annotations

from collections import defaultdict

import torch


def group_advantages(rewards: list[float], group_ids: list[str], eps: float = 1e-6) -> list[float]:
    """Group-normalised advantages; a group whose rewards are all equal gets zeros."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        groups[g].append(i)
    adv = [0.0] * len(rewards)
    for idx in groups.values():
        r = torch.tensor([rewards[i] for i in idx], dtype=torch.float64)
        std = r.std(unbiased=False) if len(idx) > 1 else torch.tensor(0.0, dtype=torch.float64)
        a = (r - r.mean()) / (std + eps) if std > 0 else torch.zeros_like(r)
        for i, v in zip(idx, a.tolist(), strict=True):
            adv[i] = v
    return adv


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    denom: float,
    clip_eps: float = 0.2,
    tis_cap: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level clipped policy-gradient loss with truncated IS; all tensors ``[batch, seq]``.

    Returns the loss (sum over masked tokens / ``denom``) and summed metrics (divide by the token count).
    """
    mask = mask.to(logprobs.dtype)
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    pg = -torch.minimum(unclipped, clipped)
    log_is = (old_logprobs - behaviour_logprobs).detach()
    is_w = torch.exp(log_is)
    tis = torch.clamp(is_w, max=tis_cap)
    loss = (tis * pg * mask).sum() / denom
    with torch.no_grad():
        metrics = {
            "is_approx_k3_kl": ((is_w - 1 - log_is) * mask).sum(),
            "tis_mean": (tis * mask).sum(),
            "tis_truncated_frac": ((is_w > tis_cap).to(mask.dtype) * mask).sum(),
            "clip_frac": (((ratio - 1).abs() > clip_eps).to(mask.dtype) * mask).sum(),
            "logprob_abs_diff": ((old_logprobs - behaviour_logprobs).abs() * mask).sum(),
        }
    return loss, metrics


def sft_loss(logprobs: torch.Tensor, mask: torch.Tensor, denom: float) -> torch.Tensor:
    """Negative log-likelihood of the model tokens, summed and divided by ``denom`` (token-level mean)."""
    return -(logprobs * mask.to(logprobs.dtype)).sum() / denom
