"""The shipped tool environments (PyCode, Shell, Retrieval) in a real bubblewrap sandbox, with scripted experts."""

import asyncio
import importlib
import importlib.util
import json
from dataclasses import replace

import pytest
from conftest import env_param, play_episode, require, require_env

import envs
from envs.checker import check_agent_env
from envs.core import answer_action, tool_action
from envs.pycode import TASK_TYPES as CODE_TYPES
from envs.pycode import make_code_task
from envs.retrieval import TASK_TYPES as QA_TYPES
from envs.retrieval import corpus, make_qa_task
from envs.retrieval_data import DATA_FILE, generate_documents
from envs.sandbox import bwrap_works
from envs.shell import TASK_TYPES as SHELL_TYPES
from envs.shell import make_shell_task

SHIPPED = {
    "agentflow/PyCode-v0": "envs.pycode",
    "agentflow/Shell-v0": "envs.shell",
    "agentflow/Retrieval-v0": "envs.retrieval",
}


def play(env, expert, seed, split="train"):
    """One expert episode; returns (actions, final reward, final info)."""
    history, reward, info = play_episode(env, expert, seed, split)
    return [a for a, _ in history], reward, info


@pytest.fixture(params=sorted(SHIPPED))
def env_and_expert(request):
    require(bwrap_works(), "bubblewrap (bwrap)")
    env = envs.make(request.param)
    yield env, importlib.import_module(SHIPPED[request.param]).expert_action
    env.close()


@pytest.fixture
def bwrap_env():
    """A factory of envs in bwrap sandboxes, closed after the test."""
    require(bwrap_works(), "bubblewrap (bwrap)")
    made = []

    def factory(env_id):
        made.append(envs.make(env_id))
        return made[-1]

    yield factory
    for env in made:
        env.close()


def test_check_agent_env_with_expert_script(env_and_expert):
    env, expert = env_and_expert
    check_agent_env(env)  # the default script (bad tool call, then a wrong answer)
    actions, reward, _ = play(env, expert, seed=7)
    assert reward == 1.0
    check_agent_env(env, actions=actions, seed=7)


def test_expert_solves_train_and_eval(env_and_expert):
    env, expert = env_and_expert
    for split in ("train", "eval"):
        for seed in range(8):
            _, reward, info = play(env, expert, seed, split)
            assert reward == 1.0 and info["success"] is True, (split, seed, info)
            assert info["split"] == split and "reward_terms" in info


def test_wrong_answer_scores_zero(env_and_expert):
    env, _ = env_and_expert
    for seed in range(4):
        env.reset(seed=seed)
        _, reward, terminated, _, info = env.step(answer_action("def solve(*a):\n    return None\n"))
        assert reward == 0.0 and terminated and info["success"] is False


def test_async_expert_episode(env_and_expert):
    env, expert = env_and_expert

    async def episode():
        await env.areset(seed=3, options={"split": "eval"})
        history = []
        while True:
            action = expert(env, history)
            obs, reward, terminated, truncated, info = await env.astep(action)
            history.append((action, obs))
            if terminated or truncated:
                return reward, info

    reward, info = asyncio.run(episode())
    assert reward == 1.0 and info["success"]


def test_sandbox_kind_process(env_and_expert):
    env, expert = env_and_expert
    other = envs.make(env.spec.id, sandbox_kind="process", split="eval")
    try:
        assert play(other, expert, seed=2, split="eval")[1] == 1.0
    finally:
        other.close()


@pytest.mark.parametrize(
    "make, kinds", [(make_code_task, CODE_TYPES), (make_shell_task, SHELL_TYPES), (make_qa_task, QA_TYPES)]
)
def test_tasks_deterministic_and_splits_disjoint(make, kinds):
    assert make(5, "train") == make(5, "train")
    assert {make(s, "train").task_type for s in range(300)} == set(kinds)
    env_cls = {make_code_task: "PyCode", make_shell_task: "Shell", make_qa_task: "Retrieval"}[make]
    ts = envs.spec(f"agentflow/{env_cls}-v0").make(sandbox_kind="process").task_sets["default"]
    train = {repr(replace(make(ts.task_seed(s, "train"), "train"), task_id="")) for s in range(200)}
    evals = {repr(replace(make(ts.task_seed(s, "eval"), "eval"), task_id="")) for s in range(200)}
    assert len(train) > 150 and not train & evals


def test_pycode_partial_and_broken_solutions(bwrap_env):
    env = bwrap_env("agentflow/PyCode-v0")
    env.reset(seed=0, options={})
    task = env.task
    wrong_sometimes = (
        task.reference
        + f"\n_orig = solve\ndef solve(*a):\n    return None if list(a) == {task.hidden[0][0]!r} else _orig(*a)\n"
    )  # noqa: E501
    _, reward, _, _, info = env.step(answer_action(f"```python\n{wrong_sometimes}```"))
    assert reward == 0.0 and 0.5 < info["reward_terms"]["pass_fraction"] < 1.0
    for code in ("def solve(:\n", "import os\nos._exit(0)\n", "print('@@AGENTFLOW-RESULTS@@[]')\nraise SystemExit"):
        env.reset(seed=0)
        assert env.step(answer_action(code))[1] == 0.0
    env.reset(seed=0)
    obs, *_ = env.step(
        tool_action("run_python", {"code": "import socket; socket.create_connection(('1.1.1.1', 80), 2)"})
    )
    assert "exit code: 1" in obs and "OSError" in obs or "Errno" in obs


def test_shell_state_checks_and_symlink_escape(bwrap_env):
    env = bwrap_env("agentflow/Shell-v0")
    seed = next(
        s
        for s in range(100)
        if make_shell_task(env.task_sets["default"].task_seed(s), "train").task_type == "sort_unique"
    )
    env.reset(seed=seed)
    obs, *_ = env.step(tool_action("sh", {"command": "sort names.txt > sorted.txt && wc -l < names.txt"}))
    assert obs.strip().isdigit()
    assert env.step(answer_action("done"))[1] == 0.0  # duplicates kept: wrong state
    env.reset(seed=seed)
    env.step(tool_action("sh", {"command": "ln -s /etc/passwd sorted.txt"}))
    _, reward, terminated, _, info = env.step(answer_action("done"))
    assert reward == 0.0 and terminated and info["reward_terms"] == {"task_check": 0.0}
    env.reset(seed=seed)
    obs, *_ = env.step(tool_action("sh", {"command": "touch /etc/agentflow-test; cat missing"}))
    assert "(exit code 1)" in obs and "Read-only" in obs


def test_retrieval_data_file_and_search():
    assert DATA_FILE.read_text(encoding="utf-8") == "".join(
        json.dumps(d, sort_keys=True, ensure_ascii=False) + "\n" for d in generate_documents()
    ), "envs/data/retrieval_docs.jsonl is stale: run python -m envs.retrieval_data"
    index, by_title = corpus()
    assert len(index.docs) == 300 and len(by_title) == 300
    for seed in range(60):
        task = make_qa_task(seed, "train")
        for query, doc_id in zip(task.queries, task.doc_ids, strict=True):
            assert doc_id in [d["id"] for _, d in index.search(query, 3)], (task, query)


def test_retrieval_numeric_answers_and_task_sets():
    env = envs.make("agentflow/Retrieval-v0", sandbox_kind="process")
    try:
        seed = next(s for s in range(200) if make_qa_task(s, "train").task_type == "city_population")
        env.reset(seed=seed)
        answer = f"{int(env.task.answer):,}."
        assert env.step(answer_action(answer))[1] == 1.0
        for s in range(30):
            _, info = env.reset(seed=s, options={"task_set": "single_hop", "split": "eval"})
            assert info["task_type"] in QA_TYPES[:3] and info["task_set"] == "single_hop"
        obs, *_ = env.step(tool_action("search", {"query": "x", "k": 50}))
        assert obs.startswith("Error: k must be between 1 and 10")
    finally:
        env.close()


@pytest.mark.parametrize("env_id", [env_param(e) for e in envs.list_envs() if e.startswith("agentflow/")])
def test_every_registered_env_passes_check_env(env_id):
    require_env(env_id)
    env = envs.make(env_id)
    try:
        check_agent_env(env)
    finally:
        env.close()


def test_broken_sandbox_during_scoring_is_an_error_not_zero(bwrap_env, monkeypatch):
    import envs.pycode
    from envs.errors import SandboxError, VerifierError

    env = bwrap_env("agentflow/PyCode-v0")
    env.reset(seed=1)

    def no_sandbox(*args, **kwargs):
        raise SandboxError("bubblewrap vanished")

    monkeypatch.setattr(envs.pycode, "make_sandbox", no_sandbox)
    with pytest.raises(VerifierError, match="verifier 'all_tests_pass' failed: SandboxError: bubblewrap vanished"):
        env.step(answer_action(env.task.reference))
    env.reset(seed=1)
    with pytest.raises(VerifierError, match="bubblewrap vanished"):
        asyncio.run(env.astep(answer_action(env.task.reference)))


def test_shell_path_answers_accept_workdir_prefix():
    from envs.shell import _normalize_path

    assert _normalize_path(" ./tree/ab/c.txt ") == "tree/ab/c.txt"
    assert _normalize_path("/tmp/sandbox/tree/ab/c.txt") == _normalize_path("`/work/tree/ab/c.txt`") == "tree/ab/c.txt"
    assert _normalize_path("subtree/ab/c.txt") == "subtree/ab/c.txt"


@pytest.mark.slow
def test_pycode_infinite_loop_scores_zero(bwrap_env):
    env = bwrap_env("agentflow/PyCode-v0")
    env.reset(seed=0)
    _, reward, terminated, _, info = env.step(answer_action("def solve(*a):\n    while True:\n        pass\n"))
    assert reward == 0.0 and terminated and info["reward_terms"]["pass_fraction"] == 0.0


def test_shell_env_takes_warm_sandboxes_from_a_pool():
    import envs
    from envs.sandbox import SandboxPool
    from envs.shell import expert_action

    pool = SandboxPool("bwrap", size=2)
    assert pool.wait_ready(timeout=30)
    env = envs.make("agentflow/Shell-v0", sandbox_pool=pool)
    try:
        for seed in range(3):
            env.reset(seed=seed)
            history: list[tuple[str, str]] = []
            for _ in range(env.max_turns):
                action = expert_action(env.unwrapped, history)
                obs, reward, term, trunc, info = env.step(action)
                history.append((action, obs))
                if term or trunc:
                    break
            assert info["success"], (seed, history)
        assert pool.cold_starts == 0  # every episode's first tool call found a started sandbox
    finally:
        env.close()
        pool.close()
