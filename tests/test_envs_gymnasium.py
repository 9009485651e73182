"""One registry with Gymnasium's: our ids build with ``gymnasium.make``; Gymnasium-only text envs build with ours."""

from __future__ import annotations

import asyncio

import gymnasium
import pytest
from conftest import env_param, require_env
from gymnasium import spaces

import envs
from envs.checker import check_agent_env
from envs.core import answer_action, tool_action
from envs.errors import EnvError
from envs.gym_adapter import GymTextEnv


class GuessEnv(gymnasium.Env):
    """Guess a letter in three tries: text observations, string actions, reward 1 for the right letter."""

    observation_space = spaces.Text(64)
    action_space = spaces.Text(8)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.letter = "abcdefgh"[int(self.np_random.integers(0, 8))]
        return "Guess my letter (a to h).", {}

    def step(self, action):
        right = action.strip() == self.letter
        hint = "right" if right else ("later" if action.strip() < self.letter else "earlier")
        return hint, float(right), right, False, {}


class CountEnv(gymnasium.Env):
    """Numeric spaces: cannot carry text."""

    observation_space = spaces.Box(0.0, 1.0, (2,))
    action_space = spaces.Discrete(2)


@pytest.fixture(scope="module", autouse=True)
def gym_only_envs():
    gymnasium.register("gymtest/Guess-v0", entry_point=GuessEnv, max_episode_steps=3, reward_threshold=1.0)
    gymnasium.register("gymtest/Count-v0", entry_point=CountEnv)
    yield
    for env_id in ("gymtest/Guess-v0", "gymtest/Count-v0"):
        gymnasium.registry.pop(env_id, None)


def _agentflow_ids() -> list[str]:
    return [e for e in envs.list_envs() if e.startswith("agentflow/")]


@pytest.mark.parametrize("env_id", _agentflow_ids())
def test_gymnasium_knows_every_id_with_the_same_entry_point(env_id):
    ours, theirs = envs.spec(env_id), gymnasium.spec(env_id)
    assert theirs.entry_point == ours.entry_point
    assert theirs.kwargs.get("max_turns") == ours.max_turns


@pytest.mark.parametrize("env_id", [env_param(e) for e in _agentflow_ids()])
def test_gymnasium_make_builds_every_agentflow_env(env_id):
    require_env(env_id)
    env = gymnasium.make(env_id)
    try:
        assert env.unwrapped.max_turns == envs.spec(env_id).max_turns
        obs, info = env.reset(seed=3)
        assert isinstance(obs, str) and info["split"] == "train"
        obs, reward, terminated, truncated, _ = env.step("not json")
        assert obs.startswith("Error: ") and reward == 0.0 and not terminated
    finally:
        env.close()


def test_a_gymnasium_only_text_env_is_adapted_and_passes_the_checks():
    env = envs.make("gymtest/Guess-v0")
    try:
        assert isinstance(env, GymTextEnv) and env.max_turns == 3 and env.tools == []
        check_agent_env(env, actions=[answer_action("d"), answer_action("e")])
        obs, info = env.reset(seed=5, options={"split": "eval"})
        assert info["split"] == "eval" and info["task_id"].startswith("Guess-v0-eval-")
        letter = env.inner.unwrapped.letter
        obs, reward, terminated, _, info = env.step(tool_action("letter", {}))
        assert obs.startswith("Error: unknown tool") and not terminated
        obs, reward, terminated, _, info = env.step(answer_action("too long for the space"))
        assert obs.startswith("Error: the action is not in the env's action space")
        obs, reward, terminated, truncated, info = env.step(answer_action(letter))
        assert (reward, terminated, info["success"]) == (1.0, True, True)
    finally:
        env.close()


def test_the_adapter_keeps_train_and_eval_seeds_apart_and_runs_async():
    env = envs.make("gymtest/Guess-v0")
    try:
        train = {env.reset(seed=s)[1]["seed"] for s in range(20)}
        held_out = {env.reset(seed=s, options={"split": "eval"})[1]["seed"] for s in range(20)}
        assert not train & held_out

        async def wrong_three_times():
            await env.areset(seed=1)
            letter = env.inner.unwrapped.letter
            wrong = "a" if letter != "a" else "b"
            return [await env.astep(answer_action(wrong)) for _ in range(3)]

        steps = asyncio.run(wrong_three_times())
        assert [s[3] for s in steps] == [False, False, True]  # the TimeLimit of max_episode_steps truncates
        assert steps[-1][4]["success"] is False and steps[-1][1] == 0.0
    finally:
        env.close()


def test_envs_whose_spaces_cannot_carry_text_are_refused_with_the_reason():
    with pytest.raises(EnvError, match=r"'gymtest/Count-v0' cannot be used by agentflow: its observation space is Box"):
        envs.make("gymtest/Count-v0")
    with pytest.raises(EnvError, match="cannot carry text"):
        envs.make("CartPole-v1")


def test_unknown_ids_still_say_did_you_mean():
    with pytest.raises(KeyError, match="Did you mean 'agentflow/Calc-v0'"):
        envs.make("agentflow/Calk-v0")
