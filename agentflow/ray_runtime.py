"""Ray runtime: the job's engines, trainer group and env workers as Ray actors, restarted by Ray when they die.

The controller stays the single driver; only where the parts run changes (``ray.enabled``). Each part keeps the
interface the controller already uses, so the RL loop is the same code:

- :class:`RayEngine` (the :class:`~agentflow.types.InferenceEngine` protocol and the weight receiver the TransferMesh
  transports call) over ``ray.engines`` :class:`EngineActor` s, each hosting an embedded engine. A trajectory sticks
  to one engine. When an engine dies, Ray restarts it with the initial weights; the next call finds a new
  incarnation and is given the newest weights first, and the episodes that were on it are reported lost.
- :class:`~agentflow.ray_envs.RemoteEnvPool` / ``RemoteEnv`` (``agentflow/ray_envs.py``) over ``ray.env_workers``
  async :class:`EnvWorker` actors, each hosting
  many envs (one Python process per env would cost ~50 MB and seconds each: 50 actors took ~20 s and ~2.4 GB to
  start). An env is (re)made on the worker at every reset, so a restarted worker serves the next episode; the episode
  that was on it is lost.
- :class:`RayTrainerGroup`: the trainer group (trainer/launcher.py) launched inside a Ray actor.

Lost episodes are retried by :class:`agentflow.rollout.Rollouts` (``rollout.episode_retries``) and reported.
Without an address (and no ``RAY_ADDRESS``) a local cluster starts with its files inside the run directory;
``ray.address`` (``auto`` or ``HOST:PORT``) or ``RAY_ADDRESS`` joins an existing one with no other change.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import tempfile
import threading
import time
import uuid
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from agentflow.ray_nodes import (
    ROLES,
    PlacementError,
    actor_options,
    alive_nodes,
    node_report,
    require_matching_nodes,
    role_labels,
)
from agentflow.types import GenerateResult, InferenceEngine, PauseMode, SamplingParams, ScoreResult

if TYPE_CHECKING:
    from agentflow.engine.pool import EnginePool
    from agentflow.ray_envs import RemoteEnvPool
    from trainer.types import Sample

try:  # ray is an optional dependency (the ``ray`` extra); importing this module without it fails at use
    import ray
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError:  # pragma: no cover - exercised only where ray is missing
    ray = cast(Any, None)

LOST = (RayActorError, ActorDiedError, ActorUnavailableError) if ray is not None else ()


class WorkerLost(RuntimeError):
    """An engine or env worker died under an episode; the episode can be retried once the worker is back."""


def _need_ray() -> None:
    if ray is None:
        raise RuntimeError("ray.enabled needs the ray package: pip install 'agentflow[ray]'")


def init_ray(cfg: Any, run_dir: Path) -> str:
    """Join ``cfg.address`` / ``RAY_ADDRESS`` when given, else start a small local cluster writing inside the run dir.

    Returns ``"joined"`` or ``"local"``.
    """
    _need_ray()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # a ray call after shutdown must fail, not quietly start (or hang joining) another cluster
    os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"
    if ray.is_initialized():
        return "joined"
    env_vars = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "RAY_USAGE_STATS_ENABLED": "0"}
    runtime_env = {"env_vars": env_vars}
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=False, configure_logging=False)
        return "joined"
    _STARTED_LOCAL[0] = True
    ray.init(
        num_cpus=cfg.num_cpus,
        include_dashboard=False,
        _temp_dir=_short_temp_dir(Path(run_dir).resolve() / "ray"),
        runtime_env=runtime_env,
        log_to_driver=False,
        configure_logging=False,
    )
    return "local"


def _short_temp_dir(temp: Path) -> str:
    """``temp``, or a short symlink to it: Ray's sockets live under the temp dir and AF_UNIX paths are limited to 107
    bytes, which a deep run directory exceeds. The files stay in the run directory either way."""
    temp.mkdir(parents=True, exist_ok=True)
    if len(str(temp)) <= 40:
        return str(temp)
    link = Path(tempfile.gettempdir()) / f"agentflow-ray-{zlib.crc32(str(temp).encode()):08x}"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(temp, target_is_directory=True)
    return str(link)


_STARTED_LOCAL = [False]


def shutdown_ray() -> None:
    """Leave the cluster (a local one stops) and forget its address, so the next job starts its own again."""
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    if _STARTED_LOCAL[0]:  # ray.init exported the local cluster's address; it is gone now
        os.environ.pop("RAY_ADDRESS", None)
        _STARTED_LOCAL[0] = False


# ------------------------------------------------------------------------------------------------------ actors


def _node_id() -> str:
    """The Ray node this process runs on."""
    return str(ray.get_runtime_context().get_node_id())


class EngineActor:
    """One embedded engine in its own process; ``incarnation`` changes when Ray restarts it."""

    def __init__(self, engine_cfg: Any, model_dir: str, seed: int) -> None:
        from agentflow.engine.factory import make_engine

        self.engine: InferenceEngine = make_engine(engine_cfg, model_dir, seed=seed)
        self.incarnation = uuid.uuid4().hex

    def info(self) -> dict[str, Any]:
        return {"incarnation": self.incarnation, "version": self.engine.weight_version, "pid": os.getpid()}

    def node(self) -> str:
        return _node_id()

    async def generate(self, ids: list[int], sampling: SamplingParams, rid: str | None) -> GenerateResult:
        return await self.engine.generate(ids, sampling, rid)

    def update_weights(self, version: int, named: dict[str, Any]) -> str:
        self.engine.update_weights(version, named)
        return self.incarnation

    def pause(self, mode: PauseMode) -> None:
        self.engine.pause(mode)

    def resume(self) -> None:
        self.engine.resume()

    def flush_cache(self) -> bool:
        return self.engine.flush_cache()

    def score(self, ids: list[int], start: int, top_k: int) -> ScoreResult:
        return self.engine.score(ids, start, top_k)

    def abort(self, rid: str) -> None:
        self.engine.abort(rid)


class EnvWorker:
    """Many envs in one async actor; an env is made at reset when its handle is new here (or the worker restarted)."""

    def __init__(self) -> None:
        self.envs: dict[str, Any] = {}

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        return _node_id()

    async def reset(self, handle: str, env_id: str, kwargs: dict, seed: int, options: dict) -> tuple:
        import envs

        env = self.envs.get(handle)
        if env is None:
            env = self.envs[handle] = envs.make(env_id, **kwargs)
        obs, info = await env.areset(seed=seed, options=options)
        return obs, info, env.system_prompt, list(env.tools), env.max_turns

    async def step(self, handle: str, action: str) -> tuple:
        env = self.envs.get(handle)
        if env is None:
            raise WorkerLost(f"env {handle} is not on this worker (it restarted since the reset)")
        return await env.astep(action)

    def close(self, handle: str) -> None:
        env = self.envs.pop(handle, None)
        if env is not None:
            env.close()


class TrainerActor:
    """The trainer group (one or ``tp * dp`` processes) launched from inside a Ray actor.

    Each :class:`trainer.types.TrainerGroup` method returns ``(its result, the version after it)``, so the
    controller-side :class:`RayTrainerGroup` keeps the version without another round trip.
    """

    def __init__(self, model_dir: str, settings: Any, tp: int, dp: int, ep: int = 1) -> None:
        from trainer.launcher import make_trainer_group

        self.group = make_trainer_group(model_dir, settings, tp=tp, dp=dp, ep=ep)

    def _out(self, result: Any) -> tuple[Any, int]:
        return result, self.group.version

    def version(self) -> tuple[int, int]:
        return self._out(self.group.version)

    def train_step(self, samples: list[Sample], loss: str | None) -> tuple[dict[str, float], int]:
        return self._out(self.group.train_step(samples, loss))

    def export_weights(self) -> tuple[dict[str, Any], int]:
        return self._out(self.group.export_weights())

    def export_buckets(self, bucket_bytes: int) -> tuple[list[Any], int]:
        return self._out(self.group.export_buckets(bucket_bytes))

    def save_checkpoint(self, path: str, extra: dict[str, Any] | None) -> tuple[None, int]:
        return self._out(self.group.save_checkpoint(path, extra))

    def load_checkpoint(self, path: str) -> tuple[dict[str, Any], int]:
        return self._out(self.group.load_checkpoint(path))

    def save_hf(self, path: str) -> tuple[Path, int]:
        return self._out(self.group.save_hf(path))

    def eval_nll(self, samples: list[Sample]) -> tuple[float, int]:
        return self._out(self.group.eval_nll(samples))

    def pids(self) -> list[int]:
        return [os.getpid(), *self.group.pids()]

    def node(self) -> str:
        return _node_id()

    def close(self) -> None:
        self.group.close()


# ------------------------------------------------------------------------------------------- controller side


class RayEngine:
    """The controller's view of the engine actors: one engine to the agent loop and to the weight transports."""

    def __init__(
        self, actors: list[Any], recover_timeout_s: float = 300.0, on_close: Callable[[], None] | None = None
    ) -> None:
        self.actors = actors
        self._on_close = on_close
        self.recover_timeout_s = recover_timeout_s
        self._incarnations = [ray.get(a.info.remote())["incarnation"] for a in actors]
        self._version = 0
        self._latest: tuple[int, Any] | None = None  # (version, object ref of the tensors) for restarted engines
        self.lost: set[str] = set()
        """Trajectory ids whose engine died under them (the rollout layer retries and clears them)."""
        self.restarts = 0
        self._recovering = threading.Lock()

    @property
    def weight_version(self) -> int:
        return self._version

    def _pick(self, rid: str | None) -> int:
        traj = (rid or "").split(":")[0]
        return zlib.crc32(traj.encode()) % len(self.actors)

    async def generate(self, input_ids: list[int], sampling: SamplingParams, rid: str | None = None) -> GenerateResult:
        k = self._pick(rid)
        floor = self._version  # tokens may come from this version or newer ones (updates mid-generation), never older
        try:
            res = await self.actors[k].generate.remote(list(input_ids), sampling, rid)
        except LOST as e:
            await self._lose(k, rid)
            raise WorkerLost(f"engine {k} died under request {rid}: {type(e).__name__}") from e
        if res.versions and min(res.versions) < floor:  # a restarted engine answered before it had our weights
            await self._lose(k, rid)
            raise WorkerLost(f"engine {k} restarted under request {rid}: it sampled with version {min(res.versions)}")
        return res

    async def _lose(self, k: int, rid: str | None) -> None:
        self.lost.add((rid or "").split(":")[0])
        await asyncio.to_thread(self._recover, k)

    def _recover(self, k: int) -> None:
        """Wait for Ray to bring engine ``k`` back (restarted, re-placed, or on a node that joined); a new incarnation
        gets the newest weights before serving again."""
        with self._recovering:
            deadline = time.monotonic() + self.recover_timeout_s
            while True:
                left = deadline - time.monotonic()
                try:
                    info = ray.get(self.actors[k].info.remote(), timeout=max(left, 0.1))
                    break
                except (*LOST, ray.exceptions.GetTimeoutError) as e:
                    if time.monotonic() >= deadline:
                        raise RuntimeError(
                            f"engine {k} did not come back within ray.recover_timeout_s={self.recover_timeout_s:g}: "
                            f"{type(e).__name__}"
                        ) from e
                    time.sleep(0.5)
            if self._latest is not None and info["version"] != self._latest[0]:
                self._note(k, ray.get(self.actors[k].update_weights.remote(*self._latest)))
            else:
                self._note(k, info["incarnation"])

    def _note(self, k: int, incarnation: str) -> None:
        if incarnation != self._incarnations[k]:
            self.restarts += 1
            self._incarnations[k] = incarnation

    def update_weights(self, version: int, named_tensors: dict[str, Any]) -> None:
        """Apply a whole version on every engine (each validates and applies all or nothing); an engine that is
        restarting gets it once it is back."""
        ref = ray.put(dict(named_tensors))
        self._latest = (version, ref)
        for k, call in enumerate([a.update_weights.remote(version, ref) for a in self.actors]):
            try:
                self._note(k, ray.get(call))
            except LOST:
                self._recover(k)
        self._version = version

    def _all(self, refs: list[Any]) -> list[Any]:
        """The answers of one call on every engine; a dead one answers None (it comes back with the newest weights
        anyway)."""
        out = []
        for ref in refs:
            try:
                out.append(ray.get(ref))
            except LOST:
                out.append(None)
        return out

    def pause(self, mode: PauseMode = "in_place") -> None:
        self._all([a.pause.remote(mode) for a in self.actors])

    def resume(self) -> None:
        self._all([a.resume.remote() for a in self.actors])

    def flush_cache(self) -> bool:
        return all(r is not False for r in self._all([a.flush_cache.remote() for a in self.actors]))

    def score(self, ids: list[int], start: int, top_k: int = 0) -> ScoreResult:
        result: ScoreResult = ray.get(self.actors[0].score.remote(list(ids), start, top_k))
        return result

    def abort(self, rid: str) -> None:
        """Abort ``rid`` on the engine its trajectory sticks to (a dead engine has nothing left to abort)."""
        self._all([self.actors[self._pick(rid)].abort.remote(rid)])

    def pids(self) -> list[int]:
        return [i["pid"] for i in ray.get([a.info.remote() for a in self.actors])]

    def close(self) -> None:
        for a in self.actors:
            ray.kill(a)
        if self._on_close is not None:
            self._on_close()


class RayTrainerGroup:
    """:class:`trainer.types.TrainerGroup` over a :class:`TrainerActor`."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self._version = 0
        self._version = self._get("version", actor.version.remote())

    @property
    def version(self) -> int:
        return self._version

    def _get(self, what: str, ref: Any) -> Any:
        """The result of one actor call (which also brings the version after it)."""
        from trainer.launcher import TrainerError

        try:
            out, self._version = ray.get(ref)
        except LOST as e:
            raise TrainerError(f"the trainer actor died during '{what}': {e}") from e
        return out

    def train_step(self, samples: list[Sample], loss: str | None = None) -> dict[str, float]:
        return self._get("train_step", self.actor.train_step.remote(samples, loss))

    def export_weights(self) -> dict[str, Any]:
        return self._get("export_weights", self.actor.export_weights.remote())

    def export_buckets(self, bucket_bytes: int = 32 << 20) -> list[Any]:
        return self._get("export_buckets", self.actor.export_buckets.remote(bucket_bytes))

    def save_checkpoint(self, path: str | Path, extra: dict[str, Any] | None = None) -> None:
        self._get("save_checkpoint", self.actor.save_checkpoint.remote(str(path), extra))

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        return self._get("load_checkpoint", self.actor.load_checkpoint.remote(str(path)))

    def save_hf(self, path: str | Path) -> Path:
        """The HF directory is written where the trainer actor runs (the same filesystem on one node)."""
        return Path(self._get("save_hf", self.actor.save_hf.remote(str(path))))

    def eval_nll(self, samples: list[Sample]) -> float:
        return float(self._get("eval_nll", self.actor.eval_nll.remote(samples)))

    def pids(self) -> list[int]:
        return ray.get(self.actor.pids.remote())

    def close(self) -> None:
        try:
            ray.get(self.actor.close.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - closing a dead actor: nothing left to close
            pass
        ray.kill(self.actor)


class RayRuntime:
    """Starts the actors of one job: by node labels where a role has them (agentflow/ray_nodes.py), the rest on a
    placement group (``colocated``: packed on one node; ``separate``: spread)."""

    def __init__(self, cfg: Any, run_dir: Path) -> None:
        self.cfg = cfg
        r = cfg.ray
        self.labels = role_labels(r)  # before anything starts
        self.cluster = init_ray(r, run_dir)
        self.start_nodes = alive_nodes()
        try:  # under ``replace`` an unmatched selector falls back to any node; under ``wait`` it would hang
            if r.on_node_loss == "wait":
                require_matching_nodes(self.labels, self.start_nodes)
        except PlacementError:
            shutdown_ray()
            raise
        counts = {"trainer": 1, "engine": r.engines, "env_worker": r.env_workers}
        n = sum(c for role, c in counts.items() if not self.labels[role])
        self.pg = None
        if n:
            strategy = "PACK" if r.placement == "colocated" else "SPREAD"
            self.pg = placement_group([{"CPU": r.actor_cpus}] * n, strategy=strategy)
            ray.get(self.pg.ready(), timeout=120)
        self._bundle = itertools.count()
        self.actors: dict[str, list[Any]] = {role: [] for role in ROLES}
        self.start_placement: dict[str, list[str | None]] = {}

    def _opts(self, role: str, restarts: int) -> dict[str, Any]:
        opts: dict[str, Any] = {"num_cpus": self.cfg.ray.actor_cpus, "max_restarts": restarts}
        if self.labels[role]:
            return {**opts, **actor_options(self.labels[role], self.cfg.ray.on_node_loss)}
        assert self.pg is not None  # sized for every role without labels
        bundle = next(self._bundle)
        return {**opts, "scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, bundle)}

    def trainer(self, model_dir: Path, settings: Any) -> RayTrainerGroup:
        tr = self.cfg.trainer
        cls = ray.remote(TrainerActor).options(**self._opts("trainer", 0))
        actor = cls.remote(str(model_dir), settings, tr.tp, tr.dp, tr.ep)
        self.actors["trainer"] = [actor]
        return RayTrainerGroup(actor)

    def engine(self, model_dir: Path) -> RayEngine:
        restarts = self.cfg.ray.max_restarts
        cls = ray.remote(EngineActor)
        seed = self.cfg.run.seed
        actors = [
            cls.options(**self._opts("engine", restarts), max_concurrency=1000).remote(
                self.cfg.engine, str(model_dir), seed + i
            )
            for i in range(self.cfg.ray.engines)
        ]
        self.actors["engine"] = actors
        return RayEngine(actors, self.cfg.ray.recover_timeout_s)

    def engine_pool(self, model_dir: Path) -> EnginePool:
        """The engines as a resizable pool (``engine.elastic``): each actor its own member."""
        from agentflow.engine.pool import EnginePool

        def member(k: int) -> RayEngine:
            actor = self.engine_actor(model_dir, k)
            return RayEngine([actor], self.cfg.ray.recover_timeout_s, lambda: self.actors["engine"].remove(actor))

        return EnginePool(member, self.cfg.ray.engines)

    def engine_actor(self, model_dir: Path, k: int) -> Any:
        """Engine actor ``k``: the first ``ray.engines`` on the placement group (or by label), later ones by label or
        wherever Ray finds room (the group was sized at the start)."""
        restarts = self.cfg.ray.max_restarts
        if k < self.cfg.ray.engines or self.labels["engine"]:
            opts = self._opts("engine", restarts)
        else:
            opts = {"num_cpus": self.cfg.ray.actor_cpus, "max_restarts": restarts}
        actor = (
            ray.remote(EngineActor)
            .options(**opts, max_concurrency=1000)
            .remote(self.cfg.engine, str(model_dir), self.cfg.run.seed + k)
        )
        self.actors["engine"].append(actor)
        return actor

    def env_pool(self) -> RemoteEnvPool:
        from agentflow.ray_envs import RemoteEnvPool

        cls = ray.remote(EnvWorker)
        restarts = self.cfg.ray.max_restarts
        workers = [cls.options(**self._opts("env_worker", restarts)).remote() for _ in range(self.cfg.ray.env_workers)]
        self.actors["env_worker"] = workers
        return RemoteEnvPool(workers, self.cfg.env.id, dict(self.cfg.env.kwargs))

    def placement(self, timeout: float = 10.0) -> dict[str, list[str | None]]:
        """The node of every actor, by role (None: it did not answer within ``timeout``, e.g. dead or pending)."""
        out: dict[str, list[str | None]] = {}
        for role, actors in self.actors.items():
            nodes: list[str | None] = []
            for ref in [a.node.remote() for a in actors]:
                try:
                    nodes.append(ray.get(ref, timeout=timeout))
                except (*LOST, ray.exceptions.GetTimeoutError):
                    nodes.append(None)
            out[role] = nodes
        return out

    def record_start(self) -> None:
        """Where every actor runs once all are started (the fault report compares the end of the job with it)."""
        self.start_placement = self.placement(timeout=self.cfg.ray.recover_timeout_s)

    def node_report(self) -> dict[str, Any]:
        """Nodes lost since the start (and which actors they held) and actors now on another node."""
        return node_report(self.start_nodes, self.start_placement, self.placement())

    def close(self) -> None:
        try:
            if self.pg is not None:
                remove_placement_group(self.pg)
        finally:
            shutdown_ray()
