"""An RL job from config to summary: model, warm-up SFT, engine + trainer, evaluation before and after, the loop."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import envs
from agentflow.agents import agent_from_config
from agentflow.chat import ChatTokenizer
from agentflow.config import JobConfig, save_config
from agentflow.controller import rl_loop, save_checkpoint
from agentflow.metrics import MetricsLogger
from agentflow.rollout import BusyTracker, EnvPool, Rollouts, overlap_seconds, success_summary
from agentflow.store import Journal, TrajectoryStore, dump_json


class JobError(RuntimeError):
    """A job cannot start; the message says what to fix."""


_LOSS_FIELDS = ("clip_low", "clip_high", "off_policy", "is_cap", "is_low", "recompute_old", "minibatches", "kl_coef",
                "kl_estimator", "entropy_coef", "turn_credit", "gamma")  # fmt: skip


def trainer_settings(cfg: JobConfig) -> Any:
    """The trainer's settings from the job config (the trainer does not import agentflow's config)."""
    from trainer.types import LossSettings, TrainerSettings

    t = cfg.trainer
    loss = LossSettings(name=t.loss, **{k: getattr(t, k) for k in _LOSS_FIELDS})
    return TrainerSettings(
        lr=t.lr,
        weight_decay=t.weight_decay,
        warmup_steps=t.warmup_steps,
        grad_clip=t.grad_clip,
        loss=loss,
        micro_batch_tokens=t.micro_batch_tokens,
        seed=t.seed,
        threads=cfg.run.threads,
        temperature=cfg.rollout.temperature or 1.0,
    )


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

    return init_model(path, ModelInitConfig(seed=cfg.model.init_seed), env_ids=[cfg.env.id])


def check_env_id(cfg: JobConfig) -> None:
    envs.spec(cfg.env.id)  # raises UnknownEnvError with "did you mean"


def _pin_threads(n: int) -> None:
    import torch

    os.environ["OMP_NUM_THREADS"] = str(n)
    torch.set_num_threads(n)


def scripted_success(cfg: JobConfig, seeds: list[int]) -> dict[str, Any]:
    """The scripted expert's success on the held-out seeds (what imitation alone could reach)."""
    from agentflow.sft import load_expert

    env = envs.make(cfg.env.id, **cfg.env.kwargs)
    expert = load_expert(cfg.sft.expert)
    results: list[tuple[str, bool]] = []
    try:
        for s in seeds:
            obs, info = env.reset(seed=s, options={"split": "eval"})
            history: list[tuple[str, str]] = []
            for _ in range(env.max_turns):
                obs, reward, term, trunc, step_info = env.step(action := expert(env, history))
                history.append((action, obs))
                if term or trunc:
                    break
            results.append((info["task_type"], bool(term and step_info.get("success", reward > 0))))
    finally:
        env.close()
    per: dict[str, list[bool]] = {}
    for t, ok in results:
        per.setdefault(t, []).append(ok)
    return {
        "success": sum(ok for _, ok in results) / len(results),
        "per_type": {k: sum(v) / len(v) for k, v in sorted(per.items())},
    }


def run_job(cfg: JobConfig, log=print, resume: bool = False) -> dict[str, Any]:
    """Run warm-up SFT (optional) and RL; write and return ``summary.json``.

    ``resume``: continue the run in ``run.dir`` from its newest checkpoint and its journal (agentflow/resume.py).
    """
    t_start = time.monotonic()
    _pin_threads(cfg.run.threads)
    check_env_id(cfg)
    run_dir = Path(cfg.run.dir)
    save_config(cfg, run_dir)
    base = ensure_model(cfg)
    policy_dir = base
    sft_report = None
    if cfg.sft.enabled:
        from agentflow.sft import run_sft

        policy_dir = run_sft(cfg, base, run_dir.parent / "cache", log)
        sft_report = json.loads((policy_dir / "sft_report.json").read_text())
    summary = asyncio.run(_rl(cfg, policy_dir, run_dir, log, resume))
    summary["wall_s"] = time.monotonic() - t_start
    summary["sft"] = sft_report and {k: sft_report[k] for k in ("best_val_loss", "epochs", "curve")}
    dump_json(run_dir / "summary.json", summary)
    if summary["rl_steps"]:
        from agentflow.report import plot_success

        summary["plot"] = str(plot_success(run_dir))
        from agentflow.report import plot_run

        summary["report"] = str(plot_run(run_dir))
    return summary


def _write_processes(run_dir: Path, *parts: Any) -> None:
    """Process ids of this job's parts (operators and crash tests signal them by pid)."""
    pids = [p.pids() if hasattr(p, "pids") else [] for p in parts]
    out = {"controller": os.getpid(), **dict(zip(("trainer", "engines", "env_workers"), pids, strict=False))}
    dump_json(run_dir / "processes.json", out)


async def _components(cfg: JobConfig, policy_dir: Path, run_dir: Path) -> tuple[Any, Any, Any, Any]:
    """Trainer group, engine, env pool: local processes, or Ray actors (``ray.enabled``) plus their runtime."""
    from agentflow.engine.factory import make_engine
    from trainer.launcher import make_trainer_group

    settings = trainer_settings(cfg)
    if cfg.ray.enabled:
        from agentflow.ray_runtime import RayRuntime

        runtime = await asyncio.to_thread(RayRuntime, cfg, run_dir)
        try:
            trainer = await asyncio.to_thread(runtime.trainer, policy_dir, settings)
            engine = await asyncio.to_thread(runtime.engine, policy_dir)
            return trainer, engine, runtime.env_pool(), runtime
        except BaseException:
            runtime.close()
            raise
    tr = cfg.trainer
    trainer = await asyncio.to_thread(make_trainer_group, policy_dir, settings, tp=tr.tp, dp=tr.dp)
    engine = make_engine(cfg.engine, policy_dir, seed=cfg.run.seed)
    return trainer, engine, EnvPool(cfg.env.id, cfg.env.kwargs), None


def fault_report(rollouts: Rollouts, engine: Any) -> dict[str, Any]:
    """What died and what was replayed because of it."""
    return {
        "retried_episodes": dict(rollouts.retried),
        "retried_ids": list(rollouts.retried_ids),
        "lost_after_retries": rollouts.lost_for_good,
        "engine_restarts": getattr(engine, "restarts", 0),
    }


async def _resume(cfg: JobConfig, run_dir: Path, trainer: Any, transport: Any, store: TrajectoryStore, log) -> Any:
    """Load the newest good checkpoint, give its weights to the engines, put untrained journaled groups back."""
    from agentflow.controller import sync_weights
    from agentflow.resume import plan_resume

    state = await asyncio.to_thread(plan_resume, run_dir, trainer.load_checkpoint, cfg.rollout.group_size)
    if state.checkpoint is not None:
        await sync_weights(trainer, transport)
    store.restore(state.groups, trainer.version)
    n = sum(len(g.trajectories) for g in state.groups)
    log(
        f"resumed {run_dir} at step {state.step} from {state.checkpoint or 'the start (no checkpoint)'}: "
        f"{len(state.trained_ids)} trajectories trained, {n} restored from the journal"
        + (f"; skipped unreadable {state.skipped_checkpoints}" if state.skipped_checkpoints else "")
    )
    return state


async def _evaluate_before(cfg: JobConfig, rollouts: Rollouts, run_dir: Path, seeds: list[int], resumed: bool) -> dict:
    """Held-out success before RL; a resumed run reuses the first run's (its weights are gone)."""
    path = run_dir / "eval_before.json"
    if resumed and path.is_file():
        return json.loads(path.read_text())
    before = success_summary(await rollouts.evaluate(seeds, cfg.rollout.max_new_tokens))
    dump_json(path, before)
    return before


async def _rl(cfg: JobConfig, policy_dir: Path, run_dir: Path, log, resume: bool = False) -> dict[str, Any]:
    from agentflow.engine.factory import make_engine
    from transfer_mesh.transport import make_transport

    trainer, engine, pool, runtime = await _components(cfg, policy_dir, run_dir)
    transport = make_transport(cfg.transfer, [engine])
    stale = {"sync": 0, "one_step": 1}.get(cfg.run.mode, cfg.store.stale_steps)
    store = TrajectoryStore(
        cfg.store.batch_groups, stale, Journal(run_dir / "journal.jsonl"), cfg.store.collect, cfg.store.length_aware
    )
    agent = agent_from_config(cfg)  # whitebox loop, or a blackbox program behind the recording proxy
    await agent.start(engine, ChatTokenizer(policy_dir))
    rollouts = Rollouts(engine, ChatTokenizer(policy_dir), pool, cfg.engine.max_len, cfg.rollout.max_concurrency, agent)
    rollouts.retries = cfg.rollout.episode_retries
    metrics = MetricsLogger(run_dir, cfg.run.progress)
    trainer_busy = BusyTracker()
    eval_seeds = list(range(cfg.eval.episodes))
    _write_processes(run_dir, trainer, engine, pool)
    state = None
    try:
        if resume:
            state = await _resume(cfg, run_dir, trainer, transport, store, log)
        scripted = await asyncio.to_thread(scripted_success, cfg, eval_seeds)
        before = await _evaluate_before(cfg, rollouts, run_dir, eval_seeds, resume)
        log(f"before RL: success {before['success']:.3f} {before['per_type']} (scripted {scripted['success']:.3f})")
        ref = make_engine(cfg.engine, policy_dir, seed=cfg.run.seed) if cfg.trainer.kl_coef > 0 else None
        try:
            result = await rl_loop(rollouts, store, trainer, transport, cfg, metrics, trainer_busy, ref, state)
        finally:
            if ref is not None:
                ref.close()
        after = success_summary(await rollouts.evaluate(eval_seeds, cfg.rollout.max_new_tokens))
        log(f"after RL:  success {after['success']:.3f} {after['per_type']}")
        await save_checkpoint(trainer, metrics, result, store)
    finally:
        metrics.close()
        transport.close()
        await agent.close()
        engine.close()
        pool.close()
        trainer.close()
        if runtime is not None:
            runtime.close()
        if store.journal:
            store.journal.close()
    window = (result.start, result.end)
    engine_spans = rollouts.engine_busy.busy_in(*window)
    trainer_spans = trainer_busy.busy_in(*window)
    sm = store.metrics()
    return {
        "mode": cfg.run.mode,
        "scripted_policy_success": scripted["success"],
        "scripted_policy_per_type": scripted["per_type"],
        "success_before_rl": before["success"],
        "success_after_rl": after["success"],
        "per_type_before_rl": before["per_type"],
        "per_type_after_rl": after["per_type"],
        "eval_episodes": len(eval_seeds),
        "eval_errors": {"before": before["errors"], "after": after["errors"]},
        "rl_steps": result.steps,
        "rl_wall_s": result.wall_s,
        "mean_staleness": sm["mean_staleness"],
        "max_staleness_seen": sm["max_staleness_seen"],
        "staleness_histogram": store.histogram(),
        "stale_steps": stale,
        "dropped_stale_groups": sm["dropped_stale_groups"],
        "store_collect": store.strategy,
        "length_bias": sm["length_bias"],  # trained / accepted mean episode length (model tokens): 1.0 is unbiased
        "trained_len_mean": sm["trained_len_mean"],
        "finished_len_mean": sm["finished_len_mean"],
        "gate_closures": sm["gate_closures"],
        "overlap_fraction": overlap_seconds(engine_spans, trainer_spans) / max(result.wall_s, 1e-9),
        "engine_busy_fraction": sum(b - a for a, b in engine_spans) / max(result.wall_s, 1e-9),
        "trainer_busy_fraction": sum(b - a for a, b in trainer_spans) / max(result.wall_s, 1e-9),
        "weight_sync_s_median": sorted(result.sync_s)[len(result.sync_s) // 2] if result.sync_s else None,
        "trajectories_trained": len(result.trained_ids),
        "trajectories_pending": len(store.pending_ids()),
        "resumed_from": str(state.checkpoint) if state and state.checkpoint else None,
        "restored_trajectories": sum(len(g.trajectories) for g in state.groups) if state else 0,
        "policy_dir": str(policy_dir),
        "faults": fault_report(rollouts, engine),
        "timeline": {  # busy spans in seconds since the RL loop started (the report's utilisation plot)
            "engine": [(a - result.start, b - result.start) for a, b in engine_spans],
            "trainer": [(a - result.start, b - result.start) for a, b in trainer_spans],
        },
        "runtime": f"ray ({runtime.cluster} cluster)" if runtime is not None else "local processes",
    }


def run_eval(cfg: JobConfig, model_dir: str | None = None) -> dict[str, Any]:
    """Greedy success of a model directory on the env's held-out split (``eval.episodes`` episodes)."""
    _pin_threads(cfg.run.threads)
    check_env_id(cfg)
    path = Path(model_dir) if model_dir else ensure_model(cfg)
    if not (path / "config.json").is_file():
        raise JobError(f"model directory not found: {path}")

    async def go() -> dict[str, Any]:
        from agentflow.engine.factory import make_engine

        engine = make_engine(cfg.engine, path, seed=cfg.run.seed)
        pool = EnvPool(cfg.env.id, cfg.env.kwargs)
        agent = agent_from_config(cfg)
        await agent.start(engine, ChatTokenizer(path))
        rollouts = Rollouts(engine, ChatTokenizer(path), pool, cfg.engine.max_len, cfg.rollout.max_concurrency, agent)
        try:
            trajs = await rollouts.evaluate(list(range(cfg.eval.episodes)), cfg.rollout.max_new_tokens)
        finally:
            await agent.close()
            engine.close()
            pool.close()
        return {"model": str(path), **success_summary(trajs)}

    return asyncio.run(go())
