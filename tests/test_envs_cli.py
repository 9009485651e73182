"""`agentflow envs check` and `agentflow envs play`."""

import io
import json

import pytest

import envs
from agentflow.cli import main
from envs import registry
from envs.core import AgentEnv, tool_action


class _BrokenEnv(AgentEnv):
    """Returns a non-string observation from reset: check_env must reject it."""

    def reset_task(self, seed, options):
        return 42, {"task_id": "t", "task_type": "k", "split": "train"}

    def score_answer(self, text):
        return 0.0, False


class _NondeterministicEnv(AgentEnv):
    """Ignores the seed: the same seed gives different observations."""

    calls = 0

    def reset_task(self, seed, options):
        type(self).calls += 1
        return f"q{self.calls}", {"task_id": "t", "task_type": "k", "split": "train"}

    def score_answer(self, text):
        return 0.0, False


class _NoInfoEnv(AgentEnv):
    """Forgets the info keys AgentEnv requires."""

    def reset_task(self, seed, options):
        return "q", {}

    def score_answer(self, text):
        return 0.0, False


@pytest.fixture
def scratch_registry(monkeypatch):
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))


def test_check_ok(capsys):
    assert main(["envs", "check", "agentflow/Retrieval-v0"]) == 0
    assert "ok: agentflow/Retrieval-v0 passes" in capsys.readouterr().out


@pytest.mark.parametrize(
    "cls, fragment",
    [
        (_BrokenEnv, "TypeError: object of type 'int' has no len()"),
        (_NondeterministicEnv, "`env.reset(seed=123)` is non-deterministic"),
        (_NoInfoEnv, "info lacks"),
    ],
)
def test_check_broken_env_exits_nonzero_with_reason(scratch_registry, capsys, cls, fragment):
    envs.register("test/Broken-v0", cls)
    assert main(["envs", "check", "test/Broken-v0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("agentflow: error: test/Broken-v0 fails the env check: ") and "\n" not in err
    assert fragment in err


def test_check_unknown_id(capsys):
    assert main(["envs", "check", "agentflow/Retreival-v0"]) == 2
    assert "Did you mean 'agentflow/Retrieval-v0'?" in capsys.readouterr().err


def test_play_from_stdin(monkeypatch, capsys):
    from envs.retrieval import make_qa_task

    task = make_qa_task(1_000_004, "eval")
    lines = ["", tool_action("search", {"query": task.queries[0]}), "not json at all but an answer", ""]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines) + "\n"))
    assert main(["envs", "play", "agentflow/Retrieval-v0", "--seed", "4", "--split", "eval"]) == 0
    out = capsys.readouterr().out
    assert f"observation: {task.prompt.splitlines()[0]}" in out
    assert f"[{task.doc_ids[0]}]" in out and "observation: Incorrect." in out and "episode over: success=False" in out
    info = json.loads([ln for ln in out.splitlines() if ln.startswith("info: ")][-1][6:])
    assert info["task_id"] == "retrieval-eval-1000004" and info["success"] is False


def test_play_correct_answer_and_eof(monkeypatch, capsys):
    from envs.retrieval import make_qa_task

    task = make_qa_task(2, "train")
    monkeypatch.setattr("sys.stdin", io.StringIO(task.answer + "\n"))
    assert main(["envs", "play", "agentflow/Retrieval-v0", "--seed", "2"]) == 0
    assert "reward: 1  terminated: True" in capsys.readouterr().out
    monkeypatch.setattr("sys.stdin", io.StringIO('{"tool": "search"}\n'))
    assert main(["envs", "play", "agentflow/Retrieval-v0"]) == 0
    out = capsys.readouterr().out
    assert "observation: Error: tool 'search' is missing required argument(s): query" in out
    assert "stdin closed before the episode ended" in out


def test_user_env_in_one_file_checks_and_plays(scratch_registry, monkeypatch, capsys):
    """The README's example: one file (envs/example.py) with one register call, found through 'module:id'."""
    assert main(["envs", "check", "envs.example:me/Reverse-v0"]) == 0
    assert "ok: envs.example:me/Reverse-v0 passes" in capsys.readouterr().out
    from envs.example import ReverseEnv

    env = ReverseEnv()
    env.reset(seed=3)
    word = env.task.word
    lines = [tool_action("letter", {"index": i}) for i in range(len(word))] + [word[::-1]]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines) + "\n"))
    assert main(["envs", "play", "me/Reverse-v0", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "reward: 1  terminated: True" in out and '"used_letter": 1.0' in out


def test_module_prefixed_id_errors(capsys):
    assert main(["envs", "check", "no_such_module_xyz:me/Thing-v0"]) == 2
    assert "cannot import module 'no_such_module_xyz' that should register 'me/Thing-v0'" in capsys.readouterr().err
