"""Bounded replay: trained groups trained again while every one of their tokens stays within the staleness bound.

A batch of ``B`` groups is ``B - k`` fresh groups (never trained) plus ``k`` replayed ones (trained before). A group
enters the :class:`ReplayPool` when it is first trained and may be replayed up to ``max_reuse`` times, but only at
trainer versions ``t`` with ``t - (its oldest token version) <= stale_steps``: the store's bound holds for replayed
tokens exactly as for fresh ones, and the trainer's off-policy correction (the importance ratio to the sampling
log-probs recorded with every token) applies to them unchanged. Groups whose rewards are all equal are not kept:
under group-relative advantages they contribute no policy gradient, so replaying one spends a batch slot on nothing.

How many of a batch are replayed is the :class:`ReplayScheduler`'s choice: ``fixed`` takes ``round(ratio * B)``
whenever that many are eligible; ``adaptive`` measures the rate at which fresh groups finish and the trainer's cost
per group, and replays only what generation cannot supply while one batch trains (never more than
``round(ratio * B)``). Either way a batch keeps at least one fresh group, so the job always moves on to new data, and
the pool replays the groups nearest their bound first.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from agentflow.types import NO_VERSION, Group, Trajectory

Schedule = Literal["fixed", "adaptive"]


def uniform_rewards(trajectories: Iterable[Trajectory]) -> bool:
    """True when the scored ones of ``trajectories`` all have the same reward (or none is scored): under
    group-relative advantages a group like that has no policy gradient, and a batch like that none under any."""
    rewards = {t.reward for t in trajectories if t.status in ("ok", "truncated") and t.reward is not None}
    return len(rewards) <= 1


@dataclass(eq=False)
class _Entry:
    group: Group
    min_version: int
    replays: int = 0  # times trained again so far (the first training is not counted)


class ReplayPool:
    """Trained groups that may be trained again: at most ``max_reuse`` more times, each within the staleness bound."""

    def __init__(self, max_reuse: int, stale_steps: int, skip_uniform: bool = True) -> None:
        self.max_reuse = max_reuse
        self.stale_steps = stale_steps
        self.skip_uniform = skip_uniform
        self._entries: dict[str, _Entry] = {}
        self.replayed_groups = 0
        self.expired = 0  # left the pool because their tokens passed the bound before their reuses ran out
        self.skipped_uniform = 0
        self.staleness_hist: Counter[int] = Counter()  # of replayed trajectories, at the version they were replayed
        self.trainings_hist: Counter[int] = Counter()  # times trained in all, of every group that left the pool
        self.last_replayed: list[str] = []

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, group: Group, replays: int = 0) -> None:
        """A group just trained (``replays`` > 0: restored on resume with the replays it already had)."""
        if self.max_reuse <= 0 or replays >= self.max_reuse or group.min_version() == NO_VERSION:
            self.trainings_hist[1 + replays] += 1
            return
        if self.skip_uniform and uniform_rewards(group.trajectories):
            self.skipped_uniform += 1
            self.trainings_hist[1 + replays] += 1
            return
        self._entries[group.id] = _Entry(group, group.min_version(), replays)

    def eligible(self, trainer_version: int) -> list[_Entry]:
        """Entries that may be trained at ``trainer_version``: nearest to the bound first (they expire first, and a
        replay not taken before then is lost), then fewest replays."""
        ok = [e for e in self._entries.values() if trainer_version - e.min_version <= self.stale_steps]
        return sorted(ok, key=lambda e: (e.min_version, e.replays))

    def take(self, k: int, trainer_version: int) -> list[Group]:
        """Up to ``k`` eligible groups for the batch trained at ``trainer_version``; their reuse is counted."""
        picks = self.eligible(trainer_version)[:k]
        for e in picks:
            staleness = trainer_version - e.min_version
            assert 0 <= staleness <= self.stale_steps, "replay past the staleness bound"
            e.replays += 1
            self.replayed_groups += 1
            for t in e.group.trajectories:
                if t.min_version() != NO_VERSION:
                    self.staleness_hist[trainer_version - t.min_version()] += 1
            if e.replays >= self.max_reuse:
                self._remove(e)
        self.last_replayed = [e.group.id for e in picks]
        return [e.group for e in picks]

    def expire(self, trainer_version: int) -> None:
        """Drop entries whose oldest token has passed the bound (they can never be trained again)."""
        for e in list(self._entries.values()):
            if trainer_version - e.min_version > self.stale_steps:
                self.expired += 1
                self._remove(e)

    def _remove(self, e: _Entry) -> None:
        del self._entries[e.group.id]
        self.trainings_hist[1 + e.replays] += 1

    def state(self) -> dict[str, int]:
        """Group id -> replays so far, of every group still in the pool (what a checkpoint records)."""
        return {gid: e.replays for gid, e in self._entries.items()}

    def metrics(self) -> dict[str, float]:
        n = sum(self.staleness_hist.values())
        return {
            "replayed_groups": self.replayed_groups,
            "replay_pool": len(self._entries),
            "replay_expired": self.expired,
            "replay_skipped_uniform": self.skipped_uniform,
            "replay_mean_staleness": sum(k * v for k, v in self.staleness_hist.items()) / n if n else 0.0,
            "replay_max_staleness": max(self.staleness_hist, default=0),
            "replay_bound": self.stale_steps,
        }

    def trainings(self) -> dict[str, int]:
        """Times trained in all -> number of groups, over every group trained so far (those in the pool included)."""
        hist = self.trainings_hist + Counter(1 + e.replays for e in self._entries.values())
        return {str(k): v for k, v in sorted(hist.items())}


@dataclass
class _Ema:
    alpha: float = 0.3
    value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.alpha * x + (1 - self.alpha) * self.value


MIN_SLOT_SHARE = 0.5
"""The smallest share of slots held that the adaptive rate is scaled by: at most doubled per measurement, so a window
held full by the trainer is escaped in a few steps without a single idle interval swinging the schedule to no replay."""

WAIT_S = 0.05
"""A trainer wait for its batch longer than this (and than 5% of the step) counts as waiting for generation."""


@dataclass
class ReplayScheduler:
    """How many of the next batch's groups are replayed, how many are fresh, and the fresh groups dispatch plans for.

    ``fixed``: ``k = round(ratio * B)`` replays (fewer while fewer are eligible) and ``B - k`` fresh groups.

    ``adaptive``, with ``r`` the replays the pool can give now (at most ``round(ratio * B)``), ``g`` the measured rate
    at which fresh groups finish and ``c`` the measured cost of a step per group trained (from taking a batch to
    asking for the next: score, train, weight sync): the batch takes ``f = min(B, max(floor(g * c * B), B - r))``
    fresh groups, the whole groups generation supplies while one batch trains (no replay where it keeps up), and
    replays the other ``B - f``. Rounded down: per optimizer step, a batch with a replay in place of a fresh group
    learned as much on the demo, and the fresh group would cost trajectories and, on shared cores, CPU the trainer
    needs (rounding up took about 4.5 fresh groups a step where this takes about 4; docs/results.md, replay). Before
    the first measurement it replays like ``fixed``.

    ``g`` is generation's rate with the rollout slots full. While the dispatch window is full, slots stand idle and
    the rate at which groups finish is the rate at which the trainer takes them, whatever the engines could do: any
    replay share would then measure as just right. So when the trainer did not wait for its last batch, the rate
    measured since is divided by the mean share of the slots held meanwhile (at least ``MIN_SLOT_SHARE``): the
    schedule takes more fresh groups, the window widens, and either the slots fill (the share returns to 1 and the
    rate is generation's own) or replay stops. After a wait (a straggler the trainer had to train) the rate is taken
    as measured, since slots idle behind a straggler say nothing of what generation would supply.

    Dispatch plans for ``B - round(ratio * B)`` fresh groups per batch under both schedules: no batch takes fewer, so
    the window's deadlines hold whatever the scheduler decides later.
    """

    batch_groups: int
    ratio: float
    schedule: Schedule = "fixed"
    rate: _Ema = field(default_factory=_Ema)
    step_s: _Ema = field(default_factory=_Ema)
    group_s: _Ema = field(default_factory=_Ema)
    """Seconds per group trained, from the last steps."""
    last: dict[str, float] = field(default_factory=dict)
    """The last decision (logged with every step's store metrics)."""
    last_share: float | None = None
    """Mean share of the rollout slots held between the last two requests."""
    _last_out: float | None = None
    _last_size: int = 0
    _last_request: float | None = None
    _accepted_since: int = 0
    _paused: float = 0.0
    _gen_paused: float = 0.0
    _usage: tuple[float, float] | None = None
    _waited: bool = True  # until a batch has come out, nothing says the trainer is fed

    @property
    def max_replays(self) -> int:
        """``round(ratio * B)``, leaving at least one fresh group per batch."""
        return max(0, min(self.batch_groups - 1, round(self.ratio * self.batch_groups)))

    def on_accept(self) -> None:
        self._accepted_since += 1

    def on_pause(self, seconds: float, generation: float = 0.0) -> None:
        """Time since the last batch that was no step's cost (an in-loop evaluation, a checkpoint, an engine added):
        left out of the step time, or the steps after each evaluation would look several times as expensive and the
        schedule would stop replaying while the trainer in fact waits. ``generation``: the part of it in which no
        new group could start (``eval.pause_rollouts``), left out of the generation rate for the same reason."""
        self._paused += max(0.0, seconds)
        self._gen_paused += max(0.0, generation)

    def on_request(self, now: float, usage: tuple[float, float] | None = None) -> None:
        """The trainer asks for a batch: its step time since the last batch, the generation rate since the last ask.
        ``usage``: the rollout slots' (share held x seconds, seconds) so far (:class:`agentflow.store.SlotUsage`)."""
        if self._last_out is not None:
            step = max(0.0, now - self._last_out - self._paused)
            self.step_s.add(step)
            if self._last_size:
                self.group_s.add(step / self._last_size)
        self._paused = 0.0
        share = self._slot_share(usage)
        if self._last_request is not None and now - self._last_request > self._gen_paused:
            rate = self._accepted_since / (now - self._last_request - self._gen_paused)
            if share is not None and not self._waited:
                rate /= max(share, MIN_SLOT_SHARE)
            self.rate.add(rate)
        self._gen_paused = 0.0
        self._last_request, self._accepted_since = now, 0
        if share is not None:
            self.last_share = share

    def _slot_share(self, usage: tuple[float, float] | None) -> float | None:
        """Mean share of the slots held since the last request (None: unknown, or counting restarted)."""
        before, self._usage = self._usage, usage
        if usage is None or before is None:
            return None
        held, seconds = usage[0] - before[0], usage[1] - before[1]
        return min(1.0, held / seconds) if seconds > 0 and held >= 0 else None

    def on_batch_out(self, now: float, size: int = 0) -> None:
        if self._last_request is not None:
            wait = now - self._last_request
            self._waited = wait > WAIT_S and wait > 0.05 * (self.step_s.value or 0.0)
        self._last_out, self._last_size = now, size

    def plan(self, ready: int, eligible: int | None = None) -> int:
        """Replays wanted for the next batch, given ``eligible`` groups the pool could replay now (None: as many as
        wanted); ``ready``, the finished fresh groups waiting, is logged with the decision."""
        b, cap = self.batch_groups, self.max_replays
        if eligible is not None:
            cap = min(cap, eligible)
        supply = 0
        if self.schedule == "adaptive" and self.rate.value is not None and self.group_s.value is not None:
            supply = math.floor(self.rate.value * self.group_s.value * b + 1e-9)
        k = b - min(b, max(supply, b - cap))
        self.last = {"replay_wanted": k, "replay_ready_at_request": ready, "replay_supply": supply}
        return k

    @property
    def fresh_plan(self) -> int:
        """Fresh groups per batch that dispatch plans ahead for (the window): the fewest any batch takes."""
        return self.batch_groups - self.max_replays

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {"replay_fresh_plan": self.fresh_plan, **self.last}
        if self.rate.value is not None:
            out["replay_gen_rate"] = self.rate.value
        if self.step_s.value is not None:
            out["replay_step_s"] = self.step_s.value
        if self.group_s.value is not None:
            out["replay_group_s"] = self.group_s.value
        if self.last_share is not None:
            out["replay_slot_share"] = self.last_share
        return out
