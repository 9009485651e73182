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
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from agentflow.engine import protocol as P
from agentflow.engine.embedded import EmbeddedEngine
from agentflow.engine.qwen2 import load_hf_dir
from agentflow.engine.tensors import deserialize_named_tensors
from agentflow.types import GenerateResult
from transfer_mesh.receiver import WeightReceiverService
from transfer_mesh.transport import choreograph

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


@dataclass
class _Track:
    """Tokens of one request as they are sampled (streaming and stop strings), filled on the event loop."""

    rid: str
    stop_strings: list[str]
    decode: Callable[[list[int]], str] | None
    on_stop: Callable[[str], None]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    stop_at: int | None = None
    matched: str | None = None
    event: asyncio.Event = field(default_factory=asyncio.Event)

    def push(self, tok: int, lp: float, version: int) -> None:
        self.ids.append(tok)
        self.logprobs.append(lp)
        self.versions.append(version)
        if self.stop_strings and self.stop_at is None and self.decode is not None:
            text = self.decode(self.ids)
            hit = next((s for s in self.stop_strings if s in text), None)
            if hit is not None:
                self.stop_at, self.matched = len(self.ids), hit
                self.on_stop(self.rid)
        self.event.set()


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


class SGLangServer:
    """Serves an :class:`EmbeddedEngine` over the SGLang protocol subset; :meth:`app` builds the aiohttp app."""

    def __init__(self, engine: EmbeddedEngine, api_key: str | None = None, model_path: str | None = None) -> None:
        self.engine = engine
        self.api_key = api_key
        self.model_path = model_path or engine.model_dir
        self.tokenizer, self.eos_ids, self.hf_config = _model_files(engine.model_dir)
        max_pos = engine.model.config.max_position_embeddings or engine.max_len
        self.context_len = min(engine.max_len, max_pos)
        self.labels: dict[int, str] = {engine.weight_version: P.DEFAULT_VERSION_LABEL}
        self._session = False
        self._inflight: set[str] = set()
        self._weights_lock = asyncio.Lock()
        self.receivers = WeightReceiverService()

    # ------------------------------------------------------------------------------------------------ plumbing

    def app(self) -> web.Application:
        """The aiohttp application (auth and error middlewares, every route)."""
        app = web.Application(middlewares=[self._auth, self._errors], client_max_size=1 << 30)
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
            return await handler(request)
        except P.ProtocolError as exc:
            return web.json_response(exc.body, status=exc.status)
        except web.HTTPException:
            raise
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception:  # the server keeps serving; the caller sees SGLang's 500
            return web.Response(status=500, text="Internal Server Error")

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
                "weight_version": self._label(),
                "version": SERVER_VERSION,
                "internal_states": [stats],
            }
        )

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.model_path, "object": "model", "created": int(time.time()), "owned_by": "agentflow"}
        card.update(root=self.model_path, parent=None, max_model_len=self.context_len)
        return web.json_response({"object": "list", "data": [card]})

    # -------------------------------------------------------------------------------------------- /generate

    async def generate(self, request: web.Request) -> web.StreamResponse:
        encode = (lambda t: self.tokenizer.encode(t).ids) if self.tokenizer is not None else None
        items, opts = P.parse_generate(
            await self._body(request), self.engine.model.config.vocab_size, self.context_len, self.eos_ids, encode
        )
        if opts.stream:
            if opts.batch:
                raise P.error_message("streaming is supported for a single prompt with n 1 only.")
            return await self._stream(request, items[0], opts)
        replies = await asyncio.gather(*(self._complete(item, opts) for item in items))
        return web.json_response(replies if opts.batch else replies[0])

    def _track(self, item: P.GenItem) -> _Track:
        decode = (lambda ids: self.tokenizer.decode(ids)) if self.tokenizer is not None else None
        return _Track(item.rid or uuid.uuid4().hex, item.stop_strings, decode, self.engine.abort)

    async def _run(self, item: P.GenItem, track: _Track) -> GenerateResult:
        """Generate one item; tokens reach ``track`` on the event loop as they are sampled."""
        loop = asyncio.get_running_loop()
        if track.rid in self._inflight:
            raise P.error_message(f"request id {track.rid!r} is already in flight.")
        self._inflight.add(track.rid)
        try:
            return await self.engine.generate(
                item.prompt,
                item.sampling,
                rid=track.rid,
                on_token=lambda t, lp, v: loop.call_soon_threadsafe(track.push, t, lp, v),
            )
        except ValueError as exc:
            raise P.error_message(str(exc)) from exc
        finally:
            self._inflight.discard(track.rid)

    async def _prompt_logprobs(self, item: P.GenItem, opts: P.GenOptions) -> tuple[list[Any], list[Any]]:
        """``input_token_logprobs`` and ``input_top_logprobs`` for ``prompt[logprob_start_len:]``."""
        if not opts.return_logprob or opts.logprob_start_len < 0:
            return [], []
        prompt = item.prompt
        start = min(opts.logprob_start_len, len(prompt))
        first = max(start, 1)
        k = opts.top_logprobs_num
        res = await self._op(self.engine.score, prompt, first, k) if first < len(prompt) else None
        lps = res.logprobs if res else []
        tops = (res.top_logprobs or []) if res else []
        triples: list[Any] = [[None, prompt[0], None]] if start == 0 else []
        triples += [[lp, tok, None] for lp, tok in zip(lps, prompt[first:], strict=True)]
        top_rows: list[Any] = [None] if start == 0 and k else []
        top_rows += [[[v, t, None] for t, v in row] for row in tops]
        return triples, top_rows

    async def _output_top(self, prompt: list[int], output: list[int], k: int) -> list[Any]:
        if not output or k <= 0:
            return []
        res = await self._op(self.engine.score, prompt + output, len(prompt), k)
        return [[[v, t, None] for t, v in row] for row in res.top_logprobs or []]

    async def _complete(self, item: P.GenItem, opts: P.GenOptions) -> dict[str, Any]:
        t0 = time.monotonic()
        track = self._track(item)
        prompt_lps = await self._prompt_logprobs(item, opts)
        res = await self._run(item, track)
        return await self._reply(item, opts, track, res, prompt_lps, t0, first=True)

    async def _reply(
        self,
        item: P.GenItem,
        opts: P.GenOptions,
        track: _Track,
        res: GenerateResult | None,
        prompt_lps: tuple[list[Any], list[Any]],
        t0: float,
        first: bool,
    ) -> dict[str, Any]:
        """One reply object (a stream chunk while ``res`` is None, else the final one)."""
        ids, lps, vers = (res.output_ids, res.logprobs, res.versions) if res else (track.ids, track.logprobs, [])
        reason = res.finish_reason if res else None
        matched: int | str | None = None
        if res is not None and track.stop_at is not None and track.stop_at <= len(ids):
            ids, lps, vers, reason, matched = (
                ids[: track.stop_at],
                lps[: track.stop_at],
                vers[: track.stop_at],
                "stop",
                track.matched,
            )
        elif reason == "stop":
            matched = ids[-1]
        n = len(ids)
        meta: dict[str, Any] = {
            "id": track.rid,
            "finish_reason": P.finish_reason_json(reason, n, matched),
            "prompt_tokens": len(item.prompt),
            "weight_version": self._label(),
            "num_retractions": self.engine.retractions(track.rid),
        }
        if opts.return_logprob:
            meta["input_token_logprobs"] = prompt_lps[0]
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, ids, strict=True)]
            meta["output_token_logprobs_length"] = n
            if opts.top_logprobs_num > 0:
                meta["input_top_logprobs"] = prompt_lps[1]
                meta["output_top_logprobs"] = await self._output_top(item.prompt, ids, opts.top_logprobs_num)
        cached = res.cached_tokens if res else 0
        meta.update(reasoning_tokens=0, completion_tokens=n, cached_tokens=cached)
        if res is not None:
            meta["weight_versions"] = P.version_spans(vers, self.labels, self.engine.weight_version)
        meta.update(cached_tokens_details={"device": cached, "host": 0} if cached else None, dp_rank=None)
        if res is not None:
            meta["e2e_latency"] = time.monotonic() - t0
        if first:
            meta["response_sent_to_client_ts"] = time.time()
        return {"text": self._text(ids, reason, matched), "output_ids": list(ids), "meta_info": meta}

    def _text(self, ids: list[int], reason: str | None, matched: int | str | None) -> str:
        if self.tokenizer is None:
            return ""
        if reason == "stop" and isinstance(matched, int):
            ids = ids[:-1]
        text = self.tokenizer.decode(list(ids))
        if isinstance(matched, str) and matched in text:
            text = text[: text.index(matched)]
        return text

    async def _stream(self, request: web.Request, item: P.GenItem, opts: P.GenOptions) -> web.StreamResponse:
        """SSE: one cumulative reply object per batch of new tokens, a final one, then ``[DONE]``."""
        t0 = time.monotonic()
        track = self._track(item)
        prompt_lps = await self._prompt_logprobs(item, opts)
        task = asyncio.ensure_future(self._run(item, track))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        sent, first = 0, True
        try:
            await resp.prepare(request)
            while not task.done():
                track.event.clear()
                waiter = asyncio.ensure_future(track.event.wait())
                await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                if len(track.ids) > sent and not task.done() and track.stop_at is None:
                    sent = len(track.ids)
                    chunk = await self._reply(item, opts, track, None, prompt_lps, t0, first)
                    await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    first = False
            final = await self._reply(item, opts, track, task.result(), prompt_lps, t0, first)
            await resp.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
            await resp.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            self.engine.abort(track.rid)
            raise
        except P.ProtocolError as exc:
            if not resp.prepared:
                raise
            await resp.write(f"data: {json.dumps(exc.body)}\n\ndata: [DONE]\n\n".encode())
        return resp

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

    # ------------------------------------------------------------------------------------------- weights

    def _next_version(self, label: Any) -> tuple[int, str]:
        """Int version and wire label for an update that names ``label`` (None: the next int)."""
        current = self.engine.weight_version
        if label is None:
            return current + 1, str(current + 1)
        label = str(label)
        if label.lstrip("-").isdigit():
            return int(label), label
        return max([current, *self.labels]) + 1, label

    async def _apply(
        self, label: Any, partial: dict[str, Any], pause_mode: Any = "none", flush: Any = None, checked: bool = False
    ) -> tuple[str, dict[str, float]]:
        """Apply ``partial`` (HF names -> tensors) on top of the current weights as one new version: pause
        (``pause_mode``), update, flush or keep the prefix cache (``flush``; None: the engine's setting), resume.
        ``checked``: TransferMesh's receiver already refused NaN/inf in ``partial`` (the engine skips its scan)."""
        if pause_mode not in ("none", "in_place", "retract", "abort"):
            raise ValueError(f"pause_mode must be none, in_place, retract or abort; got {pause_mode!r}")
        version, name = self._next_version(label)
        merged = {k: v for k, v in self.engine.model.params.items()}
        merged.update(partial)
        keep = not bool(flush) if flush is not None else self.engine.keep_cache_on_update
        async with self._weights_lock:
            timing = await self._op(
                choreograph,
                self.engine,
                pause_mode,
                not keep,
                lambda: self.engine.update_weights(version, merged, finite_checked=checked),
            )
            if name != str(version):
                self.labels[version] = name
        return name, timing

    @staticmethod
    def _weights_body(body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise P.ProtocolError({"success": False, "message": "request body must be a JSON object"})
        return body

    async def update_from_disk(self, request: web.Request) -> web.Response:
        body = self._weights_body(await self._body(request))
        try:
            model = await self._op(load_hf_dir, str(body.get("model_path") or self.model_path))
            name, _ = await self._apply(body.get("weight_version"), model.params)
        except (OSError, ValueError) as exc:
            reply = {"success": False, "message": f"Failed to update weights: {exc}", "num_paused_requests": 0}
            return web.json_response(reply, status=400)
        message = f"Succeeded to update model weights. Weight version updated to {name}."
        return web.json_response({"success": True, "message": message, "num_paused_requests": 0})

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        body = self._weights_body(await self._body(request))
        if not self._session:
            message = P.SESSION_MESSAGE.format("update_weights_from_tensor")
            return web.json_response({"success": False, "message": message}, status=400)
        if body.get("load_format") not in (None, "direct"):
            message = f"load_format {body.get('load_format')!r} is not supported (use direct)"
            return web.json_response({"success": False, "message": message}, status=400)
        ext = body.get("transfer_mesh")
        try:
            tensors = await self._op(deserialize_named_tensors, body.get("serialized_named_tensors"))
            if ext is not None:  # checksummed buckets: verify the whole version before applying any of it
                tensors = await self._op(self.receivers.decode_packed, ext, tensors, body.get("weight_version"))
            flush = body.get("flush_cache") if ext is not None else None
            pause = body.get("pause_mode", "none")
            name, timing = await self._apply(body.get("weight_version"), tensors, pause, flush, ext is not None)
        except (ValueError, TypeError, OSError, RuntimeError) as exc:
            return web.json_response({"success": False, "message": f"Failed to update weights: {exc}"}, status=400)
        reply: dict[str, Any] = {"success": True, "message": f"Success Weight version updated to {name}."}
        return web.json_response({**reply, **timing} if ext is not None else reply)

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        body = self._weights_body(await self._body(request))
        status, reply = await self._op(self.receivers.init_group, body)
        return web.json_response(reply, status=status)

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        body = self._weights_body(await self._body(request))
        status, reply = await self._op(self.receivers.destroy_group, body)
        return web.json_response(reply, status=status)

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        body = self._weights_body(await self._body(request))
        if not self._session:
            message = P.SESSION_MESSAGE.format("update_weights_from_distributed")
            return web.json_response({"success": False, "message": message}, status=400)
        t0 = time.perf_counter()
        try:  # the engine keeps generating while the version streams in; it stalls only for the apply
            tensors = await self._op(self.receivers.receive, body)
            receive_s = time.perf_counter() - t0
            label, pause = body.get("weight_version"), body.get("pause_mode", "none")
            checked = body.get("load_format") == "transfer_mesh"
            name, timing = await self._apply(label, tensors, pause, body.get("flush_cache"), checked)
        except (ValueError, TypeError, RuntimeError) as exc:
            return web.json_response({"success": False, "message": f"Failed to update weights: {exc}"}, status=400)
        message = f"Succeeded to update parameter online. Weight version updated to {name}."
        reply: dict[str, Any] = {"success": True, "message": message}
        if body.get("load_format") == "transfer_mesh":
            reply.update(receive_s=receive_s, **timing)
        return web.json_response(reply)

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        """The first ``truncate_size`` rows of a parameter as nested lists (SGLang's read-back endpoint)."""
        body = self._weights_body(await self._body(request))
        t = self.engine.model.params.get(str(body.get("name")))
        if t is None:
            raise P.error_message("Get parameter by name failed")
        return web.json_response(t.detach()[: int(body.get("truncate_size", 100))].tolist())

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        self._session = True
        return web.json_response({"success": True, "message": "Success"})

    async def end_weight_update(self, request: web.Request) -> web.Response:
        self._session = False
        return web.json_response({"success": True, "message": "Success"})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = self._weights_body(await self._body(request))
        new = body.get("new_version")
        if not isinstance(new, str | int) or isinstance(new, bool):
            return web.json_response({"success": False, "message": "new_version must be a string"}, status=400)
        if body.get("abort_all_requests"):
            for rid in list(self._inflight):
                self.engine.abort(rid)
        self.labels[self.engine.weight_version] = str(new)
        return web.json_response({"success": True, "message": f"Weight version updated to {new}", "new_version": new})


# ------------------------------------------------------------------------------------------------- running it


def serve(
    model_dir: str,
    host: str = "127.0.0.1",
    port: int = 30000,
    api_key: str | None = None,
    max_slots: int = 32,
    max_len: int = 2048,
    seed: int = 0,
) -> None:
    """Load ``model_dir`` into an embedded engine and serve it over HTTP until interrupted (``agentflow serve``)."""
    engine = EmbeddedEngine(model_dir, max_slots=max_slots, max_len=max_len, seed=seed)
    server = SGLangServer(engine, api_key)
    try:
        web.run_app(server.app(), host=host, port=port, print=None)
    finally:
        server.receivers.close()
        engine.close()
