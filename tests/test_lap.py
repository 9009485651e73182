"""The whole lap on a tiny model: exact tokens, weight sync parity, staleness bound, error observations."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest
import torch

import envs
from agentflow.chat import ChatTokenizer
from agentflow.config import load_config
from agentflow.engine.embedded import EmbeddedEngine
from agentflow.episode import EpisodeSpec, run_episode
from agentflow.model_init import ModelInitConfig, init_model
from agentflow.store import Journal
from agentflow.types import GenerateResult, SamplingParams

TINY = ModelInitConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=176, num_attention_heads=4)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("tiny"), TINY)


class Recording:
    """Passes every call through to the real engine and keeps what went in and came out."""

    def __init__(self, engine):
        self.engine = engine
        self.calls: list[tuple[list[int], GenerateResult]] = []

    @property
    def weight_version(self):
        return self.engine.weight_version

    async def generate(self, input_ids, sampling, rid=None):
        res = await self.engine.generate(input_ids, sampling, rid)
        self.calls.append((list(input_ids), res))
        return res


def test_trajectory_tokens_are_exactly_the_engines(tiny_model):
    tok = ChatTokenizer(tiny_model)
    env = envs.make("agentflow/Calc-v0")
    with EmbeddedEngine(tiny_model, max_slots=4, max_len=512) as engine:
        rec = Recording(engine)
        sampling = SamplingParams(temperature=1.0, max_new_tokens=24, seed=1)
        traj = asyncio.run(run_episode(rec, tok, env, EpisodeSpec("t0", "g0", 3), sampling, 512))
    env.close()
    seg = traj.segments[0]
    assert rec.calls and len(traj.turns) == len(rec.calls)
    for turn, (inputs, res) in zip(traj.turns, rec.calls, strict=True):
        start, end = turn.span
        assert seg.token_ids[:start] == inputs  # the prompt of each call is the segment so far, never re-encoded
        assert seg.token_ids[start:end] == res.output_ids
        assert seg.logprobs[start:end] == res.logprobs
        assert seg.versions[start:end] == res.versions
        assert all(seg.loss_mask[start:end]) and not any(seg.loss_mask[end : end + 1][:0])
    assert sum(seg.loss_mask) == sum(len(r.output_ids) for _, r in rec.calls)
    seg.check()


class Replay:
    """Stands in for the model's *choice* of text (a random tiny model cannot be made to emit a malformed call)."""

    def __init__(self, tok: ChatTokenizer, texts: list[str]):
        self.tok, self.texts, self.weight_version = tok, list(texts), 0

    async def generate(self, input_ids, sampling, rid=None):
        ids = self.tok.encode(self.texts.pop(0) + "<|im_end|>")
        return GenerateResult(rid or "", ids, [-0.5] * len(ids), [0] * len(ids), "stop", len(input_ids))


class CutReplay(Replay):
    """Replies cut at the token budget: no end token, finish reason ``length``."""

    async def generate(self, input_ids, sampling, rid=None):
        ids = self.tok.encode(self.texts.pop(0))
        return GenerateResult(rid or "", ids, [-0.5] * len(ids), [0] * len(ids), "length", len(input_ids))


@pytest.mark.parametrize("unfinished", ["act", "end"])
def test_a_reply_cut_at_the_budget_is_acted_on_or_ends_the_episode(tiny_model, unfinished):
    tok = ChatTokenizer(tiny_model)
    env = envs.make("agentflow/Calc-v0")
    env.reset(seed=5)
    answer = str(env.unwrapped.task.answer)  # right, but the reply never ended
    engine = CutReplay(tok, [answer, answer])
    spec = EpisodeSpec("t", "g", 5)
    traj = asyncio.run(run_episode(engine, tok, env, spec, SamplingParams(), 512, unfinished_turn=unfinished))
    env.close()
    seg, turn = traj.segments[0], traj.turns[0]
    assert tok.decode(seg.token_ids[turn.span[0] : turn.span[1]]) == answer and seg.loss_mask[turn.span[0]] == 1
    if unfinished == "act":  # the env's parser accepted it
        assert traj.status == "ok" and traj.reward == 1.0 and turn.error is None
    else:
        assert traj.status == "truncated" and traj.reward == 0.0 and len(traj.turns) == 1
        assert turn.action is None and "cut at" in turn.error and traj.info["success"] is False


def test_blackbox_agents_refuse_whitebox_loop_settings():
    from agentflow.agents import make_agent

    with pytest.raises(ValueError, match="whitebox agent only"):
        make_agent("blackbox", entry="json:dumps", unfinished_turn="end")


def test_malformed_tool_call_becomes_error_observation_and_episode_continues(tiny_model):
    tok = ChatTokenizer(tiny_model)
    env = envs.make("agentflow/Calc-v0")
    env.reset(seed=5)
    task = env.unwrapped.task
    texts = [
        '<tool_call>\n{"name": "calc", "arguments": {"expression": }\n</tool_call>',
        '<tool_call>\n{"name": "calc", "arguments": {"expression": "' + task.expression + '"}}\n</tool_call>',
        str(task.answer),
    ]
    traj = asyncio.run(run_episode(Replay(tok, texts), tok, env, EpisodeSpec("t", "g", 5), SamplingParams(), 512))
    env.close()
    assert [t.error is not None for t in traj.turns] == [True, False, False]
    assert traj.turns[0].observation.startswith("Error: malformed tool call: invalid JSON")
    assert traj.turns[1].observation.strip() == str(task.answer)
    assert traj.status == "ok" and traj.reward == 1.0 and traj.info["success"] is True
    text = tok.decode(traj.segments[0].token_ids)
    assert "<tool_response>\nError: malformed tool call" in text


def test_env_failure_marks_error_not_zero_reward(tiny_model):
    tok = ChatTokenizer(tiny_model)
    env = envs.make("agentflow/Calc-v0")

    async def broken(*a, **k):
        raise RuntimeError("sandbox died")

    env.astep = broken  # the env raising mid-episode
    traj = asyncio.run(run_episode(Replay(tok, ["1"]), tok, env, EpisodeSpec("t", "g", 1), SamplingParams(), 512))
    env.close()
    assert traj.status == "error" and traj.reward is None and "sandbox died" in traj.error


def test_engine_matches_trainer_after_weight_sync(tiny_model):
    _check_weight_sync(tiny_model)


def test_moe_engine_matches_trainer_after_weight_sync_and_runs_a_job(tmp_path_factory, tmp_path):
    """A Qwen3-MoE model through the lap: behaviour log-probs, a train step, the synced experts, a 2-step job."""
    from agentflow.recipes.rl import run_job

    moe = ModelInitConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, arch="qwen3_moe",
                          num_experts=4, moe_intermediate_size=48)  # fmt: skip
    model = init_model(tmp_path_factory.mktemp("moe"), moe)
    _check_weight_sync(model)
    cfg = _job_cfg(model, tmp_path, "async", steps=2)
    summary = run_job(load_config(None, [*_overrides(cfg), "trainer.routing_replay=true"]), log=lambda *_: None)
    assert summary["rl_steps"] == 2 and summary["errors"] == 0
    exported = tmp_path / "async" / "model"  # the trained policy, a Hugging Face directory the engine loads
    assert summary["model_dir"] == str(exported) and (exported / "config.json").is_file()
    with EmbeddedEngine(exported, max_slots=1, max_len=64) as engine:
        assert engine.model.config.num_experts == 4
    steps = [json.loads(line) for line in (tmp_path / "async" / "metrics.jsonl").read_text().splitlines()]
    mismatch = [m["train/routing_mismatch"] for m in steps if "train/routing_mismatch" in m]
    assert mismatch and max(mismatch) < 0.05  # stale versions (async) may route a few tokens differently
    traj = Journal.read(tmp_path / "async" / "journal.jsonl")[0]
    seg = traj.segments[0]
    routed = {p for p, _ in seg.routes}  # every position fed to the model, cached prefixes included
    last = traj.turns[-1].span  # the final sampled token is never fed back
    assert routed == set(range(last[1] - 1))
    assert all(len(r) == 2 and len(r[0]) == 2 for _, r in seg.routes)  # 2 layers x top-2


def _overrides(cfg) -> list[str]:
    return [f"{k}={v}" for k, v in _flat(cfg.model_dump(mode="json")).items() if not k.startswith("data")]


def _check_weight_sync(tiny_model):
    from agentflow.controller import to_samples
    from trainer.megatron_trainer import MegatronTrainer
    from trainer.types import TrainerSettings
    from transfer_mesh.buckets import unpack_version

    trainer = MegatronTrainer(tiny_model, TrainerSettings(lr=1e-2, threads=1))
    tok = ChatTokenizer(tiny_model)
    env = envs.make("agentflow/Calc-v0")
    with EmbeddedEngine(tiny_model, max_slots=4, max_len=512) as engine:
        sampling = SamplingParams(temperature=1.0, max_new_tokens=16, seed=2)
        trajs = [
            asyncio.run(run_episode(engine, tok, env, EpisodeSpec(f"t{i}", "g", i), sampling, 512)) for i in range(2)
        ]
        trajs[0].reward, trajs[1].reward = 1.0, 0.0
        from agentflow.types import Group

        samples = to_samples([Group("g", 0, trajs)])
        # behaviour log-probs (engine, version 0) equal the trainer's before any update
        seq = samples[0].token_ids
        before = trainer.sequence_logprobs(seq)
        mask = samples[0].loss_mask
        diffs = [abs(b - a) for a, b, m in zip(samples[0].behaviour_logprobs[1:], before, mask[1:], strict=True) if m]
        assert max(diffs) < 1e-4
        trainer.train_step(samples, "grpo")
        version, tensors = unpack_version(trainer.export_buckets(bucket_bytes=1 << 16))
        assert version == 1
        engine.update_weights(version, tensors)
        assert engine.weight_version == 1
        after = trainer.sequence_logprobs(seq)
        scored = engine.score(seq, 1).logprobs
        assert max(abs(a - b) for a, b in zip(after, scored, strict=True)) < 1e-4
        assert max(abs(a - b) for a, b in zip(after, before, strict=True)) > 1e-3  # the step changed the policy
        engine_params = engine.model.params
        trainer_ptrs = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
        assert not any(t.untyped_storage().data_ptr() in trainer_ptrs for t in engine_params.values())
    env.close()


def _job_cfg(tiny_model, tmp_path, mode: str, steps: int = 4, extra: tuple[str, ...] = ()):
    return load_config(
        None,
        [
            f"model.path={tiny_model}",
            "sft.enabled=false",
            f"run.mode={mode}",
            f"run.steps={steps}",
            f"run.dir={tmp_path / mode}",
            "run.progress=false",
            "store.batch_groups=2",
            "store.stale_steps=1",
            "rollout.group_size=2",
            "rollout.max_new_tokens=12",
            "eval.episodes=4",
            "engine.max_len=384",
            "trainer.micro_batch_tokens=2048",
            "trainer.drop_uniform_groups=false",  # an untrained model scores 0 everywhere: train on it anyway
            *extra,
        ],
    )


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_job_staleness_bound_and_outputs(tiny_model, tmp_path, mode):
    from agentflow.recipes.rl import run_job

    cfg = _job_cfg(tiny_model, tmp_path, mode)
    summary = run_job(cfg, log=lambda *_: None)
    run_dir = tmp_path / mode
    assert summary["rl_steps"] == 4 and summary["mode"] == mode
    hist = {int(k): v for k, v in summary["staleness_histogram"].items()}
    if mode == "async":
        assert summary["mean_staleness"] > 0
        assert max(hist) <= cfg.store.stale_steps and summary["dropped_stale_groups"] == 0
        assert summary["gate_closures"] == 0  # dispatch never waits for training in async mode
    else:
        assert set(hist) == {0} and summary["stale_steps"] == 0
        assert summary["gate_closures"] == summary["rl_steps"]
        assert summary["trainer_wait_fraction"] > 0  # sync: every batch is generated while the trainer waits
    assert 0 <= summary["trainer_wait_fraction"] < 1 and 0 < summary["rollout_slot_occupancy"] <= 1
    for key in (
        "scripted_policy_success",
        "success_before_rl",
        "success_after_rl",
        "eval_episodes",
        "wall_s",
        "max_staleness_seen",
        "overlap_fraction",
    ):
        assert key in summary
    assert json.loads((run_dir / "summary.json").read_text())["rl_steps"] == 4
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4 and "train/is_approx_k3_kl" in json.loads(lines[0])
    waits = [json.loads(line)["loop/batch_wait_s"] for line in lines]
    assert min(waits) >= 0 and sum(waits) <= summary["rl_wall_s"]
    assert list((run_dir / "tensorboard").iterdir())
    assert (run_dir / "config.yaml").is_file() and list((run_dir / "checkpoints").iterdir())
    journal = Journal.read(run_dir / "journal.jsonl")
    assert len(journal) >= summary["trajectories_trained"] == 4 * 2 * 2


def test_job_stops_at_its_token_budget(tiny_model, tmp_path):
    from agentflow.recipes.rl import run_job

    cfg = _job_cfg(tiny_model, tmp_path, "sync", steps=30, extra=("run.max_generated_tokens=150",))
    summary = run_job(cfg, log=lambda *_: None)
    spent = [
        json.loads(x)["store/generated_tokens"] for x in (tmp_path / "sync" / "metrics.jsonl").read_text().splitlines()
    ]
    assert summary["token_budget_spent"] and summary["generated_tokens"] == spent[-1] >= 150
    assert summary["rl_steps"] == len(spent) < 30 and all(n < 150 for n in spent[:-1])  # stopped at the first step over


def test_a_job_without_reward_spread_says_so_and_can_stop(tiny_model, tmp_path, capsys):
    from agentflow.recipes.rl import run_job

    extra = ("run.silent_steps_warn=2", "run.stop_after_silent_steps=3")
    summary = run_job(_job_cfg(tiny_model, tmp_path, "sync", steps=30, extra=extra), log=lambda *_: None)
    assert summary["success_before_rl"] == 0.0  # the untrained model fails every episode: no reward spread
    assert summary["rl_steps"] == 3
    assert summary["silent_steps"] == {"longest": 3, "ended_at_step": 3, "stopped_job": True}
    err = capsys.readouterr().err
    assert err.count("agentflow: warning: steps 1-2: every episode got the same reward") == 1


def test_checkpoint_resume_is_exact(tiny_model, tmp_path):
    from trainer.megatron_trainer import MegatronTrainer
    from trainer.types import Sample, TrainerSettings

    s = TrainerSettings(lr=1e-2, threads=1)
    samples = [Sample([1, 5, 9, 12, 7], [0, 0, 1, 1, 1], [0.0, 0.0, -2.0, -2.0, -2.0], r, "g", str(r)) for r in (0, 1)]
    samples[1] = replace(samples[1], token_ids=[1, 5, 9, 13, 8])
    a = MegatronTrainer(tiny_model, s)
    a.train_step(samples)
    a.save_checkpoint(tmp_path / "ck.pt", {"trained_ids": ["x"]})
    a.train_step(samples)
    b = MegatronTrainer(tiny_model, s)
    assert b.load_checkpoint(tmp_path / "ck.pt") == {"trained_ids": ["x"]}
    b.train_step(samples)
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    assert a.version == b.version == 2


def test_behaviour_logprobs_match_trainer_at_rollout_temperature(tiny_model):
    from trainer.megatron_trainer import MegatronTrainer
    from trainer.types import TrainerSettings

    trainer = MegatronTrainer(tiny_model, TrainerSettings(threads=1, temperature=0.7))
    with EmbeddedEngine(tiny_model, max_slots=2, max_len=256) as engine:
        prompt = list(range(5, 40))
        res = engine.generate_sync(prompt, SamplingParams(temperature=0.7, top_k=20, max_new_tokens=16, seed=4))
    lp = trainer.sequence_logprobs(prompt + res.output_ids)[len(prompt) - 1 :]
    assert max(abs(a - b) for a, b in zip(lp, res.logprobs, strict=True)) < 1e-4


def test_job_mixes_data_sources_and_carries_tags(tiny_model, tmp_path):
    from agentflow.recipes.rl import run_job

    cfg = _job_cfg(tiny_model, tmp_path, "async", steps=2)
    cfg = load_config(
        None,
        [
            *[f"{k}={v}" for k, v in _flat(cfg.model_dump(mode="json")).items() if not k.startswith("data")],
            "data.sources=[{env_id: agentflow/Calc-v0, tags: [math], name: calc}, "
            "{env_id: agentflow/Retrieval-v0, tags: [search], name: docs, weight: 1}]",
        ],
    )
    run_job(cfg, log=lambda *_: None)
    journal = Journal.read(tmp_path / "async" / "journal.jsonl")
    seen = {(t.data_source, tuple(t.tags), t.env_id) for t in journal}
    assert seen == {("calc", ("math",), "agentflow/Calc-v0"), ("docs", ("search",), "agentflow/Retrieval-v0")}


def test_job_mixes_our_env_with_adapted_ones(tiny_model, tmp_path):
    """Calc-v0 beside a TextArena game and a Reasoning Gym dataset in one job (envs/adapters.py), end to end."""
    from conftest import require_env

    from agentflow.recipes.rl import run_job

    for env_id in ("textarena/GuessTheNumber-v0", "reasoning_gym/chain_sum-v0"):
        require_env(env_id)
    cfg = _job_cfg(tiny_model, tmp_path, "async", steps=2)
    over = [f"{k}={v}" for k, v in _flat(cfg.model_dump(mode="json")).items() if not k.startswith("data")]
    sources = ("data.sources=[{env_id: agentflow/Calc-v0, name: calc}, "
               "{env_id: textarena/GuessTheNumber-v0, name: game, env_kwargs: {reward: success}}, "
               "{env_id: reasoning_gym/chain_sum-v0, name: chain}]")  # fmt: skip
    summary = run_job(load_config(None, [*over, sources]), log=lambda *_: None)
    journal = Journal.read(tmp_path / "async" / "journal.jsonl")
    assert {t.data_source for t in journal} == {"calc", "game", "chain"}
    adapted = [t for t in journal if t.data_source != "calc"]  # a random tiny model may run out of turns or tokens
    assert adapted and all(t.status in ("ok", "truncated") and t.reward in (0.0, 1.0) for t in adapted)
    assert summary["rl_steps"] == 2 and set(summary["per_source"]) == {"calc", "game", "chain"}


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "kwargs":
            out |= _flat(v, f"{prefix}{k}.")
        elif v is not None and not isinstance(v, dict | list):  # None: the default, not writable as an override
            out[f"{prefix}{k}"] = v
    return out


def test_busy_fractions_leave_out_the_in_loop_evaluations():
    """The trainer waits through an evaluation by design: its time counts neither as busy nor as RL time."""
    from agentflow.recipes.common import busy_fraction, eval_spans
    from agentflow.rollout import overlap_spans

    evals = eval_spans([{"rl_s": 10.0, "eval_s": 5.0}, {"rl_s": 20.0, "eval_s": 5.0}])
    assert evals == [(10.0, 15.0), (25.0, 30.0)]  # the second starts after 20 s of RL and the first's 5 s
    trainer = [(0.0, 12.0), (16.0, 18.0), (36.0, 40.0)]  # 2 s of the first span fall inside an evaluation
    assert busy_fraction(trainer, evals, wall_s=40.0) == pytest.approx(16 / 30)
    assert busy_fraction(trainer, [], wall_s=40.0) == pytest.approx(18 / 40)
    assert overlap_spans([(0, 3), (5, 9)], [(2, 6), (8, 12)]) == [(2, 3), (5, 6), (8, 9)]


def test_slot_occupancy_is_time_weighted_and_leaves_out_what_is_not_counted(monkeypatch):
    """Episodes holding slots, weighted by how long they held them; time before ``restart`` or while not counting
    (an in-loop evaluation) is left out."""
    from agentflow import rollout
    from agentflow.rollout import EpisodeSlots

    now = [0.0]
    monkeypatch.setattr(rollout.time, "monotonic", lambda: now[0])

    async def scenario() -> float:
        slots = EpisodeSlots(4)
        await slots.__aenter__()  # 1 held from t=0 (before the restart: not counted)
        now[0] = 5.0
        slots.held.restart()
        await slots.__aenter__()  # 2 held from t=5
        now[0] = 7.0
        slots.held.count(False)  # t=7..17 not counted, whatever is held
        for _ in range(2):
            await slots.__aenter__()
        now[0] = 17.0
        slots.held.count(True)
        for _ in range(3):
            await slots.__aexit__()  # 1 held from t=17
        now[0] = 21.0
        return slots.occupancy()

    # counted: 2 slots for 2 s, 1 slot for 4 s -> 8 slot-seconds over 6 s, of 4 slots
    assert asyncio.run(scenario()) == pytest.approx(8 / 6 / 4)


@pytest.mark.parametrize("pause", [True, False])
def test_in_loop_evaluations_pause_new_rl_groups_when_asked(tiny_model, tmp_path, pause):
    """``eval.pause_rollouts``: no RL group starts while an in-loop evaluation runs (the groups it finds live are
    the ones it leaves), and no episode of one dispatched before it; without it rollouts go on beside it."""
    from agentflow.builder import build_job
    from agentflow.controller import rl_loop
    from agentflow.recipes.evaluate import evaluate_sources

    # one slot: episodes of dispatched groups still wait when an evaluation starts, however slow the trainer step
    extra = ("eval.every_steps=1", f"eval.pause_rollouts={str(pause).lower()}", "store.stale_steps=8",
             "rollout.max_concurrency=1")  # fmt: skip
    cfg = _job_cfg(tiny_model, tmp_path, "async", steps=2, extra=extra)
    live: list[tuple[int, int]] = []

    async def scenario() -> None:
        async with build_job(cfg, tiny_model, tmp_path / "run") as job:

            async def evaluate() -> dict[str, float]:
                before = job.store.occupancy()  # no batch is taken meanwhile: only a dispatch changes it
                waiting = fewest = job.rollouts.limit.waiting  # episodes of dispatched groups waiting for a slot
                # the evaluation's own episodes share the slots and are not held (else this would never return)
                held_out = asyncio.create_task(evaluate_sources(job.rollouts, job.cfg))
                for _ in range(300):  # 3 s
                    await asyncio.sleep(0.01)
                    fewest = min(fewest, job.rollouts.limit.waiting)
                await asyncio.wait_for(held_out, 60)
                live.append((before, job.store.occupancy()))
                queue.append((waiting, fewest))
                return {"success": 0.0}

            await rl_loop(job, evaluate=evaluate)
            assert not job.rollouts.limit.held.counting  # the evaluation after RL is left out of the occupancy

    queue: list[tuple[int, int]] = []
    asyncio.run(scenario())
    assert len(live) == 2
    if pause:
        assert all(after == before for before, after in live)
        assert all(waiting > 0 for waiting, _ in queue)
        assert all(fewest == waiting for waiting, fewest in queue)  # none of the waiting episodes started
    else:
        assert any(after > before for before, after in live)
