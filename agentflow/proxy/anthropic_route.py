"""The Anthropic Messages route of the recording proxy: ``POST /{trajectory_id}/{attempt}/v1/messages``.

It serves a call as the OpenAI route does, on the same path through the proxy: the body becomes the OpenAI chat
request it means (:mod:`agentflow.proxy.anthropic_wire`), and :class:`~agentflow.proxy.calls.Call` plans it with the
trajectory's Recorder (a call that resends the conversation plus the previous reply extends its segment), runs it on
the engine and commits it. Only the reply's shape differs: a ``message`` object, or Anthropic's stream events.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from agentflow.chat import render_conversation
from agentflow.proxy import anthropic_wire as aw
from agentflow.proxy import calls
from agentflow.proxy.recorder import Recorder, _with_system
from agentflow.proxy.server import ProxyServer, _json
from agentflow.proxy.types import ProxyError
from agentflow.types import GenerateResult


class AnthropicRoute:
    """The Messages handler of one :class:`~agentflow.proxy.server.ProxyServer`."""

    def __init__(self, server: ProxyServer) -> None:
        self.server = server

    async def messages(self, request: web.Request) -> web.StreamResponse:
        return await calls.serve(self.server, request, self._messages)

    async def _messages(self, request: web.Request, rec: Recorder, t0: float) -> web.StreamResponse:
        server = self.server
        parsed = aw.parse_request(await _json(request))
        if parsed.chat.model != server.model_name:
            raise ProxyError(404, f"model: {parsed.chat.model} (this server serves {server.model_name!r})",
                             code="model_not_found", param="model")  # fmt: skip
        # tool-use ids in Anthropic's form, so the record holds the ids the program got
        async with calls.Call(server, rec, parsed.chat, request.headers, t0, lambda: aw.new_id("toolu")) as call:
            if parsed.chat.stream:
                return await call.stream(request, lambda resp: _Stream(self, parsed, call, resp).run(), _stream_failed)
            out = await call.run()
            res = out.result
            use = aw.usage(len(out.record.input_ids), len(res.output_ids), res.cached_tokens)
            body = aw.message(aw.new_id("msg"), server.model_name, out.reply, self.stop(parsed, res, out.reply), use)
            return web.json_response(body, headers=call.sampling_header)

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

    def stop(self, parsed: aw.MessagesRequest, res: GenerateResult, reply: dict[str, Any]) -> tuple[str, str | None]:
        tok = self.server.tokenizer
        natural = bool(res.output_ids) and res.output_ids[-1] in tok.stop_ids
        text = tok.decode(res.output_ids) if parsed.stop_sequences else ""
        return aw.stop_reason(reply, res.finish_reason, text, natural, parsed.stop_sequences)


class _Stream:
    """One streamed Messages call: ``message_start``, content blocks as the tokens arrive, ``message_delta``,
    ``message_stop``; a failure after the stream began is an ``error`` event, as Anthropic's API sends it."""

    def __init__(
        self, route: AnthropicRoute, parsed: aw.MessagesRequest, call: calls.Call, resp: web.StreamResponse
    ) -> None:
        self.route, self.parsed, self.call, self.resp = route, parsed, call, resp
        self.index = 0  # the index of the next content block
        self.text_open = False
        self.held = ""

    async def run(self) -> None:
        server, call, resp = self.route.server, self.call, self.resp
        use = aw.usage(len(call.plan.input_ids), 0)
        start = aw.message(aw.new_id("msg"), server.model_name, None, (None, None), use)
        await resp.write(aw.event("message_start", message=start))
        await resp.write(aw.event("ping"))
        out = await call.run(on_text=self.text)
        res = out.result
        await self.finish(out.reply, self.route.stop(self.parsed, res, out.reply),
                          aw.usage(len(out.record.input_ids), len(res.output_ids), res.cached_tokens))  # fmt: skip

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


async def _stream_failed(resp: web.StreamResponse, err: ProxyError) -> None:
    """A failure after the stream began: an ``error`` event, as Anthropic's API sends it."""
    await resp.write(aw.event("error", error=aw.error_body(err)["error"]))
    await resp.write_eof()
