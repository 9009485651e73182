"""``agentflow train``: warm-up SFT (optional), then RL: evaluate -> loop -> evaluate -> summary."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from agentflow.builder import Job, JobError, build_job
from agentflow.config import JobConfig, save_config
from agentflow.controller import rl_loop, save_checkpoint, sync_weights
from agentflow.files import dump_json
from agentflow.recipes.common import Log, all_failed, begin, ensure_model, errors_note, loop_summary, warm_up
from agentflow.recipes.evaluate import evaluate_sources, pooled, scripted_success
from agentflow.resume import ResumeState, plan_resume
from agentflow.rollout import episode_shape

SHAPE_KEYS = ("median_turns_success", "p90_turns", "p90_context_tokens", "p90_over_median_episode_s")


def run_job(cfg: JobConfig, log: Log = print, resume: bool = False) -> dict[str, Any]:
    """Run warm-up SFT (optional) and RL; write and return ``summary.json``.

    ``resume``: continue the run in ``run.dir`` from its newest checkpoint and its journal (agentflow/resume.py).
    """
    t_start = time.monotonic()
    begin(cfg, "rl", resume)
    run_dir = Path(cfg.run.dir)
    save_config(cfg, run_dir)
    policy_dir, sft_report = warm_up(cfg, ensure_model(cfg), run_dir, log)
    summary = asyncio.run(_rl(cfg, policy_dir, run_dir, log, resume))
    summary["wall_s"] = time.monotonic() - t_start
    summary["sft"] = sft_report
    dump_json(run_dir / "summary.json", summary)
    if summary["rl_steps"]:
        from agentflow.report import plot_run, plot_success

        summary["plot"] = str(plot_success(run_dir))
        summary["report"] = str(plot_run(run_dir))
    return summary


async def _rl(cfg: JobConfig, policy_dir: Path, run_dir: Path, log: Log, resume: bool) -> dict[str, Any]:
    async with build_job(cfg, policy_dir, run_dir) as job:
        state = await _resume(job, log) if resume else None
        scripted = (
            await asyncio.to_thread(scripted_success, cfg, list(range(cfg.eval.episodes))) if cfg.sft.enabled else None
        )
        before = await _evaluate_before(job, state is not None)
        log(f"before RL: success {before['success']:.3f} {before['per_type']}"
            + (f" (scripted {scripted['success']:.3f})" if scripted else "") + errors_note(before))  # fmt: skip
        if (reason := all_failed(before)) is not None:  # the agent or env is broken: RL would learn nothing
            raise JobError(f"held-out evaluation before RL: {reason}")
        result = await rl_loop(job, state, evaluate=lambda: _success(job))
        after_sources = await evaluate_sources(job.rollouts, cfg)
        after = pooled(after_sources)
        log(f"after RL:  success {after['success']:.3f} {after['per_type']}" + errors_note(after))
        await save_checkpoint(job, result)
        model_dir = await asyncio.to_thread(job.trainer.save_hf, str(run_dir / "model"))  # the trained policy
        loop = loop_summary(job, result)
    shape = episode_shape(after["lengths"])
    return {
        **loop,
        "scripted_policy_success": scripted and scripted["success"],
        "scripted_policy_per_type": scripted and scripted["per_type"],
        "success_before_rl": before["success"],
        "success_after_rl": after["success"],
        "per_type_before_rl": before["per_type"],
        "per_type_after_rl": after["per_type"],
        "per_source": {
            k: {"before": v["success"], "after": after_sources[k]["success"]} for k, v in before["per_source"].items()
        },  # fmt: skip
        "eval_episodes": cfg.eval.episodes,
        "model_dir": str(model_dir),
        # the held-out episodes' shape after RL (turns, context, wall-time tail), and before/after in full
        **{k: shape[k] for k in SHAPE_KEYS},
        "episode_shape": {"before": episode_shape(before["lengths"]) if "lengths" in before else None, "after": shape},
        "eval_errors": {"before": before["errors"], "after": after["errors"]},
        # every episode the job played (evaluations and trained batches) and the ones that ended ``error``
        "episodes": before["episodes"] + after["episodes"] + loop["rollout_episodes"],
        "errors": before["errors"] + after["errors"] + loop["rollout_errors"],
        "first_error": before.get("first_error") or loop["first_rollout_error"] or after.get("first_error"),
        "resumed_from": str(state.checkpoint) if state and state.checkpoint else None,
        "restored_trajectories": sum(len(g.trajectories) for g in state.groups) if state else 0,
    }


async def _success(job: Job) -> dict[str, float]:
    """Held-out success now, per data source and pooled (``eval.every_steps``)."""
    per_source = await evaluate_sources(job.rollouts, job.cfg)
    return {"success": pooled(per_source)["success"], **{f"success/{k}": v["success"] for k, v in per_source.items()}}


async def _resume(job: Job, log: Log) -> ResumeState:
    """Load the newest good checkpoint, give its weights to the engines, put untrained journaled groups back."""
    state = await asyncio.to_thread(plan_resume, job.run_dir, job.trainer.load_checkpoint, job.cfg.rollout.group_size)
    if state.checkpoint is not None:
        await sync_weights(job.trainer, job.transport)
    job.store.restore(state.groups, job.trainer.version, state.fresh_groups, state.replayable)
    job.store.generated_tokens = state.generated_tokens  # run.max_generated_tokens counts the first run's tokens
    n = sum(len(g.trajectories) for g in state.groups)
    log(
        f"resumed {job.run_dir} at step {state.step} from {state.checkpoint or 'the start (no checkpoint)'}: "
        f"{len(state.trained_ids)} trajectories trained, {n} restored from the journal"
        + (f"; skipped unreadable {state.skipped_checkpoints}" if state.skipped_checkpoints else "")
    )
    return state


async def _evaluate_before(job: Job, resumed: bool) -> dict[str, Any]:
    """Held-out success before RL; a resumed run reuses the first run's (its weights are gone)."""
    path = job.run_dir / "eval_before.json"
    if resumed and path.is_file():
        saved = json.loads(path.read_text())
        if "per_source" in saved:
            return saved
    per_source = await evaluate_sources(job.rollouts, job.cfg)
    before = {**pooled(per_source), "per_source": per_source}
    dump_json(path, before)
    return before
