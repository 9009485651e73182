"""Envs from other libraries: TextArena's single-player games and Reasoning Gym's datasets (envs/adapters.py)."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
from conftest import play_episode as _play
from conftest import require

import envs
from envs.adapters import ReasoningGymEnv, TextArenaEnv, guess_the_number_expert
from envs.core import answer_action, tool_action
from envs.errors import EnvError


@pytest.fixture(autouse=True)
def _libraries() -> None:
    for module, package in (("textarena", "textarena"), ("reasoning_gym", "reasoning-gym")):
        require(importlib.util.find_spec(module) is not None, f"the {package} package")


def test_guess_the_number_plays_to_the_end_with_the_games_reward() -> None:
    env = envs.make("textarena/GuessTheNumber-v0")
    history, reward, info = _play(env, guess_the_number_expert, seed=0, split="eval")
    assert info["success"] and reward == 1.0 and info["game_reward"] == 1.0
    assert history[-1][1].startswith("Game over: Congratulations")
    assert all("[Player]" not in obs and not obs.startswith("[") for _, obs in history)  # only the game's words
    assert info["task_id"].startswith("GuessTheNumber-v0-eval-")
    # the expert's off-by-one repeats a guess on some targets: an invalid move, then the game ends it
    outcomes = [_play(env, guess_the_number_expert, seed=s)[2] for s in range(40)]
    rate = sum(o["success"] for o in outcomes) / len(outcomes)
    assert 0.3 < rate < 0.95
    failed = next(_play(env, guess_the_number_expert, seed=s) for s in range(40) if not outcomes[s]["success"])
    assert "already guessed" in failed[0][-1][1] and 0.0 < failed[1] < 1.0  # partial credit from the game


def test_success_reward_and_seeded_tasks() -> None:
    env = TextArenaEnv("GuessTheNumber-v0", reward="success")
    first = [env.reset(seed=s)[0] and env.inner.game_number for s in range(30)]
    again = [env.reset(seed=s)[0] and env.inner.game_number for s in range(30)]
    assert first == again and len(set(first)) > 5
    env.reset(seed=1)
    env.step(answer_action("no brackets here"))  # the game's own invalid-move rule (one allowed)
    obs, reward, terminated, _, info = env.step(answer_action("still none"))
    assert terminated and reward == 0.0 and not info["success"] and obs.startswith("Game over")
    with pytest.raises(EnvError, match="reward must be"):
        TextArenaEnv("GuessTheNumber-v0", reward="partial")


def test_textarena_errors_are_clear() -> None:
    with pytest.raises(EnvError, match="TextArena has no game 'GuessTheNumbr-v0'. Did you mean 'GuessTheNumber-v0'"):
        TextArenaEnv("GuessTheNumbr-v0")
    env = envs.make("textarena/Mastermind-v0")
    env.reset(seed=3)
    obs, reward, terminated, _, _ = env.step(tool_action("guess", {"code": "1234"}))
    assert obs.startswith("Error: unknown tool 'guess'") and not terminated and reward == 0.0


def test_async_steps_match_sync_steps() -> None:
    env = envs.make("textarena/TowerOfHanoi-v0")
    moves = [answer_action("[A C]"), answer_action("[A B]"), answer_action("[C B]")]

    def sync():
        out = [env.reset(seed=4)]
        return out + [env.step(m) for m in moves]

    async def run_async():
        out = [await env.areset(seed=4)]
        return out + [await env.astep(m) for m in moves]

    assert sync() == asyncio.run(run_async())


def test_reasoning_gym_scores_with_the_datasets_verifier() -> None:
    env = envs.make("reasoning_gym/chain_sum-v0")
    obs, info = env.reset(seed=11, options={"split": "eval"})
    assert obs == env.entry["question"] and info["task_type"] == "chain_sum"
    _, reward, terminated, _, info = env.step(answer_action(str(env.entry["answer"])))
    assert terminated and reward == 1.0 and info["success"] and info["expected"] == str(env.entry["answer"])
    env.reset(seed=11, options={"split": "eval"})
    _, reward, terminated, _, info = env.step(answer_action("not a number"))
    assert terminated and reward == 0.0 and not info["success"]
    train = {env.reset(seed=s)[1]["task_id"] for s in range(50)}
    held_out = {env.reset(seed=s, options={"split": "eval"})[1]["task_id"] for s in range(50)}
    assert not train & held_out


def test_reasoning_gym_errors_are_clear() -> None:
    with pytest.raises(EnvError, match="no dataset 'chain_summ'. Did you mean 'chain_sum'"):
        ReasoningGymEnv("chain_summ")
    with pytest.raises(EnvError, match="Reasoning Gym dataset 'chain_sum' with config"):
        ReasoningGymEnv("chain_sum", config={"no_such_option": 3})
    env = ReasoningGymEnv("gcd", config={"min_numbers": 2, "max_numbers": 2})
    env.reset(seed=0)
    obs, *_ = env.step(tool_action("calc", {}))
    assert obs.startswith("Error: unknown tool 'calc'")
