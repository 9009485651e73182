"""What ``agentflow envs check ID`` and ``agentflow envs play ID`` do (kept here so ``envs`` can test them alone)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings
from typing import Any, TextIO

from envs.core import AgentEnv, answer_action
from envs.errors import EnvError
from envs.registry import make


class EnvCheckError(EnvError):
    """An environment that fails :func:`envs.checker.check_agent_env`; the message is one line saying why."""


def _one_line(text: object, limit: int = 400) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def check(
    env_id: str, seed: int = 7, out: TextIO | None = None, fuzz: int = 0, fuzz_seed: int | None = None
) -> list[str]:
    """Build ``env_id`` and run ``check_agent_env``; returns Gymnasium's warnings, raises :class:`EnvCheckError`.

    ``fuzz``: then send that many malformed actions (:mod:`envs.fuzz`, from ``fuzz_seed``, a fresh one when None;
    printed either way, so a failure can be replayed). Output goes to ``out`` (default: ``sys.stdout``).
    """
    out = out or sys.stdout
    from envs.checker import check_agent_env

    env: Any = None
    try:
        env = make(env_id)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            check_agent_env(env, seed=seed)
    except EnvError as e:
        if isinstance(e, EnvCheckError | KeyError):
            raise
        _close(env)
        raise EnvCheckError(f"{env_id} fails the env check: {type(e).__name__}: {_one_line(e)}") from e
    except Exception as e:  # noqa: BLE001 - any failure of the env is the verdict, said in one line
        _close(env)
        reason = _one_line(e) or "(no message)"
        raise EnvCheckError(f"{env_id} fails the env check: {type(e).__name__}: {reason}") from e
    notes = sorted({_one_line(w.message) for w in caught})
    for note in notes:
        print(f"warning: {note}", file=out)
    print(f"ok: {env_id} passes gymnasium check_env and the async/AgentEnv conformance checks", file=out)
    try:
        print(check_branch(env, env_id, seed), file=out)
    except Exception as e:  # noqa: BLE001 - a branch that does not repeat is the verdict, in one line
        _close(env)
        raise EnvCheckError(f"{env_id} fails the branching check: {type(e).__name__}: {_one_line(e)}") from e
    try:
        if fuzz > 0:
            run_fuzz(env, env_id, fuzz, fuzz_seed, out)
    finally:
        _close(env)
    return notes


def check_branch(env: AgentEnv, env_id: str, seed: int) -> str:
    """Verify the env's declared branching on its expert's episode (or a short script); returns the verdict line."""
    import asyncio

    from envs.branching import branching_of, check_branching, expert_actions
    from envs.checker import default_actions
    from envs.registry import spec

    mode = branching_of(env)
    if mode is None:
        return f"warning: {env_id} declares no branching (AgentEnv.branching): tree rollouts cannot branch it"
    if mode == "none":
        return f"ok: {env_id} declares that it cannot branch (branching='none')"
    expert = spec(env_id).load_expert()
    actions = asyncio.run(expert_actions(env, expert, seed)) if expert is not None else default_actions(env)
    report = asyncio.run(check_branching(env, actions, seed))
    return (f"ok: {env_id} branches by {mode}: after {report.prefix} of the episode's actions, the branched env "
            f"repeats the next {report.compared} steps exactly")  # fmt: skip


def run_fuzz(env: AgentEnv, env_id: str, n: int, seed: int | None, out: TextIO) -> None:
    """``n`` malformed actions from ``seed`` (a fresh one when None); raises :class:`EnvCheckError` on a failure."""
    import secrets

    from envs.fuzz import fuzz_env, step_timeout

    seed = secrets.randbelow(2**31) if seed is None else seed
    print(f"fuzz: {n} malformed actions, seed {seed}, step timeout {step_timeout(env):g} s", file=out, flush=True)
    report = fuzz_env(env, n, seed)
    if not report.ok:
        replay = f"agentflow envs check {env_id} --fuzz {n} --fuzz-seed {seed}"
        more = f" (and {len(report.failures) - 1} more)" if len(report.failures) > 1 else ""
        raise EnvCheckError(
            f"{env_id} fails the fuzz check (seed {seed}): {report.failures[0]}{more}; replay: {replay}"
        )
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(report.kinds.items()))
    print(f"ok: {env_id} answers {n} malformed actions (seed {seed}) in {report.wall_s:.1f} s, slowest step "
          f"{report.slowest_s:.2f} s, and resets after them [{kinds}]", file=out)  # fmt: skip


def _close(env: Any) -> None:
    if env is not None:
        try:
            env.close()
        except Exception:  # noqa: BLE001 - the verdict matters more than a failing close
            pass


def line_to_action(line: str) -> str | None:
    """A typed line as a canonical action: JSON objects are passed as they are, other text is an answer."""
    text = line.strip()
    if not text:
        return None
    return text if text.startswith("{") else answer_action(text)


def _show(out: TextIO, label: str, value: Any) -> None:
    if isinstance(value, dict) and value.get("images"):
        value = {**value, "images": f"[{len(value['images'])} PNG screenshot(s)]"}
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)
    print(f"{label}: {text}", file=out)


def play(
    env_id: str,
    seed: int = 0,
    split: str = "train",
    task_set: str | None = None,
    inp: TextIO | None = None,
    out: TextIO | None = None,
) -> dict[str, Any]:
    """Play one episode of ``env_id`` with actions read from ``inp`` line by line; returns the final step's info.

    A line that starts with ``{`` is a canonical action (``{"tool": ..., "arguments": {...}}`` or
    ``{"answer": ...}``); any other non-empty line is an answer. Observations, rewards and infos go to ``out``.
    ``inp``/``out`` default to ``sys.stdin``/``sys.stdout``.
    """
    inp, out = inp or sys.stdin, out or sys.stdout
    env: AgentEnv = make(env_id)
    try:
        options: dict[str, Any] = {"split": split}
        if task_set is not None:
            options["task_set"] = task_set
        obs, info = env.reset(seed=seed, options=options)
        _show(out, "system", env.system_prompt)
        for t in env.tools:
            _show(out, "tool", t.to_openai()["function"])
        _show(out, "observation", obs)
        _save_images(info, out, 0)
        _show(out, "info", info)
        return _loop(env, inp, out)
    finally:
        env.close()


def _save_images(info: dict[str, Any], out: TextIO, turn: int) -> None:
    """Browser and desktop envs return PNG screenshots in the info: write them to files and print their paths."""
    global _play_dir
    for i, png in enumerate(info.get("images") or []):
        if _play_dir is None:
            _play_dir = tempfile.mkdtemp(prefix="agentflow-play-")
        path = os.path.join(_play_dir, f"turn{turn:02d}-{i}.png")
        with open(path, "wb") as f:
            f.write(png)
        print(f"screenshot: {path}", file=out)


_play_dir: str | None = None


def _loop(env: AgentEnv, inp: TextIO, out: TextIO) -> dict[str, Any]:
    interactive = inp.isatty()
    while True:
        if interactive:
            print("> ", end="", file=out, flush=True)
        line = inp.readline()
        if not line:
            print("stdin closed before the episode ended", file=out)
            return {}
        action = line_to_action(line)
        if action is None:
            continue
        obs, reward, terminated, truncated, info = env.step(action)
        _show(out, "observation", obs)
        _save_images(info, out, env.turn)
        print(f"reward: {reward:g}  terminated: {terminated}  truncated: {truncated}", file=out)
        _show(out, "info", info)
        if terminated or truncated:
            print(f"episode over: success={info.get('success')}", file=out)
            return info
