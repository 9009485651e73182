"""State and helpers that the SGLang server's route groups share (see :mod:`agentflow.engine.server`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from aiohttp import web

from agentflow.engine import protocol as P
from agentflow.engine.embedded import EmbeddedEngine
from transfer_mesh.receiver import WeightReceiverService


class ServerBase:
    """What every route group of :class:`agentflow.engine.server.SGLangServer` reads: the engine, the version
    labels, the tokenizer; plus body parsing and running blocking engine calls off the event loop."""

    # set by SGLangServer.__init__
    engine: EmbeddedEngine
    model_path: str
    tokenizer: Any
    eos_ids: tuple[int, ...]
    context_len: int
    labels: dict[int, str]
    receivers: WeightReceiverService
    _session: bool
    _inflight: set[str]
    _weights_lock: asyncio.Lock

    @staticmethod
    async def _body(request: web.Request) -> Any:
        if not request.can_read_body:
            return {}
        try:
            return await request.json()
        except json.JSONDecodeError as exc:
            raise P.validation_error("body", f"JSON decode error: {exc}") from exc

    async def _op(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a blocking engine call (it waits for the decode thread) off the event loop."""
        return await asyncio.to_thread(fn, *args)

    def _label(self, version: int | None = None) -> str:
        return P.version_label(self.engine.weight_version if version is None else version, self.labels)
