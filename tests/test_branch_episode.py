"""Branching an episode from one of its turns: the env brought back as it declares, the prefix's KV reused."""

from __future__ import annotations

import asyncio

import pytest
from test_lap import TINY, Replay

import envs
from agentflow.chat import ChatTokenizer
from agentflow.engine.embedded import EmbeddedEngine
from agentflow.episode import EpisodeSpec, run_branch, run_episode
from agentflow.model_init import init_model
from agentflow.types import SamplingParams
from envs.core import tool_action


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("tiny"), TINY)


@pytest.fixture
def env():
    env = envs.make("agentflow/Calc-v0")
    yield env
    env.close()


def _root(tok: ChatTokenizer, env, texts: list[str]):
    """A root episode on seed 5 whose model replies are ``texts``."""
    return asyncio.run(run_episode(Replay(tok, texts), tok, env, EpisodeSpec("root", "g", 5), SamplingParams(), 512))


def _call(expr: str) -> str:
    call = '{"name": "calc", "arguments": {"expression": "EXPR"}}'.replace("EXPR", expr)
    return f"<tool_call>\n{call}\n</tool_call>"


THREE_CALLS = [_call("1+1"), _call("2+2"), _call("3+3")]


def test_a_branch_continues_the_env_where_the_root_was(tiny_model, env) -> None:
    tok = ChatTokenizer(tiny_model)
    root = _root(tok, env, THREE_CALLS)
    assert [t.action for t in root.turns] == [tool_action("calc", {"expression": e}) for e in ("1+1", "2+2", "3+3")]
    assert root.status == "truncated" and len(root.turns) == 3
    branch = asyncio.run(run_branch(Replay(tok, [_call("7*6"), _call("5-1")]), tok, env, EpisodeSpec("b", "g", 5),
                                    SamplingParams(), 512, root, at_turn=1))  # fmt: skip
    assert branch.status == "truncated" and branch.info["branch_of"] == "root" and branch.info["branch_turn"] == 1
    assert [t.observation for t in branch.turns] == [root.turns[0].observation, "42", "4"]
    assert env.unwrapped._turn == 3  # the env was replayed to its first turn, then took two more
    seg, start = branch.segments[0], root.turns[1].span[0]
    assert seg.token_ids[:start] == root.segments[0].token_ids[:start] and not any(seg.loss_mask[:start])
    assert branch.turns[1].span[0] == start and all(seg.loss_mask[slice(*branch.turns[1].span)])


def test_a_branch_reads_the_roots_prefix_from_the_engines_cache(tiny_model, env) -> None:
    tok = ChatTokenizer(tiny_model)
    root = _root(tok, env, THREE_CALLS)
    with EmbeddedEngine(tiny_model, max_slots=4, max_len=512, paused_aware=True) as engine:
        engine.generate_sync(root.segments[0].token_ids, SamplingParams(max_new_tokens=1))  # the root's KV, cached
        before = engine.stats()
        sp = SamplingParams(temperature=1.0, max_new_tokens=24, seed=1)
        branch = asyncio.run(run_branch(engine, tok, env, EpisodeSpec("b", "g", 5), sp, 512, root, at_turn=2))
        after = engine.stats()
    start = root.turns[2].span[0]
    assert branch.status != "error", branch.error
    reused = after["prefix_tokens_reused"] - before["prefix_tokens_reused"]
    assert reused >= start - 1  # its first prompt but the last token
    assert after["prefix_copies"] == 1  # copied out of the root's entry, which stays for other branches


def test_a_branch_that_cannot_be_made_says_why(tiny_model, env) -> None:
    tok = ChatTokenizer(tiny_model)
    root = _root(tok, env, [_call("1+1"), "the answer is 2"])
    out = asyncio.run(run_branch(Replay(tok, []), tok, env, EpisodeSpec("b", "g", 5), SamplingParams(), 512, root, 5))
    assert out.status == "error" and "branch at turn 5 of a 2-turn" in out.error
