"""The OpenAI-compatible recording proxy (aiohttp, 127.0.0.1, a random per-run API key).

Routes (every one needs ``Authorization: Bearer <key>`` or, as Anthropic clients send it, ``x-api-key: <key>``)::

    GET  /v1/models                                     and  /{trajectory_id}/{attempt}/v1/models
    POST /{trajectory_id}/{attempt}/v1/chat/completions  streaming (SSE) or not, tools, logprobs
    POST /{trajectory_id}/{attempt}/v1/messages          Anthropic's Messages API (anthropic_route.py), and
         /{trajectory_id}/{attempt}/v1/messages/count_tokens
    POST /{trajectory_id}/{attempt}/tools/{name}         the env's tool for subprocess agents: {"arguments": {...}}

A trajectory is opened with :meth:`ProxyServer.open` before its program runs and closed after; calls for an unknown
trajectory id or a stale attempt are refused (404), so a program that outlives its episode cannot write into
another one. Standalone (``agentflow proxy serve``, an ``opener``), an unknown trajectory opens on its first call
and ``POST /v1/chat/completions`` is the :data:`DEFAULT_TRAJECTORY`'s. A request to a path or with a method the
proxy does not serve gets a 404 or 405 naming the routes it does serve. Each call renders its messages with the
model's chat template, generates token-in/token-out on the engine and is recorded by the trajectory's
:class:`~agentflow.proxy.recorder.Recorder`; both routes leave those steps to :mod:`agentflow.proxy.calls` and only
read their wire format's request and write its answer.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import itertools
import json
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from agentflow.chat import ChatTokenizer
from agentflow.proxy import anthropic_wire, calls, route_help, wire
from agentflow.proxy.recorder import Recorder
from agentflow.proxy.types import CallRecord, ProxyError, ToolHandler
from agentflow.types import GenerateResult, InferenceEngine, SamplingParams

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Opener = Callable[[str, str], None]
"""Standalone proxy: open trajectory ``(id, attempt)`` (both as in the path) on its first call, or raise ProxyError."""

#: The trajectory of ``POST /v1/chat/completions`` on a standalone proxy.
DEFAULT_TRAJECTORY = "default"


@dataclass
class _Session:
    recorder: Recorder
    tool_handler: ToolHandler | None = None


class ProxyServer:
    """Serves one engine to black-box programs and records their calls per trajectory.

    ``recycle``: a generation aborted because the weights changed under it is run again from the same input
    (``partial: recycle``); otherwise an engine abort fails the call with 503 ``engine_aborted``.
    """

    def __init__(
        self,
        engine: InferenceEngine,
        tokenizer: ChatTokenizer,
        model_name: str = "agentflow-policy",
        api_key: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        recycle: bool = False,
        max_recycles: int = 4,
        train_side_calls: bool = False,
        opener: Opener | None = None,
        on_call: Callable[[Recorder], None] | None = None,
    ) -> None:
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.train_side_calls, self.opener, self.on_call = train_side_calls, opener, on_call
        self.api_key = api_key or "sk-agentflow-" + secrets.token_urlsafe(24)
        self.host, self.port = host, port
        self.recycle, self.max_recycles = recycle, max_recycles
        self._sessions: dict[str, tuple[int, _Session]] = {}
        self._runner: web.AppRunner | None = None
        self._streams = "on_token" in inspect.signature(engine.generate).parameters
        self.in_flight = 0
        self._call_ids = itertools.count()
        self.max_in_flight = 0
        self.refused = 0

    # ------------------------------------------------------------------------------------------- lifecycle

    async def start(self) -> ProxyServer:
        app = web.Application(middlewares=[self._errors, self._auth], client_max_size=64 << 20)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/{tid}/{attempt}/v1/models", self.models)
        app.router.add_post("/{tid}/{attempt}/v1/chat/completions", self.chat)
        if self.opener is not None:
            app.router.add_post("/v1/chat/completions", self.chat)
        from agentflow.proxy.anthropic_route import AnthropicRoute  # it builds on this module: imported here

        anthropic = AnthropicRoute(self)
        app.router.add_post("/{tid}/{attempt}/v1/messages", anthropic.messages)
        app.router.add_post("/{tid}/{attempt}/v1/messages/count_tokens", anthropic.count_tokens)
        if self.opener is not None:
            app.router.add_post("/v1/messages", anthropic.messages)
        app.router.add_post("/{tid}/{attempt}/tools/{name}", self.tool)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, backlog=1024)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> ProxyServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def base_url(self, trajectory_id: str, attempt: int = 0) -> str:
        """The ``base_url`` an OpenAI client of this trajectory uses (ends in ``/v1``)."""
        return f"{self.url}/{trajectory_id}/{attempt}/v1"

    def anthropic_base_url(self, trajectory_id: str, attempt: int = 0) -> str:
        """The ``base_url`` an Anthropic client of this trajectory uses (the client appends ``/v1/messages``)."""
        return f"{self.url}/{trajectory_id}/{attempt}"

    def tools_url(self, trajectory_id: str, attempt: int = 0) -> str:
        return f"{self.url}/{trajectory_id}/{attempt}/tools"

    # -------------------------------------------------------------------------------------------- sessions

    def open(
        self,
        trajectory_id: str,
        sampling: SamplingParams,
        max_len: int,
        attempt: int = 0,
        client_sampling: bool = False,
        tool_handler: ToolHandler | None = None,
    ) -> Recorder:
        """Start recording a trajectory attempt (a later attempt replaces an earlier one)."""
        if "/" in trajectory_id or not trajectory_id:
            raise ValueError(f"trajectory id must be non-empty and contain no '/': {trajectory_id!r}")
        rec = Recorder(
            trajectory_id, attempt, self.tokenizer, sampling, max_len, client_sampling, self.train_side_calls
        )
        rec.canonical_forcing = bool(getattr(self.engine, "canonical_forcing", False))
        self._sessions[trajectory_id] = (attempt, _Session(rec, tool_handler))
        return rec

    def is_open(self, trajectory_id: str) -> bool:
        return trajectory_id in self._sessions

    def close(self, trajectory_id: str) -> Recorder:
        """Stop accepting calls for the trajectory and return its record."""
        _, session = self._sessions.pop(trajectory_id)
        session.recorder.closed = True
        return session.recorder

    def _session(self, request: web.Request) -> _Session:
        tid = request.match_info.get("tid", DEFAULT_TRAJECTORY)
        attempt = request.match_info.get("attempt", "0")
        entry = self._sessions.get(tid)
        if self.opener is not None and (entry is None or str(entry[0]) != attempt):
            self.opener(tid, attempt)
            entry = self._sessions.get(tid)
        if entry is None or str(entry[0]) != attempt:
            self.refused += 1
            now = ""
            if entry is not None:  # a stale attempt: the base URL of the current one, for this kind of client
                anthropic = anthropic_wire.wants_anthropic(request.path, request.headers)
                now = f"; its current attempt's base URL is {self._base_url_of(tid, anthropic)}"
            raise ProxyError(404, f"unknown trajectory {tid!r} (attempt {attempt}){now}", "invalid_request_error",
                             "unknown_trajectory")  # fmt: skip
        return entry[1]

    # ------------------------------------------------------------------------------------------ middleware

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        given = request.headers.get("Authorization", "")
        key = request.headers.get("x-api-key")  # how Anthropic clients send the key
        bearer_ok = hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode())
        if not (bearer_ok or (key is not None and hmac.compare_digest(key.encode(), self.api_key.encode()))):
            self.refused += 1
            raise ProxyError(401, "Incorrect API key provided.", "invalid_request_error", "invalid_api_key")
        return await handler(request)

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ProxyError as e:
            return _error(request, e)
        except web.HTTPException as e:  # aiohttp's own 404/405: the same error shape, naming the routes served
            err, headers = route_help.route_error(request, e, self._base_url_of)
            return _error(request, err, headers)
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as e:  # the proxy keeps serving; the program sees why
            return _error(request, calls.internal_error(e))

    # ---------------------------------------------------------------------------------------------- routes

    async def models(self, request: web.Request) -> web.Response:
        if "tid" in request.match_info:
            self._session(request)
        if anthropic_wire.wants_anthropic(request.path, request.headers):
            return web.json_response(anthropic_wire.model_list(self.model_name))
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "agentflow"}
        return web.json_response({"object": "list", "data": [model]})

    async def tool(self, request: web.Request) -> web.Response:
        session = self._session(request)
        if session.tool_handler is None:
            raise ProxyError(404, "this trajectory has no env tools", code="no_tools")
        body = await _json(request)
        args = body.get("arguments", {}) if isinstance(body, dict) else None
        if not isinstance(args, dict):
            raise wire.bad("'arguments' must be a JSON object", "arguments")
        try:
            output, done = await session.tool_handler(request.match_info["name"], args)
        except RuntimeError as e:
            raise ProxyError(409, str(e), code="episode_over") from None
        return web.json_response({"output": output, "done": done})

    def _base_url_of(self, trajectory_id: str, anthropic: bool = False) -> str | None:
        """The open trajectory's base URL for an OpenAI client, or for an Anthropic one; None when it is not open."""
        entry = self._sessions.get(trajectory_id)
        if entry is None:
            return None
        return (self.anthropic_base_url if anthropic else self.base_url)(trajectory_id, entry[0])

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await calls.serve(self, request, self._chat)

    async def _chat(self, request: web.Request, rec: Recorder, t0: float) -> web.StreamResponse:
        req = wire.parse_request(await _json(request))
        if req.model != self.model_name:
            raise ProxyError(404, f"The model '{req.model}' does not exist; this proxy serves '{self.model_name}'.",
                             code="model_not_found", param="model")  # fmt: skip
        async with calls.Call(self, rec, req, request.headers, t0) as call:  # a bad schema is refused here
            if req.stream:
                return await self._stream(request, call)
            out = await call.run()
            res = out.result
            body = wire.completion(
                wire.new_id("chatcmpl"), self.model_name, _public(out.reply),
                wire.finish_reason(out.reply, res.finish_reason),
                wire.usage_of(len(out.record.input_ids), len(res.output_ids), res.cached_tokens),
                self._extra(req, out.record, res),
            )  # fmt: skip
            return web.json_response(body, headers=call.sampling_header)

    def _extra(self, req: wire.ChatRequest, call: CallRecord, res: GenerateResult) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if req.logprobs:
            toks = [self.tokenizer.decode([t]) for t in call.output_ids]
            top = None
            if req.top_logprobs and res.top_logprobs is not None:
                top = [[(self.tokenizer.decode([i]), lp) for i, lp in row] for row in res.top_logprobs]
            extra["logprobs"] = wire.logprobs_block(toks, call.logprobs, top)
        if req.return_token_ids:
            extra.update(token_ids=call.output_ids, prompt_token_ids=call.input_ids, weight_versions=call.versions)
        return extra

    async def _stream(self, request: web.Request, call: calls.Call) -> web.StreamResponse:
        """Server-sent events: content deltas as tokens arrive, tool calls and the finish reason at the end; a
        failure after the stream began is an error event, as OpenAI sends it."""
        cid, model = wire.new_id("chatcmpl"), self.model_name

        async def body(resp: web.StreamResponse) -> None:
            async def text(delta: str) -> None:
                await _sse(resp, wire.chunk(cid, model, {"content": delta}))

            await _sse(resp, wire.chunk(cid, model, {"role": "assistant", "content": ""}))
            await self._stream_tail(resp, cid, call.req, await call.run(on_text=text))

        async def failed(resp: web.StreamResponse, err: ProxyError) -> None:
            await _sse(resp, err.body())
            await resp.write(b"data: [DONE]\n\n")

        return await call.stream(request, body, failed)

    async def _stream_tail(self, resp: web.StreamResponse, cid: str, req: wire.ChatRequest, out: calls.Outcome) -> None:
        model, reply, res, call = self.model_name, out.reply, out.result, out.record
        tool_calls = wire.openai_tool_calls(reply)
        if tool_calls:
            delta = {"tool_calls": [{"index": i, **c} for i, c in enumerate(tool_calls)]}
            await _sse(resp, wire.chunk(cid, model, delta))
        await _sse(resp, wire.chunk(cid, model, {}, wire.finish_reason(reply, res.finish_reason),
                                    **self._extra(req, call, res)))  # fmt: skip
        if req.include_usage:
            usage = wire.usage_of(len(call.input_ids), len(res.output_ids), res.cached_tokens)
            body = wire.chunk(cid, model, {})
            body["choices"], body["usage"] = [], usage
            await _sse(resp, body)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()


def _error(request: web.Request, err: ProxyError, headers: Any = None) -> web.Response:
    """The error as JSON in the caller's API shape: Anthropic's for Anthropic clients, OpenAI's otherwise."""
    anthropic = anthropic_wire.wants_anthropic(request.path, request.headers)
    body = anthropic_wire.error_body(err) if anthropic else err.body()
    return web.json_response(body, status=err.status, headers=headers)


async def _sse(resp: web.StreamResponse, obj: dict[str, Any]) -> None:
    await resp.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")


async def _json(request: web.Request) -> Any:
    try:
        return await request.json(loads=json.loads)
    except json.JSONDecodeError as e:
        raise wire.bad(f"request body is not valid JSON ({e.msg} at position {e.pos})") from None


def _public(reply: dict[str, Any]) -> dict[str, Any]:
    return {"content": reply["content"], "tool_calls": reply.get("tool_calls", [])}
