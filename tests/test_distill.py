"""Distillation signals in the trainer and the distill job's pre-flight checks."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from agentflow.cli import main
from agentflow.model_init import ModelInitConfig
from agentflow.teacher_scoring import EngineScorer, attach_teacher_scores
from agentflow.types import Group, Segment, Trajectory
from teachers.manager import TeacherManager
from teachers.routing import Router, parse_routes
from teachers.types import TeacherSpec
from trainer.losses import LossInputs, plan_advantages, policy_loss, topk_reverse_kl
from trainer.types import LossSettings, Sample, TrainerSettings

TINY = ModelInitConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=176, num_attention_heads=4)


def _sample(n: int = 10) -> Sample:
    mask = [0] * 4 + [1] * (n - 4)
    beh = [-1.0 * m for m in mask]
    s = Sample(list(range(5, 5 + n)), mask, beh, 1.0, "g", "s0")
    s.teacher_logprobs = [-0.5 * m for m in mask]
    return s


def test_distill_reward_is_teacher_minus_behaviour_on_model_tokens():
    s = _sample()
    other = replace(_sample(), reward=0.0, sample_id="s1")
    plan = plan_advantages([s, other], LossSettings(env_reward_coef=0.0, distill_reward_coef=2.0))
    assert plan.advantages[0] == [0.0] * 4 + [2.0 * (-0.5 - -1.0)] * 6  # k1: teacher - behaviour, masked
    with_env = plan_advantages([s, other], LossSettings(distill_reward_coef=2.0))
    assert with_env.advantages[0][5] == pytest.approx(1.0 + 1.0)  # GRPO advantage (+1) plus the teacher reward
    k3 = plan_advantages(
        [s, other], LossSettings(env_reward_coef=0.0, distill_reward_coef=1.0, distill_reward_estimator="k3")
    )
    d = -1.0 - -0.5
    assert k3.advantages[0][5] == pytest.approx(-(torch.exp(torch.tensor(-d)) - 1 + d).item())


def test_distill_reward_without_teacher_logprobs_is_an_error():
    s = _sample()
    s.teacher_logprobs = None
    with pytest.raises(ValueError, match="has no teacher log-probs"):
        plan_advantages([s], LossSettings(distill_reward_coef=1.0))


def test_topk_reverse_kl_is_zero_only_when_the_distributions_agree():
    full = torch.log_softmax(torch.randn(2, 3, 50, generator=torch.Generator().manual_seed(0)), -1)
    top = full.topk(5, dim=-1).values
    assert torch.allclose(topk_reverse_kl(top, top), torch.zeros(2, 3), atol=1e-6)
    assert (topk_reverse_kl(top.flip(-1), top) > 0).all()
    assert (topk_reverse_kl(top - 1.0, top) > 0).all()  # less mass on the teacher's support costs too
    exact = (full.exp() * (full - full.roll(1, -1))).sum(-1)  # full KL(s || t) with t = s shifted
    coarse = topk_reverse_kl(full.gather(-1, top_idx := full.topk(5, -1).indices), full.roll(1, -1).gather(-1, top_idx))
    assert (coarse <= exact + 1e-6).all()  # a lower bound of the full reverse KL


def test_distill_loss_term_is_added_to_the_policy_loss():
    b, s = 1, 6
    logp = torch.full((b, s), -1.0, requires_grad=True)
    zeros, mask = torch.zeros(b, s), torch.ones(b, s)
    x = LossInputs(logp, logp.detach(), logp.detach(), zeros, mask, teacher=torch.full((b, s), -0.25))
    base, _ = policy_loss(x, LossSettings(off_policy="none"), 6.0, 1.0)
    loss, metrics = policy_loss(
        x, LossSettings(off_policy="none", distill_loss_coef=0.5, distill_loss_estimator="k2"), 6.0, 1.0
    )
    assert float(loss - base) == pytest.approx(0.5 * 0.5 * 0.75**2)
    assert float(metrics["teacher_k1"]) == pytest.approx(6 * -0.75)
    with pytest.raises(ValueError, match="top-k log-probs"):
        policy_loss(x, LossSettings(distill_loss_coef=0.5), 6.0, 1.0)


def _on_policy_samples(engine, teacher: Path, n: int, top_k: int, seed: int) -> list[Sample]:
    """Sequences sampled by the student (real engine, behaviour log-probs) and scored by the teacher."""
    from agentflow.types import SamplingParams

    futures = [engine.submit([5 + i, 9, 11], SamplingParams(max_new_tokens=12, seed=seed + i)) for i in range(n)]
    samples, groups = [], []
    for i, r in enumerate(f.result() for f in futures):
        ids = [5 + i, 9, 11, *r.output_ids]
        mask = [0, 0, 0] + [1] * len(r.output_ids)
        samples.append(Sample(ids, mask, [0.0] * 3 + r.logprobs, 0.0, f"g{i}", f"t{i}/0"))
        seg = Segment(token_ids=ids, loss_mask=mask)
        groups.append(Group(f"g{i}", i, [Trajectory(f"t{i}", "task", f"g{i}", "e", "src", ["calc"], [seg])]))
    specs = [TeacherSpec("calc", path=str(teacher))]
    manager = TeacherManager(specs, Router(specs, parse_routes({"calc": "calc"})), lambda s: EngineScorer(s.path), 1)
    manager.top_k = top_k
    try:
        attach_teacher_scores(manager, groups, samples)
    finally:
        manager.close()
    return samples


@pytest.fixture(scope="module")
def scored(pair) -> list[Sample]:
    from agentflow.engine.embedded import EmbeddedEngine

    student, teacher = pair
    with EmbeddedEngine(student, max_slots=16, max_len=64) as engine:
        return _on_policy_samples(engine, teacher, 16, top_k=8, seed=0)


def test_topk_loss_steps_lower_the_kl_to_the_teacher(pair, scored):
    from trainer.megatron_trainer import MegatronTrainer

    assert all(len(s.teacher_top_ids[t]) == 8 for s in scored for t in range(1, len(s.token_ids)))
    loss = LossSettings(env_reward_coef=0.0, distill_loss_coef=1.0, off_policy="none")
    trainer = MegatronTrainer(pair[0], TrainerSettings(lr=1e-2, threads=1, loss=loss))
    kls = [trainer.train_step(scored)["distill_kl"] for _ in range(10)]  # the batch's KL before each update
    assert kls[-1] < 0.8 * kls[0] and all(b < a for a, b in zip(kls, kls[1:], strict=False)), kls


def test_k1_reward_raises_tokens_the_teacher_prefers_and_lowers_the_others(pair, scored):
    from trainer.megatron_trainer import MegatronTrainer

    loss = LossSettings(env_reward_coef=0.0, distill_reward_coef=1.0, off_policy="none")
    trainer = MegatronTrainer(pair[0], TrainerSettings(lr=3e-3, threads=1, loss=loss))
    before = [trainer.sequence_logprobs(s.token_ids) for s in scored]
    for _ in range(3):
        trainer.train_step(scored)
    up = down = 0.0
    for s, old in zip(scored, before, strict=True):
        new = trainer.sequence_logprobs(s.token_ids)
        for t in range(1, len(s.token_ids)):
            if s.loss_mask[t]:
                change = new[t - 1] - old[t - 1]  # position t-1 predicts token t
                reward = s.teacher_logprobs[t] - s.behaviour_logprobs[t]
                up, down = (up + change, down) if reward > 0 else (up, down + change)
    assert up > 0 > down, (up, down)


def _write_config(tmp_path: Path, student: Path, teachers: list[dict], routes: dict) -> Path:
    cfg = {
        "model": {"path": str(student), "init_if_missing": False},
        "data": {"sources": [{"env_id": "agentflow/Calc-v0", "tags": ["calc"]}]},
        "sft": {"enabled": False},
        "trainer": {"drop_uniform_groups": False},
        "run": {"dir": str(tmp_path / "run")},
        "teachers": {"models": teachers, "routes": routes},
    }
    path = tmp_path / "distill.yaml"
    path.write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "teacher 'calc': model directory not found"),
        ("unknown_route", "route 'calc' -> unknown teacher 'calk'"),
        ("no_route", "data source 'agentflow/Calc-v0:default' with tags"),
        ("tokenizer", "teacher 'calc': its tokenizer .* differs from the student's"),
    ],
)
def test_bad_teacher_setups_fail_before_the_job_starts(pair, tmp_path, capsys, case, message):
    student, teacher = pair
    path = str(teacher)
    routes: dict = {"calc": "calc"}
    if case == "missing":
        path = str(tmp_path / "gone")
    elif case == "unknown_route":
        routes = {"calc": "calk"}
    elif case == "no_route":
        routes = {"qa": "calc"}
    else:
        odd = tmp_path / "odd"
        shutil.copytree(teacher, odd)
        tok = json.loads((odd / "tokenizer.json").read_text())
        tok["model"]["merges"] = tok["model"]["merges"][:-1]
        (odd / "tokenizer.json").write_text(json.dumps(tok))
        path = str(odd)
    config = _write_config(tmp_path, student, [{"name": "calc", "path": path}], routes)
    assert main(["distill", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("agentflow: error: teachers: ")
    assert __import__("re").search(message, err), err
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


def _two_source_config(student: Path, teacher: Path, run_dir: Path, extra: list[str]):
    """A distill job on two Calc data sources (``add`` tagged ``a`` -> teacher ``t``, ``mul`` tagged ``m`` ->
    teacher ``s``, the student itself), sized for a tiny model; ``extra`` overrides come last."""
    from agentflow.config import load_config

    return load_config(
        None,
        [
            f"model.path={student}",
            "model.init_if_missing=false",
            'data.sources=[{"env_id": "agentflow/Calc-v0", "name": "add", "tags": ["a"], '
            '"env_kwargs": {"task_types": ["add"]}}, {"env_id": "agentflow/Calc-v0", "name": "mul", "tags": ["m"], '
            '"env_kwargs": {"task_types": ["mul"]}}]',
            "sft.enabled=false",
            "trainer.drop_uniform_groups=false",
            "trainer.micro_batch_tokens=2048",
            f"run.dir={run_dir}",
            "run.progress=false",
            "rollout.max_new_tokens=12",
            "engine.max_len=384",
            f'teachers.models=[{{"name": "t", "path": "{teacher}"}}, {{"name": "s", "path": "{student}"}}]',
            'teachers.routes={"a": "t", "m": "s"}',
            *extra,
        ],
    )


@pytest.mark.slow
def test_distill_job_end_to_end_on_a_tiny_model(pair, tmp_path):
    """``run_distill`` on two data sources routed to two teachers (budget 1): trains, scores every sample, evals."""
    from agentflow.recipes.distill import run_distill

    student, teacher = pair
    extra = ["run.steps=2", "store.batch_groups=2", "rollout.group_size=2", "eval.episodes=2"]
    extra += ["teachers.loss_coef=0.1", "teachers.top_k=4", "teachers.max_resident=1"]
    cfg = _two_source_config(student, teacher, tmp_path / "run", extra)
    summary = run_distill(cfg, log=lambda *_: None)
    assert summary["steps"] == 2 and set(summary["per_source"]) == {"add", "mul"}
    stats = summary["teacher_stats"]
    assert stats["sequences_scored"] == summary["trajectories_trained"] and stats["peak_resident"] == 1
    assert set(stats["per_teacher"]) <= {"t", "s"} and stats["per_teacher"]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all("train/teacher_k1" in r and "train/distill_kl" in r for r in rows)
    assert (tmp_path / "run" / "model" / "model.safetensors").is_file()


def _seq_kd_config(student: Path, teacher: Path, run_dir: Path, extra: list[str] = ()):  # type: ignore[assignment]
    seq_kd = ["engine.max_slots=8", "teachers.seq_kd.episodes=20", "teachers.seq_kd.epochs=2"]
    seq_kd += ["teachers.seq_kd.batch_size=8", "teachers.seq_kd.threads=1"]
    return _two_source_config(student, teacher, run_dir, [*seq_kd, *extra])


def test_seq_kd_draws_are_played_by_their_sources_teacher(pair, tmp_path):
    from agentflow.recipes.seq_kd import assign_draws

    student, teacher = pair
    cfg = _seq_kd_config(student, teacher, tmp_path / "run")
    router = Router(
        [TeacherSpec("t", path=str(teacher)), TeacherSpec("s", path=str(student))], parse_routes({"a": "t", "m": "s"})
    )
    plan = assign_draws(cfg, router)
    indices = sorted(i for pairs in plan.values() for i, _ in pairs)
    assert indices == list(range(20))  # every draw once
    assert {d.source.name for _, d in plan["t"]} == {"add"} and {d.source.name for _, d in plan["s"]} == {"mul"}
    # a mixed route: each episode is played by one teacher, drawn by weight, the same one every time
    mixed = Router(
        [TeacherSpec("t", path=str(teacher)), TeacherSpec("s", path=str(student))],
        parse_routes({"default": {"t": 0.5, "s": 0.5}}),
    )
    cfg = _seq_kd_config(student, teacher, tmp_path / "run", ["teachers.seq_kd.episodes=200"])
    first, again = assign_draws(cfg, mixed), assign_draws(cfg, mixed)
    assert {k: [i for i, _ in v] for k, v in first.items()} == {k: [i for i, _ in v] for k, v in again.items()}
    assert 60 < len(first["t"]) < 140 and len(first["t"]) + len(first["s"]) == 200


@pytest.mark.parametrize("served", [False, True], ids=["model_dir", "sglang_server"])
def test_seq_kd_episodes_carry_the_teachers_tokens_and_log_probs(pair, tmp_path, served):
    """The imitation data is the teacher's (a model directory, or a teacher behind our SGLang-protocol server): the
    log-probs recorded with its tokens are the teacher's, not the student's."""
    from agentflow.engine.launch import start_servers, stop_servers
    from agentflow.recipes.seq_kd import split_samples, teacher_episodes

    student, teacher = pair
    cfg = _seq_kd_config(student, teacher, tmp_path / "run", ['teachers.routes={"a": "t", "m": "t"}'])
    procs, urls = start_servers(teacher, 1, "k", max_slots=8, max_len=384) if served else ([], [])
    spec = TeacherSpec("t", url=urls[0], tokenizer=str(teacher)) if served else TeacherSpec("t", path=str(teacher))
    router = Router([spec, TeacherSpec("s", path=str(student))], parse_routes({"a": "t", "m": "t"}))
    try:
        groups, stats = teacher_episodes(cfg, router, student, log=lambda *_: None)
    finally:
        stop_servers(procs)
    assert len(groups) == 20 and stats["t"]["episodes"] == 20 and set(stats) == {"t"}
    gaps = {"teacher": 0.0, "student": 0.0}
    for name, path in (("teacher", teacher), ("student", student)):
        scorer = EngineScorer(str(path))
        try:
            for g in groups[:4]:
                seg = g.trajectories[0].segments[0]
                got = scorer.score(seg.token_ids, 1).logprobs
                for pos, (m, lp) in enumerate(zip(seg.loss_mask, seg.logprobs, strict=True)):
                    if m:
                        gaps[name] = max(gaps[name], abs(got[pos - 1] - lp))
        finally:
            scorer.close()
    assert gaps["teacher"] < 1e-4 < gaps["student"], gaps
    train, val = split_samples(groups)
    assert len(val) == 2 and len(train) == 18  # every 10th episode held out


@pytest.mark.slow
def test_distill_job_with_seq_kd_imitates_then_distills(pair, tmp_path):
    from agentflow.recipes.distill import run_distill

    student, teacher = pair
    extra = ["run.steps=1", "store.batch_groups=2", "rollout.group_size=2", "eval.episodes=2"]
    summary = run_distill(_seq_kd_config(student, teacher, tmp_path / "run", extra), log=lambda *_: None)
    report = summary["seq_kd"]
    assert report["episodes"] == 20 and set(report["teachers"]) == {"t", "s"}
    # the student fits its teachers' episodes: the second epoch's training NLL is below the first's (by ~0.2 nats
    # here). The held-out loss on two episodes of a random tiny model moves by noise (+-0.02), so it is not asserted.
    assert len(report["curve"]) == 3 and report["curve"][2]["train_loss"] < report["curve"][1]["train_loss"] - 0.05
    assert summary["policy_dir"] == str(tmp_path / "run" / "seq_kd")
    assert summary["samples"] == 20 + summary["trajectories_trained"]
    assert all({"before", "after_seq_kd", "after"} <= set(row) for row in summary["per_source"].values())


def test_demo_rl_baseline_gets_as_many_samples_as_distillation():
    from agentflow.config import load_config
    from agentflow.demos.distill import CONFIG, rl_steps

    cfg = load_config(CONFIG, [])
    per_step = cfg.store.batch_groups * cfg.rollout.group_size
    distill_samples = cfg.run.steps * per_step + cfg.teachers.seq_kd.episodes
    assert cfg.teachers.seq_kd.episodes > 0
    assert rl_steps(cfg) * per_step == distill_samples  # 75 steps x 64 + 1,600 episodes = 100 steps x 64


def test_seq_kd_needs_enough_episodes_to_hold_some_out():
    from agentflow.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"teachers.seq_kd.episodes.*at least 10 \(every 10th episode is held out\)"):
        load_config(None, ["teachers.seq_kd.episodes=5"])


def test_demo_reevaluate_rescores_saved_models_without_training(pair, tmp_path, monkeypatch):
    from agentflow.demos import distill as distill_demo

    student, teacher = pair
    root = tmp_path / "distill"
    for run in ("distill", "rl"):
        shutil.copytree(teacher, root / run / "model")
        before = {env: {"before": 0.9, "after": 0.9} for env in distill_demo.ENVS}
        if run == "distill":
            shutil.copytree(student, root / run / "seq_kd")
            before = {env: {**row, "after_seq_kd": 0.9} for env, row in before.items()}
        (root / run / "summary.json").write_text(json.dumps({"per_source": before, "per_source_detail": {}}))
    names = {"student": student, "teacher-calc": teacher, "teacher-shell": teacher}
    (root / "models.json").write_text(json.dumps({"models": {k: str(v) for k, v in names.items()}}))
    monkeypatch.setattr(distill_demo, "ROOT", root)
    distill_demo.reevaluate(episodes=2)
    models = json.loads((root / "models.json").read_text())
    assert models["eval_episodes"] == 2 and set(models["success"]) == set(names)
    for run in ("distill", "rl"):
        summary = json.loads((root / run / "summary.json").read_text())
        assert summary["eval_episodes"] == 2 and "per_source_detail" not in summary
        for env, row in summary["per_source"].items():  # random tiny models: the placeholders 0.9 are replaced
            assert row["before"] == models["success"]["student"][env] and row["after"] in (0.0, 0.5, 1.0)
            assert row.get("after_seq_kd", 0.0) != 0.9
