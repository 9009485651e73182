"""The embedded CPU inference engine: continuous batching over a slot-based KV cache on a background thread.

One decode thread owns the model, the KV cache and the running requests. Callers hand it work through a condition
variable: new requests (a queue that waits for free slots), aborts, and *ops* (pause, resume, weight updates,
scoring, cache flushes), which the thread runs between decode steps so that a step never sees half-applied weights.
Every step admits waiting requests (prefill into a free slot, sample one token), then decodes one token for every
running request in one batched forward pass; requests leave as soon as they finish.

Prefix cache: a finished request leaves its keys and values in its slot. Idle slots are kept in LRU order with the
token ids their KV holds; a new request takes the idle slot sharing the longest common prefix with its prompt and
prefills only the rest (a multi-turn episode that resumes with a longer context pays for its new tokens only). A
request with no hit takes the least recently used idle slot. ``flush_cache()`` drops it; what a weight update does
to it is ``kv_on_update``: ``flush`` (drop it), ``keep`` (reuse the old weights' KV, up to ``kv_max_age`` versions
old; the tokens sampled over it carry the current version and their recorded log-probs are those actually sampled,
so the trainer's importance ratio corrects for the stale KV as for any off-policy token), or ``recompute`` (keep the
token ids and prefill them again under the new weights while the engine has nothing else to do; an entry a request
reaches before that is prefilled again on admission).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from agentflow.engine.decode_loop import DecodeLoop, Deliver, OnToken, Request, safe_deliver
from agentflow.engine.kv_tier import ResumeGaps, SpillTier, common_prefix
from agentflow.engine.output_rules import OutputRules
from agentflow.engine.prefix_cache import MIN_PREFIX_HIT
from agentflow.engine.qwen2 import DecoderModel, KVCache, load_hf_dir, validate_weights
from agentflow.engine.versions import HeldVersions, VersionGone
from agentflow.types import GenerateResult, PauseMode, SamplingParams, ScoreResult

# common_prefix and MIN_PREFIX_HIT live with the prefix cache; importing them from here keeps working
__all__ = ["MIN_PREFIX_HIT", "EmbeddedEngine", "OnToken", "common_prefix"]

T = TypeVar("T")
_PAUSE_MODES = ("abort", "retract", "in_place")
KV_ON_UPDATE = ("flush", "keep", "recompute")
ADMISSION = ("fifo", "resumed_first")
DEFAULT_TTL_S = 30.0
"""A paused entry's time-to-live until enough resume gaps were measured to learn it."""


def _settle(fut: asyncio.Future[GenerateResult], value: GenerateResult | BaseException) -> None:
    if fut.done():
        return
    if isinstance(value, BaseException):
        fut.set_exception(value)
    else:
        fut.set_result(value)


class EmbeddedEngine(DecodeLoop):
    """In-process InferenceEngine over a local Hugging Face Qwen2/Llama directory (fp32, CPU).

    ``max_slots`` bounds concurrent requests (more wait in a queue) and ``max_len`` bounds prompt + output tokens
    of one request; together they size the preallocated KV cache. ``seed`` seeds requests that carry no seed.
    ``prefix_cache`` keeps finished requests' KV in idle slots for reuse; ``kv_on_update`` says what a weight
    update does to it (module docstring), ``kv_max_age`` how many versions old kept KV may be (None: no bound).
    ``kv_spill_bytes`` > 0 keeps live entries displaced from their slots in a second tier of that size;
    ``kv_ttl_s`` fixes how long an idle entry counts as live (None: learned from measured resume gaps);
    ``paused_aware`` protects paused contexts (ended and expired entries evicted first, a shared prefix copied
    rather than cut; False, the default: plain LRU); ``admission="resumed_first"`` admits queued requests that
    continue a cached context ahead of the others (:mod:`agentflow.engine.prefix_cache`,
    :mod:`agentflow.engine.kv_tier`).
    """

    canonical_forcing = True
    """Grammars marked ``agentflow.structured.CANONICAL`` spell forced text in canonical tokens here."""

    def __init__(
        self,
        model_dir: str | Path,
        max_slots: int = 32,
        max_len: int = 1024,
        seed: int = 0,
        prefix_cache: bool = True,
        kv_on_update: str = "flush",
        kv_max_age: int | None = None,
        admission: str = "fifo",
        kv_ttl_s: float | None = None,
        kv_spill_bytes: int = 0,
        paused_aware: bool = False,
    ) -> None:
        if admission not in ADMISSION:
            raise ValueError(f"admission must be one of {ADMISSION}, got {admission!r}")
        if kv_on_update not in KV_ON_UPDATE:
            raise ValueError(f"kv_on_update must be one of {KV_ON_UPDATE}, got {kv_on_update!r}")
        self.model_dir = str(model_dir)
        self.model: DecoderModel = load_hf_dir(model_dir)
        self.cache = KVCache(self.model.config, max_slots, max_len)
        self.max_slots = max_slots
        self.max_len = max_len
        self.prefix_cache = prefix_cache
        self.kv_on_update = kv_on_update
        self.kv_max_age = kv_max_age
        self.keep_cache_on_update = kv_on_update != "flush"
        """This update keeps the prefix cache (as ``kv_on_update`` says) or flushes it; TransferMesh sets it per update
        from its ``flush_cache``."""
        self._idle_version: dict[int, int] = {}
        """Oldest weight version whose KV an idle slot's entry holds."""
        self._held = HeldVersions(1)
        self.admission = admission
        self.paused_aware = paused_aware
        self._released_at: dict[int, float] = {}
        self._ended: set[int] = set()
        """Idle slots whose entry belongs to an episode that ended (:meth:`forget_prefix`): evicted first."""
        self._gaps = ResumeGaps(kv_ttl_s if kv_ttl_s is not None else DEFAULT_TTL_S, fixed=kv_ttl_s is not None)
        self._spill = SpillTier(kv_spill_bytes)
        self._stale: set[int] = set()
        """Idle slots whose entry waits to be prefilled again under the current weights (``recompute``)."""
        self._seed = seed
        self._counter = 0
        self._cv = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._running: dict[int, Request] = {}
        self._idle: OrderedDict[int, list[int]] = OrderedDict((s, []) for s in range(max_slots))
        self._slot_routes: dict[int, dict[int, list[list[int]]]] = {}
        """Free slots, least recently used first, each with the token ids whose KV it still holds."""
        self._rids: set[str] = set()
        self._aborts: set[str] = set()
        self._ops: deque[tuple[Callable[[], Any], cf.Future[Any]]] = deque()
        self._paused: PauseMode | None = None
        self._released = False
        self._retracted: OrderedDict[str, int] = OrderedDict()
        """Retraction counts of the last finished requests that had any (bounded)."""
        self._closed = False
        self._version = 0
        self.abort_on_update = False
        """Partial rollouts recycled: a weight update aborts generations that already hold old-version tokens."""
        self._stats: dict[str, float] = {
            "decode_steps": 0,
            "prefills": 0,
            "prefill_tokens": 0,
            "tokens_generated": 0,
            "busy_seconds": 0.0,
            "requests_finished": 0,
            "requests_aborted": 0,
            "scores": 0,
            "errors": 0,
            "prefix_hits": 0,
            "prefix_tokens_reused": 0,
            "stale_prefix_hits": 0,
            "stale_prefix_tokens_reused": 0,
            "kv_recomputed_tokens": 0,
            "kv_recomputed_on_admit": 0,
            "kv_dropped_too_old": 0,
            "requests_version_gone": 0,
            "resumed_ahead": 0,
            "prefix_copies": 0,
            "evicted_ended": 0,
            "evicted_expired": 0,
            "evicted_live": 0,
            "evicted_live_cut": 0,
            "evicted_expired_spill": 0,
            "kv_spilled": 0,
            "kv_spill_dropped": 0,
            "kv_restored": 0,
            "kv_restored_tokens": 0,
        }
        self.output_rules = OutputRules(self.model_dir, self.model.config.vocab_size)
        self._thread = threading.Thread(target=self._loop, name="embedded-engine", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------------------------------------- public API

    @property
    def keep_versions(self) -> int:
        """Weight versions served at once (``rollout.partial: pin``): the newest and ``keep_versions - 1`` older
        ones, each request generated by the one its ``SamplingParams.weight_version`` names. 1: only the newest."""
        return self._held.keep

    @keep_versions.setter
    def keep_versions(self, n: int) -> None:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"keep_versions must be an int >= 1, got {n!r}")
        self._run_op(lambda: setattr(self._held, "keep", n))

    @property
    def weight_version(self) -> int:
        """The version of the weights the next logits will be computed with."""
        return self._version

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, rid: str | None = None, on_token: OnToken | None = None
    ) -> GenerateResult:
        """Generate from ``input_ids``; cancelling the awaiting task aborts the request.

        ``on_token`` (optional) is called on the decode thread after every sampled token (streaming).
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[GenerateResult] = loop.create_future()

        def deliver(value: GenerateResult | BaseException) -> None:  # on the decode thread
            loop.call_soon_threadsafe(_settle, fut, value)

        rid = self._enqueue(input_ids, sampling, rid, deliver, on_token)
        fut.add_done_callback(lambda f: self.abort(rid) if f.cancelled() else None)
        return await fut

    def submit(
        self,
        input_ids: list[int],
        sampling: SamplingParams | None = None,
        rid: str | None = None,
        on_token: OnToken | None = None,
    ) -> cf.Future[GenerateResult]:
        """Enqueue a request from any thread; the returned future carries its result or error."""
        fut: cf.Future[GenerateResult] = cf.Future()

        def deliver(value: GenerateResult | BaseException) -> None:
            if isinstance(value, BaseException):
                fut.set_exception(value)
            else:
                fut.set_result(value)

        try:
            self._enqueue(input_ids, sampling or SamplingParams(), rid, deliver, on_token)
        except ValueError as exc:
            fut.set_exception(exc)
        return fut

    def generate_sync(
        self,
        input_ids: list[int],
        sampling: SamplingParams | None = None,
        rid: str | None = None,
        timeout: float | None = None,
    ) -> GenerateResult:
        """Blocking :meth:`generate` (not from the decode thread itself)."""
        return self.submit(input_ids, sampling, rid).result(timeout)

    def score(self, ids: list[int], start: int, top_k: int = 0) -> ScoreResult:
        """Log-probs of ``ids[start:]`` each given its prefix (``start >= 1``), with ``top_k`` alternatives if > 0."""
        ids = self._check_ids(ids)
        if not 1 <= start <= len(ids):
            raise ValueError(f"score start must be in [1, {len(ids)}], got {start}")
        limit = self.model.config.max_position_embeddings
        if limit and len(ids) > limit:
            raise ValueError(f"{len(ids)} tokens exceed max_position_embeddings {limit}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {top_k}")
        return self._run_op(lambda: self._do_score(ids, start, top_k))

    def update_weights(self, version: int, named_tensors: dict[str, Any], finite_checked: bool = False) -> None:
        """Validate a whole version (HF names -> tensors), then copy it in between decode steps.

        Raises ValueError naming the problem (unknown or missing name, wrong shape, non-float or non-finite
        values) and keeps the old weights and version. ``finite_checked``: the caller (TransferMesh's receiving
        side, which scans for NaN/inf in the same pass as its checksum) already refused non-finite values in
        these tensors, so the engine skips its own scan of every byte.
        """
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError(f"version must be an int, got {version!r}")
        problem = validate_weights(self.model.config, named_tensors, check_finite=not finite_checked)
        if problem:
            raise ValueError(f"rejected weights for version {version}: {problem}")
        self._run_op(lambda: self._do_update(version, named_tensors))

    def pause(self, mode: PauseMode = "in_place") -> None:
        """Stop decoding after the current step. ``abort`` finishes in-flight requests with their partial output;
        ``retract`` keeps them but drops their KV (re-prefilled on resume); ``in_place`` keeps them and their KV."""
        if mode not in _PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {_PAUSE_MODES}, got {mode!r}")
        self._run_op(lambda: self._do_pause(mode))

    def resume(self) -> None:
        """Continue decoding (requests that arrived while paused are admitted now)."""
        self._run_op(self._do_resume)

    def abort(self, rid: str) -> None:
        """Finish request ``rid`` with ``finish_reason="abort"`` and its partial output; unknown ids are ignored."""
        with self._cv:
            if rid in self._rids:
                self._aborts.add(rid)
                self._cv.notify_all()

    def forget_prefix(self, ids: list[int]) -> None:
        """The episode whose context is ``ids`` ended: its cached entries are the first to go when a slot is
        needed (they stay usable until then: a sibling episode may share their prefix)."""
        ids = [int(t) for t in ids]
        with self._cv:  # not waited for: an episode's end must not wait on a decode step
            if not self._closed:
                self._ops.append((lambda: self._do_forget(ids), cf.Future()))
                self._cv.notify_all()

    def flush_cache(self) -> bool:
        """Drop the prefix cache (KV that no request holds); in-place paused requests keep their own KV."""
        return self._run_op(self._do_flush)

    def release_memory(self) -> None:
        """Free the KV cache (running requests are retracted and wait); generation stops until
        :meth:`resume_memory`. The fp32 weights stay: on CPU there is nowhere cheaper to put them."""
        self._run_op(self._do_release)

    def resume_memory(self) -> None:
        """Reallocate the KV cache freed by :meth:`release_memory`; retracted requests are prefilled again."""
        self._run_op(self._do_resume_memory)

    def retractions(self, rid: str) -> int:
        """How many times request ``rid`` (in flight or among the last finished) lost its slot to a retraction."""
        with self._cv:
            reqs = [*self._running.values(), *self._waiting]
        return next((r.retractions for r in reqs if r.rid == rid), self._retracted.get(rid, 0))

    def stats(self) -> dict[str, Any]:
        """Counters (decode steps, tokens generated, busy seconds in forward passes, ...) and current load."""
        with self._cv:
            waiting = len(self._waiting)
        out: dict[str, Any] = dict(self._stats)
        out.update(
            running=len(self._running),
            waiting=waiting,
            weight_version=self._version,
            versions_served=self._served(),
            kv_ttl_s=self._gaps.ttl_s(),
            spilled_entries=len(self._spill),
            spill_bytes=self._spill.nbytes,
            held_weights_bytes=self._held.nbytes(),
            paused=self._paused,
            released=self._released,
            cached_slots=sum(1 for ids in self._idle.values() if ids),
            stale_slots=len(self._stale),
            kv_on_update=self.kv_on_update,
            max_slots=self.max_slots,
            max_len=self.max_len,
            kv_cache_bytes=self.cache.nbytes(),
        )
        return out

    def close(self) -> None:
        """Stop the decode thread; requests still in flight finish with ``finish_reason="abort"``."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def __enter__(self) -> EmbeddedEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------------------------------- caller-side helpers

    def _check_ids(self, ids: list[int]) -> list[int]:
        out = [int(t) for t in ids]
        if not out:
            raise ValueError("input_ids is empty")
        vocab = self.model.config.vocab_size
        bad = [t for t in out if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids out of range [0, {vocab}): {bad[:5]}")
        return out

    def _enqueue(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        rid: str | None,
        deliver: Deliver,
        on_token: OnToken | None = None,
    ) -> str:
        """Validate and queue one request; return its rid. Raises ValueError for a request that cannot run."""
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        prompt = self._check_ids(input_ids)
        if len(prompt) >= self.max_len:
            raise ValueError(
                f"prompt of {len(prompt)} tokens does not fit max_len={self.max_len} (prompt + output tokens)"
            )
        rid = rid if rid is not None else uuid.uuid4().hex
        pinned = sampling.weight_version
        if pinned is not None and pinned not in self._served():
            raise VersionGone(f"weight version {pinned} is not served (held: {self._served()})")
        rules = self.output_rules.for_request(sampling)
        with self._cv:
            if self._closed:
                raise RuntimeError("engine is closed")
            if rid in self._rids:
                raise ValueError(f"request id {rid!r} is already in flight")
            self._counter += 1
            seed = sampling.seed if sampling.seed is not None else (self._seed * 1_000_003 + self._counter)
            gen = torch.Generator().manual_seed(seed % (2**63))
            req = Request(rid, prompt, sampling, gen, deliver, on_token=on_token, rules=rules)
            if sampling.max_new_tokens == 0:
                safe_deliver(deliver, req.result("length"))
                return rid
            self._rids.add(rid)
            self._waiting.append(req)
            self._cv.notify_all()
        return rid

    def _run_op(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the decode thread between steps and wait for its result."""
        if threading.current_thread() is self._thread:
            return fn()
        fut: cf.Future[T] = cf.Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("engine is closed")
            self._ops.append((fn, fut))
            self._cv.notify_all()
        return fut.result()
