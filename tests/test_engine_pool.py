"""The elastic engine pool: joins get the newest weights before serving, routing sticks per trajectory, leaving
engines drain, and a job that grows and shrinks its pool mid-run trains every accepted group."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from agentflow.engine.embedded import EmbeddedEngine
from agentflow.engine.pool import EnginePool
from agentflow.types import SamplingParams

transformers = pytest.importorskip("transformers")
from test_engine_model import make_model_dir  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[Path, dict]:
    path = tmp_path_factory.mktemp("pool_qwen2")
    make_model_dir(path, "qwen2")
    new = make_model_dir(tmp_path_factory.mktemp("pool_new"), "qwen2", seed=1).state_dict()
    return path, {k: v.clone() for k, v in new.items()}


def test_a_joining_engine_serves_the_newest_version_and_routing_sticks(model):
    path, new = model
    made: list[EmbeddedEngine] = []

    def make(k: int) -> EmbeddedEngine:
        made.append(EmbeddedEngine(path, max_slots=2, max_len=128, seed=k))
        return made[-1]

    async def go(pool: EnginePool) -> None:
        a = await pool.generate([1, 2, 3], GREEDY, "t1:0")
        pool.update_weights(3, new)
        k = pool.add()
        assert k == 1 and pool.size == 2 and made[1].weight_version == 3  # before it served anything
        b = await pool.generate([1, 2, 3], GREEDY, "t2:0")  # a new trajectory: the idle newcomer
        c = await pool.generate([1, 2, 3] + a.output_ids, GREEDY, "t1:1")  # t1 stays on engine 0
        assert set(a.versions) == {0} and set(b.versions) == {3} and set(c.versions) == {3}
        assert pool.members()[1]["first_tokens_version"] == 3 and pool.members()[1]["joined_at_version"] == 3
        assert made[0].stats()["prefills"] == 2 and made[1].stats()["prefills"] == 1

    pool = EnginePool(make, 1)
    try:
        asyncio.run(go(pool))
    finally:
        pool.close()


def test_a_leaving_engine_drains_and_its_trajectories_move(model):
    path, _ = model
    made: list[EmbeddedEngine] = []
    pool = EnginePool(lambda k: made.append(EmbeddedEngine(path, max_slots=2, max_len=256, seed=k)) or made[-1], 2)

    async def go() -> None:
        first = await pool.generate([5, 6], GREEDY, "a:0")  # engine 0
        made[1].pause("in_place")  # holds b's request on engine 1 until resumed
        busy = asyncio.create_task(pool.generate([1, 2, 3], GREEDY, "b:0"))
        await asyncio.sleep(0.05)
        assert pool.members()[1]["inflight"] == 1
        leaving = asyncio.create_task(pool.remove(1))  # waits for b's request before closing engine 1
        await asyncio.sleep(0.1)
        assert not leaving.done() and pool.members()[1]["draining"] and pool.size == 1
        made[1].resume()
        assert await leaving == 1 and busy.done() and busy.result().finish_reason != "abort"
        assert pool.size == 1 and list(pool.members()) == [0]
        nxt = await pool.generate([1, 2, 3] + busy.result().output_ids, GREEDY, "b:1")  # b continues on engine 0
        assert nxt.output_ids and first.output_ids and made[0].stats()["prefills"] == 2
        with pytest.raises(RuntimeError, match="last serving engine"):
            await pool.remove()
        assert [e["event"] for e in pool.events] == ["remove"]

    try:
        asyncio.run(go())
    finally:
        pool.close()


def test_a_drain_past_its_timeout_aborts_what_is_left(model):
    path, _ = model
    made: list[EmbeddedEngine] = []
    pool = EnginePool(lambda k: made.append(EmbeddedEngine(path, max_slots=2, max_len=512, seed=k)) or made[-1], 2)

    async def go() -> None:
        await pool.generate([5, 6], GREEDY, "a:0")
        made[1].pause("in_place")  # b's request cannot finish: the drain times out and aborts it
        busy = asyncio.create_task(pool.generate([1, 2], GREEDY, "b:0"))
        await asyncio.sleep(0.05)
        await pool.remove(1, drain_timeout_s=0.1)
        assert busy.result().finish_reason == "abort"

    try:
        asyncio.run(go())
    finally:
        pool.close()


def test_recycle_is_refused_on_members_that_cannot_abort_at_an_update():
    class Plain:
        weight_version = 0

    pool = EnginePool(lambda k: Plain(), 1)  # type: ignore[arg-type, return-value]
    with pytest.raises(ValueError, match="rollout.partial=recycle"):
        pool.abort_on_update = True
    pool.keep_cache_on_update = True  # members without the flag: the pool stops flushing them after updates
    assert pool.keep_cache_on_update


def test_elastic_config_is_checked():
    from agentflow.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="two changes at the same step"):
        load_config(None, ["engine.elastic=[{at_step: 2, engines: 2}, {at_step: 2, engines: 3}]"])
    with pytest.raises(ConfigError, match="transfer.type"):
        load_config(None, ["engine.elastic=[{at_step: 2, engines: 2}]", "transfer={type: gloo}"])
    with pytest.raises(ConfigError, match="engines"):
        load_config(None, ["engine.elastic=[{at_step: 2, engines: 0}]"])


def _elastic_job(tmp_path: Path, ray: bool) -> dict:
    from agentflow.config import load_config
    from agentflow.model_init import ModelInitConfig, init_model
    from agentflow.recipes.rl import run_job
    from agentflow.store import Journal

    tiny = ModelInitConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=176, num_attention_heads=4)
    model = init_model(tmp_path / "model", tiny, env_ids=["agentflow/Calc-v0"])
    run_dir = tmp_path / "run"
    overrides = [
        f"model.path={model}", "sft.enabled=false", "run.mode=async", "run.steps=6", f"run.dir={run_dir}",
        "run.progress=false", "store.batch_groups=2", "store.stale_steps=1", "rollout.group_size=2",
        "rollout.max_new_tokens=12", "eval.episodes=2", "engine.max_len=384", "trainer.micro_batch_tokens=2048",
        "trainer.drop_uniform_groups=false", "engine.elastic=[{at_step: 2, engines: 2}, {at_step: 4, engines: 1}]",
    ]  # fmt: skip
    if ray:
        overrides += ["ray.enabled=true", "ray.engines=1", "ray.env_workers=1"]
    summary = run_job(load_config(None, overrides), log=lambda *_: None)
    assert summary["rl_steps"] == 6 and summary["max_staleness_seen"] <= 1
    pool = summary["engine_pool"]
    assert [(e["event"], e["version"]) for e in pool["events"]] == [("add", 2), ("remove", 4)]
    assert pool["engines_now"] == 1
    left = pool["events"][1]
    assert left["joined_at_version"] == 2 and left["first_tokens_version"] is not None
    assert left["first_tokens_version"] >= 2  # the newcomer's first tokens: the weights it joined with, or newer
    journal = Journal.read(run_dir / "journal.jsonl")
    final = json.loads((run_dir / "summary.json").read_text())
    assert final["trajectories_trained"] == 6 * 2 * 2  # every batch full
    assert final["trajectories_trained"] + final["trajectories_pending"] == len(journal)  # nothing accepted lost
    return summary


@pytest.mark.slow
def test_a_job_grows_and_shrinks_its_engine_pool(tmp_path):
    _elastic_job(tmp_path, ray=False)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_ray_job_grows_and_shrinks_its_engine_actors(tmp_path):
    pytest.importorskip("ray")
    _elastic_job(tmp_path, ray=True)
