"""The demo environment agentflow/Calc-v0 with a real bubblewrap sandbox."""

import asyncio

import pytest
from conftest import require

import envs
from envs.checker import check_agent_env
from envs.core import answer_action, tool_action
from envs.demo import TASK_TYPES, CalcEnv, make_task, scripted_policy, verify
from envs.sandbox import bwrap_works


@pytest.fixture
def env():
    require(bwrap_works(), "bubblewrap (bwrap)")
    e = envs.make("agentflow/Calc-v0")
    yield e
    e.close()


def test_check_agent_env_passes(env):
    obs, _ = env.reset(seed=7)
    script = [tool_action("calc", {"expression": env.task.expression}), answer_action(str(env.task.answer))]
    check_agent_env(env, actions=script, seed=7)


def test_tool_call_and_rewards(env):
    obs, info = env.reset(seed=11)
    task = env.task
    assert obs == task.question == f"What is {task.expression}?"
    assert info["task_id"] == task.task_id and info["task_type"] == task.task_type and info["split"] == "train"
    obs, reward, terminated, truncated, _ = env.step(tool_action("calc", {"expression": task.expression}))
    assert obs == str(task.answer) and reward == 0.0 and not terminated and not truncated
    obs, reward, terminated, truncated, info = env.step(answer_action(f" {task.answer}\n"))
    assert reward == 1.0 and terminated and not truncated
    assert info["success"] is True and info["task_type"] == task.task_type

    env.reset(seed=11)
    _, reward, terminated, _, info = env.step(answer_action(str(task.answer + 1)))
    assert reward == 0.0 and terminated and info["success"] is False


def test_tool_errors_become_observations(env):
    env.reset(seed=3)
    obs, reward, terminated, truncated, _ = env.step(tool_action("calc", {"expression": "1/0"}))
    assert obs.startswith("Error: ") and "ZeroDivisionError" in obs
    assert reward == 0.0 and not terminated and not truncated
    obs, *_ = env.step(tool_action("calc", {"expression": "open('/etc/passwd').read()"}))
    assert obs.startswith("Error: ")


def test_malformed_action_continues_then_truncates(env):
    env.reset(seed=5)
    for bad in ("{not json", '{"tool": "calc", "arguments": {"expr": "1"}}'):
        obs, reward, terminated, truncated, _ = env.step(bad)
        assert obs.startswith("Error: ") and reward == 0.0 and not terminated and not truncated
    obs, reward, terminated, truncated, info = env.step('{"tool": "nope"}')
    assert obs.startswith("Error: unknown tool 'nope'; available tools: calc")
    assert truncated and not terminated and info["success"] is False and info["task_type"] == env.task.task_type
    assert env.turn == 3


def test_async_step_uses_sandbox(env):
    async def episode():
        await env.areset(seed=21, options={"split": "eval"})
        obs, *_ = await env.astep(tool_action("calc", {"expression": env.task.expression}))
        return obs, await env.astep(answer_action(obs))

    obs, (_, reward, terminated, _, info) = asyncio.run(episode())
    assert obs == str(env.task.answer) and reward == 1.0 and terminated and info["success"]


def test_splits_are_disjoint_and_deterministic():
    train = {make_task(s, "train").task_id for s in range(200)}
    evals = {make_task(s, "eval").task_id for s in range(200)}
    assert not train & evals
    assert [make_task(s, "train").question for s in range(20)] != [make_task(s, "eval").question for s in range(20)]
    assert make_task(4, "eval") == make_task(4, "eval")
    assert {make_task(s).task_type for s in range(100)} == set(TASK_TYPES)
    env = CalcEnv(sandbox_kind="process")
    obs_a, _ = env.reset(seed=9)
    obs_b, info = env.reset(seed=9, options={"split": "eval"})
    assert info["split"] == "eval" and info["seed"] == 1_000_009
    env.close()


def test_verify():
    task = make_task(2, "train", "sub")
    assert verify(task, f"  {task.answer} ")
    assert not verify(task, f"{task.answer}.0") and not verify(task, "") and not verify(task, "abc")


def _run_scripted(env, seed, task_type):
    obs, info = env.reset(seed=seed, options={"task_type": task_type})
    question, history = obs, []
    while True:
        action = scripted_policy(info["task_type"], question, history)
        obs, reward, terminated, truncated, step_info = env.step(action)
        history.append((action, obs))
        if terminated or truncated:
            return reward, step_info


def test_scripted_policy_success_per_type(env):
    rates = {}
    for task_type in TASK_TYPES:
        rewards = [_run_scripted(env, seed, task_type)[0] for seed in range(50)]
        rates[task_type] = sum(rewards) / len(rewards)
    assert rates == {"add": 1.0, "mul": 1.0, "mod": 0.0, "sub": 0.0}, rates
