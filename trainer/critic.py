"""PPO's value model (the critic) and generalized advantage estimation over model tokens.

The critic is a second megatron-core ``GPTModel`` of the policy's architecture, initialised from the same HF weights
as the policy, whose output layer is replaced by a scalar head (:class:`ValueHead`, zero-initialised, so every value
starts at 0). It has its own AdamW (or, on CUDA, its own Megatron DDP and distributed optimizer), LR schedule and
gradient clipping, and shares no parameter with the policy: the value loss cannot reach the policy's weights, and
the policy's loss sees the critic only through the (detached, plain-float) advantages.

Values live on the same target-aligned grid as log-probs: grid position ``c`` is the head applied to the hidden
state at position ``c``, the value ``V_t`` of the state in which token ``t = c + 1`` is chosen. Aligned with
``token_ids`` (as returned by :meth:`Critic.values`), position ``t`` holds ``V_t`` and position 0 is unused.

GAE (:func:`gae`) runs over a sample's model tokens (``loss_mask == 1``) in order and skips every other token:
environment and prompt tokens between two turns are part of the transition from one model token to the next, so
they add no step, no discount and no reward of their own. For consecutive model tokens ``t`` and ``t'``::

    delta_t = r_t + gamma * V_t' - V_t            (V_t' = 0 after the sample's last model token: terminal)
    A_t     = delta_t + gamma * lam * A_t'
    R_t     = A_t + V_t                           (the critic's regression target)

Rewards (:func:`token_rewards`) are 0 except: the sample's reward at its last model token, or, with
``turn_credit``, each ``Sample.turn_rewards[k]`` at the last model token of turn ``k``. A truncated episode is
treated as terminal. The value loss is PPO's clipped one, ``0.5 * max((V - R)^2, (V_clip - R)^2)`` with
``V_clip = V_old + clip(V - V_old, -value_clip, value_clip)``, averaged over the batch's model tokens and weighted by
``value_coef``; ``V_old`` are the values the advantages were computed from (before the update).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from trainer.batching import MicroBatch, Packing
from trainer.losses import AdvantagePlan, distill_rewards
from trainer.model import _logits, _on_grid, _stream_logits, build_gpt_model, load_into_model, unwrap_model
from trainer.parallel import ParallelAdamW, allreduce_grads, allreduce_sum, allreduce_tp_partial_grads
from trainer.types import LossSettings, Sample, TrainerSettings
from transfer_mesh.layouts import ModelSpec

__all__ = ["Critic", "GAEPlan", "ValueHead", "clipped_value_loss", "gae", "gae_plan", "token_rewards", "token_values"]


# ------------------------------------------------------------------------------------------------------- GAE


def token_rewards(sample: Sample, cfg: LossSettings) -> list[float]:
    """Per-token rewards of one sample (aligned with ``token_ids``; 0 off the model tokens).

    The environment's reward (scaled by ``env_reward_coef``) sits at the last model token, or with ``turn_credit``
    each turn's reward at the last model token of that turn (at or before the turn's end; the sample's first model
    token for a turn with none). ``distill_reward_coef`` adds the per-token distillation reward at every model token.
    """
    n = len(sample.token_ids)
    model = [t for t in range(n) if sample.loss_mask[t]]
    rewards = [0.0] * n
    if not model:
        return rewards
    if cfg.turn_credit and sample.turn_spans:
        per_turn = sample.turn_rewards or [0.0] * (len(sample.turn_spans) - 1) + [sample.reward]
        for (_, end), r in zip(sample.turn_spans, per_turn, strict=True):
            at = max((t for t in model if t < end), default=model[0])
            rewards[at] += cfg.env_reward_coef * r
    else:
        rewards[model[-1]] += cfg.env_reward_coef * sample.reward
    if cfg.distill_reward_coef > 0:
        for t, r in enumerate(distill_rewards(sample, cfg.distill_reward_estimator)):
            rewards[t] += cfg.distill_reward_coef * r
    return rewards


def gae(
    rewards: list[float], values: list[float], mask: list[int], gamma: float, lam: float
) -> tuple[list[float], list[float]]:
    """Advantages and returns (aligned with the inputs, 0 off ``mask``) by GAE over the masked positions only."""
    adv, ret = [0.0] * len(rewards), [0.0] * len(rewards)
    running, next_value = 0.0, 0.0  # past the last model token: terminal
    for t in reversed([t for t, m in enumerate(mask) if m]):
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        adv[t], ret[t] = running, running + values[t]
        next_value = values[t]
    return adv, ret


@dataclass
class GAEPlan(AdvantagePlan):
    """An :class:`AdvantagePlan` from the critic, with what the value loss needs."""

    returns: list[list[float]] = field(default_factory=list)
    """``R_t`` per token of each sample (the critic's targets; 0 off the model tokens)."""
    values: list[list[float]] = field(default_factory=list)
    """``V_old`` per token of each sample (the values the advantages came from)."""
    stats: dict[str, float] = field(default_factory=dict)
    """``value_mean``, ``return_mean``, ``explained_variance`` over the batch's model tokens."""


def gae_plan(
    samples: list[Sample], gids: list[str], cfg: LossSettings, values: list[list[float]] | None = None
) -> GAEPlan:
    """PPO's advantages: GAE from the critic's ``values`` (aligned with each sample's ``token_ids``), whitened over
    the batch's model tokens when ``whiten_advantages``; one update phase over every model token."""
    if values is None:
        raise ValueError("ppo's advantages come from the critic: the trainer computes its values (trainer.critic)")
    advs, rets = [], []
    for s, v in zip(samples, values, strict=True):
        a, r = gae(token_rewards(s, cfg), v, s.loss_mask, cfg.gamma, cfg.lam)
        advs.append(a)
        rets.append(r)
    masks = [list(s.loss_mask) for s in samples]
    flat = _masked(advs, masks)
    if cfg.whiten_advantages and flat.numel() > 0:
        mean, std = float(flat.mean()), float(flat.std(unbiased=False))
        advs = [[(x - mean) / (std + 1e-6) if k else 0.0 for x, k in zip(row, m, strict=True)]
                for row, m in zip(advs, masks, strict=True)]  # fmt: skip
    stats = _value_stats(_masked(rets, masks), _masked(values, masks))
    return GAEPlan(advs, [masks], returns=rets, values=[list(v) for v in values], stats=stats)


def _masked(rows: list[list[float]], masks: list[list[int]]) -> torch.Tensor:
    return torch.tensor([x for row, m in zip(rows, masks, strict=True) for x, k in zip(row, m, strict=True) if k],
                        dtype=torch.float64)  # fmt: skip


def _value_stats(returns: torch.Tensor, values: torch.Tensor) -> dict[str, float]:
    """Mean value and return, and ``1 - Var(R - V) / Var(R)`` (0 when the returns do not vary)."""
    if returns.numel() == 0:
        return {"value_mean": 0.0, "return_mean": 0.0, "explained_variance": 0.0}
    var = float(returns.var(unbiased=False))
    varies = var > 1e-12 * float(returns.pow(2).mean())  # not just rounding of equal returns
    ev = 1.0 - float((returns - values).var(unbiased=False)) / var if varies else 0.0
    return {"value_mean": float(values.mean()), "return_mean": float(returns.mean()), "explained_variance": ev}


def critic_rows(plan: AdvantagePlan, i: int) -> tuple[list[float], ...]:
    """Sample ``i``'s critic targets ``(returns, old values)`` for a trainer row; nothing without a critic."""
    return (plan.returns[i], plan.values[i]) if isinstance(plan, GAEPlan) else ()


def clipped_value_loss(
    v: torch.Tensor, old: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed ``0.5 * max((v - R)^2, (v_clip - R)^2)`` over ``mask`` (``v_clip`` kept within ``clip`` of ``old``;
    no clipping when ``clip`` is None) and the count of tokens where the clipped term was the larger."""
    err = (v - returns) ** 2
    if clip is None:
        return 0.5 * (err * mask).sum(), torch.zeros((), dtype=mask.dtype)
    err_clipped = (old + (v - old).clamp(-clip, clip) - returns) ** 2
    worse = (err_clipped > err).to(mask.dtype)
    return 0.5 * (torch.maximum(err, err_clipped) * mask).sum(), (worse * mask).sum().detach()


# ---------------------------------------------------------------------------------------------------- critic


class ValueHead(torch.nn.Module):
    """A scalar head in place of ``GPTModel.output_layer`` (same call signature: returns ``(values, None)``)."""

    def __init__(self, hidden_size: int, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(hidden_size, 1, device=device, dtype=dtype)
        torch.nn.init.zeros_(self.proj.weight)
        torch.nn.init.zeros_(self.proj.bias)

    def forward(self, hidden_states: torch.Tensor, weight: torch.Tensor | None = None, **_: Any) -> tuple:
        return self.proj(hidden_states), None


def token_values(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    packing: Packing | None = None,
) -> torch.Tensor:
    """fp32 values ``[b, s-1]`` on the target grid (see the module docstring); zero where the target is padding.
    ``packing``: run on the padding-free stream, with the same result."""
    out = _stream_logits(model, packing) if packing is not None else _logits(model, input_ids, attention_mask)
    return _on_grid(out[:, :-1, 0], input_ids, attention_mask, packing)


MakeBatches = Callable[..., list[MicroBatch]]
"""The trainer's micro-batching: ``(samples, per-token values, masks=None, old=None) -> micro-batches``."""


class Critic:
    """The value model of one trainer rank: a ``GPTModel`` with a :class:`ValueHead`, its optimizer and schedule."""

    def __init__(
        self,
        spec: ModelSpec,
        hf_state: dict[str, torch.Tensor],
        settings: TrainerSettings,
        make_batches: MakeBatches,
        schedule: Callable[[int], float],
        device: str = "cpu",
        bf16: bool = False,
        layer_spec: str = "auto",
        tp_group: Any = None,
        dp_group: Any = None,
        dp_size: int = 1,
    ) -> None:
        """Build the critic from the policy's HF state (``spec``, ``hf_state``), on this rank's TP shard.

        ``make_batches`` is the trainer's micro-batching (so the critic packs and budgets as the policy does);
        ``schedule`` the LR factor of each step. The critic's peak LR is ``loss.critic_lr`` (default: ``lr``).
        """
        model = build_gpt_model(spec, settings.seed, device, bf16=bf16, layer_spec=layer_spec)
        load_into_model(model, hf_state, spec)
        gpt = unwrap_model(model)
        if gpt.config.sequence_parallel:  # the value head would see one rank's share of the positions
            raise ValueError("the ppo critic does not run under sequence parallelism (a mixture-of-experts model with "
                             "trainer.tp > 1): use trainer.tp=1 and trainer.dp for more ranks")  # fmt: skip
        ref = next(gpt.parameters())
        gpt.output_layer = ValueHead(spec.hidden_size, ref.device, ref.dtype)
        lr = settings.loss.critic_lr or settings.lr
        self.model: Any  # the GPTModel, or Megatron's DDP around it on CUDA
        self.optimizer: Any  # ParallelAdamW, or the Megatron optimizer adapter on CUDA
        scheduled: Any
        if device == "cuda":
            from trainer.gpu import wrap_for_gpu

            self.model, self.optimizer = wrap_for_gpu(model, settings.model_copy(update={"lr": lr}), bf16=bf16)
            scheduled = self.optimizer.torch_optimizer
        else:
            self.model = model
            self.optimizer = ParallelAdamW(
                model.parameters(), tp_group=tp_group, lr=lr, weight_decay=settings.weight_decay, betas=(0.9, 0.99)
            )
            scheduled = self.optimizer
        self.model.train()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(scheduled, schedule)
        self.settings, self.device = settings, device
        self.make_batches = make_batches
        self.dp_group, self.dp_size = dp_group, dp_size
        self.tp_group = tp_group

    @torch.no_grad()
    def values(self, samples: list[Sample]) -> list[list[float]]:
        """``V_t`` of every token of every sample, aligned with ``token_ids`` (position 0 = 0)."""
        out: list[list[float]] = [[] for _ in samples]
        for mb in self.make_batches(samples, [0.0] * len(samples)):
            v = token_values(self.model, mb.input_ids, mb.attention_mask(), mb.packing)
            for r, i in enumerate(mb.rows):
                out[i] = [0.0] + v[r, : int(mb.lengths[r]) - 1].tolist()
        return out

    def plan(self, samples: list[Sample], cfg: LossSettings) -> GAEPlan:
        """The batch's values (before any update) and the GAE plan from them."""
        gids = [s.group_id or s.sample_id for s in samples]
        return gae_plan(samples, gids, cfg, self.values(samples))

    def update(self, samples: list[Sample], rows: list[tuple], denom: float, cfg: LossSettings) -> dict[str, float]:
        """One optimizer step of the value loss over this rank's ``samples``; ``rows`` are the trainer's
        ``(advantages, mask, old, returns, old values)`` per sample, ``denom`` the global model-token count."""
        masks, returns, old = [r[1] for r in rows], [r[3] for r in rows], [r[4] for r in rows]
        # the micro-batches carry the returns where a policy batch has advantages, old values for old log-probs
        batches = self.make_batches(samples, returns, masks, old)
        self.optimizer.zero_grad(set_to_none=True)
        sums = {"value_loss": 0.0, "value_clip_frac": 0.0}
        for mb in batches:
            v = token_values(self.model, mb.input_ids, mb.attention_mask(), mb.packing)
            if mb.old_logprobs is None:
                raise RuntimeError("critic micro-batch without old values")
            loss, clipped = clipped_value_loss(v, mb.old_logprobs, mb.advantages, mb.target_mask, cfg.value_clip)
            (cfg.value_coef * loss / denom).backward()
            sums["value_loss"] += float(loss.detach())
            sums["value_clip_frac"] += float(clipped)
        if self.device == "cuda":
            self.model.finish_grad_sync()
        elif self.dp_size > 1:
            allreduce_grads(self.model.parameters(), self.dp_group)
        allreduce_tp_partial_grads(self.model, self.tp_group)
        if self.dp_size > 1:
            dev = "cuda" if self.device == "cuda" else "cpu"
            sums = {k: allreduce_sum(sums[k], self.dp_group, device=dev) for k in sorted(sums)}
        grad_norm = self.optimizer.clip_grad_norm_(self.settings.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        out = {k: v / denom for k, v in sums.items()}
        out.update(critic_grad_norm=float(grad_norm), critic_lr=float(self.scheduler.get_last_lr()[0]))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
