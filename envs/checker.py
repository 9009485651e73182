"""Conformance checks for agent environments: Gymnasium's ``check_env`` plus our async and error contracts."""

from __future__ import annotations

import asyncio
from typing import Any

from gymnasium.utils.env_checker import check_env

from envs.core import AgentEnv, answer_action, tool_action


def default_actions(env: AgentEnv) -> list[str]:
    """A short script of actions: a call of the first tool with empty arguments (maybe an error), then an answer."""
    actions = [tool_action(env.tools[0].name, {})] if env.tools else []
    return [*actions, answer_action("0")]


def check_agent_env(env: AgentEnv, actions: list[str] | None = None, seed: int = 7) -> None:
    """Raise ``AssertionError`` unless ``env`` follows the Gymnasium API and the ``AgentEnv`` contracts.

    Checks: ``check_env`` (render skipped); ``areset``/``astep`` give the same results as ``reset``/``step`` for the
    same seed and ``actions``; a malformed action gives an ``"Error:"`` observation without ending the episode;
    every observation is in ``observation_space``; reset's info has task_id/task_type/split; the final step's info
    has success and task_type.
    """
    assert isinstance(env, AgentEnv), f"expected an AgentEnv, got {type(env).__name__}"
    check_env(env, skip_render_check=True, skip_close_check=True)
    script = actions if actions is not None else default_actions(env)
    sync = _run_sync(env, script, seed)
    asynchronous = asyncio.run(_run_async(env, script, seed))
    assert sync == asynchronous, f"async episode differs from sync episode:\n{sync}\n{asynchronous}"
    _check_bad_action(env, seed)


def _run_sync(env: AgentEnv, actions: list[str], seed: int) -> list[Any]:
    obs, info = env.reset(seed=seed)
    _check_reset(env, obs, info)
    record: list[Any] = [(obs, info)]
    for action in actions:
        step = env.step(action)
        _check_step(env, step)
        record.append(step)
        if step[2] or step[3]:
            break
    return record


async def _run_async(env: AgentEnv, actions: list[str], seed: int) -> list[Any]:
    obs, info = await env.areset(seed=seed)
    _check_reset(env, obs, info)
    record: list[Any] = [(obs, info)]
    for action in actions:
        step = await env.astep(action)
        _check_step(env, step)
        record.append(step)
        if step[2] or step[3]:
            break
    return record


def _check_reset(env: AgentEnv, obs: str, info: dict[str, Any]) -> None:
    assert obs in env.observation_space, f"reset observation not in the observation space: {obs!r}"
    for key in ("task_id", "task_type", "split"):
        assert key in info, f"reset info lacks {key!r}: {info}"


def _check_step(env: AgentEnv, step: tuple[str, float, bool, bool, dict[str, Any]]) -> None:
    obs, reward, terminated, truncated, info = step
    assert obs in env.observation_space, f"step observation not in the observation space: {obs!r}"
    assert isinstance(reward, float), f"reward must be a float, got {type(reward).__name__}"
    if terminated or truncated:
        assert isinstance(info.get("success"), bool), f"final info lacks a bool 'success': {info}"
        assert "task_type" in info, f"final info lacks 'task_type': {info}"


def _check_bad_action(env: AgentEnv, seed: int) -> None:
    env.reset(seed=seed)
    for bad in ("not json", '{"tool": "no-such-tool-xyz", "arguments": {}}', '{"tool": 3}'):
        if env.turn >= env.max_turns - 1:
            env.reset(seed=seed)
        obs, reward, terminated, truncated, _ = env.step(bad)
        assert obs.startswith("Error: "), f"bad action {bad!r} gave {obs!r}, expected an 'Error: ...' observation"
        assert reward == 0.0 and not terminated, f"bad action {bad!r} must not end the episode or be rewarded"
        assert not truncated or env.turn >= env.max_turns, "bad action truncated the episode early"
