"""The embedded engine's decode thread: request records, prefix-cache slot choice, the step loop and the ops.

Everything here runs on the one decode thread (except what holds ``_cv``), so a step never races a weight update,
a pause or a cache flush. :class:`DecodeLoop` is the thread's half of :class:`agentflow.engine.embedded.EmbeddedEngine`;
the engine's constructor sets up the state declared below, and its public methods hand work over through ``_cv``.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from agentflow.engine.kv_tier import ResumeGaps, SpillTier, now
from agentflow.engine.output_rules import OutputRules, RequestRules, top_alternatives
from agentflow.engine.prefix_cache import PrefixSlots
from agentflow.engine.qwen2 import DecoderModel, KVCache
from agentflow.engine.sampling import sample_batch
from agentflow.engine.versions import HeldVersions, VersionGone
from agentflow.types import FinishReason, GenerateResult, PauseMode, SamplingParams, ScoreResult

Deliver = Callable[[GenerateResult | BaseException], None]
#: Called on the decode thread after each sampled token: (token id, behaviour log-prob, weight version).
OnToken = Callable[[int, float, int], None]


@dataclass(eq=False)
class Request:
    """One request as the decode thread sees it."""

    rid: str
    prompt: list[int]
    sampling: SamplingParams
    generator: torch.Generator
    deliver: Deliver
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    slot: int | None = None
    cached: int = 0
    """Tokens of ``prompt + output`` whose keys and values are in the slot."""
    cache_hit: int = 0
    """Prompt tokens found in the prefix cache at first admission (``GenerateResult.cached_tokens``)."""
    kv_version: int = 0
    """Oldest weight version whose keys and values the slot holds for this request (older than the current one
    only where a kept prefix-cache entry was reused, or the request decoded across an update)."""
    retractions: int = 0
    """Times the request lost its slot to ``pause("retract")`` or a memory release."""
    on_token: OnToken | None = None
    rules: RequestRules | None = None
    """Grammar and stop strings (None: plain sampling)."""
    top: list[list[tuple[int, float]]] | None = None
    routes: list[tuple[int, list[list[int]]]] | None = None
    """MoE models: ``(position, experts per layer)`` of each position this request ran (see ``GenerateResult``)."""

    def result(self, reason: FinishReason) -> GenerateResult:
        return GenerateResult(
            rid=self.rid,
            output_ids=list(self.output),
            logprobs=list(self.logprobs),
            versions=list(self.versions),
            finish_reason=reason,
            prompt_tokens=len(self.prompt),
            cached_tokens=self.cache_hit,
            top_logprobs=[list(t) for t in self.top] if self.top is not None else None,
            routed_experts=list(self.routes) if self.routes is not None else None,
        )


def _slots(reqs: list[Request]) -> list[int]:
    """The slots of admitted requests (each has one)."""
    out = [r.slot for r in reqs]
    if any(s is None for s in out):
        raise RuntimeError("a request without a slot reached a forward pass")
    return [s for s in out if s is not None]


def safe_deliver(deliver: Deliver, value: GenerateResult | BaseException) -> None:
    """Hand a result over; a caller that went away (closed loop, cancelled future) must not hurt the thread."""
    try:
        deliver(value)
    except (RuntimeError, cf.InvalidStateError):
        pass


class DecodeLoop(PrefixSlots):
    """The decode thread's side of the engine: admission into slots, batched prefill and decode, finishing
    requests, and the ops (pause, flush, memory, weight update, scoring) that run between steps."""

    # state set up by EmbeddedEngine.__init__; the caller side touches the queues only under _cv
    model: DecoderModel
    cache: KVCache
    max_slots: int
    max_len: int
    prefix_cache: bool
    keep_cache_on_update: bool
    kv_on_update: str
    kv_max_age: int | None
    abort_on_update: bool
    _cv: threading.Condition
    _waiting: deque[Request]
    _running: dict[int, Request]
    _idle: OrderedDict[int, list[int]]
    _idle_version: dict[int, int]
    _stale: set[int]
    _released_at: dict[int, float]
    _ended: set[int]
    _gaps: ResumeGaps
    _spill: SpillTier
    admission: str
    _slot_routes: dict[int, dict[int, list[list[int]]]]
    """MoE models: the experts chosen at each position of each slot's cached tokens (a prefix hit reuses them)."""
    _rids: set[str]
    _aborts: set[str]
    _ops: deque[tuple[Callable[[], Any], cf.Future[Any]]]
    _paused: PauseMode | None
    _released: bool
    _retracted: OrderedDict[str, int]
    _closed: bool
    _version: int
    _stats: dict[str, float]
    _held: HeldVersions
    output_rules: OutputRules

    def _model_of(self, version: int) -> DecoderModel:
        model = self.model if version == self._version else self._held.model_of(version)
        if model is None:
            raise VersionGone(f"weight version {version} is no longer served (held: {self._served()})")
        return model

    def _served(self) -> list[int]:
        return [*self._held.versions(), self._version]

    def _by_version(self, reqs: list[Request]) -> list[tuple[int, DecoderModel, list[Request]]]:
        """Requests grouped by the version that serves them (one forward pass each), in ``reqs``' order within."""
        if not self._held:
            return [(self._version, self.model, reqs)] if reqs else []
        groups: dict[int, list[Request]] = {}
        for r in reqs:
            groups.setdefault(self._pinned(r), []).append(r)
        return [(v, self._model_of(v), rs) for v, rs in sorted(groups.items())]

    def _has_work(self) -> bool:
        busy = self._paused is None and not self._released and bool(self._waiting or self._running or self._stale)
        return self._closed or bool(self._ops) or bool(self._aborts) or busy

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(self._has_work)
                if self._closed:
                    break
                ops = list(self._ops)
                self._ops.clear()
                aborts, self._aborts = self._aborts, set()
            for fn, fut in ops:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as exc:  # handed to the caller
                        fut.set_exception(exc)
            try:
                self._handle_aborts(aborts)
                if self._paused is None and not self._released:
                    self._step()
            except Exception as exc:  # every pending request learns the error
                self._stats["errors"] += 1
                self._fail_all(exc)
        self._shutdown()

    def _step(self) -> None:
        """Admit waiting requests into free slots, then decode one token for every running request."""
        admitted: list[Request] = []
        while self._idle:
            with self._cv:
                if not self._waiting:
                    break
                req = self._next_waiting()
            if self._pinned(req) not in self._served():  # its version was dropped while it waited
                self._fail_gone(req)
                continue
            self._running[self._admit(req)] = req
            admitted.append(req)
        for version, model, group in self._by_version(admitted):
            self._prefill(group, model, version)
        active = [r for slot, r in sorted(self._running.items()) if r not in admitted]
        for version, model, group in self._by_version(active):
            self._decode(group, model, version)
        if self._stale and not admitted and not self._waiting:
            self._recompute_some()

    def _prefill(self, reqs: list[Request], model: DecoderModel, version: int) -> None:
        """Encode newly admitted requests' uncached tokens in one forward pass of ``model`` (one per request was
        slow)."""
        seqs = [r.prompt + r.output for r in reqs]
        chunks = [torch.tensor(seq[r.cached :], dtype=torch.long) for r, seq in zip(reqs, seqs, strict=True)]
        t0 = time.perf_counter()
        self._start_routes(model)
        logits = model.prefill_batch(self.cache, _slots(reqs), chunks, [r.cached for r in reqs])
        self._keep_routes(reqs, [r.cached for r in reqs], [len(c) for c in chunks], model)
        self._stats["busy_seconds"] += time.perf_counter() - t0
        self._stats["prefills"] += len(reqs)
        self._stats["prefill_tokens"] += sum(len(c) for c in chunks)
        for r, seq in zip(reqs, seqs, strict=True):
            r.cached = len(seq)
        self._accept(reqs, logits, version)

    def _decode(self, reqs: list[Request], model: DecoderModel, version: int) -> None:
        slots = torch.tensor(_slots(reqs), dtype=torch.long)
        tokens = torch.tensor([r.output[-1] for r in reqs], dtype=torch.long)
        positions = torch.tensor([r.cached for r in reqs], dtype=torch.long)
        t0 = time.perf_counter()
        self._start_routes(model)
        logits = model.decode(self.cache, slots, tokens, positions)
        self._keep_routes(reqs, [r.cached for r in reqs], [1] * len(reqs), model)
        self._stats["busy_seconds"] += time.perf_counter() - t0
        self._stats["decode_steps"] += 1
        for r in reqs:
            r.cached += 1
        self._accept(reqs, logits, version)

    @staticmethod
    def _start_routes(model: DecoderModel) -> None:
        if model.config.is_moe:
            model.route_log = []

    def _keep_routes(self, reqs: list[Request], starts: list[int], counts: list[int], model: DecoderModel) -> None:
        """File the experts each layer chose for this forward's tokens under each request's positions."""
        log, model.route_log = model.route_log, None
        if not log:
            return
        chosen = torch.stack(log, dim=1).tolist()  # [tokens, layers, k], the requests' tokens in order
        offset = 0
        for req, start, n in zip(reqs, starts, counts, strict=True):
            req.routes = req.routes if req.routes is not None else []
            slot = self._slot_routes.setdefault(req.slot if req.slot is not None else -1, {})
            for j in range(n):
                req.routes.append((start + j, chosen[offset + j]))
                slot[start + j] = chosen[offset + j]
            offset += n

    def _accept(self, reqs: list[Request], logits: torch.Tensor, version: int) -> None:
        """Sample one token per request from ``logits`` (masked by grammars), stamp it with the ``version`` that
        computed them, and finish requests that are done."""
        rules = [r.rules for r in reqs]
        errors: list[str | None] = [None] * len(reqs)
        if any(rules):
            logits, errors = self.output_rules.mask(logits, rules)
        params = [r.sampling for r in reqs]
        picks = sample_batch(logits, params, [r.generator for r in reqs])
        tops = top_alternatives(logits, params) if any(p.top_logprobs for p in params) else None
        for i, (req, (tok, lp)) in enumerate(zip(reqs, picks, strict=True)):
            if errors[i] is not None:
                self._fail(req, RuntimeError(errors[i]))
                continue
            req.output.append(tok)
            req.logprobs.append(lp)
            req.versions.append(version)
            if tops is not None and (alternatives := tops[i]) is not None:
                req.top = req.top if req.top is not None else []
                req.top.append(alternatives)
            self._stats["tokens_generated"] += 1
            if req.on_token is not None:
                try:
                    req.on_token(tok, lp, version)
                except Exception:  # a broken listener must not stop the engine
                    req.on_token = None
            stopped, error = self.output_rules.accept(req.rules, req.output) if req.rules else (False, None)
            if error is not None:
                self._fail(req, RuntimeError(error))
            elif stopped or tok in req.sampling.stop_token_ids:
                self._finish(req, "stop")
            elif len(req.output) >= req.sampling.max_new_tokens or len(req.prompt) + len(req.output) >= self.max_len:
                self._finish(req, "length")

    def _fail_gone(self, req: Request) -> None:
        self._stats["requests_version_gone"] += 1
        self._fail(req, VersionGone(f"weight version {self._pinned(req)} is no longer served (held: {self._served()})"))

    def _fail(self, req: Request, exc: BaseException) -> None:
        """End one request with an error (its grammar failed); the others go on."""
        self._release(req, keep_kv=False)
        self._stats["errors"] += 1
        safe_deliver(req.deliver, exc)

    def _release(self, req: Request, keep_kv: bool = True) -> None:
        """Free the request's slot; its KV stays there as a prefix-cache entry unless ``keep_kv`` is False."""
        if req.slot is not None:
            self._running.pop(req.slot, None)
            # under ``flush`` no KV of older weights outlives an update: a request that decoded across one holds some
            # (its slot was running, so the update's flush did not reach it), and a later request would reuse it
            across = req.kv_version < self._version and self.kv_on_update == "flush"
            seq = (req.prompt + req.output)[: req.cached] if keep_kv and self.prefix_cache and not across else []
            self._idle[req.slot] = seq
            self._idle_version[req.slot] = req.kv_version
            self._released_at[req.slot] = now()
            if not seq:
                self._idle.move_to_end(req.slot, last=False)  # empty slots are taken before cached ones
            elif self.kv_on_update == "recompute" and req.kv_version < self._version:
                self._stale.add(req.slot)  # it decoded across an update: part of its KV is the old weights'
            req.slot = None
        req.cached = 0
        with self._cv:
            self._rids.discard(req.rid)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        self._release(req)
        if req.retractions:
            self._retracted[req.rid] = req.retractions
            if len(self._retracted) > 1024:
                self._retracted.popitem(last=False)
        self._stats["requests_aborted" if reason == "abort" else "requests_finished"] += 1
        safe_deliver(req.deliver, req.result(reason))

    def _handle_aborts(self, rids: set[str]) -> None:
        if not rids:
            return
        with self._cv:
            queued = [r for r in self._waiting if r.rid in rids]
            for r in queued:
                self._waiting.remove(r)
        for req in queued + [r for r in self._running.values() if r.rid in rids]:
            self._finish(req, "abort")

    def _take_all(self) -> list[Request]:
        """Remove every running and waiting request from the engine's books (running first)."""
        running = [r for _, r in sorted(self._running.items())]
        with self._cv:
            waiting = list(self._waiting)
            self._waiting.clear()
        return running + waiting

    def _fail_all(self, exc: BaseException) -> None:
        for req in self._take_all():
            self._release(req, keep_kv=False)
            safe_deliver(req.deliver, exc)

    def _shutdown(self) -> None:
        for req in self._take_all():
            self._finish(req, "abort")
        with self._cv:
            ops = list(self._ops)
            self._ops.clear()
        for _, fut in ops:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError("engine is closed"))

    # -------------------------------------------------------------------------------- ops (on the decode thread)

    def _do_pause(self, mode: PauseMode) -> None:
        self._paused = mode
        if mode == "abort":
            for req in self._take_all():
                self._finish(req, "abort")
        elif mode == "retract":
            self._retract_running()

    def _retract_running(self) -> None:
        """Move running requests back to the front of the queue; their KV stays only as a prefix-cache entry."""
        running = [r for _, r in sorted(self._running.items())]
        for req in running:
            self._release(req)
            req.retractions += 1
            with self._cv:
                self._rids.add(req.rid)
        with self._cv:
            self._waiting.extendleft(reversed(running))

    def _do_resume(self) -> None:
        self._paused = None

    def _do_release(self) -> None:
        self._retract_running()
        self._do_flush()
        self._released = True
        self.cache.data = torch.empty(0)

    def _do_resume_memory(self) -> None:
        if self._released:
            self.cache = KVCache(self.model.config, self.max_slots, self.max_len)
            self._released = False

    def _do_update(self, version: int, named_tensors: dict[str, Any]) -> None:
        gone = self._held.hold(self._version, self.model)
        self.model.load_(named_tensors)
        self._version = version
        if self._held.keep > 1:  # pinned requests keep their versions' KV; those of a dropped version end
            self._drop_versions(set(gone))
            return
        if self.abort_on_update:  # requests with no token yet simply start under the new version
            taken = self._take_all()
            for req in taken:
                if req.output:
                    self._finish(req, "abort")
            with self._cv:
                self._waiting.extendleft(reversed([r for r in taken if not r.output]))
        self._cache_after_update(version, self.keep_cache_on_update)

    def _drop_versions(self, gone: set[int]) -> None:
        for slot, ids in list(self._idle.items()):
            if ids and self._idle_version.get(slot) in gone:
                self._drop_entry(slot)
        self._spill.drop_versions(set(self._served()))
        for req in self._take_all():
            if self._pinned(req) in gone:
                self._fail_gone(req)
            elif req.slot is None:
                with self._cv:
                    self._waiting.append(req)
            else:
                self._running[req.slot] = req

    def _do_score(self, ids: list[int], start: int, top_k: int) -> ScoreResult:
        t0 = time.perf_counter()
        logits = self.model.forward_full(torch.tensor(ids, dtype=torch.long))
        self._stats["busy_seconds"] += time.perf_counter() - t0
        self._stats["scores"] += 1
        logp = torch.log_softmax(logits[start - 1 : len(ids) - 1], dim=-1)
        targets = torch.tensor(ids[start:], dtype=torch.long)
        lps = logp.gather(1, targets[:, None])[:, 0].tolist()
        top: list[list[tuple[int, float]]] | None = None
        if top_k > 0:
            vals, idx = torch.topk(logp, min(top_k, logp.shape[-1]), dim=-1)
            top = [list(zip(i.tolist(), v.tolist(), strict=True)) for i, v in zip(idx, vals, strict=True)]
        return ScoreResult(logprobs=lps, top_logprobs=top, weight_version=self._version)
