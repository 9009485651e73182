"""The Anthropic Messages route of the recording proxy: ``POST /{trajectory_id}/{attempt}/v1/messages``.

It serves a call as the OpenAI route does, on the same path through the proxy: the body becomes the OpenAI chat
request it means (:mod:`agentflow.proxy.anthropic_wire`), the trajectory's Recorder plans it (a call that resends
the conversation plus the previous reply extends its segment), the server's ``_generate`` runs it on the engine, and
the Recorder commits it. Only the reply's shape differs: a ``message`` object, or Anthropic's stream events.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from agentflow.chat import render_conversation
from agentflow.proxy import anthropic_wire as aw
from agentflow.proxy import wire
from agentflow.proxy.recorder import Plan, Recorder, _with_system
from agentflow.proxy.server import ProxyServer, _ContentStream, _json
from agentflow.proxy.types import SEGMENT_HEADER, ProxyError
from agentflow.types import GenerateResult


class AnthropicRoute:
    """The Messages handler of one :class:`~agentflow.proxy.server.ProxyServer`."""

    def __init__(self, server: ProxyServer) -> None:
        self.server = server

    async def messages(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        server = self.server
        rec = server._session(request).recorder
        try:  # as on the OpenAI route: a refused call is the agent's to handle, and counted in its record
            return await self._messages(request, rec, t0)
        except ProxyError as e:
            rec.refuse(e)
            raise
        finally:
            if server.on_call is not None:
                server.on_call(rec)

    async def _messages(self, request: web.Request, rec: Recorder, t0: float) -> web.StreamResponse:
        server = self.server
        parsed = aw.parse_request(await _json(request))
        if parsed.chat.model != server.model_name:
            raise ProxyError(404, f"model: {parsed.chat.model} (this server serves {server.model_name!r})",
                             code="model_not_found", param="model")  # fmt: skip
        plan = rec.plan(parsed.chat, request.headers.get(SEGMENT_HEADER))
        server.in_flight += 1
        server.max_in_flight = max(server.max_in_flight, server.in_flight)
        try:
            if parsed.chat.stream:
                return await _Stream(self, request, rec, parsed, plan).run(t0)  # commits or releases the plan
            return await self._complete(rec, parsed, plan, t0)
        finally:
            server.in_flight -= 1

    async def _complete(self, rec: Recorder, parsed: aw.MessagesRequest, plan: Plan, t0: float) -> web.Response:
        try:
            used = wire.sampling_header(rec.sampling_for(parsed.chat, plan))  # a bad grammar is refused here
            res, engine_s, recycled = await self.server._generate(rec, parsed.chat, plan)
            reply = self.reply(rec, res, parsed)
        except BaseException:
            rec.release(plan)  # nothing recorded; the segment may be extended again
            raise
        call = rec.commit(plan, res, reply, engine_s=engine_s, recycled=recycled)
        use = aw.usage(len(call.input_ids), len(res.output_ids), res.cached_tokens)
        body = aw.message(aw.new_id("msg"), self.server.model_name, reply, self.stop(parsed, res, reply), use)
        call.total_s = time.perf_counter() - t0
        return web.json_response(body, headers=used)

    async def count_tokens(self, request: web.Request) -> web.Response:
        """``/v1/messages/count_tokens``: the prompt's tokens as a fresh render (a call that extends a segment
        reuses its recorded ids, which may encode the replies differently: an estimate, as Anthropic's is)."""
        server = self.server
        server._session(request)  # only an open trajectory's, as every call
        req = aw.parse_count_request(await _json(request))
        if req.model != server.model_name:
            raise ProxyError(404, f"model: {req.model} (this server serves {server.model_name!r})",
                             code="model_not_found", param="model")  # fmt: skip
        text = render_conversation(_with_system(req.messages, req.tools), req.tools or None, add_generation_prompt=True)
        return web.json_response({"input_tokens": len(server.tokenizer.encode(text))})

    def reply(self, rec: Recorder, res: GenerateResult, parsed: aw.MessagesRequest) -> dict[str, Any]:
        """The Recorder's reply with Anthropic tool-use ids, so the record holds the ids the program got."""
        reply = rec.reply_for(res.output_ids, parsed.chat)
        for call in reply.get("tool_calls", []):
            call["id"] = aw.new_id("toolu")
        return reply

    def stop(self, parsed: aw.MessagesRequest, res: GenerateResult, reply: dict[str, Any]) -> tuple[str, str | None]:
        tok = self.server.tokenizer
        natural = bool(res.output_ids) and res.output_ids[-1] in tok.stop_ids
        text = tok.decode(res.output_ids) if parsed.stop_sequences else ""
        return aw.stop_reason(reply, res.finish_reason, text, natural, parsed.stop_sequences)


class _Stream:
    """One streamed Messages call: ``message_start``, content blocks as the tokens arrive, ``message_delta``,
    ``message_stop``; a failure after the stream began is an ``error`` event, as Anthropic's API sends it."""

    def __init__(
        self, route: AnthropicRoute, request: web.Request, rec: Recorder, parsed: aw.MessagesRequest, plan: Plan
    ) -> None:
        self.route, self.request, self.rec, self.parsed, self.plan = route, request, rec, parsed, plan
        self.resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        self.index = 0  # the index of the next content block
        self.text_open = False
        self.held = ""

    async def run(self, t0: float) -> web.StreamResponse:
        server, rec, plan, resp = self.route.server, self.rec, self.plan, self.resp
        committed = False
        generation: asyncio.Task | None = None
        try:
            resp.headers.update(wire.sampling_header(rec.sampling_for(self.parsed.chat, plan)))  # before any event
            await resp.prepare(self.request)
            start = aw.message(
                aw.new_id("msg"), server.model_name, None, (None, None), aw.usage(len(plan.input_ids), 0)
            )
            await resp.write(aw.event("message_start", message=start))
            await resp.write(aw.event("ping"))
            streamer = _ContentStream(server.tokenizer, self.parsed.chat.stop, self.parsed.chat.parse_tools)
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue = asyncio.Queue()
            generation = asyncio.create_task(server._generate(
                rec, self.parsed.chat, plan, lambda *a: loop.call_soon_threadsafe(queue.put_nowait, a)
            ))  # fmt: skip
            async for token in _drain(queue, generation):
                await self.text(streamer.push(*token))
            res, engine_s, recycled = generation.result()
            reply = self.route.reply(rec, res, self.parsed)
            reply["content"] = streamer.finish(res.output_ids, reply["content"])
            for delta in streamer.pending:
                await self.text(delta)
            call = rec.commit(plan, res, reply, engine_s=engine_s, recycled=recycled)
            committed = True
            await self.finish(reply, self.route.stop(self.parsed, res, reply),
                              aw.usage(len(call.input_ids), len(res.output_ids), res.cached_tokens))  # fmt: skip
            call.total_s = time.perf_counter() - t0
            return resp
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as e:
            if not resp.prepared:
                raise
            err = e if isinstance(e, ProxyError) else ProxyError(500, f"proxy error: {type(e).__name__}: {e}")
            rec.refuse(err)
            await resp.write(aw.event("error", error=aw.error_body(err)["error"]))
            await resp.write_eof()
            return resp
        finally:
            if generation is not None and not generation.done():
                generation.cancel()  # the client went away: abort the generation on the engine
            if not committed:
                rec.release(plan)

    async def text(self, delta: str) -> None:
        """Stream text; the text block opens at the first visible text (whitespace before a tool call opens none)."""
        if not self.text_open:
            self.held += delta
            if not self.held.strip():
                return
            delta, self.held, self.text_open = self.held, "", True
            block = {"type": "text", "text": ""}
            await self.resp.write(aw.event("content_block_start", index=self.index, content_block=block))
        if delta:
            text_delta = {"type": "text_delta", "text": delta}
            await self.resp.write(aw.event("content_block_delta", index=self.index, delta=text_delta))

    async def finish(self, reply: dict[str, Any], stop: tuple[str, str | None], use: dict[str, int]) -> None:
        """Close the text block, send each tool call as a whole ``tool_use`` block, then the message's end."""
        write = self.resp.write
        if self.text_open:
            await write(aw.event("content_block_stop", index=self.index))
            self.index += 1
        for block in aw.tool_use_blocks(reply):
            arguments = json.dumps(block["input"], ensure_ascii=False)
            await write(aw.event("content_block_start", index=self.index, content_block={**block, "input": {}}))
            json_delta = {"type": "input_json_delta", "partial_json": arguments}
            await write(aw.event("content_block_delta", index=self.index, delta=json_delta))
            await write(aw.event("content_block_stop", index=self.index))
            self.index += 1
        await write(aw.event("message_delta", delta={"stop_reason": stop[0], "stop_sequence": stop[1]}, usage=use))
        await write(aw.event("message_stop"))
        await self.resp.write_eof()


async def _drain(queue: asyncio.Queue, generation: asyncio.Task) -> AsyncIterator[tuple[Any, ...]]:
    """The tokens ``on_token`` queues, as they come, until the generation ends and the queue is empty."""
    while not generation.done() or not queue.empty():
        getter = asyncio.ensure_future(queue.get())
        await asyncio.wait({getter, generation}, return_when=asyncio.FIRST_COMPLETED)
        if not getter.done():
            getter.cancel()
            continue
        yield getter.result()
