"""What keeps a paused episode's KV alive in the embedded engine: a time-to-live learned from how long episodes
really pause, and a second tier where live entries go instead of being dropped when the slots run out.

An agentic episode leaves the engine after every turn while its tool runs, and comes back with a longer context.
Its KV waits in an idle slot; when a new request needs a slot and none is empty, one entry must go. Entries of
episodes that ended go first (the agent says so), then entries idle past their time-to-live (their episode is most
likely gone), and only then live ones, least recently used first, which are copied to the :class:`SpillTier` (host
memory outside the slot cache, bounded in bytes) rather than dropped. A request whose prompt extends a spilled
entry gets it copied back into its slot instead of paying the prefill again.

The time-to-live comes from :class:`ResumeGaps`: the seconds between a turn's end and the next turn reusing its
entry, as measured by the engine itself (tool latency plus the agent's own time), p90 times a margin.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]: bisect on slice equality (C-speed compares)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


TTL_MARGIN = 2.0
"""The time-to-live is this many times the p90 of measured resume gaps."""
TTL_MIN_SAMPLES = 8
"""Resume gaps measured before the learned time-to-live replaces the configured starting value."""


class ResumeGaps:
    """Seconds between an entry's release and its reuse, the last ``window`` of them."""

    def __init__(self, initial_ttl_s: float, fixed: bool = False, window: int = 256) -> None:
        self.initial_ttl_s, self.fixed = initial_ttl_s, fixed
        self._gaps: deque[float] = deque(maxlen=window)

    def add(self, gap_s: float) -> None:
        self._gaps.append(max(0.0, gap_s))

    def ttl_s(self) -> float:
        """The current time-to-live: fixed, or the margin times the p90 gap once enough were measured."""
        if self.fixed or len(self._gaps) < TTL_MIN_SAMPLES:
            return self.initial_ttl_s
        gaps = sorted(self._gaps)
        return max(0.05, TTL_MARGIN * gaps[min(len(gaps) - 1, int(0.9 * len(gaps)))])


@dataclass
class Spilled:
    """One entry in the second tier: its token ids, their keys and values, the version that computed them."""

    ids: list[int]
    kv: torch.Tensor
    """``[layers, 2, kv_heads, len(ids), head_dim]`` copied out of the slot cache."""
    version: int
    released_at: float
    routes: dict[int, list[list[int]]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


class SpillTier:
    """Spilled entries, least recently used first, within ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, Spilled] = OrderedDict()
        self._next = 0
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: Spilled) -> int:
        """Keep ``entry``; returns how many older entries were dropped to make room (0 when it does not fit)."""
        if entry.nbytes > self.max_bytes:
            return 0
        dropped = 0
        while self.nbytes + entry.nbytes > self.max_bytes and self._entries:
            self._remove(next(iter(self._entries)))
            dropped += 1
        self._entries[self._next] = entry
        self._next += 1
        self.nbytes += entry.nbytes
        return dropped

    def take(self, seq: list[int], version: int | None, min_hit: int) -> tuple[Spilled, int] | None:
        """Remove and return the entry sharing the longest prefix (at least ``min_hit`` tokens) with ``seq``, of
        ``version`` when one is given, with that prefix's length."""
        best, hit = None, 0
        for key, entry in self._entries.items():
            if version is not None and entry.version != version:
                continue
            n = common_prefix(entry.ids, seq)
            if n > hit and n >= min_hit:
                best, hit = key, n
        if best is None:
            return None
        return self._remove(best), hit

    def contains_prefix_of(self, seq: list[int], min_len: int) -> bool:
        """Whether some entry (of ``min_len`` tokens at least) is a prefix of ``seq``."""
        return any(len(e.ids) >= min_len and seq[: len(e.ids)] == e.ids for e in self._entries.values())

    def expire(self, now: float, ttl_s: float) -> int:
        """Drop entries idle past ``ttl_s``; returns how many."""
        old = [k for k, e in self._entries.items() if now - e.released_at > ttl_s]
        for k in old:
            self._remove(k)
        return len(old)

    def forget(self, ids: list[int]) -> int:
        """Drop entries that are a prefix of ``ids`` (their episode ended); returns how many."""
        done = [k for k, e in self._entries.items() if ids[: len(e.ids)] == e.ids]
        for k in done:
            self._remove(k)
        return len(done)

    def drop_versions(self, keep: set[int] | None) -> None:
        """Drop every entry (``keep`` None) or those whose version is not in ``keep``."""
        for k in [k for k, e in self._entries.items() if keep is None or e.version not in keep]:
            self._remove(k)

    def _remove(self, key: int) -> Spilled:
        entry = self._entries.pop(key)
        self.nbytes -= entry.nbytes
        return entry


def now() -> float:
    return time.monotonic()
