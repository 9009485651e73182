"""The trainer's objectives by name: the one place a loss, an off-policy correction or a KL estimator is added.

Each table maps a config name to a ``module:function`` entry point (resolved on first use, so reading a config
does not import torch). Config validation checks names against these tables with a "did you mean"; the trainer
resolves the function from the same table. Adding an estimator is one function plus one line here.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from functools import cache
from typing import Any

POLICY_LOSSES: dict[str, str] = {
    "grpo": "trainer.losses:token_surrogate",  # token-level clipped surrogate, token-level averaging
    "dapo": "trainer.losses:token_surrogate",  # GRPO's loss; pair with clip_high > clip_low, drop_uniform_groups
    "gspo": "trainer.losses:sequence_surrogate",  # sequence-level geometric-mean ratio
    "rloo": "trainer.losses:token_surrogate",  # GRPO's loss on leave-one-out advantages
    "reinforce_pp": "trainer.losses:token_surrogate",  # GRPO's loss on batch-normalised returns (REINFORCE++)
    "cispo": "trainer.losses:cispo_surrogate",  # clipped detached IS weight times A log pi, every token's gradient
    "ppo": "trainer.losses:token_surrogate",  # the clipped surrogate on GAE advantages from a critic (trainer.critic)
    "sft": "trainer.losses:nll",  # imitation: negative log-likelihood of the model tokens
}
"""``trainer.loss``: the policy objective."""

OFF_POLICY: dict[str, str] = {
    "none": "trainer.losses:weights_none",
    "tis": "trainer.losses:weights_tis",
    "mis": "trainer.losses:weights_mis",
    "seq_tis": "trainer.losses:weights_seq_tis",
    "seq_mis": "trainer.losses:weights_seq_mis",
    "geo_seq_tis": "trainer.losses:weights_geo_seq_tis",  # truncated geometric-mean sequence ratio
    "geo_seq_mis": "trainer.losses:weights_seq_mis",  # seq_mis already masks on the geometric mean
    "m2po": "trainer.losses:weights_m2po",  # drop the largest (log r)^2 until their mean is <= m2po_tau
    "opsm": "trainer.losses:weights_opsm",  # drop negative-advantage sequences that drifted past opsm_delta
}
"""``trainer.off_policy``: importance weights against the engine's behaviour log-probs."""

ADVANTAGES: dict[str, str] = {
    "grpo": "trainer.losses:group_plan",
    "dapo": "trainer.losses:group_plan",
    "gspo": "trainer.losses:group_plan",
    "cispo": "trainer.losses:group_plan",
    "rloo": "trainer.losses:rloo_plan",
    "reinforce_pp": "trainer.losses:batch_plan",
    "ppo": "trainer.critic:gae_plan",  # needs the critic's values: the trainer calls it with them
}
"""The advantage estimator of each policy loss (one not listed here uses GRPO's group normalisation)."""

KL_ESTIMATORS: dict[str, str] = {
    "k1": "trainer.losses:kl_k1",
    "k2": "trainer.losses:kl_k2",
    "k3": "trainer.losses:kl_k3",
}
"""``trainer.kl_estimator`` and the teachers' sampled-token estimators: per-token KL(pi || ref) from pi's tokens."""

FULL_VOCAB_ESTIMATORS: dict[str, str] = {
    "full_rkl": "trainer.losses:full_reverse_kl",  # KL(student || teacher) over the whole vocabulary
    "full_fkl": "trainer.losses:full_forward_kl",  # KL(teacher || student) over the whole vocabulary
    "jsd": "trainer.losses:generalized_jsd",  # generalised Jensen-Shannon divergence with weight distill_jsd_beta
}
"""Divergences between the student's and the teacher's full next-token distributions (log-prob rows ``[..., V]``),
computed in position chunks against a teacher model the trainer evaluates itself (``trainer.full_distill``)."""

DISTILL_LOSS_ESTIMATORS: dict[str, str] = {
    **KL_ESTIMATORS,
    "topk": "trainer.losses:topk_reverse_kl",
    **FULL_VOCAB_ESTIMATORS,
}
"""``teachers.loss_estimator``: a sampled-token estimator, the KL over the teacher's top-k tokens, or a divergence
over the full vocabulary."""

_TABLES = {"loss": POLICY_LOSSES, "off_policy": OFF_POLICY, "kl_estimator": KL_ESTIMATORS,
           "distill_loss_estimator": DISTILL_LOSS_ESTIMATORS, "advantages": ADVANTAGES}  # fmt: skip


def check(kind: str, name: str) -> str:
    """``name`` if the ``kind`` table has it; otherwise a ValueError listing the choices and the closest one."""
    table = _TABLES[kind]
    if name in table:
        return name
    close = difflib.get_close_matches(name, table, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown {kind} {name!r}; choose one of {sorted(table)}.{hint}")


@cache
def resolve(kind: str, name: str) -> Callable[..., Any]:
    """The function registered as ``name`` in the ``kind`` table."""
    module, _, attr = _TABLES[kind][check(kind, name)].partition(":")
    return getattr(importlib.import_module(module), attr)
