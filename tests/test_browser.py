"""The browser env on the real system Chromium (Playwright) and the shipped web apps."""

from __future__ import annotations

import asyncio
import importlib.util
import io
import shutil

import pytest
from conftest import require

from envs.core import answer_action, tool_action

pytestmark = pytest.mark.browser


def _require_browser() -> None:
    ok = shutil.which("chromium") is not None and importlib.util.find_spec("playwright") is not None
    require(ok, "chromium + playwright (apt-get install chromium; pip install playwright)")


@pytest.fixture(scope="module")
def pool():
    _require_browser()
    from envs.browser.pool import BrowserPool

    p = BrowserPool()
    yield p
    p.close()


@pytest.fixture
def env(pool):
    from envs.browser.env import BrowserEnv

    e = BrowserEnv(pool=pool)
    yield e
    e.close()


def check_png(png: bytes, size: tuple[int, int]) -> None:
    """A PNG a person can open: it decodes, has the viewport's size and shows more than a blank page."""
    from PIL import Image

    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    img = Image.open(io.BytesIO(png))
    img.load()
    assert img.size == size
    assert len(img.convert("RGB").getcolors(maxcolors=1 << 20) or []) > 2


def play_expert(env, seed: int, task_type: str) -> tuple[float, dict, list[bytes]]:
    from envs.browser.tasks import expert_action

    obs, info = env.reset(seed=seed, options={"task_type": task_type})
    images = list(info["images"])
    history: list[tuple[str, str]] = []
    while True:
        action = expert_action(env, history)
        obs, reward, terminated, truncated, info = env.step(action)
        images += info["images"]
        history.append((action, obs))
        if terminated or truncated:
            return reward, info, images


async def aplay_expert(env, seed: int, task_type: str) -> float:
    from envs.browser.tasks import expert_action

    await env.areset(seed=seed, options={"task_type": task_type})
    history: list[tuple[str, str]] = []
    while True:
        action = expert_action(env, history)
        obs, reward, terminated, truncated, info = await env.astep(action)
        history.append((action, obs))
        if terminated or truncated:
            return reward


@pytest.mark.parametrize("task_type", ["shop_buy", "shop_cheapest", "form", "todo"])
def test_expert_solves_every_task_type(env, task_type, tmp_path):
    reward, info, images = play_expert(env, seed=3, task_type=task_type)
    assert reward == 1.0 and info["success"], info
    assert all(info["checks"].values())
    for i, png in enumerate(images):
        check_png(png, (800, 600))
        (tmp_path / f"{task_type}-{i}.png").write_bytes(png)


def test_async_twin_solves_tasks_concurrently(pool):
    from envs.browser.env import BrowserEnv

    envs_ = [BrowserEnv(pool=pool) for _ in range(2)]
    try:

        async def both():
            return await asyncio.gather(aplay_expert(envs_[0], 11, "form"), aplay_expert(envs_[1], 12, "todo"))

        assert asyncio.run(both()) == [1.0, 1.0]
    finally:
        for e in envs_:
            e.close()


def test_doing_nothing_fails_from_the_server_state(env):
    env.reset(seed=5, options={"task_type": "shop_buy"})
    _, reward, terminated, _, info = env.step(answer_action("done"))
    assert terminated and reward == 0.0 and not info["success"]
    assert info["checks"]["orders"] is False


def test_check_env_passes(env):
    from envs.checker import check_agent_env

    check_agent_env(env)


def test_navigation_outside_the_origin_is_refused(env):
    from envs.browser.tasks import find_ref

    obs, _ = env.reset(seed=1, options={"task_type": "shop_buy"})
    out, reward, terminated, _, _ = env.step(tool_action("goto", {"url": "https://example.com/"}))
    assert out.startswith("Error: navigation to 'https://example.com/' refused") and not terminated
    ref = find_ref(obs, "link", "Partner deals")
    assert ref is not None
    out, *_ = env.step(tool_action("click", {"ref": ref}))
    assert "Refused (outside this site): https://partner.example.com/deals" in out
    out, *_ = env.step(tool_action("goto", {"url": "/todo"}))
    assert out.startswith("URL: /todo")


def test_bad_refs_and_keys_are_error_observations(env):
    env.reset(seed=2, options={"task_type": "todo"})
    out, *_ = env.step(tool_action("click", {"ref": "e9999"}))
    assert out.startswith("Error: no element with ref 'e9999'")
    out, *_ = env.step(tool_action("press", {"key": "NoSuchKey"}))
    assert out.startswith("Error: press failed")
    out, *_ = env.step(tool_action("type", {"ref": "e1"}))
    assert out.startswith("Error: tool 'type' is missing required argument(s): text")


def test_reused_page_shows_the_same_refs_and_no_history(env):
    """The page is kept across episodes: refs still count from the episode's first document, a ref of an earlier
    document is an error, and "back" cannot reach the last episode."""
    from envs.browser.tasks import find_ref

    first, _ = env.reset(seed=4, options={"task_type": "shop_buy"})
    env.step(tool_action("goto", {"url": "/todo"}))
    again, _ = env.reset(seed=4, options={"task_type": "shop_buy"})
    assert again == first and "[ref=e1]" in first
    out, *_ = env.step(tool_action("back", {}))
    assert out.startswith("Error: there is no previous page"), out[:200]
    ref = find_ref(first, "link", "Todo")
    out, *_ = env.step(tool_action("click", {"ref": ref}))
    assert out.startswith("URL: /todo") and "[ref=f1e1]" in out
    out, *_ = env.step(tool_action("click", {"ref": ref}))  # the shop page's ref, on the todo page
    assert out.startswith(f"Error: no element with ref '{ref}'"), out[:200]


def test_reused_context_has_its_state_wiped(pool):
    from envs.browser.apps import WebApps

    apps = WebApps()

    async def scenario():
        origin = await apps.start()
        first = await pool.acquire(origin)
        page = await first.context.new_page()
        await page.goto(origin + "/todo")
        await page.evaluate("document.cookie = 'k=v'; localStorage.setItem('k', 'v')")
        await pool.release(first)
        second = await pool.acquire(origin)
        assert second.context is first.context  # reused, not a new context
        page = await second.context.new_page()
        await page.goto(origin + "/todo")
        seen = await page.evaluate("[document.cookie, localStorage.getItem('k')]")
        await pool.release(second)
        await apps.stop()
        return seen

    assert pool.loop.run(scenario(), 60) == ["", None]


def test_pool_runs_the_headless_shell_when_installed(pool):
    """Setup installs Debian's chromium-headless-shell: ~2.5x less CPU per step than full chromium (decisions.md)."""
    from pathlib import Path

    from envs.browser.pool import HEADLESS_SHELL

    require(Path(HEADLESS_SHELL).exists(), "chromium-headless-shell (apt-get install chromium-headless-shell)")
    apps_origin = "http://127.0.0.1:9"  # never visited: acquiring only needs the browser up
    lease = pool.loop.run(pool.acquire(apps_origin), 60)
    pool.loop.run(pool.release(lease), 60)
    assert pool.executable == HEADLESS_SHELL
    assert Path(f"/proc/{pool.browser_pid}/exe").resolve() == Path(HEADLESS_SHELL).resolve()
