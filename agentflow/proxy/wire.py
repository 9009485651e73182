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
from agentflow.types import SamplingParams

_ROLES = ("system", "developer", "user", "assistant", "tool")


#: Request fields that change nothing we generate: accepted and documented as such (README, "Request fields").
INFORMATIONAL = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key")
#: Fields we honour (validated below), besides the informational ones.
HONOURED = (
    "model", "messages", "tools", "tool_choice", "parallel_tool_calls", "response_format", "stream",
    "stream_options", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "logprobs",
    "top_logprobs", "n", "modalities", "return_token_ids",
)  # fmt: skip
#: Fields refused unless they ask for nothing (their default), and why.
_REFUSED: dict[str, str] = {
    "frequency_penalty": "sampling penalties are not supported (the trainer could not reproduce the log-probs)",
    "presence_penalty": "sampling penalties are not supported (the trainer could not reproduce the log-probs)",
    "logit_bias": "logit_bias is not supported (the trainer could not reproduce the log-probs)",
    "functions": "the deprecated 'functions' field is not supported; use 'tools'",
    "function_call": "the deprecated 'function_call' field is not supported; use 'tool_choice'",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "this model has no reasoning settings",
    "verbosity": "this model has no verbosity setting",
    "web_search_options": "web search is not supported",
}


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
    tool_choice: str | dict[str, Any] | None = None
    """``None``/``"auto"``, ``"none"``, ``"required"``, or ``{"mode": "auto"|"required", "names": [...]}``."""
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None
    """``{"type": "json_object"}`` or ``{"type": "json_schema", "schema": {...}, "strict": bool}``; None: text."""
    stop: tuple[str, ...] = ()

    @property
    def parse_tools(self) -> bool:
        """Whether tool calls are parsed out of the reply (never without tools or with ``tool_choice: none``)."""
        return bool(self.tools) and self.tool_choice != "none"


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
    _refuse_unsupported(body)
    tools = _tools(body.get("tools"))
    if body.get("n") not in (None, 1):
        raise bad("only n=1 is supported", "n")
    if body.get("modalities") not in (None, ["text"]):
        raise bad("only the 'text' modality is supported", "modalities")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    stream_opts = body.get("stream_options") or {}
    top_logprobs = _typed(body, "top_logprobs", int, 0)
    if not 0 <= top_logprobs <= 20:
        raise bad(f"'top_logprobs' must be an integer in [0, 20], got {top_logprobs}", "top_logprobs")
    if top_logprobs and not body.get("logprobs"):
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
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
        top_logprobs=top_logprobs,
        return_token_ids=_typed(body, "return_token_ids", bool, False),
        tool_choice=_tool_choice(body.get("tool_choice"), tools),
        parallel_tool_calls=_typed(body, "parallel_tool_calls", bool, True),
        response_format=_response_format(body.get("response_format")),
        stop=_stop(body.get("stop")),
    )


def _refuse_unsupported(body: dict[str, Any]) -> None:
    """Unknown fields and fields we cannot honour are refused by name, as OpenAI refuses unknown arguments."""
    for key, value in body.items():
        if key in _REFUSED:
            if value in (None, 0, 0.0, {}, False) and key not in ("functions", "function_call"):
                continue  # asks for the default: nothing to honour
            raise bad(f"'{key}': {_REFUSED[key]}", key, "unsupported_parameter")
        if key not in HONOURED and key not in INFORMATIONAL:
            raise bad(f"Unrecognized request argument supplied: {key}", key, "unknown_parameter")


def _tool_choice(value: Any, tools: list[dict[str, Any]]) -> str | dict[str, Any] | None:
    names = [t["function"]["name"] for t in tools]
    if value is None or value == "auto":
        return None
    if value in ("none", "required"):
        if value == "required" and not tools:
            raise bad("tool_choice 'required' needs 'tools'", "tool_choice")
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        name = (value.get("function") or {}).get("name")
        if name not in names:
            raise bad(f"tool_choice names function {name!r}, which is not in 'tools' ({names})", "tool_choice")
        return {"mode": "required", "names": [name]}
    if isinstance(value, dict) and value.get("type") == "allowed_tools":
        spec = value.get("allowed_tools") or {}
        mode = spec.get("mode", "auto")
        picked = [((t or {}).get("function") or {}).get("name") for t in spec.get("tools") or []]
        if mode not in ("auto", "required") or not picked or any(n not in names for n in picked):
            raise bad("allowed_tools needs mode 'auto' or 'required' and tools named in 'tools'", "tool_choice")
        return {"mode": mode, "names": picked}
    raise bad("tool_choice must be 'none', 'auto', 'required', {'type': 'function', 'function': {'name'}} or "
              "{'type': 'allowed_tools', ...}", "tool_choice")  # fmt: skip


def _response_format(value: Any) -> dict[str, Any] | None:
    if value is None or (isinstance(value, dict) and value.get("type") == "text"):
        return None
    if isinstance(value, dict) and value.get("type") == "json_object":
        return {"type": "json_object"}
    if isinstance(value, dict) and value.get("type") == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise bad("response_format.json_schema needs a 'name'", "response_format.json_schema")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise bad("response_format.json_schema.schema must be an object", "response_format.json_schema.schema")
        return {"type": "json_schema", "schema": schema, "strict": bool(spec.get("strict"))}
    raise bad("response_format.type must be 'text', 'json_object' or 'json_schema'", "response_format")


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(x, str) and x for x in stops):
        raise bad("'stop' must be a non-empty string or an array of at most 4 of them", "stop")
    return tuple(stops)


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
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad(f"tools[{j}].function.parameters must be a JSON schema object", f"tools[{j}].function.parameters")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise bad(f"tools[{j}].function.strict must be a boolean", f"tools[{j}].function.strict")
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


def logprobs_block(
    tokens: list[str], logprobs: list[float], top: list[list[tuple[str, float]]] | None = None
) -> dict[str, Any]:
    """OpenAI's ``logprobs`` of a choice; ``top``: per token the alternatives (tokens the grammar forbade, with a
    log-prob of -inf, are left out: JSON has no infinity)."""
    content = []
    for k, (t, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        alts = [
            {"token": a, "logprob": v, "bytes": list(a.encode())}
            for a, v in (top[k] if top is not None and k < len(top) else [])
            if v != float("-inf")
        ]
        content.append({"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": alts})
    return {"content": content, "refusal": None}


#: Response header reporting the sampling the engine used (an RL job overrides the client's; README).
SAMPLING_HEADER = "X-AgentFlow-Sampling"


def sampling_header(s: SamplingParams) -> dict[str, str]:
    """``{SAMPLING_HEADER: "temperature=1.0; top_p=1.0; top_k=-1; seed=none; max_tokens=64"}``."""
    seed = "none" if s.seed is None else str(s.seed)
    value = f"temperature={s.temperature:g}; top_p={s.top_p:g}; top_k={s.top_k}; seed={seed}"
    value += f"; max_tokens={s.max_new_tokens}"
    return {SAMPLING_HEADER: value}


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
