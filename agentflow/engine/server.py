"""HTTP serving of the embedded engine over the SGLang protocol subset (aiohttp, 127.0.0.1 by default).

Routes, field names, reply shapes and status codes follow SGLang 0.5.x (recorded replies: ``tests/fixtures/sglang``),
so one client (:mod:`agentflow.engine.sglang_client`) drives this server and real SGLang servers alike. Endpoints that
change state (pause, continue, abort, flush, weights, memory) require ``Authorization: Bearer <api_key>`` when the
server has a key; reads (``/health``, ``/model_info``, ``/server_info``) and ``/generate`` do not.

Deliberate differences from SGLang: out-of-vocabulary or negative ids get a 400 (SGLang's process dies); a list of
``sampling_params`` for a single prompt gets a 400 (SGLang answers 500); a weight update while requests are paused
in place answers 200 (SGLang answers 400 although it did update, because it cannot flush their KV; our requests
keep their own KV and the prefix cache is flushed). Distributed weight updates are served over gloo only (SGLang uses
NCCL on GPUs); with ``load_format: "transfer_mesh"`` they carry TransferMesh's checksummed buckets, and with a
``transfer_mesh`` field ``/update_weights_from_tensor`` does too (see :mod:`transfer_mesh.receiver`). Both accept
``pause_mode`` (``none`` by default: the engine applies a version between decode steps) and report ``stall_s``.
A body over the request-size limit (``max_request_bytes``, 64 MiB by default) gets a 413 and one that is not UTF-8
a 400, both with JSON bodies (SGLang has no limit). Large bodies are parsed and tokenized on worker threads, so
``/health`` and the other routes keep answering while a multi-megabyte prompt is tokenized.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from agentflow.engine import protocol as P
from agentflow.engine.embedded import EmbeddedEngine
from agentflow.engine.server_generate import GenerateRoutes
from agentflow.engine.server_weights import WeightRoutes
from transfer_mesh.receiver import WeightReceiverService

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
PROTECTED = {
    "/pause_generation",
    "/continue_generation",
    "/abort_request",
    "/flush_cache",
    "/update_weights_from_disk",
    "/update_weights_from_tensor",
    "/update_weights_from_distributed",
    "/init_weights_update_group",
    "/destroy_weights_update_group",
    "/begin_weight_update",
    "/end_weight_update",
    "/update_weight_version",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/get_weights_by_name",
}
SERVER_VERSION = "0.5.23-agentflow"
#: Largest request body by default (``agentflow serve --max-request-mb``); weight updates carry shared-memory
#: handles, not tensors, so only very large prompt batches come near it.
DEFAULT_MAX_REQUEST_BYTES = 64 << 20


def _model_files(model_dir: str) -> tuple[Any, tuple[int, ...], dict[str, Any]]:
    """Tokenizer (or None), EOS ids and config.json of a model directory."""
    root = Path(model_dir)
    cfg = json.loads((root / "config.json").read_text())
    eos: list[int] = []
    for path in (root / "config.json", root / "generation_config.json"):
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            eos += value if isinstance(value, list) else [value] if isinstance(value, int) else []
    tokenizer = None
    if (root / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
    return tokenizer, tuple(dict.fromkeys(eos)), cfg


class SGLangServer(GenerateRoutes, WeightRoutes):
    """Serves an :class:`EmbeddedEngine` over the SGLang protocol subset; :meth:`app` builds the aiohttp app.

    The routes come in groups: reads and pause/abort/flush/memory here, ``/generate`` in
    :mod:`agentflow.engine.server_generate`, weight updates in :mod:`agentflow.engine.server_weights`.
    """

    def __init__(
        self,
        engine: EmbeddedEngine,
        api_key: str | None = None,
        model_path: str | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    ) -> None:
        if max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be at least 1, got {max_request_bytes}")
        self.engine = engine
        self.max_request_bytes = max_request_bytes
        self.api_key = api_key
        self.model_path = model_path or engine.model_dir
        self.tokenizer, self.eos_ids, self.hf_config = _model_files(engine.model_dir)
        max_pos = engine.model.config.max_position_embeddings or engine.max_len
        self.context_len = min(engine.max_len, max_pos)
        self.labels: dict[int, str] = {engine.weight_version: P.DEFAULT_VERSION_LABEL}
        self._session = False
        self._inflight: set[str] = set()
        self._weights_lock = asyncio.Lock()
        self._workers = None
        self.receivers = WeightReceiverService()

    # ------------------------------------------------------------------------------------------------ plumbing

    def app(self) -> web.Application:
        """The aiohttp application (auth and error middlewares, every route)."""
        app = web.Application(middlewares=[self._auth, self._errors], client_max_size=self.max_request_bytes)
        app.on_cleanup.append(self._close_workers)
        get, post = (
            {
                "/health": self.health,
                "/health_generate": self.health_generate,
                "/model_info": self.model_info,
                "/get_model_info": self.model_info,
                "/server_info": self.server_info,
                "/get_server_info": self.server_info,
                "/flush_cache": self.flush_cache,
                "/v1/models": self.models,
            },
            {
                "/generate": self.generate,
                "/abort_request": self.abort_request,
                "/pause_generation": self.pause_generation,
                "/continue_generation": self.continue_generation,
                "/flush_cache": self.flush_cache,
                "/update_weights_from_disk": self.update_from_disk,
                "/update_weights_from_tensor": self.update_from_tensor,
                "/update_weights_from_distributed": self.update_from_distributed,
                "/init_weights_update_group": self.init_weights_update_group,
                "/destroy_weights_update_group": self.destroy_weights_update_group,
                "/begin_weight_update": self.begin_weight_update,
                "/end_weight_update": self.end_weight_update,
                "/update_weight_version": self.update_weight_version,
                "/get_weights_by_name": self.get_weights_by_name,
                "/release_memory_occupation": self.release_memory,
                "/resume_memory_occupation": self.resume_memory,
            },
        )
        for path, handler in get.items():
            app.router.add_get(path, handler)
        for path, handler in post.items():
            app.router.add_post(path, handler)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self.api_key and request.path in PROTECTED:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            if (request.content_length or 0) > self.max_request_bytes:  # refused before a byte of it is read
                raise P.request_too_large(self.max_request_bytes)
            return await handler(request)
        except P.ProtocolError as exc:
            return web.json_response(exc.body, status=exc.status)
        except web.HTTPRequestEntityTooLarge:  # aiohttp's (text) 413 for a chunked or compressed body: ours is JSON
            refused = P.request_too_large(self.max_request_bytes)
            return web.json_response(refused.body, status=refused.status)
        except web.HTTPException:
            raise
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception:  # the server keeps serving; the caller sees SGLang's 500
            return web.Response(status=500, text="Internal Server Error")

    # ------------------------------------------------------------------------------------------- read routes

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def health_generate(self, request: web.Request) -> web.Response:
        if self.engine.stats()["paused"] is None:
            from agentflow.types import SamplingParams

            await self.engine.generate([0], SamplingParams(temperature=0.0, max_new_tokens=1))
        return web.Response()

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.model_path,
                "served_model_name": self.model_path,
                "tokenizer_path": self.model_path if self.tokenizer is not None else None,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self._label(),
                "load_format": "auto",
                "reasoning_parser": None,
                "tool_call_parser": None,
                "disaggregation_mode": "null",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": self.hf_config.get("model_type"),
                "architectures": self.hf_config.get("architectures"),
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        stats = self.engine.stats()
        return web.json_response(
            {
                "model_path": self.model_path,
                "context_length": self.context_len,
                "max_running_requests": self.engine.max_slots,
                "max_total_tokens": self.engine.max_slots * self.engine.max_len,
                "dtype": "float32",
                "device": "cpu",
                "disable_radix_cache": not self.engine.prefix_cache,
                "grammar_backend": "llguidance",  # ebnf is read as Lark, as SGLang's llguidance backend reads it
                "weight_version": self._label(),
                "version": SERVER_VERSION,
                "transfer_mesh": True,  # verifies TransferMesh buckets (a plain SGLang server would skip them)
                "enable_deterministic_inference": True,  # sampling_seed is always honoured here
                "internal_states": [stats],
            }
        )

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.model_path, "object": "model", "created": int(time.time()), "owned_by": "agentflow"}
        card.update(root=self.model_path, parent=None, max_model_len=self.context_len)
        return web.json_response({"object": "list", "data": [card]})

    # -------------------------------------------------------------------------------------------- /generate

    # ------------------------------------------------------------------------------- pause, abort, flush

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if not isinstance(body, dict):
            raise P.validation_error("body", "Value error, must be a JSON object")
        rid = body.get("rid")
        if body.get("abort_all"):
            for r in list(self._inflight):
                self.engine.abort(r)
        elif isinstance(rid, str):
            self.engine.abort(rid)
        elif rid is not None:
            raise P.validation_error("rid", "Value error, must be str")
        return web.Response()

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        mode = body.get("mode", "abort") if isinstance(body, dict) else None
        if mode not in ("abort", "retract", "in_place"):
            raise P.error_message(f"mode must be one of abort, retract, in_place; got {mode!r}.")
        await self._op(self.engine.pause, mode)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self._op(self.engine.resume)
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.engine.stats()["running"] > 0:  # as SGLang: not while requests sit in the running batch
            return web.Response(status=400, text=P.FLUSH_FAILED_TEXT)
        await self._op(self.engine.flush_cache)
        return web.Response(text=P.FLUSH_OK_TEXT)

    async def release_memory(self, request: web.Request) -> web.Response:
        await self._op(self.engine.release_memory)
        return web.json_response(None)

    async def resume_memory(self, request: web.Request) -> web.Response:
        await self._op(self.engine.resume_memory)
        return web.json_response(None)


# ------------------------------------------------------------------------------------------------- running it


def serve(
    model_dir: str,
    host: str = "127.0.0.1",
    port: int = 30000,
    api_key: str | None = None,
    max_slots: int = 32,
    max_len: int = 2048,
    seed: int = 0,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> None:
    """Load ``model_dir`` into an embedded engine and serve it over HTTP until interrupted (``agentflow serve``)."""
    engine = EmbeddedEngine(model_dir, max_slots=max_slots, max_len=max_len, seed=seed)
    server = SGLangServer(engine, api_key, max_request_bytes=max_request_bytes)
    try:
        web.run_app(server.app(), host=host, port=port, print=None)
    finally:
        server.receivers.close()
        engine.close()
