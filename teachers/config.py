"""The Teacher Manager's config: the job's ``teachers:`` section (teachers, routes, signals, the seq-KD phase).

Declared here, beside the manager that reads it; the job config nests it. Estimator names are the trainer's and are
checked by the job config, which sees both packages (``teachers`` imports no other package of ours).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class TeacherModelConfig(_Section):
    name: str
    """Name the routes refer to."""
    path: str | None = None
    """Local Hugging Face model directory (scored by an embedded engine loaded on demand)."""
    url: str | None = None
    """SGLang-protocol server URL instead of ``path`` (scored over HTTP)."""
    tokenizer: str | None = None
    """Directory with the teacher's tokenizer.json (default: ``path``; required with ``url``), checked against the
    student's before the job starts."""


class SeqKDConfig(_Section):
    episodes: int = Field(0, ge=0)
    """Episodes the teachers play (drawn from the data mixture, each played by its source's teacher) for the student
    to imitate before on-policy distillation; 0: no sequence-level KD. Counts toward the job's samples."""
    epochs: int = Field(3, ge=1)
    """Upper bound on passes over those episodes (stops early when the held-out 10% stops improving)."""
    lr: float = Field(1e-3, gt=0)
    """Learning rate of the imitation phase."""
    batch_size: int = Field(32, ge=1)
    """Sequences per imitation step."""
    warmup_steps_max: int = Field(20, ge=0)
    """The LR warms up linearly over a tenth of the imitation steps, at most this many, then decays (cosine)."""
    temperature: float = Field(1.0, gt=0)
    """Teachers' sampling temperature (1: the student imitates the teachers' own distribution)."""
    threads: int = Field(2, ge=1)
    """Torch threads of the imitation trainer (nothing else runs during this phase, so it may use every core)."""

    @field_validator("episodes")
    @classmethod
    def _enough_to_hold_out(cls, v: int) -> int:
        if 0 < v < 10:
            raise ValueError(f"must be 0 (off) or at least 10 (every 10th episode is held out), got {v}")
        return v


class TeachersConfig(_Section):
    models: list[TeacherModelConfig] = Field(default_factory=list)
    """The teachers; none: no distillation."""
    routes: dict[str, str | dict[str, float]] = Field(default_factory=dict)
    """Data-source tag -> teacher name, or ``{teacher: weight}`` for a weighted mix; tag ``default`` catches
    sources without a routed tag."""
    mix: Literal["probs", "sample"] = "probs"
    """A mixed route's teachers: per-token mixture of probabilities, or one teacher per sequence drawn by weight."""
    max_resident: int = Field(1, ge=1)
    """Teachers loaded at once; idle ones are released and reloaded on demand."""
    release: Literal["free", "offload"] = "free"
    """Idle teachers: closed and freed (reloaded from disk), or offloaded by scorers that can (GPU -> CPU)."""
    top_k: int = Field(8, ge=1)
    """Teacher alternatives per position for the top-k KL (``loss_estimator: topk``)."""
    env_reward_coef: float = Field(0.0, ge=0)
    """Scale of the environment-reward (GRPO) advantage beside the teachers' signal (0: pure distillation)."""
    reward_coef: float = Field(1.0, ge=0)
    """Per-token reward ``-coef * reverse KL`` added to the advantage (policy-gradient distillation)."""
    reward_estimator: str = "k1"
    """Reverse-KL estimate used as that reward: ``k1``, ``k2`` or ``k3`` (checked by the job config)."""
    loss_coef: float = Field(0.0, ge=0)
    """Weight of the divergence from the teacher as a loss term (GKD style; which divergence: ``loss_estimator``)."""
    loss_estimator: str = "topk"
    """Estimator of that loss term: sampled-token ``k1``/``k2``/``k3``; ``topk``, the KL over the teacher's top-k
    tokens plus a tail bucket; or over the teacher's full next-token distribution, ``full_rkl`` (reverse KL),
    ``full_fkl`` (forward KL) or ``jsd`` (generalised JSD), for which the trainer loads every teacher itself (model
    directories only). Names come from the trainer's estimator registry, checked by the job config."""
    jsd_beta: float = Field(0.5, gt=0, lt=1)
    """``jsd``: weight of the teacher in the mixture ``m = beta * teacher + (1 - beta) * student``; the loss is
    ``beta KL(teacher || m) + (1 - beta) KL(student || m)`` (near 0 it behaves like ``beta`` times the forward KL,
    near 1 like ``1 - beta`` times the reverse KL)."""
    seq_kd: SeqKDConfig = Field(default_factory=SeqKDConfig)
    """Off-policy phase first: the student imitates episodes the teachers play (GKD's teacher-generated data), which
    teaches an env the student has never seen its format; on-policy distillation follows."""
