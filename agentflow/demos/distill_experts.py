"""Scripted experts the distillation demo trains its teachers with (kept apart so SFT cache keys stay stable).

The SFT cache keys on the expert module's source, so these live in a small file that changes only when the
experts do.
"""

from __future__ import annotations

from typing import Any

from envs.core import answer_action, tool_action
from envs.shell import expert_action as shell_expert_action


def calc_expert(env: Any, history: list[tuple[str, str]]) -> str:
    """A correct expert for ``agentflow/Calc-v0`` (unlike envs.demo's, it reads every operand right)."""
    task = env.unwrapped.task
    if history:
        return answer_action(history[-1][1].strip())
    return tool_action("calc", {"expression": task.expression})


def shell_expert(env: Any, history: list[tuple[str, str]]) -> str:
    """envs.shell's expert: the task's reference command, then its first output line (or "done")."""
    return shell_expert_action(env, history)
