"""``agentflow distill``: on-policy distillation from several teachers, each serving the data sources routed to it.

The student plays episodes from the job's data mixture (as in RL). Before each train step every trained sequence
is scored by its data source's teacher(s) through the Teacher Manager (``teachers/``), which keeps at most
``teachers.max_resident`` teachers loaded. The trainer turns the teacher log-probs into a per-token reward added to
the advantage and/or a reverse-KL loss term, beside the environment reward (``teachers.env_reward_coef``). With
``teachers.seq_kd.episodes`` the student first imitates episodes the teachers play (``recipes/seq_kd.py``).

Everything that can be checked is checked before anything heavy starts: teacher directories, routes, that every
data source has a teacher, and that every teacher's tokenizer is the student's.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from agentflow.builder import Job, JobError, build_job, data_mixture
from agentflow.config import JobConfig, save_config
from agentflow.controller import rl_loop
from agentflow.files import dump_json
from agentflow.recipes.common import Log, begin, ensure_model, loop_summary, warm_up
from agentflow.recipes.evaluate import evaluate_dir, evaluate_sources, shaped_sources
from agentflow.teacher_scoring import route_tags, teacher_specs
from teachers.routing import Router, parse_routes
from teachers.teacher import check_teacher
from teachers.types import TeacherError
from trainer.registry import FULL_VOCAB_ESTIMATORS


def check_teachers(cfg: JobConfig, student_dir: Path) -> Router:
    """Every pre-flight check of a distillation job; a :class:`JobError` that says what to fix."""
    t = cfg.teachers
    if not t.models:
        raise JobError("no teachers configured: add a `teachers.models` list (name + path or url)")
    try:
        specs = teacher_specs(cfg)
        router = Router(specs, parse_routes(t.routes, t.mix))
        router.check_sources({s.name: route_tags(s.tags, s.name) for s in data_mixture(cfg).sources})
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
    if t.release == "offload":  # the shipped scorers (embedded engines, SGLang clients) have nothing to offload to
        raise JobError("teachers.release=offload: no teacher scorer here can offload; set teachers.release=free")
    mixed = any(isinstance(v, dict) and len(v) > 1 for v in t.routes.values())
    full = t.loss_coef > 0 and t.loss_estimator in FULL_VOCAB_ESTIMATORS
    if t.loss_coef > 0 and t.loss_estimator == "topk" and t.mix == "probs" and mixed:
        raise JobError("teachers: the top-k loss needs one teacher per sequence: set teachers.mix=sample")
    if full and t.mix == "probs" and mixed:
        raise JobError(f"teachers: the {t.loss_estimator} loss needs one teacher per sequence: set teachers.mix=sample")
    if full:
        vocab = _vocab_size(student_dir)
        for m in t.models:
            if m.path is not None and _vocab_size(Path(m.path)) != vocab:
                raise JobError(
                    f"teachers: teacher {m.name!r} has a vocabulary of {_vocab_size(Path(m.path))} tokens, the student "
                    f"{vocab}; {t.loss_estimator} compares distributions over one vocabulary"
                )
    return router


def _vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def run_distill(cfg: JobConfig, log: Log = print, resume: bool = False) -> dict[str, Any]:
    """Check everything, then warm up (optional), imitate the teachers (optional seq-KD), and distill on-policy."""
    t_start = time.monotonic()
    begin(cfg, "distill", resume)
    student = ensure_model(cfg)
    router = check_teachers(cfg, student)  # before the run directory, SFT or any engine
    run_dir = Path(cfg.run.dir)
    save_config(cfg, run_dir)
    policy_dir, _ = warm_up(cfg, student, run_dir, log)
    seq_kd = start = None
    if cfg.teachers.seq_kd.episodes:
        from agentflow.recipes.seq_kd import run_seq_kd

        start = asyncio.run(evaluate_dir(cfg, policy_dir))  # the student as it was, before imitating anyone
        log(f"before seq-KD: {json.dumps({k: v['success'] for k, v in start.items()})}")
        policy_dir, seq_kd = run_seq_kd(cfg, policy_dir, router, run_dir / "seq_kd", log)
    summary = asyncio.run(_loop(cfg, policy_dir, run_dir, log, router))
    if seq_kd is not None and start is not None:
        for name, row in summary["per_source"].items():
            row["after_seq_kd"] = row["before"]
            row["before"] = start[name]["success"]
        summary["per_source_detail"]["before_seq_kd"] = shaped_sources(start)
        summary["seq_kd"] = seq_kd
    summary["samples"] = summary["trajectories_trained"] + (seq_kd["episodes"] if seq_kd else 0)
    summary["wall_s"] = time.monotonic() - t_start
    dump_json(run_dir / "summary.json", summary)
    return summary


def run_rl_per_source(cfg: JobConfig, log: Log = print) -> dict[str, Any]:
    """The same job without teachers (RL on the environment reward alone), evaluated per data source: the
    baseline a distillation run is compared with."""
    t_start = time.monotonic()
    begin(cfg, "rl")
    run_dir = Path(cfg.run.dir)
    save_config(cfg, run_dir)
    policy_dir, _ = warm_up(cfg, ensure_model(cfg), run_dir, log)
    summary = asyncio.run(_loop(cfg, policy_dir, run_dir, log, None))
    summary["samples"] = summary["trajectories_trained"]
    summary["wall_s"] = time.monotonic() - t_start
    dump_json(run_dir / "summary.json", summary)
    return summary


async def _loop(cfg: JobConfig, policy_dir: Path, run_dir: Path, log: Log, router: Router | None) -> dict[str, Any]:
    async with build_job(cfg, policy_dir, run_dir, router) as job:
        before = await evaluate_sources(job.rollouts, cfg)
        log(f"before: {json.dumps({k: v['success'] for k, v in before.items()})}")
        result = await rl_loop(job, evaluate=lambda: _success(job))
        after = await evaluate_sources(job.rollouts, cfg)
        log(f"after:  {json.dumps({k: v['success'] for k, v in after.items()})}")
        await asyncio.to_thread(job.trainer.save_hf, str(run_dir / "model"))
        teacher_stats = job.teachers.stats.__dict__ if job.teachers else None
        loop = loop_summary(job, result)
    return {
        **loop,
        "teachers": {t.name: t.path or t.url for t in cfg.teachers.models} if router else {},
        "per_source": {name: {"before": before[name]["success"], "after": after[name]["success"]} for name in before},
        "per_source_detail": {"before": shaped_sources(before), "after": shaped_sources(after)},
        "steps": result.steps,
        "teacher_stats": teacher_stats,
        "model_dir": str(run_dir / "model"),
    }


async def _success(job: Job) -> dict[str, float]:
    return {f"success/{k}": v["success"] for k, v in (await evaluate_sources(job.rollouts, job.cfg)).items()}
