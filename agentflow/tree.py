"""Sparse reverse trees in rollout (``rollout.tree``): after a group's roots, branches from chosen turns.

A group's roots are played from the task's initial state as usual; then up to ``branches`` continuations start
from the state after one of a root's turns (:func:`agentflow.episode.run_branch`: the env brought back as it
declares, the root's prefix served from the engine's prefix cache). Where to branch:

- ``uniform``: turns drawn at random (seeded by the task) over every root turn after the first;
- ``last_first``: the deepest turns first (a decision near the end is credited most directly by its continuations);
- ``surprisal``: the turns whose sampled tokens were least likely under the policy (mean ``-log p``, an estimate of
  the entropy there): where the policy was least sure of its action;
- ``disagree``: the states where the group's roots, having reached the same context, took the most different
  actions (the roots are samples of the policy there: their disagreement estimates its uncertainty at that state
  without the token-level noise), then by surprisal. On a task where one early decision settles the outcome, this
  is that decision's state; per-token surprisal instead grows with the context and picks turns after it, once
  the outcome is settled (measured on Trail-v0: 27 of 28 relay branches after the decisive turn).
- ``contested``: only the states where the roots disagreed, most different first, and every branch there: the
  budget cycles over those states, so a state gets more branches than roots reached it (several from one root
  turn). A group whose roots acted alike everywhere is not branched at all. Where one decision settles the outcome
  and the policy rarely gets it right, the continuations are spent on that decision instead of on a copy of the
  roots' agreement elsewhere.

``max_tokens`` bounds the group's generated tokens: a branch is skipped when the root's tokens after its branch
point (the estimate of what it will generate) would take the group past the budget.
"""

from __future__ import annotations

import hashlib
import random
from array import array
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from agentflow.types import Trajectory

SELECT = ("uniform", "last_first", "surprisal", "disagree", "contested")


@dataclass(frozen=True)
class TreeSpec:
    branches: int
    select: str = "disagree"
    max_tokens: int | None = None


def model_tokens(traj: Trajectory) -> int:
    return sum(sum(seg.loss_mask) for seg in traj.segments)


def _after(root: Trajectory, k: int) -> int:
    """Model tokens the root generated from its turn ``k`` on."""
    return sum(b - a for a, b in (t.span for t in root.turns[k:]))


def _surprisal(root: Trajectory, k: int) -> float:
    seg = root.segments[0]
    a, b = root.turns[k].span
    lps = [lp for lp, m in zip(seg.logprobs[a:b], seg.loss_mask[a:b], strict=True) if m]
    return -sum(lps) / len(lps) if lps else 0.0


def branch_points(roots: list[Trajectory], spec: TreeSpec, seed: int) -> list[tuple[Trajectory, int]]:
    """Which ``(root, turn)`` pairs to branch from, at most ``spec.branches``, within ``spec.max_tokens``."""
    if spec.select not in SELECT:
        raise ValueError(f"rollout.tree.select must be one of {SELECT}, got {spec.select!r}")
    cands = [
        (r, k)
        for r in roots
        if r.status in ("ok", "truncated") and len(r.segments) == 1
        for k in range(1, len(r.turns))
    ]
    if spec.select == "uniform":
        random.Random(seed).shuffle(cands)
    elif spec.select == "last_first":
        cands.sort(key=lambda rk: -rk[1])  # stable: roots in order within a depth
    elif spec.select in ("disagree", "contested"):
        states = {id(r): state_keys(r) for r in roots if len(r.segments) == 1}
        spread = _disagreement(roots, states)

        def state(rk: tuple[Trajectory, int]) -> str:
            return states[id(rk[0])][rk[1]]

        cands.sort(key=lambda rk: (-spread[state(rk)], -_surprisal(*rk)))
        if spec.select == "contested":
            cands = _cycle([rk for rk in cands if spread[state(rk)] > 1], state, spec.branches)
    else:
        cands.sort(key=lambda rk: -_surprisal(*rk))
    used = sum(model_tokens(r) for r in roots)
    picked: list[tuple[Trajectory, int]] = []
    for root, k in cands:
        if len(picked) == spec.branches:
            break
        cost = _after(root, k)
        if spec.max_tokens is not None and used + cost > spec.max_tokens:
            continue
        picked.append((root, k))
        used += cost
    return picked


def _cycle(
    cands: list[tuple[Trajectory, int]], state: Callable[[tuple[Trajectory, int]], str], n: int
) -> list[tuple[Trajectory, int]]:
    """``cands``' states in their order, round after round (at most ``n``), each round every state once more from
    the next root that reached it; the caller takes the first ``n`` that fit its budget."""
    by_state: dict[str, list[tuple[Trajectory, int]]] = {}
    for rk in cands:
        by_state.setdefault(state(rk), []).append(rk)
    return [pairs[r % len(pairs)] for r in range(n) for pairs in by_state.values()]


def state_keys(traj: Trajectory) -> list[str]:
    """Per turn of a one-segment trajectory, a digest of the context it acted in (one pass over the tokens: each
    turn's digest extends the previous one's)."""
    ids, h, done, out = traj.segments[0].token_ids, hashlib.blake2b(digest_size=10), 0, []
    for t in traj.turns:
        h.update(array("q", ids[done : t.span[0]]).tobytes())
        done = t.span[0]
        out.append(h.copy().hexdigest())
    return out


def _disagreement(roots: list[Trajectory], states: dict[int, list[str]]) -> dict[str, int]:
    """State -> how many different actions the roots took there (``states``: each root's :func:`state_keys`)."""
    actions: dict[str, set[tuple[int, ...]]] = defaultdict(set)
    for r in roots:
        for key, t in zip(states.get(id(r), []), r.turns, strict=False):
            a, b = t.span
            actions[key].add(tuple(r.segments[0].token_ids[a:b]))
    return defaultdict(int, {key: len(acts) for key, acts in actions.items()})


def turn_nodes(traj: Trajectory, turn_indices: list[int]) -> list[str]:
    """The state node each turn acted in (:mod:`trainer.tree_credit`): the exact context its action was generated
    from, within the group. Trajectories that reached the same context share the node: a branch's shared turns and
    its branch point, and roots whose actions and observations coincided so far (so a state's value pools every
    trajectory through it, and the actions taken there are ranked against each other). A trajectory with more than
    one segment (its context compacted or cut) keys its turns by its own id instead: the group's initial state for
    turn 0, the root's state for a branch's shared turns and its branch point, else the trajectory's own."""
    if len(traj.segments) == 1:
        by_index = dict(zip((t.index for t in traj.turns), state_keys(traj), strict=True))
        return [f"{traj.group_id}:{by_index[j]}" for j in turn_indices]
    parent, at = traj.info.get("branch_of"), traj.info.get("branch_turn")
    out = []
    for j in turn_indices:
        if j == 0:
            out.append(f"{traj.group_id}:0")
        elif parent is not None and at is not None and j <= int(at):
            out.append(f"{parent}:{j}")
        else:
            out.append(f"{traj.id}:{j}")
    return out
