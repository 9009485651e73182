"""``agentflow distill``: on-policy distillation from several teachers, each serving the data sources routed to it.

The student plays episodes from the job's data mixture (as in RL). Before each train step every trained sequence
is scored by its data source's teacher(s) through the Teacher Manager (``teachers/``), which keeps at most
``teachers.max_resident`` teachers loaded. The trainer turns the teacher log-probs into a per-token reward added to
the advantage and/or a reverse-KL loss term, beside the environment reward (``teachers.env_reward_coef``). With
``teachers.seq_kd.episodes`` the student first imitates episodes the teachers play (``agentflow/seq_kd.py``).

Everything that can be checked is checked before anything heavy starts: teacher directories, routes, that every
data source has a teacher, and that every teacher's tokenizer is the student's.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from agentflow.chat import ChatTokenizer
from agentflow.config import JobConfig, save_config
from agentflow.controller import data_mixture, rl_loop
from agentflow.job import JobError, _pin_threads, check_env_id, ensure_model, trainer_settings
from agentflow.metrics import MetricsLogger
from agentflow.rollout import BusyTracker, EnvPool, Rollouts, success_summary
from agentflow.store import Journal, TrajectoryStore, dump_json
from agentflow.types import Group, SamplingParams
from envs.tasks import DataSource
from teachers.manager import TeacherManager
from teachers.routing import Router, parse_routes
from teachers.teacher import check_teacher
from teachers.types import Scorer, ScoreRequest, TeacherError, TeacherSpec
from trainer.types import Sample


def teacher_specs(cfg: JobConfig) -> list[TeacherSpec]:
    try:
        return [TeacherSpec(m.name, m.path, m.url, m.tokenizer) for m in cfg.teachers.models]
    except TeacherError as e:
        raise JobError(str(e)) from None


def sources(cfg: JobConfig) -> list[DataSource]:
    """The job's data sources (validated: registered env ids, known task sets)."""
    return list(data_mixture(cfg).sources)


def env_pool(cfg: JobConfig) -> EnvPool:
    """An env pool for the job's sources (it makes an env of each source's id on demand; the first is the default)."""
    first = sources(cfg)[0]
    return EnvPool(first.env_id, dict(first.env_kwargs))


def route_tags(source_tags: tuple[str, ...] | list[str], source_name: str) -> list[str]:
    """What a sequence is routed on: its data source's tags, then the source's name."""
    return [*source_tags, source_name]


def check_teachers(cfg: JobConfig, student_dir: Path) -> Router:
    """Every pre-flight check of a distillation job; a :class:`JobError` that says what to fix."""
    t = cfg.teachers
    if not t.models:
        raise JobError("no teachers configured: add a `teachers.models` list (name + path or url)")
    try:
        specs = teacher_specs(cfg)
        router = Router(specs, parse_routes(t.routes, t.mix))
        router.check_sources({s.name: route_tags(s.tags, s.name) for s in sources(cfg)})
        for spec in specs:
            check_teacher(spec, student_dir)
    except TeacherError as e:
        raise JobError(f"teachers: {e}") from None
    if cfg.rollout.temperature != 1.0:
        raise JobError("distillation compares log-probs at temperature 1: set rollout.temperature=1")
    if cfg.trainer.drop_uniform_groups:
        raise JobError(
            "set trainer.drop_uniform_groups=false for distillation: groups whose environment rewards are all equal "
            "still carry the teachers' per-token signal"
        )
    if (
        t.loss_coef > 0
        and t.loss_estimator == "topk"
        and t.mix == "probs"
        and any(isinstance(v, dict) and len(v) > 1 for v in t.routes.values())
    ):
        raise JobError("teachers: the top-k loss needs one teacher per sequence: set teachers.mix=sample")
    return router


def distill_settings(cfg: JobConfig) -> Any:
    """The trainer's settings with the teachers' signals switched on."""
    settings = trainer_settings(cfg)
    t = cfg.teachers
    settings.loss = replace(
        settings.loss,
        env_reward_coef=t.env_reward_coef,
        distill_reward_coef=t.reward_coef,
        distill_reward_estimator=t.reward_estimator,
        distill_loss_coef=t.loss_coef,
        distill_loss_estimator=t.loss_estimator,
    )
    return settings


class EngineScorer:
    """A teacher loaded into an embedded engine (no KV cache to speak of: scoring runs full forward passes)."""

    def __init__(self, path: str) -> None:
        from agentflow.engine.embedded import EmbeddedEngine

        self.engine = EmbeddedEngine(path, max_slots=1, max_len=16, prefix_cache=False)

    def score(self, ids: list[int], start: int, top_k: int = 0) -> Any:
        return self.engine.score(ids, start, top_k)

    def close(self) -> None:
        """Stop the engine and hand its memory back to the OS (glibc keeps freed heap pages otherwise, and a
        released teacher would still count against the machine)."""
        self.engine.close()
        del self.engine
        gc.collect()
        _malloc_trim()


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def make_scorer_factory(cfg: JobConfig):
    """Teachers load into embedded engines (``path``) or talk to SGLang-protocol servers (``url``)."""

    def factory(spec: TeacherSpec) -> Scorer:
        if spec.path is not None:
            return EngineScorer(spec.path)
        from agentflow.engine.sglang_client import SGLangEngine

        return SGLangEngine([spec.url], request_timeout=cfg.engine.request_timeout)

    return factory


def make_manager(cfg: JobConfig, router: Router, factory=None) -> TeacherManager:
    t = cfg.teachers
    top_k = t.top_k if t.loss_coef > 0 and t.loss_estimator == "topk" else 0
    return TeacherManager(
        teacher_specs(cfg), router, factory or make_scorer_factory(cfg), t.max_resident, t.release, top_k
    )


def attach_teacher_scores(manager: TeacherManager, batch: list[Group], samples: list[Sample]) -> None:
    """Score every sample with its data source's teacher(s); store the log-probs aligned with its tokens."""
    trajs = {t.id: t for g in batch for t in g.trajectories}
    requests = []
    for s in samples:
        traj = trajs[s.sample_id.rsplit("/", 1)[0]]  # to_samples names rows "TRAJECTORY_ID/SEGMENT"
        requests.append(ScoreRequest(s.sample_id, s.token_ids, route_tags(traj.tags, traj.data_source), 1))
    for s, scores in zip(samples, manager.score(requests), strict=True):
        s.teacher_logprobs = [0.0, *scores.logprobs]
        if scores.top_ids is not None and scores.top_logprobs is not None:
            s.teacher_top_ids = [[], *scores.top_ids]
            s.teacher_top_logprobs = [[], *scores.top_logprobs]
        s.extra["teachers"] = scores.teachers


async def evaluate_sources(rollouts: Rollouts, cfg: JobConfig) -> dict[str, dict[str, Any]]:
    """Greedy held-out success per data source (``eval.episodes`` episodes each, its task set's eval split)."""
    sampling = SamplingParams(temperature=0.0, max_new_tokens=cfg.rollout.max_new_tokens)
    out = {}
    for src in sources(cfg):
        specs = [_eval_spec(src, seed) for seed in range(cfg.eval.episodes)]
        trajs = await asyncio.gather(*(rollouts.episode(s, sampling) for s in specs))
        out[src.name] = success_summary(list(trajs))
    return out


def _eval_spec(src: DataSource, seed: int) -> Any:
    from agentflow.agent import EpisodeSpec

    return EpisodeSpec(
        f"eval-{src.name}-{seed}",
        f"eval-{src.name}-{seed}",
        seed,
        "eval",
        data_source=src.name,
        env_id=src.env_id,
        options={"task_set": src.task_set},
        tags=src.tags,
        env_kwargs=dict(src.env_kwargs),
    )


def run_distill(cfg: JobConfig, log=print) -> dict[str, Any]:
    """Check everything, then distill (or, with no teachers and ``allow_rl``, run RL with per-source evals)."""
    t_start = time.monotonic()
    _pin_threads(cfg.run.threads)
    check_env_id(cfg)
    student = ensure_model(cfg)
    router = check_teachers(cfg, student)  # before the run directory, SFT or any engine
    run_dir = Path(cfg.run.dir)
    save_config(cfg, run_dir)
    policy_dir = student
    if cfg.sft.enabled:
        from agentflow.sft import run_sft

        policy_dir = run_sft(cfg, student, run_dir.parent / "cache", log)
    seq_kd = None
    if cfg.teachers.seq_kd.episodes:
        from agentflow.seq_kd import run_seq_kd

        start = asyncio.run(evaluate_dir(cfg, policy_dir))  # the student as it was, before imitating anyone
        log(f"before seq-KD: {json.dumps({k: v['success'] for k, v in start.items()})}")
        policy_dir, seq_kd = run_seq_kd(cfg, policy_dir, router, run_dir / "seq_kd", log)
    summary = asyncio.run(_loop(cfg, policy_dir, run_dir, log, router))
    if seq_kd is not None:
        for name, row in summary["per_source"].items():
            row["after_seq_kd"] = row["before"]
            row["before"] = start[name]["success"]
        summary["per_source_detail"]["before_seq_kd"] = start
        summary["seq_kd"] = seq_kd
    summary["samples"] = summary["trajectories_trained"] + (seq_kd["episodes"] if seq_kd else 0)
    summary["wall_s"] = time.monotonic() - t_start
    dump_json(run_dir / "summary.json", summary)
    return summary


async def evaluate_dir(cfg: JobConfig, model_dir: Path) -> dict[str, dict[str, Any]]:
    """Held-out success per data source of the model in ``model_dir`` (its own engine, closed afterwards)."""
    from agentflow.engine.factory import make_engine

    engine = make_engine(cfg.engine, model_dir, seed=cfg.run.seed)
    pool = env_pool(cfg)
    try:
        rollouts = Rollouts(engine, ChatTokenizer(model_dir), pool, cfg.engine.max_len, cfg.rollout.max_concurrency)
        return await evaluate_sources(rollouts, cfg)
    finally:
        engine.close()
        pool.close()


def run_rl_per_source(cfg: JobConfig, log=print) -> dict[str, Any]:
    """The same job without teachers (RL on the environment reward alone), evaluated per data source: the
    baseline a distillation run is compared with."""
    t_start = time.monotonic()
    _pin_threads(cfg.run.threads)
    check_env_id(cfg)
    policy_dir = ensure_model(cfg)
    run_dir = Path(cfg.run.dir)
    save_config(cfg, run_dir)
    summary = asyncio.run(_loop(cfg, policy_dir, run_dir, log, None))
    summary["samples"] = summary["trajectories_trained"]
    summary["wall_s"] = time.monotonic() - t_start
    dump_json(run_dir / "summary.json", summary)
    return summary


async def _loop(cfg: JobConfig, policy_dir: Path, run_dir: Path, log, router: Router | None) -> dict[str, Any]:
    from agentflow.engine.factory import make_engine
    from trainer.launcher import make_trainer_group
    from transfer_mesh.transport import make_transport

    settings = distill_settings(cfg) if router is not None else trainer_settings(cfg)
    trainer = await asyncio.to_thread(make_trainer_group, policy_dir, settings, tp=cfg.trainer.tp, dp=cfg.trainer.dp)
    engine = make_engine(cfg.engine, policy_dir, seed=cfg.run.seed)
    transport = make_transport(cfg.transfer, [engine])
    pool = env_pool(cfg)
    journal = Journal(run_dir / "journal.jsonl")
    store = TrajectoryStore(
        cfg.store.batch_groups, cfg.store.stale_steps, journal, cfg.store.collect, cfg.store.length_aware
    )
    rollouts = Rollouts(engine, ChatTokenizer(policy_dir), pool, cfg.engine.max_len, cfg.rollout.max_concurrency)
    metrics = MetricsLogger(run_dir, cfg.run.progress)
    manager = make_manager(cfg, router) if router is not None else None
    annotate = (lambda batch, samples: attach_teacher_scores(manager, batch, samples)) if manager else None
    try:
        before = await evaluate_sources(rollouts, cfg)
        log(f"before: {json.dumps({k: v['success'] for k, v in before.items()})}")
        result = await rl_loop(rollouts, store, trainer, transport, cfg, metrics, BusyTracker(), annotate=annotate)
        after = await evaluate_sources(rollouts, cfg)
        log(f"after:  {json.dumps({k: v['success'] for k, v in after.items()})}")
        await asyncio.to_thread(trainer.call, "save_hf", str(run_dir / "model"))
    finally:
        if manager is not None:
            manager.close()
        metrics.close()
        transport.close()
        engine.close()
        pool.close()
        trainer.close()
        store.journal.close()
    return {
        "teachers": {t.name: t.path or t.url for t in cfg.teachers.models} if router else {},
        "per_source": {name: {"before": before[name]["success"], "after": after[name]["success"]} for name in before},
        "per_source_detail": {"before": before, "after": after},
        "steps": result.steps,
        "trajectories_trained": len(result.trained_ids),
        "rl_wall_s": result.wall_s,
        "teacher_stats": manager.stats.__dict__ if manager else None,
        "model_dir": str(run_dir / "model"),
        "policy_dir": str(policy_dir),
    }
