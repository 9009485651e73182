"""The demo environment ``agentflow/Calc-v0``: short arithmetic questions answered with a sandboxed calculator.

Each task asks "What is A OP B?"; the ``calc`` tool evaluates an expression with ``python3`` inside a bubblewrap
sandbox (network off) and returns its output. At most 3 turns; answering ends the episode with reward 1.0 for the
exact integer and 0.0 otherwise. :func:`scripted_policy` is a deterministic expert for SFT warm-up that is right
on "add" and "mul" and systematically wrong on "mod" and "sub", so RL has something to fix.
"""

from __future__ import annotations

import random
import re
import threading
from dataclasses import dataclass
from typing import Any

from envs.core import AgentEnv, ToolSpec, answer_action, tool_action
from envs.errors import ActionError, EnvError, SandboxError
from envs.sandbox import ExecResult, Limits, make_sandbox
from envs.tasks import TaskSet

TASK_TYPES: tuple[str, ...] = ("add", "mul", "mod", "sub")
SPLITS: tuple[str, ...] = ("train", "eval")
EVAL_SEED_OFFSET = 1_000_000
"""Task seed = seed % 1_000_000 for "train" and 1_000_000 + seed % 1_000_000 for "eval": the sets are disjoint."""

SYSTEM_PROMPT = "Answer the arithmetic question. Use the calc tool to compute, then answer with the number only."
CALC_TOOL = ToolSpec(
    name="calc",
    description="Evaluate an arithmetic expression with Python and return the result.",
    parameters={
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. 482 * 37"}},
        "required": ["expression"],
        "additionalProperties": False,
    },
)
_OPS = {"add": "+", "mul": "*", "mod": "%", "sub": "-"}
_QUESTION_RE = re.compile(r"What is (-?\d+) ([-+*%]) (-?\d+)\?")
_EVAL_PROGRAM = (
    "import sys\n"
    "try:\n    print(eval(sys.argv[1], {'__builtins__': {}}, {}))\n"
    "except Exception as e:\n    sys.exit(f'{type(e).__name__}: {e}')\n"
)
_CALC_LIMITS = Limits(memory_mb=256, cpu_s=2, file_size_mb=1, max_procs=16, output_kb=16)
_CALC_TIMEOUT_S = 5.0
_MAX_EXPRESSION_CHARS = 200


@dataclass(frozen=True)
class Task:
    """One question: ``expression`` is the Python expression whose value ``answer`` the agent must give."""

    seed: int
    split: str
    task_type: str
    question: str
    expression: str
    answer: int

    @property
    def task_id(self) -> str:
        """A stable id, e.g. ``calc-eval-1000007``."""
        return f"calc-{self.split}-{self.seed}"


def task_seed(seed: int, split: str = "train") -> int:
    """The seed that draws the task of episode ``seed`` in ``split`` (train and eval sets are disjoint)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    return seed % EVAL_SEED_OFFSET + (EVAL_SEED_OFFSET if split == "eval" else 0)


def make_task(seed: int, split: str = "train", task_type: str | None = None) -> Task:
    """The task for episode ``seed`` of ``split`` (deterministic); ``task_type`` forces the type.

    Operands are redrawn in the rare cases where the scripted expert's systematic mistake would happen to be right
    (``a % c == a % b`` for "mod"), so its failures never succeed by chance.
    """
    ts = task_seed(seed, split)
    rng = random.Random(ts)
    kind = task_type if task_type is not None else rng.choice(TASK_TYPES)
    if kind not in TASK_TYPES:
        raise ValueError(f"unknown task type {kind!r}; expected one of {TASK_TYPES}")
    while True:
        if kind == "add" or kind == "sub":
            a, b = rng.randint(100, 999), rng.randint(100, 999)
        elif kind == "mul":
            a, b = rng.randint(10, 99), rng.randint(10, 99)
        else:
            a, b = rng.randint(1000, 9999), rng.randint(10, 99)
        if kind not in ("mod", "sub"):
            break
        wrong = garbled(a, b, kind)
        if (a % wrong if kind == "mod" else a - wrong) != (a % b if kind == "mod" else a - b):
            break
    expression = f"{a} {_OPS[kind]} {b}"
    answer = {"add": a + b, "mul": a * b, "mod": a % b, "sub": a - b}[kind]
    return Task(ts, split, kind, f"What is {expression}?", expression, answer)


def verify(task: Task, answer_text: str) -> bool:
    """True when ``answer_text`` (whitespace stripped) is exactly the integer answer, e.g. "-12" or "+7"."""
    text = answer_text.strip()
    return re.fullmatch(r"[+-]?\d+", text) is not None and int(text) == task.answer


def garbled(a: int, b: int, kind: str) -> int:
    """The operand the scripted expert misreads, a fixed function of the task that looks arbitrary to a model.

    One digit of ``b`` is read as another digit: the divisor's first digit ("mod", 10..99 stays 2-digit) and the
    subtrahend's last digit ("sub"). Which wrong digit depends on a hash of the task, so a model imitating the
    expert cannot predict it; it keeps some probability on every digit there, the right one included, which is
    what RL starts from. (A divisor misread as any other 2-digit number left ~1% of samples right and made the
    RL take-off depend on the seed; see docs/decisions.md.)
    """
    h = (a * 7919 + b * 104729) % 1_000_003
    if kind == "mod":
        first = b // 10
        return (1 + (first - 1 + 1 + h % 8) % 9) * 10 + b % 10
    last = b % 10
    return b - last + (last + 1 + h % 9) % 10


def scripted_policy(task_type: str, question: str, history: list[tuple[str, str]]) -> str:
    """A deterministic expert: right on "add"/"mul", systematically wrong on "mod" and "sub".

    It always calls ``calc`` and then answers the tool's output. On "add"/"mul" it passes the question's expression;
    on "mod" and "sub" it mis-handles the second operand: it misreads the divisor's first digit and the subtrahend's
    last digit as another digit (:func:`garbled`). The misreading is a fixed function of the task, so
    the expert fails every such task, never by chance, while a model imitating it cannot predict the wrong digits.
    ``history`` is the episode's (action, observation) pairs so far.
    """
    m = _QUESTION_RE.search(question)
    if m is None:
        return answer_action("0")
    a, op, b = m.group(1), m.group(2), m.group(3)
    if history:
        return answer_action(history[-1][1].strip())
    if task_type in ("mod", "sub"):
        b = str(garbled(int(a), int(b), task_type))
    return tool_action("calc", {"expression": f"{a} {op} {b}"})


def expert_action(env: CalcEnv, history: list[tuple[str, str]]) -> str:
    """:func:`scripted_policy` with the signature jobs expect of an expert: ``(env, history) -> action``."""
    task = env.unwrapped.task
    return scripted_policy(task.task_type, task.question, history)


class CalcEnv(AgentEnv):
    """``agentflow/Calc-v0``: one arithmetic question per episode, a sandboxed ``calc`` tool, at most 3 turns.

    ``reset(options={"split": "eval", "task_type": "mod"})`` picks the split and optionally forces a task type.
    The env owns one sandbox (created on the first tool call, closed by :meth:`close`).
    """

    tools = [CALC_TOOL]
    system_prompt = SYSTEM_PROMPT
    max_turns = 3
    task_sets = {
        "default": TaskSet(
            "default",
            {"train": range(0, EVAL_SEED_OFFSET), "eval": range(EVAL_SEED_OFFSET, 2 * EVAL_SEED_OFFSET)},
            TASK_TYPES,
            "the task seeds of task_seed(seed, split)",
        )
    }
    max_observation_chars = 4096
    branching = "snapshot"  # the episode state is the task and the turn count (the sandbox keeps nothing)

    def __init__(
        self,
        max_turns: int | None = None,
        split: str = "train",
        task_types: tuple[str, ...] | list[str] | None = None,
        sandbox_kind: str = "bwrap",
    ) -> None:
        super().__init__(max_turns=max_turns)
        task_seed(0, split)  # validates the split
        self.split = split
        self.task_types = tuple(task_types) if task_types else None
        self.sandbox_kind = sandbox_kind
        self.task: Task | None = None
        self._sandbox: Any = None
        self._sandbox_lock = threading.Lock()

    @property
    def sandbox(self) -> Any:
        """The env's sandbox, created on first use."""
        with self._sandbox_lock:
            if self._sandbox is None:
                self._sandbox = make_sandbox(self.sandbox_kind, limits=_CALC_LIMITS)
            return self._sandbox

    def reset_task(self, seed: int, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Draw the task of ``seed`` in ``options["split"]`` (default: the env's split)."""
        split = options.get("split", self.split)
        kind = options.get("task_type")
        if kind is None and self.task_types:
            kind = random.Random(task_seed(seed, split)).choice(self.task_types)
        self.task = make_task(seed, split, kind)
        info = {"task_id": self.task.task_id, "task_type": self.task.task_type, "split": split, "seed": self.task.seed}
        return self.task.question, info

    def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        """Evaluate ``arguments["expression"]`` in the sandbox (one ``python3`` process)."""
        argv = self._calc_argv(arguments)
        return self._observe(self.sandbox.exec(argv, timeout=_CALC_TIMEOUT_S, limits=_CALC_LIMITS))

    async def acall_tool(self, name: str, arguments: dict[str, Any]) -> str:
        """Like :meth:`call_tool`, awaiting the sandbox instead of holding a thread."""
        argv = self._calc_argv(arguments)
        return self._observe(await self.sandbox.aexec(argv, timeout=_CALC_TIMEOUT_S, limits=_CALC_LIMITS))

    def score_answer(self, text: str) -> tuple[float, bool]:
        """1.0 and success for the exact integer answer, else 0.0."""
        if self.task is None:
            raise EnvError("no task: call reset() first")
        ok = verify(self.task, text)
        return (1.0 if ok else 0.0), ok

    def snapshot(self) -> tuple[Any, ...]:
        """The episode's state (task, turn, whether it ended, its info), for :func:`envs.branching.branch`."""
        return self.task, self._turn, self._done, dict(self._task_info)

    def restore(self, state: tuple[Any, ...]) -> None:
        """Continue from a :meth:`snapshot` (of this env or another Calc env)."""
        self.task, self._turn, self._done, info = state
        self._task_info = dict(info)

    def close(self) -> None:
        """Close the sandbox (if one was created). Safe to call twice."""
        with self._sandbox_lock:
            sandbox, self._sandbox = self._sandbox, None
        if sandbox is not None:
            sandbox.close()
        super().close()

    @staticmethod
    def _calc_argv(arguments: dict[str, Any]) -> list[str]:
        expression = arguments["expression"]
        if len(expression) > _MAX_EXPRESSION_CHARS:
            raise ActionError(f"expression is too long ({len(expression)} > {_MAX_EXPRESSION_CHARS} characters)")
        return ["python3", "-I", "-S", "-c", _EVAL_PROGRAM, expression]

    @staticmethod
    def _observe(result: ExecResult) -> str:
        if result.timed_out:
            raise SandboxError(f"the calculation timed out after {_CALC_TIMEOUT_S:g} s")
        if result.exit_code != 0:
            lines = result.stderr.strip().splitlines()
            raise SandboxError(lines[-1] if lines else f"the calculation failed (exit code {result.exit_code})")
        return result.stdout.strip() or "(no output)"
