"""One trajectory's record in the proxy: which segment a call extends, the exact ids it feeds the engine, and the
segments the calls build.

A call *extends* a segment when its messages start with that segment's last call's messages followed by the reply
the proxy returned (compared by role, stripped content and tool calls; ids and whitespace around content do not
matter). Its input is then the segment's recorded ids, reused as they are, plus the encoding of only the new
messages; generated ids are never re-encoded. Any other call starts a new segment: ``root`` for the first,
``subagent`` when the agent says so in the ``X-AgentFlow-Segment`` header, ``compact`` otherwise. A segment with a
call in flight cannot be extended by a second, concurrent call (that call starts its own segment).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from agentflow.chat import IM_END, ChatTokenizer, parse_reply, render_conversation
from agentflow.proxy.types import CallRecord, ProxyError
from agentflow.proxy.wire import ChatRequest, message_key, new_id
from agentflow.types import GenerateResult, SamplingParams, Segment, SegmentKind, Turn
from envs.core import answer_action, tool_action


@dataclass
class _Open:
    """A segment and the conversation it holds so far (as comparison keys)."""

    segment: Segment
    history: list[tuple[Any, ...]]
    tools: str
    busy: bool = False


@dataclass
class Plan:
    """What one call will feed the engine; :meth:`Recorder.commit` or :meth:`Recorder.release` ends it."""

    segment: int | None
    """Index of the extended segment, or None for a new one."""
    kind: SegmentKind
    input_ids: list[int]
    new_ids: list[int]
    history: list[tuple[Any, ...]]
    tools: str
    max_new_tokens: int


@dataclass
class Recorder:
    """Segments and calls of one trajectory attempt."""

    trajectory_id: str
    attempt: int
    tokenizer: ChatTokenizer
    sampling: SamplingParams
    max_len: int
    client_sampling: bool = False
    """Honour the request's temperature/top_p/seed (off in RL jobs: behaviour log-probs must be at the job's
    temperature, which the trainer reproduces)."""
    open: list[_Open] = field(default_factory=list)
    calls: list[CallRecord] = field(default_factory=list)
    truncated: str | None = None
    """Why the agent ran out of context, if it did."""
    closed: bool = False

    # ----------------------------------------------------------------------------------------------- planning

    def plan(self, req: ChatRequest, segment_hint: str | None = None) -> Plan:
        """Choose the segment and build the exact input ids; raises ProxyError when the context is full."""
        messages = _with_system(req.messages, req.tools)
        keys = [message_key(m) for m in messages]
        tools = json.dumps(req.tools, sort_keys=True)
        index = self._extendable(keys, tools)
        if index is None:
            kind: SegmentKind = "root" if not self.open else ("subagent" if segment_hint == "subagent" else "compact")
            text = render_conversation(messages, req.tools or None, add_generation_prompt=True)
            new_ids = self.tokenizer.encode(text)
            prefix: list[int] = []
        else:
            seg = self.open[index]
            kind = seg.segment.kind
            new_ids = self.tokenizer.continuation_ids(messages[len(seg.history) :])
            prefix = seg.segment.token_ids
        input_ids = prefix + new_ids
        room = self.max_len - len(input_ids)
        if room <= 0:
            self.truncated = f"context of {len(input_ids)} tokens reaches max_len {self.max_len}"
            raise ProxyError(
                400,
                f"This model's maximum context length is {self.max_len} tokens; the messages take {len(input_ids)}.",
                code="context_length_exceeded",
                param="messages",
            )
        if index is not None:
            self.open[index].busy = True
        budget = min(room, self.sampling.max_new_tokens, req.max_tokens or room)
        return Plan(index, kind, input_ids, new_ids, keys, tools, budget)

    def _extendable(self, keys: list[tuple[Any, ...]], tools: str) -> int | None:
        """The free segment with the longest history that ``keys`` strictly extends (same tools), if any."""
        best, best_len = None, -1
        for i, seg in enumerate(self.open):
            n = len(seg.history)
            if seg.busy or seg.tools != tools or len(keys) <= n or n <= best_len:
                continue
            if keys[:n] == seg.history:
                best, best_len = i, n
        return best

    def sampling_for(self, req: ChatRequest, plan: Plan) -> SamplingParams:
        s = replace(self.sampling, max_new_tokens=plan.max_new_tokens)
        s = replace(s, stop_token_ids=tuple(s.stop_token_ids) or self.tokenizer.stop_ids)
        if self.client_sampling:
            s = replace(
                s,
                temperature=s.temperature if req.temperature is None else req.temperature,
                top_p=s.top_p if req.top_p is None else req.top_p,
                seed=s.seed if req.seed is None else req.seed,
            )
        return s

    # ------------------------------------------------------------------------------------------------- commit

    def release(self, plan: Plan) -> None:
        """The call failed: nothing was recorded; the segment may be extended again."""
        if plan.segment is not None:
            self.open[plan.segment].busy = False

    def reply_for(self, output_ids: list[int]) -> dict[str, Any]:
        """The assistant message for the program: text and parsed tool calls (a malformed call stays text)."""
        text = self.tokenizer.decode(output_ids)
        parsed = parse_reply(text)
        if parsed.error is not None:
            return {"role": "assistant", "content": text.removesuffix(IM_END).removesuffix("<|endoftext|>")}
        calls = [
            {"id": new_id("call"), "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.tool_calls
        ]
        reply: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if calls:
            reply["tool_calls"] = calls
        return reply

    def commit(self, plan: Plan, res: GenerateResult, reply: dict[str, Any], **timing: Any) -> CallRecord:
        """Record a finished generation into its segment."""
        if plan.segment is None:
            self.open.append(_Open(Segment(kind=plan.kind), [], plan.tools))
            index = len(self.open) - 1
        else:
            index = plan.segment
        seg = self.open[index]
        seg.segment.append_context(plan.new_ids)
        start = len(seg.segment.token_ids)
        seg.segment.append_generated(res.output_ids, res.logprobs, res.versions)
        if res.finish_reason == "length":  # close the unfinished message, as the white-box loop does
            seg.segment.append_context(self.tokenizer.encode(IM_END))
        seg.history = plan.history + [message_key(reply)]
        seg.busy = False
        rec = CallRecord(
            index=len(self.calls),
            segment=index,
            input_ids=list(plan.input_ids),
            output_ids=list(res.output_ids),
            logprobs=list(res.logprobs),
            versions=list(res.versions),
            finish_reason=res.finish_reason,
            span=(start, start + len(res.output_ids)),
            spliced=plan.segment is not None,
            new_tokens=len(plan.new_ids),
            reply=reply,
            **timing,
        )
        self.calls.append(rec)
        return rec

    # ------------------------------------------------------------------------------------------------ results

    @property
    def segments(self) -> list[Segment]:
        return [o.segment for o in self.open]

    def turns(self) -> list[Turn]:
        """One turn per call, pointing at the model's tokens of that call."""
        return [
            Turn(index=c.index, action=_action(c.reply), observation="", segment=c.segment, span=c.span)
            for c in self.calls
        ]

    def tito_mismatch(self) -> int:
        """Tokens where a segment differs from what the engine consumed (a call's input is the segment's prefix)
        or produced (its output, log-probs and versions at its span); 0 when capture is exact."""
        bad = 0
        for c in self.calls:
            seg = self.open[c.segment].segment
            consumed = seg.token_ids[: len(c.input_ids)]
            bad += sum(a != b for a, b in zip(consumed, c.input_ids, strict=False))
            bad += abs(len(consumed) - len(c.input_ids)) + abs(c.span[0] - len(c.input_ids))
            lo, hi = c.span
            for got, want in ((seg.token_ids, c.output_ids), (seg.logprobs, c.logprobs), (seg.versions, c.versions)):
                part = got[lo:hi]
                bad += sum(a != b for a, b in zip(part, want, strict=False)) + abs(len(part) - len(want))
        return bad

    def summary(self) -> dict[str, Any]:
        return {
            "calls": len(self.calls),
            "spliced_calls": sum(c.spliced for c in self.calls),
            "segments": [s.kind for s in self.segments],
            "tito_mismatch": self.tito_mismatch(),
            "recycled": sum(c.recycled for c in self.calls),
            "engine_s": sum(c.engine_s for c in self.calls),
            "proxy_overhead_s": sum(c.total_s - c.engine_s for c in self.calls),
        }

    def last_reply(self) -> dict[str, Any] | None:
        return self.calls[-1].reply if self.calls else None


def _with_system(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tools are listed in the system message; a conversation with tools but none gets an empty one."""
    if tools and messages[0]["role"] != "system":
        return [{"role": "system", "content": ""}, *messages]
    return messages


def _action(reply: dict[str, Any]) -> str | None:
    calls = reply.get("tool_calls") or []
    if calls:
        return tool_action(calls[0]["function"]["name"], calls[0]["function"]["arguments"])
    return answer_action(reply.get("content") or "")
