"""A killed browser or X server ends its episode as ``error`` (with the reason), and the next episode succeeds.

The episodes run through the white-box agent loop with the embedded engine on a tiny local model; the backend is
killed (by the PID the env started) after the episode's reset, before its first action reaches the env.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from test_browser import _require_browser, play_expert
from test_desktop import play_expert as play_desktop_expert
from test_desktop import require_desktop

from agentflow.chat import ChatTokenizer
from agentflow.engine.embedded import EmbeddedEngine
from agentflow.episode import EpisodeSpec, run_episode
from agentflow.model_init import ModelInitConfig, init_model
from agentflow.types import SamplingParams

TINY = ModelInitConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=176, num_attention_heads=4)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("tiny"), TINY)


class KillFirst:
    """The real engine; before the first generation it kills ``pid`` (a process the test's env started)."""

    def __init__(self, engine, pid: int | None):
        self.engine, self.pid = engine, pid

    @property
    def weight_version(self):
        return self.engine.weight_version

    async def generate(self, input_ids, sampling, rid=None):
        if self.pid is not None:
            os.kill(self.pid, signal.SIGKILL)
            self.pid = None
            await asyncio.sleep(0.5)  # let the env's backend notice
        return await self.engine.generate(input_ids, sampling, rid)


def _episode(engine, tok, env, pid):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=16, seed=1)
    spec = EpisodeSpec("t0", "g0", 3, env_id="test")
    return asyncio.run(run_episode(KillFirst(engine, pid), tok, env, spec, sampling, 2048))


@pytest.mark.browser
def test_killed_browser_ends_the_episode_with_error_and_the_pool_recovers(tiny_model):
    _require_browser()
    from envs.browser.env import BrowserEnv
    from envs.browser.pool import BrowserPool

    pool = BrowserPool()
    env = BrowserEnv(pool=pool, max_turns=2)
    tok = ChatTokenizer(tiny_model)
    try:
        with EmbeddedEngine(tiny_model, max_slots=2, max_len=2048) as engine:
            env.reset(seed=0)  # launch the browser so that its PID is known
            traj = _episode(engine, tok, env, pool.browser_pid)
            assert traj.status == "error" and traj.reward is None
            assert traj.error.startswith("EnvCrashedError: the browser (pid") and "died" in traj.error
            again = _episode(engine, tok, env, None)
            assert again.status != "error", again.error
        assert pool.launches == 2
        env.max_turns = 16  # the expert needs more turns than the short agent episodes had
        reward, info, _ = play_expert(env, seed=1, task_type="todo")
        assert reward == 1.0, info
    finally:
        env.close()
        pool.close()


@pytest.mark.desktop
def test_killed_xvfb_ends_the_episode_with_error_and_the_env_recovers(tiny_model):
    require_desktop()
    from envs.desktop.env import DesktopEnv

    env = DesktopEnv(max_turns=2)
    tok = ChatTokenizer(tiny_model)
    try:
        with EmbeddedEngine(tiny_model, max_slots=2, max_len=2048) as engine:
            env.reset(seed=0)
            traj = _episode(engine, tok, env, env.xvfb.pid)
            assert traj.status == "error" and traj.reward is None
            assert traj.error.startswith("EnvCrashedError: the X server :") and "exited with code -9" in traj.error
            again = _episode(engine, tok, env, None)
            assert again.status != "error", again.error
        assert env.x_restarts == 1
        env.max_turns = 12
        reward, info, _ = play_desktop_expert(env, seed=1, task_type="calculator")
        assert reward == 1.0, info
    finally:
        env.close()
