"""Sliding-window trajectory store: bounds how stale a trained trajectory may be, journals what it accepts.

Window (v1): at most ``C = B * (1 + stale_steps)`` groups may be dispatched-or-finished-but-untrained at once, and
the n-th group (counting from 0 over the run) may start only once the engine holds weight version
``v >= n // B - stale_steps``. Batches are collected strictly in dispatch order (FIFO), so the n-th group is trained
at trainer version ``n // B`` and its staleness is at most ``stale_steps``. (A plain capacity cap is not enough: groups
dispatched while the trainer steps still sample from the old version and are trained two versions later.) A group
whose staleness would still exceed the bound (after a resume, say) is not trained; it stays in the journal and is
counted in ``dropped_stale``.

Staleness of a trajectory trained at trainer version ``t`` is ``t - (its oldest token version)`` (DESIGN.md).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter
from pathlib import Path

from agentflow.types import NO_VERSION, Group, Trajectory


class Journal:
    """Append-only, fsync'd JSONL of accepted trajectories (one line each)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
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


class TrajectoryStore:
    """Groups in flight and finished, the staleness window, and the metrics about both."""

    def __init__(self, batch_groups: int, stale_steps: int, journal: Journal | None = None) -> None:
        self.batch_groups = batch_groups
        self.stale_steps = stale_steps
        self.capacity = batch_groups * (1 + stale_steps)
        self.journal = journal
        self.trainer_version = 0
        self._in_flight: dict[str, int] = {}  # group id -> dispatch order
        self._ready: dict[str, tuple[int, Group]] = {}
        self._order = 0
        self._dispatched = 0  # groups dispatched this run (the n of the window rule)
        self._gate_open = True
        self._cond = asyncio.Condition()
        self.staleness_hist: Counter[int] = Counter()
        self.dropped_stale = 0
        self.gate_closures = 0  # times dispatch was stopped for a batch (sync mode only; async never closes it)
        self.failed_groups = 0
        self.accepted = 0

    # -- dispatch side ------------------------------------------------------------------------------------------
    def occupancy(self) -> int:
        return len(self._in_flight) + len(self._ready)

    async def acquire_slot(self, group_id: str) -> None:
        """Wait until the window (and the gate) admit one more group, then count it as dispatched."""
        async with self._cond:
            await self._cond.wait_for(self._admits_one_more)
            self._in_flight[group_id] = self._order
            self._order += 1
            self._dispatched += 1

    def _admits_one_more(self) -> bool:
        ahead = self._dispatched < (self.trainer_version + self.stale_steps + 1) * self.batch_groups
        return self._gate_open and ahead and self.occupancy() < self.capacity

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
        order = self._in_flight.pop(group.id)
        self._ready[group.id] = (order, group)
        self.accepted += len(group.trajectories)
        async with self._cond:
            self._cond.notify_all()

    async def fail(self, group_id: str) -> None:
        """A group that could not finish frees its slot."""
        async with self._cond:
            self._in_flight.pop(group_id, None)
            self.failed_groups += 1
            self._cond.notify_all()

    def restore(self, groups: list[Group], trainer_version: int = 0) -> None:
        """Resume: the trainer is at ``trainer_version`` (each version consumed ``B`` groups) and ``groups`` are the
        journaled, untrained groups in dispatch order; they are collected first, before anything dispatched now.

        The window counts them as dispatched, so the next group is gated exactly as it would have been without the
        crash and restored groups keep their staleness bound (group ``n`` was sampled at a version
        ``>= n // B - stale_steps`` and is trained at ``n // B`` again).
        """
        self.trainer_version = trainer_version
        self._dispatched = trainer_version * self.batch_groups + len(groups)
        for g in groups:
            self._ready[g.id] = (self._order, g)
            self._order += 1

    def pending_ids(self) -> list[str]:
        """Trajectory ids accepted (journaled) but not yet collected for training."""
        return [t.id for _, g in sorted(self._ready.values(), key=lambda x: x[0]) for t in g.trajectories]

    # -- training side -------------------------------------------------------------------------------------------
    def staleness(self, group: Group) -> int:
        return self.trainer_version - group.min_version()

    async def get_batch(self, close_gate: bool = False) -> list[Group]:
        """Wait for ``B`` finished groups within the staleness bound, oldest dispatch first.

        ``close_gate`` closes the dispatch gate in the same critical section (sync mode: no group may start on the
        capacity this batch frees until the new weights are in the engine).
        """
        async with self._cond:
            while True:
                self._drop_too_stale()
                batch = self._oldest_if_finished()
                if batch is not None:
                    break
                await self._cond.wait()
            for g in batch:
                del self._ready[g.id]
                for t in g.trajectories:
                    if t.min_version() != NO_VERSION:
                        self.staleness_hist[self.trainer_version - t.min_version()] += 1
            if close_gate:
                self._gate_open = False
                self.gate_closures += 1
            self._cond.notify_all()
            return batch

    def _oldest_if_finished(self) -> list[Group] | None:
        """The ``B`` oldest-dispatched groups when all of them have finished (FIFO collection), else None.

        Strict FIFO is what makes the window a staleness bound: a group admitted while fewer than ``C`` groups were
        ahead of it is trained within ``1 + stale_steps`` batches, so nothing has to be dropped.
        """
        orders = sorted([(o, gid) for gid, o in self._in_flight.items()] + [(o, g.id) for o, g in self._ready.values()])
        head = orders[: self.batch_groups]
        if len(head) < self.batch_groups or any(gid not in self._ready for _, gid in head):
            return None
        return [self._ready[gid][1] for _, gid in head]

    def _drop_too_stale(self) -> None:
        for gid, (_, g) in list(self._ready.items()):
            if self.staleness(g) > self.stale_steps:
                del self._ready[gid]
                self.dropped_stale += 1

    async def set_trainer_version(self, version: int) -> None:
        async with self._cond:
            self.trainer_version = version
            self._cond.notify_all()

    def metrics(self) -> dict[str, float]:
        n = sum(self.staleness_hist.values())
        mean = sum(k * v for k, v in self.staleness_hist.items()) / n if n else 0.0
        return {
            "mean_staleness": mean,
            "max_staleness_seen": max(self.staleness_hist, default=0),
            "dropped_stale_groups": self.dropped_stale,
            "gate_closures": self.gate_closures,
            "failed_groups": self.failed_groups,
            "in_flight_groups": len(self._in_flight),
            "ready_groups": len(self._ready),
            "accepted_trajectories": self.accepted,
        }

    def histogram(self) -> dict[str, int]:
        return {str(k): v for k, v in sorted(self.staleness_hist.items())}


def dump_json(path: str | Path, obj: object) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=True))
