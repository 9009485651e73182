"""The OpenAI chat-completions wire format: validate a request into normalised messages, build replies and chunks.

Normalised messages are what the chat template renders (:mod:`agentflow.chat`): ``{"role", "content": str}`` plus,
for assistant messages, ``tool_calls`` as ``[{"id", "function": {"name", "arguments": dict}}]``. Every problem
raises :class:`ProxyError` with OpenAI's error shape and the offending ``param``.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from agentflow.proxy.types import ProxyError

_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class ChatRequest:
    """A validated ``/v1/chat/completions`` body."""

    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    return_token_ids: bool = False


def bad(message: str, param: str | None = None, code: str | None = None, status: int = 400) -> ProxyError:
    return ProxyError(status, message, "invalid_request_error", code, param)


def parse_request(body: Any) -> ChatRequest:
    """Validate a chat request body; raises :class:`ProxyError` naming the bad field."""
    if not isinstance(body, dict):
        raise bad("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required and must be a string", "model")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad("'messages' must be a non-empty array", "messages")
    messages = [_message(m, i) for i, m in enumerate(raw)]
    tools = _tools(body.get("tools"))
    if body.get("n", 1) != 1:
        raise bad("only n=1 is supported", "n")
    if body.get("tool_choice") not in (None, "auto", "none"):
        raise bad("only tool_choice 'auto' or 'none' is supported", "tool_choice")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    stream_opts = body.get("stream_options") or {}
    return ChatRequest(
        model=model,
        messages=messages,
        tools=tools,
        stream=_typed(body, "stream", bool, False),
        include_usage=bool(isinstance(stream_opts, dict) and stream_opts.get("include_usage")),
        max_tokens=_positive_int(max_tokens, "max_tokens"),
        temperature=_number(body.get("temperature"), "temperature", 0.0, 2.0),
        top_p=_number(body.get("top_p"), "top_p", 1e-9, 1.0),
        seed=body.get("seed") if isinstance(body.get("seed"), int) else None,
        logprobs=_typed(body, "logprobs", bool, False),
        top_logprobs=_typed(body, "top_logprobs", int, 0),
        return_token_ids=_typed(body, "return_token_ids", bool, False),
    )


def _typed(body: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise bad(f"'{key}' must be of type {kind.__name__}, got {type(value).__name__}", key)
    return value


def _positive_int(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise bad(f"'{name}' must be a positive integer, got {value!r}", name)
    return value


def _number(value: Any, name: str, lo: float, hi: float) -> float | None:
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or not lo <= value <= hi:
        raise bad(f"'{name}' must be a number in [{lo:g}, {hi:g}], got {value!r}", name)
    return float(value)


def _content(value: Any, where: str) -> str:
    """Message content as text: a string, null, or an array of text parts."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for j, p in enumerate(value):
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise bad(f"{where}.content[{j}]: only text content parts are supported", f"{where}.content")
            parts.append(p["text"])
        return "".join(parts)
    raise bad(f"{where}.content must be a string or an array of text parts", f"{where}.content")


def _message(m: Any, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad(f"{where} must be an object", where)
    role = m.get("role")
    if role not in _ROLES:
        raise bad(f"{where}.role must be one of {list(_ROLES)}, got {role!r}", f"{where}.role")
    out: dict[str, Any] = {
        "role": "system" if role == "developer" else role,
        "content": _content(m.get("content"), where),
    }
    if role == "assistant" and m.get("tool_calls"):
        calls = m["tool_calls"]
        if not isinstance(calls, list):
            raise bad(f"{where}.tool_calls must be an array", f"{where}.tool_calls")
        out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    if role == "tool":
        out["tool_call_id"] = m.get("tool_call_id")
    return out


def _tool_call(c: Any, where: str) -> dict[str, Any]:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad(f"{where} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}", where)
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except json.JSONDecodeError as e:
            raise bad(
                f"{where}.function.arguments is not valid JSON ({e.msg})", f"{where}.function.arguments"
            ) from None
    if not isinstance(args, dict):
        raise bad(f"{where}.function.arguments must encode a JSON object", f"{where}.function.arguments")
    return {"id": c.get("id"), "function": {"name": fn["name"], "arguments": args}}


def _tools(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad("'tools' must be an array", "tools")
    for j, t in enumerate(value):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise bad(f"tools[{j}] must be {{'type': 'function', 'function': {{...}}}}", f"tools[{j}]")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"tools[{j}].function.name must be a non-empty string", f"tools[{j}].function.name")
    return value


def message_key(m: dict[str, Any]) -> tuple[Any, ...]:
    """What must match for a history message to be the one recorded (ids and surrounding whitespace ignored)."""
    calls = tuple(
        (c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True)) for c in m.get("tool_calls", [])
    )
    return (m["role"], (m.get("content") or "").strip(), calls)


# ------------------------------------------------------------------------------------------------------ replies


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def openai_tool_calls(reply: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "id": c["id"],
            "type": "function",
            "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])},
        }
        for c in reply.get("tool_calls", [])
    ]


def finish_reason(reply: dict[str, Any], engine_reason: str) -> str:
    if reply.get("tool_calls"):
        return "tool_calls"
    return "length" if engine_reason == "length" else "stop"


def logprobs_block(tokens: list[str], logprobs: list[float]) -> dict[str, Any]:
    content = [
        {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
        for t, lp in zip(tokens, logprobs, strict=True)
    ]
    return {"content": content, "refusal": None}


def completion(
    cid: str, model: str, reply: dict[str, Any], reason: str, usage: dict[str, int], extra: dict[str, Any]
) -> dict[str, Any]:
    """A non-streaming ``chat.completion`` object."""
    message: dict[str, Any] = {"role": "assistant", "content": reply["content"], "refusal": None}
    calls = openai_tool_calls(reply)
    if calls:
        message["tool_calls"] = calls
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": reason, "logprobs": None}
    choice.update(extra)
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage,
    }


def chunk(cid: str, model: str, delta: dict[str, Any], reason: str | None = None, **extra: Any) -> dict[str, Any]:
    """One ``chat.completion.chunk`` with a single choice."""
    choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
    choice.update(extra)
    return {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }


def usage_of(prompt: int, completion_tokens: int, cached: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
