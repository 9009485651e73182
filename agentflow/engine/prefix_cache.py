"""The embedded engine's prefix cache: which idle slot a request takes, what an eviction does with the entry it
displaces, and what a weight update does to cached entries.

A finished request leaves its keys and values in its slot as an entry (the token ids its KV holds, the oldest
version that computed them, when it was released). A new request takes the slot whose entry shares the longest
prefix with it (:data:`MIN_PREFIX_HIT` tokens at least), else a spilled entry is copied back into a free slot
(:mod:`agentflow.engine.kv_tier`), else it prefills from scratch. Entries go, when a slot is needed, in the order
of :meth:`PrefixSlots._free_slot`. These methods run on the decode thread only; :class:`DecodeLoop` mixes them in.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from typing import TYPE_CHECKING

import torch

from agentflow.engine.kv_tier import ResumeGaps, Spilled, SpillTier, common_prefix, now
from agentflow.engine.qwen2 import DecoderModel, KVCache
from agentflow.engine.versions import HeldVersions

if TYPE_CHECKING:
    from agentflow.engine.decode_loop import Request

RECOMPUTE_TOKENS_PER_STEP = 1024
"""Stale prefix-cache tokens one idle step of ``kv_on_update: recompute`` prefills again (about one long context)."""

MIN_PREFIX_HIT = 4
"""Shortest cached prefix worth taking a slot for. A match of a token or two is a coincidence that saves almost no
prefill, and taking that slot would evict its cached sequence and scatter the batch over the slot range (the decode
step attends over the range ``[min slot, max slot]``)."""

RESUMED_SCAN = 64
"""``admission: resumed_first`` looks this far down the queue for a request that continues a cached context."""


class PrefixSlots:
    """Slot choice, eviction, spilling and update handling of the prefix cache (mixed into the decode loop)."""

    model: DecoderModel
    cache: KVCache
    prefix_cache: bool
    kv_on_update: str
    kv_max_age: int | None
    admission: str
    paused_aware: bool
    _version: int
    _waiting: deque[Request]
    _idle: OrderedDict[int, list[int]]
    _idle_version: dict[int, int]
    _released_at: dict[int, float]
    _ended: set[int]
    _stale: set[int]
    _slot_routes: dict[int, dict[int, list[list[int]]]]
    _gaps: ResumeGaps
    _spill: SpillTier
    _held: HeldVersions
    _stats: dict[str, float]

    def _pinned(self, req: Request) -> int:
        """The weight version that serves ``req``: the one it names, else the newest."""
        v = req.sampling.weight_version
        return self._version if v is None else v

    def _multi_version(self) -> bool:
        """Whether several weight versions are served (``rollout.partial: pin``): KV is then per version."""
        return self._held.keep > 1

    # ------------------------------------------------------------------------------------------ admission

    def _next_waiting(self) -> Request:
        """The queue's head, or with ``resumed_first`` the first of the next few that continues a cached context
        (a paused episode's next turn goes ahead of new episodes). Called under ``_cv`` with a non-empty queue."""
        if self.admission == "resumed_first" and len(self._waiting) > 1:
            for i, req in enumerate(self._waiting):
                if i >= RESUMED_SCAN:
                    break
                if self._resumes(req.prompt + req.output):
                    del self._waiting[i]
                    if i:
                        self._stats["resumed_ahead"] += 1
                    return req
        return self._waiting.popleft()

    def _resumes(self, seq: list[int]) -> bool:
        """Whether ``seq`` continues a whole cached context (a paused episode's next turn), in a slot or spilled;
        sharing a system prompt with an entry is not enough."""
        for ids in self._idle.values():
            if len(ids) >= MIN_PREFIX_HIT and seq[: len(ids)] == ids:
                return True
        return self._spill.contains_prefix_of(seq, MIN_PREFIX_HIT)

    def _slot_hit(self, seq: list[int], want: int) -> tuple[int | None, int]:
        best, hit = None, 0
        if self.prefix_cache:
            for slot, ids in self._idle.items():
                if self._multi_version() and self._idle_version.get(slot) != want:  # pinned: its own version's KV
                    continue
                n = common_prefix(ids, seq) if ids else 0
                if n > hit and n >= MIN_PREFIX_HIT:
                    best, hit = slot, n
        return best, hit

    def _admit(self, req: Request) -> int:
        """Give ``req`` the idle slot whose cached ids share the longest prefix with it, else a free slot (with a
        spilled entry copied back into it when one matches).

        Free slot: the lowest-numbered empty one. A decode step attends over the slot range of the running
        requests, so a compact range (no idle slots between them, no gather) is what keeps a step cheap; after a
        flush every slot is empty and taking them in LRU order scattered a batch of 32 over 64 slots (1.2x HF at
        batch 32 instead of 1.6x).
        """
        seq = req.prompt + req.output
        want = self._pinned(req)
        slot, hit = self._slot_hit(seq, want)
        resumes = slot is not None and hit >= len(self._idle[slot])  # it continues the whole cached context
        restored = None
        if len(self._spill) and self.prefix_cache:  # a spilled entry that covers more than any slot's
            restored = self._spill.take(seq, want if self._multi_version() else None, max(MIN_PREFIX_HIT, hit + 1))
            if restored is not None:
                slot, resumes = None, restored[1] >= len(restored[0].ids)
        if slot is not None and not resumes and self.paused_aware and self._live(slot):
            slot = self._share_prefix(slot, hit)  # only a shared prefix (a system prompt): keep the paused context
        if slot is None:
            slot = self._free_slot()
        del self._idle[slot]
        version = self._idle_version.pop(slot, self._version)
        released = self._released_at.pop(slot, None)
        self._ended.discard(slot)
        if restored is not None:
            entry, hit = restored
            self._restore(slot, entry, hit)
            version, released = entry.version, entry.released_at
        if resumes and released is not None:  # the pause this entry waited through: what its time-to-live learns
            self._gaps.add(now() - released)
        if slot in self._stale:  # kept for recompute but not recomputed yet: its KV is the old weights'
            self._stale.discard(slot)
            if hit:
                self._stats["kv_recomputed_on_admit"] += 1
                self._stats["kv_recomputed_tokens"] += hit
            hit = 0
        self._take_hit(req, slot, hit, version, want)
        return slot

    def _take_hit(self, req: Request, slot: int, hit: int, version: int, want: int) -> None:
        seq_len = len(req.prompt) + len(req.output)
        req.slot = slot
        req.cached = min(hit, seq_len - 1)  # at least one token goes through the model for its logits
        req.kv_version = version if req.cached else want
        if req.cached and version < want:
            self._stats["stale_prefix_hits"] += 1
            self._stats["stale_prefix_tokens_reused"] += req.cached
        if self.model.config.is_moe and req.cached:  # the cached positions' experts, chosen when they were computed
            known = self._slot_routes.get(slot, {})
            req.routes = (req.routes or []) + [(p, known[p]) for p in range(req.cached) if p in known]
        if req.cached > 0:
            self._stats["prefix_hits"] += 1
            self._stats["prefix_tokens_reused"] += req.cached
        if not req.output:
            req.cache_hit = req.cached

    # ------------------------------------------------------------------------------------------ eviction

    def _live(self, slot: int) -> bool:
        """Whether an idle entry may still be resumed: its episode did not end and it is within its time-to-live."""
        t = now()
        return slot not in self._ended and t - self._released_at.get(slot, t) <= self._gaps.ttl_s()

    def _share_prefix(self, src: int, n: int) -> int:
        """A request shares only ``n`` leading tokens with a live entry (the system prompt and task of a sibling):
        rather than cut that paused episode's context, copy the ``n`` positions into a slot nobody needs (empty,
        or its episode ended or expired). Without one the entry is cut, after a copy went to the second tier."""
        t, ttl = now(), self._gaps.ttl_s()
        dst = min((s for s, ids in self._idle.items() if not ids), default=None)
        if dst is None:
            dst = next((s for s in self._idle if s in self._ended or t - self._released_at.get(s, t) > ttl), None)
        if dst is None:
            self._stats["evicted_live"] += 1
            self._stats["evicted_live_cut"] += 1
            if self._spill.max_bytes and src not in self._stale:
                self._spill_out(src)
            return src
        self._drop_entry(dst)
        self.cache.data[:, :, dst, :, :n, :] = self.cache.data[:, :, src, :, :n, :]
        self._idle[dst] = self._idle[src][:n]
        self._idle_version[dst] = self._idle_version.get(src, self._version)
        self._released_at[dst] = self._released_at.get(src, t)
        if src in self._slot_routes:
            self._slot_routes[dst] = {p: e for p, e in self._slot_routes[src].items() if p < n}
        if src in self._stale:
            self._stale.add(dst)
        self._stats["prefix_copies"] += 1
        return dst

    def _free_slot(self) -> int:
        """The lowest-numbered empty slot; else an entry goes: one whose episode ended, else one idle past its
        time-to-live, else the least recently used live one, which is spilled to the second tier first."""
        empty = min((slot for slot, ids in self._idle.items() if not ids), default=None)
        if empty is not None:
            return empty
        t, ttl = now(), self._gaps.ttl_s()
        self._stats["evicted_expired_spill"] += self._spill.expire(t, ttl)
        if self.paused_aware:
            ended = next((s for s in self._idle if s in self._ended), None)
            if ended is not None:
                self._stats["evicted_ended"] += 1
                return ended
            expired = next((s for s in self._idle if t - self._released_at.get(s, t) > ttl), None)
            if expired is not None:
                self._stats["evicted_expired"] += 1
                return expired
        victim = next(iter(self._idle))
        self._stats["evicted_live"] += 1
        if self._spill.max_bytes and victim not in self._stale:
            self._spill_out(victim)
        return victim

    def _spill_out(self, slot: int) -> None:
        ids = self._idle[slot]
        kv = self.cache.data[:, :, slot, :, : len(ids), :].clone()
        routes = dict(self._slot_routes.get(slot, {}))
        version, released = self._idle_version.get(slot, self._version), self._released_at.get(slot, now())
        entry = Spilled(ids, kv, version, released, routes)
        self._stats["kv_spill_dropped"] += self._spill.put(entry)
        self._stats["kv_spilled"] += 1

    def _restore(self, slot: int, entry: Spilled, n: int) -> None:
        """Copy the first ``n`` positions of a spilled entry back into ``slot``."""
        t0 = time.perf_counter()
        self.cache.data[:, :, slot, :, :n, :] = entry.kv[:, :, :, :n, :]
        self._stats["busy_seconds"] += time.perf_counter() - t0
        self._slot_routes[slot] = {p: e for p, e in entry.routes.items() if p < n}
        self._stats["kv_restored"] += 1
        self._stats["kv_restored_tokens"] += n

    def _do_forget(self, ids: list[int]) -> None:
        """An episode ended with context ``ids``: its entries go first when a slot is needed."""
        for slot, cached in self._idle.items():
            if cached and ids[: len(cached)] == cached:
                self._ended.add(slot)
        self._spill.forget(ids)

    def _do_flush(self) -> bool:
        for slot in list(self._idle):
            self._drop_entry(slot)
        self._spill.drop_versions(None)
        return True

    def _drop_entry(self, slot: int) -> None:
        self._idle[slot] = []
        self._idle.move_to_end(slot, last=False)  # empty slots are taken before cached ones
        self._slot_routes.pop(slot, None)
        self._idle_version.pop(slot, None)
        self._released_at.pop(slot, None)
        self._ended.discard(slot)
        self._stale.discard(slot)

    # ------------------------------------------------------------------------------------------ updates

    def _cache_after_update(self, version: int, keep: bool) -> None:
        """``kv_on_update`` after the weights became ``version``: flush, or keep entries within ``kv_max_age``
        (marking them for recompute under ``recompute``)."""
        if not keep:
            self._do_flush()
            return
        oldest = version - self.kv_max_age if self.kv_max_age is not None else None
        for slot, ids in list(self._idle.items()):
            if not ids:
                continue
            if oldest is not None and self._idle_version.get(slot, version) < oldest:
                self._stats["kv_dropped_too_old"] += 1
                self._drop_entry(slot)
            elif self.kv_on_update == "recompute":
                self._stale.add(slot)
        # spilled entries are not recomputed in place: under recompute they go, under keep the too-old ones
        if self.kv_on_update == "recompute":
            self._spill.drop_versions({version})
        elif oldest is not None:
            self._spill.drop_versions({v for v in range(oldest, version + 1)})

    def _recompute_some(self, budget: int = RECOMPUTE_TOKENS_PER_STEP) -> None:
        """Prefill stale prefix-cache entries again under the current weights, most recently used first, at most
        ``budget`` tokens (one entry at least) so that a step with running requests is not held up for long."""
        slots: list[int] = []
        total = 0
        for slot in reversed(self._idle):
            if slot in self._stale and (not slots or total + len(self._idle[slot]) <= budget):
                slots.append(slot)
                total += len(self._idle[slot])
        picked = [s for s in slots if self._idle[s]]
        if not picked:
            self._stale.difference_update(slots)
            return
        slots = picked
        chunks = [torch.tensor(self._idle[s], dtype=torch.long) for s in slots]
        t0 = time.perf_counter()
        if self.model.config.is_moe:
            self.model.route_log = []
        self.model.prefill_batch(self.cache, slots, chunks, [0] * len(slots))
        log, self.model.route_log = self.model.route_log, None
        self._stats["busy_seconds"] += time.perf_counter() - t0
        self._stats["kv_recomputed_tokens"] += total
        offset = 0
        chosen = torch.stack(log, dim=1).tolist() if log else None
        for slot, chunk in zip(slots, chunks, strict=True):
            self._idle_version[slot] = self._version
            if chosen is not None:  # MoE: the experts the new weights chose for the recomputed positions
                self._slot_routes[slot] = {p: chosen[offset + p] for p in range(len(chunk))}
            offset += len(chunk)
        self._stale.difference_update(slots)  # last: a reader of the stats sees the work done once it is gone
