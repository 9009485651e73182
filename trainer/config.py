"""The trainer's config: the job's ``trainer:`` section and the settings a trainer process is built with.

Each option is declared once, here. :class:`TrainerConfig` is what a user writes; :class:`TrainerSettings` is what
the trainer receives: the same optimisation fields plus values the job supplies (threads, the rollout temperature,
an LR decay for imitation phases, the teachers' signals). Names of losses and estimators are checked against
``trainer/registry.py``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from trainer import registry


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


_REGISTRY_TABLE = {
    "loss": "loss",
    "name": "loss",
    "off_policy": "off_policy",
    "kl_estimator": "kl_estimator",
    "distill_reward_estimator": "kl_estimator",
    "distill_loss_estimator": "distill_loss_estimator",
}
"""Which ``trainer/registry.py`` table names each field's value."""


def _registered_name(value: str, info: ValidationInfo) -> str:
    return registry.check(_REGISTRY_TABLE[str(info.field_name)], value)


class OptimFields(_Section):
    lr: float = Field(1e-5, gt=0)
    """Peak AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up steps of the LR schedule."""
    grad_clip: float = Field(1.0, gt=0)
    """Max global gradient norm."""
    max_step_kl: float | None = Field(None, gt=0)
    """A trust region on each optimizer step (RL losses): after the step, the batch's model tokens are scored again
    and, while the mean k3 estimate of KL(before || after) exceeds this, the step is halved along its own direction
    (up to 5 times; beyond that the weights of before are kept). Adam moves every weight by about the learning rate
    whatever the batch's signal, which can swing a small policy into a degenerate mode in one or two steps; the
    gradient norm and the loss do not see it. ``train/step_kl`` and ``train/step_scale`` report each step. None: off.
    CPU trainer only."""
    micro_batch_tokens: int = Field(4096, ge=1)
    """Token budget of one micro-batch (gradient accumulation across them): real tokens when packed, ``rows *
    longest row`` when padded."""
    packing: bool = False
    """Pack each micro-batch's sequences end to end without padding (same results to 1e-6, no work on padding:
    1.67x the padded step on mixed lengths). Off by default until the documented demo results are re-run with it."""
    distill_chunk_tokens: int = Field(1024, ge=1)
    """Positions per chunk of the full-vocabulary distillation terms (``full_rkl``, ``full_fkl``, ``jsd``): each chunk
    holds a few ``[chunk, vocab]`` tensors of the student and the teacher, recomputed chunk by chunk in backward."""
    seed: int = 0
    """Trainer seed."""
    routing_replay: bool = False
    """Mixture-of-experts models: route each token the embedded engine routed to the experts it chose (recorded
    with the trajectory) instead of the router's own choice, so training sees the experts sampling saw
    (``trainer/moe.py``). With or without it, ``train/routing_mismatch`` reports the share of (token, layer) routings
    where the trainer's own top-k differs from the engine's."""


class LossFields(_Section):
    clip_low: float = Field(0.2, ge=0)
    """Ratio clip below 1 (PPO's epsilon)."""
    clip_high: float = Field(0.2, ge=0)
    """Ratio clip above 1 (DAPO's clip-higher uses 0.28)."""
    off_policy: str = "tis"
    """Correction against the engine's behaviour log-probs (``trainer/registry.py``): ``none``, token truncated IS
    ``tis``, token masking ``mis``, sequence level ``seq_tis`` / ``seq_mis`` (= ``geo_seq_mis``) / ``geo_seq_tis``,
    second-moment token masking ``m2po``, or off-policy sequence masking ``opsm``."""
    is_cap: float = Field(2.0, gt=0)
    """Upper cap C of importance weights (truncation) or of the kept range (masking)."""
    is_low: float = Field(0.5, ge=0)
    """Lower end of the kept range for masking modes."""
    recompute_old: bool = False
    """Recompute old log-probs with a no-grad pass before the update; otherwise the current ones (one update per
    batch) or the behaviour ones (several updates)."""
    minibatches: int = Field(1, ge=1)
    """Optimizer steps per RL step (the batch split in order)."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL to the reference policy (the initial weights, scored by a frozen reference engine)."""
    kl_estimator: str = "k3"
    """Per-token KL estimator: ``k1``, ``k2`` or ``k3``."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus weight (needs rollout temperature 1)."""
    turn_credit: bool = False
    """Turn-level credit: per-turn returns, updates in reverse turn order (after RTPO). With ``ppo``: each turn's
    reward at its last model token (instead of the episode's at the last one), one update."""
    tree_credit: bool = False
    """With ``rollout.tree``: each turn's advantage from the returns of the continuations below its state and its
    siblings' (``trainer/tree_credit.py``), updates in reverse turn order; group-relative losses only."""
    turn_phases: int | None = Field(None, ge=1)
    """``turn_credit``/``tree_credit``: at most this many reverse-order update phases per step, each a band of
    consecutive turn depths, deepest band first (None: one phase per turn depth). Each phase is a forward and
    backward pass over the episodes with a turn in it, so on 20-turn episodes per-depth phases cost up to 20
    passes a step; bands bound that."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount of per-turn returns; with ``ppo``, GAE's discount per model token."""
    lam: float = Field(1.0, ge=0, le=1)
    """``ppo``: GAE's lambda (1: Monte-Carlo returns minus the value; 0: one-step TD errors)."""
    value_coef: float = Field(1.0, ge=0)
    """``ppo``: weight of the value loss in the critic's objective (it scales the critic's gradient before clipping;
    the critic has its own optimizer, so it never trades off against the policy loss)."""
    value_clip: float | None = Field(0.5, gt=0)
    """``ppo``: the most a value may move from the one its advantage came from before the clipped term takes over
    (PPO's value clipping; ``null`` turns it off). Active from the second optimizer step on a batch."""
    critic_lr: float | None = Field(None, gt=0)
    """``ppo``: peak learning rate of the critic (default: ``lr``); it follows the policy's LR schedule."""
    critic_warmup_steps: int = Field(0, ge=0)
    """``ppo``: train steps at the start in which only the critic learns (the policy's weights stay; versions and LR
    schedules still advance), so the first policy updates use values that have seen some returns."""
    whiten_advantages: bool = True
    """``ppo``: normalise the GAE advantages over the batch's model tokens (mean 0, std 1); returns stay raw."""
    replay_clip: float | None = Field(0.2, gt=0)
    """Replayed samples (``store.replay``): a token whose current-to-behaviour probability ratio already lies beyond
    ``1 + replay_clip`` (positive advantage) or below ``1 - replay_clip`` (negative) gets no gradient: PPO's clip
    measured against the policy that sampled it, so training on the same data again stops pushing once it has moved
    the policy that far. ``null``: replayed tokens are corrected like stale fresh ones (``off_policy`` only)."""
    replay_clip_fresh: bool = False
    """Apply ``replay_clip`` to fresh tokens as well: a stale one (sampled some versions ago) stops getting gradient
    the same way, an on-policy one has a ratio of ~1 and is not touched. For loose staleness bounds, where fresh
    tokens are as far behind as replayed ones. ``train/replay_tokens`` then counts every token it covered."""
    m2po_tau: float = Field(0.04, gt=0)
    """``m2po``: the most the kept tokens' mean squared log-ratio (second moment) may be."""
    opsm_delta: float = Field(1e-4, ge=0)
    """``opsm``: a negative-advantage sequence whose mean ``log(behaviour / current)`` exceeds this is left out."""
    kl_in_reward: bool = False
    """``reinforce_pp``: the KL to the reference (``kl_coef``, ``kl_estimator``) as a per-token reward, not a loss."""

    _registered = field_validator("off_policy", "kl_estimator")(_registered_name)

    def _check_with(self, loss: str) -> None:
        """Options that hold only for some losses."""
        if self.kl_in_reward and loss != "reinforce_pp":
            raise ValueError(f"kl_in_reward is REINFORCE++'s: it needs loss 'reinforce_pp', not {loss!r}")
        if self.kl_in_reward and self.kl_coef == 0:
            raise ValueError("kl_in_reward needs kl_coef > 0 (the weight of the KL in the reward)")
        if self.tree_credit and loss in ("rloo", "reinforce_pp", "ppo", "sft"):
            raise ValueError(f"tree_credit replaces the group baseline by tree values: a group-relative loss (grpo, "
                             f"dapo, gspo, cispo), not {loss!r}")  # fmt: skip
        if self.tree_credit and self.turn_credit:
            raise ValueError("tree_credit and turn_credit are two turn-level credits: choose one")
        if self.turn_phases is not None and (not (self.turn_credit or self.tree_credit) or loss in ("ppo", "sft")):
            raise ValueError(f"turn_phases bounds the reverse-order phases of turn_credit or tree_credit, which loss "
                             f"{loss!r} with these settings does not run")  # fmt: skip


class TrainerConfig(OptimFields, LossFields):
    """The job's ``trainer:`` section."""

    loss: str = "grpo"
    """Policy loss (``trainer/registry.py``; trainer/losses.py documents each): token-level ``grpo``, ``dapo``
    (GRPO's loss; pair it with ``clip_high > clip_low``), ``gspo`` (sequence-level ratios), ``rloo``
    (leave-one-out baseline), ``reinforce_pp`` (batch-normalised returns), ``cispo`` (clipped IS weights), ``ppo``
    (GAE advantages from a value model trained beside the policy), or ``sft``."""
    drop_uniform_groups: bool = True
    """DAPO's dynamic sampling: leave out groups whose rewards are all equal (their GRPO advantage is zero), so they
    cost no trainer time and do not dilute the token-level average. A batch with none left is a no-op step."""
    tp: int = Field(1, ge=1)
    """Tensor-parallel ranks of the trainer (processes launched by the trainer group itself)."""
    dp: int = Field(1, ge=1)
    """Data-parallel ranks of the trainer."""
    ep: int = Field(1, ge=1)
    """Expert-parallel ranks (a mixture-of-experts model): each TP group's ranks hold ``num_experts / ep`` whole
    experts apiece, each expert TP-split over ``tp / ep`` ranks. Must divide ``tp``: expert parallelism lives inside
    the TP group, whose ranks see the same tokens."""

    _registered_loss = field_validator("loss")(_registered_name)

    @model_validator(mode="after")
    def _loss_options(self) -> TrainerConfig:
        self._check_with(self.loss)
        if self.tp % self.ep:
            raise ValueError(f"ep={self.ep} must divide tp={self.tp}: experts are spread over a TP group's ranks")
        return self

    def loss_settings(self, **signals: object) -> LossSettings:
        """The loss as the trainer runs it; ``signals``: the teachers' :class:`LossSettings` fields."""
        return LossSettings(name=self.loss, **self.model_dump(include=set(LossFields.model_fields)), **signals)

    def settings(self, threads: int, temperature: float, **changes: object) -> TrainerSettings:
        """A trainer's settings from this section (``changes``: fields of :class:`TrainerSettings` to replace)."""
        base = {"loss": self.loss_settings(), **self.model_dump(include=set(OptimFields.model_fields))}
        return TrainerSettings(**{**base, "threads": threads, "temperature": temperature, **changes})


class LossSettings(LossFields):
    """Which objective and which corrections a trainer runs (trainer/losses.py documents each)."""

    name: str = "grpo"
    """The policy loss's registered name."""
    env_reward_coef: float = Field(1.0, ge=0)
    """Scale of the environment-reward advantage (the job passes ``teachers.env_reward_coef``)."""
    distill_reward_coef: float = Field(0.0, ge=0)
    """Per-token reward ``-coef * KL_t(behaviour || teacher)`` (the job passes ``teachers.reward_coef``)."""
    distill_reward_estimator: str = "k1"
    """Estimator of that reward (the job passes ``teachers.reward_estimator``)."""
    distill_loss_coef: float = Field(0.0, ge=0)
    """Weight of the distillation loss term, a divergence from the teacher (the job passes ``teachers.loss_coef``)."""
    distill_loss_estimator: str = "topk"
    """Estimator of that term (the job passes ``teachers.loss_estimator``)."""
    distill_jsd_beta: float = Field(0.5, gt=0, lt=1)
    """Weight ``beta`` of the ``jsd`` estimator's mixture ``beta * teacher + (1 - beta) * student`` (the job passes
    ``teachers.jsd_beta``)."""

    _registered_signals = field_validator("name", "distill_reward_estimator", "distill_loss_estimator")(
        _registered_name
    )

    @model_validator(mode="after")
    def _loss_options(self) -> LossSettings:
        self._check_with(self.name)
        return self

    @property
    def distills(self) -> bool:
        """Whether the objective uses teacher log-probs."""
        return self.distill_reward_coef > 0 or self.distill_loss_coef > 0


class TrainerSettings(OptimFields):
    """What a trainer process is built with."""

    loss: LossSettings = Field(default_factory=LossSettings)
    """The objective."""
    decay_steps: int = Field(0, ge=0)
    """Cosine decay to ``min_lr_ratio`` of the peak over this many steps after warm-up (0: constant LR)."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Floor of the decay, as a fraction of the peak LR."""
    temperature: float = Field(1.0, gt=0)
    """Rollout sampling temperature: RL log-probs are taken from logits / temperature, as the engine's are."""
    threads: int = Field(1, ge=1)
    """Torch threads of each trainer process (the job's ``run.threads``, or an imitation phase's own)."""
    cpus: list[int] | None = None
    """CPU cores each trainer process is pinned to (Linux; the job passes ``run.trainer_cpus``, or its own starting
    cores when only ``run.cpus`` is set); None: the cores it inherits."""
    teachers: dict[str, str] = Field(default_factory=dict)
    """Teachers the trainer evaluates itself for the full-vocabulary distillation estimators: name -> Hugging Face
    model directory (the job passes ``teachers.models``' paths). Loaded frozen next to the student."""
