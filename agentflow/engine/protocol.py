"""The SGLang HTTP protocol subset (0.5.x) shared by our server and our client: request parsing, reply shapes.

Field names, nesting and error bodies follow real SGLang (replies recorded from SGLang 0.5.23 are in
``tests/fixtures/sglang``). SGLang uses three error body shapes, and so do we, for the same kinds of mistakes:

- request-body validation (a top-level field of the wrong type): OpenAI style
  ``{"object": "error", "message", "type": "Bad Request", "param": null, "code": 400}``;
- an unknown ``sampling_params`` key: ``{"error": "unknown field `x`, expected one of ..."}`` (a string);
- every other bad value: ``{"error": {"message": ...}}``.

Weight versions are strings on the wire (``"default"`` before any update) and ints in AgentFlow.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentflow.types import FinishReason, SamplingParams

#: Every key SGLang 0.5.23 accepts in ``sampling_params``, in its own order.
SAMPLING_KEYS = (
    "max_new_tokens stop stop_token_ids stop_regex temperature top_p top_k min_p frequency_penalty presence_penalty "
    "repetition_penalty min_new_tokens n json_schema regex ebnf structural_tag ignore_eos skip_special_tokens "
    "spaces_between_special_tokens no_stop_trim stream_interval logit_bias sampling_seed custom_params beam_width "
    "watermark choice"
).split()
#: Keys we accept but cannot honour: allowed only at their neutral value.
_NEUTRAL: dict[str, Any] = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "beam_width": 1,
}
_SUPPORTED = {
    "ebnf",
    "json_schema",
    "regex",
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "ignore_eos",
    "sampling_seed",
}
_IGNORED = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval"}
DEFAULT_VERSION_LABEL = "default"
FLUSH_OK_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
FLUSH_FAILED_TEXT = "Flush cache failed.\n"
SESSION_MESSAGE = "{} must run between begin_weight_update() and end_weight_update()"


class ProtocolError(Exception):
    """A request the server rejects: HTTP ``status`` with the JSON ``body`` SGLang would send."""

    def __init__(self, body: Any, status: int = 400) -> None:
        super().__init__(str(body))
        self.body = body
        self.status = status


def error_message(message: str, status: int = 400) -> ProtocolError:
    """``{"error": {"message": ...}}``: SGLang's usual shape for a bad value."""
    return ProtocolError({"error": {"message": message}}, status)


def validation_error(loc: str, message: str) -> ProtocolError:
    """OpenAI-style body SGLang sends when the request body fails validation (a field of the wrong type)."""
    detail = f"1 validation error:\n  {{'type': 'value_error', 'loc': ('body', '{loc}'), 'msg': '{message}'}}"
    return ProtocolError({"object": "error", "message": detail, "type": "Bad Request", "param": None, "code": 400})


def request_too_large(limit: int) -> ProtocolError:
    """413 for a body over the server's request-size limit (``agentflow serve --max-request-mb``)."""
    size = f"{limit / (1 << 20):g} MiB ({limit} bytes)"
    return error_message(
        f"The request body is larger than this server's limit of {size}; "
        "send less per request or raise the limit (agentflow serve --max-request-mb).",
        413,
    )


def json_body(raw: bytes) -> Any:
    """A request body as JSON. Only UTF-8 is read (RFC 8259), whatever the ``Content-Type`` says; anything else,
    and text that is not JSON, gets the validation error SGLang sends for a malformed body."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        where = f"byte 0x{raw[exc.start]:02x} at offset {exc.start}"
        raise validation_error("body", f"the request body is not UTF-8 ({where}); send JSON encoded as UTF-8") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise validation_error("body", f"JSON decode error: {exc}") from exc


def error_text(body: Any) -> str:
    """The message of any of SGLang's error bodies (``{error: {message}}``, ``{error: str}``, OpenAI style, text)."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            return str(err.get("message", err))
        if err is not None:
            return str(err)
        if "message" in body:
            return str(body["message"])
    return str(body).strip()


def version_label(version: int, labels: dict[int, str]) -> str:
    """Wire label of an int version (``labels`` holds non-numeric names set by callers)."""
    return labels.get(version, str(version))


def parse_version(label: Any) -> int:
    """Int version of a wire label: ``"7"`` -> 7, ``"default"`` -> 0, else the first integer in it (``"v5-x"`` -> 5),
    else 0. AgentFlow's client always sends ``str(int)`` labels; the rest is for servers others updated."""
    if isinstance(label, int) and not isinstance(label, bool):
        return label
    text = str(label)
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    m = re.search(r"\d+", text)
    return int(m.group()) if m else 0


@dataclass
class GenItem:
    """One prompt of a ``/generate`` call, after validation (a batch or ``n > 1`` makes several)."""

    prompt: list[int]
    sampling: SamplingParams
    rid: str | None
    stop_strings: list[str] = field(default_factory=list)


@dataclass
class GenOptions:
    """Per-call options of ``/generate``."""

    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    batch: bool = False
    """Reply with a JSON array (batch input or ``n > 1``)."""
    return_routed_experts: bool = False
    """MoE models: ``meta_info.routed_experts`` in the final reply (SGLang's base64 int32 ``[positions, layers,
    top-k]`` over positions ``[0, prompt + output - 1)``)."""


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _typed(body: dict[str, Any], key: str, check: Callable[[Any], bool], default: Any, what: str) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if not check(value):
        raise validation_error(key, f"Value error, must be {what}; got {type(value).__name__}")
    return value


def parse_options(body: Any) -> GenOptions:
    """Top-level flags of a ``/generate`` body."""
    if not isinstance(body, dict):
        raise validation_error("body", "Value error, must be a JSON object")
    return GenOptions(
        return_logprob=_typed(body, "return_logprob", lambda x: isinstance(x, bool), False, "bool"),
        logprob_start_len=_typed(body, "logprob_start_len", _is_int, -1, "int"),
        top_logprobs_num=_typed(body, "top_logprobs_num", _is_int, 0, "int"),
        stream=_typed(body, "stream", lambda x: isinstance(x, bool), False, "bool"),
        return_routed_experts=_typed(body, "return_routed_experts", lambda x: isinstance(x, bool), False, "bool"),
    )


def _prompts(body: dict[str, Any], encode: Callable[[str], list[int]] | None) -> tuple[list[list[int]], bool]:
    """The prompt(s) as id lists, and whether the input was a batch."""
    ids, text = body.get("input_ids"), body.get("text")
    if ids is None and text is None:
        raise error_message("Either text, input_ids or input_embeds should be provided.")
    if ids is None:
        if encode is None:
            raise error_message("text prompts need a tokenizer; this server has none (send input_ids)")
        if isinstance(text, str):
            return [encode(text)], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return [encode(t) for t in text], True
        raise validation_error("text", "Value error, must be str or list of str")
    if not isinstance(ids, list):
        raise validation_error("input_ids", f"Value error, must be list or null; got {type(ids).__name__}")
    if ids and all(isinstance(p, list) for p in ids):
        batch = True
        prompts = ids
    else:
        batch = False
        prompts = [ids]
    for p in prompts:
        if not all(_is_int(t) for t in p):
            raise validation_error("input_ids", "Value error, must be a list of int or a list of lists of int")
    return prompts, batch


def check_prompt(prompt: list[int], vocab_size: int, context_len: int) -> None:
    """Range and length checks SGLang lacks (it crashes on out-of-vocabulary ids: we answer 400)."""
    if not prompt:
        raise error_message("input_ids cannot be empty.")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise error_message(f"input_ids must be in [0, {vocab_size}) (the vocabulary); got {bad[:5]}.")
    if len(prompt) >= context_len:
        raise error_message(
            f"The input ({len(prompt)} tokens) is longer than the model's context length ({context_len} tokens)."
        )


def _sampling(sp: Any, eos_ids: tuple[int, ...]) -> tuple[SamplingParams, list[str], int]:
    """Validate one ``sampling_params`` dict; return our params, stop strings and ``n``."""
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise validation_error("sampling_params", "Value error, must be a dict (or a list of dicts for a batch)")
    for key, value in sp.items():
        if key not in SAMPLING_KEYS:
            expected = ", ".join(f"`{k}`" for k in SAMPLING_KEYS)
            raise ProtocolError({"error": f"unknown field `{key}`, expected one of {expected}"})
        if key in _NEUTRAL and value is not None and value != _NEUTRAL[key]:
            raise error_message(f"sampling param {key}={value!r} is not supported by this server.")
        if key not in _NEUTRAL and key not in _IGNORED and key not in _SUPPORTED and value is not None:
            raise error_message(f"sampling param {key} is not supported by this server.")
    temperature = sp.get("temperature", 1.0)
    if not _is_num(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise error_message(f"temperature must be a non-negative finite number, got {temperature}.")
    max_new = sp.get("max_new_tokens", 128)
    if not _is_int(max_new) or max_new < 0:
        raise error_message(f"max_new_tokens must be at least 0, got {max_new}.")
    top_p = sp.get("top_p", 1.0)
    if not _is_num(top_p) or not 0 < top_p <= 1:
        raise error_message(f"top_p must be in (0, 1], got {top_p}.")
    top_k = sp.get("top_k", -1)
    if not _is_int(top_k) or top_k == 0 or top_k < -1:
        raise error_message(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    n = sp.get("n", 1)
    if not _is_int(n) or n < 1:
        raise error_message(f"n must be at least 1, got {n}.")
    stop_ids = sp.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(_is_int(t) for t in stop_ids):
        raise error_message("stop_token_ids must be a list of int.")
    stop = sp.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise error_message("stop must be a string or a list of non-empty strings.")
    seed = sp.get("sampling_seed")
    if seed is not None and not _is_int(seed):
        raise error_message(f"sampling_seed must be an int, got {seed!r}.")
    grammar = _grammar(sp)
    # as SGLang: ignore_eos switches off stop_token_ids too (only max_new_tokens and stop strings end the request)
    stops = () if sp.get("ignore_eos") else (*stop_ids, *eos_ids)
    params = SamplingParams(
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=int(top_k),
        max_new_tokens=max_new,
        stop_token_ids=tuple(dict.fromkeys(stops)),
        seed=seed,
        grammar=grammar,
    )
    return params, stop, n


def _grammar(sp: dict[str, Any]) -> str | None:
    """The Lark grammar of ``ebnf`` (read as SGLang's llguidance backend reads it: Lark), ``json_schema`` or
    ``regex``; at most one of them, as SGLang allows."""
    given = {k: sp[k] for k in ("ebnf", "json_schema", "regex") if sp.get(k) is not None}
    if len(given) > 1:
        raise error_message("Only one of regex, json_schema, or ebnf can be set.")
    if not given:
        return None
    ((key, text),) = given.items()
    if not isinstance(text, str):
        raise error_message(f"{key} must be a string.")
    if key == "ebnf":
        return text
    if key == "regex":
        return f"start: /{text.replace('/', chr(92) + '/')}/\n"
    return f"start: %json {text}\n"


def parse_generate(
    body: Any,
    vocab_size: int,
    context_len: int,
    eos_ids: tuple[int, ...] = (),
    encode: Callable[[str], list[int]] | None = None,
) -> tuple[list[GenItem], GenOptions]:
    """Validate a ``/generate`` body into items (one per prompt and sample) and options; raise ProtocolError."""
    opts = parse_options(body)
    prompts, opts.batch = _prompts(body, encode)
    sps, rids = body.get("sampling_params"), body.get("rid")
    if isinstance(sps, list) and not opts.batch:
        raise error_message("a list of sampling_params needs a batch of prompts (a list of input_ids lists).")
    sps = sps if isinstance(sps, list) else [sps] * len(prompts)
    if len(sps) != len(prompts):
        raise error_message(f"{len(sps)} sampling_params for {len(prompts)} prompts.")
    if rids is not None and not isinstance(rids, str | list):
        raise validation_error("rid", f"Value error, must be str or list of str; got {type(rids).__name__}")
    rid_list = rids if isinstance(rids, list) else [rids] * len(prompts)
    if len(rid_list) != len(prompts) or not all(r is None or isinstance(r, str) for r in rid_list):
        raise validation_error("rid", "Value error, must be one str per prompt")
    items: list[GenItem] = []
    for prompt, sp, rid in zip(prompts, sps, rid_list, strict=True):
        check_prompt(prompt, vocab_size, context_len)
        params, stop, n = _sampling(sp, eos_ids)
        if n > 1:
            opts.batch = True
        items += [GenItem(list(prompt), params, None if n > 1 else rid, stop) for _ in range(n)]
    if opts.top_logprobs_num < 0:
        raise error_message(f"top_logprobs_num must be at least 0, got {opts.top_logprobs_num}.")
    return items, opts


def encode_routed_experts(routes: list[tuple[int, list[list[int]]]], positions: int, layers: int, k: int) -> str:
    """SGLang's ``routed_experts``: base64 of int32 ``[positions, layers, k]``, -1 where a position's experts are not
    known (a prefix this engine reused without recording it)."""
    import base64

    import numpy as np

    out = np.full((positions, layers, k), -1, dtype="<i4")
    for pos, chosen in routes:
        if 0 <= pos < positions:
            out[pos] = chosen
    return base64.b64encode(out.tobytes()).decode()


def decode_routed_experts(data: str, layers: int, k: int, start: int = 0) -> list[tuple[int, list[list[int]]]]:
    """``(position, experts per layer)`` from SGLang's base64 ``routed_experts`` (positions from ``start``; ones all
    -1 are left out)."""
    import base64

    import numpy as np

    raw = np.frombuffer(base64.b64decode(data), dtype="<i4")
    if raw.size % (layers * k):
        raise ValueError(f"routed_experts holds {raw.size} ids, not a multiple of {layers} layers x top-{k}")
    grid = raw.reshape(-1, layers, k)
    return [(start + i, row.tolist()) for i, row in enumerate(grid) if (row >= 0).any()]


def finish_reason_json(reason: FinishReason | None, length: int, matched: int | str | None) -> dict[str, Any] | None:
    """SGLang's ``meta_info.finish_reason`` object."""
    if reason is None:
        return None
    if reason == "abort":
        return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    if reason == "stop":
        return {"type": "stop", "matched": matched}
    return {"type": "length", "length": length}


def version_spans(versions: list[int], labels: dict[int, str], current: int) -> list[dict[str, Any]]:
    """``weight_versions``: ``[start, end)`` output-token spans per version (one empty span when no tokens)."""
    if not versions:
        return [{"version": version_label(current, labels), "start": 0, "end": 0}]
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["_v"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"_v": v, "version": version_label(v, labels), "start": i, "end": i + 1})
    return [{k: s[k] for k in ("version", "start", "end")} for s in spans]


def versions_from_spans(spans: list[dict[str, Any]] | None, n: int, fallback: int) -> list[int]:
    """Per-token int versions from ``weight_versions`` spans (``fallback`` where none cover a token)."""
    out = [fallback] * n
    for span in spans or []:
        v = parse_version(span.get("version"))
        for i in range(max(0, int(span.get("start", 0))), min(n, int(span.get("end", 0)))):
            out[i] = v
    return out
