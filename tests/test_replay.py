"""Bounded replay in the store: reuse counts, the staleness bound on replayed tokens, batch composition, the window,
the adaptive scheduler, and checkpoint/resume of the pool."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from agentflow.config import ConfigError, ReplayConfig, load_config
from agentflow.replay import ReplayPool, ReplayScheduler
from agentflow.resume import ResumeError, replay_pool
from agentflow.store import TrajectoryStore
from agentflow.types import Group, Segment, Trajectory
from agentflow.virtual_clock import VirtualLoop


def _group(gid: str, version: int, rewards: tuple[float, ...] = (1.0, 0.0), length: int = 3) -> Group:
    trajs = []
    for i, r in enumerate(rewards):
        seg = Segment()
        seg.append_context([1, 2])
        seg.append_generated([3] * length, [-0.1] * length, [version] * length)
        trajs.append(Trajectory(id=f"{gid}-{i}", task_id="t", group_id=gid, env_id="e", segments=[seg], reward=r))
    return Group(id=gid, task_seed=0, trajectories=trajs, dispatch_version=version)


def test_pool_replays_within_the_bound_and_at_most_max_reuse_times():
    pool = ReplayPool(max_reuse=2, stale_steps=2)
    pool.add(_group("a", 0))
    pool.add(_group("b", 1))
    assert [g.id for g in pool.take(1, 2)] == ["a"]  # nearest to the bound first (a expires after version 2)
    assert [g.id for g in pool.take(2, 2)] == ["a", "b"]
    assert len(pool) == 1 and pool.state() == {"b": 1}  # a reached max_reuse and left
    assert [g.id for g in pool.take(1, 3)] == ["b"]  # version 1's tokens are 2 stale at version 3: still in bound
    assert pool.take(1, 4) == []  # b left after its second replay
    pool.add(_group("c", 1))
    assert pool.take(1, 4) == []  # c's tokens are 3 stale at version 4: never replayed
    pool.expire(4)
    assert len(pool) == 0 and pool.expired == 1
    assert pool.trainings() == {"1": 1, "3": 2}  # a and b trained three times in all, c once
    assert pool.staleness_hist == Counter({2: 6, 1: 2})  # per replayed trajectory: a at 2 twice, b at 1 then 2


def test_pool_leaves_out_groups_without_a_gradient():
    pool = ReplayPool(max_reuse=3, stale_steps=3)
    pool.add(_group("same", 0, rewards=(1.0, 1.0)))
    pool.add(_group("mixed", 0))
    assert pool.state() == {"mixed": 0} and pool.skipped_uniform == 1
    keep_all = ReplayPool(max_reuse=3, stale_steps=3, skip_uniform=False)
    keep_all.add(_group("same", 0, rewards=(1.0, 1.0)))
    assert keep_all.state() == {"same": 0}


def test_fixed_ratio_batches_mix_fresh_and_replayed_groups():
    async def go():
        spec = ReplayConfig(max_reuse=1, ratio=0.5, schedule="fixed")
        store = TrajectoryStore(batch_groups=2, stale_steps=2, replay=spec)
        for gid in ("g0", "g1", "g2", "g3"):
            await store.acquire_slot(gid)
            await store.accept(_group(gid, 0))
        first = await store.get_batch()
        assert [g.id for g in first] == ["g0", "g1"] and store.last_replayed == set()  # empty pool: all fresh
        await store.set_trainer_version(1)
        second = await store.get_batch()
        assert [g.id for g in second] == ["g2", "g0"] and store.last_replayed == {"g0"}  # one fresh, one replayed
        m = store.metrics()
        assert m["replay_share"] == 0.5 and m["replayed_groups"] == 1 and m["replay_max_staleness"] == 1
        assert store.fresh_taken == 3 and store.replay_state() == {"g1": 0, "g2": 0}  # g0 used its one reuse

    asyncio.run(go())


def test_replay_shrinks_the_dispatch_window_to_the_fresh_groups_per_batch():
    async def go():
        spec = ReplayConfig(max_reuse=2, ratio=0.5, schedule="fixed")
        store = TrajectoryStore(batch_groups=4, stale_steps=1, replay=spec)
        # an empty pool: the first batch needs 4 fresh groups, each later one 2, so 4 + 1 * 2 may be dispatched
        for i in range(6):
            await store.acquire_slot(f"g{i}")
        blocked = asyncio.create_task(store.acquire_slot("g6"))
        await asyncio.sleep(0.01)
        assert not blocked.done()
        blocked.cancel()

    asyncio.run(go())


def test_episode_slots_report_when_no_episode_waits():
    from agentflow.rollout import EpisodeSlots

    async def go():
        slots = EpisodeSlots(1)
        await asyncio.wait_for(slots.drained(), 1)  # nobody waits
        async with slots:
            second = asyncio.create_task(slots.__aenter__())  # waits for the one slot
            await asyncio.sleep(0.01)
            assert slots.waiting == 1
            drained = asyncio.create_task(slots.drained())
            await asyncio.sleep(0.01)
            assert not drained.done()
        await asyncio.wait_for(second, 1)  # the slot passed on: nobody waits any more
        await asyncio.wait_for(drained, 1)
        await slots.__aexit__(None, None, None)

    asyncio.run(go())


def test_held_slots_start_no_rl_episode_until_let_go():
    """An evaluation that pauses RL rollouts holds the slots: an RL episode already waiting for one does not take the
    one that frees, an evaluation episode does, and the RL episodes go on once the hold ends."""
    from agentflow.rollout import EpisodeSlots

    async def go():
        slots = EpisodeSlots(1)
        await slots.acquire(holdable=True)
        waiter = asyncio.create_task(slots.acquire(holdable=True))
        await asyncio.sleep(0.01)
        slots.hold(True)
        evaluation = asyncio.create_task(slots.acquire())
        slots.release()  # the slot frees during the hold
        late = asyncio.create_task(slots.acquire(holdable=True))  # and a new RL episode arrives
        await asyncio.wait_for(evaluation, 1)  # the evaluation's episode gets it
        await asyncio.sleep(0.05)
        assert not waiter.done() and not late.done() and slots.held.level == 1 and slots.waiting == 2
        slots.release()
        await asyncio.sleep(0.05)
        assert not waiter.done() and not late.done() and slots.held.level == 0  # still held, though a slot is free
        slots.hold(False)
        done, _ = await asyncio.wait({waiter, late}, timeout=1, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1 and slots.held.level == 1  # one slot: one of them runs
        slots.release()
        await asyncio.wait_for(asyncio.gather(waiter, late), 1)
        slots.release()
        assert slots.held.level == 0

    asyncio.run(go())


def _measured(s: ReplayScheduler, groups_per_s: float, step_s: float, batch: int) -> None:
    """Feed ``s`` one measurement: fresh groups finishing at ``groups_per_s``, a step of ``step_s`` over ``batch``."""
    s.on_request(0.0)
    s.on_batch_out(0.0, batch)
    for _ in range(round(groups_per_s * step_s)):
        s.on_accept()
    s.on_request(step_s)


def test_adaptive_replays_only_what_generation_cannot_supply():
    s = ReplayScheduler(batch_groups=8, ratio=0.75, schedule="adaptive")
    assert s.fresh_plan == 2  # the window plans for the fewest fresh groups a batch takes
    assert s.plan(ready=0, eligible=10) == 6  # nothing measured: replays like fixed
    assert s.plan(ready=0, eligible=2) == 2  # what the pool cannot give, fresh groups do
    _measured(s, groups_per_s=1.0, step_s=4.0, batch=8)  # 0.5 s per group trained: 4 fresh groups per step
    assert s.rate.value == pytest.approx(1.0) and s.group_s.value == pytest.approx(0.5)
    assert s.plan(ready=0, eligible=10) == 4 and s.plan(ready=20, eligible=10) == 4
    busy = ReplayScheduler(batch_groups=8, ratio=0.75, schedule="adaptive")
    _measured(busy, groups_per_s=4.0, step_s=2.0, batch=8)  # generation supplies a full batch during a step
    assert busy.plan(ready=0, eligible=10) == 0
    part = ReplayScheduler(batch_groups=8, ratio=0.75, schedule="adaptive")
    _measured(part, groups_per_s=1.0, step_s=4.0, batch=8)  # 4 groups finished in a step, then 3 in the next
    part.on_batch_out(4.0, 8)
    for _ in range(3):
        part.on_accept()
    part.on_request(8.0)
    assert part.plan(ready=0, eligible=10) == 5  # 3.7 a step: a batch of 4 fresh would wait for the rest of one
    slow = ReplayScheduler(batch_groups=8, ratio=0.5, schedule="adaptive")
    _measured(slow, groups_per_s=0.0, step_s=1.0, batch=8)  # nothing finished: the trainer would only wait
    assert slow.plan(ready=0, eligible=10) == 4  # capped at ratio * B
    assert ReplayScheduler(batch_groups=8, ratio=0.5, schedule="fixed").plan(ready=20, eligible=1) == 1
    assert ReplayScheduler(batch_groups=2, ratio=0.9).max_replays == 1  # a batch keeps one fresh group


class _WindowBound:
    """A job whose window is full: each 4 s step frees the window for the 4 fresh groups its batch took, so 4 finish
    per step whatever the engines could do; the slots are ``share`` full meanwhile."""

    def __init__(self, s: ReplayScheduler) -> None:
        self.s, self.t, self.held = s, 0.0, 0.0
        s.on_request(0.0, (0.0, 0.0))

    def step(self, share: float, wait: float = 0.0, slots: bool = True) -> int:
        """One batch out ``wait`` s after the request, trained in 4 s; the replays wanted for the next."""
        self.s.on_batch_out(self.t + wait, 8)
        for _ in range(4):
            self.s.on_accept()
        self.t += wait + 4.0
        self.held += share * (wait + 4.0)
        self.s.on_request(self.t, (self.held, self.t) if slots else None)
        return self.s.plan(ready=6, eligible=10)


def test_a_window_held_full_by_the_trainer_does_not_hide_generation_from_the_adaptive_schedule():
    """Groups finish as fast as the trainer takes them, exactly the 4 fresh groups of each batch: taken as
    generation's rate that keeps any share. Idle slots say generation could do more, so the schedule takes more
    fresh groups, step by step, until the slots fill or replay stops."""
    blind = _WindowBound(ReplayScheduler(batch_groups=8, ratio=0.5, schedule="adaptive"))
    assert [blind.step(share=0.25, slots=False) for _ in range(4)] == [4] * 4  # slots unknown: the fixed point
    full = _WindowBound(ReplayScheduler(batch_groups=8, ratio=0.5, schedule="adaptive"))
    assert [full.step(share=1.0) for _ in range(4)] == [4] * 4  # slots full: the rate is generation's own
    job = _WindowBound(ReplayScheduler(batch_groups=8, ratio=0.5, schedule="adaptive"))
    job.step(share=1.0)
    wanted = [job.step(share=0.25) for _ in range(6)]
    # the rate at most doubles per step; rounded down, the last replay goes once generation covers all 8 groups
    assert wanted[0] == 3 and wanted[-1] == 1 and wanted == sorted(wanted, reverse=True)
    assert job.s.last_share == pytest.approx(0.25) and job.s.metrics()["replay_slot_share"] == pytest.approx(0.25)
    straggler = _WindowBound(ReplayScheduler(batch_groups=8, ratio=0.5, schedule="adaptive"))
    straggler.step(share=1.0)
    # the trainer waited 3 s for each batch: slots idle behind a group it had to train say nothing of generation
    assert [straggler.step(share=0.25, wait=3.0) for _ in range(3)] == [4] * 3
    assert straggler.s.rate.value is not None and straggler.s.rate.value < 1.0


def test_the_store_reads_the_slots_it_is_fed_from():
    class Slots:
        def __init__(self) -> None:
            self.held, self.seconds = 0.0, 0.0

        def usage(self) -> tuple[float, float]:
            return self.held, self.seconds

    async def go() -> None:
        store = TrajectoryStore(batch_groups=2, stale_steps=2, replay=ReplayConfig(max_reuse=1, schedule="adaptive"))
        slots = Slots()
        store.watch_slots(slots)
        assert store.scheduler is not None
        store._plan_replays()
        slots.held, slots.seconds = 3.0, 10.0
        store._plan_replays()
        assert store.scheduler.last_share == pytest.approx(0.3)

    asyncio.run(go())


def test_an_evaluation_between_steps_is_not_counted_as_step_cost():
    s = ReplayScheduler(batch_groups=8, ratio=0.5, schedule="adaptive")
    _measured(s, groups_per_s=1.0, step_s=4.0, batch=8)
    assert s.plan(ready=0, eligible=10) == 4  # 0.5 s per group: generation supplies 4 of 8 during a step
    s.on_batch_out(10.0, 8)
    s.on_pause(30.0)  # a 30 s evaluation after the step, while the trainer waits
    s.on_request(44.0)
    assert s.step_s.value == pytest.approx(4.0) and s.group_s.value == pytest.approx(0.5)
    assert s.plan(ready=0, eligible=10) == 4  # still replaying: with the evaluation counted it would be 0
    s.on_batch_out(50.0, 8)
    s.on_request(54.0)  # the pause was spent on the step it belonged to
    assert s.step_s.value == pytest.approx(4.0)


def test_a_pause_of_rollouts_is_left_out_of_the_generation_rate():
    """``eval.pause_rollouts``: no group could start during the evaluation, so its seconds are not generation's."""
    s = ReplayScheduler(batch_groups=8, ratio=0.5, schedule="adaptive")
    _measured(s, groups_per_s=1.0, step_s=4.0, batch=8)
    s.on_batch_out(4.0, 8)
    for _ in range(4):
        s.on_accept()
    s.on_pause(30.0, generation=30.0)  # 4 groups in 4 s of steps + 30 s of an evaluation that paused rollouts
    s.on_request(38.0)
    assert s.rate.value == pytest.approx(1.0)  # not 4 / 34
    s.on_batch_out(38.0, 8)
    for _ in range(4):
        s.on_accept()
    s.on_pause(30.0)  # rollouts went on beside this one: its time is generation's
    s.on_request(72.0)
    assert s.rate.value == pytest.approx(0.3 * 4 / 34 + 0.7 * 1.0)


def test_the_store_passes_periodic_work_to_the_scheduler():
    store = TrajectoryStore(batch_groups=4, stale_steps=2, replay=ReplayConfig(max_reuse=1, schedule="adaptive"))
    assert store.scheduler is not None
    store.pause_step_clock(2.5, generation=2.0)
    assert store.scheduler._paused == 2.5 and store.scheduler._gen_paused == 2.0
    TrajectoryStore(batch_groups=4, stale_steps=2).pause_step_clock(2.5)  # no replay: nothing to tell


@pytest.mark.parametrize("collect", ["fifo", "first_finished"])
@pytest.mark.parametrize("schedule", ["fixed", "adaptive"])
def test_random_runs_keep_every_invariant(collect, schedule):
    """Random episode and step times on a virtual clock: no replayed or fresh token beyond the bound, no group
    trained more than 1 + max_reuse times, every accepted group trained (fresh) once or dropped, none lost."""
    for seed in range(4):
        _simulate(collect, schedule, seed)


def test_a_tighter_replay_bound_holds_for_replayed_groups_only():
    """``store.replay.stale_steps`` 1 under a job bound of 2: replayed tokens at most 1 version old, fresh ones 2."""
    for seed in range(4):
        _simulate("first_finished", "fixed", seed, replay_bound=1)


def test_a_replay_bound_above_the_jobs_is_refused():
    with pytest.raises(ConfigError, match="store.replay.stale_steps=3 is above the job's staleness bound 2"):
        load_config(None, ["store.stale_steps=2", "store.replay.max_reuse=2", "store.replay.stale_steps=3"])
    with pytest.raises(ConfigError, match="above the job's staleness bound 1"):
        load_config(None, ["run.mode=one_step", "store.replay.max_reuse=2", "store.replay.stale_steps=2"])
    with pytest.raises(ValueError, match="above the store's staleness bound"):
        TrajectoryStore(batch_groups=2, stale_steps=1, replay=ReplayConfig(max_reuse=1, stale_steps=2))
    load_config(None, ["store.stale_steps=2", "store.replay.max_reuse=2", "store.replay.stale_steps=1"])


def _simulate(collect: str, schedule: str, seed: int, replay_bound: int | None = None) -> None:
    rng = random.Random(seed)
    b, s, reuse, steps = 3, 2, 2, 25
    spec = ReplayConfig(max_reuse=reuse, ratio=0.67, schedule=schedule, stale_steps=replay_bound)
    store = TrajectoryStore(batch_groups=b, stale_steps=s, collect=collect, replay=spec)  # type: ignore[arg-type]
    accepted: list[str] = []
    trainings: Counter[str] = Counter()
    sizes: list[int] = []

    async def episode(i: int) -> None:
        gid = f"g{i}"
        version = store.trainer_version
        await asyncio.sleep(rng.lognormvariate(0, 1))
        rewards = (1.0, 1.0) if rng.random() < 0.2 else (1.0, 0.0)
        await store.accept(_group(gid, version, rewards))
        accepted.append(gid)

    tasks: list[asyncio.Task] = []

    async def feed() -> None:
        i = 0
        while True:
            await store.acquire_slot(f"g{i}")
            tasks.append(asyncio.create_task(episode(i)))
            i += 1

    async def train() -> None:
        feeder = asyncio.create_task(feed())
        for v in range(steps):
            batch = await store.get_batch()
            sizes.append(len(batch))
            assert len(batch) == b and len({g.id for g in batch}) == b and len(batch) - len(store.last_replayed) >= 1
            for g in batch:
                assert store.trainer_version - g.min_version() <= s, "trained past the staleness bound"
                if replay_bound is not None and g.id in store.last_replayed:
                    assert store.trainer_version - g.min_version() <= replay_bound, "replayed past the replay bound"
                trainings[g.id] += 1
            await asyncio.sleep(rng.uniform(0.05, 0.6))
            await store.set_trainer_version(v + 1)
        for t in [feeder, *tasks]:
            t.cancel()
        await asyncio.gather(feeder, *tasks, return_exceptions=True)

    loop = VirtualLoop()
    try:
        loop.run_until_complete(train())
    finally:
        loop.close()
    assert max(trainings.values()) <= 1 + reuse
    assert store.pool is not None and store.pool.replayed_groups > 0  # replay actually happened
    fresh = [g for g in trainings if g in accepted]
    assert len(fresh) == store.fresh_taken == sum(sizes) - sum(trainings.values()) + len(trainings)
    pending = {i.rsplit("-", 1)[0] for i in store.pending_ids()}
    assert set(accepted) == set(trainings) | pending | _dropped(store, accepted, trainings, pending)
    assert store.metrics()["replay_max_staleness"] <= (s if replay_bound is None else replay_bound)


def _dropped(store: TrajectoryStore, accepted: list[str], trained: Counter[str], pending: set[str]) -> set[str]:
    dropped = set(accepted) - set(trained) - pending
    assert len(dropped) == store.dropped_stale
    return dropped


def test_sync_mode_refuses_replay():
    with pytest.raises(ConfigError, match="store.replay.max_reuse"):
        load_config(None, ["run.mode=sync", "store.replay.max_reuse=2"])
    load_config(None, ["run.mode=async", "store.replay.max_reuse=2", "store.replay.schedule=adaptive"])


def test_resume_rebuilds_the_pool_from_the_journal():
    journal = [t for gid in ("g0", "g1") for t in _group(gid, 0).trajectories]
    trained = {t.id for t in journal}
    pool = replay_pool(journal, trained, {"g1": 1}, version=2)
    assert [(g.id, n, len(g.trajectories)) for g, n in pool] == [("g1", 1, 2)]
    with pytest.raises(ResumeError, match="g7"):
        replay_pool(journal, trained, {"g7": 0}, version=2)

    async def go():
        store = TrajectoryStore(batch_groups=2, stale_steps=2, replay=ReplayConfig(max_reuse=2))
        store.restore([], trainer_version=2, fresh_taken=3, replayable=pool)
        assert store.replay_state() == {"g1": 1} and store.fresh_taken == 3
        await store.acquire_slot("g2")
        await store.accept(_group("g2", 2))
        batch = await store.get_batch()
        assert [g.id for g in batch] == ["g2", "g1"] and store.replay_state() == {"g2": 0}  # g1 used its last reuse

    asyncio.run(go())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkill_with_replay_on_then_resume_loses_nothing_and_overtrains_nothing(tmp_path):
    """A real job with replay: the trainer is SIGKILLed mid-run, ``--resume`` completes it. By trajectory id nothing
    accepted is lost, none is trained fresh twice, and no group is trained more than ``1 + max_reuse`` times."""
    import json
    import os
    import signal

    import torch
    from test_resume import STEPS, TINY, _kill_trainer, _start, _steps_logged, _wait

    from agentflow.model_init import init_model
    from agentflow.store import Journal

    reuse = 2
    extra = (
        f"store.replay.max_reuse={reuse}",
        "store.replay.ratio=0.5",
        "store.stale_steps=2",
        "store.replay.skip_uniform=false",
    )  # a random model scores 0 everywhere: keep uniform groups
    model = init_model(tmp_path / "model", TINY)
    run_dir = tmp_path / "run"
    procs = []
    try:
        procs.append(p := _start(run_dir, model, tmp_path / "log1.txt", resume=False, extra=extra))
        _wait("step 5", lambda: _steps_logged(run_dir) >= 5, p, timeout=240)
        _kill_trainer(run_dir, p, tmp_path / "log1.txt")
        procs.append(p := _start(run_dir, model, tmp_path / "log2.txt", resume=True))
        assert p.wait(timeout=400) == 0, (tmp_path / "log2.txt").read_text()[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert "resumed " in (tmp_path / "log2.txt").read_text()
    final = torch.load(run_dir / "checkpoints" / f"step_{STEPS:06d}.pt", weights_only=False)["extra"]
    trained, counts = final["trained_ids"], final["replay_counts"]
    journal_ids = [t.id for t in Journal.read(run_dir / "journal.jsonl")]
    assert len(trained) == len(set(trained)) and set(trained) <= set(journal_ids)  # each fresh once
    assert set(final["pending_ids"]) == set(journal_ids) - set(trained)  # nothing lost
    trained_groups = {i.rsplit("-", 1)[0] for i in trained}
    assert counts and set(counts) <= trained_groups and max(counts.values()) <= reuse  # replayed, within the limit
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rl_steps"] == STEPS and summary["max_staleness_seen"] <= 2
    assert summary["replay"]["replay_max_staleness"] <= 2
    assert summary["replay"]["replayed_groups"] == sum(counts.values())
