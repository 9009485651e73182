"""Tree rollouts end to end: a group's roots, branches from their turns, the samples' state nodes, tree credit."""

from __future__ import annotations

import asyncio
import json

import pytest
from test_lap import TINY

from agentflow.chat import ChatTokenizer
from agentflow.config import ConfigError, load_config
from agentflow.controller import to_samples
from agentflow.model_init import init_model
from agentflow.rollout import EnvPool, Rollouts
from agentflow.tree import TreeSpec, branch_points, turn_nodes
from agentflow.types import GenerateResult, SamplingParams
from envs.tasks import DataMixture, DataSource
from trainer.losses import plan_advantages
from trainer.types import LossSettings


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return ChatTokenizer(init_model(tmp_path_factory.mktemp("tiny"), TINY))


class Scripted:
    """Two calc calls, then a wrong answer: episodes of three turns."""

    weight_version = 0

    def __init__(self, tok: ChatTokenizer) -> None:
        self.tok, self.calls = tok, 0

    async def generate(self, input_ids, sampling, rid=None):
        self.calls += 1
        calls = self.tok.decode(input_ids).count("<tool_call>") - 1  # the system prompt shows the format once
        if calls < 2:
            call = {"name": "calc", "arguments": {"expression": f"{calls}+1"}}
            text = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
        else:
            text = "wrong"
        ids = self.tok.encode(text + "<|im_end|>")
        return GenerateResult(rid or "", ids, [-0.1 * (1 + calls)] * len(ids), [0] * len(ids), "stop", len(input_ids))


def test_a_group_grows_branches_and_its_samples_carry_state_nodes(tok) -> None:
    pool = EnvPool("agentflow/Calc-v0", {})
    try:
        rollouts = Rollouts(Scripted(tok), tok, pool, 1024, 8, tree=TreeSpec(3, "last_first"))
        draw = DataMixture([DataSource("agentflow/Calc-v0")], seed=0).draw(0)
        group = asyncio.run(rollouts.play_group("g0", draw, 2, SamplingParams()))
    finally:
        pool.close()
    roots, branches = group.trajectories[:2], group.trajectories[2:]
    assert [len(r.turns) for r in roots] == [3, 3] and len(branches) == 3 and rollouts.branches == 3
    assert [(b.info["branch_of"], b.info["branch_turn"]) for b in branches] == [("g0-0", 2), ("g0-1", 2), ("g0-0", 1)]
    assert all(b.status == "ok" and len(b.turns) == 3 for b in branches)
    group.trajectories[0].reward = 1.0  # one root succeeded: something to rank
    samples = {s.sample_id: s for s in to_samples([group])}
    nodes = samples["g0-0/0"].turn_nodes
    # the scripted policy is deterministic: roots and branches reach the same contexts, so they share every state
    assert len(set(nodes)) == 3 and all(n.startswith("g0:") for n in nodes)
    assert samples["g0-1/0"].turn_nodes == samples["g0-b2/0"].turn_nodes == samples["g0-b0/0"].turn_nodes == nodes
    plan = plan_advantages(list(samples.values()), LossSettings(tree_credit=True))
    assert len(plan.phases) == 3 and any(a != 0 for row in plan.advantages for a in row)


def test_branch_points_respect_the_budget_and_the_choice(tok) -> None:
    from agentflow.types import Segment, Trajectory, Turn

    def root(tid: str, spans: list[tuple[int, int]], lps: list[float], ids: list[int] | None = None) -> Trajectory:
        ids = ids or list(range(40))
        seg = Segment(token_ids=ids, loss_mask=[0] * 40, logprobs=[0.0] * 40, versions=[0] * 40)
        for (a, b), lp in zip(spans, lps, strict=True):
            for t in range(a, b):
                seg.loss_mask[t], seg.logprobs[t] = 1, lp
        t = Trajectory(id=tid, task_id="t", group_id="g", env_id="e", segments=[seg])
        t.turns = [Turn(k, "a", "o", span=s) for k, s in enumerate(spans)]
        return t

    a = root("a", [(0, 5), (10, 15), (20, 25)], [-0.1, -3.0, -0.2])
    assert branch_points([a], TreeSpec(1, "surprisal"), 0) == [(a, 1)]
    assert branch_points([a], TreeSpec(2, "last_first"), 0) == [(a, 2), (a, 1)]
    assert branch_points([a], TreeSpec(5, "last_first", max_tokens=15 + 5), 0) == [(a, 2)]  # 15 used, 5 left
    # two roots in the same context until turn 1, where they act differently: turn 2 is likelier surprising, but
    # the roots disagree at turn 1's state, so that is where `disagree` branches (from either root: the same state)
    spans = [(0, 5), (10, 15), (20, 25)]
    c = root("c", spans, [-0.1, -0.2, -3.0])
    d = root("d", spans, [-0.1, -0.2, -3.0], ids=[*range(10), *range(100, 105), *range(15, 40)])
    assert branch_points([c, d], TreeSpec(2, "surprisal"), 0) == [(c, 2), (d, 2)]
    assert branch_points([c, d], TreeSpec(2, "disagree"), 0) == [(c, 1), (d, 1)]
    c_nodes, d_nodes = turn_nodes(c, [0, 1, 2]), turn_nodes(d, [0, 1, 2])
    assert c_nodes[:2] == d_nodes[:2] and c_nodes[2] != d_nodes[2]  # one state until their actions part
    # `contested` spends every branch where the roots disagreed (turn 1's state), more than one per root there
    assert branch_points([c, d], TreeSpec(5, "contested"), 0) == [(c, 1), (d, 1), (c, 1), (d, 1), (c, 1)]
    assert branch_points([c, d], TreeSpec(5, "contested", max_tokens=30 + 2 * 10), 0) == [(c, 1), (d, 1)]
    # roots that acted alike everywhere: nothing contested, no branch
    assert branch_points([c, root("e", spans, [-0.1, -0.2, -3.0])], TreeSpec(4, "contested"), 0) == []


def test_a_tree_needs_our_loop_and_an_env_that_branches() -> None:
    with pytest.raises(ConfigError, match="rollout.tree: branches continue the white-box loop"):
        load_config(None, ["rollout.tree.branches=2", "agent.type=blackbox"])
    with pytest.raises(ConfigError, match="applies to roots only"):
        load_config(None, ["rollout.tree.branches=2", "rollout.partial=recycle"])
