"""What every training recipe does around the loop: the base model, the warm-up, the loop's part of the summary."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import envs
from agentflow.builder import Job, JobError, pin_threads, refuse_unsupported
from agentflow.config import JobConfig
from agentflow.controller import LoopResult, engine_counters, over_budget
from agentflow.rollout import overlap_seconds, overlap_spans
from agentflow.types import SupervisedEngine

Log = Callable[[str], None]


def ensure_model(cfg: JobConfig) -> Path:
    """The base model directory; create the small demo model there when allowed and missing."""
    path = Path(cfg.model.path)
    if (path / "config.json").is_file():
        return path
    if path.exists() and any(path.iterdir()):
        raise JobError(f"model directory {path} has no config.json (not a Hugging Face model directory)")
    if not cfg.model.init_if_missing:
        raise JobError(f"model directory not found: {path} (create one with `agentflow model init {path}`)")
    from agentflow.model_init import ModelInitConfig, init_model

    init = ModelInitConfig(seed=cfg.model.init_seed, arch=cfg.model.init_arch)
    return init_model(path, init, env_ids=[cfg.env.id])


def begin(cfg: JobConfig, recipe: str, resume: bool = False) -> None:
    """What every recipe checks first: keys it cannot honour, the thread count, every env id of the job, and a run
    directory that holds an earlier run (refused unless resumed or ``run.overwrite``)."""
    refuse_unsupported(cfg, recipe, resume)
    pin_threads(cfg.run.threads)
    check_env_ids(cfg)
    claim_run_dir(cfg, resume)


RUN_FILES = ("journal.jsonl", "metrics.jsonl", "summary.json", "eval_before.json", "processes.json", "config.yaml",
             "report.png", "success.png")  # fmt: skip
RUN_DIRS = ("checkpoints", "tensorboard", "model", "seq_kd", "ray")
"""What a run writes into its directory (``run.overwrite`` removes these and nothing else)."""


def claim_run_dir(cfg: JobConfig, resume: bool) -> None:
    """A fresh run starts in a directory without another run's journal or checkpoints: appending to them would mix
    two runs (and a later resume would find trajectory ids twice)."""
    import shutil

    run_dir = Path(cfg.run.dir)
    if resume:
        return
    held = [n for n in ("journal.jsonl", "metrics.jsonl") if (run_dir / n).is_file() and (run_dir / n).stat().st_size]
    held += ["checkpoints"] if any((run_dir / "checkpoints").glob("*")) else []
    if held and not cfg.run.overwrite:
        raise JobError(
            f"run.dir {run_dir} already holds a run ({', '.join(held)}): continue it with "
            f"`agentflow train --resume {run_dir}`, or set run.overwrite=true to start over"
        )
    for name in RUN_FILES:
        (run_dir / name).unlink(missing_ok=True)
    for name in RUN_DIRS:
        shutil.rmtree(run_dir / name, ignore_errors=True)


def check_env_ids(cfg: JobConfig) -> None:
    """Every env id of the job is registered (``UnknownEnvError`` with "did you mean" otherwise)."""
    envs.spec(cfg.env.id)
    for src in cfg.data.sources:
        envs.spec(src.env_id)


def warm_up(cfg: JobConfig, base: Path, run_dir: Path, log: Log) -> tuple[Path, dict[str, Any] | None]:
    """The policy to train: ``base`` after warm-up SFT (``sft.enabled``; cached by config hash), and its report."""
    if not cfg.sft.enabled:
        return base, None
    from agentflow.recipes.warmup import run_sft

    policy = run_sft(cfg, base, run_dir.parent / "cache", log)
    report = json.loads((policy / "sft_report.json").read_text())
    return policy, {k: report[k] for k in ("best_val_loss", "epochs", "curve")}


def fault_report(job: Job) -> dict[str, Any]:
    """What died and what was replayed because of it (on Ray: also the nodes lost and the actors re-placed)."""
    r = job.rollouts
    report = {
        "retried_episodes": dict(r.retried),
        "retried_ids": list(r.retried_ids),
        "lost_after_retries": r.lost_for_good,
        "engine_restarts": job.engine.restarts if isinstance(job.engine, SupervisedEngine) else 0,
        "env_timeouts": len(r.timed_out),
        "env_timeout_reasons": r.timed_out[:20],
    }
    if job.runtime is not None:
        report.update(job.runtime.node_report())
    return report


def eval_spans(evals: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """The in-loop evaluations as spans in seconds since the RL loop started (from their ``rl_s`` and ``eval_s``)."""
    spans, before = [], 0.0
    for e in evals:
        start = e["rl_s"] + before
        spans.append((start, start + e["eval_s"]))
        before += e["eval_s"]
    return spans


def busy_fraction(spans: list[tuple[float, float]], evals: list[tuple[float, float]], wall_s: float) -> float:
    """The share of the RL time, evaluations excluded, that disjoint ``spans`` cover (``evals``: the same clock)."""
    rl_s = wall_s - sum(b - a for a, b in evals)
    return (sum(b - a for a, b in spans) - overlap_seconds(spans, evals)) / max(rl_s, 1e-9)


def loop_summary(job: Job, result: LoopResult) -> dict[str, Any]:
    """The loop's part of ``summary.json``: staleness, utilisation and overlap, faults, what was trained."""
    window = (result.start, result.end)
    engine_spans = job.rollouts.engine_busy.busy_in(*window)
    trainer_spans = job.trainer_busy.busy_in(*window)
    evals = [(result.start + a, result.start + b) for a, b in eval_spans(result.evals)]
    sm = job.store.metrics()
    return {
        "mode": job.cfg.run.mode,
        "rl_steps": result.steps,
        "rl_wall_s": result.wall_s,
        "generated_tokens": job.store.generated_tokens,
        "token_budget_spent": over_budget(job.cfg, job.store.generated_tokens),  # stopped by run.max_generated_tokens
        "mean_staleness": sm["mean_staleness"],
        "max_staleness_seen": sm["max_staleness_seen"],
        "staleness_histogram": job.store.histogram(),
        "stale_steps": job.stale_steps,
        "dropped_stale_groups": sm["dropped_stale_groups"],
        "store_collect": job.store.strategy,
        "length_bias": sm["length_bias"],  # trained / accepted mean episode length (model tokens): 1.0 is unbiased
        "trained_len_mean": sm["trained_len_mean"],
        "finished_len_mean": sm["finished_len_mean"],
        "gate_closures": sm["gate_closures"],
        # fractions of the RL time without the in-loop evaluations (the trainer waits through those by design)
        "overlap_fraction": busy_fraction(overlap_spans(engine_spans, trainer_spans), evals, result.wall_s),
        "engine_busy_fraction": busy_fraction(engine_spans, evals, result.wall_s),
        "trainer_busy_fraction": busy_fraction(trainer_spans, evals, result.wall_s),
        # the trainer waiting for data (replay can fill this time) vs engines held short of their slots (the
        # trainer is the bottleneck: replay would only lengthen its steps)
        "trainer_wait_fraction": result.batch_wait_s / max(result.wall_s - result.eval_s, 1e-9),
        "rollout_slot_occupancy": job.rollouts.limit.occupancy(),
        "eval_s": result.eval_s,
        "weight_sync_s_median": sorted(result.sync_s)[len(result.sync_s) // 2] if result.sync_s else None,
        "trajectories_trained": len(result.trained_ids),
        "trajectories_pending": len(job.store.pending_ids()),
        "rollout_episodes": result.episodes,
        "rollout_errors": result.errors,
        "silent_steps": {
            "longest": result.silent_longest[0],
            "ended_at_step": result.silent_longest[1],
            "stopped_job": 0 < job.cfg.run.stop_after_silent_steps <= result.silent,
        },
        "first_rollout_error": result.first_error,
        "evals": result.evals,
        "agent": job.agent.name,
        "kl_reference": job.reference is not None,
        "partial": job.cfg.rollout.partial,
        "recycled": result.recycled,
        "episode_retries": job.rollouts.retries,
        "policy_dir": str(job.policy_dir),
        "faults": fault_report(job),
        "timeline": {  # busy spans in seconds since the RL loop started (the report's utilisation plot)
            "engine": [(a - result.start, b - result.start) for a, b in engine_spans],
            "trainer": [(a - result.start, b - result.start) for a, b in trainer_spans],
        },
        "runtime": f"ray ({job.runtime.cluster} cluster)" if job.runtime is not None else "local processes",
        "replay": replay_summary(job, result),
        "engine_pool": engine_pool_summary(job, result),
        "kv_cache": kv_cache_summary(job),
        "tree": {**job.cfg.rollout.tree.model_dump(), "branches_played": job.rollouts.branches}
        if job.cfg.rollout.tree.branches
        else None,
    }


def kv_cache_summary(job: Job) -> dict[str, Any]:
    """``engine.kv_on_update`` and, from an engine that counts them (the embedded one), how much of the prompts'
    KV the prefix cache supplied over the job (training episodes and evaluations together)."""
    e = job.cfg.engine
    out: dict[str, Any] = {"kv_on_update": e.kv_on_update, "kv_max_age": e.kv_max_age, "admission": e.admission,
                           "kv_spill_bytes": e.kv_spill_bytes}  # fmt: skip
    stats = job.engine.stats() if callable(getattr(job.engine, "stats", None)) else None  # type: ignore[attr-defined]
    counters = engine_counters(job.engine, stats)
    if counters and isinstance(stats, dict):
        out.update({k: int(v) for k, v in counters.items()})
        prompt_tokens = out["prefill_tokens"] + out["prefix_tokens_reused"]  # each prompt token: computed or reused
        out["reused_over_prompt_tokens"] = out["prefix_tokens_reused"] / prompt_tokens if prompt_tokens else 0.0
        out["kv_ttl_s"] = stats.get("kv_ttl_s")
        out["versions_served"] = stats.get("versions_served")  # rollout.partial pin: the versions held at the end
        out["held_weights_bytes"] = stats.get("held_weights_bytes")
    return out


def engine_pool_summary(job: Job, result: LoopResult) -> dict[str, Any] | None:
    """``engine.elastic``: every join and leave (seconds since the RL loop started) and the pool's size now."""
    from agentflow.engine.pool import EnginePool

    if not isinstance(job.engine, EnginePool):
        return None
    events = [{**e, "t": e["t"] - result.start} for e in job.engine.events]
    return {"engines_now": job.engine.size, "events": events, "members": job.engine.members()}


def replay_summary(job: Job, result: LoopResult) -> dict[str, Any] | None:
    """Bounded replay (``store.replay``): how often groups were trained, and how stale the replayed tokens were."""
    pool, sm = job.store.pool, job.store.metrics()
    if pool is None:
        return None
    r = job.cfg.store.replay
    return {
        "max_reuse": r.max_reuse,
        "ratio": r.ratio,
        "schedule": r.schedule,
        "replay_bound": pool.stale_steps,  # versions a replayed group's oldest token may lag the trainer
        "replayed_groups": sum(result.replay_counts.values()),
        "fresh_groups": job.store.fresh_taken,
        "trainings_per_group": pool.trainings(),  # times trained in all -> groups
        "replayed_staleness_histogram": {str(k): v for k, v in sorted(pool.staleness_hist.items())},
        "replay_max_staleness": sm["replay_max_staleness"],
        "expired": sm["replay_expired"],
        "skipped_uniform": sm["replay_skipped_uniform"],
    }


def errors_note(summary: dict[str, Any]) -> str:
    """``; errors N/M (first: ...)`` for a console line about an evaluation (empty when nothing failed)."""
    if not summary.get("errors"):
        return ""
    return f"; errors {summary['errors']}/{summary['episodes']} (first: {summary.get('first_error')})"


def all_failed(summary: dict[str, Any]) -> str | None:
    """The one-line reason to give when every episode of a job (or an evaluation) ended ``error``; None otherwise.

    ``summary`` holds ``episodes``, ``errors`` and ``first_error`` (an evaluation's pooled summary, or a job's)."""
    n = summary.get("episodes") or 0
    if n and summary.get("errors") == n:
        return f"every one of the {n} episodes failed; the first: {summary.get('first_error')}"
    return None
