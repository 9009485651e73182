"""An elastic pool of engines that the job sees as one: members join and leave while the job runs.

Routing is sticky per trajectory (the part of a request id before ``:``): a trajectory's turns go to the member that
served its first turn, so its prefix cache is reused, and new trajectories go to the member with the fewest requests
in flight. Weight updates go to every member. A member that joins gets the newest weights before it serves anything,
so its first tokens carry the current version. A member that leaves is drained: it takes no new trajectory, its
requests in flight finish (their trajectories' next turns go to the remaining members, prefilled there again), and
only then is it closed; a drain that outlasts its timeout aborts what is left, and the rollout layer's partial-output
handling applies as at any abort.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentflow.types import GenerateResult, InferenceEngine, PauseMode, SamplingParams, ScoreResult

#: Trajectory routes remembered (least recently used forgotten first): far more than the episodes ever in flight.
ROUTES_KEPT = 100_000

MakeEngine = Callable[[int], InferenceEngine]
"""Builds member ``k`` (embedded engines locally, a Ray actor's handle under Ray)."""


@dataclass(eq=False)
class _Member:
    key: int
    engine: InferenceEngine
    inflight: dict[str, int] = field(default_factory=dict)  # request id -> count (the same id may repeat)
    draining: bool = False
    joined_at: int = 0  # the pool's weight version when it joined
    first_version: int | None = None  # the oldest weight version of its first answer's tokens
    assigned: int = 0  # trajectories routed to it so far (the tie-break between equally loaded members)

    def load(self) -> tuple[int, int]:
        return sum(self.inflight.values()), self.assigned


class EnginePool:
    """Several engines as one :class:`~agentflow.types.InferenceEngine`, resizable with :meth:`add` and
    :meth:`remove`."""

    def __init__(self, make: MakeEngine, n: int) -> None:
        if n < 1:
            raise ValueError(f"an engine pool needs at least one engine, got {n}")
        self._make = make
        self._members: dict[int, _Member] = {}
        self._routes: OrderedDict[str, int] = OrderedDict()  # trajectory id -> member key, most recent last
        self._next_key = 0
        self._latest: tuple[int, dict[str, Any]] | None = None  # the newest version, for members that join later
        self._version = 0
        self._lock = threading.Lock()  # updates (transport thread) against joins and leaves (the loop)
        self._told: dict[str, bool] = {}  # keep_cache_on_update / abort_on_update as set on the pool, for newcomers
        self.events: list[dict[str, Any]] = []
        """Joins and leaves: ``{"event": "add"|"remove", "member", "version", "engines", "t"}``."""
        for _ in range(n):
            self._admit(self._make(self._next_key))

    # -- membership ---------------------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Members taking new trajectories."""
        return sum(not m.draining for m in self._members.values())

    def _admit(self, engine: InferenceEngine) -> _Member:
        with self._lock:
            if self._latest is not None:  # before it serves: its first tokens carry the current version
                engine.update_weights(*self._latest)
            for name, value in self._told.items():
                setattr(engine, name, value)
            m = _Member(self._next_key, engine, joined_at=self._version)
            self._members[m.key] = m
            self._next_key += 1
        return m

    def add(self) -> int:
        """Start one more member with the newest weights; returns its key."""
        m = self._admit(self._make(self._next_key))
        self._log("add", m)
        return m.key

    async def remove(self, key: int | None = None, drain_timeout_s: float = 60.0) -> int:
        """Drain and close member ``key`` (default: the newest serving one); returns its key. The last serving
        member cannot leave."""
        serving = [k for k, m in self._members.items() if not m.draining]
        if len(serving) <= 1:
            raise RuntimeError("cannot remove the last serving engine of the pool")
        key = serving[-1] if key is None else key
        if key not in serving:
            raise KeyError(f"no serving engine {key} in the pool (serving: {serving})")
        m = self._members[key]
        m.draining = True
        deadline = time.monotonic() + drain_timeout_s
        while m.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for rid in list(m.inflight):  # past the timeout: finish them now with their partial output
            m.engine.abort(rid)
        while m.inflight:
            await asyncio.sleep(0.02)
        with self._lock:
            del self._members[key]
            self._routes = OrderedDict((t, k) for t, k in self._routes.items() if k != key)
        close = getattr(m.engine, "close", None)
        if close is not None:
            await asyncio.to_thread(close)
        self._log("remove", m)
        return key

    def _log(self, event: str, m: _Member) -> None:
        self.events.append({"event": event, "member": m.key, "version": self._version, "engines": self.size,
                            "t": time.monotonic(), "joined_at_version": m.joined_at,
                            "first_tokens_version": m.first_version})  # fmt: skip

    def members(self) -> dict[int, dict[str, Any]]:
        """Each member now: the version it joined at, that of its first tokens, requests in flight, draining."""
        return {k: {"joined_at_version": m.joined_at, "first_tokens_version": m.first_version,
                    "inflight": sum(m.inflight.values()), "draining": m.draining}
                for k, m in self._members.items()}  # fmt: skip

    # -- routing ------------------------------------------------------------------------------------------------
    def _route(self, rid: str | None) -> _Member:
        traj = (rid or "").split(":")[0]
        k = self._routes.get(traj)
        m = self._members.get(k) if k is not None else None
        if m is None or m.draining:
            m = min((x for x in self._members.values() if not x.draining), key=_Member.load)
            m.assigned += 1
        if traj:
            self._routes[traj] = m.key
            self._routes.move_to_end(traj)
            while len(self._routes) > ROUTES_KEPT:  # finished trajectories are never announced: forget the oldest
                self._routes.popitem(last=False)
        return m

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, rid: str | None = None, **kw: Any
    ) -> GenerateResult:
        m = self._route(rid)
        key = rid or f"_anon{id(input_ids)}"
        m.inflight[key] = m.inflight.get(key, 0) + 1
        try:
            result: GenerateResult = await m.engine.generate(input_ids, sampling, rid, **kw)
            if m.first_version is None and result.versions:
                m.first_version = min(result.versions)
            return result
        finally:
            m.inflight[key] -= 1
            if not m.inflight[key]:
                del m.inflight[key]

    def abort(self, rid: str) -> None:
        for m in list(self._members.values()):
            if rid in m.inflight:
                m.engine.abort(rid)

    def score(self, ids: list[int], start: int, top_k: int = 0) -> ScoreResult:
        m = min((x for x in self._members.values() if not x.draining), key=_Member.load)
        return m.engine.score(ids, start, top_k)

    # -- weights and control, on every member -------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self._version

    def update_weights(self, version: int, named_tensors: dict[str, Any]) -> None:
        """Apply a whole version on every member (each validates, all or nothing on its own)."""
        with self._lock:
            for m in list(self._members.values()):
                m.engine.update_weights(version, named_tensors)
                if not hasattr(m.engine, "keep_cache_on_update") and not self.keep_cache_on_update:
                    m.engine.flush_cache()  # a member that does not drop its own cache on an update
            self._latest = (version, dict(named_tensors))
            self._version = version

    def _each(self, call: str, *args: Any) -> list[Any]:
        return [getattr(m.engine, call)(*args) for m in list(self._members.values())]

    def pause(self, mode: PauseMode = "in_place") -> None:
        self._each("pause", mode)

    def resume(self) -> None:
        self._each("resume")

    def flush_cache(self) -> bool:
        return all(self._each("flush_cache"))

    def _get(self, name: str) -> bool:
        if name in self._told:
            return self._told[name]
        first = next(iter(self._members.values()), None)
        return bool(getattr(first.engine, name, False)) if first is not None else False

    def _set(self, name: str, value: bool) -> None:
        """Set a flag on every member and on members that join later. Members without ``keep_cache_on_update`` get
        their cache dropped after each update unless it is set (:meth:`update_weights`); a member without
        ``abort_on_update`` cannot recycle partial rollouts, which is refused rather than ignored."""
        lacking = [type(m.engine).__name__ for m in self._members.values() if not hasattr(m.engine, name)]
        if name == "abort_on_update" and value and lacking:
            raise ValueError(f"rollout.partial=recycle: engine {lacking[0]} cannot abort generations at an update")
        self._told[name] = value
        for m in self._members.values():
            if hasattr(m.engine, name):
                setattr(m.engine, name, value)

    @property
    def keep_cache_on_update(self) -> bool:
        return self._get("keep_cache_on_update")

    @keep_cache_on_update.setter
    def keep_cache_on_update(self, value: bool) -> None:
        self._set("keep_cache_on_update", value)

    @property
    def abort_on_update(self) -> bool:
        return self._get("abort_on_update")

    @abort_on_update.setter
    def abort_on_update(self, value: bool) -> None:
        self._set("abort_on_update", value)

    # -- supervised members (Ray actors): what the rollout layer and the fault report read ----------------------
    @property
    def lost(self) -> _Lost:
        """Trajectory ids whose engine died under them, over every member that reports them."""
        return _Lost([m.engine for m in self._members.values()])

    @property
    def restarts(self) -> int:
        return sum(int(getattr(m.engine, "restarts", 0)) for m in self._members.values())

    def pids(self) -> list[int]:
        return [p for m in self._members.values() if hasattr(m.engine, "pids") for p in m.engine.pids()]

    def close(self) -> None:
        for m in list(self._members.values()):
            close = getattr(m.engine, "close", None)
            if close is not None:
                close()
        self._members.clear()


class _Lost:
    """The members' ``lost`` sets seen as one (membership and discard are all the rollout layer uses)."""

    def __init__(self, engines: list[Any]) -> None:
        self._sets = [e.lost for e in engines if isinstance(getattr(e, "lost", None), set)]

    def __contains__(self, traj_id: object) -> bool:
        return any(traj_id in s for s in self._sets)

    def discard(self, traj_id: str) -> None:
        for s in self._sets:
            s.discard(traj_id)
