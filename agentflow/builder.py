"""Job assembly: the one place that builds every part of a training job and closes them all.

Every recipe (RL, distillation, and the baselines benchmarks run) gets its parts from :func:`build_job`: the trainer
group (local processes or a Ray actor), the engines, the weight transport, the env pool, the data mixture, the
trajectory store with the ``run.mode`` staleness remap, the started agent, rollouts with retries, metrics, a frozen
reference engine when ``trainer.kl_coef > 0``, and the Teacher Manager when teachers are configured. A key that a
recipe cannot honour is refused by :func:`refuse_unsupported` before anything starts.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentflow.agents import BaseAgent, agent_from_config
from agentflow.chat import ChatTokenizer
from agentflow.config import STALENESS_BY_MODE, JobConfig
from agentflow.files import dump_json
from agentflow.metrics import MetricsLogger
from agentflow.rollout import BusyTracker, EnvPool, EnvTimeouts, Rollouts
from agentflow.store import Journal, TrajectoryStore
from agentflow.threads import use_daemon_threads
from agentflow.tree import TreeSpec
from agentflow.types import EnvProvider, InferenceEngine
from envs.tasks import DataMixture, DataSource
from trainer.registry import FULL_VOCAB_ESTIMATORS
from trainer.types import TrainerGroup, TrainerSettings
from transfer_mesh.transport import WeightTransport

if TYPE_CHECKING:
    from agentflow.ray_runtime import RayRuntime
    from teachers.manager import TeacherManager
    from teachers.routing import Router


class JobError(RuntimeError):
    """A job cannot start; the message says what to fix (one line, naming the key)."""


@dataclass
class Job:
    """A job's parts, built and closed together by :func:`build_job`."""

    cfg: JobConfig
    run_dir: Path
    policy_dir: Path
    trainer: TrainerGroup
    engine: InferenceEngine
    transport: WeightTransport
    pool: EnvProvider
    """:class:`agentflow.rollout.EnvPool`, or the Ray runtime's pool of env workers."""
    mixture: DataMixture
    store: TrajectoryStore
    agent: BaseAgent
    rollouts: Rollouts
    metrics: MetricsLogger
    trainer_busy: BusyTracker
    reference: InferenceEngine | None = None
    """A never-updated engine on the initial weights (``trainer.kl_coef > 0``)."""
    teachers: TeacherManager | None = None
    """Scores trained samples with the teachers their data sources route to (distillation)."""
    runtime: RayRuntime | None = None

    @property
    def stale_steps(self) -> int:
        return self.store.stale_steps

    @property
    def sources(self) -> list[DataSource]:
        return list(self.mixture.sources)


def stale_steps(cfg: JobConfig) -> int:
    return STALENESS_BY_MODE.get(cfg.run.mode, cfg.store.stale_steps)


def data_mixture(cfg: JobConfig) -> DataMixture:
    """The job's data sources (the ``env`` section's env alone when none are configured), validated."""
    sources = [
        DataSource(s.env_id, s.task_set, s.weight, tuple(s.tags), s.name, dict(s.env_kwargs)) for s in cfg.data.sources
    ] or [DataSource(cfg.env.id, env_kwargs=dict(cfg.env.kwargs))]
    return DataMixture(sources, seed=cfg.data.seed + cfg.run.seed)


def env_pool(cfg: JobConfig) -> EnvPool:
    """A local env pool for the job's sources (envs of any source made on demand; the first source is the default)."""
    first = data_mixture(cfg).sources[0]
    return EnvPool(first.env_id, dict(first.env_kwargs))


def trainer_settings(cfg: JobConfig, **changes: Any) -> TrainerSettings:
    """The trainer's settings: its own section, the run's threads and the rollout temperature, and the teachers'
    signals when teachers are configured (``changes`` replace fields, e.g. an imitation phase's lr)."""
    settings = cfg.trainer.settings(cfg.run.threads, cfg.rollout.temperature or 1.0)
    if cfg.teachers.models:
        t = cfg.teachers
        settings.loss = cfg.trainer.loss_settings(
            env_reward_coef=t.env_reward_coef,
            distill_reward_coef=t.reward_coef,
            distill_reward_estimator=t.reward_estimator,
            distill_loss_coef=t.loss_coef,
            distill_loss_estimator=t.loss_estimator,
            distill_jsd_beta=t.jsd_beta,
        )
        if t.loss_coef > 0 and t.loss_estimator in FULL_VOCAB_ESTIMATORS:  # the trainer evaluates these itself
            settings.teachers = {m.name: m.path for m in t.models if m.path is not None}
    return settings.model_copy(update=changes) if changes else settings


def refuse_unsupported(cfg: JobConfig, recipe: str, resume: bool = False) -> None:
    """Refuse, with one line naming the key, whatever the ``recipe`` (``rl`` | ``distill``) cannot honour."""
    if recipe == "rl" and not cfg.teachers.models:
        default = type(cfg.teachers)()
        for key in type(cfg.teachers).model_fields:
            if getattr(cfg.teachers, key) != getattr(default, key):
                raise JobError(f"teachers.{key} is set but no teachers are configured (teachers.models is empty)")
    try:
        agent_from_config(cfg)  # an unknown agent.type or a blackbox agent without a program: before anything starts
    except ValueError as e:
        raise JobError(str(e)) from None
    if recipe == "distill" and resume:
        raise JobError("--resume: a distillation job cannot be resumed (its seq-KD phase is not checkpointed)")
    if cfg.eval.every_steps and cfg.eval.every_steps > cfg.run.steps:
        raise JobError(f"eval.every_steps={cfg.eval.every_steps} is more than run.steps={cfg.run.steps}")
    if cfg.run.cpus is not None or cfg.run.trainer_cpus is not None:
        check_cores(cfg)
    if cfg.sft.enabled:
        refuse_warm_up_without_expert(cfg)


def refuse_warm_up_without_expert(cfg: JobConfig) -> None:
    """Warm-up SFT imitates the ``env`` section's env's expert: that env must be one the job trains on (not the
    default demo env next to a user's data sources) and must have an expert (declared, or ``sft.expert``)."""
    sources = {s.env_id for s in cfg.data.sources}
    if sources and cfg.env.id not in sources:
        raise JobError(
            f"sft.enabled=true warms up on env.id={cfg.env.id}, which is none of data.sources: set env.id to the "
            "source to imitate, or sft.enabled=false"
        )
    from agentflow.recipes.warmup import require_expert

    require_expert(cfg)


def pin_threads(n: int) -> None:
    """One setting for torch's intra-op threads in this process and the ones it starts."""
    import torch

    os.environ["OMP_NUM_THREADS"] = str(n)
    torch.set_num_threads(n)


def place_on_cores(cfg: JobConfig, stack: AsyncExitStack) -> list[int] | None:
    """``run.cpus``: pin every thread of this process (threads and programs started later inherit it) until the
    job's stack closes, when each gets back the cores the process had. Returns the trainer's cores: its own
    ``run.trainer_cpus``, else the cores the job started with (a trainer started from a pinned process would
    otherwise inherit the job's cores); None when nothing is pinned."""
    run = cfg.run
    if run.cpus is None and run.trainer_cpus is None:
        return None
    have = check_cores(cfg)
    if run.cpus is not None:
        _move_threads_to(run.cpus)
        stack.callback(_move_threads_to, have)
    return run.trainer_cpus or have


def check_cores(cfg: JobConfig) -> list[int]:
    """The cores this process may use; JobError naming the key when ``run.cpus`` or ``run.trainer_cpus`` lists
    others (checked before the warm-up, and again when the job starts)."""
    if not hasattr(os, "sched_getaffinity"):
        raise JobError("run.cpus / run.trainer_cpus: pinning to cores needs Linux (os.sched_setaffinity)")
    have = sorted(os.sched_getaffinity(0))
    for key in ("cpus", "trainer_cpus"):
        cores = getattr(cfg.run, key)
        if missing := sorted(set(cores or ()) - set(have)):
            raise JobError(f"run.{key}={cores}: cores {missing} are not available to this job (it may use {have})")
    return have


def _move_threads_to(cores: list[int]) -> None:
    # sched_setaffinity(0) moves only the calling thread: the engine's decode thread and the executor's workers may
    # already run
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


def write_processes(job: Job) -> None:
    """Process ids of the job's parts (operators and crash tests signal them by pid)."""
    parts = {"trainer": job.trainer, "engines": job.engine, "env_workers": job.pool}
    out: dict[str, Any] = {"controller": os.getpid()}
    for name, part in parts.items():
        pids: Callable[[], list[int]] | None = getattr(part, "pids", None)
        out[name] = pids() if pids is not None else []
    dump_json(job.run_dir / "processes.json", out)


async def _trainer_engine_pool(
    cfg: JobConfig, policy_dir: Path, run_dir: Path, first: DataSource, stack: AsyncExitStack
) -> tuple[TrainerGroup, InferenceEngine, EnvProvider, RayRuntime | None]:
    """Trainer group, engine and env pool: local processes, or Ray actors (``ray.enabled``) and their runtime."""
    from agentflow.engine.factory import make_engine
    from trainer.launcher import make_trainer_group

    settings = trainer_settings(cfg, cpus=place_on_cores(cfg, stack))
    trainer: TrainerGroup
    engine: InferenceEngine
    pool: EnvProvider
    if cfg.ray.enabled:
        from agentflow.ray_nodes import PlacementError
        from agentflow.ray_runtime import RayRuntime

        try:
            runtime = await asyncio.to_thread(RayRuntime, cfg, run_dir)
        except PlacementError as e:
            raise JobError(str(e)) from None
        stack.callback(runtime.close)
        trainer = await asyncio.to_thread(runtime.trainer, policy_dir, settings)
        stack.callback(trainer.close)
        engine = await asyncio.to_thread(runtime.engine_pool if cfg.engine.elastic else runtime.engine, policy_dir)
        stack.callback(engine.close)
        pool = runtime.env_pool()
        stack.callback(pool.close)
        await asyncio.to_thread(runtime.record_start)
        return trainer, engine, pool, runtime
    tr = cfg.trainer
    trainer = await asyncio.to_thread(make_trainer_group, policy_dir, settings, tp=tr.tp, dp=tr.dp, ep=tr.ep)
    stack.callback(trainer.close)
    if cfg.engine.elastic:  # a pool the controller resizes (each member its own seed)
        from agentflow.engine.pool import EnginePool

        engine = EnginePool(lambda k: make_engine(cfg.engine, policy_dir, seed=cfg.run.seed + k), 1)
    else:
        engine = make_engine(cfg.engine, policy_dir, seed=cfg.run.seed)
    stack.callback(engine.close)
    pool = EnvPool(first.env_id, dict(first.env_kwargs))
    stack.callback(pool.close)
    return trainer, engine, pool, None


def tree_spec(cfg: JobConfig, mixture: DataMixture) -> TreeSpec | None:
    """``rollout.tree`` as the rollouts take it; JobError when a data source's env cannot branch."""
    t = cfg.rollout.tree
    if not t.branches:
        return None
    from envs.branching import declared_branching

    for source in mixture.sources:
        mode = declared_branching(source.env_id)
        if mode in (None, "none"):
            raise JobError(
                f"rollout.tree: env {source.env_id!r} cannot branch (branching={mode!r}; see envs/branching.py)"
            )
    return TreeSpec(t.branches, t.select, t.max_tokens)


def reference_engine(cfg: JobConfig, policy_dir: Path) -> InferenceEngine:
    """The KL reference: the initial weights in an embedded engine of this process that no update reaches (an
    SGLang server or a Ray engine would receive the job's weight updates and stop being a reference)."""
    from agentflow.engine.embedded import EmbeddedEngine

    return EmbeddedEngine(policy_dir, max_slots=1, max_len=cfg.engine.max_len, seed=cfg.run.seed, prefix_cache=False)


@asynccontextmanager
async def build_job(
    cfg: JobConfig, policy_dir: Path, run_dir: Path, router: Router | None = None
) -> AsyncIterator[Job]:
    """Every part of a job on ``policy_dir``, closed in reverse order on exit (an error included).

    ``router``: the teachers' routes (checked by the distillation recipe); with it the job gets a Teacher Manager.
    """
    from transfer_mesh.transport import make_transport

    use_daemon_threads()  # a hung tool call must not hold the job's exit
    mixture = data_mixture(cfg)
    async with AsyncExitStack() as stack:
        trainer, engine, pool, runtime = await _trainer_engine_pool(cfg, policy_dir, run_dir, mixture.sources[0], stack)
        transport = make_transport(cfg.transfer, [engine])
        stack.callback(transport.close)
        if cfg.engine.type == "sglang":  # servers keep what they last served: the job's version 0 goes first
            from agentflow.controller import sync_weights

            await sync_weights(trainer, transport)
        journal = Journal(run_dir / "journal.jsonl")
        stack.callback(journal.close)
        s = cfg.store
        store = TrajectoryStore(s.batch_groups, stale_steps(cfg), journal, s.collect, s.length_aware, s.replay)
        tokenizer = ChatTokenizer(policy_dir)
        agent = agent_from_config(cfg)  # whitebox loop, or a blackbox program behind the recording proxy
        await agent.start(engine, tokenizer)
        stack.push_async_callback(agent.close)
        r = cfg.rollout
        timeouts = EnvTimeouts(r.reset_timeout_s, r.step_timeout_s)
        rollouts = Rollouts(engine, tokenizer, pool, cfg.engine.max_len, r.max_concurrency, agent, r.episode_retries,
                            timeouts, tree_spec(cfg, mixture))  # fmt: skip
        metrics = MetricsLogger(run_dir, cfg.run.progress)
        stack.callback(metrics.close)
        job = Job(cfg, run_dir, policy_dir, trainer, engine, transport, pool, mixture, store, agent,
                  rollouts, metrics, BusyTracker(), runtime=runtime)  # fmt: skip
        if cfg.trainer.kl_coef > 0:
            job.reference = reference_engine(cfg, policy_dir)
            stack.callback(job.reference.close)
        if router is not None:
            from agentflow.teacher_scoring import make_manager

            job.teachers = make_manager(cfg, router)
            stack.callback(job.teachers.close)
        write_processes(job)
        yield job
