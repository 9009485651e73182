"""``agentflow/PyCode-v0``: write a Python function; hidden unit tests run in the sandbox decide the reward.

Each task asks for ``def solve(...)`` with a seed-chosen parameter (e.g. "sum of the elements greater than 7") and
shows two examples. The ``run_python`` tool runs any script in the episode's sandbox; the answer is the solution's
source (``{"answer": CODE}``; a Markdown code fence around it is accepted). Scoring runs the answer against hidden
cases in a fresh process of the sandbox (the cases reach it on stdin before the solution is imported) and
compares the returned values with the reference solution's on the host.
"""

from __future__ import annotations

import json
import random
import re
import string
from dataclasses import dataclass
from typing import Any

from envs.core import answer_action, tool_action
from envs.errors import ActionError, VerifierError
from envs.sandbox import Limits, make_sandbox
from envs.sandboxed import SandboxToolEnv, describe_result
from envs.tasks import simple_task_set
from envs.tools import tool
from envs.verifiers import Rubric

MAX_CODE_CHARS = 20_000
N_HIDDEN = 12
_MARK = "@@AGENTFLOW-RESULTS@@"
_RUNNER = f"""import json, sys
cases = json.loads(sys.stdin.read())
sys.path.insert(0, ".")
try:
    import solution
    fn = solution.solve
except BaseException as e:
    print({_MARK!r} + json.dumps({{"import_error": f"{{type(e).__name__}}: {{e}}"}}))
    sys.exit(0)
out = []
for args in cases:
    try:
        out.append({{"ok": True, "value": fn(*args)}})
    except BaseException as e:
        out.append({{"ok": False, "error": f"{{type(e).__name__}}: {{e}}"}})
sys.stdout.flush()
print("\\n" + {_MARK!r} + json.dumps(out, default=repr))
"""


@dataclass(frozen=True)
class Problem:
    """A task template: ``statement`` and ``reference`` are formatted with the seed-drawn parameter ``k``."""

    name: str
    signature: str
    statement: str
    reference: str
    draw_k: Any  # (rng) -> parameter
    draw_input: Any  # (rng) -> list of positional arguments


def _ints(rng: random.Random, lo: int = -30, hi: int = 50, n: int = 12) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(rng.randint(0, n))]


def _word(rng: random.Random, alphabet: str = "abcde", n: int = 10) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, n)))


def _sentence(rng: random.Random) -> str:
    return " ".join(_word(rng, string.ascii_lowercase, 6) or "x" for _ in range(rng.randint(1, 6)))


PROBLEMS: tuple[Problem, ...] = (
    Problem(
        "sum_above", "solve(xs: list[int]) -> int", "Return the sum of the elements of xs that are greater than {k}.",
        "def solve(xs):\n    return sum(x for x in xs if x > {k})\n",
        lambda r: r.randint(-5, 20), lambda r: [_ints(r)],
    ),
    Problem(
        "count_chars", "solve(s: str) -> int", "Return how many characters of s are one of the letters {k!r}.",
        "def solve(s):\n    return sum(c in {k!r} for c in s)\n",
        lambda r: "".join(r.sample("abcdefgh", 3)), lambda r: [_word(r, "abcdefgh", 14)],
    ),
    Problem(
        "fizz", "solve(n: int) -> str",
        "Return 'FizzBuzz' if n is divisible by both {k[0]} and {k[1]}, 'Fizz' if only by {k[0]}, 'Buzz' if only "
        "by {k[1]}, else str(n).",
        "def solve(n):\n    a, b = n % {k[0]} == 0, n % {k[1]} == 0\n"
        "    return 'FizzBuzz' if a and b else 'Fizz' if a else 'Buzz' if b else str(n)\n",
        lambda r: tuple(r.sample(range(2, 10), 2)), lambda r: [r.randint(1, 200)],
    ),
    Problem(
        "join_reversed", "solve(s: str) -> str",
        "Return the words of s (split on whitespace) in reverse order, joined by {k!r}.",
        "def solve(s):\n    return {k!r}.join(reversed(s.split()))\n",
        lambda r: r.choice(["-", " ", ",", "_", "/"]), lambda r: [_sentence(r)],
    ),
    Problem(
        "kth_largest", "solve(xs: list[int]) -> int",
        "Return the {k}-th largest distinct value of xs (1 = the largest), or -1 if xs has fewer than {k} distinct "
        "values.",
        "def solve(xs):\n    v = sorted(set(xs), reverse=True)\n    return v[{k} - 1] if len(v) >= {k} else -1\n",
        lambda r: r.randint(1, 3), lambda r: [_ints(r, 0, 9)],
    ),
    Problem(
        "run_length", "solve(s: str) -> str",
        "Run-length encode s: each run of one character becomes the character followed by the run's length, but "
        "the length is written only when it is at least {k} (e.g. 'aaab' with {k}). Return the encoding.",
        "def solve(s):\n    out, i = [], 0\n    while i < len(s):\n        j = i\n"
        "        while j < len(s) and s[j] == s[i]:\n            j += 1\n"
        "        out.append(s[i] + (str(j - i) if j - i >= {k} else s[i] * (j - i - 1)))\n        i = j\n"
        "    return ''.join(out)\n",
        lambda r: r.randint(1, 3), lambda r: [_word(r, "aab", 12)],
    ),
    Problem(
        "rotate", "solve(xs: list[int]) -> list[int]",
        "Return xs rotated right by {k} positions (the last {k} elements move to the front, cyclically).",
        "def solve(xs):\n    if not xs:\n        return []\n    k = {k} % len(xs)\n"
        "    return xs[-k:] + xs[:-k] if k else list(xs)\n",
        lambda r: r.randint(1, 5), lambda r: [_ints(r)],
    ),
    Problem(
        "digit_sum", "solve(n: int) -> int", "Return the sum of the decimal digits of n * {k} (n >= 0).",
        "def solve(n):\n    return sum(int(d) for d in str(n * {k}))\n",
        lambda r: r.randint(2, 99), lambda r: [r.randint(0, 10**6)],
    ),
    Problem(
        "caesar", "solve(s: str) -> str",
        "Shift every lowercase letter a-z of s forward by {k} places in the alphabet (z wraps to a); keep every "
        "other character.",
        "def solve(s):\n    return ''.join(chr((ord(c) - 97 + {k}) % 26 + 97) if 'a' <= c <= 'z' else c for c in s)\n",
        lambda r: r.randint(1, 25), lambda r: [_sentence(r) + r.choice(["", "!", " 42", "Q"])],
    ),
    Problem(
        "dedupe_divisible", "solve(xs: list[int]) -> list[int]",
        "Return the values of xs divisible by {k}, each only at its first occurrence, in their original order.",
        "def solve(xs):\n    seen, out = set(), []\n    for x in xs:\n"
        "        if x % {k} == 0 and x not in seen:\n            seen.add(x)\n            out.append(x)\n"
        "    return out\n",
        lambda r: r.randint(2, 5), lambda r: [_ints(r, -20, 20, 14)],
    ),
)  # fmt: skip
TASK_TYPES = tuple(p.name for p in PROBLEMS)


@dataclass(frozen=True)
class CodeTask:
    """One coding task: the prompt, the reference solution, and visible and hidden cases with expected values."""

    task_id: str
    task_type: str
    prompt: str
    reference: str
    examples: tuple[tuple[list[Any], Any], ...]
    hidden: tuple[tuple[list[Any], Any], ...]


def _reference_fn(source: str) -> Any:
    scope: dict[str, Any] = {}
    exec(compile(source, "<reference>", "exec"), scope)  # noqa: S102 - our own constant reference code
    return scope["solve"]


def _cases(problem: Problem, fn: Any, rng: random.Random, n: int) -> tuple[tuple[list[Any], Any], ...]:
    out = []
    for _ in range(n):
        args = problem.draw_input(rng)
        out.append((json.loads(json.dumps(args)), json.loads(json.dumps(fn(*json.loads(json.dumps(args)))))))
    return tuple(out)


def make_code_task(task_seed: int, split: str, task_type: str | None = None) -> CodeTask:
    """The task of ``task_seed`` (deterministic); ``task_type`` forces the problem."""
    rng = random.Random(f"pycode:{task_seed}")
    problem = rng.choice(PROBLEMS) if task_type is None else _problem(task_type)
    k = problem.draw_k(rng)
    reference = problem.reference.format(k=k)
    fn = _reference_fn(reference)
    examples = _cases(problem, fn, rng, 2)
    hidden = _cases(problem, fn, rng, N_HIDDEN)
    shown = "\n".join(f"  solve({', '.join(map(repr, a))}) == {e!r}" for a, e in examples)
    prompt = (
        f"Write a Python function `{problem.signature}`.\n{problem.statement.format(k=k)}\nExamples:\n{shown}\n"
        "Test code with the run_python tool if you like, then answer with the complete source of the function."
    )
    return CodeTask(f"pycode-{split}-{task_seed}", problem.name, prompt, reference, examples, hidden)


def _problem(name: str) -> Problem:
    for p in PROBLEMS:
        if p.name == name:
            return p
    raise ValueError(f"unknown PyCode task type {name!r}; expected one of {TASK_TYPES}")


def extract_code(answer: str) -> str:
    """The code of an answer: the first fenced block if there is one, else the whole text."""
    m = re.search(r"```(?:python|py)?[ \t]*\n(.*?)```", answer, re.DOTALL)
    return m.group(1) if m else answer


def hidden_test_results(task: CodeTask, code: str, sandbox: Any, limits: Limits) -> list[bool]:
    """Run ``code`` against the hidden cases in ``sandbox``; one bool per case (all False if it did not run).

    Raises :class:`VerifierError` when the sandbox itself fails (not the solution).
    """
    sandbox.put_file("solution.py", code.encode())
    sandbox.put_file("_runner.py", _RUNNER.encode())
    cases = json.dumps([args for args, _ in task.hidden])
    result = sandbox.exec(["python3", "-I", "_runner.py"], stdin=cases, timeout=8.0, limits=limits)
    line = next((ln for ln in reversed(result.stdout.splitlines()) if ln.startswith(_MARK)), None)
    if result.timed_out or line is None:
        return [False] * len(task.hidden)
    try:
        outcome = json.loads(line[len(_MARK) :])
    except json.JSONDecodeError:
        return [False] * len(task.hidden)
    if not isinstance(outcome, list) or len(outcome) != len(task.hidden):
        return [False] * len(task.hidden)
    return [
        isinstance(o, dict) and o.get("ok") is True and o.get("value") == expected
        for o, (_, expected) in zip(outcome, task.hidden, strict=True)
    ]


def _all_pass(answer: str, task: CodeTask, env: PyCodeEnv) -> float:
    return float(all(env.hidden_results(answer)))


def _pass_fraction(answer: str, task: CodeTask, env: PyCodeEnv) -> float:
    results = env.hidden_results(answer)
    return sum(results) / len(results)


class PyCodeEnv(SandboxToolEnv):
    """``agentflow/PyCode-v0``: ``run_python`` in a sandbox, answer with code, hidden tests score it (0 or 1).

    The reward is 1 when every hidden case passes; ``reward_terms["pass_fraction"]`` (weight 0) reports the share.
    """

    branching = "replay"  # the same code runs the same way in a fresh sandbox

    system_prompt = (
        "You write Python functions. Use the run_python tool to try code. When done, answer with the complete "
        "source of the requested function only."
    )
    max_turns = 4
    task_sets = {
        "default": simple_task_set(task_types=TASK_TYPES, description="ten small list/string/number functions"),
    }
    rubric = Rubric([(1.0, _all_pass, "all_tests_pass"), (0.0, _pass_fraction, "pass_fraction")])
    sandbox_limits = Limits(memory_mb=512, cpu_s=5, file_size_mb=4, max_procs=16, output_kb=64)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._results: tuple[str, list[bool]] | None = None

    def make_task(self, task_seed: int, split: str, task_set: str) -> CodeTask:
        """The coding task of ``task_seed``."""
        self._results = None
        return make_code_task(task_seed, split)

    @tool
    async def run_python(self, code: str) -> str:
        """Run a Python script in a sandbox (no network) and return its exit code, stdout and stderr.

        Args:
            code: The complete script to run, e.g. a function and a few print calls.
        """
        if len(code) > MAX_CODE_CHARS:
            raise ActionError(f"code is too long ({len(code)} > {MAX_CODE_CHARS} characters)")
        self.sandbox.put_file("main.py", code.encode())
        return describe_result(await self.run(["python3", "-I", "main.py"], timeout=10.0))

    def hidden_results(self, answer: str) -> list[bool]:
        """The hidden cases' outcomes for ``answer`` (computed once per answer)."""
        if self._results is None or self._results[0] != answer:
            code = extract_code(answer)
            if len(code) > MAX_CODE_CHARS:
                results = [False] * len(self.task.hidden)
            else:  # a fresh sandbox: nothing the agent left in its own can interfere
                box = make_sandbox(self.sandbox_kind, limits=self.sandbox_limits)
                try:
                    results = hidden_test_results(self.task, code, box, self.sandbox_limits)
                finally:
                    box.close()
            if len(results) != len(self.task.hidden):
                raise VerifierError("hidden test runner returned the wrong number of results")
            self._results = (answer, results)
        return self._results[1]


def expert_action(env: PyCodeEnv, history: list[tuple[str, str]]) -> str:
    """A scripted expert: tries the reference solution on the first example with ``run_python``, then answers it."""
    task: CodeTask = env.unwrapped.task
    if not history:
        args, _ = task.examples[0]
        call = f"print(repr(solve({', '.join(map(repr, args))})))"
        return tool_action("run_python", {"code": task.reference + call})
    return answer_action(task.reference)
