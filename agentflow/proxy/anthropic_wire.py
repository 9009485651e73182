"""The Anthropic Messages wire format beside OpenAI's: requests become OpenAI-shaped chat requests, replies become
``message`` objects and stream events.

A ``/v1/messages`` body is validated here and rewritten as the OpenAI chat body it means (``system`` as the first
message, ``tool_use`` blocks as ``tool_calls``, each ``tool_result`` block as a ``tool`` message, ``tool_choice``
``any`` as ``required``, ``stop_sequences`` as ``stop``), which then goes through :func:`wire.parse_request`. So the
two routes share one normalised form: the Recorder splices an Anthropic conversation exactly as an OpenAI one, and
the Anthropic route accepts what the OpenAI path accepts and refuses what it refuses. A field neither can honour is
refused with a 400 that names it; errors take Anthropic's shape ``{"type": "error", "error": {type, message}}``.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agentflow.proxy import wire
from agentflow.proxy.types import ProxyError

#: Header every Anthropic client sends; a request carrying it gets Anthropic's shapes (errors, the model list).
VERSION_HEADER = "anthropic-version"

# Accepted and needing nothing from us: prompt-caching hints (prefix reuse is automatic here), the caller's
# metadata, and the service tier (there is one).
_HINTS = ("cache_control", "metadata", "service_tier")
_FIELDS = {"model", "max_tokens", "messages", "system", "tools", "tool_choice", "stop_sequences", "temperature",
           "top_p", "top_k", "stream", "thinking", "output_config", *_HINTS}  # fmt: skip
#: In ``wanted``: the OpenAI request must carry the attribute (any value), not a given one.
_SET = object()
_TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,128}$")
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}  # fmt: skip
# OpenAI params that parse_request may name, as the Anthropic field the client sent.
_PARAMS = {"stop": "stop_sequences", "parallel_tool_calls": "tool_choice.disable_parallel_tool_use"}


@dataclass
class MessagesRequest:
    """A validated ``/v1/messages`` body: the OpenAI chat request it became, and what only Anthropic reports."""

    chat: wire.ChatRequest
    stop_sequences: list[str] = field(default_factory=list)


def bad(name: str, message: str, status: int = 400) -> ProxyError:
    """A refusal naming the request field, worded as Anthropic's API words them (``field: problem``)."""
    return ProxyError(status, f"{name}: {message}", "invalid_request_error", None, name)


def wants_anthropic(path: str, headers: Mapping[str, str]) -> bool:
    """Whether the caller is an Anthropic client: the Messages route, or the Anthropic version header."""
    return re.search(r"/v1/messages(/|$)", path) is not None or VERSION_HEADER in headers


def error_body(err: ProxyError) -> dict[str, Any]:
    """Anthropic's error JSON; its error type follows the HTTP status as in Anthropic's API."""
    kind = _ERROR_TYPES.get(err.status) or ("api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


# ------------------------------------------------------------------------------------------------------ requests


def parse_request(body: Any) -> MessagesRequest:
    """Validate a Messages body into the OpenAI chat request it means; raises :class:`ProxyError` naming the field."""
    openai_body, wanted = to_openai(body)
    try:
        chat = wire.parse_request(openai_body)
    except ProxyError as e:  # the OpenAI path refuses it: so does this one, naming the Anthropic field
        name = _PARAMS.get(e.param or "") or re.split(r"[.\[]", e.param or "request")[0]
        raise ProxyError(e.status, f"{name}: {e.message}", e.type, e.code, name) from None
    # parse_request passes over fields it does not know; one it did not take up is not honoured: refuse it.
    for name, (attr, value) in wanted.items():
        got = getattr(chat, attr, None)
        if value is _SET:
            missing = got is None
        else:
            missing = (list(got) if isinstance(got, list | tuple) else got) != value
        if missing:
            raise bad(name, "not supported by this server")
    return MessagesRequest(chat, list(openai_body.get("stop") or []))


def parse_count_request(body: Any) -> wire.ChatRequest:
    """A ``/v1/messages/count_tokens`` body: a Messages body without ``max_tokens`` and ``stream``."""
    if isinstance(body, dict):
        for key in ("max_tokens", "stream"):
            if key in body:
                raise bad(key, "Extra inputs are not permitted")
        body = {**body, "max_tokens": 1}
    return parse_request(body).chat


def to_openai(body: Any) -> tuple[dict[str, Any], dict[str, tuple[str, Any]]]:
    """The OpenAI chat body a Messages body means, and the optional fields it asks for: {Anthropic name:
    (ChatRequest attribute, value)}, each of which the OpenAI request must carry to be honoured."""
    if not isinstance(body, dict):
        raise bad("request", "the body must be a JSON object")
    given = {k: v for k, v in body.items() if v is not None}  # a null optional field is an absent one
    for key in given:
        if key not in _FIELDS:
            raise bad(key, "not supported by this server (Extra inputs are not permitted)")
    model = given.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "Field required (a non-empty string)")
    if "max_tokens" not in given:
        raise bad("max_tokens", "Field required")
    _thinking(given.get("thinking"))
    _hints(given)
    tools = _tools(given.get("tools", []))
    out: dict[str, Any] = {
        "model": model,
        "max_tokens": _integer(given["max_tokens"], "max_tokens", 1),
        "messages": _system(given.get("system")) + _messages(given.get("messages")),
        "stream": _boolean(given.get("stream", False), "stream"),
    }
    if tools:
        out["tools"] = tools
    return out, _options(given, out, [t["function"]["name"] for t in tools])


def _options(given: dict[str, Any], out: dict[str, Any], names: list[str]) -> dict[str, tuple[str, Any]]:
    """The optional sampling and output fields into ``out``; returns those the OpenAI request must carry."""
    for name in ("temperature", "top_p"):
        if name in given:
            out[name] = _unit_number(given[name], name, open_low=name == "top_p")
    wanted: dict[str, tuple[str, Any]] = {}
    if "top_k" in given:
        out["top_k"] = _integer(given["top_k"], "top_k", 0)
        wanted["top_k"] = ("top_k", out["top_k"])
    stops = _stop_sequences(given.get("stop_sequences", []))
    if stops:
        out["stop"] = stops
        wanted["stop_sequences"] = ("stop", stops)
    if "output_config" in given:
        out["response_format"] = _output_format(given["output_config"])
        if out["response_format"] is not None:
            wanted["output_config.format"] = ("response_format", _SET)
    if "tool_choice" in given:
        out["tool_choice"], parallel = _tool_choice(given["tool_choice"], names)
        if not parallel:
            out["parallel_tool_calls"] = False
            wanted["tool_choice.disable_parallel_tool_use"] = ("parallel_tool_calls", False)
    return wanted


def _integer(value: Any, name: str, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise bad(name, f"must be an integer >= {low}, got {value!r}")
    return value


def _boolean(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise bad(name, f"must be a boolean, got {value!r}")
    return value


def _unit_number(value: Any, name: str, open_low: bool) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and (0 < value if open_low else 0 <= value)
    if not ok or value > 1:
        raise bad(name, f"must be a number in {'(0' if open_low else '[0'}, 1], got {value!r}")
    return float(value)


def _thinking(value: Any) -> None:
    # Extended thinking needs a thinking channel the chat template does not have; only "disabled" can be honoured.
    if value is not None and not (isinstance(value, dict) and value.get("type") == "disabled"):
        raise bad("thinking", "extended thinking is not supported by this server (only {'type': 'disabled'})")


def _hints(given: dict[str, Any]) -> None:
    metadata = given.get("metadata", {})
    if not isinstance(metadata, dict) or set(metadata) - {"user_id"}:
        raise bad("metadata", "must be an object with at most 'user_id'")
    if given.get("service_tier", "auto") not in ("auto", "standard_only"):
        raise bad("service_tier", "must be 'auto' or 'standard_only'")
    _cache_control(given.get("cache_control"), "cache_control")


def _cache_control(value: Any, where: str) -> None:
    if value is not None and not (isinstance(value, dict) and value.get("type") == "ephemeral"):
        raise bad(where, "must be {'type': 'ephemeral'} (optionally with 'ttl')")


def _output_format(value: Any) -> dict[str, Any] | None:
    """``output_config.format`` (structured output, always enforced) as OpenAI's strict ``json_schema`` format."""
    if not isinstance(value, dict):
        raise bad("output_config", "must be an object")
    for key, setting in value.items():
        if key != "format" and setting is not None:  # effort: this model has no such setting
            raise bad(f"output_config.{key}", "not supported by this server (only 'format')")
    fmt = value.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad("output_config.format", "must be {'type': 'json_schema', 'schema': {...}}")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True}}


def _stop_sequences(value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise bad("stop_sequences", "must be an array of non-empty strings")
    return list(value)


def _system(value: Any) -> list[dict[str, Any]]:
    """``system`` (a string or text blocks) as the leading system message; an empty one is no system prompt."""
    if value is None or isinstance(value, str):
        text = value or ""
    else:
        text = _texts(value, "system")
    return [{"role": "system", "content": text}] if text else []


def _texts(blocks: Any, where: str) -> str:
    """Text blocks (``system``, a ``tool_result``'s content) joined with newlines, as one message's text."""
    if not isinstance(blocks, list):
        raise bad(where, "must be a string or an array of text blocks")
    parts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise bad(f"{where}.{j}.type", f"only text blocks are supported here, got {kind!r}")
        parts.append(_text_block(block, f"{where}.{j}"))
    return "\n".join(parts)


def _known(block: dict[str, Any], keys: tuple[str, ...], where: str) -> dict[str, Any]:
    """The block without null fields; any other key is refused, as Anthropic's API refuses extra inputs."""
    block = {k: v for k, v in block.items() if v is not None}
    for key in block:
        if key not in (*keys, "type", "cache_control"):
            raise bad(f"{where}.{key}", "not supported by this server (Extra inputs are not permitted)")
    _cache_control(block.get("cache_control"), f"{where}.cache_control")
    return block


def _text_block(block: dict[str, Any], where: str) -> str:
    block = _known(block, ("text", "citations"), where)
    if not isinstance(block.get("text"), str):
        raise bad(f"{where}.text", "Field required (a string)")
    if block.get("citations"):
        raise bad(f"{where}.citations", "citations are not supported by this server")
    return block["text"]


# ------------------------------------------------------------------------------------------------------ messages


def _messages(raw: Any) -> list[dict[str, Any]]:
    """Anthropic messages as OpenAI chat messages; a user message's ``tool_result`` blocks become ``tool`` ones."""
    if not isinstance(raw, list) or not raw:
        raise bad("messages", "Field required (a non-empty array)")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(raw):
        where = f"messages.{i}"
        if not isinstance(m, dict):
            raise bad(where, "must be an object with 'role' and 'content'")
        for key in m:
            if key not in ("role", "content"):
                raise bad(f"{where}.{key}", "Extra inputs are not permitted")
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise bad(f"{where}.role", f"must be 'user' or 'assistant', got {role!r}")
        if not isinstance(content, str | list):
            raise bad(f"{where}.content", "must be a string or an array of content blocks")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        out += _assistant(blocks, where) if role == "assistant" else _user(blocks, where)
    if raw[-1].get("role") == "assistant":
        # The chat template always opens a new assistant turn, so a reply cannot continue a prefilled one.
        raise bad("messages", "a final assistant message (prefill) is not supported by this server")
    return out


def _block(block: Any, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise bad(where, "each content block must be an object with a 'type'")
    return block["type"]


def _user(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """Text blocks in a row make one user message; each ``tool_result`` a tool message, in their order."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content.{j}"
        kind = _block(block, at)
        if kind == "text":
            texts.append(_text_block(block, at))
            continue
        if kind != "tool_result":
            raise bad(f"{at}.type", f"{kind!r} blocks are not supported in user messages (text, tool_result)")
        if texts:
            out.append({"role": "user", "content": "\n".join(texts)})
            texts = []
        out.append(_tool_result(block, at))
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    block = _known(block, ("tool_use_id", "content", "is_error"), where)
    if not isinstance(block.get("tool_use_id"), str) or not block["tool_use_id"]:
        raise bad(f"{where}.tool_use_id", "Field required (a string)")
    content = block.get("content", "")
    text = content if isinstance(content, str) else _texts(content, f"{where}.content")
    if _boolean(block.get("is_error", False), f"{where}.is_error") and not text.lower().startswith("error"):
        text = f"Error: {text}"  # the template has no error flag: say it in the text, as the white-box loop does
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}


def _assistant(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """One assistant message: its text blocks as the content, its ``tool_use`` blocks as tool calls."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content.{j}"
        kind = _block(block, at)
        if kind == "text":
            texts.append(_text_block(block, at))
        elif kind == "tool_use":
            calls.append(_tool_use(block, at))
        else:
            raise bad(f"{at}.type", f"{kind!r} blocks are not supported in assistant messages (text, tool_use)")
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return [message]


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    block = _known(block, ("id", "name", "input", "caller"), where)
    for key in ("id", "name"):
        if not isinstance(block.get(key), str) or not block[key]:
            raise bad(f"{where}.{key}", "Field required (a non-empty string)")
    if not isinstance(block.get("input"), dict):
        raise bad(f"{where}.input", "Field required (an object)")
    if block.get("caller", {"type": "direct"}) != {"type": "direct"}:
        raise bad(f"{where}.caller", "only direct tool calls are supported by this server")
    arguments = json.dumps(block["input"], ensure_ascii=False)
    return {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": arguments}}


def _tools(raw: Any) -> list[dict[str, Any]]:
    """Client tools as OpenAI function tools (the form the chat template lists); server tools are refused."""
    if not isinstance(raw, list):
        raise bad("tools", "must be an array")
    out, names = [], set()
    for j, tool in enumerate(raw):
        where = f"tools.{j}"
        if not isinstance(tool, dict):
            raise bad(where, "must be an object")
        if tool.get("type") not in (None, "custom"):
            raise bad(f"{where}.type", f"server tool {tool.get('type')!r} is not supported by this server")
        tool = _known(tool, ("name", "description", "input_schema", "strict"), where)
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise bad(f"{where}.name", "must match ^[a-zA-Z0-9_-]{1,128}$")
        if name in names:
            raise bad("tools", f"tool names must be unique, {name!r} is repeated")
        if not isinstance(schema, dict) or schema.get("type", "object") != "object":
            raise bad(f"{where}.input_schema", "Field required (a JSON schema object of type 'object')")
        names.add(name)
        fn: dict[str, Any] = {"name": name}
        if "description" in tool:
            if not isinstance(tool["description"], str):
                raise bad(f"{where}.description", "must be a string")
            fn["description"] = tool["description"]
        fn["parameters"] = schema
        if "strict" in tool:  # inputs that must match the schema: OpenAI's strict function tools
            fn["strict"] = _boolean(tool["strict"], f"{where}.strict")
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(value: Any, names: list[str]) -> tuple[Any, bool]:
    """Anthropic's ``tool_choice`` as OpenAI's, and whether parallel tool calls stay allowed."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise bad("tool_choice.type", f"must be one of 'auto', 'any', 'tool', 'none', got {kind!r}")
    allowed = {"type", "name", "disable_parallel_tool_use"} if kind == "tool" else {"type", "disable_parallel_tool_use"}
    for key in value:
        if key not in allowed:
            raise bad(f"tool_choice.{key}", f"Extra inputs are not permitted for type {kind!r}")
    parallel = not _boolean(value.get("disable_parallel_tool_use", False), "tool_choice.disable_parallel_tool_use")
    if kind in ("any", "tool") and not names:
        raise bad("tool_choice", f"type {kind!r} needs 'tools'")
    if kind == "tool":
        if value.get("name") not in names:
            raise bad("tool_choice.name", f"no tool named {value.get('name')!r} in 'tools'")
        return {"type": "function", "function": {"name": value["name"]}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel


# ------------------------------------------------------------------------------------------------------ replies


def new_id(prefix: str) -> str:
    """An Anthropic-style object id: ``msg_…``, ``toolu_…``."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def stop_reason(
    reply: dict[str, Any], engine_reason: str, text: str, natural_end: bool, stops: list[str]
) -> tuple[str, str | None]:
    """``stop_reason`` and ``stop_sequence``: a tool call, the token budget, a stop sequence, or the model's end.

    ``text`` is the decoded output and ``natural_end`` whether it ended on the model's end-of-turn token; output that
    stopped early on text the client listed in ``stop_sequences`` stopped on the first of them it contains.
    """
    if reply.get("tool_calls"):
        return "tool_use", None
    if engine_reason == "length":
        return "max_tokens", None
    hits = sorted((text.find(s), s) for s in stops if s in text) if not natural_end else []
    return ("stop_sequence", hits[0][1]) if hits else ("end_turn", None)


def usage(input_tokens: int, output_tokens: int, cached: int = 0) -> dict[str, int]:
    """Anthropic's usage: ``input_tokens`` excludes the prompt tokens served from the prefix cache."""
    return {
        "input_tokens": input_tokens - cached,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def tool_use_blocks(reply: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"type": "tool_use", "id": c["id"], "name": c["function"]["name"], "input": c["function"]["arguments"]}
        for c in reply.get("tool_calls", [])
    ]


def message(
    mid: str, model: str, reply: dict[str, Any] | None, stop: tuple[str | None, str | None], use: dict[str, int]
) -> dict[str, Any]:
    """A ``message`` object; with ``reply`` None, the empty one a stream's ``message_start`` carries."""
    content: list[dict[str, Any]] = []
    if reply is not None and reply["content"].strip():
        content.append({"type": "text", "text": reply["content"]})
    content += tool_use_blocks(reply or {})
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": use}  # fmt: skip


def event(kind: str, **fields: Any) -> bytes:
    """One server-sent event as Anthropic streams them: the type as the event name and in the data."""
    data = json.dumps({"type": kind, **fields}, ensure_ascii=False)
    return f"event: {kind}\ndata: {data}\n\n".encode()


def model_list(name: str) -> dict[str, Any]:
    """``GET /v1/models`` in Anthropic's shape (one model, one page)."""
    model = {"type": "model", "id": name, "display_name": name, "created_at": "1970-01-01T00:00:00Z"}
    return {"data": [model], "has_more": False, "first_id": name, "last_id": name}
