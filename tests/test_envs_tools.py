"""Tools from typed Python functions: schema from hints and docstring, clear errors, validated dispatch."""

import asyncio
from typing import Literal

import pytest

from envs.core import tool_action
from envs.errors import ActionError
from envs.tools import (
    ToolDefinitionError,
    ToolEnv,
    ToolSet,
    check_arguments,
    parse_docstring,
    tool,
    tool_from_function,
)


def lookup(
    query: str,
    k: int = 3,
    scale: float = 1.0,
    exact: bool = False,
    tags: list[str] | None = None,
    mode: Literal["fast", "slow"] = "fast",
    weights: dict[str, int] | None = None,
    level: Literal[1, 2] | None = None,
) -> str:
    """Look things up.

    Second paragraph of the description.

    Args:
        query: Words to look for,
            on two lines.
        k (int): How many results.
        mode: Speed.

    Returns:
        Something.
    """
    return f"{query}|{k}|{scale!r}|{exact}|{tags}|{mode}|{weights}|{level}"


def test_schema_from_hints_and_docstring():
    spec = tool_from_function(lookup)
    assert spec.name == "lookup"
    assert spec.description == "Look things up.\n\nSecond paragraph of the description."
    p = spec.parameters
    assert p["type"] == "object" and p["additionalProperties"] is False and p["required"] == ["query"]
    props = p["properties"]
    assert props["query"] == {"type": "string", "description": "Words to look for, on two lines."}
    assert props["k"] == {"type": "integer", "description": "How many results.", "default": 3}
    assert props["scale"] == {"type": "number", "default": 1.0}
    assert props["exact"] == {"type": "boolean", "default": False}
    assert props["tags"] == {"type": ["array", "null"], "items": {"type": "string"}, "default": None}
    assert props["mode"] == {"type": "string", "enum": ["fast", "slow"], "description": "Speed.", "default": "fast"}
    assert props["weights"]["additionalProperties"] == {"type": "integer"}
    assert props["level"]["anyOf"] == [{"type": "integer", "enum": [1, 2]}, {"type": "null"}]
    assert spec.to_openai()["function"]["name"] == "lookup"


def test_parse_docstring_without_sections():
    assert parse_docstring("One line.") == ("One line.", {})
    assert parse_docstring(None) == ("", {})


def _no_hint(x):
    return x


def _star(*args: int) -> str:
    return ""


def _obj(x: object) -> str:
    return ""


def _union(x: int | str) -> str:
    return ""


def _bare_list(x: list) -> str:
    return ""


def _bad_default(x: int = "a") -> str:  # type: ignore[assignment]
    return ""


def _doc_unknown(x: int) -> str:
    """Doc.

    Args:
        y: Not a parameter.
    """
    return ""


@pytest.mark.parametrize(
    "fn, fragment",
    [
        (_no_hint, "parameter 'x' of tool '_no_hint': missing type annotation"),
        (_star, r"\*args/\*\*kwargs are not supported"),
        (_obj, "unsupported annotation <class 'object'>; supported: str, int"),
        (_union, "only 'T | None' is supported"),
        (_bare_list, r"list needs an item type"),
        (_bad_default, "default 'a' does not fit"),
        (_doc_unknown, r"docstring describes unknown parameter\(s\) \['y'\]"),
    ],
)
def test_unsupported_definitions(fn, fragment):
    with pytest.raises(ToolDefinitionError, match=fragment):
        tool_from_function(fn)
    assert issubclass(ToolDefinitionError, TypeError)


def test_bad_tool_name():
    with pytest.raises(ToolDefinitionError, match="invalid tool name"):
        tool_from_function(lookup, name="has space")


def test_dispatch_validates_and_fills_defaults():
    tools = ToolSet([lookup])
    assert tools.call("lookup", {"query": "q", "scale": 2}) == "q|3|2.0|False|None|fast|None|None"
    assert tools.call("lookup", {"query": "q", "tags": ["a"], "level": 2}) == "q|3|1.0|False|['a']|fast|None|2"
    for args, fragment in [
        ({}, "missing required argument"),
        ({"query": "q", "tags": ["a", 3]}, r"argument 'tags' of tool 'lookup'\[1\] must be string, got integer"),
        ({"query": "q", "mode": "medium"}, "must be one of"),
        ({"query": "q", "k": 2.5}, "must be integer, got number"),
        ({"query": "q", "exact": 1}, "must be boolean"),
        ({"query": "q", "weights": {"a": "x"}}, r"\['a'\] must be integer"),
        ({"query": "q", "level": 3}, "one of"),
        ({"query": "q", "extra": 1}, "unknown argument"),
    ]:
        with pytest.raises(ActionError, match=fragment):
            tools.call("lookup", args)
    with pytest.raises(ActionError, match="unknown tool 'nope'; available tools: lookup"):
        tools.call("nope", {})
    assert check_arguments(tools.specs[0], {"query": "x"})["k"] == 3


def test_decorator_async_tool_and_duplicates():
    @tool(name="twice", description="Double a number.")
    async def double(n: int) -> int:
        await asyncio.sleep(0)
        return 2 * n

    assert double.__name__ == "double"  # still the function
    tools = ToolSet([double])
    assert tools.specs[0].name == "twice" and tools.specs[0].description == "Double a number."
    assert tools.call("twice", {"n": 4}) == "8"
    assert asyncio.run(tools.acall("twice", {"n": 5})) == "10"
    with pytest.raises(ToolDefinitionError, match="two tools are named 'lookup'"):
        ToolSet([lookup, lookup])


class _Echo(ToolEnv):
    """A tiny ToolEnv: an @tool method, sync and async, and an answer."""

    tools = []

    def reset_task(self, seed, options):
        return "say something", {"task_id": str(seed), "task_type": "echo", "split": "train"}

    @tool
    def echo(self, text: str, times: int = 1) -> str:
        """Repeat text.

        Args:
            text: What to repeat.
            times: How often.
        """
        return text * times

    @tool
    async def shout(self, text: str) -> str:
        """Upper-case text."""
        return text.upper()

    def score_answer(self, text):
        return float(text == "ok"), text == "ok"


def test_tool_env_dispatch_and_errors():
    env = _Echo(max_turns=5)
    assert [t.name for t in env.tools] == ["echo", "shout"]
    env.reset(seed=1)
    assert env.step(tool_action("echo", {"text": "ab", "times": 2}))[0] == "abab"
    assert env.step(tool_action("shout", {"text": "hi"}))[0] == "HI"
    obs, reward, terminated, *_ = env.step(tool_action("echo", {"text": "a", "times": "2"}))
    assert obs.startswith("Error: argument 'times' of tool 'echo' must be integer") and not terminated
    assert asyncio.run(env.astep(tool_action("shout", {"text": "yo"})))[0] == "YO"
