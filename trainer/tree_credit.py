"""Turn-level credit from a sparse reverse tree of trajectories (``trainer.tree_credit``).

A tree rollout (``rollout.tree``) plays a group's root episodes from the task's initial state, then branches: more
continuations from the state after one of a root's turns. Each trained turn carries the id of the state it acted in
(``Sample.turn_nodes``): the exact context its action was generated from, so every trajectory of the group that
reached that context (a branch through its shared prefix, or roots whose actions coincided so far) has the same id.

The value of a state is the mean return of the trajectories through it, ``V(s)``; a turn's action leads from its
state ``s`` to the next turn's state ``s'`` (or to the end of its own episode, whose value is its return). The
turn's advantage is the sum of a *global* term ``V(s') - V(root)`` (how much better than the task's average the
continuations after this action did: GRPO's advantage, with every continuation below the action averaged in) and a
*local* term ``V(s') - V(s)`` (how much better than its siblings, the other actions taken from the same state), over
the standard deviation of the group's returns. A turn whose state and next state no other trajectory shares gets
``R - mean`` from the global term and nothing from the local one, as under trajectory-level GRPO; where trajectories
part, turns before the split are credited with the mean of all continuations below them (a lower-variance
estimate; turns every trajectory took alike get nothing), and the actions at the split are ranked against each
other.

How this departs from the papers: RTPO (sparse reverse trees) and AT2PO (turn-level trees with per-turn values)
propagate outcome rewards to per-turn values as here, but RTPO's update is phased from the last turn to the first
with the clipped surrogate per phase, which we keep (one optimizer step per turn depth, as ``turn_credit`` does),
while the global-plus-local sum and its normalisation by the group's return std follow TreeRL (Hou et al. 2025)
rather than either; branch points are chosen by the rollout (uniform, last turns first, or the turn whose sampled
tokens were least likely), not by a learned uncertainty.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from trainer.types import Sample

TERMINAL = "#end"
"""Suffix of the node after a trajectory's last turn (its own return)."""


def tree_advantages(samples: list[Sample], gids: list[str], eps: float = 1e-6) -> list[list[float]]:
    """Each sample's advantage per turn in ``turn_spans`` (``turn_nodes`` aligned with it)."""
    through: dict[str, list[float]] = defaultdict(list)  # node -> returns of the trajectories through it
    paths = [_path(s) for s in samples]
    for s, path in zip(samples, paths, strict=True):
        for node in set(path):
            through[node].append(s.reward)
    value = {node: statistics.fmean(rs) for node, rs in through.items()}
    by_group: dict[str, list[float]] = defaultdict(list)
    for s, g in zip(samples, gids, strict=True):
        by_group[g].append(s.reward)
    out = []
    for s, g, path in zip(samples, gids, paths, strict=True):
        rewards = by_group[g]
        root, std = statistics.fmean(rewards), statistics.pstdev(rewards)
        if std == 0:  # every continuation ended alike: nothing to rank
            out.append([0.0] * len(s.turn_spans))
            continue
        adv = []
        for k in range(len(s.turn_spans)):
            here, after = value[path[k]], value[path[k + 1]]
            adv.append(((after - root) + (after - here)) / (std + eps))
        out.append(adv)
    return out


def _path(sample: Sample) -> list[str]:
    """The states of the sample's turns, then its own terminal node."""
    if len(sample.turn_nodes) != len(sample.turn_spans):
        raise ValueError(
            f"sample {sample.sample_id!r}: {len(sample.turn_nodes)} turn nodes for {len(sample.turn_spans)} turns "
            "(tree credit needs a tree rollout: rollout.tree)"
        )
    return [*sample.turn_nodes, sample.sample_id + TERMINAL]


def tree_phases(
    samples: list[Sample], advantages: list[list[float]]
) -> tuple[list[list[float]], list[list[list[int]]]]:
    """Per-token advantages and the update phases, deepest turn first (turns no token of which is trained, such as
    a branch's shared prefix, train nothing)."""
    advs = [[0.0] * len(s.token_ids) for s in samples]
    depth = max((len(s.turn_spans) for s in samples), default=1) or 1
    phases = [[[0] * len(s.token_ids) for s in samples] for _ in range(depth)]
    for i, s in enumerate(samples):
        for k, (a, b) in enumerate(s.turn_spans):
            for t in range(a, b):
                advs[i][t] = advantages[i][k]
                phases[depth - 1 - k][i][t] = s.loss_mask[t]
    return advs, phases
