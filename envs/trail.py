"""``agentflow/Trail-v0``: a long-horizon shell task: follow a trail of notes through the sandbox to a code.

Each episode's sandbox workdir holds a trail of note files. ``start.txt`` begins it; every note has a few lines of
words and, last, a pointer to the next note (``next: 4172.txt``). The last note holds the code to answer
(``code: 7``). The agent has one tool, ``sh(command)``, run in the real sandbox; each note is one ``cat``, so an
episode takes as many turns as the trail has notes, and its context grows by a note per turn.

Task types (the difficulty varies by type):

- ``short``: 3-5 notes.
- ``long``: 11-15 notes (contexts past 1,000 tokens, episodes past 12 turns).
- ``relay``: 5-8 notes, one of which points on with ``relay:`` instead of ``next:``.
- ``vault``: 4-7 notes, one of which is locked: ``locked: run python3 vault.py 4821``. The vault is a program in
  the workdir that takes a while to answer (seeded per task, 0.05-2.5 s: the tool latency varies) and prints the
  next pointer for the right code, ``access denied`` for any other.

:func:`expert_action` is a deterministic expert for SFT warm-up that is right on ``short`` and ``long`` and fails
every ``relay`` and ``vault`` task, never by chance: it misreads the last digit of a relay pointer's file number and
of a vault code as another digit (a hash of the task picks which, so a model imitating it cannot predict it). The
misread leads to a decoy: a note (or a vault answer) that exists and starts a decoy trail as long as the rest of
the real one, ending in a wrong code. The mistake is made early and shows only in the final reward, so the credit
for it spreads over the turns after it.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from typing import Any

from envs.core import answer_action, tool_action
from envs.sandbox import Limits
from envs.shell import ShellEnv
from envs.tasks import misread, simple_task_set, task_hash
from envs.verifiers import Rubric

TASK_TYPES: tuple[str, ...] = ("short", "long", "relay", "vault")
EXPERT_FAILS: tuple[str, ...] = ("relay", "vault")
"""The types the scripted expert gets wrong on every task."""
_NOTES = {"short": (3, 5), "long": (11, 15), "relay": (5, 8), "vault": (4, 7)}
_WORDS = (
    "gate", "door", "path", "road", "wall", "tree", "rock", "well", "bell", "lamp", "rope", "boat", "bird", "fox",
    "old", "new", "red", "dark", "cold", "wet", "quiet", "open", "closed", "near", "far", "left", "right", "under",
)  # fmt: skip
_VAULT_FILE = "vault.py"
_VAULT_PROGRAM = """import json, sys, time
table = json.loads({table!r})
time.sleep({delay!r})
code = sys.argv[1].strip() if len(sys.argv) > 1 else ""
print(table.get(code, "access denied: wrong code"))
"""
_POINTER_RE = re.compile(r"^(next|relay): (\S+)$")
_LOCKED_RE = re.compile(r"^locked: run python3 vault\.py (\d+)$")
_CODE_RE = re.compile(r"^code: (\d+)$")


@dataclass(frozen=True)
class TrailTask:
    """One trail: the files to write, the code to answer, and the real trail's note paths in order."""

    task_id: str
    task_type: str
    prompt: str
    answer: str
    files: dict[str, str] = field(default_factory=dict)
    trail: tuple[str, ...] = ()
    vault_delay_s: float = 0.0


def _filler(rng: random.Random) -> list[str]:
    """Five to eight lines of words (what makes the context grow note by note). No digits: with digits in the text
    (log timestamps, as an earlier design had) the pointer's digits were not the only ones to copy from, and whether
    the warm-up learned to copy them at all depended on the draw of the initial weights and tokenizer."""
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 6))) for _ in range(rng.randint(5, 8))]


class _TrailBuilder:
    """Draws one task's paths and notes; every path is unique within the task, decoys included."""

    def __init__(self, rng: random.Random, salt: int) -> None:
        self.rng, self.salt = rng, salt
        self.files: dict[str, str] = {}
        self.taken: set[str] = {"start.txt", _VAULT_FILE}

    def new_path(self) -> str:
        """A fresh ``NNNN.txt`` whose misread variant is free too (so a decoy can always be put there). Names are
        digits only: a small model learns to copy digit tokens early, while copying word tokens (``lake/``) took it
        far longer than the warm-up's budget."""
        while True:
            path = f"{self.rng.randint(1000, 9999)}.txt"
            decoy = misread(path[:-4], self.salt) + ".txt"
            if path not in self.taken and decoy not in self.taken:
                self.taken |= {path, decoy}  # the misread variant stays free for a decoy, and only for one
                return path

    def code(self, avoid: str = "") -> str:
        """A one-digit code (different from ``avoid``). One digit, because the demo-size model learns to copy the
        first token after a marker it has seen (``code: ``) within its warm-up, but not the digits after that one:
        with 4-digit codes it copied every 4-digit pointer (4,800 copies an epoch) and no code (600 an epoch)."""
        while (c := str(self.rng.randint(0, 9))) == avoid:
            pass
        return c

    def note(self, path: str, last_line: str) -> None:
        self.files[path] = "\n".join([*_filler(self.rng), last_line]) + "\n"

    def chain(self, first: str, n: int, final_line: str) -> list[str]:
        """Write ``n`` notes starting at ``first`` (each pointing to the next), the last one ending in
        ``final_line``; returns their paths."""
        paths = [first] + [self.new_path() for _ in range(n - 1)]
        for i, p in enumerate(paths):
            self.note(p, f"next: {paths[i + 1]}" if i + 1 < n else final_line)
        return paths


def make_trail_task(task_seed: int, split: str, task_type: str | None = None) -> TrailTask:
    """The task of ``task_seed`` (deterministic); ``task_type`` forces its kind."""
    rng = random.Random(f"trail:{task_seed}")
    kind = task_type or rng.choice(TASK_TYPES)
    if kind not in TASK_TYPES:
        raise ValueError(f"unknown Trail task type {kind!r}; expected one of {TASK_TYPES}")
    salt = task_hash("trail", task_seed)
    b = _TrailBuilder(rng, salt)
    n = rng.randint(*_NOTES[kind])
    answer = b.code()
    delay = 0.0
    if kind in ("short", "long"):
        trail = b.chain(b.new_path(), n, f"code: {answer}")
    else:
        k = rng.randint(1, n - 2)  # notes before the relay/locked one (the start note is one of them)
        head = b.chain(b.new_path(), k, "")
        tail_first = b.new_path()
        tail = b.chain(tail_first, n - k, f"code: {answer}")
        decoy_first = misread(tail_first[:-4], salt) + ".txt"  # reserved by new_path
        b.chain(decoy_first, n - k, f"code: {b.code(avoid=answer)}")
        if kind == "relay":
            b.note(head[-1], f"relay: {tail_first}")
            trail = head + tail
        else:
            vault_code = str(rng.randint(1000, 9999))
            table = {vault_code: f"next: {tail_first}", misread(vault_code, salt): f"next: {decoy_first}"}
            delay = round(min(2.5, 0.05 + rng.lognormvariate(-1.2, 0.9)), 3)
            b.files[_VAULT_FILE] = _VAULT_PROGRAM.format(table=json.dumps(table), delay=delay)
            b.note(head[-1], f"locked: run python3 vault.py {vault_code}")
            trail = head + tail
    b.files["start.txt"] = f"The trail starts here.\nnext: {trail[0]}\n"
    prompt = (
        "Follow the trail of notes that begins in start.txt: read each note, go where it points, and answer the "
        "code in the last note.\nUse the sh tool to run shell commands in the working directory."
    )
    return TrailTask(f"trail-{split}-{task_seed}", kind, prompt, answer, b.files, tuple(trail), delay)


def _task_check(answer: str, task: TrailTask, env: TrailEnv) -> float:
    """1 for exactly the trail's code, bare or as the note states it (``code: 7``), once the trail's last note has
    been shown to the agent: a one-digit code could otherwise be guessed (RL found that: on vault tasks a policy
    learned to answer a digit at the locked note instead of running the vault, and was right one time in ten)."""
    text = answer.strip().strip("'\"`.")
    return float(env.reached_end and text.removeprefix("code:").strip() == task.answer)


class TrailEnv(ShellEnv):
    """``agentflow/Trail-v0``: follow notes through the sandbox with ``sh`` and answer the code at the end."""

    system_prompt = (
        "You work in a Linux shell. Run commands with the sh tool (working directory: the task's files). "
        "Answer with the value asked for."
    )
    max_turns = 20
    task_sets = {"default": simple_task_set(task_types=TASK_TYPES, description="trails of 3-15 notes")}
    rubric = Rubric([(1.0, _task_check, "task_check")])
    sandbox_limits = Limits(memory_mb=256, cpu_s=10, file_size_mb=4, max_procs=16, output_kb=16)

    def __init__(self, *args: Any, task_types: tuple[str, ...] | list[str] | None = None, **kwargs: Any) -> None:
        """``task_types``: draw only these types (e.g. to train on a subset); the default draws all four."""
        super().__init__(*args, **kwargs)
        unknown = sorted(set(task_types or ()) - set(TASK_TYPES))
        if unknown:
            raise ValueError(f"unknown Trail task types {unknown}; expected some of {TASK_TYPES}")
        self.task_types = tuple(task_types) if task_types else None
        self._forced_type: str | None = None
        self.reached_end = False
        """Whether a tool output of this episode has shown the real trail's last note (the verifier requires it)."""

    def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        """As the base's, noting whether the output showed the trail's last note."""
        return self._note_end(super().call_tool(name, arguments))

    async def acall_tool(self, name: str, arguments: dict[str, Any]) -> str:
        """As the base's, noting whether the output showed the trail's last note."""
        return self._note_end(await super().acall_tool(name, arguments))

    def _note_end(self, output: str) -> str:
        if self.task is not None and self.task.files[self.task.trail[-1]].strip() in output:
            self.reached_end = True
        return output

    def reset_task(self, seed: int, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Like the base's; ``options["task_type"]`` forces the task's type."""
        kind = options.get("task_type")
        if kind is not None and kind not in TASK_TYPES:
            raise ValueError(f"unknown Trail task type {kind!r}; expected one of {TASK_TYPES}")
        self._forced_type, self.reached_end = kind, False
        return super().reset_task(seed, options)

    def make_task(self, task_seed: int, split: str, task_set: str) -> TrailTask:
        """The trail of ``task_seed`` (of the forced type, else of one of ``task_types``, else any)."""
        kind = self._forced_type
        if kind is None and self.task_types:
            kind = random.Random(f"trail-type:{task_seed}").choice(self.task_types)
        return make_trail_task(task_seed, split, kind)

    def tokenizer_texts(self) -> list[str]:
        """The current task's notes and a ``cat`` of one: what a new tokenizer should find short (see
        :func:`agentflow.model_init.env_corpus`)."""
        if self.task is None:
            return []
        return [*self.task.files.values(), f'{{"command": "cat {self.task.trail[0]}"}}']


def expert_action(env: TrailEnv, history: list[tuple[str, str]]) -> str:
    """The scripted expert: read ``start.txt``, follow each pointer, answer the code; it misreads the last digit of
    every relay pointer and vault code (:func:`misread`), which sends it down the decoy trail."""
    task: TrailTask = env.unwrapped.task
    salt = task_hash("trail", task.task_id.rsplit("-", 1)[1])
    if not history:
        return tool_action("sh", {"command": "cat start.txt"})
    lines = history[-1][1].strip().splitlines()
    last = lines[-1].strip() if lines else ""
    if _CODE_RE.match(last):
        # the line as the note states it: its first token is the note's own "code: ", which a small model learns to
        # copy from far sooner than it learns to start a bare number right after the assistant's header
        return answer_action(last)
    if m := _LOCKED_RE.match(last):
        return tool_action("sh", {"command": f"python3 {_VAULT_FILE} {misread(m.group(1), salt)}"})
    if m := _POINTER_RE.match(last):
        path = m.group(2)
        if m.group(1) == "relay":
            path = misread(path[:-4], salt) + ".txt"
        return tool_action("sh", {"command": f"cat {path}"})
    return answer_action("unknown")
