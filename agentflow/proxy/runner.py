"""Plays one episode with a black-box agent program: env reset, the program against the proxy, the env's verifier.

The program is a Python callable (``module:function``, sync or async, given a :class:`BlackBoxTask`) or a subprocess
command (given ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` / ``OPENAI_MODEL``, the same as ``ANTHROPIC_*`` for
Anthropic clients, and ``AGENTFLOW_TASK`` in its environment). Its answer is the callable's return value or the last
non-empty line the subprocess prints; without one, the last reply the proxy returned. The env scores the answer (its
verifier), so the reward never comes from the program. A call the proxy refuses (a bad request, a context past
``max_len``) is the program's to handle: it gets the error, the trajectory counts it (``refused_calls``,
``first_refusal``) and the episode goes on. The episode ends ``error``, with a reason and no reward, only when the
program fails: it crashes, hangs past the timeout (killed, with its process group; ``timed_out`` in the info) or
makes no successful model call; the job goes on.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentflow.entrypoints import load_reference
from agentflow.proxy.server import ProxyServer
from agentflow.proxy.types import BlackBoxTask
from agentflow.types import SamplingParams, Trajectory
from envs.core import answer_action, tool_action


@dataclass
class Outcome:
    """How the program ended: its answer (or None), or why it failed."""

    answer: str | None = None
    error: str | None = None
    timed_out: bool = False


class CallableProgram:
    """A Python agent: ``fn(task) -> str | None``, a coroutine function or a plain one (run in a thread)."""

    def __init__(self, fn: Callable[[BlackBoxTask], Any]) -> None:
        self.fn = fn
        self.name = getattr(fn, "__qualname__", repr(fn))

    async def __call__(self, task: BlackBoxTask, timeout: float) -> Outcome:
        # A thread cannot be killed: on timeout it is abandoned, and the closed session refuses its further calls.
        call = self.fn(task) if inspect.iscoroutinefunction(self.fn) else asyncio.to_thread(self.fn, task)
        try:
            answer = await asyncio.wait_for(call, timeout)
        except TimeoutError:
            return Outcome(error=f"agent {self.name} timed out after {timeout:g} s", timed_out=True)
        except Exception as e:
            tb = traceback.format_exc(limit=4)
            return Outcome(error=f"agent {self.name} raised {type(e).__name__}: {e}\n{tb}")
        if answer is not None and not isinstance(answer, str):
            return Outcome(error=f"agent {self.name} returned {type(answer).__name__}, expected str or None")
        return Outcome(answer=answer)


class SubprocessProgram:
    """An agent command run in its own process group; killed with the group on timeout."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        if not argv:
            raise ValueError("black-box agent command is empty")
        self.argv = [sys.executable if a == "{python}" else a for a in argv]
        self.env = dict(env or {})

    async def __call__(self, task: BlackBoxTask, timeout: float) -> Outcome:
        env = {**os.environ, **self.env, "OPENAI_BASE_URL": task.base_url, "OPENAI_API_KEY": task.api_key,
               "OPENAI_MODEL": task.model, "AGENTFLOW_TASK": json.dumps(task.to_json_dict())}  # fmt: skip
        if task.anthropic_base_url:  # for programs on Anthropic's SDK (which reads these itself)
            env.update(ANTHROPIC_BASE_URL=task.anthropic_base_url, ANTHROPIC_API_KEY=task.api_key,
                       ANTHROPIC_MODEL=task.model)  # fmt: skip
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True,
            )  # fmt: skip
        except OSError as e:
            return Outcome(error=f"cannot start agent {self.argv[0]!r}: {e}")
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except (TimeoutError, asyncio.CancelledError) as e:
            _kill_group(proc)
            await proc.wait()
            if isinstance(e, asyncio.CancelledError):
                raise
            return Outcome(error=f"agent {self.argv[0]!r} timed out after {timeout:g} s (killed)", timed_out=True)
        if proc.returncode != 0:
            tail = err.decode(errors="replace").strip()[-800:]
            return Outcome(error=f"agent {self.argv[0]!r} exited with code {proc.returncode}: {tail}")
        lines = [ln.strip() for ln in out.decode(errors="replace").splitlines() if ln.strip()]
        return Outcome(answer=lines[-1] if lines else None)


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the program's own children too (start_new_session made the group)
    except ProcessLookupError:
        pass


def load_callable(entry: str) -> Callable[..., Any]:
    """``module:function`` -> the function (``agent.entry``); a clear error names what is missing."""
    return load_reference(entry, "agent.entry")


class _EnvTools:
    """The env's tools for one episode, stepped in call order; the episode may end on a tool step (turn limit)."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.done = False
        self.truncated = False
        self.steps: list[tuple[str, str]] = []
        self.lock = asyncio.Lock()

    async def __call__(self, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        async with self.lock:
            if self.done:
                raise RuntimeError("the episode is over: no more tool calls")
            action = tool_action(name, arguments)
            obs, _, terminated, truncated, _ = await self.env.astep(action)
            self.steps.append((action, obs))
            self.done, self.truncated = bool(terminated or truncated), bool(truncated and not terminated)
            return obs, self.done


class BlackBoxRunner:
    """Runs episodes of one program through one proxy."""

    def __init__(self, proxy: ProxyServer, program: Any, timeout_s: float, max_len: int) -> None:
        self.proxy, self.program, self.timeout_s, self.max_len = proxy, program, timeout_s, max_len

    async def run(self, env: Any, spec: Any, sampling: SamplingParams, attempt: int = 0) -> Trajectory:
        """Play ``spec`` (an :class:`~agentflow.episode.EpisodeSpec`); always returns a trajectory."""
        traj = Trajectory(id=spec.traj_id, task_id=f"{spec.split}:{spec.seed}", group_id=spec.group_id,
                          env_id=spec.env_id, data_source=spec.data_source, tags=list(spec.tags))  # fmt: skip
        t0 = time.perf_counter()
        try:
            await self._play(env, spec, sampling, attempt, traj)
        except Exception as e:  # the env failed (reset, tool, verifier): keep what was recorded, never score it
            traj.status, traj.reward, traj.error = "error", None, f"{type(e).__name__}: {e}"
            traj.info["traceback"] = traceback.format_exc(limit=5)
        finally:
            if self.proxy.is_open(spec.traj_id):
                self._collect(self.proxy.close(spec.traj_id), traj)
        traj.timings["episode_s"] = time.perf_counter() - t0
        if traj.status != "ok":
            traj.info["success"] = False
        return traj

    async def _play(self, env: Any, spec: Any, sampling: SamplingParams, attempt: int, traj: Trajectory) -> None:
        obs, info = await env.areset(seed=spec.seed, options={**spec.options, "split": spec.split})
        traj.info.update(task_type=info.get("task_type"), split=spec.split)
        tools = _EnvTools(env)
        self.proxy.open(spec.traj_id, sampling, self.max_len, attempt, tool_handler=tools)
        task = BlackBoxTask(
            trajectory_id=spec.traj_id,
            base_url=self.proxy.base_url(spec.traj_id, attempt),
            api_key=self.proxy.api_key,
            model=self.proxy.model_name,
            messages=[{"role": "system", "content": env.system_prompt}, {"role": "user", "content": obs}],
            tools=[t.to_openai() for t in env.tools],
            max_turns=env.max_turns,
            tools_url=self.proxy.tools_url(spec.traj_id, attempt),
            call_tool=tools,
            anthropic_base_url=self.proxy.anthropic_base_url(spec.traj_id, attempt),
        )
        t = time.perf_counter()
        outcome = await self.program(task, self.timeout_s)
        traj.timings["agent_s"] = time.perf_counter() - t
        rec = self.proxy.close(spec.traj_id)
        self._collect(rec, traj)
        refused = f" ({rec.refused} refused, the first: {rec.first_refusal})" if rec.refused else ""
        if outcome.error is not None:
            traj.status, traj.reward, traj.error = "error", None, outcome.error
            traj.info["timed_out"] = outcome.timed_out
        elif not rec.calls:
            traj.status, traj.reward, traj.error = "error", None, "the agent made no model calls" + refused
        elif tools.done:  # out of turns (tool steps): as the white-box loop
            traj.status, traj.reward = "truncated", 0.0
            traj.error = f"no answer within {env.max_turns} turns"
        else:
            answer = outcome.answer if outcome.answer is not None else (rec.last_reply() or {}).get("content", "")
            _, reward, _, _, step_info = await env.astep(answer_action(answer))
            traj.reward, traj.info["answer"] = float(reward), answer
            traj.info["success"] = bool(step_info.get("success", reward > 0))
        _attach_observations(traj, tools.steps)

    @staticmethod
    def _collect(rec: Any, traj: Trajectory) -> None:
        traj.segments, traj.turns = rec.segments, rec.turns()
        traj.info.update(rec.summary())


def _attach_observations(traj: Trajectory, steps: list[tuple[str, str]]) -> None:
    """Tool results in call order onto the turns that asked for that tool call (not onto replies the agent dropped
    by asking again: an agent that asks again has not acted on the reply)."""
    pending = list(steps)
    for turn in traj.turns:
        if traj.segments[turn.segment].kind == "retry":
            continue
        if pending and turn.action == pending[0][0]:
            turn.observation = pending.pop(0)[1]
