"""Held-out evaluation: greedy success per data source, the scripted expert's success, ``agentflow eval``."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import envs
from agentflow.agents import agent_from_config
from agentflow.builder import JobError, data_mixture, env_pool, pin_threads
from agentflow.chat import ChatTokenizer
from agentflow.config import JobConfig
from agentflow.episode import EpisodeSpec
from agentflow.rollout import (
    EnvTimeouts,
    Rollouts,
    episode_lengths,
    episode_shape,
    per_type_success,
    success_summary,
)
from agentflow.threads import use_daemon_threads
from agentflow.types import SamplingParams
from envs.tasks import DataSource

LENGTH_KEYS = tuple(episode_lengths([]))


def eval_spec(src: DataSource, seed: int) -> EpisodeSpec:
    """Episode ``seed`` of a data source's held-out (eval) split. Its id is URL- and path-safe (a source's default
    name, ``ENV_ID:TASK_SET``, holds a slash, and black-box agents reach the proxy at ``/{trajectory id}/...``)."""
    tid = f"eval-{re.sub(r'[^A-Za-z0-9._-]', '_', src.name)}-{seed}"
    return EpisodeSpec(
        tid,
        tid,
        seed,
        "eval",
        data_source=src.name,
        env_id=src.env_id,
        options={"task_set": src.task_set},
        tags=src.tags,
        env_kwargs=dict(src.env_kwargs),
    )


async def evaluate_sources(rollouts: Rollouts, cfg: JobConfig) -> dict[str, dict[str, Any]]:
    """Greedy held-out success per data source (``eval.episodes`` episodes each, its task set's eval split)."""
    sampling = SamplingParams(temperature=0.0, max_new_tokens=cfg.rollout.max_new_tokens)
    out = {}
    for src in data_mixture(cfg).sources:
        specs = [eval_spec(src, seed) for seed in range(cfg.eval.episodes)]
        trajs = await asyncio.gather(*(rollouts.episode(s, sampling) for s in specs))
        out[src.name] = success_summary(list(trajs))
    return out


def pooled(per_source: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One summary over every source's episodes (the only one's, for a single-source job)."""
    n = sum(s["episodes"] for s in per_source.values())
    types: dict[str, list[tuple[float, int]]] = {}
    for s in per_source.values():
        for k, v in s["per_type"].items():
            types.setdefault(k, []).append((v, s["episodes"]))  # a type's share comes from its sources' episodes
    return {
        "success": sum(s["success"] * s["episodes"] for s in per_source.values()) / n if n else 0.0,
        "episodes": n,
        "errors": sum(s["errors"] for s in per_source.values()),
        "first_error": next((s["first_error"] for s in per_source.values() if s.get("first_error")), None),
        "per_type": {k: sum(v * e for v, e in xs) / sum(e for _, e in xs) for k, xs in sorted(types.items())},
        "lengths": {k: [x for s in per_source.values() for x in s["lengths"][k]] for k in LENGTH_KEYS},
    }


def shaped(summary: dict[str, Any]) -> dict[str, Any]:
    """An evaluation summary with its per-episode ``lengths`` replaced by their ``episode_shape`` (for reports)."""
    out = {k: v for k, v in summary.items() if k != "lengths"}
    if "lengths" in summary:
        out["episode_shape"] = episode_shape(summary["lengths"])
    return out


def shaped_sources(per_source: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """:func:`shaped` for each data source's summary."""
    return {k: shaped(v) for k, v in per_source.items()}


def scripted_success(cfg: JobConfig, seeds: list[int]) -> dict[str, Any] | None:
    """The warm-up's scripted expert on the held-out seeds of the ``env`` section's env (what imitation could reach);
    None when the env has no expert."""
    from agentflow.recipes.warmup import job_expert

    found = job_expert(cfg)
    if found is None:
        return None
    expert = found[0]
    env = envs.make(cfg.env.id, **cfg.env.kwargs)
    results: list[tuple[str, bool]] = []
    try:
        for s in seeds:
            obs, info = env.reset(seed=s, options={"split": "eval"})
            history: list[tuple[str, str]] = []
            term = False
            step_info: dict[str, Any] = {}
            reward = 0.0
            for _ in range(env.max_turns):
                obs, reward, term, trunc, step_info = env.step(action := expert(env, history))
                history.append((action, obs))
                if term or trunc:
                    break
            ok = bool(term and step_info.get("success", reward > 0))
            results.append((str(info["task_type"]), ok))
    finally:
        env.close()
    return {"success": sum(ok for _, ok in results) / len(results), "per_type": per_type_success(results)}


async def evaluate_dir(cfg: JobConfig, model_dir: Path) -> dict[str, dict[str, Any]]:
    """Held-out success per data source of the model in ``model_dir``, played by the job's agent on an engine of
    its own (closed afterwards)."""
    from agentflow.engine.factory import make_engine

    use_daemon_threads()
    engine = make_engine(cfg.engine, model_dir, seed=cfg.run.seed)
    pool = env_pool(cfg)
    agent = agent_from_config(cfg)
    tokenizer = ChatTokenizer(model_dir)
    try:
        await agent.start(engine, tokenizer)
        r = cfg.rollout
        timeouts = EnvTimeouts(r.reset_timeout_s, r.step_timeout_s)
        rollouts = Rollouts(engine, tokenizer, pool, cfg.engine.max_len, r.max_concurrency, agent, r.episode_retries,
                            timeouts)  # fmt: skip
        return await evaluate_sources(rollouts, cfg)
    finally:
        await agent.close()
        engine.close()
        pool.close()


def run_eval(cfg: JobConfig, model_dir: str | None = None) -> dict[str, Any]:
    """``agentflow eval``: greedy held-out success of a model directory (``eval.episodes`` per data source)."""
    from agentflow.recipes.common import check_env_ids, ensure_model

    pin_threads(cfg.run.threads)
    check_env_ids(cfg)
    path = Path(model_dir) if model_dir else ensure_model(cfg)
    if not (path / "config.json").is_file():
        raise JobError(f"model directory not found: {path}")
    per_source = asyncio.run(evaluate_dir(cfg, path))
    out = {"model": str(path), **shaped(pooled(per_source))}
    if len(per_source) > 1:
        out["per_source"] = shaped_sources(per_source)
    return out
