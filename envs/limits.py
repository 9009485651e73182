"""Bounds on one action: its size, each string's size, nesting, numbers, and text that cannot cross a process.

A weak model writes anything: megabyte arguments, non-UTF-8 text, ``[[[[...]]]]`` thousands deep, integers with
ten thousand digits. :func:`check_action_text` and :func:`check_value_tree` turn each of those into an
:class:`~envs.errors.ActionError` saying which bound was crossed and which setting raises it, so the env answers
with an ``"Error: ..."`` observation instead of hanging in a tool, raising out of ``step``, or passing a NUL byte
to a subprocess. Every :class:`~envs.core.AgentEnv` checks its actions against its ``action_limits``; set them per
env class, or per instance with ``envs.make(id, action_limits={"max_string_chars": 4096})`` (also as
``env.kwargs.action_limits`` in a job config).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

from envs.errors import ActionError

_INT_BOUND = 2**63


@dataclass(frozen=True)
class ActionLimits:
    """The largest action an env accepts; anything beyond is an ``"Error: ..."`` observation, never an exception."""

    max_action_chars: int = 65_536
    """Characters of the whole action string (checked before it is parsed)."""
    max_string_chars: int = 16_384
    """Characters of any one string in it: an argument, an item of one, or the answer."""
    max_depth: int = 16
    """Nesting of arrays and objects inside ``arguments``."""
    max_items: int = 4_096
    """Array items plus object keys in ``arguments``, all levels together."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"action_limits.{f.name} must be an int >= 1, got {value!r}")

    @classmethod
    def coerce(cls, value: ActionLimits | dict[str, Any] | None, base: ActionLimits | None = None) -> ActionLimits:
        """``value`` as limits: an :class:`ActionLimits`, or a dict of fields replacing those of ``base``."""
        base = base or cls()
        if value is None:
            return base
        if isinstance(value, ActionLimits):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"action_limits must be an ActionLimits or a dict, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown action_limits key(s) {unknown}; known: {sorted(known)}")
        return replace(base, **value)


DEFAULT_LIMITS = ActionLimits()


def check_action_text(s: str, limits: ActionLimits) -> None:
    """The raw action string: not longer than ``max_action_chars``."""
    if len(s) > limits.max_action_chars:
        raise ActionError(
            f"action is {len(s)} characters, more than the {limits.max_action_chars} accepted "
            "(action_limits.max_action_chars)"
        )


def check_text(text: str, where: str, limits: ActionLimits) -> None:
    """One string: at most ``max_string_chars``, valid Unicode (no lone surrogate) and no NUL character."""
    if len(text) > limits.max_string_chars:
        raise ActionError(
            f"{where} is {len(text)} characters, more than the {limits.max_string_chars} accepted "
            "(action_limits.max_string_chars)"
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ActionError(f"{where} is not valid UTF-8 text (a lone surrogate at character {e.start})") from None
    if "\x00" in text:
        raise ActionError(f"{where} contains a NUL character (U+0000), which no tool accepts")


def check_value_tree(value: Any, where: str, limits: ActionLimits) -> None:
    """Every string, number, key and container under ``value`` (iteratively: depth cannot overflow the stack)."""
    items = 0
    stack: list[tuple[Any, str, int]] = [(value, where, 0)]
    while stack:
        node, at, depth = stack.pop()
        if isinstance(node, str):
            check_text(node, at, limits)
        elif isinstance(node, bool) or node is None:
            continue
        elif isinstance(node, int):
            if not -_INT_BOUND < node < _INT_BOUND:
                raise ActionError(f"{at} is an integer out of range (more than 64 bits)")
        elif isinstance(node, float):
            if not math.isfinite(node):
                raise ActionError(f"{at} is {node!r}, not a finite JSON number")
        elif isinstance(node, dict | list):
            if depth >= limits.max_depth:
                raise ActionError(f"{at} nests deeper than {limits.max_depth} levels (action_limits.max_depth)")
            items += len(node)
            if items > limits.max_items:
                raise ActionError(f"{where} holds more than {limits.max_items} items in all (action_limits.max_items)")
            if isinstance(node, dict):
                for k, v in node.items():
                    check_text(k, f"a key in {at}", limits)
                    key = repr(k) if len(k) <= 40 else "'" + k[:37] + "...'"
                    stack.append((v, f"argument {key}" if depth == 0 else f"{at}[{key}]", depth + 1))
            else:
                stack.extend((v, f"{at}[{i}]", depth + 1) for i, v in enumerate(node))
