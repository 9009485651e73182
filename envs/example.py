"""A complete user environment in one file (the README's example): ``agentflow envs check envs.example:me/Reverse-v0``.

Tools are typed methods marked ``@tool``; the task set gives disjoint train/eval seeds; the rubric scores the
answer; :func:`expert` is the scripted expert warm-up SFT imitates (``configs/reverse.yaml`` trains on it).
Importing this module registers the id.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from envs import register
from envs.core import answer_action, tool_action
from envs.errors import ActionError
from envs.tasks import simple_task_set
from envs.tools import ToolEnv, tool
from envs.verifiers import Rubric, exact_match, used_tool

WORDS = ["apple", "river", "stone", "cloud", "maple", "quartz", "lantern", "meadow"]


@dataclass(frozen=True)
class Task:
    """The secret word and the expected answer (it reversed)."""

    word: str
    answer: str


class ReverseEnv(ToolEnv):
    """Spell a hidden word backwards; the ``letter`` tool reveals one letter at a time."""

    branching = "replay"  # the word comes from the seed; the tool only reads it

    system_prompt = "Find the hidden word with the letter tool, then answer it spelled backwards."
    max_turns = 10
    task_sets = {"default": simple_task_set(task_types=("reverse",))}
    rubric = Rubric([(1.0, exact_match()), (0.0, used_tool("letter"))])

    def reset_task(self, seed: int, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Draw the word of ``seed`` in the requested split."""
        split = options.get("split", "train")
        task_seed = self.task_sets["default"].task_seed(seed, split)
        word = random.Random(task_seed).choice(WORDS)
        self.task = Task(word, word[::-1])
        info = {"task_id": f"reverse-{split}-{task_seed}", "task_type": "reverse", "split": split}
        return f"The hidden word has {len(word)} letters. What is it spelled backwards?", info

    @tool
    def letter(self, index: int) -> str:
        """Reveal one letter of the hidden word.

        Args:
            index: The letter's position, from 0.
        """
        if not 0 <= index < len(self.task.word):
            raise ActionError(f"index must be in [0, {len(self.task.word) - 1}]")
        return self.task.word[index]


def expert(env: Any, history: list[tuple[str, str]]) -> str:
    """Warm-up SFT imitates this: reveal letters until one word fits, then answer it. It forgets to reverse the
    word on 60% of the tasks, so a model that imitates it answers forwards, and RL has something to learn."""
    word = env.unwrapped.task.word
    seen = "".join(obs for _, obs in history)
    fits = [w for w in WORDS if len(w) == len(word) and w.startswith(seen)]
    if len(fits) > 1:
        return tool_action("letter", {"index": len(seen)})
    forgets = env.unwrapped.np_random.random() < 0.6  # seeded by reset: the same traces every time
    return answer_action(fits[0] if forgets else fits[0][::-1])


register("me/Reverse-v0", ReverseEnv, expert=expert)
