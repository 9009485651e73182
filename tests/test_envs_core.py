"""Contracts of envs.core: tool specs, the text space, canonical actions."""

import json

import pytest

from envs.core import (
    AnswerAction,
    AnyText,
    ToolAction,
    ToolSpec,
    answer_action,
    parse_action,
    tool_action,
    validate_arguments,
)
from envs.errors import ActionError, EnvError, UnknownEnvError


def test_toolspec_to_openai():
    spec = ToolSpec("calc", "Evaluate.", {"type": "object", "properties": {"x": {"type": "string"}}})
    out = spec.to_openai()
    assert out == {
        "type": "function",
        "function": {"name": "calc", "description": "Evaluate.", "parameters": spec.parameters},
    }
    out["function"]["parameters"]["properties"].clear()
    assert spec.parameters["properties"], "to_openai must not share the schema dict"


def test_anytext_space():
    space = AnyText(10, seed=0)
    assert "héllo\n" in space and "" in space
    assert "x" * 11 not in space and 3 not in space
    space.seed(1)
    a = [space.sample() for _ in range(5)]
    space.seed(1)
    assert a == [space.sample() for _ in range(5)]
    assert all(s in space for s in a)


def test_parse_action_round_trip():
    assert parse_action(tool_action("calc", {"expression": "1+1"})) == ToolAction("calc", {"expression": "1+1"})
    assert parse_action(answer_action(" 42 ")) == AnswerAction(" 42 ")
    assert parse_action('{"tool": "t"}') == ToolAction("t", {})


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ("nope", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"tool": "t", "arguments": [1]}', '"arguments" must be a JSON object'),
        ('{"tool": ""}', "non-empty string"),
        ('{"answer": 5}', '"answer" must be a string'),
        ('{"answer": "1", "tool": "t"}', "keys"),
        ('{"foo": 1}', "expected"),
    ],
)
def test_parse_action_errors(bad, fragment):
    with pytest.raises(ActionError, match=fragment):
        parse_action(bad)
    assert issubclass(ActionError, ValueError)


def test_validate_arguments():
    spec = ToolSpec(
        "t",
        "d",
        {
            "type": "object",
            "properties": {"n": {"type": "integer"}, "mode": {"type": "string", "enum": ["a", "b"]}},
            "required": ["n"],
            "additionalProperties": False,
        },
    )
    validate_arguments(spec, {"n": 3, "mode": "a"})
    for args, fragment in [
        ({}, "missing"),
        ({"n": True}, "integer"),
        ({"n": 1, "x": 2}, "unknown"),
        ({"n": 1, "mode": "c"}, "one of"),
    ]:
        with pytest.raises(ActionError, match=fragment):
            validate_arguments(spec, args)


def test_error_hierarchy():
    err = UnknownEnvError("no such env")
    assert isinstance(err, KeyError) and isinstance(err, EnvError)
    assert str(err) == "no such env"
    assert json.loads(answer_action("é")) == {"answer": "é"}
