"""Rubrics: weighted terms; a failing verifier raises VerifierError out of step/astep, never a reward of 0."""

import asyncio
import math
from types import SimpleNamespace

import pytest

from envs.core import AgentEnv, answer_action
from envs.errors import EnvError, VerifierError
from envs.verifiers import Rubric, Term, exact_match, normalize_text, numeric_match, used_tool

TASK = SimpleNamespace(answer="Paris")


def test_weighted_sum_success_and_terms():
    rubric = Rubric(
        [(1.0, exact_match()), (0.5, lambda a, t, e: len(a) < 20, "short"), (0.0, lambda a, t, e: 0.3, "log")]
    )
    score = rubric.score(" the paris. ", TASK)
    assert score.reward == 1.5 and score.success and score.terms == {"exact_match": 1.0, "short": 1.0, "log": 0.3}
    score = rubric.score("London, definitely not Paris", TASK)
    assert score.reward == 0.0 and not score.success
    assert Rubric([(1.0, exact_match())], success_threshold=0.5).score("x", TASK).success is False
    assert "1*exact_match" in repr(rubric)


def test_term_validation():
    with pytest.raises(ValueError, match="finite number"):
        Term(math.inf, exact_match())
    with pytest.raises(ValueError, match="unique"):
        Rubric([(1.0, exact_match()), (1.0, exact_match())])
    with pytest.raises(ValueError, match="at least one term"):
        Rubric([])


def test_failing_verifier_raises_with_message():
    def broken(answer, task, env):
        raise KeyError("missing_field")

    rubric = Rubric([(1.0, exact_match()), (1.0, broken)])
    with pytest.raises(VerifierError, match=r"verifier 'broken' failed: KeyError: 'missing_field'"):
        rubric.score("Paris", TASK)
    for bad in (float("nan"), "1.0", None):
        with pytest.raises(VerifierError, match="expected a finite number"):
            Rubric([(1.0, lambda a, t, e, v=bad: v, "bad")]).score("x", TASK)
    assert issubclass(VerifierError, EnvError)


def test_reusable_terms():
    assert normalize_text("  The  Café, Ünter-Straße! ") == "cafe unter-straße"
    num = numeric_match(lambda t: 48213)
    assert (
        num("48,213", TASK, None) == 1.0 and num("48213.0", TASK, None) == 1.0 and num("about 48213", TASK, None) == 0
    )
    env = SimpleNamespace(tool_calls=["search"])
    assert used_tool("search")("x", TASK, env) == 1.0 and used_tool("python")("x", TASK, env) == 0.0


class _Env(AgentEnv):
    """An env whose verifier raises on the answer "boom"."""

    def reset_task(self, seed, options):
        return "q", {"task_id": "t", "task_type": "k", "split": "train"}

    def score_answer(self, text):
        def verdict(answer, task, env):
            if answer == "boom":
                raise RuntimeError("reference file is corrupt")
            return answer == "ok"

        score = Rubric([(1.0, verdict)]).score(text, None, self)
        return score.reward, score.success

    def call_tool(self, name, arguments):
        raise VerifierError("tool-side verifier failed")


def test_verifier_error_propagates_from_step_and_astep():
    env = _Env()
    env.reset(seed=0)
    with pytest.raises(VerifierError, match="reference file is corrupt"):
        env.step(answer_action("boom"))
    env.reset(seed=0)
    with pytest.raises(VerifierError, match="reference file is corrupt"):
        asyncio.run(env.astep(answer_action("boom")))
    env.reset(seed=0)
    assert env.step(answer_action("ok"))[1] == 1.0
