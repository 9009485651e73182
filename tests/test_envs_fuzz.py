"""`agentflow envs check ID --fuzz N`: malformed actions from a seeded generator, on every registered id.

The seed is fresh each run (``AGENTFLOW_FUZZ_SEED`` fixes it) and printed in every failure with the command that
replays it, so CI explores new actions each time and a failure it finds can be run again.
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import os
import random
import time

import gymnasium
import pytest
from conftest import env_param, require_env
from gymnasium import spaces

import envs
from agentflow.cli import main
from envs import registry
from envs.console import check
from envs.fuzz import MAKERS, fuzz_env, malformed_actions
from envs.tools import ToolEnv, tool

SEED = int(os.environ.get("AGENTFLOW_FUZZ_SEED", random.SystemRandom().randrange(2**31)))
FUZZ_N = 200


SHIPPED = ("agentflow/", "textarena/", "reasoning_gym/")  # our envs and the adapted ones (envs/adapters.py)


@pytest.mark.parametrize("env_id", [env_param(e) for e in envs.list_envs() if e.startswith(SHIPPED)])
def test_every_registered_env_answers_every_malformed_action(env_id):
    require_env(env_id)
    out = io.StringIO()
    t0 = time.perf_counter()
    check(env_id, out=out, fuzz=FUZZ_N, fuzz_seed=SEED)  # raises EnvCheckError with the seed and the replay line
    assert f"answers {FUZZ_N} malformed actions (seed {SEED})" in out.getvalue()
    print(f"{env_id}: fuzz {FUZZ_N} (seed {SEED}) with the checks in {time.perf_counter() - t0:.1f} s")


def test_the_readme_example_and_a_gymnasium_text_env_pass_the_fuzz(monkeypatch, capsys):
    import envs.example

    importlib.reload(envs.example)  # registered again, whatever registry an earlier test left behind
    assert main(["envs", "check", "envs.example:me/Reverse-v0", "--fuzz", str(FUZZ_N), "--fuzz-seed", str(SEED)]) == 0
    assert f"(seed {SEED})" in capsys.readouterr().out
    gymnasium.register("fuzztest/Echo-v0", entry_point=_EchoText, max_episode_steps=6)
    try:
        check("fuzztest/Echo-v0", out=io.StringIO(), fuzz=FUZZ_N, fuzz_seed=SEED)
    finally:
        gymnasium.registry.pop("fuzztest/Echo-v0")


class _EchoText(gymnasium.Env):
    """A Gymnasium text env: echoes the action, reward 1 for "stop"."""

    observation_space = spaces.Text(256)
    action_space = spaces.Text(32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return "say stop", {}

    def step(self, action):
        return f"you said {action}", float(action == "stop"), action == "stop", False, {}


def test_the_generator_is_seeded_and_covers_every_kind():
    tools = _Leaky().tools
    first = malformed_actions(tools, 300, seed=11)
    assert first == malformed_actions(tools, 300, seed=11)
    assert first != malformed_actions(tools, 300, seed=12)
    assert {c.kind for c in first} == {"empty", "not_json", "truncated_json", "not_object", "unknown_tool",
                                       "wrong_keys", "missing_argument", "wrong_type", "unknown_argument",
                                       "huge_argument", "non_utf8", "random_bytes", "deep_nesting", "huge_number",
                                       "url"}  # fmt: skip
    assert len(MAKERS) == 15
    assert any(isinstance(c.action, bytes) for c in first)  # not even a string
    assert any(len(c.action) >= 1 << 20 for c in first if c.kind == "huge_argument")


class _Leaky(ToolEnv):
    """Breaks the contract three ways: follows any URL, raises on non-ASCII text, hangs on a long query."""

    max_turns = 4

    def reset_task(self, seed, options):
        return "go", {"task_id": "l", "task_type": "leak", "split": "train"}

    def score_answer(self, text):
        return 0.0, False

    @tool
    def fetch(self, url: str) -> str:
        """Fetch a page.

        Args:
            url: Where.
        """
        return f"contents of {url}"

    @tool
    def search(self, query: str, k: int = 3) -> str:
        """Search.

        Args:
            query: Words.
            k: How many.
        """
        if "://" in query:
            raise RuntimeError("a URL in a query")  # no EnvError: it escapes step
        return "nothing"


def test_a_broken_env_fails_the_fuzz_with_the_seed_and_the_replay_line(monkeypatch, capsys):
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))
    envs.register("test/Leaky-v0", _Leaky)
    assert main(["envs", "check", "test/Leaky-v0", "--fuzz", "300", "--fuzz-seed", "5"]) == 2
    err = capsys.readouterr().err
    assert "test/Leaky-v0 fails the fuzz check (seed 5): case " in err
    assert "replay: agentflow envs check test/Leaky-v0 --fuzz 300 --fuzz-seed 5" in err
    report = fuzz_env(_Leaky(), 300, seed=5)
    problems = " ".join(report.failures)
    assert "instead of an 'Error: ...' observation" in problems  # the URL was followed
    assert "raised RuntimeError: a URL in a query" in problems


def test_a_hanging_step_is_reported_not_waited_for():
    class _Hangs(_Leaky):
        def step(self, action):
            time.sleep(3)
            return super().step(action)

    env = _Hangs()
    t0 = time.perf_counter()
    report = fuzz_env(env, 60, seed=1, timeout_s=0.5)
    assert time.perf_counter() - t0 < 3
    assert any("no answer within the step timeout (0.5 s)" in f for f in report.failures)
