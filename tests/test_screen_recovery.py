"""Browser and desktop envs recover from actions that time out, and leave nothing behind at interpreter exit.

An action that runs past ``action_timeout_s`` is stopped and answered with an error observation; a backend whose
loop stops answering for ``step_timeout_s`` ends the episode (``EnvCrashedError``) and the next reset replaces it.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time

import pytest
from test_browser import _require_browser
from test_desktop import require_desktop

import envs
from envs.core import tool_action
from envs.errors import EnvCrashedError

BIG = {"max_string_chars": 200_000, "max_action_chars": 300_000}


@pytest.mark.desktop
def test_desktop_a_long_type_text_is_stopped_and_the_env_goes_on():
    require_desktop()
    env = envs.make("agentflow/Desktop-v0")
    try:
        env.reset(seed=1)
        obs, reward, terminated, _, _ = env.step(tool_action("type_text", {"text": "a" * 100_000}))
        assert obs.startswith("Error: action is 100048 characters") and not terminated  # the limit
        env.action_limits = env.action_limits.coerce(BIG)
        env.action_timeout_s = 1.0
        t0 = time.perf_counter()
        obs, *_ = env.step(tool_action("type_text", {"text": "a" * 100_000}))
        assert obs == "Error: type_text did not finish within 1 s and was stopped"
        assert time.perf_counter() - t0 < 5
        assert env.step(tool_action("key", {"combo": "BackSpace"}))[0].startswith("Window: Calculator")

        async def twin():
            obs = (await env.astep(tool_action("type_text", {"text": "b" * 100_000})))[0]
            t = time.perf_counter()
            await env.areset(seed=2)
            return obs, time.perf_counter() - t

        obs, reset_s = asyncio.run(twin())
        assert obs.startswith("Error: type_text did not finish") and reset_s < 10
    finally:
        env.close()


@pytest.mark.desktop
def test_desktop_a_blocked_loop_ends_the_episode_and_the_next_reset_replaces_it(monkeypatch):
    require_desktop()
    from envs.desktop.env import DesktopEnv

    env = DesktopEnv()
    try:
        env.reset(seed=1)
        old_loop, old_display = env.backend, env.xvfb.display

        async def blocks(self, name, arguments):
            time.sleep(3)  # a call that holds the loop itself (no await): action_timeout_s cannot stop it
            return "late"

        monkeypatch.setattr(DesktopEnv, "atool", blocks)
        env.step_timeout_s = 0.5
        with pytest.raises(EnvCrashedError, match="did not answer within 0.5 s"):
            env.step(tool_action("key", {"combo": "Return"}))
        with pytest.raises(EnvCrashedError, match="reset\\(\\) replaces the backend"):
            env.step(tool_action("key", {"combo": "Return"}))
        monkeypatch.undo()
        env.step_timeout_s = 60.0
        obs, _ = env.reset(seed=2)
        assert "\nTask: " in obs and env.backend is not old_loop and not old_loop.alive
        assert env.xvfb.display != old_display
        assert env.step(tool_action("key", {"combo": "Return"}))[0].startswith("Window: ")
    finally:
        env.close()


@pytest.mark.browser
def test_browser_a_slow_action_is_stopped_and_a_blocked_loop_is_replaced(monkeypatch):
    _require_browser()
    from envs.browser.env import BrowserEnv
    from envs.browser.pool import BrowserPool

    pool = BrowserPool()
    env = BrowserEnv(pool=pool)
    try:
        env.reset(seed=1)

        async def slow(self, args):
            await asyncio.sleep(30)

        monkeypatch.setattr(BrowserEnv, "_do_press", slow)
        env.action_timeout_s = 0.5
        assert (
            env.step(tool_action("press", {"key": "Tab"}))[0]
            == "Error: press did not finish within 0.5 s and was stopped"
        )
        assert asyncio.run(env.astep(tool_action("press", {"key": "Tab"})))[0].startswith("Error: press did not")

        async def blocks(self, args):
            time.sleep(8)  # holds the pool's loop past the recovery's own wait

        monkeypatch.setattr(BrowserEnv, "_do_press", blocks)
        env.step_timeout_s = 0.5
        with pytest.raises(EnvCrashedError, match="did not answer"):
            env.step(tool_action("press", {"key": "Tab"}))
        monkeypatch.undo()
        env.step_timeout_s = 60.0
        old_loop = pool.loop
        obs, _ = env.reset(seed=2)
        assert obs.startswith("Task: ") and pool.loop is not old_loop and pool.launches == 2
        assert env.step(tool_action("scroll", {"direction": "down"}))[0].startswith("URL: ")
    finally:
        env.close()
        pool.close()


_EXIT_SCRIPT = """
import asyncio, sys, envs
from envs.core import tool_action

close = sys.argv[1] == "close"
browser = envs.make("agentflow/Browser-v0")
desktop = envs.make("agentflow/Desktop-v0", action_limits={"max_string_chars": 200000, "max_action_chars": 300000})
desktop.action_timeout_s = browser.action_timeout_s = 1.0
for env, act in ((browser, tool_action("type", {"ref": "e10", "text": "x" * 50000})),
                 (desktop, tool_action("type_text", {"text": "a" * 100000}))):
    env.reset(seed=1)
    print(env.step(act)[0][:40])
    async def twin(env=env, act=act):
        await env.areset(seed=2)
        return (await env.astep(act))[0][:40]
    print(asyncio.run(twin()))
print("pids", desktop.xvfb.pid, desktop._app.pid, browser.pool.browser_pid, flush=True)
if close:
    browser.close()
    desktop.close()
"""


@pytest.mark.browser
@pytest.mark.desktop
@pytest.mark.parametrize("how", ["close", "exit"])
def test_no_traceback_and_no_process_left_at_interpreter_exit(how, tmp_path):
    _require_browser()
    require_desktop()
    script = tmp_path / "use_both.py"
    script.write_text(textwrap.dedent(_EXIT_SCRIPT))
    cwd = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-W", "default", str(script), how], capture_output=True, text=True,
                          cwd=cwd, timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for bad in ("Traceback", "Exception ignored", "Event loop is closed", "ResourceWarning", "Task was destroyed"):
        assert bad not in proc.stderr, proc.stderr
    pids = [int(p) for p in proc.stdout.split("pids", 1)[1].split()]
    time.sleep(0.5)
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read(), pid
