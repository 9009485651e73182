"""The planner: the virtual clock, the simulated parts' arithmetic by hand, and a plan from a run directory."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from agentflow.cli import main
from agentflow.config import load_config
from agentflow.planner import (
    Episode,
    PlanError,
    calibrate,
    curve_at,
    load_profile,
    plan,
    predict,
    simulate,
    source_scenario,
)
from agentflow.simulated import Cpu, KvPolicy, SimEngine, SimRollouts, SimTrainer, Work
from agentflow.store import Journal
from agentflow.types import Segment, Trajectory, Turn
from agentflow.virtual_clock import Stalled, VirtualLoop, run_virtual

CURVE = {1: 1.0, 8: 4.0, 32: 8.0}


def test_the_virtual_clock_jumps_and_charges_executor_work() -> None:
    async def job() -> tuple[float, float, str]:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(3600)
        slept = loop.time()

        def work() -> str:
            assert isinstance(loop, VirtualLoop)
            loop.charge(2.5)
            return "done"

        out = await asyncio.to_thread(work)
        return slept, loop.time(), out

    t0 = time.monotonic()
    assert run_virtual(job()) == (3600.0, 3602.5, "done")
    assert time.monotonic() - t0 < 5


def test_a_loop_where_everything_waits_is_reported_not_hung() -> None:
    async def forever() -> None:
        await asyncio.get_running_loop().create_future()

    with pytest.raises(Stalled):
        run_virtual(forever())


def test_processor_sharing_engine_by_hand() -> None:
    """Throughput 100 tokens/s whatever the batch: two requests share it until the shorter one ends."""

    async def job() -> list[tuple[float, int]]:
        loop = asyncio.get_running_loop()
        engine = SimEngine(lambda n: 100.0, slots=8, cpu=Cpu(None))

        async def one(tokens: float) -> tuple[float, int]:
            v = await engine.generate(tokens)
            return loop.time(), v

        first = asyncio.ensure_future(one(100))
        second = asyncio.ensure_future(one(300))
        await asyncio.sleep(1.0)
        engine.version = 7  # a weight update lands while both decode
        return [await first, await second]

    # both at 50 tokens/s: the first ends at 2 s (100 tokens); the second has 200 left, alone at 100/s: 4 s
    (t1, v1), (t2, v2) = run_virtual(job())
    assert t1 == pytest.approx(2.0) and t2 == pytest.approx(4.0) and v1 == v2 == 7


def test_prefill_takes_its_share_of_the_engine_then_decodes_by_hand() -> None:
    """A (1,000 tokens to prefill, then 100 to decode) beside B (50 to decode): each has half the engine, so A
    prefills at 500/s and B decodes at 100/2 = 50/s until B ends at 1 s; A prefills its last 500 alone at 1,000/s
    (1.5 s) and decodes 100 at 100/s (2.5 s)."""

    async def job() -> list[float]:
        loop = asyncio.get_running_loop()
        engine = SimEngine(lambda n: 100.0, slots=8, cpu=Cpu(None), prefill_rate=1000.0)

        async def one(tokens: float, prefill: float) -> float:
            await engine.generate(tokens, prefill, prompt=prefill + 10)
            return loop.time()

        ends = list(await asyncio.gather(one(100, 1000), one(50, 0)))
        assert engine.prefilled == 1000 and engine.prompt_tokens == 1020
        return ends

    assert run_virtual(job()) == pytest.approx([2.5, 1.0])


@pytest.mark.parametrize(
    ("kv", "prefilled"),
    [
        (KvPolicy(max_age=0, shared_prefix=20), 80 + 130 + 40),  # flush: the update drops the context
        (KvPolicy(max_age=2, shared_prefix=20), 80 + 40 + 40),  # keep: the old weights' KV still serves
        (KvPolicy(prefix_cache=False, shared_prefix=20), 80 + 130 + 180),  # no cache: every turn prefills all
    ],
)
def test_a_weight_update_mid_episode_costs_a_prefill_only_when_the_kv_is_dropped(kv: KvPolicy, prefilled: int) -> None:
    """Three turns at contexts 100, 150, 200 tokens (40 new after each turn); the version changes in the first
    env wait. The first turn finds the 20 shared prompt tokens cached."""
    ep = Episode(3, 30, env_s=3.0, reward=1.0, turn_tokens=[(100, 100, 10), (150, 40, 10), (200, 40, 10)])

    async def job() -> float:
        loop = asyncio.get_running_loop()
        engine = SimEngine(lambda n: 1e6, slots=4, cpu=Cpu(None), prefill_rate=1e6)
        rollouts = SimRollouts([ep], [engine], 1, 0, Cpu(None), 0.0, kv)
        loop.call_later(0.5, setattr, engine, "version", 1)
        traj = await rollouts._episode("g0-0", "g0")
        assert traj.segments[0].versions[1:] == [0, 1, 1]
        return engine.prefilled

    assert run_virtual(job()) == prefilled


def test_slots_queue_requests_in_arrival_order() -> None:
    async def job() -> list[float]:
        loop = asyncio.get_running_loop()
        engine = SimEngine(lambda n: 10.0 * n, slots=1, cpu=Cpu(None))  # 10 tokens/s per request

        async def one(tokens: float) -> float:
            await engine.generate(tokens)
            return loop.time()

        return list(await asyncio.gather(one(10), one(10), one(10)))

    assert run_virtual(job()) == pytest.approx([1.0, 2.0, 3.0])


def test_contention_on_one_core_halves_both_parts() -> None:
    """One core: a 1 s trainer step next to a decoding engine runs at half speed, and so does the engine."""

    async def job() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        cpu = Cpu(1.0)
        engine = SimEngine(lambda n: 10.0 * n, slots=4, cpu=cpu)
        gen = asyncio.ensure_future(engine.generate(10))  # 1 s alone
        await asyncio.sleep(0)
        work = Work(cpu, 1.0, 1.0, loop)
        await work.done
        t_work = loop.time()
        await gen
        return t_work, loop.time()

    t_work, t_gen = run_virtual(job())
    assert t_work == pytest.approx(2.0) and t_gen == pytest.approx(2.0)


def test_trainer_step_returns_when_its_work_is_done() -> None:
    async def job() -> tuple[float, dict]:
        loop = asyncio.get_running_loop()
        trainer = SimTrainer(lambda k: 0.5 * k, Cpu(None))
        out = await asyncio.to_thread(trainer.train_step, [0, 1, 2, 3])
        return loop.time(), out

    t, out = run_virtual(job())
    assert t == pytest.approx(2.0) and out["samples"] == 4


def test_curve_is_piecewise_linear_and_flat_past_the_last_point() -> None:
    assert curve_at(CURVE, 1) == 1.0 and curve_at(CURVE, 20) == pytest.approx(6.0) and curve_at(CURVE, 64) == 8.0


def _fake_run(tmp_path: Path, mode: str = "async", measured: float = 3.0) -> Path:
    """A run directory as a job writes it: config, journal, metrics, summary (numbers made up, formats real)."""
    run = tmp_path / f"run-{mode}"
    run.mkdir()
    over = [f"run.mode={mode}", "store.batch_groups=2", "rollout.group_size=4", "run.steps=20"]
    cfg = load_config(None, over)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    rng = random.Random(0)
    journal = Journal(run / "journal.jsonl")
    for g in range(40):
        trajs = []
        for i in range(4):
            turns = rng.randint(1, 4)
            seg = Segment(token_ids=[0] * 40 * turns, loss_mask=[1] * 30 * turns + [0] * 10 * turns)
            env_s = sum(rng.lognormvariate(-1.2, 1.0) for _ in range(turns))
            trajs.append(Trajectory(f"g{g}-{i}", "t", f"g{g}", "e", segments=[seg], reward=float(rng.random() < 0.5),
                                    timings={"env_s": env_s}))  # fmt: skip
        journal.append(trajs)
    journal.close()
    rows = [{"step": s, "train/train_s": 0.2 + 0.01 * n, "train/samples": n, "sync/total_s": 0.05}
            for s, n in enumerate([8, 6, 8, 7, 8], 1)]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps({"trajectories_trained": 160, "rl_wall_s": 160 / measured}))
    return run


def test_turn_spans_give_each_turn_its_context_and_new_tokens(tmp_path: Path) -> None:
    run = _fake_run(tmp_path)
    (run / "journal.jsonl").unlink()
    journal = Journal(run / "journal.jsonl")
    for g, system in enumerate(([7, 7, 7, 1], [7, 7, 7, 2])):  # every prompt starts with the same 3 tokens
        ids = system + [5] * 6 + [0] * 10 + [5] * 4
        turns = [Turn(0, "a", "o", span=(10, 16)), Turn(1, "a", "o", span=(20, 24))]
        seg = Segment(token_ids=ids, loss_mask=[0] * 10 + [1] * 6 + [0] * 4 + [1] * 4)
        journal.append([Trajectory(f"s{g}", "t", f"s{g}", "e", segments=[seg], turns=turns, reward=1.0)])
    journal.close()
    profile = load_profile(run, CURVE, prefill_ratio=8.0)
    assert profile.shared_prefix == 3 and profile.prefill_ratio == 8.0
    assert [e.turn_tokens for e in profile.episodes] == [[(10, 10, 6), (20, 4, 4)]] * 2


def test_calibration_reproduces_the_run_and_predictions_follow_the_window(tmp_path: Path) -> None:
    profile = load_profile(_fake_run(tmp_path), CURVE, cores=2.0)
    assert len(profile.episodes) == 160 and profile.train_b == pytest.approx(0.01)
    fitted, speed = calibrate(profile, steps=20, iters=20)
    again = simulate(fitted, source_scenario(fitted, speed, 20))
    assert again.samples_per_s == pytest.approx(3.0, rel=0.02)
    sync, asyn = predict(fitted, speed, "sync", 20), predict(fitted, speed, "async", 20)
    assert sync.max_staleness_seen == 0 and asyn.max_staleness_seen <= fitted.cfg.store.stale_steps
    assert sync.samples_per_s < asyn.samples_per_s  # tool latency overlaps training only in async
    table = plan(fitted, speed, gpus=[8], steps=4, modes=["async"])
    (row,) = table["rows"]
    split = [r["trainer_gpus"] for r in row["tried"]]
    assert row["batch_groups"] == 8 and {1, 2, 4} <= set(split) and split == sorted(split)
    assert row["best"]["steady_samples_per_s"] == max(r["steady_samples_per_s"] for r in row["tried"])
    # the best split is inside what was tried, or at the end of the range (1 trainer GPU, 1 engine)
    best = row["best"]["trainer_gpus"]
    assert best in (1, 7) or split[0] < best < split[-1]


def test_replay_in_the_plan_uses_the_real_store_and_keeps_the_bound(tmp_path: Path) -> None:
    profile = load_profile(_fake_run(tmp_path), CURVE, cores=2.0)
    fitted, speed = calibrate(profile, steps=20, iters=20)
    fast = replace(fitted, train_a=0.01, train_b=0.001)  # a trainer far faster than generation: it would idle
    # a saturated engine (4 episodes at once): generation is throughput-bound, so replay adds updates
    base = replace(source_scenario(fast, speed / 4, 30), stale_steps=3, concurrency=4)
    plain, replay = simulate(fast, base), simulate(fast, replace(base, mode="async+replay"))
    assert plain.replayed_share == 0 and replay.replayed_share > 0.3
    assert replay.max_staleness_seen <= 3 and replay.updates_per_s > 1.5 * plain.updates_per_s


def test_a_run_faster_than_its_own_parts_allow_is_refused(tmp_path: Path) -> None:
    profile = load_profile(_fake_run(tmp_path, measured=1e4), CURVE)
    with pytest.raises(PlanError, match="infinitely fast engines"):
        calibrate(profile, steps=10)


def test_a_latency_bound_run_is_fitted_to_the_slowest_engines_that_keep_it(tmp_path: Path) -> None:
    """A run a little faster than even infinitely fast engines allow (the episode draw's noise) is latency-bound:
    calibrated to 99% of that bound instead of refused."""
    profile = load_profile(_fake_run(tmp_path), CURVE)
    bound = simulate(profile, source_scenario(profile, 1e6, 10)).samples_per_s
    fitted, speed = calibrate(replace(profile, measured_samples_per_s=1.03 * bound), steps=10, iters=20)
    assert simulate(fitted, source_scenario(fitted, speed, 10)).samples_per_s == pytest.approx(0.99 * bound, rel=0.01)
    assert speed < 1e5


def test_plan_command_names_what_is_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(tmp_path)]) == 2
    assert "no config.yaml" in capsys.readouterr().err
    run = _fake_run(tmp_path)
    out = tmp_path / "plan.json"
    assert main(["plan", str(run), "--gpus", "4", "--steps", "3", "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["measured"]["samples_per_s"] == pytest.approx(3.0) and set(saved["this_machine"]) == {"sync", "async"}


def test_effective_cores_of_two_spinners_are_at_most_two() -> None:
    from agentflow.planner import measure_effective_cores

    # the median of three pairs: one 0.5 s window alone can be slowed by whatever else the machine runs (2.38 seen)
    cores = measure_effective_cores(workers=2, seconds=0.5, repeats=3)
    assert 0.5 < cores <= 2 * 1.15  # two spinners do at most twice one's work (timing noise aside)
