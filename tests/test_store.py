"""Sliding-window store: capacity, staleness bound, gate, journal, collection strategies and length bias."""

import asyncio
import heapq
import itertools

import pytest

from agentflow.store import Journal, TrajectoryStore
from agentflow.types import Group, Segment, Trajectory


def _group(gid: str, version: int, n: int = 2, length: int = 2) -> Group:
    trajs = []
    for i in range(n):
        seg = Segment()
        seg.append_context([1, 2])
        seg.append_generated([3] * length, [-0.1] * length, [version] * length)
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


def test_failed_groups_give_their_gate_place_back():
    async def go():
        store = TrajectoryStore(batch_groups=1, stale_steps=0)  # sync mode's window: one group per version
        await store.acquire_slot("a")
        await store.fail("a")
        await asyncio.wait_for(store.acquire_slot("b"), 1)  # a failed group must not stall dispatch for good

    asyncio.run(go())


def test_length_aware_takes_the_group_that_would_miss_its_deadline():
    async def go():
        store = TrajectoryStore(batch_groups=1, stale_steps=2, collect="first_finished", length_aware=True)
        for gid in ("a", "b", "c"):  # all at version 0: deadline version 2
            await store.acquire_slot(gid)
        await store.accept(_group("c", 0))
        assert [g.id for g in await store.get_batch()] == ["c"]  # slack: the first finished goes first
        await store.set_trainer_version(1)
        await store.acquire_slot("d")  # deadline 3
        await store.accept(_group("d", 1))
        # a and b are both due by version 2 and only batches 1 and 2 are left: one of them must be in this batch
        waiting = asyncio.create_task(store.get_batch())
        await asyncio.sleep(0.01)
        assert not waiting.done()
        await store.accept(_group("b", 0, length=9))
        assert [g.id for g in await asyncio.wait_for(waiting, 1)] == ["b"]

    asyncio.run(go())


def _simulate(store: TrajectoryStore, durations: list[float], train_s: float = 5.0) -> float:
    """Discrete-event run in virtual time: group ``i`` is dispatched when the window admits it, takes
    ``durations[i]`` and its episodes are ``int(durations[i])`` model tokens long (long episodes are the slow ones);
    a train step takes ``train_s``. Runs until nothing can move; returns the virtual time of the last event."""
    now = 0.0
    events: list = []
    seq = itertools.count()

    def at(t: float, fn) -> None:
        heapq.heappush(events, (t, next(seq), fn))

    async def feeder() -> None:
        for i, d in enumerate(durations):
            await store.acquire_slot(f"g{i}")
            g = _group(f"g{i}", store.trainer_version, length=int(d))  # the engine holds the trainer's version
            at(now + d, lambda g=g: store.accept(g))

    async def trainer() -> None:
        while True:
            await store.get_batch()
            done = asyncio.get_running_loop().create_future()

            async def finish(done=done) -> None:
                done.set_result(None)

            at(now + train_s, finish)
            await done
            await store.set_trainer_version(store.trainer_version + 1)

    async def go() -> float:
        nonlocal now
        tasks = [asyncio.create_task(feeder()), asyncio.create_task(trainer())]
        while True:
            for _ in range(100):  # no real I/O: every task runs until it blocks, deterministically
                await asyncio.sleep(0)
            if not events:
                break
            now, _, fn = heapq.heappop(events)
            await fn()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return now

    return asyncio.run(go())


# every 4th episode is long (40 tokens) and 4x as slow as the others (10 tokens); 40 groups, B=2, one stale step
DURATIONS = [(40 if i % 4 == 0 else 10) + i * 0.01 for i in range(40)]


def _run(collect: str, length_aware: bool = False) -> tuple[dict, float]:
    store = TrajectoryStore(batch_groups=2, stale_steps=1, collect=collect, length_aware=length_aware)
    end = _simulate(store, DURATIONS)
    return store.metrics(), end


def test_fifo_trains_lengths_as_sampled():
    m, _ = _run("fifo")
    assert m["dropped_stale_groups"] == 0 and m["ready_groups"] == 0
    assert m["length_bias"] == pytest.approx(1.0) and m["finished_len_mean"] == pytest.approx(17.5)
    assert m["max_staleness_seen"] <= 1


def test_first_finished_drops_long_episodes_and_under_trains_them():
    m, _ = _run("first_finished", length_aware=False)
    assert m["dropped_stale_groups"] > 0 and m["dropped_len_mean"] == pytest.approx(40)  # only long ones are dropped
    assert m["length_bias"] < 0.9  # trained episodes measurably shorter than the sampled ones
    assert m["max_staleness_seen"] <= 1  # the bound holds for what is trained


def test_length_aware_removes_the_bias_within_the_bound_and_waits_less_than_fifo():
    m, end = _run("first_finished", length_aware=True)
    biased, _ = _run("first_finished", length_aware=False)
    assert m["dropped_stale_groups"] == 0
    assert abs(m["length_bias"] - 1) < 0.01 < abs(biased["length_bias"] - 1)
    assert m["max_staleness_seen"] <= 1
    _, fifo_end = _run("fifo")
    assert end < fifo_end  # short groups still jump ahead where there is slack


def test_tokens_newer_than_the_trainer_are_refused():
    """Negative staleness (an engine serving weights the job never sent) is refused when the batch is taken."""
    from agentflow.store import FutureVersionError

    async def go():
        store = TrajectoryStore(batch_groups=1, stale_steps=1)
        await store.acquire_slot("a")
        await store.accept(_group("a", 2))
        with pytest.raises(FutureVersionError, match="version 2, but the trainer is at version 0"):
            await store.get_batch()

    asyncio.run(go())
