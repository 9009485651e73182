"""Desktop tasks: what to do in the shipped Tk apps, how the app's state proves it, and a scripted expert.

Task types: ``calculator`` (compute an expression with the calculator: the app's last evaluation must be exactly
that expression with the right value), ``editor`` (type lines into the editor and save under a file name: the
app's saved files must hold exactly that text) and ``total`` (add up three amounts with the calculator, checked
like ``calculator``). Expressions are three two-digit numbers with spaces around the operators, at the end of the
prompt, and are typed as shown (the check ignores spaces): entering one copies the prompt's last tokens verbatim,
from the same distance every time (the task closes each observation). The expert clicks at the centres the widget tree
gives and types through the keyboard, as an agent would.

The expert is right on ``calculator`` and ``editor`` and fails every ``total`` task, never by chance: it misreads the
last digit of the last amount as another digit (a hash of the task picks which, so a model imitating it cannot
predict the wrong digit and keeps some probability on the right one). A warm-up on its traces leaves RL a signal on
exactly one task type, visible in the prompt ("Add up"), whose reward depends on one token of one action.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any

from envs.core import answer_action, tool_action
from envs.desktop.apps import evaluate, format_number
from envs.tasks import misread, task_hash

TASK_TYPES: tuple[str, ...] = ("calculator", "editor", "total")
EXPERT_FAILS: tuple[str, ...] = ("total",)
"""The types the scripted expert gets wrong on every task."""
_WORDS = ("alpha", "river", "quiet", "copper", "maple", "orbit", "lantern", "pixel", "harbor", "meadow", "signal")


@dataclass(frozen=True)
class DesktopTask:
    """One desktop task: the app to start (with ``init``) and the goal the verifier checks."""

    task_id: str
    task_type: str
    prompt: str
    app: str
    init: dict[str, Any] = field(default_factory=dict)
    goal: dict[str, Any] = field(default_factory=dict)


def make_task(task_seed: int, split: str, task_type: str | None = None) -> DesktopTask:
    """The task of ``task_seed`` (deterministic); ``task_type`` forces the type."""
    rng = random.Random(task_seed)
    kind = task_type if task_type is not None else rng.choice(TASK_TYPES)
    if kind not in TASK_TYPES:
        raise ValueError(f"unknown desktop task type {kind!r}; expected one of {TASK_TYPES}")
    tid = f"desktop-{split}-{task_seed}"
    if kind == "calculator":
        a, b, c = rng.randint(10, 99), rng.randint(10, 99), rng.randint(10, 99)
        op1, op2 = rng.choice("+-*"), rng.choice("+-")
        shown = f"{a} {op1} {b} {op2} {c}"
        return _calculator_task(tid, kind, "Use the calculator to compute this expression (enter it and press =)",
                                shown)  # fmt: skip
    if kind == "total":
        shown = " + ".join(str(rng.randint(10, 99)) for _ in range(3))
        return _calculator_task(tid, kind, "Add up these amounts with the calculator (enter the sum and press =)",
                                shown)  # fmt: skip
    lines = [" ".join(rng.sample(_WORDS, 3)) for _ in range(rng.randint(1, 2))]
    name = f"{rng.choice(_WORDS)}-{rng.randint(1, 99)}.txt"
    start = rng.choice(["", "notes:\n"])
    text = start + "\n".join(lines)
    shown = " / ".join(repr(line) for line in lines)
    prefix = "After the existing text, type" if start else "Type"
    prompt = f"{prefix} the line(s) {shown} in the editor and save the file as {name!r}."
    return DesktopTask(tid, kind, prompt, "editor", init={"text": start}, goal={"filename": name, "text": text})


def _calculator_task(tid: str, kind: str, ask: str, shown: str) -> DesktopTask:
    """A calculator task whose expression ``shown`` ends the prompt and must be entered and evaluated."""
    goal = {"expression": shown.replace(" ", ""), "result": format_number(evaluate(shown)), "shown": shown}
    return DesktopTask(tid, kind, f"{ask}: {shown}", "calculator", goal=goal)


def check_state(task: DesktopTask, state: dict[str, Any]) -> dict[str, bool]:
    """Each goal condition and whether the app's state meets it."""
    if task.app == "calculator":
        history = state.get("history") or [{}]
        last = history[-1]
        return {
            "expression": last.get("expression", "").replace(" ", "") == task.goal["expression"],
            "result": last.get("result") == task.goal["result"] and state.get("display") == task.goal["result"],
        }
    saved = state.get("saved", {})
    return {
        "saved": task.goal["filename"] in saved,
        "text": saved.get(task.goal["filename"], "").rstrip("\n") == task.goal["text"],
    }


_WIDGET_LINE = re.compile(r'^\s*- (?P<cls>\w+) "(?P<name>[\w-]+)".*? center \((?P<x>\d+), (?P<y>\d+)\)')


def find_center(observation: str, name: str) -> tuple[int, int] | None:
    """The centre of widget ``name`` in a desktop observation's widget tree, or None."""
    for line in observation.splitlines():
        m = _WIDGET_LINE.match(line)
        if m and m.group("name") == name:
            return int(m.group("x")), int(m.group("y"))
    return None


def expert_plan(task: DesktopTask) -> list[tuple[str, Any]]:
    """The expert's steps for ``task``: ("click", widget name), ("type", text) or ("key", combo). They solve every
    task but a ``total``, where the last amount's last digit is misread."""
    if task.app == "calculator":
        typed = task.goal["shown"]  # as the prompt shows it (the calculator ignores spaces): a verbatim copy
        if task.task_type in EXPERT_FAILS:
            typed = misread(typed, task_hash("desktop-total", task.task_id))
        return [("click", "display"), ("type", typed), ("click", "equals")]
    added = task.goal["text"][len(task.init.get("text", "")) :]
    return [
        ("click", "text"),
        ("key", "ctrl+End"),
        ("type", added),
        ("click", "filename"),
        ("key", "ctrl+slash"),  # Tk's select-all; typing then replaces the selection
        ("type", task.goal["filename"]),
        ("key", "ctrl+s"),
    ]


def expert_action(env: Any, history: list[tuple[str, str]]) -> str:
    """The scripted expert's next action (step ``len(history)`` of the plan); ``"done"`` when the plan is over."""
    base = env.unwrapped
    plan = expert_plan(base.task)
    i = len(history)
    if i >= len(plan):
        return answer_action("done")
    kind, arg = plan[i]
    if kind == "click":
        center = find_center(base.last_observation, arg)
        if center is None:
            return answer_action("done")
        return tool_action("click", {"x": center[0], "y": center[1]})
    if kind == "type":
        return tool_action("type_text", {"text": arg})
    return tool_action("key", {"combo": arg})
