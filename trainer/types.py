"""Contracts of the trainer: what it trains on and how the controller drives it.

The trainer knows nothing of trajectories or environments: it receives flat token rows. ``agentflow`` converts each
trajectory segment into a :class:`Sample`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from trainer.config import LossSettings, TrainerSettings

__all__ = ["LossSettings", "Sample", "TrainerGroup", "TrainerSettings"]  # settings: part of the contract


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
