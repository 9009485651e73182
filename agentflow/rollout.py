"""Rollout workers: keep groups of episodes flowing into the store while the window admits them.

Each group is one task seed played ``group_size`` times concurrently. Episodes await the engine and the env, so a
paused episode (a tool running in its sandbox) holds no engine slot. Env instances are pooled and reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import threading
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, replace
from typing import Any

import envs
from agentflow.agents import BaseAgent, Episode, WhiteBoxAgent
from agentflow.chat import ChatTokenizer
from agentflow.episode import EpisodeSpec, run_branch
from agentflow.store import TrajectoryStore
from agentflow.tree import TreeSpec, branch_points
from agentflow.types import EnvProvider, Group, InferenceEngine, SamplingParams, SupervisedEngine, Trajectory
from envs.tasks import DataMixture, Draw


class BusyTracker:
    """Intervals during which a component had work; used for utilisation and overlap metrics."""

    def __init__(self) -> None:
        self.active = 0
        self.intervals: list[tuple[float, float]] = []
        self._since = 0.0

    def enter(self) -> None:
        if self.active == 0:
            self._since = time.monotonic()
        self.active += 1

    def exit(self) -> None:
        self.active -= 1
        if self.active == 0:
            self.intervals.append((self._since, time.monotonic()))

    def busy_in(self, start: float, end: float) -> list[tuple[float, float]]:
        spans = list(self.intervals) + ([(self._since, time.monotonic())] if self.active else [])
        return [(max(a, start), min(b, end)) for a, b in spans if min(b, end) > max(a, start)]


def overlap_spans(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The intersection of two sets of disjoint intervals, as disjoint intervals."""
    out, i, j = [], 0, 0
    a, b = sorted(a), sorted(b)
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def overlap_seconds(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sets of disjoint intervals."""
    return sum(hi - lo for lo, hi in overlap_spans(a, b))


def _loop_time() -> float:
    """The running event loop's clock (a simulation's virtual one), else the monotonic clock it equals."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()


class LevelTracker:
    """The time-weighted mean of a count (episodes holding a concurrency slot) over the time it is counting."""

    def __init__(self) -> None:
        self.level = 0
        self.counting = True
        self._since = _loop_time()
        self._area = 0.0
        self._seconds = 0.0

    def _advance(self) -> None:
        now = _loop_time()
        if self.counting:
            self._area += self.level * (now - self._since)
            self._seconds += now - self._since
        self._since = now

    def add(self, delta: int) -> None:
        self._advance()
        self.level += delta

    def restart(self) -> None:
        """Forget the mean so far and count from now (the RL loop starts: the evaluation before it does not count)."""
        self._advance()
        self._area = self._seconds = 0.0
        self.counting = True

    def count(self, on: bool) -> None:
        """Stop (an in-loop evaluation) or resume counting time."""
        self._advance()
        self.counting = on

    def mean(self) -> float:
        self._advance()
        return self._area / self._seconds if self._seconds > 0 else 0.0

    def totals(self) -> tuple[float, float]:
        """(count x seconds, seconds) counted so far: the mean over any span is the ratio of two readings' deltas."""
        self._advance()
        return self._area, self._seconds


class EnvPool:
    """Env instances made on demand per (env id, kwargs) and reused across episodes."""

    def __init__(self, env_id: str, kwargs: dict[str, Any]) -> None:
        self.env_id, self.kwargs = env_id, kwargs
        self._free: dict[str, list[Any]] = {}
        self._all: list[Any] = []
        envs.spec(env_id)  # fail fast with the registry's "did you mean" message

    @staticmethod
    def _key(env_id: str, kwargs: dict[str, Any]) -> str:
        return env_id + json.dumps(kwargs, sort_keys=True, default=str)

    def acquire(self, env_id: str | None = None, kwargs: dict[str, Any] | None = None) -> Any:
        env_id, kwargs = env_id or self.env_id, self.kwargs if kwargs is None else kwargs
        free = self._free.setdefault(self._key(env_id, kwargs), [])
        if free:
            return free.pop()
        env = envs.make(env_id, **kwargs)
        env._agentflow_pool_key = self._key(env_id, kwargs)
        self._all.append(env)
        return env

    def release(self, env: Any) -> None:
        self._free.setdefault(env._agentflow_pool_key, []).append(env)

    def discard(self, env: Any) -> None:
        """Forget an env that must not be reused; it is closed in a daemon thread (its close may hang as well)."""
        if env in self._all:
            self._all.remove(env)
        threading.Thread(target=env.close, daemon=True, name="env-discard").start()

    def close(self) -> None:
        for env in self._all:
            env.close()
        self._all.clear()
        self._free.clear()


@dataclass(frozen=True)
class EnvTimeouts:
    """How long one env reset and one env step (a tool call, or an answer and its verifier) may take."""

    reset_s: float = 300.0
    step_s: float = 300.0


class EnvTimeoutError(RuntimeError):
    """An env call outlived its timeout; the episode ends ``error`` with this reason and the env is not reused."""


class TimedEnv:
    """An env whose ``areset``/``astep`` give up after their timeouts; everything else is the env's own."""

    def __init__(self, env: Any, timeouts: EnvTimeouts) -> None:
        self.env, self.timeouts = env, timeouts
        self.timed_out: str | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.env, name)

    async def areset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        call = self.env.areset(seed=seed, options=options)
        return await self._within(call, self.timeouts.reset_s, "reset", "rollout.reset_timeout_s")

    async def astep(self, action: str) -> Any:
        return await self._within(self.env.astep(action), self.timeouts.step_s, "step", "rollout.step_timeout_s")

    async def _within(self, call: Any, limit: float, what: str, key: str) -> Any:
        try:
            return await asyncio.wait_for(call, limit)
        except TimeoutError:
            self.timed_out = f"env {what} took longer than {limit:g} s ({key})"
            raise EnvTimeoutError(self.timed_out) from None


class EpisodeSlots:
    """The episode concurrency limit (``rollout.max_concurrency``), counting the episodes waiting for a slot."""

    def __init__(self, n: int) -> None:
        self._sem = asyncio.Semaphore(n)
        self.size = n
        self.held = LevelTracker()  # episodes holding a slot: how full rollouts kept the engines
        self.waiting = 0
        self._drained = asyncio.Event()
        self._drained.set()
        self._open = asyncio.Event()
        self._open.set()

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self.release()

    async def acquire(self, holdable: bool = False) -> None:
        """Take a slot. ``holdable``: an RL rollout's episode, which waits out a :meth:`hold`."""
        self.waiting += 1
        self._drained.clear()
        try:
            while True:
                if holdable:
                    await self._open.wait()
                await self._sem.acquire()
                if not holdable or self._open.is_set():
                    break
                self._sem.release()  # the hold began while it waited: the slot goes to an episode not held
        finally:
            self.waiting -= 1
            if not self.waiting:
                self._drained.set()
        self.held.add(1)

    def release(self) -> None:
        self.held.add(-1)
        self._sem.release()

    @contextlib.asynccontextmanager
    async def slot(self, holdable: bool = False) -> AsyncIterator[None]:
        """One slot for the block (see :meth:`acquire`)."""
        await self.acquire(holdable)
        try:
            yield
        finally:
            self.release()

    def hold(self, on: bool) -> None:
        """Stop (``on``) or let go the holdable episodes waiting for a slot, so that the slots that free go to the
        others (an in-loop evaluation's); episodes holding a slot run on. An evaluation that pauses RL rollouts holds
        them, or the groups dispatched before it would go on generating beside it."""
        if on:
            self._open.clear()
        else:
            self._open.set()

    def occupancy(self) -> float:
        """The mean share of the slots that episodes held while counting: below 1 while the engines could have run
        more episodes than were started (the store's window held dispatch back, or too few groups were wanted)."""
        return self.held.mean() / max(self.size, 1)

    def usage(self) -> tuple[float, float]:
        """(slot-seconds held / slots, seconds counted) so far (:class:`agentflow.store.SlotUsage`)."""
        area, seconds = self.held.totals()
        return area / max(self.size, 1), seconds

    async def drained(self) -> None:
        """Return once no episode waits for a slot."""
        await self._drained.wait()


class Rollouts:
    """Plays episodes against one engine; dispatches RL groups into a store."""

    def __init__(
        self,
        engine: InferenceEngine,
        tokenizer: ChatTokenizer,
        pool: EnvProvider,
        max_len: int,
        max_concurrency: int,
        agent: BaseAgent | None = None,
        retries: int = 2,
        timeouts: EnvTimeouts | None = None,
        tree: TreeSpec | None = None,
    ) -> None:
        self.engine, self.tokenizer, self.pool, self.max_len = engine, tokenizer, pool, max_len
        self.limit = EpisodeSlots(max_concurrency)
        self.engine_busy = BusyTracker()
        self.episodes = 0
        self.agent = agent or WhiteBoxAgent()  # started by the job (agents.BaseAgent.start)
        self.retries = retries
        """Replays of an episode whose engine or env worker died under it (a restarted worker serves the replay)."""
        self.retried: dict[str, int] = {"engine": 0, "env_worker": 0}
        self.retried_ids: list[str] = []
        self.lost_for_good = 0
        self.timeouts = timeouts or EnvTimeouts()
        self.timed_out: list[str] = []
        """Why each timed-out episode ended (its env was discarded, not reused)."""
        self.tree = tree
        self.branches = 0
        """Branches played (``rollout.tree``)."""

    async def episode(self, spec: EpisodeSpec, sampling: SamplingParams, rl: bool = False) -> Trajectory:
        """One episode, retried where an engine or env worker died under it. ``rl``: of an RL group (it waits out an
        evaluation that pauses RL rollouts, see :meth:`EpisodeSlots.hold`)."""
        for attempt in range(self.retries + 1):
            traj, lost = await self._episode_once(spec, sampling, rl)
            if lost is None:
                return traj
            if attempt == self.retries:  # still failing: it stays an error trajectory, never a reward of 0
                self.lost_for_good += 1
                traj.info["lost_to"] = lost
                return traj
            self.retried[lost] += 1
            self.retried_ids.append(spec.traj_id)
            # a restarting engine or worker refuses calls until it is back: replaying at once would burn the retries
            await asyncio.sleep(min(2.0**attempt, 8.0))
        raise AssertionError("unreachable")

    async def _episode_once(
        self, spec: EpisodeSpec, sampling: SamplingParams, rl: bool
    ) -> tuple[Trajectory, str | None]:
        """One try; the second value names the part that died under it (``engine``, ``env_worker``) or is None."""
        async with self.limit.slot(holdable=rl):
            env = self.pool.acquire(spec.env_id, spec.env_kwargs)
            timed = TimedEnv(env, self.timeouts)
            self.engine_busy.enter()
            try:
                episode = Episode(spec, timed, self.engine, self.tokenizer, sampling, self.max_len)
                traj = await self.agent.run(episode)
            finally:
                self.engine_busy.exit()
                if timed.timed_out is None:
                    self.pool.release(env)
                else:  # its call may still be running in an abandoned thread: never hand this env out again
                    self.pool.discard(env)
            if timed.timed_out is not None:
                self.timed_out.append(f"{spec.traj_id}: {timed.timed_out}")
            self.episodes += 1
        if isinstance(self.engine, SupervisedEngine) and traj.id in self.engine.lost:  # its engine died under it
            self.engine.lost.discard(traj.id)
            return traj, "engine"
        return traj, ("env_worker" if getattr(env, "lost", False) else None)

    async def play_group(self, group_id: str, draw: Draw, n: int, sampling: SamplingParams) -> Group:
        specs = [
            EpisodeSpec(
                f"{group_id}-{i}",
                group_id,
                draw.seed,
                draw.split,
                data_source=draw.source.name,
                env_id=draw.source.env_id,
                options=draw.reset_options(),
                tags=draw.tags,
                env_kwargs=dict(draw.source.env_kwargs),
            )
            for i in range(n)
        ]
        version = self.engine.weight_version
        trajs = list(await asyncio.gather(*(self.episode(s, sampling, rl=True) for s in specs)))
        if self.tree is not None and self.tree.branches:
            points = branch_points(trajs, self.tree, draw.task_seed)
            trajs += await asyncio.gather(
                *(self.branch(replace(specs[0], traj_id=f"{group_id}-b{j}"), root, k, sampling)
                  for j, (root, k) in enumerate(points))
            )  # fmt: skip
        return Group(id=group_id, task_seed=draw.task_seed, trajectories=trajs, dispatch_version=version)

    async def branch(self, spec: EpisodeSpec, root: Trajectory, at_turn: int, sampling: SamplingParams) -> Trajectory:
        """One branch of ``root`` from its turn ``at_turn`` (white-box loop; an env of the pool)."""
        async with self.limit.slot(holdable=True):
            env = self.pool.acquire(spec.env_id, spec.env_kwargs)
            timed = TimedEnv(env, self.timeouts)
            self.engine_busy.enter()
            try:
                traj = await run_branch(self.engine, self.tokenizer, timed, spec, sampling, self.max_len, root, at_turn)
            finally:
                self.engine_busy.exit()
                if timed.timed_out is None:
                    self.pool.release(env)
                else:
                    self.pool.discard(env)
            self.episodes += 1
            self.branches += 1
        return traj

    async def feed(
        self, store: TrajectoryStore, group_size: int, sampling: SamplingParams, data: DataMixture, first: int = 0
    ) -> None:
        """Dispatch groups forever (cancel to stop): each waits for a window slot, then plays and is accepted.

        ``first``: index of the first group (a resumed run continues after the journal's last group). With replay
        (``store.pool``) a group is dispatched only once no episode waits for a concurrency slot: a group admitted
        earlier would only queue, and the versions it ages while queued and finished-but-waiting are the room
        replay needs within the staleness bound.
        """
        tasks: set[asyncio.Task] = set()
        index = first
        store.watch_slots(self.limit)  # how full the slots are tells the replay schedule what the window holds back
        try:
            while True:
                gid = f"g{index}"
                if store.pool is not None:
                    await self.limit.drained()
                await store.acquire_slot(gid)
                task = asyncio.create_task(self._play_and_accept(store, gid, data.draw(index), group_size, sampling))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                index += 1
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _play_and_accept(self, store, gid, draw, n, sampling) -> None:
        try:
            group = await self.play_group(gid, draw, n, sampling)
        except BaseException:
            await store.fail(gid)
            raise
        await store.accept(group)


def outcomes(trajs: Iterable[Trajectory]) -> list[tuple[str, bool]]:
    """(task type, success) of each trajectory."""
    return [(str(t.info.get("task_type")), bool(t.info.get("success"))) for t in trajs]


def per_type_success(results: Iterable[tuple[str, bool]]) -> dict[str, float]:
    """Success rate per task type from (task type, success) pairs, sorted by type."""
    by_type: dict[str, list[bool]] = {}
    for task_type, ok in results:
        by_type.setdefault(task_type, []).append(ok)
    return {k: sum(v) / len(v) for k, v in sorted(by_type.items())}


def success_summary(trajs: list[Trajectory]) -> dict[str, Any]:
    """Overall and per-task-type success; errors are counted (with the first one's reason), not scored."""
    n = len(trajs)
    return {
        "success": sum(bool(t.info.get("success")) for t in trajs) / n if n else 0.0,
        "episodes": n,
        "errors": sum(t.status == "error" for t in trajs),
        "first_error": first_error(trajs),
        "per_type": per_type_success(outcomes(trajs)),
        "lengths": episode_lengths(trajs),
    }


def episode_lengths(trajs: Iterable[Trajectory]) -> dict[str, list[Any]]:
    """Per episode (errors left out): turns, context tokens (its longest segment: what the engine held at the end),
    wall seconds and success; :func:`episode_shape` summarises them."""
    played = [t for t in trajs if t.status != "error"]
    return {
        "turns": [len(t.turns) for t in played],
        "context_tokens": [max((len(s.token_ids) for s in t.segments), default=0) for t in played],
        "episode_s": [round(t.timings.get("episode_s", 0.0), 4) for t in played],
        "success": [bool(t.info.get("success")) for t in played],
    }


def _nearest_rank(values: list[float], q: float) -> float | None:
    """The ``q`` quantile by nearest rank (a value that occurred); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def episode_shape(lengths: dict[str, list[Any]]) -> dict[str, float | None]:
    """How long episodes were: median turns of the successful ones, p90 turns and context tokens, and the tail of
    episode wall time (p90 over median: how unevenly episodes finish, what rollout scheduling contends with)."""
    ok_turns = [n for n, ok in zip(lengths["turns"], lengths["success"], strict=True) if ok]
    median_s, p90_s = _nearest_rank(lengths["episode_s"], 0.5), _nearest_rank(lengths["episode_s"], 0.9)
    return {
        "median_turns_success": _nearest_rank(ok_turns, 0.5),
        "median_turns": _nearest_rank(lengths["turns"], 0.5),
        "p90_turns": _nearest_rank(lengths["turns"], 0.9),
        "max_turns": max(lengths["turns"], default=None),
        "median_context_tokens": _nearest_rank(lengths["context_tokens"], 0.5),
        "p90_context_tokens": _nearest_rank(lengths["context_tokens"], 0.9),
        "median_episode_s": median_s,
        "p90_episode_s": p90_s,
        "p90_over_median_episode_s": p90_s / median_s if median_s and p90_s is not None else None,
    }


def first_error(trajs: Iterable[Trajectory]) -> str | None:
    """The first error trajectory's reason, its first line only (an agent's traceback follows on later lines)."""
    for t in trajs:
        if t.status == "error":
            lines = (t.error or "").strip().splitlines()
            return f"{t.id}: {lines[0][:300] if lines else 'no reason given'}"
    return None
