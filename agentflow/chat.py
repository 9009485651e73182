"""Chat format: Qwen2.5-style markup, tool calls, incremental tokenization.

This is the only module that knows how conversations become tokens and how model text becomes tool calls (a settled
convention, docs/architecture.md). The rendering is built so that a conversation is a strict prefix of any longer
one: the token ids of a running episode are the ids of its first prompt, then the engine's ids, then encodings of
only the new messages, and are never re-tokenized.

Markup (one message)::

    <|im_start|>{role}\\n{content}<|im_end|>\\n

Tools are listed in the system message; an assistant calls one with
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; tool results come back as a user message wrapped
in ``<tool_response>`` tags (one message per result so the prefix property holds).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentflow.structured import Grammars

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
EOS = "<|endoftext|>"
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END, TOOL_CALL_OPEN, TOOL_CALL_CLOSE, TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE]

TOOLS_HEADER = "\n\n# Tools\n<tools>\n"
TOOLS_FOOTER = "</tools>\nTo call a tool, reply with <tool_call>{json}</tool_call>."

#: The same format as a Jinja chat template, saved in tokenizer_config.json so HF tooling renders identically.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'system' %}"
    "<|im_start|>system\n{{ m.content }}"
    "{% if tools %}{{ '\\n\\n# Tools\\n<tools>\\n' }}{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    "To call a tool, reply with <tool_call>{json}</tool_call>.{% endif %}<|im_end|>\n"
    "{% elif m.role == 'assistant' %}"
    "<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for tc in (m.tool_calls or []) %}"
    "<tool_call>\n{{ {'name': tc.function.name, 'arguments': tc.function.arguments} | tojson }}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_TOOL_CALL_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


class ToolCallError(ValueError):
    """The model's text looked like a tool call but could not be parsed."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class AssistantReply:
    """What the model said: free text, tool calls, or an error describing a malformed tool call."""

    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    error: str | None = None


def _tojson(obj: Any) -> str:
    # As Hugging Face's chat-template ``tojson``: insertion order, no HTML escaping, non-ASCII kept.
    return json.dumps(obj, ensure_ascii=False)


def render_tool_call(call: ToolCall) -> str:
    return f"{TOOL_CALL_OPEN}\n{_tojson({'name': call.name, 'arguments': call.arguments})}\n{TOOL_CALL_CLOSE}"


def render_message(message: dict[str, Any], tools: list[dict[str, Any]] | None = None) -> str:
    """Render one message exactly as :data:`CHAT_TEMPLATE` does."""
    role, content = message["role"], message.get("content") or ""
    if role == "system":
        text = f"{IM_START}system\n{content}"
        if tools:
            text += TOOLS_HEADER + "".join(_tojson(t) + "\n" for t in tools) + TOOLS_FOOTER
        return text + f"{IM_END}\n"
    if role == "assistant":
        calls = "".join(
            render_tool_call(ToolCall(tc["function"]["name"], tc["function"]["arguments"]))
            for tc in message.get("tool_calls") or []
        )
        return f"{IM_START}assistant\n{content}{calls}{IM_END}\n"
    if role == "tool":
        return f"{IM_START}user\n{TOOL_RESPONSE_OPEN}\n{content}\n{TOOL_RESPONSE_CLOSE}{IM_END}\n"
    return f"{IM_START}{role}\n{content}{IM_END}\n"


def render_conversation(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = False
) -> str:
    text = "".join(render_message(m, tools) for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def parse_reply(text: str) -> AssistantReply:
    """Split model text into content and tool calls; malformed calls give an ``error`` instead of raising."""
    text = text.removesuffix(IM_END).removesuffix(EOS)
    calls: list[ToolCall] = []
    for raw in _TOOL_CALL_RE.findall(text):
        try:
            calls.append(_parse_call(raw))
        except ToolCallError as e:
            return AssistantReply(content=text, error=str(e))
    content = _TOOL_CALL_RE.sub("", text)
    if TOOL_CALL_OPEN in content or TOOL_CALL_CLOSE in content:
        return AssistantReply(content=text, error="malformed tool call: unbalanced <tool_call> tags")
    return AssistantReply(content=content.strip(), tool_calls=tuple(calls))


def _parse_call(raw: str) -> ToolCall:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ToolCallError(f"malformed tool call: invalid JSON ({e.msg} at char {e.pos})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ToolCallError('malformed tool call: expected {"name": str, "arguments": object}')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models emit arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise ToolCallError("malformed tool call: arguments is a string that is not JSON") from None
    if not isinstance(args, dict):
        raise ToolCallError("malformed tool call: arguments must be a JSON object")
    return ToolCall(obj["name"], args)


class ChatTokenizer:
    """A local HF tokenizer directory (tokenizer.json) plus this chat format."""

    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer

        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in model directory {model_dir}")
        self.tok = Tokenizer.from_file(str(path))
        ids = {t: self.tok.token_to_id(t) for t in SPECIAL_TOKENS}
        missing = [t for t, i in ids.items() if i is None]
        if missing:
            raise ValueError(f"tokenizer in {model_dir} lacks special tokens {missing}")
        self.im_end_id: int = ids[IM_END]
        self.eos_id: int = ids[EOS]
        self.stop_ids: tuple[int, ...] = (self.im_end_id, self.eos_id)
        self.call_ids: tuple[int, int] = (ids[TOOL_CALL_OPEN], ids[TOOL_CALL_CLOSE])

    def parse_reply_ids(self, ids: list[int]) -> AssistantReply:
        """:func:`parse_reply` on token ids: tool calls are what lies between the ``<tool_call>`` and
        ``</tool_call>`` special tokens, so a JSON string that spells out ``</tool_call>`` stays inside its call."""
        ids = list(ids)
        while ids and ids[-1] in self.stop_ids:
            ids.pop()
        opening, closing = self.call_ids
        if opening not in ids and closing not in ids:
            return parse_reply(self.decode(ids))
        content, calls, i = [], [], 0
        while i < len(ids):
            if ids[i] == closing:
                return AssistantReply(
                    content=self.decode(ids), error="malformed tool call: unbalanced <tool_call> tags"
                )
            if ids[i] != opening:
                content.append(ids[i])
                i += 1
                continue
            end = ids.index(closing, i) if closing in ids[i:] else -1
            if end < 0 or opening in ids[i + 1 : end]:
                return AssistantReply(
                    content=self.decode(ids), error="malformed tool call: unbalanced <tool_call> tags"
                )
            try:
                calls.append(_parse_call(self.decode(ids[i + 1 : end])))
            except ToolCallError as e:
                return AssistantReply(content=self.decode(ids), error=str(e))
            i = end + 1
        return AssistantReply(content=self.decode(content).strip(), tool_calls=tuple(calls))

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    @functools.cached_property
    def grammars(self) -> Grammars:
        """llguidance over this tokenizer (:mod:`agentflow.structured`), to check request grammars."""
        from agentflow.structured import Grammars

        return Grammars(self.tok.to_str(), self.vocab_size, list(self.stop_ids))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def prompt_ids(self, system: str, user: str, tools: list[dict[str, Any]] | None) -> list[int]:
        """First prompt of an episode, ending with the assistant generation prompt."""
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        return self.encode(render_conversation(msgs, tools, add_generation_prompt=True))

    def continuation_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """Ids that follow a finished assistant turn (which ends at ``<|im_end|>``): only the new messages."""
        return self.encode("\n" + render_conversation(messages, add_generation_prompt=True))
