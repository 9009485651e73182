"""``/generate`` of the SGLang server: plain and batched replies, SSE streaming, stop strings and log-probs."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from agentflow.engine import protocol as P
from agentflow.engine.server_base import OFFLOAD_BYTES, ServerBase
from agentflow.types import GenerateResult


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


class GenerateRoutes(ServerBase):
    """The ``/generate`` route and the reply objects it builds (SGLang's ``meta_info`` fields)."""

    async def generate(self, request: web.Request) -> web.StreamResponse:
        raw = await self._raw(request)
        # JSON, validation and tokenization grow with the body: a large one is handled on a worker thread
        items, opts = await self._sized(len(raw or b""), OFFLOAD_BYTES, self._parse, raw)
        if opts.stream:
            if opts.batch:
                raise P.error_message("streaming is supported for a single prompt with n 1 only.")
            return await self._stream(request, items[0], opts)
        replies = await asyncio.gather(*(self._complete(item, opts) for item in items))
        return web.json_response(replies if opts.batch else replies[0])

    def _parse(self, raw: bytes | None) -> tuple[list[P.GenItem], P.GenOptions]:
        encode = self._encode if self.tokenizer is not None else None
        vocab = self.engine.model.config.vocab_size
        items, opts = P.parse_generate(self._json(raw), vocab, self.context_len, self.eos_ids, encode)
        if opts.return_routed_experts and not self.engine.model.config.is_moe:
            raise P.error_message("return_routed_experts needs a mixture-of-experts model; this one is dense.")
        return items, opts

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
        """``input_token_logprobs`` and ``input_top_logprobs`` from ``logprob_start_len`` on, as SGLang gives them:
        null at the start position (its logits are not computed), values from the next one."""
        if not opts.return_logprob or opts.logprob_start_len < 0:
            return [], []
        prompt = item.prompt
        start = min(opts.logprob_start_len, len(prompt) - 1)
        k = opts.top_logprobs_num
        res = await self._op(self.engine.score, prompt, start + 1, k) if start + 1 < len(prompt) else None
        lps = res.logprobs if res else []
        tops = (res.top_logprobs or []) if res else []
        triples: list[Any] = [[None, prompt[start], None]]
        triples += [[lp, tok, None] for lp, tok in zip(lps, prompt[start + 1 :], strict=True)]
        top_rows: list[Any] = [None] if k else []
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
        if res is not None and opts.return_routed_experts:
            c = self.engine.model.config
            total = len(item.prompt) + n - 1  # the last token was never fed to the model
            routes = res.routed_experts or []
            meta["routed_experts"] = P.encode_routed_experts(routes, total, c.num_hidden_layers, c.num_experts_per_tok)
        cached = res.cached_tokens if res else 0
        meta.update(reasoning_tokens=0, completion_tokens=n, cached_tokens=cached)
        if res is not None:
            meta["weight_versions"] = P.version_spans(vers, self.labels, self.engine.weight_version)
        meta.update(cached_tokens_details={"device": cached, "host": 0} if cached else None, dp_rank=None)
        if res is not None:
            meta["e2e_latency"] = time.monotonic() - t0
        if first:
            meta["response_sent_to_client_ts"] = time.time()
        return {"text": await self._text(ids, reason, matched), "output_ids": list(ids), "meta_info": meta}

    async def _text(self, ids: list[int], reason: str | None, matched: int | str | None) -> str:
        if self.tokenizer is None:
            return ""
        if reason == "stop" and isinstance(matched, int):
            ids = ids[:-1]
        text = await self._decode(list(ids))
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
