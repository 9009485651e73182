"""Contracts of the trainer: what it trains on and how the controller drives it.

The trainer knows nothing of trajectories or environments: it receives flat token rows. ``agentflow`` converts each
trajectory segment into a :class:`Sample`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
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
    teacher: str = ""
    """Name of the teacher whose full next-token distributions the full-vocabulary estimators compare with (a key of
    ``TrainerSettings.teachers``; empty: the only one)."""
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    """[start, end) of each model turn's tokens, for turn-level credit."""
    turn_rewards: list[float] = field(default_factory=list)
    """Reward of each turn (the last includes the final reward), for turn-level credit."""
    turn_nodes: list[str] = field(default_factory=list)
    """Tree rollouts: the id of the state each turn of ``turn_spans`` acted in (shared by every trajectory through
    it), for ``tree_credit``."""
    extra: dict[str, Any] = field(default_factory=dict)
    vocab_masks: list[tuple[int, bytes]] = field(default_factory=list)
    """Tokens sampled from a restricted vocabulary (structured output): ``(position, bitmask)``, the bitmask as
    little-endian int32 words (bit ``j`` of word ``i`` allows token ``32 * i + j``). The trainer restricts its
    logits at those positions the same way, so its log-probs are of the distribution the token was drawn from."""
    routes: list[tuple[int, list[list[int]]]] | None = None
    """Mixture-of-experts models: ``(position, experts per layer)`` for the positions the engine ran, the experts
    its router chose for that input token in each layer (``trainer.routing_replay``)."""
    replayed: bool = False
    """Trained before (bounded replay, ``store.replay``): the loss's replay trust region (``replay_clip``) applies."""
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
    """The trainer's process group as its callers see it: one local process, ``tp * dp`` ranks, or a Ray actor.

    Every method is a named call (no string RPC): the controller, SFT and distillation use only these. Under
    TP/DP each call runs on every rank (they are collectives) and rank 0's answer comes back.
    """

    @property
    def version(self) -> int:
        """Weight version of the trainer's current parameters (0 = the job's initial weights)."""
        ...

    def train_step(self, samples: list[Sample], loss: str | None = None) -> dict[str, float]:
        """One training step on ``samples`` (``loss`` overrides the configured objective's name, e.g. ``"sft"``);
        the version goes up by one. Returns the step's metrics."""
        ...

    def export_weights(self) -> dict[str, Any]:
        """Full HF-named tensors of the current weights (TransferMesh's sending side)."""
        ...

    def export_buckets(self, bucket_bytes: int = 32 << 20) -> list[Any]:
        """The current version as checksummed TransferMesh buckets of about ``bucket_bytes`` each."""
        ...

    def save_checkpoint(self, path: str | Path, extra: dict[str, Any] | None = None) -> None:
        """Model, optimizer, scheduler and RNG state plus the caller's ``extra``, written atomically."""
        ...

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Restore a :meth:`save_checkpoint` (the version comes back with it); returns the saved ``extra``."""
        ...

    def save_hf(self, path: str | Path) -> Path:
        """Write the current weights as a Hugging Face model directory (config, safetensors, tokenizer files)."""
        ...

    def eval_nll(self, samples: list[Sample]) -> float:
        """Token-level mean negative log-likelihood of the samples' model tokens (no update)."""
        ...

    def pids(self) -> list[int]:
        """Process ids of the trainer's processes (monitoring, crash tests)."""
        ...

    def close(self) -> None:
        """Stop the trainer's processes (idempotent)."""
        ...
