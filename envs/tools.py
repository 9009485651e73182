"""Tools declared from typed Python functions: JSON schema from type hints and docstring, validated dispatch.

A tool is a plain (or ``async``) function whose parameters are annotated with ``str``, ``int``, ``float``,
``bool``, ``list[...]``, ``dict[str, ...]``, ``Literal[...]`` or ``X | None``; defaults make a parameter optional.
Its docstring's first paragraph is the tool's description and a Google-style ``Args:`` section describes the
parameters::

    @tool
    def search(query: str, k: int = 3) -> str:
        '''Search the documents.

        Args:
            query: Words to look for.
            k: How many documents to return.
        '''

:class:`ToolSet` holds tools (functions or bound methods), lists their :class:`~envs.core.ToolSpec` and dispatches a
call after checking the arguments against the schema (nested types included). :class:`ToolEnv` is an
:class:`~envs.core.AgentEnv` whose ``@tool`` methods are its tools.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, Literal, Union, get_args, get_origin

from envs.core import AgentEnv, ToolSpec, check_max_length
from envs.errors import ActionError, EnvError

SUPPORTED = "str, int, float, bool, list[T], dict[str, T], Literal[...], T | None"
_PRIMITIVES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}
_TOOL_ATTR = "__agentflow_tool__"


class ToolDefinitionError(EnvError, TypeError):
    """A function that cannot be a tool: an unsupported or missing annotation, ``*args``, a bad name."""


# -- schema from type hints ------------------------------------------------------------------------------------
def annotation_schema(annotation: Any, where: str) -> dict[str, Any]:
    """The JSON schema of one annotation; raises :class:`ToolDefinitionError` naming ``where`` if unsupported."""
    if annotation in _PRIMITIVES:
        return {"type": _PRIMITIVES[annotation]}
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        kinds = {_PRIMITIVES.get(type(a)) for a in args}
        if None in kinds or len(kinds) != 1:
            raise ToolDefinitionError(f"{where}: Literal values must all be str, or all int (got {args!r})")
        return {"type": kinds.pop(), "enum": list(args)}
    if origin in (Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(args) == 2:
            inner = annotation_schema(rest[0], where)
            return {**inner, "type": [inner["type"], "null"]} if "enum" not in inner else {"anyOf": [inner, _NULL]}
        raise ToolDefinitionError(f"{where}: unsupported union {annotation!r}; only 'T | None' is supported")
    if origin is list or annotation is list:
        if not args:
            raise ToolDefinitionError(f"{where}: list needs an item type, e.g. list[str]")
        return {"type": "array", "items": annotation_schema(args[0], f"{where} (list item)")}
    if origin is dict:
        if not args or args[0] is not str:
            raise ToolDefinitionError(f"{where}: dict needs str keys and a value type, e.g. dict[str, int]")
        return {"type": "object", "additionalProperties": annotation_schema(args[1], f"{where} (dict value)")}
    if annotation is inspect.Parameter.empty:
        raise ToolDefinitionError(f"{where}: missing type annotation; supported: {SUPPORTED}")
    raise ToolDefinitionError(f"{where}: unsupported annotation {annotation!r}; supported: {SUPPORTED}")


_NULL = {"type": "null"}


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """Split a Google-style docstring into (description, {parameter: description}).

    The description is the text before the first section header (``Args:``, ``Returns:``, ...), joined into one
    paragraph per blank-line-separated block. ``Args:`` entries look like ``name: text`` or ``name (type): text``,
    with indented continuation lines.
    """
    lines = inspect.cleandoc(doc or "").splitlines()
    desc: list[str] = []
    params: dict[str, str] = {}
    section, current = None, None
    for line in lines:
        header = re.fullmatch(r"(\w[\w ]*):\s*", line)
        if header and not line.startswith(" "):
            section, current = header.group(1).lower(), None
            continue
        if section is None:
            desc.append(line.strip())
        elif section in ("args", "arguments", "parameters"):
            entry = re.fullmatch(r"\s{0,4}(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)", line)
            if entry and not line.startswith(" " * 5):
                current = entry.group(1).lstrip("*")
                params[current] = entry.group(2).strip()
            elif current is not None and line.strip():
                params[current] = f"{params[current]} {line.strip()}".strip()
    blocks = "\n".join(desc).split("\n\n")
    description = "\n\n".join(" ".join(b.split()) for b in blocks if b.strip())
    return description, params


def tool_from_function(fn: Callable[..., Any], name: str | None = None, description: str | None = None) -> ToolSpec:
    """The :class:`ToolSpec` of ``fn``: name, description and parameter schema from its signature and docstring.

    ``self`` / ``cls`` of a method are skipped. Raises :class:`ToolDefinitionError` for ``*args``/``**kwargs``,
    parameters without annotation, unsupported annotations and names that are not valid tool names.
    """
    tool_name = name or getattr(fn, "__name__", "")
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]{0,63}", tool_name):
        raise ToolDefinitionError(f"invalid tool name {tool_name!r}: use letters, digits, '_' or '-' (max 64)")
    doc_desc, doc_params = parse_docstring(inspect.getdoc(fn))
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:  # noqa: BLE001 - a NameError in a string annotation, say which tool
        raise ToolDefinitionError(f"tool {tool_name!r}: cannot resolve type hints: {e}") from e
    props: dict[str, Any] = {}
    required: list[str] = []
    for i, (pname, param) in enumerate(inspect.signature(fn).parameters.items()):
        if i == 0 and pname in ("self", "cls"):
            continue
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ToolDefinitionError(f"tool {tool_name!r}: *args/**kwargs are not supported ({pname!r})")
        where = f"parameter {pname!r} of tool {tool_name!r}"
        schema = annotation_schema(hints.get(pname, inspect.Parameter.empty), where)
        if pname in doc_params:
            schema["description"] = doc_params[pname]
        if param.default is param.empty:
            required.append(pname)
        else:
            _check_default(schema, param.default, where)
            schema["default"] = param.default
        props[pname] = schema
    unknown = sorted(set(doc_params) - set(props))
    if unknown:
        raise ToolDefinitionError(f"tool {tool_name!r}: docstring describes unknown parameter(s) {unknown}")
    parameters: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        parameters["required"] = required
    return ToolSpec(tool_name, description if description is not None else doc_desc, parameters)


def _check_default(schema: dict[str, Any], default: Any, where: str) -> None:
    try:
        check_value(schema, default, where)
        json.dumps(default)
    except (ActionError, TypeError) as e:
        raise ToolDefinitionError(f"{where}: default {default!r} does not fit its annotation ({e})") from None


# -- checking values against a schema --------------------------------------------------------------------------
def check_value(schema: dict[str, Any], value: Any, where: str) -> Any:
    """Check ``value`` against a schema made by :func:`annotation_schema`; returns it (ints widened for floats).

    Raises :class:`ActionError` saying which argument (and which item) is wrong.
    """
    if "anyOf" in schema:
        for option in schema["anyOf"]:
            try:
                return check_value(option, value, where)
            except ActionError:
                pass
        raise ActionError(f"{where} must be one of {schema['anyOf'][0].get('enum')} or null, got {value!r}")
    kinds = schema.get("type")
    names = [kinds] if isinstance(kinds, str) else list(kinds or [])
    if value is None and "null" in names:
        return None
    kind = next((n for n in names if n != "null" and _fits(value, n)), None)
    if names and kind is None:
        raise ActionError(f"{where} must be {' or '.join(names)}, got {_json_name(value)}")
    if "enum" in schema and value not in schema["enum"]:
        raise ActionError(f"{where} must be one of {schema['enum']}, got {value!r}")
    check_max_length(schema, value, where)
    if kind == "number":
        return float(value)
    if kind == "array":
        return [check_value(schema.get("items", {}), v, f"{where}[{i}]") for i, v in enumerate(value)]
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        sub = schema["additionalProperties"]
        return {k: check_value(sub, v, f"{where}[{k!r}]") for k, v in value.items()}
    return value


def _fits(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return name == "boolean"
    expected = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict}
    return isinstance(value, expected.get(name, object))


def _json_name(value: Any) -> str:
    for name in ("boolean", "integer", "number", "string", "array", "object"):
        if _fits(value, name):
            return name
    return "null" if value is None else type(value).__name__


def check_arguments(spec: ToolSpec, arguments: dict[str, Any]) -> dict[str, Any]:
    """Validate ``arguments`` for ``spec`` (required, unknown, nested types, enums); returns them with defaults."""
    schema = spec.parameters
    props: dict[str, Any] = schema.get("properties", {})
    missing = [k for k in schema.get("required", []) if k not in arguments]
    if missing:
        raise ActionError(f"tool {spec.name!r} is missing required argument(s): {', '.join(missing)}")
    extra = sorted(set(arguments) - set(props))
    if extra and schema.get("additionalProperties", True) is False:
        raise ActionError(f"tool {spec.name!r} got unknown argument(s): {', '.join(extra)}; known: {sorted(props)}")
    out = {k: v["default"] for k, v in props.items() if "default" in v and k not in arguments}
    for key, value in arguments.items():
        out[key] = check_value(props.get(key, {}), value, f"argument {key!r} of tool {spec.name!r}")
    return out


# -- the decorator and the tool set ----------------------------------------------------------------------------
def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None, description: str | None = None) -> Any:
    """Mark ``fn`` as a tool (``@tool`` or ``@tool(name=..., description=...)``); the schema is built right away.

    The function itself is returned unchanged (still callable as before), with its spec attached.
    """

    def mark(f: Callable[..., Any]) -> Callable[..., Any]:
        setattr(f, _TOOL_ATTR, tool_from_function(f, name, description))
        return f

    return mark(fn) if fn is not None else mark


def spec_of(fn: Callable[..., Any]) -> ToolSpec:
    """The spec of a ``@tool`` function (or of a plain function, built now)."""
    found = getattr(fn, _TOOL_ATTR, None)
    return found if isinstance(found, ToolSpec) else tool_from_function(fn)


def format_result(value: Any) -> str:
    """A tool's return value as observation text: strings as they are, ``None`` as "(no output)", else JSON."""
    if isinstance(value, str):
        return value
    if value is None:
        return "(no output)"
    return json.dumps(value, ensure_ascii=False, default=str)


class ToolSet:
    """Named tools (functions or bound methods) with their specs; validates arguments and calls them."""

    def __init__(self, functions: Sequence[Callable[..., Any]]) -> None:
        self._fns: dict[str, Callable[..., Any]] = {}
        self._specs: dict[str, ToolSpec] = {}
        for fn in functions:
            spec = spec_of(fn)
            if spec.name in self._specs:
                raise ToolDefinitionError(f"two tools are named {spec.name!r}")
            self._fns[spec.name], self._specs[spec.name] = fn, spec

    @property
    def specs(self) -> list[ToolSpec]:
        """The tools' specs, in declaration order."""
        return list(self._specs.values())

    def _lookup(self, name: str, arguments: dict[str, Any]) -> tuple[Callable[..., Any], dict[str, Any]]:
        if name not in self._fns:
            raise ActionError(f"unknown tool {name!r}; available tools: {', '.join(self._specs) or 'none'}")
        return self._fns[name], check_arguments(self._specs[name], arguments)

    def call(self, name: str, arguments: dict[str, Any]) -> str:
        """Validate and call tool ``name``; an ``async`` tool runs to completion on a private event loop."""
        fn, args = self._lookup(name, arguments)
        if inspect.iscoroutinefunction(fn):
            return format_result(_run_coroutine(fn(**args)))
        return format_result(fn(**args))

    async def acall(self, name: str, arguments: dict[str, Any]) -> str:
        """Validate and call tool ``name``: awaited when ``async``, else run in a worker thread."""
        fn, args = self._lookup(name, arguments)
        if inspect.iscoroutinefunction(fn):
            return format_result(await fn(**args))
        return format_result(await asyncio.to_thread(fn, **args))


def _run_coroutine(coro: Any) -> Any:
    """Run ``coro`` to completion from sync code, also when this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


class ToolEnv(AgentEnv):
    """An :class:`AgentEnv` whose tools are its ``@tool`` methods (sync or ``async``), found on the class.

    Subclasses implement :meth:`~envs.core.AgentEnv.reset_task` (setting ``self.task``) and either set ``rubric``
    (a :class:`~envs.verifiers.Rubric`, called as ``rubric.score(answer, self.task, self)``) or override
    :meth:`score_answer`. ``call_tool``/``acall_tool`` dispatch to the methods with validated arguments and record
    the names in ``self.tool_calls``; the final info carries ``reward_terms`` (each rubric term's value).
    """

    rubric: Any = None

    def __init__(self, max_turns: int | None = None) -> None:
        super().__init__(max_turns=max_turns)
        methods = [getattr(self, n) for n in _tool_method_names(type(self))]
        self.toolset = ToolSet(methods)
        self.tools = self.toolset.specs
        self.task: Any = None
        self.tool_calls: list[str] = []
        self.last_score: Any = None

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Clear the episode's tool calls and score, then reset as :meth:`AgentEnv.reset`."""
        self.tool_calls, self.last_score = [], None
        return super().reset(seed=seed, options=options)

    def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        """Record the call and dispatch to the ``@tool`` method ``name``."""
        self.tool_calls.append(name)
        return self.toolset.call(name, arguments)

    async def acall_tool(self, name: str, arguments: dict[str, Any]) -> str:
        """Record the call and await the ``@tool`` method ``name`` (sync ones run in a worker thread)."""
        self.tool_calls.append(name)
        return await self.toolset.acall(name, arguments)

    def score_answer(self, text: str) -> tuple[float, bool]:
        """Score ``text`` with ``rubric`` (a failing term raises :class:`~envs.errors.VerifierError`)."""
        if self.rubric is None:
            raise NotImplementedError(f"{type(self).__name__} sets no rubric and does not override score_answer")
        if self.task is None:
            raise EnvError("no task: call reset() first")
        self.last_score = self.rubric.score(text, self.task, self)
        return self.last_score.reward, self.last_score.success

    def answer_info(self) -> dict[str, Any]:
        """``reward_terms``: each rubric term's unweighted value (when a rubric scored the answer)."""
        return {"reward_terms": dict(self.last_score.terms)} if self.last_score is not None else {}


def _tool_method_names(cls: type) -> list[str]:
    """Names of ``@tool`` methods of ``cls`` in definition order (base classes first)."""
    names: list[str] = []
    for klass in reversed(cls.__mro__):
        for attr, value in vars(klass).items():
            if callable(value) and hasattr(value, _TOOL_ATTR) and attr not in names:
                names.append(attr)
    return names
