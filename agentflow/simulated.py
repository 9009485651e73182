"""Simulated engines, trainer, weight transport and rollouts for the planner (agentflow/planner.py).

Each part has the shape the controller loop calls; durations are spent on the loop's virtual clock
(:mod:`agentflow.virtual_clock`). Rollouts borrow the real dispatch (:meth:`Rollouts.feed`): only playing a group
is simulated.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentflow.rollout import EpisodeSlots, Rollouts
from agentflow.types import NO_VERSION, Group, Segment, Trajectory
from transfer_mesh.transport import UpdateReport

_DONE = 1e-6  # tokens left below which a request counts as finished (float slack of the shared-rate updates)


class Cpu:
    """The cores a machine's parts share: when the threads that want CPU exceed ``cores``, every one of them runs at
    ``cores / demand`` of its own speed (processor sharing). ``cores=None``: every part has its own device (no
    contention), as on a cluster.

    A user (:class:`SimEngine`, :class:`Work`) has ``threads`` (its demand now), ``advance(now, share)`` (progress
    since its last event) and ``reschedule(loop, share)`` (its next completion timer); every change of demand goes
    through :meth:`update` so each user's progress is accounted at the share that held while it ran.
    """

    def __init__(self, cores: float | None) -> None:
        self.cores = cores
        self.users: dict[Any, None] = {}  # insertion-ordered: the same run schedules the same way
        self._share = 1.0

    def share(self) -> float:
        if self.cores is None:
            return 1.0
        demand = sum(u.threads for u in self.users)
        return 1.0 if demand <= self.cores else self.cores / demand

    def update(self, loop: asyncio.AbstractEventLoop, change: Callable[[], None], who: Any) -> None:
        now = loop.time()
        shared = self.cores is not None
        for u in self.users if shared else [who]:
            u.advance(now, self._share)
        change()
        self._share = self.share()
        for u in list(self.users) if shared else [who] if who in self.users else []:
            u.reschedule(loop, self._share)


class Work:
    """``seconds`` of work at full speed on ``threads`` threads of a :class:`Cpu`; ``done`` resolves when finished."""

    def __init__(self, cpu: Cpu, seconds: float, threads: float, loop: asyncio.AbstractEventLoop) -> None:
        self.cpu, self.left, self.threads = cpu, seconds, threads
        self.done: asyncio.Future = loop.create_future()
        self._last = loop.time()
        self._timer: asyncio.TimerHandle | None = None
        cpu.update(loop, lambda: cpu.users.setdefault(self), self)

    def advance(self, now: float, share: float) -> None:
        self.left -= (now - self._last) * share
        self._last = now

    def reschedule(self, loop: asyncio.AbstractEventLoop, share: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_later(max(self.left, 0.0) / share, self._finish, loop)

    def _finish(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        self.cpu.update(loop, lambda: self.cpu.users.pop(self, None), self)
        if not self.done.done():
            self.done.set_result(None)


class SimEngine:
    """Processor sharing of engine time: at most ``slots`` requests are active (the rest queue in arrival order) and
    each of the ``n`` active ones gets ``1/n`` of the engine. A request first prefills its uncached prompt tokens at
    ``prefill_rate`` tokens/s of engine time (prefill is already a matrix product: batching buys it little), then
    decodes; the ``k`` decoding requests share the batched rate ``rate(k)``, so each decodes ``rate(k) / n`` tokens/s
    (times the CPU share). A finished request answers with the weight version the engine holds then. It wants one
    thread of the CPU while anything is active."""

    def __init__(self, rate: Callable[[int], float], slots: int, cpu: Cpu, prefill_rate: float | None = None) -> None:
        self.rate, self.slots, self.cpu = rate, slots, cpu
        self.prefill_rate = prefill_rate
        self.version = 0
        self.busy_s = 0.0
        self.prompt_tokens = 0.0
        self.prefilled = 0.0
        """Prompt tokens prefilled (the rest of ``prompt_tokens`` came from the cache)."""
        self._active: dict[int, list[Any]] = {}  # id -> [prefill tokens left, decode tokens left, future]
        self._queue: deque[tuple[int, float, float, asyncio.Future]] = deque()
        self._ids = 0
        self._last = 0.0
        self._timer: asyncio.TimerHandle | None = None
        cpu.users[self] = None

    @property
    def threads(self) -> float:
        return 1.0 if self._active else 0.0

    async def generate(self, tokens: float, prefill: float = 0.0, prompt: float = 0.0) -> int:
        """Generate ``tokens`` after prefilling ``prefill`` uncached tokens of a ``prompt`` (prefill is free without
        a prefill rate)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._ids += 1
        rid = self._ids
        self.prompt_tokens += prompt
        self.prefilled += prefill
        prefill = prefill if self.prefill_rate else 0.0
        self.cpu.update(loop, lambda: self._enqueue(rid, prefill, tokens, fut), self)
        return int(await fut)

    def _enqueue(self, rid: int, prefill: float, tokens: float, fut: asyncio.Future) -> None:
        self._queue.append((rid, prefill, tokens, fut))
        self._admit()

    def _admit(self) -> None:
        while self._queue and len(self._active) < self.slots:
            rid, prefill, tokens, fut = self._queue.popleft()
            self._active[rid] = [prefill, tokens, fut]

    def _rates(self, share: float) -> tuple[float, float]:
        """(prefill, decode) tokens/s of each active request in its phase."""
        n = len(self._active)
        decoding = sum(1 for req in self._active.values() if req[0] <= _DONE)
        decode = share * self.rate(decoding) / n if decoding else 0.0
        return share * (self.prefill_rate or 0.0) / n, decode

    def advance(self, now: float, share: float) -> None:
        dt = now - self._last
        if self._active and dt > 0:
            prefill, decode = self._rates(share)
            for req in self._active.values():
                if req[0] > _DONE:
                    req[0] -= dt * prefill
                else:
                    req[1] -= dt * decode
            self.busy_s += dt
        self._last = now

    def reschedule(self, loop: asyncio.AbstractEventLoop, share: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._active:
            prefill, decode = self._rates(share)
            # the next event: a prefill ends (the request starts decoding, every decode rate changes) or a request ends
            soonest = min(req[0] / prefill if req[0] > _DONE else req[1] / decode for req in self._active.values())
            self._timer = loop.call_later(max(soonest, 0.0), self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        self.cpu.update(loop, self._complete, self)

    def _complete(self) -> None:
        for rid in [r for r, req in self._active.items() if req[0] <= _DONE and req[1] <= _DONE]:
            *_, fut = self._active.pop(rid)
            if not fut.done():
                fut.set_result(self.version)
        self._admit()


class Deferred:
    """What a simulated blocking call returns: its result, ready when ``done`` resolves (the virtual loop's executor
    delivers it then)."""

    def __init__(self, done: asyncio.Future, result: Any) -> None:
        self.done, self.result = done, result


class SimTrainer:
    """A trainer group whose step is ``step_s(samples)`` seconds of work on ``threads`` threads of the CPU."""

    def __init__(self, step_s: Callable[[int], float], cpu: Cpu, threads: float = 1.0) -> None:
        self.step_s, self.cpu, self.threads = step_s, cpu, threads
        self.version = 0
        self.busy: list[tuple[float, float]] = []
        self.samples: list[int] = []

    def train_step(self, samples: list[Any], loss: str | None = None) -> Deferred:
        loop = asyncio.get_event_loop()
        seconds = self.step_s(len(samples))
        self.samples.append(len(samples))
        work = Work(self.cpu, seconds, self.threads, loop)
        start = loop.time()
        work.done.add_done_callback(lambda _: self.busy.append((start, loop.time())))
        self.version += 1
        return Deferred(work.done, {"train_s": seconds, "samples": float(len(samples))})

    def export_weights(self) -> dict[str, Any]:
        return {}


class SimTransport:
    """Weight sync: ``sync_s`` virtual seconds, after which every engine holds the new version."""

    def __init__(self, engines: list[SimEngine], sync_s: float) -> None:
        self.engines, self.sync_s = engines, sync_s

    def send(self, version: int, named: dict[str, Any]) -> UpdateReport:
        loop = asyncio.get_event_loop()
        loop.charge(self.sync_s)  # type: ignore[attr-defined]
        loop.call_later(self.sync_s, self._apply, version)
        return UpdateReport(version=version, transport="simulated", bytes=0, buckets=0, total_s=self.sync_s)

    def _apply(self, version: int) -> None:
        for e in self.engines:
            e.version = version

    def close(self) -> None:
        pass


class SimMixture:
    """Group ``i``'s draw is ``i`` (the simulated episode is drawn from the run's journal by trajectory id)."""

    def draw(self, index: int) -> int:
        return index


@dataclass
class KvPolicy:
    """Which prompt tokens a simulated turn prefills: a resumed turn pays only its new tokens while its cached
    context survives; after a weight update it survives only under ``keep`` and within ``max_age`` versions
    (``flush`` drops it, and ``recompute`` spends the same prefill, only earlier). Every episode's first turn finds
    the ``shared_prefix`` tokens (the system prompt and tools every episode starts with) cached."""

    prefix_cache: bool = True
    max_age: int = 0
    """Versions a cached context may lag the engine (0: flushed at every update)."""
    shared_prefix: int = 0

    def reuses(self, kv_version: int, engine_version: int) -> bool:
        return self.prefix_cache and engine_version - kv_version <= self.max_age


class SimRollouts:
    """Plays simulated groups; dispatch (``feed``) is the real :class:`Rollouts` code."""

    feed = Rollouts.feed
    _play_and_accept = Rollouts._play_and_accept

    def __init__(
        self,
        episodes: list[Any],
        engines: list[SimEngine],
        concurrency: int,
        seed: int,
        cpu: Cpu,
        env_cpu_s: float,
        kv: KvPolicy | None = None,
    ) -> None:
        self.episodes, self.engines, self.seed = episodes, engines, seed
        self.limit = EpisodeSlots(concurrency)
        self.cpu, self.env_cpu_s = cpu, env_cpu_s
        self.kv = kv or KvPolicy()

    async def play_group(self, group_id: str, draw: int, n: int, sampling: Any) -> Group:
        version = self.engines[0].version
        trajs = await asyncio.gather(*(self._episode(f"{group_id}-{i}", group_id) for i in range(n)))
        return Group(id=group_id, task_seed=draw, trajectories=list(trajs), dispatch_version=version)

    async def _episode(self, traj_id: str, group_id: str) -> Trajectory:
        key = zlib.crc32(f"{self.seed}:{traj_id}".encode())
        ep = self.episodes[random.Random(key).randrange(len(self.episodes))]
        engine = self.engines[key % len(self.engines)]  # a trajectory sticks to one engine
        versions: list[int] = []
        turns = ep.turn_tokens or [(0, 0, ep.model_tokens / ep.turns)] * ep.turns
        async with self.limit.slot(holdable=True):
            kv_version: int | None = None  # the oldest weight version in this episode's cached context
            for context, new, generated in turns:
                if kv_version is None or not self.kv.reuses(kv_version, engine.version):
                    prefill, kv_version = max(context - self.kv.shared_prefix, 0), engine.version
                else:
                    prefill = new
                versions.append(await engine.generate(generated, prefill, context))
                await self._env_step(ep.env_s / ep.turns)
        # one token stands for each turn's generation: what the store and the loss bookkeeping read is its version
        seg = Segment(
            token_ids=[0] * (ep.turns + 1),
            loss_mask=[0] + [1] * ep.turns,
            logprobs=[0.0] + [-1.0] * ep.turns,
            versions=[NO_VERSION, *versions],
        )
        return Trajectory(
            traj_id, "sim", group_id, "sim", segments=[seg], reward=ep.reward, info={"success": ep.reward > 0}
        )

    async def _env_step(self, wall_s: float) -> None:
        """A tool call or check: its CPU part competes for the cores, the rest (the tool's own latency) waits."""
        cpu_s = min(self.env_cpu_s, wall_s)
        if cpu_s > 0 and self.cpu.cores is not None:
            await Work(self.cpu, cpu_s, 1.0, asyncio.get_running_loop()).done
        await asyncio.sleep(wall_s - cpu_s)


def _spin(seconds: float, start: Any, out: Any) -> None:
    """One process of :func:`measure_effective_cores`: single-threaded matrix products for ``seconds``."""
    import torch

    torch.set_num_threads(1)
    a = torch.randn(192, 192)
    start.wait()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ a
        n += 1
    out.put(n / (time.perf_counter() - t0))


def measure_effective_cores(workers: int | None = None, seconds: float = 2.0, repeats: int = 3) -> float:
    """How many single-threaded compute-bound processes' worth of work this machine does at once: the summed rate of
    ``workers`` (default: the CPU count) concurrent spinners over one alone. Below the CPU count where logical CPUs
    share physical cores (hyper-threads) or memory bandwidth; this, not the CPU count, bounds overlap."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")

    def rates(n: int) -> list[float]:
        start, out = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_spin, args=(seconds, start, out)) for _ in range(n)]
        for p in procs:
            p.start()
        time.sleep(3.0)  # every process imported torch and waits at the start line
        start.set()
        got = [out.get(timeout=60 + seconds) for _ in procs]
        for p in procs:
            p.join()
        return got

    n = workers or os.cpu_count() or 1
    # a shared machine is noisy: the median of ``repeats`` alone/together pairs
    return statistics.median(sum(rates(n)) / rates(1)[0] for _ in range(repeats))
