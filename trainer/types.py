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
    extra: dict[str, Any] = field(default_factory=dict)

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
class TrainerSettings:
    """Optimisation settings the controller passes down (built from the job config's ``trainer`` section)."""

    lr: float = 1e-5
    weight_decay: float = 0.0
    warmup_steps: int = 0
    decay_steps: int = 0
    """Cosine decay to ``min_lr_ratio`` of the peak over this many steps after warm-up (0: constant LR)."""
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    clip_eps: float = 0.2
    tis_cap: float = 2.0
    temperature: float = 1.0
    """Rollout sampling temperature: RL log-probs are taken from logits / temperature, as the engine's are."""
    micro_batch_tokens: int = 4096
    seed: int = 0
    threads: int = 1
