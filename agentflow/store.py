"""Sliding-window trajectory store: bounds how stale a trained trajectory may be, journals what it accepts.

Window: at most ``C = B * (1 + stale_steps)`` groups may be dispatched-or-finished-but-untrained at once, and the
n-th live-or-trained group (counting from 0 over the run) may start only once the trainer is at version
``v >= n // B - stale_steps`` (the version gate). A plain capacity cap is not enough: groups dispatched while the
trainer steps still sample from the old version and are trained two versions later. Which finished groups make a
batch is the ``collect`` strategy (``fifo`` or ``first_finished``, see :class:`TrajectoryStore`). A group whose
staleness would exceed the bound when collected is not trained; it stays in the journal and is counted in
``dropped_stale``.

Staleness of a trajectory trained at trainer version ``t`` is ``t - (its oldest token version)`` (docs/architecture.md).
Episode length, for the length-bias accounting, is the number of model-generated tokens of a trajectory.

With replay (:mod:`agentflow.replay`) a batch is ``f`` fresh groups plus ``B - f`` trained-before ones, so the gate
counts fresh groups: the n-th may start while ``n < F + f_t + stale_steps * f_plan``, where ``F`` is the fresh groups
trained by the versions before the trainer's current one ``t``, ``f_t`` the fresh groups of version ``t``'s batch and
``f_plan`` the fewest fresh groups a later batch takes. With ``f = B`` (no replay) that is the gate above. With
replay, dispatch also waits until no episode queues for a concurrency slot (:meth:`agentflow.rollout.Rollouts.feed`).
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from agentflow.replay import ReplayPool, ReplayScheduler, Schedule
from agentflow.types import NO_VERSION, Group, Trajectory


class FutureVersionError(RuntimeError):
    """A trajectory carries a weight version the trainer has not reached (negative staleness)."""


class Journal:
    """Append-only, fsync'd JSONL of accepted trajectories (one line each)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.cut_bytes = _cut_torn_tail(self.path)
        """Bytes of a torn last line (a write a crash cut short, never acknowledged) removed before appending."""
        self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open for the run

    def append(self, trajectories: list[Trajectory]) -> None:
        # one write per group: a crash leaves at most one torn last line, which ``read`` drops
        self._f.write("".join(t.to_json() + "\n" for t in trajectories))
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()

    @staticmethod
    def read(path: str | Path) -> list[Trajectory]:
        p = Path(path)
        if not p.exists():
            return []
        out = []
        lines = p.read_text(encoding="utf-8").split("\n")
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                out.append(Trajectory.from_json(line))
            except ValueError as e:
                if i == len(lines) - 1:  # no newline yet: the write was cut by a crash, never acknowledged
                    break
                raise ValueError(f"{p}: line {i + 1} is not a trajectory: {e}") from e
        return out


def _cut_torn_tail(path: Path) -> int:
    """Truncate ``path`` after its last newline, so the next record starts on a line of its own; bytes removed."""
    if not path.is_file():
        return 0
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        keep, step = size, 1 << 16
        while keep > 0:  # scan back from the end for the last newline
            start = max(0, keep - step)
            f.seek(start)
            chunk = f.read(keep - start)
            nl = chunk.rfind(b"\n")
            if nl >= 0:
                keep = start + nl + 1
                break
            keep = start
        if keep < size:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
        return size - keep


Collect = Literal["fifo", "first_finished"]


@dataclass(eq=False)  # compared by identity: picks are tested with ``in``
class _Slot:
    """One dispatched, not yet trained group: in flight while ``group`` is None."""

    order: int  # dispatch order
    version: int  # trainer version at dispatch: a lower bound on its token versions (the engine is never behind)
    group: Group | None = None
    finished: int = -1  # finish (accept) order
    min_version: int = 0  # of the finished group's tokens

    def deadline(self, stale_steps: int) -> int:
        """The last trainer version at which this group is still within the staleness bound."""
        return (self.min_version if self.group is not None else self.version) + stale_steps


def _groups(slots: list[_Slot]) -> list[Group]:
    """The groups of finished slots."""
    out = []
    for s in slots:
        assert s.group is not None, "a slot still in flight was collected"
        out.append(s.group)
    return out


@dataclass
class _Lengths:
    """Running sum and count of episode lengths (model tokens per trajectory)."""

    tokens: int = 0
    n: int = 0

    def add(self, group: Group) -> None:
        self.tokens += sum(t.num_model_tokens() for t in group.trajectories)
        self.n += len(group.trajectories)

    def mean(self) -> float:
        return self.tokens / self.n if self.n else 0.0


class TrajectoryStore:
    """Groups in flight and finished, the staleness window, the batch choice, and the metrics about them.

    ``collect="fifo"``: a batch is the ``B`` oldest-dispatched groups, waiting for all of them. The n-th group is
    trained at version ``n // B`` (the gate makes that within the bound) and every dispatched group is trained in
    dispatch order, so training sees episode lengths exactly as they were sampled; the price is that the trainer waits
    for the slowest episode of each batch.

    ``collect="first_finished"``: a batch is the ``B`` earliest-finished groups in the window, so the trainer waits
    for the B-th fastest instead. Long episodes finish late; while they run the trainer moves on, and one that finishes
    more than ``stale_steps`` versions after it started is dropped. Dropping is length-biased (long episodes are the
    late ones), so the trained mix skews short: ``length_bias`` in :meth:`metrics` measures it.

    ``length_aware`` (``first_finished`` only) removes that drop mechanism with deadline-aware selection. Every live
    group has a deadline: the last trainer version at which it is within the bound (its oldest token version, or while
    in flight the version it was dispatched at, plus ``stale_steps``). At version ``t`` the batches ``t .. j`` hold
    ``(j - t + 1) * B`` groups, so this batch must take at least ``r_j = #{deadline <= j} - (j - t) * B`` groups with a
    deadline ``<= j``, for every ``j``; the earliest-finished groups fill what is left. When a required group is still
    running the trainer waits for it, exactly as ``fifo`` waits for its head. This is earliest-deadline feasibility:
    with the capacity cap (``C = (1 + stale_steps) * B`` live groups, and later dispatches have later deadlines) the
    requirements never exceed ``B``, so no group is dropped for being slow, while short groups still jump ahead
    whenever there is slack. Why not length buckets with debts: they reweight which short or long group is taken but
    cannot stop a long group from passing its deadline, which is the actual source of the bias.
    """

    def __init__(
        self,
        batch_groups: int,
        stale_steps: int,
        journal: Journal | None = None,
        collect: Collect = "fifo",
        length_aware: bool = True,
        replay: ReplaySpec | None = None,
    ) -> None:
        if collect not in ("fifo", "first_finished"):
            raise ValueError(f"collect must be 'fifo' or 'first_finished', got {collect!r}")
        self.batch_groups = batch_groups
        self.stale_steps = stale_steps
        self.capacity = batch_groups * (1 + stale_steps)
        self.journal = journal
        self.collect = collect
        self.length_aware = length_aware
        self.trainer_version = 0
        self._live: dict[str, _Slot] = {}  # dispatched, not yet trained (in flight or finished)
        self._order = 0
        self._finished = 0
        # live-or-trained groups this run (the n of the gate); failed and dropped groups give theirs back, else each
        # one would shrink the window for good and enough of them would stop dispatch altogether
        self._dispatched = 0
        self._gate_open = True
        self._cond = asyncio.Condition()
        self.staleness_hist: Counter[int] = Counter()
        self.dropped_stale = 0
        self.gate_closures = 0  # times dispatch was stopped for a batch (sync mode only; async never closes it)
        self.failed_groups = 0
        self.accepted = 0
        self.generated_tokens = 0
        """Model tokens of the accepted trajectories (a branch counts only what it generated itself)."""
        self.finished_len = _Lengths()  # every accepted trajectory, trained, dropped or pending
        self.trained_len = _Lengths()
        self.dropped_len = _Lengths()
        self.last_batch_len = _Lengths()
        self.fresh_taken = 0  # fresh groups taken for training (B per batch without replay)
        self._fresh_before = 0  # of those, the ones taken before the current trainer version's batch
        self.pool: ReplayPool | None = None
        self.scheduler: ReplayScheduler | None = None
        if replay is not None and replay.max_reuse > 0:
            bound = stale_steps if replay.stale_steps is None else replay.stale_steps
            if bound > stale_steps:
                raise ValueError(f"store.replay.stale_steps={bound} is above the store's staleness bound {stale_steps}")
            self.pool = ReplayPool(replay.max_reuse, bound, replay.skip_uniform)
            self.scheduler = ReplayScheduler(batch_groups, replay.ratio, replay.schedule)
        self.last_replayed: set[str] = set()
        """Group ids of the last batch that were replays (trained before)."""
        self._slots: SlotUsage | None = None

    @property
    def strategy(self) -> str:
        """The collection strategy in words: ``fifo``, ``first_finished`` or ``first_finished+length_aware``."""
        return self.collect + ("+length_aware" if self.collect != "fifo" and self.length_aware else "")

    # -- dispatch side ------------------------------------------------------------------------------------------
    def occupancy(self) -> int:
        return len(self._live)

    async def acquire_slot(self, group_id: str) -> None:
        """Wait until the window (and the gate) admit one more group, then count it as dispatched."""
        async with self._cond:
            await self._cond.wait_for(self._admits_one_more)
            self._live[group_id] = _Slot(self._order, self.trainer_version)
            self._order += 1
            self._dispatched += 1

    def _admits_one_more(self) -> bool:
        ahead = self._dispatched < self._window_end()
        return self._gate_open and ahead and self.occupancy() < self.capacity

    def _window_end(self) -> int:
        """The gate: groups dispatched (live or trained) may not reach this count (see the module docstring)."""
        if self.pool is None:
            return (self.trainer_version + self.stale_steps + 1) * self.batch_groups
        this_batch = self.fresh_taken - self._fresh_before or self._fresh_next()  # taken already, or still to take
        return self._fresh_before + this_batch + self.stale_steps * self._fresh_plan()

    def _fresh_plan(self) -> int:
        return self.batch_groups if self.scheduler is None else self.scheduler.fresh_plan

    def _fresh_next(self) -> int:
        """Fresh groups the next batch needs: all ``B`` but what the pool can replay at the current version."""
        if self.pool is None or self.scheduler is None:
            return self.batch_groups
        k = min(self.batch_groups - self.scheduler.fresh_plan, len(self.pool.eligible(self.trainer_version)))
        return self.batch_groups - k

    def watch_slots(self, slots: SlotUsage) -> None:
        """The concurrency slots that this store's groups are played in: the adaptive replay schedule reads how full
        they were between batches (see :meth:`ReplayScheduler.on_request`)."""
        self._slots = slots

    def pause_step_clock(self, seconds: float, generation: float = 0.0) -> None:
        """``seconds`` since the last batch were periodic work, not this step's cost, and in ``generation`` of them
        no new group could start (see :meth:`ReplayScheduler.on_pause`)."""
        if self.scheduler is not None:
            self.scheduler.on_pause(seconds, generation)

    async def set_gate(self, open_: bool) -> None:
        """Close to stop new dispatch (sync mode closes it while training and syncing weights)."""
        async with self._cond:
            self._gate_open = open_
            self._cond.notify_all()

    async def accept(self, group: Group) -> None:
        """A finished group: journal it, then make it collectable."""
        if self.journal is not None:
            self.journal.append(group.trajectories)
        # no await between journaling and making it collectable: a cancelled feeder cannot strand a journaled group
        self._finish(self._live[group.id], group)
        self.accepted += len(group.trajectories)
        self.generated_tokens += sum(t.num_model_tokens() for t in group.trajectories)
        if self.scheduler is not None:
            self.scheduler.on_accept()
        async with self._cond:
            self._cond.notify_all()

    def _finish(self, slot: _Slot, group: Group) -> None:
        slot.group, slot.finished, slot.min_version = group, self._finished, group.min_version()
        self._finished += 1
        self.finished_len.add(group)

    async def fail(self, group_id: str) -> None:
        """A group that could not finish frees its slot."""
        async with self._cond:
            if self._live.pop(group_id, None) is not None:
                self._dispatched -= 1
            self.failed_groups += 1
            self._cond.notify_all()

    def restore(
        self,
        groups: list[Group],
        trainer_version: int = 0,
        fresh_taken: int | None = None,
        replayable: list[tuple[Group, int]] | None = None,
    ) -> None:
        """Resume: the trainer is at ``trainer_version`` having trained ``fresh_taken`` fresh groups (``B`` per version
        without replay) and ``groups`` are the journaled, untrained groups in dispatch order; ``fifo`` collects them
        first, before anything dispatched now. ``replayable``: the checkpoint's replay pool (group, replays so far).

        The window counts them as dispatched, so the next group is gated exactly as it would have been without the
        crash and restored groups keep their staleness bound (group ``n`` was sampled at a version
        ``>= n // B - stale_steps`` and is trained at ``n // B`` again). They count as finished for the length bias.
        """
        self.trainer_version = trainer_version
        self.fresh_taken = trainer_version * self.batch_groups if fresh_taken is None else fresh_taken
        self._fresh_before = self.fresh_taken
        self._dispatched = self.fresh_taken + len(groups)
        for g, replays in replayable or []:
            if self.pool is not None:
                self.pool.add(g, replays)
        for g in groups:
            slot = _Slot(self._order, trainer_version)
            self._order += 1
            self._live[g.id] = slot
            self._finish(slot, g)

    def pending_ids(self) -> list[str]:
        """Trajectory ids accepted (journaled) but not yet collected for training."""
        return [t.id for g in _groups(sorted(self._ready(), key=lambda s: s.order)) for t in g.trajectories]

    def _ready(self) -> list[_Slot]:
        return [s for s in self._live.values() if s.group is not None]

    # -- training side -------------------------------------------------------------------------------------------
    def staleness(self, group: Group) -> int:
        return self.trainer_version - group.min_version()

    async def get_batch(self, close_gate: bool = False) -> list[Group]:
        """Wait for ``B`` finished groups within the staleness bound, chosen by the ``collect`` strategy.

        ``close_gate`` closes the dispatch gate in the same critical section (sync mode: no group may start on the
        capacity this batch frees until the new weights are in the engine).
        """
        async with self._cond:
            want = self._plan_replays()
            while True:
                self._drop_too_stale()
                k = self._replays_now(want)
                batch = self._choose(self.batch_groups - k)
                if batch is not None:
                    break
                await self._cond.wait()
            replayed = self._take_replays(k, len(batch))
            self._refuse_future_versions(batch + replayed)
            self.last_batch_len = _Lengths()
            for g in batch:
                del self._live[g.id]
                self.trained_len.add(g)
                self.last_batch_len.add(g)
                for t in g.trajectories:
                    if t.min_version() != NO_VERSION:
                        self.staleness_hist[self.trainer_version - t.min_version()] += 1
                if self.pool is not None:
                    self.pool.add(g)
            self.fresh_taken += len(batch)
            if close_gate:
                self._gate_open = False
                self.gate_closures += 1
            self._cond.notify_all()
            return batch + replayed

    def _plan_replays(self) -> int:
        if self.scheduler is None:
            return 0
        usage = self._slots.usage() if self._slots is not None else None
        self.scheduler.on_request(asyncio.get_running_loop().time(), usage)
        eligible = len(self.pool.eligible(self.trainer_version)) if self.pool is not None else 0
        return self.scheduler.plan(ready=self._takeable(), eligible=eligible)

    def _takeable(self) -> int:
        """Finished groups a batch could take now: under ``fifo`` the finished run from the oldest dispatched one
        (others wait behind it), otherwise every finished one."""
        if self.collect != "fifo":
            return len(self._ready())
        n = 0
        for slot in sorted(self._live.values(), key=lambda s: s.order):
            if slot.group is None:
                break
            n += 1
        return n

    def _replays_now(self, want: int) -> int:
        return 0 if self.pool is None else min(want, len(self.pool.eligible(self.trainer_version)))

    def _take_replays(self, k: int, fresh: int) -> list[Group]:
        if self.pool is None or self.scheduler is None:
            return []
        replayed = self.pool.take(k, self.trainer_version)
        self.last_replayed = {g.id for g in replayed}
        self.scheduler.on_batch_out(asyncio.get_running_loop().time(), fresh + len(replayed))
        return replayed

    def _refuse_future_versions(self, batch: list[Group]) -> None:
        """A token newer than the trainer means an engine served weights this job never sent (a server left at a
        later version by another job): its staleness would be negative, and training on it is refused."""
        for g in batch:
            for t in g.trajectories:
                if t.max_version() > self.trainer_version:
                    raise FutureVersionError(
                        f"trajectory {t.id} has tokens of weight version {t.max_version()}, but the trainer is at "
                        f"version {self.trainer_version}: the engine serves weights this job did not send"
                    )

    def _choose(self, fresh: int) -> list[Group] | None:
        """``fresh`` finished groups for the next batch by the ``collect`` strategy, or None until they are there."""
        if self.collect == "fifo":
            return self._oldest_if_finished(fresh)
        ready = sorted(self._ready(), key=lambda s: s.finished)
        picks = self._due_picks(ready, fresh) if self.length_aware else []
        if picks is None:
            return None
        picks += [s for s in ready if s not in picks][: fresh - len(picks)]
        return _groups(picks) if len(picks) == fresh else None

    def _oldest_if_finished(self, fresh: int) -> list[Group] | None:
        """The ``fresh`` oldest-dispatched groups when all of them have finished (FIFO collection), else None.

        Strict FIFO is what makes the window a staleness bound: a group admitted while fewer than ``C`` groups were
        ahead of it is trained within ``1 + stale_steps`` batches, so nothing has to be dropped.
        """
        head = sorted(self._live.values(), key=lambda s: s.order)[:fresh]
        if len(head) < fresh or any(s.group is None for s in head):
            return None
        return _groups(head)

    def _due_picks(self, ready: list[_Slot], fresh: int) -> list[_Slot] | None:
        """The finished groups this batch must take so that no live group misses its deadline (earliest finished
        first among those that qualify), or None while a required group is still running.

        Requirements are capped at ``B``: more can only happen when the bound was already broken (a resumed run, an
        engine behind the trainer), and then the earliest deadlines go first and the rest are dropped as stale.
        """
        t, b, s, plan = self.trainer_version, fresh, self.stale_steps, self._fresh_plan()
        # an in-flight group already past its deadline will be dropped when it finishes: waiting for it helps nobody
        deadlines = sorted(d for d in (x.deadline(s) for x in self._live.values()) if d >= t)
        picks: list[_Slot] = []
        for i, j in enumerate(deadlines):
            if i + 1 < len(deadlines) and deadlines[i + 1] == j:
                continue  # count all groups with this deadline first
            need = min(b, i + 1 - (j - t) * plan)
            have = sum(1 for p in picks if p.deadline(s) <= j)
            for x in ready:
                if have >= need:
                    break
                if x not in picks and x.deadline(s) <= j:
                    picks.append(x)
                    have += 1
            if have < need:
                return None
        return picks

    def _drop_too_stale(self) -> None:
        for gid, slot in list(self._live.items()):
            if slot.group is not None and self.staleness(slot.group) > self.stale_steps:
                del self._live[gid]
                self._dispatched -= 1  # gives its place in the gate back (see __init__)
                self.dropped_stale += 1
                self.dropped_len.add(slot.group)

    async def set_trainer_version(self, version: int) -> None:
        async with self._cond:
            self.trainer_version = version
            self._fresh_before = self.fresh_taken
            if self.pool is not None:
                self.pool.expire(version)
            self._cond.notify_all()

    def replay_state(self) -> dict[str, int]:
        """The replay pool for a checkpoint: group id -> replays so far (empty without replay)."""
        return {} if self.pool is None else self.pool.state()

    def metrics(self) -> dict[str, float]:
        """Staleness, window and length-bias numbers (logged every step, and the last ones go into summary.json).

        ``length_bias`` = mean episode length (model tokens) of the trajectories trained so far / that of every
        trajectory accepted so far (trained, dropped or still pending): 1.0 is unbiased, below 1 means training saw
        shorter episodes than were sampled. ``batch_length_bias`` is the same for the last batch alone.
        """
        n = sum(self.staleness_hist.values())
        mean = sum(k * v for k, v in self.staleness_hist.items()) / n if n else 0.0
        fin = self.finished_len.mean()
        ready = len(self._ready())
        replay: dict[str, float] = {}
        if self.pool is not None and self.scheduler is not None:
            share = len(self.last_replayed) / self.batch_groups
            replay = {"replay_share": share, **self.pool.metrics(), **self.scheduler.metrics()}
        seen = max(self.staleness_hist, default=0)
        return {
            **replay,
            "mean_staleness": mean,
            "max_staleness_seen": max(seen, self.pool.metrics()["replay_max_staleness"]) if self.pool else seen,
            "dropped_stale_groups": self.dropped_stale,
            "gate_closures": self.gate_closures,
            "failed_groups": self.failed_groups,
            "in_flight_groups": len(self._live) - ready,
            "ready_groups": ready,
            "accepted_trajectories": self.accepted,
            "generated_tokens": self.generated_tokens,
            "finished_len_mean": fin,
            "trained_len_mean": self.trained_len.mean(),
            "dropped_len_mean": self.dropped_len.mean(),
            "length_bias": self.trained_len.mean() / fin if self.trained_len.n and fin else 1.0,
            "batch_length_bias": self.last_batch_len.mean() / fin if self.last_batch_len.n and fin else 1.0,
        }

    def histogram(self) -> dict[str, int]:
        return {str(k): v for k, v in sorted(self.staleness_hist.items())}


class SlotUsage(Protocol):
    """The rollout concurrency slots, as the store reads them."""

    def usage(self) -> tuple[float, float]:
        """(mean share of the slots held x seconds, seconds) counted so far; both only grow until counting restarts."""
        ...


class ReplaySpec(Protocol):
    """What the store reads of the ``store.replay`` config section."""

    max_reuse: int
    ratio: float
    schedule: Schedule
    skip_uniform: bool
    stale_steps: int | None
