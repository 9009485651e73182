"""Continuing an episode from a recorded prefix: how an env branches, and the check that it really does.

A tree rollout plays a root episode, then branches: more continuations from the state after one of its turns. An
env declares how its state after a prefix of actions is brought back (``AgentEnv.branching``):

- ``snapshot``: the env implements ``snapshot()`` (an opaque copy of its episode state) and ``restore(state)``;
  cheap, for envs whose state is ours to copy.
- ``replay``: the state is rebuilt by resetting on the same seed and options and stepping the recorded actions
  again; for deterministic envs (same seed and actions, same observations), whatever their state lives in
  (a sandbox workdir, a browser page, a desktop app).
- ``none``: the env cannot branch (its state lives somewhere it cannot copy or replay, e.g. a remote service).

:func:`check_branching` verifies the declaration: after the same prefix, the branched env and the original give
the same observations, rewards and endings for the same further actions. ``agentflow envs check`` runs it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from envs.core import AgentEnv

BRANCHING = ("snapshot", "replay", "none")


@dataclass
class BranchReport:
    """What :func:`check_branching` did: the mode, the prefix replayed or snapshotted, the steps compared."""

    mode: str
    prefix: int
    compared: int


def branching_of(env: AgentEnv) -> str | None:
    """The env's declared branching mode, None when it declares none."""
    mode = getattr(env, "branching", None)
    if mode is not None and mode not in BRANCHING:
        raise ValueError(f"{type(env).__name__}.branching must be one of {BRANCHING}, got {mode!r}")
    return mode


def _outcome(step: tuple[str, float, bool, bool, dict[str, Any]]) -> tuple[str, float, bool, bool]:
    obs, reward, terminated, truncated, _ = step
    return obs, float(reward), bool(terminated), bool(truncated)


async def _play(env: AgentEnv, actions: list[str]) -> list[tuple[str, float, bool, bool]]:
    out = []
    for action in actions:
        step = _outcome(await env.astep(action))
        out.append(step)
        if step[2] or step[3]:
            break
    return out


async def branch(env: AgentEnv, seed: int, options: dict[str, Any], prefix: list[str], state: Any = None) -> None:
    """Bring ``env`` to the state after ``prefix`` (played from ``reset(seed, options)``): ``restore(state)`` for a
    ``snapshot`` env given a state, else a reset and a replay of the prefix. Raises ValueError for ``none``."""
    mode = branching_of(env)
    if mode in (None, "none"):
        raise ValueError(f"{type(env).__name__} cannot branch (branching={mode!r})")
    if mode == "snapshot" and state is not None:
        env.restore(state)  # type: ignore[attr-defined]
        return
    await env.areset(seed=seed, options=dict(options))
    for action in prefix:
        await env.astep(action)


async def check_branching(env: AgentEnv, actions: list[str], seed: int = 7, at: int | None = None) -> BranchReport:
    """Play ``actions`` from ``reset(seed)``; branch after ``at`` of them (default: half of the steps the episode
    takes, leaving one at least) and play the rest again: the continuation must match the original step for step.
    AssertionError names the first difference."""
    mode = branching_of(env)
    if mode in (None, "none"):
        return BranchReport(str(mode), 0, 0)
    await env.areset(seed=seed)
    n = len(await _play(env, actions))  # how many of the actions the episode takes before it ends
    k = max(0, min(n // 2 if at is None else at, n - 1))
    await env.areset(seed=seed)
    await _play(env, actions[:k])
    state = env.snapshot() if mode == "snapshot" else None  # type: ignore[attr-defined]
    first = await _play(env, actions[k:n])
    await branch(env, seed, {}, actions[:k], state)
    again = await _play(env, actions[k:n])
    for i, (a, b) in enumerate(zip(first, again, strict=False)):
        assert a == b, f"{mode} branch after {k} actions differs at step {k + i + 1}: {a!r} vs {b!r}"
    assert len(first) == len(again), f"{mode} branch after {k} actions ended after {len(again)} steps, not {len(first)}"
    return BranchReport(mode, k, len(first))


async def expert_actions(env: AgentEnv, expert: Callable[..., Any], seed: int) -> list[str]:
    """The actions the env's scripted expert takes in the episode of ``seed`` (a realistic script to branch)."""
    await env.areset(seed=seed)
    history: list[tuple[str, str]] = []
    for _ in range(env.max_turns):
        action = expert(env, history)
        if inspect.isawaitable(action):
            action = await action
        obs, _, terminated, truncated, _ = await env.astep(action)
        history.append((action, obs))
        if terminated or truncated:
            break
    return [a for a, _ in history]


def declared_branching(env_id: str) -> str | None:
    """The branching an env id's class declares, without building it (a Gymnasium id runs through the adapter)."""
    from envs.registry import _load_entry_point, spec

    s = spec(env_id)
    if s.source != "agentflow":
        from envs.gym_adapter import GymTextEnv

        return GymTextEnv.branching
    target = _load_entry_point(s.entry_point)
    return getattr(target, "branching", None) if isinstance(target, type) else None
