"""One trajectory's record in the proxy: which segment a call extends, the exact ids it feeds the engine, and the
segments the calls build.

A call *extends* a segment when its messages start with that segment's last call's messages followed by the reply
the proxy returned (compared by role, stripped content and tool calls; ids and whitespace around content do not
matter). Its input is then the segment's recorded ids, reused as they are, plus the encoding of only the new
messages; generated ids are never re-encoded. A call that re-sends exactly the messages of a segment's last call is
a *retry*: it replaces that reply (the segment goes back to the call's recorded input) and the dropped reply is kept
in a ``retry`` segment. Any other call starts a new segment: ``root`` for the first, ``subagent`` or ``compact`` when
the agent says so in the ``X-AgentFlow-Segment`` header, ``side`` otherwise (a re-send of an older call reuses that
call's recorded input). ``side`` and ``retry`` segments are recorded but not trained unless ``train_side_calls``.
A segment with a call in flight cannot be extended by a second, concurrent call (that call starts its own segment).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from agentflow.chat import IM_END, ChatTokenizer, parse_reply, render_conversation
from agentflow.proxy.types import SEGMENT_HEADER, CallRecord, ProxyError
from agentflow.proxy.wire import ChatRequest, message_key, new_id
from agentflow.structured import Grammar, GrammarError, canonical, request_grammar
from agentflow.types import GenerateResult, SamplingParams, Segment, SegmentKind, Turn
from envs.core import answer_action, tool_action


@dataclass
class _Open:
    """A segment and the conversation it holds so far (as comparison keys)."""

    segment: Segment
    history: list[tuple[Any, ...]]
    tools: str
    busy: bool = False
    last_call: int | None = None
    """Index of the segment's latest call (a re-send of its messages is a retry of it)."""


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
    trained: bool = True
    replaces: int | None = None
    """A retry: the call whose reply this one replaces in segment ``segment``."""
    grammar: Grammar | None = None
    """What the reply was constrained to (set by :meth:`Recorder.sampling_for`)."""
    sampling: SamplingParams | None = None
    """The engine's sampling for the call (set by :meth:`Recorder.sampling_for`)."""


#: What the ``X-AgentFlow-Segment`` header may say of a call that starts a new context (such segments are trained).
SEGMENT_HINTS: tuple[SegmentKind, ...] = ("subagent", "compact")


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
    train_side_calls: bool = False
    """Train ``side`` and ``retry`` segments too (``agent.train_side_calls``)."""
    canonical_forcing: bool = False
    """The engine spells grammar-forced text in canonical tokens (the embedded one; not SGLang)."""
    open: list[_Open] = field(default_factory=list)
    calls: list[CallRecord] = field(default_factory=list)
    refused: int = 0
    """Calls answered with an error (bad request, context too long, engine abort): the agent saw the error."""
    first_refusal: str | None = None
    closed: bool = False
    _asked: dict[tuple[str, tuple[Any, ...]], int] = field(default_factory=dict, repr=False)
    """(tools, message keys) -> the latest call that sent exactly them."""
    _starting: int = 0
    """Calls in flight that will start a new segment (the first of them is the root)."""

    # ----------------------------------------------------------------------------------------------- planning

    def plan(self, req: ChatRequest, segment_hint: str | None = None) -> Plan:
        """Choose the segment and build the exact input ids; raises ProxyError when the context is full."""
        hint = _hint(segment_hint)
        messages = _with_system(req.messages, req.tools)
        keys = [message_key(m) for m in messages]
        tools = json.dumps(req.tools, sort_keys=True)
        index, replaces = self._extendable(keys, tools), None
        retried = self._asked.get((tools, tuple(keys)))
        if index is not None:
            seg = self.open[index]
            kind, trained = seg.segment.kind, seg.segment.trained
            new_ids = self.tokenizer.continuation_ids(messages[len(seg.history) :])
            prefix = seg.segment.token_ids
        elif retried is not None and self._free_last(retried):
            index, replaces = self.calls[retried].segment, retried
            kind, trained = self.open[index].segment.kind, self.open[index].segment.trained
            new_ids, prefix = [], self.calls[retried].input_ids
        else:
            kind = "root" if not self.open and not self._starting else (hint or "side")
            trained = kind != "side" or self.train_side_calls
            if retried is not None:  # a re-send of an older call: its recorded input, not a new encoding
                new_ids = list(self.calls[retried].input_ids)
            else:
                text = render_conversation(messages, req.tools or None, add_generation_prompt=True)
                new_ids = self.tokenizer.encode(text)
            prefix = []
        input_ids = prefix + new_ids
        room = self.max_len - len(input_ids)
        if room <= 0:
            raise ProxyError(
                400,
                f"This model's maximum context length is {self.max_len} tokens; the messages take {len(input_ids)}.",
                code="context_length_exceeded",
                param="messages",
            )
        if index is not None:
            self.open[index].busy = True
        else:
            self._starting += 1
        budget = min(room, self.sampling.max_new_tokens, req.max_tokens or room)
        return Plan(index, kind, input_ids, new_ids, keys, tools, budget, trained=trained, replaces=replaces)

    def _free_last(self, call: int) -> bool:
        """Whether ``call`` is the latest call of a segment that has no call in flight."""
        seg = self.open[self.calls[call].segment]
        return seg.last_call == call and not seg.busy

    def refuse(self, error: ProxyError) -> None:
        """A call of this trajectory was answered with ``error``: counted, the first reason kept."""
        self.refused += 1
        if self.first_refusal is None:
            self.first_refusal = f"{error.status} {error.code or error.type}: {error.message}"

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
        """The engine's sampling for this call: the job's (or the client's) settings, the request's stop strings
        and top log-probs, and the grammar its tool choice and response format ask for."""
        s = replace(self.sampling, max_new_tokens=plan.max_new_tokens)
        s = replace(s, stop_token_ids=tuple(s.stop_token_ids) or self.tokenizer.stop_ids)
        plan.grammar = _grammar(req, plan.max_new_tokens, self.tokenizer)
        if plan.grammar is not None and self.canonical_forcing:
            plan.grammar = canonical(plan.grammar)
        s = replace(s, stop=req.stop, top_logprobs=req.top_logprobs if req.logprobs else 0,
                    grammar=plan.grammar.lark if plan.grammar else None)  # fmt: skip
        if self.client_sampling:
            s = replace(
                s,
                temperature=s.temperature if req.temperature is None else req.temperature,
                top_p=s.top_p if req.top_p is None else req.top_p,
                seed=s.seed if req.seed is None else req.seed,
            )
        plan.sampling = s
        return s

    # ------------------------------------------------------------------------------------------------- commit

    def release(self, plan: Plan) -> None:
        """The call failed: nothing was recorded; the segment may be extended again."""
        if plan.segment is not None:
            self.open[plan.segment].busy = False
        else:
            self._starting -= 1

    def reply_for(self, output_ids: list[int], req: ChatRequest | None = None) -> dict[str, Any]:
        """The assistant message for the program: text (cut before a stop string) and, when the request offers
        tools and allows calls, the parsed tool calls (a malformed call stays text)."""
        text = self.tokenizer.decode(output_ids)
        cuts = [i for i in (text.find(x) for x in req.stop) if i >= 0] if req is not None else []
        text = text[: min(cuts)] if cuts else text
        if req is not None and not req.parse_tools:
            return {"role": "assistant", "content": text.removesuffix(IM_END).removesuffix("<|endoftext|>")}
        parsed = parse_reply(text) if cuts else self.tokenizer.parse_reply_ids(output_ids)
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
            self._starting -= 1
            self.open.append(_Open(Segment(kind=plan.kind, trained=plan.trained), [], plan.tools))
            index = len(self.open) - 1
        else:
            index = plan.segment
            if plan.replaces is not None:
                self._drop_reply(index, plan.replaces)
        seg = self.open[index]
        seg.segment.append_context(plan.new_ids)
        start = len(seg.segment.token_ids)
        seg.segment.append_generated(res.output_ids, res.logprobs, res.versions)
        if plan.grammar is not None and res.output_ids:
            seg.segment.constraints.append((start, start + len(res.output_ids), plan.grammar.lark))
        if not res.output_ids or res.output_ids[-1] not in self.tokenizer.stop_ids:
            # out of tokens or cut by a stop string: close the message, as the white-box loop does
            seg.segment.append_context(self.tokenizer.encode(IM_END))
        seg.history = plan.history + [message_key(reply)]
        seg.busy = False
        seg.last_call = len(self.calls)
        self._asked[(plan.tools, tuple(plan.history))] = len(self.calls)
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

    def _drop_reply(self, index: int, call: int) -> None:
        """A retry of ``call``, the last of segment ``index``: the segment goes back to that call's input, and the
        reply it drops moves to a ``retry`` segment (the call's input as context, then the reply as recorded)."""
        live, rec = self.open[index], self.calls[call]
        cut = rec.span[0]
        dropped = Segment(kind="retry", trained=self.train_side_calls)
        dropped.append_context(live.segment.token_ids[:cut])
        for name in ("token_ids", "loss_mask", "logprobs", "versions"):
            getattr(dropped, name).extend(getattr(live.segment, name)[cut:])
            del getattr(live.segment, name)[cut:]
        moved = [c for c in live.segment.constraints if c[0] >= cut]  # same positions in the retry segment
        dropped.constraints = moved
        live.segment.constraints = [c for c in live.segment.constraints if c[0] < cut]
        self.open.append(_Open(dropped, live.history, live.tools, last_call=call))
        rec.segment = len(self.open) - 1

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
            "untrained_calls": sum(not self.open[c.segment].segment.trained for c in self.calls),
            "refused_calls": self.refused,
            "first_refusal": self.first_refusal,
            "tito_mismatch": self.tito_mismatch(),
            "recycled": sum(c.recycled for c in self.calls),
            "engine_s": sum(c.engine_s for c in self.calls),
            "proxy_overhead_s": sum(c.total_s - c.engine_s for c in self.calls),
        }

    def last_reply(self) -> dict[str, Any] | None:
        return self.calls[-1].reply if self.calls else None


def _hint(value: str | None) -> SegmentKind | None:
    """The segment kind a call's ``X-AgentFlow-Segment`` header asks for (None without one)."""
    if not value:
        return None
    for kind in SEGMENT_HINTS:
        if value.strip().lower() == kind:
            return kind
    raise ProxyError(400, f"header {SEGMENT_HEADER} must be one of {list(SEGMENT_HINTS)}, got {value!r}",
                     code="invalid_segment", param=SEGMENT_HEADER)  # fmt: skip


def _grammar(req: ChatRequest, budget: int, tokenizer: ChatTokenizer) -> Grammar | None:
    """The request's grammar, checked against the tokenizer; a schema llguidance refuses is a 400 naming it."""
    param = "response_format" if req.response_format is not None else "tools"
    try:
        count = lambda text: len(tokenizer.encode(text))
        grammar = request_grammar(
            req.tools, req.tool_choice, req.parallel_tool_calls, req.response_format, budget, count
        )
        if grammar is not None:
            tokenizer.grammars.check(grammar.lark)
    except GrammarError as e:
        raise ProxyError(400, f"cannot constrain the reply to this {param}: {e}", code="invalid_schema",
                         param=param) from None  # fmt: skip
    return grammar


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
