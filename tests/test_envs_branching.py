"""Branching from an intermediate state: every env declares how, and the check holds the declaration to account."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

import envs
from envs.branching import BRANCHING, branch, check_branching, expert_actions
from envs.core import answer_action, tool_action
from envs.example import ReverseEnv
from envs.registry import _load_entry_point

SHIPPED = ("agentflow/", "textarena/", "reasoning_gym/", "me/Reverse-v0")


def test_every_shipped_env_declares_how_it_branches() -> None:
    shipped = [i for i in envs.list_envs() if i.startswith(SHIPPED)]
    assert len(shipped) >= 19
    modes = {i: getattr(_load_entry_point(envs.spec(i).entry_point), "branching", None) for i in shipped}
    assert all(m in BRANCHING for m in modes.values()), {i: m for i, m in modes.items() if m not in BRANCHING}
    assert modes["agentflow/Calc-v0"] == "snapshot" and modes["agentflow/Trail-v0"] == "replay"


class NoisyReverse(ReverseEnv):
    """Declares ``replay`` but its tool answers from an unseeded generator: a replay does not repeat."""

    _rng = random.Random()

    def letter(self, index: int) -> str:  # type: ignore[override]
        return str(self._rng.random())


class LeakySnapshot(ReverseEnv):
    """Declares ``snapshot`` but forgets the turn count: the restored episode ends at a different step."""

    branching = "snapshot"

    def snapshot(self) -> Any:
        return self.task

    def restore(self, state: Any) -> None:
        self.task = state
        self._turn, self._done = 0, False


def _script(n: int) -> list[str]:
    return [tool_action("letter", {"index": i % 3}) for i in range(n)] + [answer_action("x")]


def test_a_false_declaration_fails_the_check() -> None:
    with pytest.raises(AssertionError, match="replay branch after 2 actions differs at step 3"):
        asyncio.run(check_branching(NoisyReverse(), _script(4), seed=3))
    with pytest.raises(AssertionError, match="snapshot branch after 3 actions differs at step 7"):
        asyncio.run(check_branching(LeakySnapshot(max_turns=7), _script(10), seed=3))
    report = asyncio.run(check_branching(ReverseEnv(), _script(4), seed=3))
    assert (report.mode, report.prefix, report.compared) == ("replay", 2, 3)


def test_a_calc_snapshot_continues_in_another_env() -> None:
    from envs.demo import expert_action

    a, b = envs.make("agentflow/Calc-v0"), envs.make("agentflow/Calc-v0")
    try:
        actions = asyncio.run(expert_actions(a, expert_action, seed=11))
        assert len(actions) >= 2
        asyncio.run(a.areset(seed=11))
        asyncio.run(a.astep(actions[0]))
        state = a.snapshot()
        want = asyncio.run(a.astep(actions[1]))[:4]
        asyncio.run(branch(b, 11, {}, actions[:1], state))  # b never played the prefix
        assert asyncio.run(b.astep(actions[1]))[:4] == want
    finally:
        a.close()
        b.close()


def test_an_env_that_cannot_branch_is_refused() -> None:
    env = ReverseEnv()
    env.branching = "none"
    with pytest.raises(ValueError, match="cannot branch"):
        asyncio.run(branch(env, 0, {}, []))
    assert asyncio.run(check_branching(env, _script(2))).mode == "none"


def test_envs_check_reports_the_branching(capsys) -> None:
    from envs.console import check

    check("me/Reverse-v0")
    assert "ok: me/Reverse-v0 branches by replay: after" in capsys.readouterr().out
