"""One model call through the recording proxy, whatever wire format it arrived in.

The OpenAI route (:mod:`agentflow.proxy.server`) and the Anthropic route (:mod:`agentflow.proxy.anthropic_route`)
each turn a request body into a :class:`~agentflow.proxy.wire.ChatRequest` and shape the answer; everything in
between happens here, once: :func:`serve` counts a refused call in its trajectory's record and tells the server's
``on_call`` of every call; :class:`Call` plans the call with the trajectory's Recorder, fixes its sampling (so a
request the Recorder refuses, a schema it cannot constrain to, fails before a stream is opened), generates it on
the engine (run again from the same input when a weight update aborted it and the server recycles), builds the
reply, and commits it, or releases the plan when the call ends any other way (an error, a client that went away).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from aiohttp import web

from agentflow.chat import ChatTokenizer
from agentflow.proxy import wire
from agentflow.proxy.recorder import Plan, Recorder
from agentflow.proxy.types import SEGMENT_HEADER, CallRecord, ProxyError
from agentflow.types import GenerateResult, SamplingParams

if TYPE_CHECKING:
    from agentflow.proxy.server import ProxyServer

R = TypeVar("R")
OnText = Callable[[str], Awaitable[None]]
"""Receives the reply's text piece by piece as the tokens arrive (only pieces that are not empty)."""


async def serve(
    server: ProxyServer, request: web.Request, handle: Callable[[web.Request, Recorder, float], Awaitable[R]]
) -> R:
    """Answer one call of the request's trajectory with ``handle(request, recorder, t0)``.

    A :class:`ProxyError` it raises is a refused call: the agent's to handle (an error observation), counted in
    its trajectory's record. ``server.on_call`` hears of every call, answered or refused.
    """
    t0 = time.perf_counter()
    rec = server._session(request).recorder
    try:
        return await handle(request, rec, t0)
    except ProxyError as e:
        rec.refuse(e)
        raise
    finally:
        if server.on_call is not None:
            server.on_call(rec)


def internal_error(e: BaseException) -> ProxyError:
    """What the program is told of an exception the proxy did not expect (it keeps serving)."""
    return ProxyError(500, f"proxy error: {type(e).__name__}: {e}", "server_error", "internal_error")


@dataclass
class Outcome:
    """A committed call: what the wire formats build their answer from."""

    reply: dict[str, Any]
    """The assistant message as the program receives it (and as the record holds it)."""
    result: GenerateResult
    record: CallRecord


class Call:
    """One call of a trajectory: ``async with Call(...) as call`` plans it and fixes its sampling
    (:attr:`sampling_header` is then set), :meth:`run` generates and commits it, and leaving the block releases a
    plan that was not committed, so its segment may be extended again.

    ``tool_id`` makes the id of each tool call in the reply (the Recorder's own ids when None); the record holds
    the ids the program got.
    """

    def __init__(
        self,
        server: ProxyServer,
        rec: Recorder,
        req: wire.ChatRequest,
        headers: Mapping[str, str],
        t0: float,
        tool_id: Callable[[], str] | None = None,
    ) -> None:
        self.server, self.rec, self.req, self.headers, self.t0 = server, rec, req, headers, t0
        self.tool_id = tool_id
        self.sampling_header: dict[str, str] = {}
        self._plan: Plan | None = None
        self._sampling: SamplingParams | None = None
        self.record: CallRecord | None = None

    @property
    def plan(self) -> Plan:
        if self._plan is None:
            raise RuntimeError("the call is not planned yet (use it as 'async with')")
        return self._plan

    async def __aenter__(self) -> Call:
        self._plan = self.rec.plan(self.req, self.headers.get(SEGMENT_HEADER))
        server = self.server
        server.in_flight += 1
        server.max_in_flight = max(server.max_in_flight, server.in_flight)
        try:
            self._sampling = self.rec.sampling_for(self.req, self._plan)
        except BaseException:
            self._end()
            raise
        self.sampling_header = wire.sampling_header(self._sampling)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._end()

    def _end(self) -> None:
        self.server.in_flight -= 1
        if self.record is None:
            self.rec.release(self.plan)  # nothing recorded
        else:
            self.record.total_s = time.perf_counter() - self.t0

    async def stream(
        self,
        request: web.Request,
        body: Callable[[web.StreamResponse], Awaitable[None]],
        failed: Callable[[web.StreamResponse, ProxyError], Awaitable[None]],
    ) -> web.StreamResponse:
        """Answer as server-sent events (with the sampling header): ``body`` writes the stream; a failure before it
        began is raised (a plain error response), one after is ``failed``'s error event, as both APIs send it."""
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **self.sampling_header}
        resp = web.StreamResponse(headers=headers)
        try:
            await resp.prepare(request)
            await body(resp)
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as e:
            if not resp.prepared:
                raise
            await failed(resp, self.refuse(e))
        return resp

    def refuse(self, e: Exception) -> ProxyError:
        """The error a response already under way reports for ``e`` (as an event of its stream), counted as a
        refused call; an unexpected exception is an internal error, as the server's error middleware makes it."""
        err = e if isinstance(e, ProxyError) else internal_error(e)
        self.rec.refuse(err)
        return err

    async def run(self, on_text: OnText | None = None) -> Outcome:
        """Generate, build the reply and commit it. With ``on_text``, the reply's text is streamed to it as the
        tokens arrive, up to its first tool call or stop string (tool calls are the reply's, whole, at the end)."""
        if on_text is None:
            res, engine_s, recycled = await self._generate()
            reply = self._reply(res)
        else:
            streamer = ContentStream(self.server.tokenizer, self.req.stop, self.req.parse_tools)
            res, engine_s, recycled = await self._streamed(streamer, on_text)
            reply = self._reply(res)
            reply["content"] = streamer.finish(res.output_ids, reply["content"])
            for delta in streamer.pending:
                await on_text(delta)
        self.record = self.rec.commit(self.plan, res, reply, engine_s=engine_s, recycled=recycled)
        return Outcome(reply, res, self.record)

    def _reply(self, res: GenerateResult) -> dict[str, Any]:
        reply = self.rec.reply_for(res.output_ids, self.req)
        if self.tool_id is not None:
            for call in reply.get("tool_calls", []):
                call["id"] = self.tool_id()
        return reply

    async def _streamed(self, streamer: ContentStream, on_text: OnText) -> tuple[GenerateResult, float, int]:
        """The generation, its tokens fed to ``streamer`` and its text to ``on_text`` as they come; a generation
        still running when this ends early (the client went away) is cancelled, which aborts it on the engine."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        generation = asyncio.create_task(self._generate(lambda *a: loop.call_soon_threadsafe(queue.put_nowait, a)))
        try:
            while not generation.done() or not queue.empty():
                getter = asyncio.ensure_future(queue.get())
                try:
                    await asyncio.wait({getter, generation}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    got = getter.done()
                    if not got:
                        getter.cancel()
                if not got:
                    continue
                delta = streamer.push(*getter.result())
                if delta:
                    await on_text(delta)
            return generation.result()
        finally:
            if not generation.done():
                generation.cancel()

    async def _generate(self, on_token: Callable | None = None) -> tuple[GenerateResult, float, int]:
        """Run the call on the engine: (result, engine seconds, recycled generations). A generation aborted by a
        weight update is run again from the same input when the server recycles, else the call fails (503)."""
        server, rec, plan, sampling = self.server, self.rec, self.plan, self._sampling
        assert sampling is not None  # set with the plan
        engine_s, recycled = 0.0, 0
        while True:
            version = server.engine.weight_version
            rid = f"{rec.trajectory_id}:{rec.attempt}:{next(server._call_ids)}:{recycled}"  # concurrent calls differ
            t = time.perf_counter()
            kwargs = {"on_token": on_token} if on_token is not None and server._streams else {}
            res = await server.engine.generate(list(plan.input_ids), sampling, rid=rid, **kwargs)
            engine_s += time.perf_counter() - t
            if res.finish_reason != "abort":
                return res, engine_s, recycled
            if not (server.recycle and server.engine.weight_version != version and recycled < server.max_recycles):
                raise ProxyError(503, "the engine aborted the generation", "server_error", "engine_aborted")
            recycled += 1
            if on_token is not None:
                on_token(None, 0.0, -1)  # tell the stream to forget the aborted tokens


class ContentStream:
    """Incremental text of the model's tokens, up to its first tool call (tool calls are sent whole at the end)
    or stop string (text that could be the start of one is held back until it is known not to be)."""

    def __init__(self, tokenizer: ChatTokenizer, stop: tuple[str, ...] = (), parse_tools: bool = True) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = ""
        self.stopped = False
        self.pending: list[str] = []
        self.stop, self.parse_tools = stop, parse_tools
        self.hold = max((len(x) for x in stop), default=1) - 1

    def push(self, token: int | None, logprob: float, version: int) -> str:
        if token is None:  # the generation was recycled: the new one starts over (text already sent stays)
            self.ids = []
            return ""
        self.ids.append(token)
        if self.stopped or token in self.tokenizer.stop_ids:
            return ""
        text = self.tokenizer.decode(self.ids)
        cuts = [i for i in (text.find(x) for x in self.stop) if i >= 0]
        if self.parse_tools and (i := text.find("<tool_call>")) >= 0:
            cuts.append(i)
        if cuts:
            text, self.stopped = text[: min(cuts)], True
        elif self.hold:
            text = text[: len(text) - self.hold]
        if text.endswith("\ufffd") or not text.startswith(self.sent):  # a partial UTF-8 character: wait
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta

    def finish(self, output_ids: list[int], content: str) -> str:
        """The content the program received in total; what is still missing of ``content`` goes to ``pending``."""
        if content.startswith(self.sent) and len(content) > len(self.sent):
            self.pending.append(content[len(self.sent) :])
            self.sent = content
        return self.sent
