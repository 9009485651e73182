"""The job's envs on Ray: :class:`RemoteEnvPool` hands out :class:`RemoteEnv` s hosted by ``EnvWorker`` actors
(:mod:`agentflow.ray_runtime`), with :class:`agentflow.rollout.EnvPool`'s interface."""

from __future__ import annotations

import itertools
import uuid
from typing import Any

from agentflow.ray_runtime import LOST, WorkerLost, ray


class RemoteEnv:
    """An env on an :class:`EnvWorker`, with the attributes and coroutines the agent loop uses."""

    def __init__(self, worker: Any, env_id: str, kwargs: dict[str, Any]) -> None:
        self.worker, self.env_id, self.kwargs = worker, env_id, kwargs
        self.handle = uuid.uuid4().hex
        self.system_prompt, self.max_turns = "", 1
        self.tools: list[Any] = []
        self.lost = False
        self._agentflow_pool_key = ""

    async def _call(self, coro: Any) -> Any:
        try:
            return await coro
        except (*LOST, WorkerLost) as e:  # WorkerLost: the worker restarted since this env's reset
            self.lost = True
            raise WorkerLost(f"env worker died under env {self.handle}: {type(e).__name__}") from e

    async def areset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict]:
        ref = self.worker.reset.remote(self.handle, self.env_id, self.kwargs, seed, options or {})
        obs, info, self.system_prompt, self.tools, self.max_turns = await self._call(ref)
        return obs, info

    async def astep(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return await self._call(self.worker.step.remote(self.handle, action))

    def close(self) -> None:
        if not self.lost:
            try:
                ray.get(self.worker.close.remote(self.handle), timeout=10)
            except LOST:
                pass


class RemoteEnvPool:
    """:class:`agentflow.rollout.EnvPool`'s interface over env workers: envs spread round-robin, reused when healthy."""

    def __init__(self, workers: list[Any], env_id: str, kwargs: dict[str, Any]) -> None:
        import envs

        envs.spec(env_id)  # fail fast with the registry's "did you mean" message
        self.workers, self.env_id, self.kwargs = workers, env_id, kwargs
        self._next = itertools.cycle(range(len(workers)))
        self._free: dict[str, list[RemoteEnv]] = {}
        self._all: list[RemoteEnv] = []

    def acquire(self, env_id: str | None = None, kwargs: dict[str, Any] | None = None) -> RemoteEnv:
        from agentflow.rollout import EnvPool

        env_id, kwargs = env_id or self.env_id, self.kwargs if kwargs is None else kwargs
        key = EnvPool._key(env_id, kwargs)
        free = self._free.setdefault(key, [])
        if free:
            return free.pop()
        env = RemoteEnv(self.workers[next(self._next)], env_id, kwargs)
        env._agentflow_pool_key = key
        self._all.append(env)
        return env

    def release(self, env: RemoteEnv) -> None:
        if env.lost:  # its worker restarted: the env is gone with it
            self._all.remove(env)
            return
        self._free.setdefault(env._agentflow_pool_key, []).append(env)

    def discard(self, env: RemoteEnv) -> None:
        """Forget an env whose call timed out; its worker drops it (the call may still run there)."""
        if env in self._all:
            self._all.remove(env)
        env.close()

    def pids(self) -> list[int]:
        return ray.get([w.pid.remote() for w in self.workers])

    def close(self) -> None:
        for env in self._all:
            env.close()
        self._all.clear()
        self._free.clear()
