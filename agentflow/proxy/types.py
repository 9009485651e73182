"""Contracts of the black-box proxy: what one recorded call holds, the error every bad request becomes, and what
a black-box agent program is handed.

The proxy sits between a program that speaks the OpenAI chat API and the inference engine. Everything it records
is token ids exactly as the engine consumed and produced them; text is only ever *sent* to the program.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from agentflow.types import FinishReason

#: Header by which an agent says that a call starting a new context is a sub-agent (not a compaction).
SEGMENT_HEADER = "X-AgentFlow-Segment"

#: Called by the proxy's tool route (subprocess agents) and by :class:`BlackBoxTask` (Python agents):
#: run the env's tool ``name`` with ``arguments``; returns the observation and whether the episode ended.
ToolHandler = Callable[[str, dict[str, Any]], Awaitable[tuple[str, bool]]]


class ProxyError(Exception):
    """A request the proxy refuses; rendered as OpenAI's error JSON ``{"error": {message, type, param, code}}``."""

    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None, param=None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class CallRecord:
    """One chat call as the engine saw it: the ids it consumed and the ids, log-probs and versions it produced."""

    index: int
    segment: int
    input_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason
    span: tuple[int, int]
    """[start, end) of ``output_ids`` in the segment's token ids."""
    spliced: bool
    """True when the call extended its segment (history reused as recorded, only new messages encoded)."""
    new_tokens: int
    """Ids encoded for this call's new messages (the whole prompt for a call that starts a segment)."""
    engine_s: float = 0.0
    total_s: float = 0.0
    recycled: int = 0
    """Generations aborted by a weight update and run again (``partial: recycle``)."""
    reply: dict[str, Any] = field(default_factory=dict)
    """The assistant message returned to the program (normalised), what its next call must echo to splice."""


@dataclass
class BlackBoxTask:
    """What a black-box agent program gets for one episode.

    A Python agent receives this object; a subprocess agent gets ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` and
    ``OPENAI_MODEL`` (and ``ANTHROPIC_BASE_URL``, ``ANTHROPIC_API_KEY``, ``ANTHROPIC_MODEL`` for Anthropic clients)
    in its environment and the rest as JSON in ``AGENTFLOW_TASK`` (tools it may call over HTTP at
    ``tools_url + "/" + name``). The env's own tools are optional: a program may use its own.
    """

    trajectory_id: str
    base_url: str
    api_key: str
    model: str
    messages: list[dict[str, Any]]
    """The episode's opening messages (system prompt and the env's first observation)."""
    tools: list[dict[str, Any]]
    """The env's tools in OpenAI's ``tools`` format."""
    max_turns: int
    tools_url: str
    call_tool: ToolHandler | None = None
    """Runs one of the env's tools (Python agents); raises ``RuntimeError`` after the episode ended."""
    anthropic_base_url: str = ""
    """The ``base_url`` of an Anthropic client (Messages API at ``anthropic_base_url + "/v1/messages"``); the same
    key and model as ``base_url``."""

    def anthropic_tools(self) -> list[dict[str, Any]]:
        """The env's tools in Anthropic's ``tools`` format (``name``, ``description``, ``input_schema``)."""
        fns = [t["function"] for t in self.tools]
        return [
            {"name": f["name"], "description": f.get("description", ""), "input_schema": f["parameters"]} for f in fns
        ]

    def to_json_dict(self) -> dict[str, Any]:
        keys = ("trajectory_id", "model", "messages", "tools", "max_turns", "tools_url")
        return {k: getattr(self, k) for k in keys}
