"""Sliding-window store: capacity, staleness bound, gate, journal."""

import asyncio

import pytest

from agentflow.store import Journal, TrajectoryStore
from agentflow.types import Group, Segment, Trajectory


def _group(gid: str, version: int, n: int = 2) -> Group:
    trajs = []
    for i in range(n):
        seg = Segment()
        seg.append_context([1, 2])
        seg.append_generated([3, 4], [-0.1, -0.2], [version, version])
        trajs.append(Trajectory(id=f"{gid}-{i}", task_id="t", group_id=gid, env_id="e", segments=[seg], reward=1.0))
    return Group(id=gid, task_seed=0, trajectories=trajs, dispatch_version=version)


def test_capacity_is_b_times_one_plus_stale_steps():
    async def go():
        store = TrajectoryStore(batch_groups=2, stale_steps=1)
        for i in range(4):
            await store.acquire_slot(f"g{i}")
        blocked = asyncio.create_task(store.acquire_slot("g4"))
        await asyncio.sleep(0.01)
        assert not blocked.done() and store.occupancy() == 4
        await store.accept(_group("g0", 0))
        await store.accept(_group("g1", 0))
        batch = await store.get_batch()
        assert [g.id for g in batch] == ["g0", "g1"]
        await asyncio.sleep(0.01)
        assert not blocked.done()  # room in the window, but the engine still holds version 0: g4 would be 2 stale
        await store.set_trainer_version(1)
        await asyncio.wait_for(blocked, 1)

    asyncio.run(go())


def test_staleness_is_bounded_and_measured():
    async def go():
        store = TrajectoryStore(batch_groups=1, stale_steps=1)
        for gid in ("a", "b"):
            await store.acquire_slot(gid)
            await store.accept(_group(gid, 0))
        await store.set_trainer_version(1)
        assert [g.id for g in await store.get_batch()] == ["a"]  # staleness 1: allowed
        await store.acquire_slot("c")
        await store.accept(_group("c", 1))
        await store.set_trainer_version(2)
        assert [g.id for g in await store.get_batch()] == ["c"]  # b (staleness 2) is dropped, not trained
        m = store.metrics()
        assert m["max_staleness_seen"] == 1 and m["dropped_stale_groups"] == 1
        assert store.histogram() == {"1": 4}

    asyncio.run(go())


def test_closed_gate_blocks_dispatch_until_opened():
    async def go():
        store = TrajectoryStore(batch_groups=1, stale_steps=0)
        await store.acquire_slot("a")
        await store.accept(_group("a", 0))
        await store.get_batch(close_gate=True)
        waiting = asyncio.create_task(store.acquire_slot("b"))
        await store.set_trainer_version(1)
        await asyncio.sleep(0.01)
        assert not waiting.done()  # the window admits it, the gate does not
        await store.set_gate(True)
        await asyncio.wait_for(waiting, 1)

    asyncio.run(go())


def test_journal_round_trips_every_accepted_trajectory(tmp_path):
    async def go():
        store = TrajectoryStore(batch_groups=1, stale_steps=0, journal=Journal(tmp_path / "j.jsonl"))
        await store.acquire_slot("a")
        g = _group("a", 0, n=3)
        g.trajectories[0].turns  # noqa: B018
        await store.accept(g)
        store.journal.close()
        back = Journal.read(tmp_path / "j.jsonl")
        assert [t.to_dict() for t in back] == [t.to_dict() for t in g.trajectories]

    asyncio.run(go())


def test_segment_rejects_misaligned_generation():
    with pytest.raises(ValueError, match="length mismatch"):
        Segment().append_generated([1, 2], [0.0], [0, 0])
