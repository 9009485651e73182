"""Tree credit: per-turn advantages from the state values of a small tree, computed by hand."""

from __future__ import annotations

import math

import pytest

from trainer.losses import plan_advantages
from trainer.types import LossSettings, Sample


def _sample(sid: str, reward: float, turns: int, nodes: list[str], trained_from: int = 0) -> Sample:
    """``turns`` model turns of 2 tokens each after a 2-token prompt; turns before ``trained_from`` are a shared
    prefix (not trained)."""
    ids = list(range(2 + 3 * turns))
    mask = [0, 0]
    spans = []
    for k in range(turns):
        spans.append((len(mask), len(mask) + 2))
        mask += [int(k >= trained_from)] * 2 + [0]  # two model tokens, one observation token
    return Sample(ids, mask, [-1.0] * len(ids), reward, "g", sid, turn_spans=spans, turn_nodes=nodes)


def tree() -> list[Sample]:
    """Roots A (3 turns, reward 1) and B (2 turns, 0); C branches from A after A's first turn (reward 0)."""
    return [
        _sample("A", 1.0, 3, ["g:0", "A:1", "A:2"]),
        _sample("B", 0.0, 2, ["g:0", "B:1"]),
        _sample("C", 0.0, 3, ["g:0", "A:1", "C:2"], trained_from=1),
    ]


def test_tree_advantages_by_hand() -> None:
    plan = plan_advantages(tree(), LossSettings(tree_credit=True))
    std = math.sqrt(2 / 9)  # rewards 1, 0, 0
    # V(g:0) = 1/3 (A, B, C); V(A:1) = 1/2 (A, C); V(A:2) = 1; V(B:1) = V(C:2) = 0; each terminal its reward.
    # advantage = (V(next) - V(root)) + (V(next) - V(here)), over the group's std
    want = {
        "A": [(1 / 6 + 1 / 6) / std, (2 / 3 + 1 / 2) / std, (2 / 3 + 0) / std],
        "B": [(-1 / 3 - 1 / 3) / std, (-1 / 3 + 0) / std],
        "C": [None, (-1 / 3 - 1 / 2) / std, (-1 / 3 + 0) / std],  # its first turn is A's (not trained here)
    }
    for (
        s,
        adv,
    ) in zip(tree(), plan.advantages, strict=True):
        for k, (a, _) in enumerate(s.turn_spans):
            if want[s.sample_id][k] is not None:
                assert adv[a] == pytest.approx(want[s.sample_id][k], abs=1e-5), (s.sample_id, k)
    # phases: the deepest turn first; C's shared first turn is in no phase
    assert len(plan.phases) == 3
    first_turn = plan.phases[2]
    assert first_turn[0][2:4] == [1, 1] and first_turn[2][2:4] == [0, 0]
    assert plan.phases[0][0][8:10] == [1, 1] and not any(plan.phases[0][1])  # B has no third turn


def test_without_a_branch_tree_credit_is_grpo_on_every_turn_but_the_first() -> None:
    a = _sample("A", 1.0, 2, ["g:0", "A:1"])
    b = _sample("B", 0.0, 2, ["g:0", "B:1"])
    plan = plan_advantages([a, b], LossSettings(tree_credit=True))
    assert plan.advantages[0][5] == pytest.approx(1.0, abs=1e-5)  # (R - mean) / std on the second turn
    assert plan.advantages[0][2] == pytest.approx(2.0, abs=1e-5)  # the root's siblings rank the first action too


def test_tree_credit_needs_tree_samples_and_a_group_loss() -> None:
    lone = _sample("A", 1.0, 2, [])
    with pytest.raises(ValueError, match="needs a tree rollout"):
        plan_advantages([lone, _sample("B", 0.0, 2, [])], LossSettings(tree_credit=True))
    with pytest.raises(ValueError, match="not 'rloo'"):
        LossSettings(name="rloo", tree_credit=True)
    with pytest.raises(ValueError, match="choose one"):
        LossSettings(tree_credit=True, turn_credit=True)
