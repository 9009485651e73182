"""Structured generation: the grammars a reply is constrained to, and the token masks they imply.

One library does the work everywhere: llguidance (Lark grammars with inline JSON schemas). The proxy turns a
request's ``tool_choice``, ``strict`` tools, ``parallel_tool_calls`` and ``response_format`` into one Lark grammar
(:func:`request_grammar`); the embedded engine masks its logits with it token by token; an SGLang server gets the
same text as its ``ebnf`` sampling field (its llguidance backend reads Lark). Behaviour log-probs are those of the
masked distribution the token was drawn from, so the trainer must mask the same way: it does not store masks, it
replays the grammar over the recorded tokens (:meth:`Grammars.replay`), which is exact because the matcher is
deterministic, and cheap (tens of microseconds a token).

A constrained reply always fits its token budget: strings and arrays a schema leaves unbounded get a ``maxLength``
/ ``maxItems`` sized from the budget, and objects without ``additionalProperties`` get ``false`` (the declared
properties only). Without that a model that has never seen the schema could ramble inside a string until the
budget ran out and return half a tool call. What was bounded is reported back (:attr:`Grammar.bounds`).
"""

from __future__ import annotations

import copy
import functools
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch

#: JSON as our chat template renders it (``json.dumps`` separators, no free whitespace to ramble in).
_JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
#: Tokens one character of a generated string is budgeted at: the worst case of byte-level BPE (a four-byte
#: character spelled byte by byte), so a bounded reply always fits.
_TOKENS_PER_CHAR = 4
_ARRAY_ITEMS = 4
"""``maxItems`` given to arrays that declare none."""
INTEGER_BOUND = 999_999_999
"""Integers a schema leaves unbounded are kept within plus or minus this (nine digits)."""


Counter = Callable[[str], int]
"""Tokens of a piece of reply text."""


#: Every grammar ends the turn with this special token itself rather than leaving the end to the engine's EOS set:
#: engines disagree on which ids count as EOS (SGLang takes the tokenizer's one), and the mask at the last
#: position must be the same everywhere for the trainer's replay to reproduce its log-prob.
END = "<|im_end|>"


#: First line of a grammar whose forced text must be spelled in canonical tokens (a Lark comment: other engines
#: read the grammar the same, and the replay knows how the tokens were masked).
CANONICAL = "// forced text in canonical tokens\n"


def is_canonical(lark: str) -> bool:
    return lark.startswith(CANONICAL)


def canonical(grammar: Grammar) -> Grammar:
    """The grammar marked for canonical forcing (:meth:`Grammars.mask_into`)."""
    return grammar if is_canonical(grammar.lark) else Grammar(CANONICAL + grammar.lark, grammar.kind, grammar.bounds)


class GrammarError(ValueError):
    """A schema or grammar llguidance cannot compile; the message names the problem."""


@dataclass(frozen=True)
class Grammar:
    """A Lark grammar for llguidance and what the proxy changed to make it fit the budget."""

    lark: str
    kind: str
    """``tool_call`` (required or named), ``auto`` (text, or the ``response_format`` JSON, or calls of the tools),
    ``text`` (no tool calls), ``json`` (``response_format``)."""
    bounds: dict[str, int] = field(default_factory=dict)
    """Bounds added to unbounded schema parts, e.g. ``{"maxLength": 12}``."""


# ---------------------------------------------------------------------------------------------- building grammars


def request_grammar(
    tools: list[dict[str, Any]],
    tool_choice: str | dict[str, Any] | None,
    parallel: bool,
    response_format: dict[str, Any] | None,
    budget: int,
    count_tokens: Counter | None = None,
) -> Grammar | None:
    """The grammar a chat request's reply must match, or None when it is unconstrained.

    ``tool_choice`` is normalised: ``None``/``"auto"``, ``"none"``, ``"required"``, or ``{"names": [...],
    "mode": "auto"|"required"}`` (a named function or an allowed-tools subset). ``count_tokens`` (the model's
    tokenizer) sizes the bounds; without it a token is taken to be two characters.
    """
    count = count_tokens or (lambda text: len(text) // 2 + 1)
    names = [t["function"]["name"] for t in tools]
    mode, allowed = "auto", names
    if isinstance(tool_choice, dict):
        mode, allowed = tool_choice["mode"], tool_choice["names"]
    elif tool_choice in ("none", "required"):
        mode = tool_choice
    offered = [t for t in tools if t["function"]["name"] in allowed]
    if response_format is not None and (not tools or mode == "none"):
        return _json_grammar(response_format, budget, count)
    if not tools:
        return None
    if mode == "none":
        return Grammar(f"start: TEXT? {END}\nTEXT: /(.|\\n)+/\n", "text")
    strict = any(t["function"].get("strict") for t in offered)
    if mode == "auto" and not strict and parallel and len(offered) == len(tools) and response_format is None:
        return None  # free text or any calls, parsed afterwards
    # A forced reply is exactly one call (allowed, not required, by parallel_tool_calls), so it can take the whole
    # budget; in auto mode the model may make several, each bounded as if it were alone.
    bounds: dict[str, int] = {}
    rules = [_call_rule(i, t, budget, bounds, count) for i, t in enumerate(offered)]
    calls = "call+" if parallel and mode == "auto" else "call"
    head = "call: " + " | ".join(f"call_{i}" for i in range(len(offered)))
    if mode == "required":  # a forced call has no text for a response_format to shape (OpenAI accepts both)
        start = f"start: {calls} {END}"
    elif response_format is not None:  # the reply's text, when it has any, is the response_format's JSON
        reply, added = _json_rule(response_format, budget, count)
        bounds.update({k: min(bounds.get(k, v), v) for k, v in added.items()})
        start = f"start: (reply | {calls}) {END}\nreply: {reply}"
    else:
        start = f"start: (TEXT | TEXT? {calls}) {END}\nTEXT: /(.|\\n)+/"
    kind = "tool_call" if mode == "required" else "auto"
    return Grammar("\n".join([start, head, *rules]) + "\n", kind, bounds)


def _call_rule(i: int, tool: dict[str, Any], budget: int, bounds: dict[str, int], count: Counter) -> str:
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    name = json.dumps(fn["name"])
    wrap = lambda args: f'<tool_call>\n{{"name": {name}, "arguments": {args}}}\n</tool_call><|im_end|>'
    args, added = bound_schema(params, budget, lambda text: count(wrap(text)))
    for k, v in added.items():
        bounds[k] = min(bounds.get(k, v), v)
    style = dict(_JSON_STYLE)
    if not fn.get("strict"):
        style["lenient"] = True  # best effort: keywords llguidance cannot enforce are dropped, not refused
    schema = {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, "arguments": args},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "x-guidance": style,
    }
    return f'call_{i}: <tool_call> "\\n" %json {json.dumps(schema)} "\\n" </tool_call>'


def _json_grammar(response_format: dict[str, Any], budget: int, count: Counter) -> Grammar:
    reply, added = _json_rule(response_format, budget, count)
    return Grammar(f"start: {reply} {END}\n", "json", added)


def _json_rule(response_format: dict[str, Any], budget: int, count: Counter) -> tuple[str, dict[str, int]]:
    """The ``%json`` expression of a ``response_format`` bounded to the budget, and the bounds it added."""
    if response_format["type"] == "json_object":
        schema: dict[str, Any] = {"type": "object"}
        strict = False
    else:
        schema, strict = response_format["schema"], bool(response_format.get("strict"))
    bounded, added = bound_schema(schema, budget, lambda text: count(text + "<|im_end|>"))
    style = dict(_JSON_STYLE, lenient=not strict)
    return f"%json {json.dumps({**bounded, 'x-guidance': style})}", added


def bound_schema(
    schema: dict[str, Any], budget: int, count: Counter | None = None
) -> tuple[dict[str, Any], dict[str, int]]:
    """A copy of ``schema`` whose every reply fits about ``budget`` tokens, and the bounds it added.

    ``count`` gives the tokens of a reply's text. Bounded first with strings of one character, the schema's longest
    reply with empty strings (every property, the longest enum values, long numbers, full arrays) is the fixed
    cost; the rest of the budget is shared by the free strings, at :data:`_TOKENS_PER_CHAR` a character.
    """
    count = count or (lambda text: len(text) // 2 + 1)
    for items in range(_ARRAY_ITEMS, -1, -1):  # fewer array items (down to minItems) until the rest fits
        probe: dict[str, Any] = copy.deepcopy(schema)
        _bound(probe, 1, {}, 0, items)
        fixed = count(json.dumps(_skeleton(probe, 0)))
        slots = max(_count_strings(probe, 0), 1)
        if fixed + slots * _TOKENS_PER_CHAR <= budget:
            break
    else:
        raise GrammarError(f"a reply of this schema takes at least {fixed} tokens; the budget is {budget}")
    length = max(1, (budget - fixed) // (slots * _TOKENS_PER_CHAR))
    out = copy.deepcopy(schema)
    added: dict[str, int] = {}
    _bound(out, length, added, 0, items)
    return out, added


def _skeleton(node: Any, depth: int) -> Any:
    """The longest reply of a bounded schema with its free strings empty (what a reply costs besides them)."""
    if not isinstance(node, dict) or depth > 8:
        return ""
    if "const" in node:
        return node["const"]
    if "enum" in node:
        return max(node["enum"], key=lambda v: len(json.dumps(v)), default="")
    for key in ("anyOf", "oneOf"):
        if node.get(key):
            return max((_skeleton(c, depth + 1) for c in node[key]), key=lambda v: len(json.dumps(v)))
    types = _types(node)
    if "object" in types:
        obj = {k: _skeleton(v, depth + 1) for k, v in (node.get("properties") or {}).items()}
        if node.get("patternProperties"):
            obj.update({f"k{j}": "" for j in range(int(node.get("maxProperties", _ARRAY_ITEMS)))})
        return obj
    if "array" in types:
        item = _skeleton(node.get("items") or {}, depth + 1)
        return [item] * min(int(node.get("maxItems", _ARRAY_ITEMS)), _ARRAY_ITEMS)
    if types & {"integer", "number"}:
        ends = [node[k] for k in ("minimum", "maximum") if isinstance(node.get(k), int | float)]
        if len(ends) == 2:
            return max(ends, key=lambda v: len(json.dumps(v)))
        return -12345678 if "integer" in types else -1234.5678
    if "boolean" in types:
        return False
    return None if types == {"null"} else ""


def _count_strings(node: Any, depth: int) -> int:
    """Free strings a reply can hold (arrays count their bounded items), to share the budget between them."""
    if not isinstance(node, dict) or depth > 8:
        return 0
    n = 1 if _is_free_string(node) else 2 * _ARRAY_ITEMS if _is_free_object(node) else 0
    for key in ("properties", "$defs", "definitions"):
        n += sum(_count_strings(v, depth + 1) for v in (node.get(key) or {}).values())
    for key in ("anyOf", "oneOf", "allOf"):
        n += max((_count_strings(v, depth + 1) for v in node.get(key) or []), default=0)
    if isinstance(node.get("items"), dict):
        n += min(int(node.get("maxItems", _ARRAY_ITEMS)), _ARRAY_ITEMS) * _count_strings(node["items"], depth + 1)
    return n


def _types(node: dict[str, Any]) -> set[str]:
    t = node.get("type")
    return set(t) if isinstance(t, list) else {t} if isinstance(t, str) else set()


def _is_free_string(node: dict[str, Any]) -> bool:
    return "string" in _types(node) and not ({"maxLength", "enum", "const", "pattern", "format"} & node.keys())


def _is_free_object(node: dict[str, Any]) -> bool:
    return "object" in _types(node) and not node.get("properties") and "additionalProperties" not in node


def _bound(node: Any, length: int, added: dict[str, int], depth: int, items: int = _ARRAY_ITEMS) -> None:
    if not isinstance(node, dict) or depth > 32:
        return
    if _is_free_string(node):
        node["maxLength"] = length
        added["maxLength"] = length
    if "integer" in _types(node) and not ({"minimum", "maximum", "enum", "const"} & node.keys()):
        node["minimum"], node["maximum"] = -INTEGER_BOUND, INTEGER_BOUND  # no run of digits past the budget
        added["maximum"] = INTEGER_BOUND
    if "array" in _types(node) and "maxItems" not in node:
        node["maxItems"] = max(items, int(node.get("minItems", 0)))
        added["maxItems"] = node["maxItems"]
    if _is_free_object(node):  # any object: a few short string or number values
        value = {"type": ["string", "number", "boolean", "null"], "maxLength": length}
        node["patternProperties"] = {f"^[A-Za-z0-9_]{{1,{length}}}$": value}  # bounded keys, too
        node["additionalProperties"] = False
        node["maxProperties"] = max(items, 1)
        added["maxProperties"] = node["maxProperties"]
    elif "object" in _types(node) and "additionalProperties" not in node:
        node["additionalProperties"] = False
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        for child in (node.get(key) or {}).values():
            _bound(child, length, added, depth + 1, items)
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        for child in node.get(key) or []:
            _bound(child, length, added, depth + 1, items)
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            _bound(node[key], length, added, depth + 1, items)


# --------------------------------------------------------------------------------------------- matchers and masks


_CACHED = 64
"""Compiled grammars a :class:`Grammars` keeps."""


class ConstraintMismatch(RuntimeError):
    """A recorded token the grammar does not allow (the engine masked differently than the replay)."""


class Grammars:
    """llguidance over one tokenizer: checks grammars, builds matchers and replays masks."""

    def __init__(self, tokenizer_json: str, n_vocab: int, eos_ids: list[int]) -> None:
        from llguidance import LLTokenizer

        self.n_vocab = n_vocab
        self.words = (n_vocab + 31) // 32
        self.tokenizer = LLTokenizer(tokenizer_json, n_vocab=n_vocab, eos_token=list(eos_ids))
        self._compiled: dict[str, Any] = {}
        self._lock = threading.Lock()

    def matcher(self, lark: str) -> Any:
        """A fresh matcher at the grammar's start; raises :class:`GrammarError` when the grammar is invalid.

        Compiled grammars are kept (the last :data:`_CACHED` of them) and copied: an agent's calls share one, and
        compiling takes a millisecond or more where a copy takes microseconds.
        """
        from llguidance import LLMatcher

        with self._lock:
            start = self._compiled.pop(lark, None)
        if start is None:
            start = LLMatcher(self.tokenizer, LLMatcher.grammar_from_lark(lark), log_level=0)
            if start.is_error():
                raise GrammarError(start.get_error())
        with self._lock:
            self._compiled[lark] = start
            while len(self._compiled) > _CACHED:
                self._compiled.pop(next(iter(self._compiled)))
        return start.deep_copy()

    def masks_into(self, rows: list[tuple[Any, bool]], out: torch.Tensor) -> list[str | None]:
        """:meth:`mask_into` for several ``(matcher, canonical)`` rows at once into ``out [rows, words]``. A
        canonical row whose next token is forced gets its one-token mask without a mask computation (half the
        tokens of a tool call are forced); the others' masks come from one llguidance call for the batch.
        Returns per row an error or None."""
        errors: list[str | None] = [m.get_error() if m.is_error() else None for m, _ in rows]
        rest = []
        for i, (m, canonical) in enumerate(rows):
            forced = m.compute_ff_tokens() if canonical and errors[i] is None else None
            if forced:
                out[i, forced[0] // 32] = _bit(forced[0] % 32)  # ``out`` rows start zeroed
            elif errors[i] is None:
                rest.append((m, i))
        if rest:
            self._executor.unsafe_compute_mask_ptr(rest, out.data_ptr(), self.words * 4, len(rows))
            for m, i in rest:
                errors[i] = m.get_error() if m.is_error() else None
        return errors

    @functools.cached_property
    def _executor(self) -> Any:
        from llguidance import LLExecutor

        return LLExecutor(num_threads=1)

    def check(self, lark: str) -> None:
        self.matcher(lark)

    def mask_into(self, matcher: Any, out: torch.Tensor, canonical: bool = False) -> None:
        """Write the matcher's next-token bitmask into the int32 row ``out [words]``.

        ``canonical`` (grammars marked with :data:`CANONICAL`): where the grammar forces the next bytes (a tool's
        name, the JSON punctuation), only the first token of their canonical tokenization is allowed. A model free
        to spell forced text in any tokenization (a random one picks single characters) would spend several times
        the tokens the budget was sized for. Engines that mask by plain llguidance (SGLang) get unmarked grammars.
        """
        matcher.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * 4)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        forced = matcher.compute_ff_tokens() if canonical else None
        if forced:
            out.zero_()
            out[forced[0] // 32] = _bit(forced[0] % 32)

    def replay(self, lark: str, tokens: list[int], logprobs: list[float] | None = None) -> torch.Tensor:
        """The bitmask each of ``tokens`` was drawn under, ``[len(tokens), words]`` int32.

        A :data:`CANONICAL` grammar (our engine) replays exactly. Otherwise (SGLang, which jumps over forced grammar
        text in tokens of its own choosing) the recorded ``logprobs`` say where the engine forced a token: a token
        drawn with probability 1 gets a mask of that token alone (the grammar must accept it). Raises
        :class:`ConstraintMismatch` when a token is not allowed, or when the replay allows one token where the
        engine drew from several: either way the trainer could not reproduce the log-prob.
        """
        m, canonical = self.matcher(lark), is_canonical(lark)
        masks = torch.zeros(len(tokens), self.words, dtype=torch.int32)
        for i, tok in enumerate(tokens):
            self.mask_into(m, masks[i], canonical)
            forced = not canonical and logprobs is not None and logprobs[i] > -1e-6
            allowed_here = bool((int(masks[i, tok // 32]) >> (tok % 32)) & 1)
            if forced:
                masks[i].zero_()
                masks[i, tok // 32] = _bit(tok % 32)
            elif not allowed_here:
                raise ConstraintMismatch(f"token {tok} at position {i} is not allowed by the grammar")
            elif not canonical and logprobs is not None and _single(masks[i]):
                raise ConstraintMismatch(f"token {tok} at position {i}: the grammar forces it, the engine did not")
            if not m.consume_token(tok):
                raise ConstraintMismatch(f"token {tok} at position {i} is not allowed by the grammar")
        return masks


def segment_vocab_masks(
    token_ids: list[int], logprobs: list[float], constraints: list[tuple[int, int, str]], grammars: Grammars
) -> list[tuple[int, bytes]]:
    """``Sample.vocab_masks`` of a segment: for every token sampled under a grammar, its position and bitmask."""
    out: list[tuple[int, bytes]] = []
    for start, end, lark in constraints:
        masks = grammars.replay(lark, token_ids[start:end], logprobs[start:end])
        out.extend((start + k, masks[k].numpy().tobytes()) for k in range(end - start))
    return out


def _single(row: torch.Tensor) -> bool:
    """Whether a bitmask row allows exactly one token."""
    bits = [int(w) & 0xFFFFFFFF for w in row.tolist() if w]
    return len(bits) == 1 and bits[0] & (bits[0] - 1) == 0


def _bit(j: int) -> int:
    """Bit ``j`` of an int32 word as a (signed) Python int."""
    return (1 << j) - (1 << 32) if j == 31 else 1 << j


def allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """Bool ``[..., vocab]`` from int32 bitmask words ``[..., words]`` (bit ``j`` of word ``i``: token
    ``32 * i + j``); tokens past the mask's width are not allowed."""
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    flat = bits.flatten(-2).bool()
    if flat.shape[-1] >= vocab:
        return flat[..., :vocab]
    pad = torch.zeros(*flat.shape[:-1], vocab - flat.shape[-1], dtype=torch.bool)
    return torch.cat([flat, pad], dim=-1)


@lru_cache(maxsize=8)
def grammars_for(model_dir: str, n_vocab: int | None = None) -> Grammars:
    """The (cached) :class:`Grammars` of a model directory's ``tokenizer.json``; ``n_vocab`` defaults to the
    model's ``vocab_size`` (the logits' width)."""
    from pathlib import Path

    from tokenizers import Tokenizer

    root = Path(model_dir)
    tok = Tokenizer.from_file(str(root / "tokenizer.json"))
    if n_vocab is None:
        config = json.loads((root / "config.json").read_text()) if (root / "config.json").is_file() else {}
        n_vocab = int(config.get("vocab_size", tok.get_vocab_size()))
    eos = [i for i in (tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")) if i is not None]
    return Grammars(tok.to_str(), n_vocab, eos)
