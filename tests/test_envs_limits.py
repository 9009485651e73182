"""Action limits: every way a weak model's action can be too big or unusable is an error observation."""

from __future__ import annotations

import json

import pytest

import envs
from envs.core import parse_action, tool_action
from envs.errors import ActionError, EnvError
from envs.limits import ActionLimits
from envs.tools import ToolEnv, tool


@pytest.mark.parametrize(
    "action, fragment",
    [
        ("", "action is empty"),
        ("   ", "action is empty"),
        ("[" * 50_000, "nests too deeply to parse"),
        ('{"tool": "t", "arguments": {"n": ' + "9" * 5000 + "}}", "not usable JSON"),
        ('{"tool": "t", "arguments": {"n": 123456789012345678901234567890}}', "out of range"),
        ('{"tool": "t", "arguments": {"x": 1e999}}', "not a finite JSON number"),
        ('{"tool": "t", "arguments": {"x": NaN}}', "not a finite JSON number"),
        ('{"answer": "\\ud800"}', "the answer is not valid UTF-8 text"),
        ('{"tool": "t", "arguments": {"s": "a\\u0000b"}}', "argument 's' contains a NUL character"),
        ('{"tool": "t", "arguments": {"s": "' + "x" * 20_000 + '"}}', "argument 's' is 20000 characters"),
        ("x" * 70_000, "action_limits.max_action_chars"),
        ('{"tool": "t", "arguments": {"a": ' + "[" * 20 + "]" * 20 + "}}", "action_limits.max_depth"),
        (json.dumps({"tool": "t", "arguments": {"a": list(range(5000))}}), "action_limits.max_items"),
        (json.dumps({"tool": "t", "arguments": {"\udcff": 1}}), "a key in arguments is not valid UTF-8"),
    ],
)
def test_unusable_actions_are_action_errors(action, fragment):
    with pytest.raises(ActionError, match=fragment.replace("(", r"\(")):
        parse_action(action)


def test_limits_are_validated_and_replaced_field_by_field():
    limits = ActionLimits.coerce({"max_string_chars": 10})
    assert limits.max_string_chars == 10 and limits.max_action_chars == ActionLimits().max_action_chars
    with pytest.raises(ValueError, match="unknown action_limits key"):
        ActionLimits.coerce({"max_chars": 3})
    with pytest.raises(ValueError, match=">= 1"):
        ActionLimits(max_depth=0)


class _Echo(ToolEnv):
    max_turns = 5

    def reset_task(self, seed, options):
        return "say something", {"task_id": "e", "task_type": "echo", "split": "train"}

    def score_answer(self, text):
        return 0.0, False

    @tool
    def echo(self, text: str) -> str:
        """Echo the text.

        Args:
            text: What to echo.
        """
        return text


def test_an_env_answers_a_limit_with_an_error_observation_and_limits_are_configurable(monkeypatch):
    from envs import registry

    monkeypatch.setattr(registry, "_registry", dict(registry._registry))
    envs.register("test/Echo-v0", _Echo)
    env = envs.make("test/Echo-v0", action_limits={"max_string_chars": 8})
    env.reset(seed=0)
    obs, reward, terminated, truncated, _ = env.step(tool_action("echo", {"text": "x" * 9}))
    assert obs == "Error: argument 'text' is 9 characters, more than the 8 accepted (action_limits.max_string_chars)"
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert env.step(tool_action("echo", {"text": "x" * 8}))[0] == "x" * 8
    assert envs.make("test/Echo-v0").action_limits == ActionLimits()
    with pytest.raises(EnvError, match="unknown action_limits key"):
        envs.make("test/Echo-v0", action_limits={"nope": 1})


def test_a_schemas_max_length_is_honoured():
    from envs.core import ToolSpec, validate_arguments
    from envs.tools import check_value

    spec = ToolSpec("t", "", {"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}}})
    with pytest.raises(ActionError, match="at most 3"):
        validate_arguments(spec, {"s": "abcd"})
    with pytest.raises(ActionError, match="at most 2"):
        check_value({"type": "array", "items": {"type": "integer"}, "maxItems": 2}, [1, 2, 3], "argument 'a'")
