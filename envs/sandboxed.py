"""A base for tool environments with tasks drawn from task sets, a rubric, and a fresh sandbox per episode.

:class:`SandboxToolEnv` composes the pieces: ``@tool`` methods (:class:`~envs.tools.ToolEnv`), task sets
(:mod:`envs.tasks`), a :class:`~envs.verifiers.Rubric`, and a sandbox from :func:`envs.sandbox.make_sandbox`
(created on first use, replaced at every reset so no state leaks between episodes, closed by :meth:`close`).
A subclass provides ``task_sets``, ``rubric``, :meth:`make_task` and optionally :meth:`setup_sandbox`.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from envs.errors import EnvError, SandboxError
from envs.sandbox import ExecResult, Limits, make_sandbox
from envs.tasks import DEFAULT_TASK_SET, lookup_task_set
from envs.tools import ToolEnv
from envs.verifiers import Rubric


class SandboxToolEnv(ToolEnv):
    """Tool env base: ``reset(options={"split": "eval", "task_set": NAME})``, a sandbox, rubric scoring.

    ``self.task`` is the current task (any object with ``task_id``, ``task_type`` and ``prompt``), scored by
    ``rubric`` (see :class:`~envs.tools.ToolEnv`).
    """

    branching = "replay"  # tasks are drawn from the seed and the sandbox's tools answer the same commands alike

    rubric: Rubric
    sandbox_limits: Limits = Limits(memory_mb=512, cpu_s=10, file_size_mb=8, max_procs=32, output_kb=64)

    def __init__(
        self,
        max_turns: int | None = None,
        split: str = "train",
        task_set: str = DEFAULT_TASK_SET,
        sandbox_kind: str = "bwrap",
        sandbox_pool: Any = None,
    ) -> None:
        """``sandbox_pool``: an :class:`envs.sandbox.SandboxPool` to take warm sandboxes from (and give back wiped)."""
        super().__init__(max_turns=max_turns)
        self.sandbox_pool = sandbox_pool
        lookup_task_set(self.task_sets, task_set, type(self).__name__).seed_range(split)  # validates both
        self.split, self.task_set, self.sandbox_kind = split, task_set, sandbox_kind
        self._sandbox: Any = None
        self._sandbox_lock = threading.Lock()

    # -- what subclasses implement -----------------------------------------------------------------------------
    def make_task(self, task_seed: int, split: str, task_set: str) -> Any:
        """The task of ``task_seed`` (deterministic)."""
        raise NotImplementedError

    def setup_sandbox(self, sandbox: Any) -> None:
        """Prepare a new episode's sandbox for ``self.task`` (e.g. write its files). Nothing by default."""

    needs_sandbox_at_reset: bool = False
    """When True, the sandbox is created and :meth:`setup_sandbox` runs at reset (else on the first tool use)."""

    # -- sandbox -----------------------------------------------------------------------------------------------
    @property
    def sandbox(self) -> Any:
        """This episode's sandbox, created (and set up) on first use."""
        with self._sandbox_lock:
            if self._sandbox is None:
                if self.task is None:
                    raise EnvError("no task: call reset() first")
                pool = self.sandbox_pool
                kind, limits = self.sandbox_kind, self.sandbox_limits
                box = pool.acquire() if pool is not None else make_sandbox(kind, limits=limits)
                try:
                    self.setup_sandbox(box)
                except BaseException:
                    pool.release(box) if pool is not None else box.close()
                    raise
                self._sandbox = box
            return self._sandbox

    def _drop_sandbox(self) -> None:
        with self._sandbox_lock:
            box, self._sandbox = self._sandbox, None
        if box is not None:
            self.sandbox_pool.release(box) if self.sandbox_pool is not None else box.close()

    async def run(self, cmd: list[str] | str, stdin: str | None = None, timeout: float = 10.0) -> ExecResult:
        """Run ``cmd`` in the sandbox without holding a thread; raises :class:`SandboxError` on a timeout."""
        result = await self.sandbox.aexec(cmd, stdin=stdin, timeout=timeout, limits=self.sandbox_limits)
        if result.timed_out:
            raise SandboxError(f"the command timed out after {timeout:g} s")
        return result

    # -- AgentEnv hooks ----------------------------------------------------------------------------------------
    def reset_task(self, seed: int, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Draw the task of ``seed`` in ``options["split"]`` / ``options["task_set"]`` with a fresh sandbox."""
        split = options.get("split", self.split)
        set_name = options.get("task_set", self.task_set)
        task_set = lookup_task_set(self.task_sets, set_name, type(self).__name__)
        ts = task_set.task_seed(seed, split)
        self._drop_sandbox()
        self.task = self.make_task(ts, split, set_name)
        if self.needs_sandbox_at_reset:
            _ = self.sandbox
        info = {
            "task_id": self.task.task_id,
            "task_type": self.task.task_type,
            "split": split,
            "seed": ts,
            "task_set": set_name,
        }
        return self.task.prompt, info

    async def ascore_answer(self, text: str) -> tuple[float, bool]:
        """Score in a worker thread: verifiers may run commands in the sandbox."""
        return await asyncio.to_thread(self.score_answer, text)

    def close(self) -> None:
        """Close the sandbox (if any). Safe to call twice."""
        self._drop_sandbox()
        super().close()


def describe_result(result: ExecResult, limit: int = 4000) -> str:
    """An observation for a command's result: exit code, stdout and stderr (each clipped to ``limit`` chars)."""
    parts = [f"exit code: {result.exit_code}"]
    for label, text in (("stdout", result.stdout), ("stderr", result.stderr)):
        if text:
            clipped = text if len(text) <= limit else text[:limit] + "\n...[truncated]"
            parts.append(f"{label}:\n{clipped.rstrip()}")
    return "\n".join(parts)
