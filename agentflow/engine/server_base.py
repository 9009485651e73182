"""State and helpers that the SGLang server's route groups share (see :mod:`agentflow.engine.server`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from agentflow.engine import protocol as P
from agentflow.engine.embedded import EmbeddedEngine
from transfer_mesh.receiver import WeightReceiverService

#: Request bodies past this size are parsed, validated and tokenized on a worker thread, not on the event loop.
OFFLOAD_BYTES = 64 << 10
#: Outputs longer than this (tokens) are detokenized on a worker thread.
OFFLOAD_TOKENS = 4096
#: Worker threads for request parsing and (de)tokenization.
REQUEST_THREADS = 4


class ServerBase:
    """What every route group of :class:`agentflow.engine.server.SGLangServer` reads: the engine, the version
    labels, the tokenizer; plus body parsing and running blocking or CPU-heavy work off the event loop."""

    # set by SGLangServer.__init__
    engine: EmbeddedEngine
    model_path: str
    tokenizer: Any
    eos_ids: tuple[int, ...]
    context_len: int
    labels: dict[int, str]
    receivers: WeightReceiverService
    max_request_bytes: int
    _session: bool
    _inflight: set[str]
    _weights_lock: asyncio.Lock
    _workers: ThreadPoolExecutor | None

    @staticmethod
    async def _raw(request: web.Request) -> bytes | None:
        """The request body (None: the request has none). aiohttp refuses one past ``client_max_size``."""
        return await request.read() if request.can_read_body else None

    @staticmethod
    def _json(raw: bytes | None) -> Any:
        return {} if raw is None else P.json_body(raw)

    async def _body(self, request: web.Request) -> Any:
        raw = await self._raw(request)
        return await self._sized(len(raw or b""), OFFLOAD_BYTES, self._json, raw)

    async def _op(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a blocking engine call (it waits for the decode thread) off the event loop."""
        return await asyncio.to_thread(fn, *args)

    async def _sized(self, size: int, limit: int, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, on a worker thread when ``size`` is past ``limit`` (CPU work that grows with a request:
        JSON, validation, tokenization), else here (a thread hop would cost more than the work)."""
        if size <= limit:
            return fn(*args)
        if self._workers is None:
            self._workers = ThreadPoolExecutor(REQUEST_THREADS, thread_name_prefix="sglang-request")
        return await asyncio.get_running_loop().run_in_executor(self._workers, fn, *args)

    async def _close_workers(self, app: web.Application) -> None:
        if self._workers is not None:
            self._workers.shutdown(wait=False, cancel_futures=True)
            self._workers = None

    def _encode(self, text: str) -> list[int]:
        """Token ids of ``text``. The batch call releases the GIL while it tokenizes (``Tokenizer.encode`` holds it
        throughout: seconds for a few MB of text), so the event loop keeps serving from the worker thread."""
        batch = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)  # fast: no offsets
        return batch([text])[0].ids

    async def _decode(self, ids: list[int]) -> str:
        """Text of ``ids``; long outputs are decoded on a worker thread (``decode_batch`` releases the GIL)."""
        if len(ids) <= OFFLOAD_TOKENS:
            return self.tokenizer.decode(ids)
        return await self._sized(len(ids), OFFLOAD_TOKENS, lambda: self.tokenizer.decode_batch([ids])[0])

    def _label(self, version: int | None = None) -> str:
        return P.version_label(self.engine.weight_version if version is None else version, self.labels)
