"""Sequence-level KD: before on-policy distillation, the student imitates episodes its teachers play.

On-policy distillation scores the student's own samples. On an env the student has never seen those samples are
format errors from the first token (a shell-naive student closes ``<tool_call>`` at once), and a reverse KL on them
teaches the format slowly (docs/results.md). GKD mixes in teacher-generated sequences for that reason; here
they come first, as a short imitation phase: each draw of the data mixture is played by its source's teacher (at
``teachers.seq_kd.temperature``, one teacher loaded at a time), the student is trained on the teachers' tokens with
the NLL loss, and the on-policy phase starts from the result.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentflow.builder import data_mixture, env_pool
from agentflow.chat import ChatTokenizer
from agentflow.config import JobConfig
from agentflow.controller import to_samples
from agentflow.rollout import Rollouts, success_summary
from agentflow.threads import use_daemon_threads
from agentflow.types import Group, InferenceEngine, SamplingParams, Trajectory
from envs.tasks import Draw
from teachers.routing import Router
from teachers.types import TeacherSpec
from trainer.types import Sample

VAL_FRACTION = 0.1


def assign_draws(cfg: JobConfig, router: Router) -> dict[str, list[tuple[int, Draw]]]:
    """Teacher name -> the (index, draw) pairs it plays: draw ``i`` of the job's mixture goes to its source's
    teacher (one drawn by weight, stably per index, when the route mixes several)."""
    mixture = data_mixture(cfg)
    out: dict[str, list[tuple[int, Draw]]] = defaultdict(list)
    for i in range(cfg.teachers.seq_kd.episodes):
        draw = mixture.draw(i, "train")
        tags = [*draw.source.tags, draw.source.name]
        out[router.pick(f"seq_kd/{i}", tags)].append((i, draw))
    return dict(out)


async def _play(rollouts: Rollouts, pairs: list[tuple[int, Draw]], sampling: SamplingParams) -> list[Group]:
    use_daemon_threads()
    return list(await asyncio.gather(*(rollouts.play_group(f"kd{i}", draw, 1, sampling) for i, draw in pairs)))


def _teacher_engine(cfg: JobConfig, spec: TeacherSpec) -> InferenceEngine:
    """A teacher that can play: its model directory in an embedded engine, or its SGLang-protocol server."""
    if spec.path is not None:
        from agentflow.engine.embedded import EmbeddedEngine

        return EmbeddedEngine(spec.path, cfg.engine.max_slots, cfg.engine.max_len, seed=cfg.run.seed)
    from agentflow.engine.sglang_client import SGLangEngine

    return SGLangEngine([str(spec.url)], request_timeout=cfg.engine.request_timeout)


def teacher_episodes(
    cfg: JobConfig, router: Router, tokenizer_dir: str | Path, log: Callable[[str], None]
) -> tuple[list[Group], dict[str, dict[str, Any]]]:
    """Every seq-KD episode, played by its teacher; one teacher engine exists at a time. Episodes are tokenized
    with the student's tokenizer, which the job's pre-flight check proved equal to every teacher's."""
    specs = dict(router.teachers)
    sampling = SamplingParams(temperature=cfg.teachers.seq_kd.temperature, max_new_tokens=cfg.rollout.max_new_tokens)
    tokenizer = ChatTokenizer(tokenizer_dir)
    groups: list[Group] = []
    stats: dict[str, dict[str, Any]] = {}
    for name, pairs in sorted(assign_draws(cfg, router).items()):
        t0 = time.monotonic()
        engine = _teacher_engine(cfg, specs[name])
        pool = env_pool(cfg)
        try:
            rollouts = Rollouts(engine, tokenizer, pool, cfg.engine.max_len, cfg.rollout.max_concurrency)
            played = asyncio.run(_play(rollouts, pairs, sampling))
        finally:
            engine.close()
            pool.close()
        groups += played
        stats[name] = _teacher_stats([t for g in played for t in g.trajectories], time.monotonic() - t0)
        log(f"seq-KD: teacher {name} played {len(pairs)} episodes: {json.dumps(stats[name])}")
    groups.sort(key=lambda g: int(g.id[2:]))
    return groups, stats


def _teacher_stats(trajs: list[Trajectory], wall_s: float) -> dict[str, Any]:
    by_source: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        by_source[t.data_source].append(t)
    return {
        "episodes": len(trajs),
        "errors": sum(t.status == "error" for t in trajs),
        "success": {k: round(success_summary(v)["success"], 4) for k, v in sorted(by_source.items())},
        "wall_s": round(wall_s, 1),
    }


def split_samples(groups: list[Group]) -> tuple[list[Sample], list[Sample]]:
    """Trainable rows of the teachers' episodes; every 10th episode is held out for early stopping."""
    every = round(1 / VAL_FRACTION)
    train = to_samples([g for k, g in enumerate(groups) if k % every])
    val = to_samples([g for k, g in enumerate(groups) if k % every == 0])
    return train, val


def run_seq_kd(
    cfg: JobConfig, student_dir: Path, router: Router, out: Path, log: Callable[[str], None] = print
) -> tuple[Path, dict[str, Any]]:
    """The imitation phase: returns the imitating student's directory (``out``) and a report."""
    from agentflow.recipes.warmup import Imitation, imitate

    kd = cfg.teachers.seq_kd
    t0 = time.monotonic()
    groups, stats = teacher_episodes(cfg, router, student_dir, log)
    train, val = split_samples(groups)
    how = Imitation(kd.lr, kd.epochs, kd.batch_size, 1, kd.threads, kd.warmup_steps_max, "seq-KD")
    report = imitate(cfg, student_dir, train, val, how, out, log)
    report.update(teachers=stats, train_rows=len(train), val_rows=len(val), episodes=len(groups))
    report["total_wall_s"] = round(time.monotonic() - t0, 1)
    (out / "seq_kd_report.json").write_text(json.dumps(report, indent=2))
    return out, report
