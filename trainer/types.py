"""Contracts of the trainer: what it trains on and how the controller drives it.

The trainer knows nothing of trajectories or environments: it receives flat token rows. ``agentflow`` converts each
trajectory segment into a :class:`Sample`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class Sample:
    """One token row: ids exactly as generated, which of them the model produced, and how they were sampled."""

    token_ids: list[int]
    loss_mask: list[int]
    behaviour_logprobs: list[float]
    """Log-prob of each token under the policy that sampled it (0.0 where ``loss_mask`` is 0)."""
    reward: float = 0.0
    group_id: str = ""
    """Samples with the same group id share a GRPO baseline."""
    sample_id: str = ""
    ref_logprobs: list[float] | None = None
    """Reference-policy log-prob of each token given its prefix (position 0 unused), for the KL term."""
    teacher_logprobs: list[float] | None = None
    """Teacher log-prob of each token given its prefix (position 0 unused), for the distillation signals."""
    teacher_top_ids: list[list[int]] | None = None
    """The teacher's top-k token ids at each position (the distribution predicting token t; position 0 empty)."""
    teacher_top_logprobs: list[list[float]] | None = None
    """The teacher's log-probs of ``teacher_top_ids``, for the top-k KL."""
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    """[start, end) of each model turn's tokens, for turn-level credit."""
    turn_rewards: list[float] = field(default_factory=list)
    """Reward of each turn (the last includes the final reward), for turn-level credit."""
    extra: dict[str, Any] = field(default_factory=dict)
    norm_tokens: int = 0
    """If > 0: the model-token count the batch's loss is averaged over, when it exceeds the rows' own (the
    controller counts groups it left out for having zero advantage, so a batch with little signal takes a small
    step instead of a full one on a few rows). Every row of a batch carries the same value."""

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.behaviour_logprobs) != n:
            raise ValueError(
                f"sample {self.sample_id!r}: {n} ids, {len(self.loss_mask)} mask, "
                f"{len(self.behaviour_logprobs)} logprobs"
            )


class TrainerGroup(Protocol):
    """The trainer's process group as the controller sees it (local processes here; Ray actors later)."""

    @property
    def version(self) -> int:
        """Weight version of the trainer's current parameters (0 = the job's initial weights)."""
        ...

    def train_step(self, samples: list[Sample], loss: str = "grpo") -> dict[str, float]:
        """One optimizer step on ``samples``; the version goes up by one."""
        ...

    def export_weights(self) -> dict[str, Any]:
        """Full HF-named tensors of the current weights (TransferMesh's sending side)."""
        ...

    def save_checkpoint(self, path: str, extra: dict[str, Any] | None = None) -> None: ...

    def close(self) -> None: ...


@dataclass
class LossSettings:
    """Which objective and which corrections (see trainer/losses.py for each one's departures from its paper)."""

    name: str = "grpo"
    """grpo | dapo | gspo | sft (dapo = grpo's token loss; set clip_high > clip_low and drop uniform groups)."""
    clip_low: float = 0.2
    clip_high: float = 0.2
    off_policy: str = "tis"
    """none | tis | mis | seq_tis | seq_mis: correction against the behaviour log-probs."""
    is_cap: float = 2.0
    is_low: float = 0.5
    recompute_old: bool = False
    """Recompute the old log-probs with a no-grad pass before the update (needed when minibatches > 1)."""
    minibatches: int = 1
    """Optimizer steps per train_step (per phase); the version still advances by one per train_step."""
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    turn_credit: bool = False
    gamma: float = 1.0
    env_reward_coef: float = 1.0
    """Scale of the environment-reward advantage (0: pure distillation)."""
    distill_reward_coef: float = 0.0
    """Per-token reward ``-coef * KL_t(behaviour || teacher)`` added to the advantage (policy-gradient distillation)."""
    distill_reward_estimator: str = "k1"
    """k1 | k2 | k3: the per-token reverse-KL estimate used as that reward."""
    distill_loss_coef: float = 0.0
    """Weight of the reverse KL to the teacher as a loss term (GKD style)."""
    distill_loss_estimator: str = "topk"
    """k1 | k2 | k3 (sampled tokens) | topk (reverse KL over the teacher's top-k tokens plus a tail bucket)."""

    def __post_init__(self) -> None:
        if self.name not in ("grpo", "dapo", "gspo", "sft"):
            raise ValueError(f"unknown loss {self.name!r}; choose grpo, dapo, gspo or sft")
        if self.off_policy not in ("none", "tis", "mis", "seq_tis", "seq_mis"):
            raise ValueError(f"unknown off_policy {self.off_policy!r}")
        if self.kl_estimator not in ("k1", "k2", "k3"):
            raise ValueError(f"unknown kl_estimator {self.kl_estimator!r}")
        if self.minibatches < 1:
            raise ValueError("minibatches must be >= 1")
        if self.distill_reward_estimator not in ("k1", "k2", "k3"):
            raise ValueError(f"unknown distill_reward_estimator {self.distill_reward_estimator!r}; k1, k2 or k3")
        if self.distill_loss_estimator not in ("k1", "k2", "k3", "topk"):
            raise ValueError(f"unknown distill_loss_estimator {self.distill_loss_estimator!r}; k1, k2, k3 or topk")
        if min(self.env_reward_coef, self.distill_reward_coef, self.distill_loss_coef) < 0:
            raise ValueError("env_reward_coef, distill_reward_coef and distill_loss_coef must be >= 0")

    @property
    def distills(self) -> bool:
        """Whether the objective uses teacher log-probs."""
        return self.distill_reward_coef > 0 or self.distill_loss_coef > 0


@dataclass
class TrainerSettings:
    """Optimisation settings the controller passes down (built from the job config's ``trainer`` section)."""

    lr: float = 1e-5
    weight_decay: float = 0.0
    warmup_steps: int = 0
    decay_steps: int = 0
    """Cosine decay to ``min_lr_ratio`` of the peak over this many steps after warm-up (0: constant LR)."""
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    loss: LossSettings = field(default_factory=LossSettings)
    temperature: float = 1.0
    """Rollout sampling temperature: RL log-probs are taken from logits / temperature, as the engine's are."""
    micro_batch_tokens: int = 4096
    seed: int = 0
    threads: int = 1
