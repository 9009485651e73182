"""Advantage estimation and the policy-loss family. Every tensor is ``[batch, seq]`` aligned with target tokens.

How each departs from its paper:

* **GRPO** (Shao et al. 2024): advantages are group-normalised outcome rewards ``(r - mean) / (std + eps)`` with the
  population std; a group with equal rewards gets zeros. No KL in the reward; the KL to a reference is an optional
  loss term (``kl_coef``). Token-level averaging (as DAPO argues): the loss is summed over all model tokens of the
  whole batch and divided by the batch's model-token count, not averaged per sequence first.
* **DAPO** (Yu et al. 2025) is GRPO plus asymmetric clipping (``clip_high > clip_low``, "clip-higher") and dynamic
  sampling (groups with zero reward variance are left out by the controller, ``drop_uniform_groups``); we do not
  over-sample to refill the batch, and we apply no overlong-reward shaping.
* **GSPO** (Zheng et al. 2025): the ratio is per sequence, the geometric mean ``exp(mean_t(logp - old))`` over the
  sequence's model tokens, clipped per sequence; the loss is the mean over sequences. Off-policy correction for GSPO
  uses sequence-level weights.
* **RLOO** (Ahmadian et al. 2024): leave-one-out baseline, each sample's reward minus the mean reward of the other
  samples of its group (no division by a std; a group of one gets zero). The paper pairs it with a plain
  sequence-level REINFORCE loss; here it feeds GRPO's clipped token surrogate with token-level averaging. Group
  members are samples, as for GRPO (a trajectory with several trained segments counts once per segment).
* **REINFORCE++** (Hu et al. 2025): no group baseline; each model token's return is normalised over the whole
  batch's model tokens, ``(G_t - mean) / (std + eps)`` (population std; all zeros when the batch's returns are
  equal), then GRPO's clipped token surrogate. ``G_t`` is the outcome reward (with ``turn_credit``, the turn's
  return). ``kl_in_reward`` puts the KL to the reference into the reward as the paper does: token ``t`` gets
  ``-kl_coef * sum_{s >= t} k(behaviour_s, ref_s)`` over the sample's model tokens (undiscounted reward-to-go,
  ``kl_estimator``), and the KL loss term is then left out. With ``drop_uniform_groups`` (the default) groups of
  equal rewards never reach the batch statistics; turn it off for the paper's estimator.
* **CISPO** (MiniMax 2025): ``-sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * logp`` per token, ``r = pi / pi_old``:
  the clip bounds the detached weight only, so every token keeps its gradient (the PPO clip drops the gradient of
  clipped tokens). Token-level averaging as GRPO. The paper clips only above; set ``clip_low >= 1`` for that.
  ``clip_frac`` counts tokens whose weight was clipped.
* **PPO with a value model** (Schulman et al. 2017; GAE: Schulman et al. 2016), ``trainer.critic``: a critic of the
  policy's architecture, initialised from the policy's weights with a zero-initialised scalar head, gives ``V_t`` at
  every model token; GAE with ``gamma``/``lam`` runs over the model tokens only (environment tokens between turns
  belong to the transition and add no step), with the episode reward at the last model token or, with
  ``turn_credit``, each turn's reward at its last model token. Advantages are whitened over the batch's model tokens
  (``whiten_advantages``) and feed GRPO's clipped token surrogate (with the same off-policy correction and
  token-level averaging); the critic regresses the returns ``A + V_old`` with PPO's clipped value loss
  (``value_clip``, ``value_coef``). Departures: no KL penalty in the reward (``kl_coef`` stays a loss term), one
  pass over each batch (``minibatches`` splits it; no PPO epochs), the critic has its own optimizer instead of a
  shared loss ``L_pi + c * L_V``, and a truncated episode is treated as terminal.
* **Off-policy corrections** against the engine's behaviour log-probs (asynchronous rollouts): token-level truncated
  IS ``min(r, C)`` (``tis``), token masking ``[low <= r <= C]`` (``mis``), sequence-level truncated IS of the product
  of ratios (``seq_tis``) or sequence masking on the geometric mean (``seq_mis``, also named ``geo_seq_mis``),
  truncated IS of the geometric mean ``min(exp(mean_t log r), C)`` (``geo_seq_tis``: length-independent, where the
  product's weight shrinks or explodes with length), with ``r = pi_old / pi_behaviour``. Two masking rules follow
  their papers:

  - ``m2po`` (M2PO, Zheng et al. 2025): per micro-batch, sort its model tokens by ``(log r)^2`` and drop the fewest
    largest ones so that the mean ``(log r)^2`` of the tokens kept is ``<= m2po_tau`` (ties: the earlier token
    first); kept tokens weigh ``min(r, C)`` as under ``tis``. The paper's objective is ``M * pi / pi_behaviour * A``
    (no proximal policy); with ours in between that is ``M * r * pi / pi_old * A``, and the cap is AReaL's on its
    decoupled behaviour weight (a mask that left kept tokens at 1 ignored their behaviour mismatch, and collapsed the
    demo at a staleness bound of 4: docs/results.md). The paper bounds the whole batch's second moment; a
    micro-batch bound implies the batch's (a mean of means each within the bound), dropping at least as many tokens.
    The paper also trains without the PPO clip; here the configured loss keeps its own.
  - ``opsm`` (off-policy sequence masking, DeepSeek-V3.2): a sequence whose mean advantage over its model tokens is
    negative and whose mean ``log(pi_behaviour / pi)`` over them exceeds ``opsm_delta`` weighs 0, every other
    sequence 1. ``pi`` is the current policy (detached), so the rule tracks drift within an update too.
  ``old`` is the trainer's own log-probs before the update: recomputed by a no-grad pass (``recompute_old``), or, with
  one update per batch, the current log-probs detached (identical values, one pass fewer).
* **KL to a reference** through engine scoring: ``k1 = logp - ref``, ``k2 = (logp - ref)^2 / 2``,
  ``k3 = exp(ref - logp) - 1 - (ref - logp)``, each per token with the same token-level averaging.
* **Distillation from teachers** (on-policy: the student's own samples scored by a teacher): as a per-token reward
  ``-distill_reward_coef * k(behaviour, teacher)`` added to the advantage (policy-gradient style, no group
  normalisation, no discounting: each token is credited with its own reverse-KL estimate), and/or as a loss term
  ``distill_loss_coef * KL`` (GKD style) with the k1/k2/k3 estimators above (teacher in place of the reference) or
  ``topk``: the reverse KL between both distributions coarsened to the teacher's top-k tokens plus one tail bucket.
  ``env_reward_coef`` scales the environment-reward advantage (0: pure distillation).
* **Full-vocabulary distillation terms** (``distill_loss_estimator``: ``full_rkl``, ``full_fkl``, ``jsd``): exact
  divergences between the student's and the teacher's whole next-token distributions at every model token, the
  teacher being a frozen model the trainer evaluates itself (``trainer.full_distill``, in position chunks so that no
  ``[tokens, vocab]`` tensor of a whole micro-batch exists). ``full_rkl`` is ``KL(s || t)`` (mode seeking),
  ``full_fkl`` is ``KL(t || s)`` (mean seeking, the supervised KD objective), and ``jsd`` is the generalised JSD of
  GKD (Agarwal et al. 2024), ``beta KL(t || m) + (1 - beta) KL(s || m)`` with ``m = beta t + (1 - beta) s``
  (``distill_jsd_beta``; 0.5 is the symmetric JSD, at most ``log 2``): as ``beta -> 0`` it approaches ``beta`` times
  the forward KL, as ``beta -> 1`` ``(1 - beta)`` times the reverse KL. GKD's on-policy loss is this term on the
  student's own samples with the policy gradient through the sampling left out, as here. Positions whose token was
  drawn from a restricted vocabulary compare both distributions renormalised over the allowed tokens.
* **Entropy bonus**: ``- entropy_coef * H`` per token.
* **Turn-level credit** (after RTPO): per-turn returns ``G_k = sum_{j >= k} gamma^(j-k) r_j`` normalised within the
  group at each turn index; the trainer updates turn by turn in reverse order (last turn first), one optimizer step
  per turn index. Our departure: turns are aligned by index across a group's trajectories, not by state.
* **Tree credit** (``tree_credit``, after RTPO's sparse reverse trees and AT2PO's per-turn values; with
  ``rollout.tree``): turns are aligned by *state*. A state's value is the mean return of the trajectories through
  it (roots and the branches started from it); a turn's advantage is ``(V(next) - V(root)) + (V(next) - V(here))``
  over the group's return std, the global-plus-local form of TreeRL rather than either paper's; updates run in
  reverse turn order, one optimizer step per turn depth, as for turn credit. ``trainer/tree_credit.py`` details it.
* **Phase bands** (``turn_phases``, both turn-level credits): a phase is a forward and backward pass over every
  episode with a turn at that depth, so one phase per depth costs up to 20 passes a step on 20-turn episodes (the
  long-horizon job's steps trained ~10x slower than GRPO's). ``turn_phases: N`` merges consecutive depths into at
  most ``N`` bands, still deepest first: the papers' turn-by-turn order only between bands. Within any phase, an
  episode with nothing to train in it is left out of the pass (no gradient lost).
* Metric ``is_approx_k3_kl``: the k3 estimate of KL(behaviour || old), ``mean(r - 1 - log r)`` over model tokens.
"""

from __future__ import annotations

import inspect
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch

from trainer import registry
from trainer.types import LossSettings, Sample


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


def rloo_advantages(rewards: list[float], group_ids: list[str]) -> list[float]:
    """Leave-one-out advantages: each reward minus the mean of the other rewards of its group (0 when alone)."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        groups[g].append(i)
    adv = [0.0] * len(rewards)
    for idx in groups.values():
        if len(idx) < 2:
            continue
        total = sum(rewards[i] for i in idx)
        for i in idx:
            adv[i] = rewards[i] - (total - rewards[i]) / (len(idx) - 1)
    return adv


def batch_normalise(rows: list[list[float]], masks: list[list[int]], eps: float = 1e-6) -> list[list[float]]:
    """Per-token values normalised over every masked token of the batch (population std; zeros, also off the mask,
    where the mask is 0 or all values are equal)."""
    flat = torch.tensor([v for row, m in zip(rows, masks, strict=True) for v, k in zip(row, m, strict=True) if k],
                        dtype=torch.float64)  # fmt: skip
    if flat.numel() < 2 or not bool(flat.std(unbiased=False) > 0):
        return [[0.0] * len(row) for row in rows]
    mean, std = float(flat.mean()), float(flat.std(unbiased=False))
    return [[(v - mean) / (std + eps) if k else 0.0 for v, k in zip(row, m, strict=True)]
            for row, m in zip(rows, masks, strict=True)]  # fmt: skip


def turn_returns(rewards: list[float], gamma: float) -> list[float]:
    """Discounted reward-to-go of each turn."""
    out, g = [0.0] * len(rewards), 0.0
    for k in range(len(rewards) - 1, -1, -1):
        g = rewards[k] + gamma * g
        out[k] = g
    return out


Baseline = Callable[[list[float], list[str]], list[float]]
"""Advantages of scalar returns from their group keys (:func:`group_advantages`, :func:`rloo_advantages`)."""


@dataclass
class AdvantagePlan:
    """Per-token advantages of every sample and the update phases (token masks per sample, in update order)."""

    advantages: list[list[float]]
    phases: list[list[list[int]]]
    """``phases[p][i]``: which tokens of sample ``i`` phase ``p`` trains (one full-mask phase without turn credit)."""


def plan_advantages(samples: list[Sample], cfg: LossSettings) -> AdvantagePlan:
    if cfg.name == "sft":
        return AdvantagePlan([[0.0] * len(s.token_ids) for s in samples], [[list(s.loss_mask) for s in samples]])
    gids = [s.group_id or s.sample_id for s in samples]
    estimate = registry.resolve("advantages", cfg.name) if cfg.name in registry.ADVANTAGES else group_plan
    plan = estimate(samples, gids, cfg)
    if cfg.env_reward_coef != 1.0:
        plan.advantages = [[cfg.env_reward_coef * a for a in row] for row in plan.advantages]
    if cfg.distill_reward_coef > 0:
        for row, s in zip(plan.advantages, samples, strict=True):
            for t, r in enumerate(distill_rewards(s, cfg.distill_reward_estimator)):
                row[t] += cfg.distill_reward_coef * r
    if cfg.turn_phases is not None:
        plan.phases = band_phases(plan.phases, cfg.turn_phases)
    return plan


def band_phases(phases: list[list[list[int]]], most: int) -> list[list[list[int]]]:
    """At most ``most`` phases: consecutive phases merged into bands of near-equal size, in the same order (a token
    is trained in exactly one phase, so a band's mask is the sum of its phases')."""
    if len(phases) <= most:
        return phases
    out = []
    for b in range(most):
        band = phases[b * len(phases) // most : (b + 1) * len(phases) // most]
        out.append([[sum(col) for col in zip(*rows, strict=True)] for rows in zip(*band, strict=True)])
    return out


def group_plan(
    samples: list[Sample], gids: list[str], cfg: LossSettings, baseline: Baseline = group_advantages
) -> AdvantagePlan:
    """GRPO's advantages: ``baseline`` over each group's rewards (with turn credit: over each turn index's returns;
    with tree credit: from the tree's state values, :mod:`trainer.tree_credit`)."""
    if cfg.tree_credit:
        from trainer.tree_credit import tree_advantages, tree_phases

        return AdvantagePlan(*tree_phases(samples, tree_advantages(samples, gids)))
    if cfg.turn_credit:
        return _turn_plan(samples, gids, cfg.gamma, baseline)
    adv = baseline([s.reward for s in samples], gids)
    return AdvantagePlan([[a] * len(s.token_ids) for a, s in zip(adv, samples, strict=True)], [_full(samples)])


def rloo_plan(samples: list[Sample], gids: list[str], cfg: LossSettings) -> AdvantagePlan:
    """RLOO: GRPO's plan with the leave-one-out baseline in place of group normalisation."""
    return group_plan(samples, gids, cfg, rloo_advantages)


def batch_plan(samples: list[Sample], gids: list[str], cfg: LossSettings) -> AdvantagePlan:
    """REINFORCE++: per-token returns (the reward, or the turn's return; minus the KL to go with ``kl_in_reward``)
    normalised over all model tokens of the batch."""
    if cfg.turn_credit:
        plan = _turn_plan(samples, gids, cfg.gamma, lambda values, keys: values)  # raw returns per token
    else:
        plan = AdvantagePlan([[s.reward] * len(s.token_ids) for s in samples], [_full(samples)])
    if cfg.kl_in_reward:
        for row, s in zip(plan.advantages, samples, strict=True):
            for t, c in enumerate(kl_to_go(s, cfg.kl_estimator)):
                row[t] -= cfg.kl_coef * c
    trained = [[int(any(phase[i][t] for phase in plan.phases)) for t in range(len(s.token_ids))]
               for i, s in enumerate(samples)]  # fmt: skip
    plan.advantages = batch_normalise(plan.advantages, trained)
    return plan


def kl_to_go(sample: Sample, estimator: str) -> list[float]:
    """``sum_{s >= t} k(behaviour_s, ref_s)`` over the sample's model tokens at each position ``t``."""
    if sample.ref_logprobs is None or len(sample.ref_logprobs) != len(sample.token_ids):
        raise ValueError(f"sample {sample.sample_id!r} has no aligned reference log-probs (kl_in_reward)")
    beh = torch.tensor(sample.behaviour_logprobs, dtype=torch.float64)
    ref = torch.tensor(sample.ref_logprobs, dtype=torch.float64)
    k = kl_penalty(beh, ref, estimator) * torch.tensor(sample.loss_mask, dtype=torch.float64)
    return k.flip(0).cumsum(0).flip(0).tolist()


def distill_rewards(sample: Sample, estimator: str) -> list[float]:
    """Per-token reward ``-k(behaviour, teacher)`` at the model's tokens (0 elsewhere): the reverse KL to the
    teacher estimated from the token the student sampled (k1: ``teacher - behaviour``)."""
    if sample.teacher_logprobs is None:
        raise ValueError(f"sample {sample.sample_id!r} has no teacher log-probs (distill_reward_coef > 0)")
    if len(sample.teacher_logprobs) != len(sample.token_ids):
        raise ValueError(f"sample {sample.sample_id!r}: teacher log-probs are not aligned with its tokens")
    beh = torch.tensor(sample.behaviour_logprobs, dtype=torch.float64)
    teacher = torch.tensor(sample.teacher_logprobs, dtype=torch.float64)
    mask = torch.tensor(sample.loss_mask, dtype=torch.float64)
    return (-kl_penalty(beh, teacher, estimator) * mask).tolist()


def _full(samples: list[Sample]) -> list[list[int]]:
    return [list(s.loss_mask) for s in samples]


def _turn_plan(
    samples: list[Sample], gids: list[str], gamma: float, baseline: Baseline = group_advantages
) -> AdvantagePlan:
    """Per-turn returns through ``baseline`` within (group, turn index); phases from the last turn index to the
    first."""
    spans = [s.turn_spans or [(0, len(s.token_ids))] for s in samples]
    rewards = [s.turn_rewards or ([0.0] * (len(sp) - 1) + [s.reward]) for s, sp in zip(samples, spans, strict=True)]
    returns = [turn_returns(r, gamma) for r in rewards]
    keys, values = [], []
    for i, rets in enumerate(returns):
        for k, g in enumerate(rets):
            keys.append(f"{gids[i]}#{k}")
            values.append(g)
    flat = iter(baseline(values, keys))
    advs = [[0.0] * len(s.token_ids) for s in samples]
    depth = max(len(sp) for sp in spans)
    phases = [[[0] * len(s.token_ids) for s in samples] for _ in range(depth)]
    for i, sp in enumerate(spans):
        for k, (a, b) in enumerate(sp):
            value = next(flat)
            for t in range(a, b):
                advs[i][t] = value
                phases[depth - 1 - k][i][t] = samples[i].loss_mask[t]
    return AdvantagePlan(advs, phases)


def weights_none(r: torch.Tensor, log_r: torch.Tensor, mask: torch.Tensor, cfg: LossSettings) -> torch.Tensor:
    return torch.ones_like(r)


def weights_tis(r: torch.Tensor, log_r: torch.Tensor, mask: torch.Tensor, cfg: LossSettings) -> torch.Tensor:
    return torch.clamp(r, max=cfg.is_cap)


def weights_mis(r: torch.Tensor, log_r: torch.Tensor, mask: torch.Tensor, cfg: LossSettings) -> torch.Tensor:
    return ((r >= cfg.is_low) & (r <= cfg.is_cap)).to(r.dtype)


def weights_seq_tis(r: torch.Tensor, log_r: torch.Tensor, mask: torch.Tensor, cfg: LossSettings) -> torch.Tensor:
    return torch.clamp(torch.exp(log_r.sum(-1, keepdim=True)), max=cfg.is_cap).expand_as(r)


def weights_seq_mis(r: torch.Tensor, log_r: torch.Tensor, mask: torch.Tensor, cfg: LossSettings) -> torch.Tensor:
    geo = torch.exp(log_r.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1))
    return ((geo >= cfg.is_low) & (geo <= cfg.is_cap)).to(r.dtype).expand_as(r)


def weights_geo_seq_tis(r: torch.Tensor, log_r: torch.Tensor, mask: torch.Tensor, cfg: LossSettings) -> torch.Tensor:
    """Truncated IS of each sequence's geometric-mean ratio ``min(exp(mean_t log r), C)``, on all its tokens."""
    geo = torch.exp(log_r.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1))
    return torch.clamp(geo, max=cfg.is_cap).expand_as(r)


def weights_m2po(r: torch.Tensor, log_r: torch.Tensor, mask: torch.Tensor, cfg: LossSettings) -> torch.Tensor:
    """M2PO's mask: drop the fewest tokens of largest ``(log r)^2`` so that the kept tokens' mean ``(log r)^2`` is
    at most ``m2po_tau`` (over the model tokens given, one micro-batch); the kept ones weigh ``min(r, is_cap)``."""
    keep = torch.ones_like(r)
    on = mask > 0
    sq = log_r[on].to(torch.float64) ** 2
    n = sq.numel()
    if n == 0:
        return keep * torch.clamp(r, max=cfg.is_cap)
    ordered, order = torch.sort(sq, descending=True, stable=True)
    tail = ordered.flip(0).cumsum(0).flip(0)  # tail[k]: the squares left after dropping the k largest
    fits = tail <= cfg.m2po_tau * torch.arange(n, 0, -1, dtype=torch.float64)
    k = int(torch.nonzero(fits)[0]) if bool(fits.any()) else n
    kept = torch.ones(n, dtype=r.dtype)
    kept[order[:k]] = 0.0
    keep[on] = kept
    return keep * torch.clamp(r, max=cfg.is_cap)


def weights_opsm(
    r: torch.Tensor,
    log_r: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossSettings,
    *,
    advantages: torch.Tensor | None = None,
    log_r_current: torch.Tensor | None = None,
) -> torch.Tensor:
    """Off-policy sequence masking: 0 on a sequence with negative mean advantage whose mean
    ``log(pi_behaviour / pi)`` exceeds ``opsm_delta``, 1 elsewhere (``pi``: the current policy, else the old)."""
    if advantages is None:
        raise ValueError("the opsm correction needs the advantages")
    n = mask.sum(-1).clamp(min=1)
    drift = -((log_r if log_r_current is None else log_r_current) * mask).sum(-1) / n
    seq_adv = (advantages * mask).sum(-1) / n
    return (~((seq_adv < 0) & (drift > cfg.opsm_delta))).to(r.dtype)[:, None].expand_as(r)


@cache
def _extra_inputs(fn: Callable[..., torch.Tensor]) -> frozenset[str]:
    """Which of the optional inputs a correction declares (the basic ones take only ``r, log_r, mask, cfg``)."""
    return frozenset(inspect.signature(fn).parameters) & {"advantages", "log_r_current"}


def off_policy_weights(
    old: torch.Tensor,
    behaviour: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossSettings,
    advantages: torch.Tensor | None = None,
    current: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Detached importance weights ``[b, s]`` correcting for the engine's (behaviour) policy, plus summed metrics.

    ``advantages`` and the ``current`` log-probs reach the corrections that declare them (``advantages``,
    ``log_r_current = current - behaviour``), such as ``opsm``."""
    log_r = ((old - behaviour) * mask).detach()
    r = torch.exp(log_r)
    metrics = {"is_approx_k3_kl": ((r - 1 - log_r) * mask).sum(), "logprob_abs_diff": (log_r.abs() * mask).sum()}
    fn = registry.resolve("off_policy", cfg.off_policy)
    extra: dict[str, torch.Tensor | None] = {}
    if "advantages" in _extra_inputs(fn):
        extra["advantages"] = None if advantages is None else advantages.detach()
    if "log_r_current" in _extra_inputs(fn):
        extra["log_r_current"] = None if current is None else ((current - behaviour) * mask).detach()
    w = fn(r, log_r, mask, cfg, **extra)
    metrics["is_weight_mean"] = (w * mask).sum()
    metrics["is_weight_zero_frac"] = ((w == 0).to(r.dtype) * mask).sum()
    return w, metrics


def replay_trust_region(
    logp: torch.Tensor, behaviour: torch.Tensor, adv: torch.Tensor, replayed: torch.Tensor, clip: float
) -> torch.Tensor:
    """Detached 0/1 weights: 0 on replayed tokens whose ratio ``pi / pi_behaviour`` is already past ``1 + clip``
    with a positive advantage or below ``1 - clip`` with a negative one (PPO's clip against the sampling policy:
    the surrogate there has no gradient), 1 elsewhere."""
    ratio = torch.exp(logp.detach() - behaviour)
    past = ((adv > 0) & (ratio > 1.0 + clip)) | ((adv < 0) & (ratio < 1.0 - clip))
    return 1.0 - (past & (replayed > 0)).to(logp.dtype)


def ppo_token_loss(
    logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate ``-min(r A, clip(r, 1-lo, 1+hi) A)`` and whether the clip was active."""
    ratio = torch.exp(logp - old)
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = -torch.minimum(ratio * adv, clipped * adv)
    return loss, ((ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)).detach()


def gspo_sequence_loss(
    logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence GSPO loss ``[b]`` with the geometric-mean ratio, and whether each sequence was clipped."""
    n = mask.sum(-1).clamp(min=1)
    seq_ratio = torch.exp(((logp - old) * mask).sum(-1) / n)
    seq_adv = (adv * mask).sum(-1) / n  # every token of a sequence carries the sequence's advantage
    clipped = torch.clamp(seq_ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = -torch.minimum(seq_ratio * seq_adv, clipped * seq_adv)
    return loss, ((seq_ratio < 1.0 - clip_low) | (seq_ratio > 1.0 + clip_high)).detach()


def kl_k1(d: torch.Tensor) -> torch.Tensor:
    return d


def kl_k2(d: torch.Tensor) -> torch.Tensor:
    return 0.5 * d**2


def kl_k3(d: torch.Tensor) -> torch.Tensor:
    return torch.exp(-d) - 1 + d


def kl_penalty(logp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from tokens sampled by pi (``d = logp - ref``)."""
    return registry.resolve("kl_estimator", estimator)(logp - ref)


def sft_loss(logprobs: torch.Tensor, mask: torch.Tensor, denom: float) -> torch.Tensor:
    """Negative log-likelihood of the model tokens, summed and divided by ``denom`` (token-level mean)."""
    return -(logprobs * mask.to(logprobs.dtype)).sum() / denom


@dataclass
class LossInputs:
    """One micro-batch's tensors for :func:`policy_loss` (all ``[b, s-1]``; ``ref``/``entropy`` optional)."""

    logp: torch.Tensor
    old: torch.Tensor
    behaviour: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    ref: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    teacher: torch.Tensor | None = None
    """Teacher log-probs of the target tokens ``[b, s-1]``."""
    teacher_top: torch.Tensor | None = None
    """Teacher log-probs of its top-k tokens ``[b, s-1, k]``."""
    student_top: torch.Tensor | None = None
    """The student's (differentiable) log-probs of the same top-k tokens ``[b, s-1, k]``."""
    divergence: torch.Tensor | None = None
    """Per-position divergence between the student's and the teacher's full next-token distributions ``[b, s-1]``
    (the full-vocabulary estimators; differentiable through the student, computed by ``trainer.full_distill``)."""
    replayed: torch.Tensor | None = None
    """1.0 on the tokens of replayed samples ``[b, s-1]`` (the replay trust region, ``replay_clip``)."""


def topk_reverse_kl(student_top: torch.Tensor, teacher_top: torch.Tensor) -> torch.Tensor:
    """``KL(s || t)`` per position ``[b, s-1]`` over the teacher's top-k tokens plus one bucket for every other token.

    Inputs are log-probs of the same k tokens ``[b, s-1, k]``. The tail bucket holds ``1 - sum(top)``, so the term
    also pulls the student's mass onto the teacher's support; by the data-processing inequality it is a lower bound
    of the full reverse KL, exact when the teacher's mass is all in its top-k."""

    def with_tail(top: torch.Tensor) -> torch.Tensor:
        tail = torch.log((-torch.expm1(torch.logsumexp(top, -1, keepdim=True))).clamp(min=1e-12))
        return torch.cat([top, tail], dim=-1)

    log_s, log_t = with_tail(student_top), with_tail(teacher_top)
    return (log_s.exp() * (log_s - log_t)).sum(-1)


def full_reverse_kl(student: torch.Tensor, teacher: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """``KL(s || t) = sum_v s_v (log s_v - log t_v)`` per position, from full log-prob rows ``[..., V]`` (``beta``
    unused: every full-vocabulary estimator takes it)."""
    return (student.exp() * (student - teacher)).sum(-1)


def full_forward_kl(student: torch.Tensor, teacher: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """``KL(t || s) = sum_v t_v (log t_v - log s_v)`` per position, from full log-prob rows ``[..., V]``."""
    return (teacher.exp() * (teacher - student)).sum(-1)


def generalized_jsd(student: torch.Tensor, teacher: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """GKD's generalised JSD ``beta KL(t || m) + (1 - beta) KL(s || m)``, ``m = beta t + (1 - beta) s``, per
    position, from full log-prob rows ``[..., V]``; ``0 < beta < 1``."""
    if not 0.0 < beta < 1.0:
        raise ValueError(f"the generalised JSD needs 0 < beta < 1, got {beta}")
    mix = torch.logaddexp(teacher + math.log(beta), student + math.log1p(-beta))
    to_mix_t = (teacher.exp() * (teacher - mix)).sum(-1)
    to_mix_s = (student.exp() * (student - mix)).sum(-1)
    return beta * to_mix_t + (1.0 - beta) * to_mix_s


def distill_loss(x: LossInputs, cfg: LossSettings, mask: torch.Tensor) -> torch.Tensor:
    """Summed per-token divergence from the teacher (masked); divide by the token count."""
    if cfg.distill_loss_estimator in registry.FULL_VOCAB_ESTIMATORS:
        if x.divergence is None:
            raise ValueError(
                f"the {cfg.distill_loss_estimator} distillation loss needs the full-vocabulary divergence computed "
                "against an in-trainer teacher (trainer.full_distill)"
            )
        return (x.divergence * mask).sum()
    if cfg.distill_loss_estimator == "topk":
        if x.teacher_top is None or x.student_top is None:
            raise ValueError("the top-k distillation loss needs the teacher's top-k log-probs on every sample")
        return (topk_reverse_kl(x.student_top, x.teacher_top) * mask).sum()
    if x.teacher is None:
        raise ValueError("distill_loss_coef > 0 needs teacher log-probs on every sample")
    return (kl_penalty(x.logp, x.teacher, cfg.distill_loss_estimator) * mask).sum()


def token_surrogate(
    x: LossInputs, cfg: LossSettings, w: torch.Tensor, mask: torch.Tensor, denom_tokens: float, denom_seqs: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO/DAPO: the clipped surrogate per token, importance-weighted, averaged over the batch's model tokens.
    Returns the loss and the summed count of clipped tokens."""
    tok_loss, clipped = ppo_token_loss(x.logp, x.old, x.advantages, cfg.clip_low, cfg.clip_high)
    return (w * tok_loss * mask).sum() / denom_tokens, (clipped.to(mask.dtype) * mask).sum()


def sequence_surrogate(
    x: LossInputs, cfg: LossSettings, w: torch.Tensor, mask: torch.Tensor, denom_tokens: float, denom_seqs: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO: the clipped surrogate per sequence (geometric-mean ratio), weighted by the sequence's mean IS weight,
    averaged over sequences."""
    seq_w = (w * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    seq_loss, clipped = gspo_sequence_loss(x.logp, x.old, x.advantages, mask, cfg.clip_low, cfg.clip_high)
    has = (mask.sum(-1) > 0).to(mask.dtype)
    return (seq_w * seq_loss * has).sum() / denom_seqs, (clipped.to(mask.dtype)[:, None] * mask).sum()


def cispo_surrogate(
    x: LossInputs, cfg: LossSettings, w: torch.Tensor, mask: torch.Tensor, denom_tokens: float, denom_seqs: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO: ``-sg(clip(r, 1-lo, 1+hi)) * A * logp`` per token, importance-weighted, averaged over the batch's model
    tokens; the gradient reaches every token. Returns the loss and the summed count of tokens whose weight was
    clipped."""
    ratio = torch.exp(x.logp.detach() - x.old.detach())
    weight = torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    clipped = ((ratio < 1.0 - cfg.clip_low) | (ratio > 1.0 + cfg.clip_high)).to(mask.dtype)
    return -(w * weight * x.advantages * x.logp * mask).sum() / denom_tokens, (clipped * mask).sum()


def nll(
    x: LossInputs, cfg: LossSettings, w: torch.Tensor, mask: torch.Tensor, denom_tokens: float, denom_seqs: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """SFT through the policy-loss interface: the token-level NLL (no ratio, nothing clipped)."""
    return sft_loss(x.logp, mask, denom_tokens), torch.zeros((), dtype=mask.dtype)


def policy_loss(
    x: LossInputs, cfg: LossSettings, denom_tokens: float, denom_seqs: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The configured objective for one micro-batch; metrics are sums (divide by the global token count)."""
    mask = x.mask.to(x.logp.dtype)
    w, metrics = off_policy_weights(x.old, x.behaviour, mask, cfg, x.advantages, x.logp)
    if cfg.replay_clip is not None and (x.replayed is not None or cfg.replay_clip_fresh):
        scope = mask if cfg.replay_clip_fresh or x.replayed is None else x.replayed * mask
        keep = replay_trust_region(x.logp, x.behaviour, x.advantages, scope, cfg.replay_clip)
        metrics["replay_tokens"] = scope.sum()
        metrics["replay_clipped"] = ((1 - keep) * mask).sum()
        w = w * keep
    loss, clip_frac = registry.resolve("loss", cfg.name)(x, cfg, w, mask, denom_tokens, denom_seqs)
    metrics["clip_frac"] = clip_frac
    if cfg.kl_coef > 0 and not cfg.kl_in_reward:  # in the reward instead: trainer.losses.batch_plan
        if x.ref is None:
            raise ValueError("kl_coef > 0 needs reference log-probs on every sample (score them with a ref engine)")
        kl = kl_penalty(x.logp, x.ref, cfg.kl_estimator) * mask
        loss = loss + cfg.kl_coef * kl.sum() / denom_tokens
        metrics["kl_ref"] = kl.detach().sum()
    if cfg.distill_loss_coef > 0:
        kl_t = distill_loss(x, cfg, mask)
        loss = loss + cfg.distill_loss_coef * kl_t / denom_tokens
        metrics["distill_kl"] = kl_t.detach()
    if x.teacher is not None:
        metrics["teacher_k1"] = ((x.logp.detach() - x.teacher) * mask).sum()
    if cfg.entropy_coef > 0:
        if x.entropy is None:
            raise ValueError("entropy_coef > 0 needs per-token entropies")
        loss = loss - cfg.entropy_coef * (x.entropy * mask).sum() / denom_tokens
    if x.entropy is not None:
        metrics["entropy"] = (x.entropy.detach() * mask).sum()
    return loss, metrics
