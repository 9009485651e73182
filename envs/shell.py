"""``agentflow/Shell-v0``: tasks on files in the sandbox workdir, solved with one tool, ``sh(command)``.

Each episode's sandbox starts with seed-generated files (a log, a CSV, a directory tree, notes...). Some tasks
ask a question about them (answer with the value); others ask to change the workdir (answer anything, e.g.
"done"), and the verifier reads the workdir's state back from the sandbox.
"""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass, field
from typing import Any

from envs.core import answer_action, tool_action
from envs.errors import ActionError, SandboxError
from envs.sandbox import Limits
from envs.sandboxed import SandboxToolEnv
from envs.tasks import simple_task_set
from envs.tools import tool
from envs.verifiers import Rubric, normalize_text

TASK_TYPES = ("count_level", "sum_column", "find_token", "sort_unique", "rename_ext", "archive_drafts")
MAX_COMMAND_CHARS = 4000
_NAMES = ["Ada", "Bela", "Cyd", "Dora", "Emil", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea", "Milo", "Nia"]
_LEVELS = ["INFO", "WARN", "ERROR", "DEBUG"]
_SNAPSHOT = """import json, os, sys
out = {}
for top in sys.argv[1:]:
    files = {}
    for root, dirs, names in os.walk(top):
        for n in dirs + names:
            p = os.path.join(root, n)
            rel = os.path.relpath(p, top)
            if os.path.islink(p) or not os.path.isfile(p):
                files[rel] = None if os.path.islink(p) or not os.path.isdir(p) else "<dir>"
                continue
            with open(p, "rb") as f:
                files[rel] = f.read(65536).decode("utf-8", "replace")
    out[top] = files if os.path.isdir(top) and not os.path.islink(top) else None
print(json.dumps(out))
"""


@dataclass(frozen=True)
class ShellTask:
    """One task: the files to create, and either the expected answer or the expected state of some paths."""

    task_id: str
    task_type: str
    prompt: str
    files: dict[str, str]
    answer: str | None = None
    expected_dirs: dict[str, dict[str, str]] = field(default_factory=dict)
    expert_command: str = ""


def _word(rng: random.Random, n: int = 6) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, n)))


def _count_level(rng: random.Random) -> dict[str, Any]:
    level = rng.choice(_LEVELS[:3])
    lines = [f"2024-05-{rng.randint(1, 28):02d} [{rng.choice(_LEVELS)}] {_word(rng)} {_word(rng)}" for _ in range(40)]
    n = sum(f"[{level}]" in ln for ln in lines)
    return {
        "prompt": f"How many lines of logs/app.log have the level {level} (written [{level}])? Answer the number.",
        "files": {"logs/app.log": "\n".join(lines) + "\n"},
        "answer": str(n),
        "expert_command": f"grep -c '\\[{level}\\]' logs/app.log",
    }


def _sum_column(rng: random.Random) -> dict[str, Any]:
    col = rng.choice(["qty", "price"])
    rows = [(_word(rng), rng.randint(1, 50), rng.randint(1, 500)) for _ in range(rng.randint(8, 20))]
    total = sum(r[1] if col == "qty" else r[2] for r in rows)
    idx = 2 if col == "qty" else 3
    return {
        "prompt": f"data.csv has a header line. What is the sum of its {col!r} column? Answer the number.",
        "files": {"data.csv": "name,qty,price\n" + "".join(f"{a},{b},{c}\n" for a, b, c in rows)},
        "answer": str(total),
        "expert_command": f"awk -F, 'NR>1 {{s+=${idx}}} END {{print s}}' data.csv",
    }


def _find_token(rng: random.Random) -> dict[str, Any]:
    token = "".join(rng.choice(string.ascii_uppercase + string.digits) for _ in range(8))
    paths = sorted({f"tree/{_word(rng, 4)}/{_word(rng, 5)}.txt" for _ in range(8)})
    target = rng.choice(paths)
    files = {p: f"token: {_word(rng, 8).upper()}\n" for p in paths}
    files[target] = f"notes\ntoken: {token}\n"
    return {
        "prompt": f"Which file under tree/ contains the line 'token: {token}'? Answer its path (e.g. tree/x/y.txt).",
        "files": files,
        "answer": target,
        "expert_command": f"grep -rl 'token: {token}' tree",
    }


def _sort_unique(rng: random.Random) -> dict[str, Any]:
    names = [rng.choice(_NAMES) for _ in range(rng.randint(8, 16))]
    expected = "".join(f"{n}\n" for n in sorted(set(names)))
    return {
        "prompt": "Write the distinct lines of names.txt, sorted alphabetically, one per line, to a new file "
        "sorted.txt. Then answer 'done'.",
        "files": {"names.txt": "".join(f"{n}\n" for n in names)},
        "expected_dirs": {".": {"sorted.txt": expected}},
        "expert_command": "LC_ALL=C sort -u names.txt > sorted.txt",
    }


def _rename_ext(rng: random.Random) -> dict[str, Any]:
    stems = sorted({_word(rng, 5) for _ in range(rng.randint(3, 6))})
    files = {f"docs/{s}.{rng.choice(['txt', 'txt', 'log'])}": f"{_word(rng)}\n" for s in stems}
    after = {p[5:].removesuffix(".txt") + (".md" if p.endswith(".txt") else ""): c for p, c in files.items()}
    return {
        "prompt": "Rename every .txt file in docs/ to the same name with .md instead (keep the contents; leave the "
        "other files alone). Then answer 'done'.",
        "files": files,
        "expected_dirs": {"docs": after},
        "expert_command": 'cd docs && for f in *.txt; do mv "$f" "${f%.txt}.md"; done',
    }


def _archive_drafts(rng: random.Random) -> dict[str, Any]:
    names = sorted({f"{_word(rng, 5)}{rng.choice(['', '-draft', '_draft'])}.md" for _ in range(rng.randint(4, 8))})
    names.append(f"{_word(rng, 5)}-draft.md")
    files = {f"notes/{n}": f"{_word(rng)}\n" for n in names}
    keep = {n: c for n, c in ((p[6:], c) for p, c in files.items()) if "draft" not in n}
    moved = {n: c for n, c in ((p[6:], c) for p, c in files.items()) if "draft" in n}
    return {
        "prompt": "Move every file in notes/ whose name contains 'draft' into a new directory archive/ (same "
        "names). Then answer 'done'.",
        "files": files,
        "expected_dirs": {"notes": keep, "archive": moved},
        "expert_command": "mkdir -p archive && mv notes/*draft* archive/",
    }


_MAKERS = {
    "count_level": _count_level,
    "sum_column": _sum_column,
    "find_token": _find_token,
    "sort_unique": _sort_unique,
    "rename_ext": _rename_ext,
    "archive_drafts": _archive_drafts,
}


def make_shell_task(task_seed: int, split: str, task_type: str | None = None) -> ShellTask:
    """The task of ``task_seed`` (deterministic); ``task_type`` forces its kind."""
    rng = random.Random(f"shell:{task_seed}")
    kind = task_type or rng.choice(TASK_TYPES)
    if kind not in _MAKERS:
        raise ValueError(f"unknown Shell task type {kind!r}; expected one of {TASK_TYPES}")
    parts = _MAKERS[kind](rng)
    prompt = parts.pop("prompt") + "\nUse the sh tool to run shell commands in the working directory."
    return ShellTask(f"shell-{split}-{task_seed}", kind, prompt, **parts)


def _normalize_path(text: str) -> str:
    """A path answer relative to the workdir: quotes, ``./`` and the workdir's absolute prefix removed."""
    text = text.strip().strip("'\"`")
    start = text.find("tree/")
    return text[start:] if start > 0 and text[start - 1] == "/" else text.removeprefix("./")


def _task_check(answer: str, task: ShellTask, env: ShellEnv) -> float:
    """1 when the answer (question tasks) or the workdir state (change tasks) is right."""
    if task.answer is not None:
        if task.task_type == "find_token":
            return float(_normalize_path(answer) == task.answer)
        return float(normalize_text(answer) == normalize_text(task.answer))
    state = env.snapshot(sorted(task.expected_dirs))
    if state is None:
        return 0.0
    for top, expected in task.expected_dirs.items():
        got = state.get(top)
        if top == ".":
            got = {k: v for k, v in (got or {}).items() if k in expected}
        if got != expected:
            return 0.0
    return 1.0


class ShellEnv(SandboxToolEnv):
    """``agentflow/Shell-v0``: a workdir of generated files and ``sh(command)``; answer or change the files."""

    system_prompt = (
        "You work in a Linux shell. Run commands with the sh tool (working directory: the task's files). "
        "Answer with the value asked for, or 'done' once the files are as asked."
    )
    max_turns = 6
    task_sets = {"default": simple_task_set(task_types=TASK_TYPES, description="log/CSV questions and file edits")}
    rubric = Rubric([(1.0, _task_check, "task_check")])
    sandbox_limits = Limits(memory_mb=512, cpu_s=10, file_size_mb=8, max_procs=32, output_kb=64)

    def make_task(self, task_seed: int, split: str, task_set: str) -> ShellTask:
        """The shell task of ``task_seed``."""
        return make_shell_task(task_seed, split)

    def setup_sandbox(self, sandbox: Any) -> None:
        """Write the task's files into the new workdir."""
        for path, text in self.task.files.items():
            sandbox.put_file(path, text.encode())

    @tool
    async def sh(self, command: str) -> str:
        """Run a shell command (/bin/sh) in the working directory and return its output and exit code.

        Args:
            command: The command line, e.g. "ls -la" or "grep -c foo file.txt".
        """
        if len(command) > MAX_COMMAND_CHARS:
            raise ActionError(f"command is too long ({len(command)} > {MAX_COMMAND_CHARS} characters)")
        result = await self.run(command, timeout=10.0)
        out = (result.stdout + result.stderr).rstrip("\n")
        if result.exit_code != 0:
            out += f"\n(exit code {result.exit_code})"
        return out.strip("\n") or "(no output)"

    def snapshot(self, dirs: list[str]) -> dict[str, Any] | None:
        """``{dir: {relative path: text | None | "<dir>"} | None}`` read inside the sandbox; None if unreadable."""
        result = self.sandbox.exec(["python3", "-I", "-c", _SNAPSHOT, *dirs], timeout=20.0, limits=self.sandbox_limits)
        if result.exit_code != 0 and not result.stdout:
            if "python3" in result.stderr and "not found" in result.stderr:
                raise SandboxError(f"cannot read the workdir: {result.stderr.strip()}")
            return None
        try:
            return json.loads(result.stdout)
        except json.JSONDecodeError:
            return None


def expert_action(env: ShellEnv, history: list[tuple[str, str]]) -> str:
    """A scripted expert: runs the task's reference command, then answers its output (or "done")."""
    task: ShellTask = env.unwrapped.task
    if not history:
        return tool_action("sh", {"command": task.expert_command})
    if task.answer is None:
        return answer_action("done")
    return answer_action(history[-1][1].strip().splitlines()[0])
