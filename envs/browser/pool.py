"""A pool of Playwright browser contexts in one system Chromium, reused across episodes with their state wiped.

Playwright's own browser download cannot work on our machines, so the pool launches Debian's Chromium
(``executable_path``) headless with the flags that keep it off the network. It prefers Debian's
``chromium-headless-shell`` (the same engine without the browser UI: Playwright's own default for headless runs),
which costs about 2.5x less CPU per step here than full ``chromium --headless`` (``docs/decisions.md``), and falls back
to ``chromium``. Each episode leases a context with its one page; at release the page goes back to ``about:blank``
(the page, and so its renderer process, is kept), cookies, storage and permissions are wiped, and it waits for the
next episode.
A lease's route handler refuses every request outside the episode's allowed origin.

A crashed browser is seen through ``Browser.is_connected()``; leases of a dead browser are dropped and the next
:meth:`BrowserPool.acquire` launches a new one.
"""

from __future__ import annotations

import base64
import os
import signal
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from envs.errors import EnvError
from envs.screen import LoopThread

HEADLESS_SHELL = "/usr/lib/chromium/chromium-headless-shell"  # the binary itself: /usr/bin's wrapper does not exec
CHROMIUM = "/usr/bin/chromium"


def default_executable() -> str:
    """Debian's headless shell when installed, else Debian's ``chromium``."""
    return HEADLESS_SHELL if Path(HEADLESS_SHELL).exists() else CHROMIUM


CHROMIUM_FLAGS = (
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-extensions",
    "--mute-audio",
)
VIEWPORT = {"width": 800, "height": 600}
_LOCAL_SCHEMES = ("about", "data", "blob")


def origin_of(url: str) -> str:
    """``scheme://host[:port]`` of ``url`` (lower case)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}".lower()


@dataclass
class Lease:
    """One episode's browser context and the origin it may visit."""

    context: Any
    generation: int
    allowed_origin: str = ""
    blocked: list[str] = field(default_factory=list)
    """URLs refused since the last :meth:`take_blocked` (requests outside ``allowed_origin``)."""
    visited: set[str] = field(default_factory=set)
    page: Any = None
    """The context's page, kept across episodes (on ``about:blank`` between them): a new page costs a new renderer
    process, which was 40% of an episode's CPU (``docs/decisions.md``)."""
    crashed: bool = False
    """The page's renderer crashed (set by its ``crash`` event); a crashed lease is closed, not reused."""

    cdp: Any = None
    """A CDP session on :attr:`page` (history and storage resets, screenshots)."""

    async def ensure_page(self) -> Any:
        """The lease's page, made on first use."""
        if self.page is None or self.page.is_closed():
            self.page = await self.context.new_page()
            self.crashed = False
            self.page.on("crash", lambda _page: setattr(self, "crashed", True))
            self.cdp = await self.context.new_cdp_session(self.page)
        return self.page

    async def forget_history(self) -> None:
        """Drop the page's back/forward entries but the current one ("back" must not reach an earlier episode)."""
        await self.cdp.send("Page.resetNavigationHistory")

    async def screenshot(self) -> bytes:
        """A PNG of the viewport, straight from CDP with speed-optimised encoding.

        Playwright's ``page.screenshot`` adds round trips around the same capture (style injection to stop
        animations and hide the caret, font readiness); through the one Node driver and browser process that every
        env shares, those round trips were what 4 concurrent episodes queued on (docs/results.md).
        """
        shot = await self.cdp.send("Page.captureScreenshot", {"format": "png", "optimizeForSpeed": True})
        return base64.b64decode(shot["data"])

    def take_blocked(self) -> list[str]:
        """The refused URLs since the last call."""
        out, self.blocked = self.blocked, []
        return out


class BrowserPool:
    """One Chromium, many contexts; all calls are coroutines on :attr:`loop` (a :class:`LoopThread`).

    ``max_idle`` contexts are kept for reuse. The pool is safe to share between envs (``BrowserPool.shared()``
    gives a process-wide one, closed when the last env that took it lets go).
    """

    _shared: BrowserPool | None = None
    _shared_users = 0
    _shared_lock = threading.Lock()

    def __init__(self, executable: str | None = None, max_idle: int = 8, launch_timeout_s: float = 30.0) -> None:
        executable = executable or default_executable()
        if not Path(executable).exists():
            raise EnvError(
                f"Chromium not found at {executable}: install Debian's chromium-headless-shell (or chromium) "
                "(apt-get install -y chromium-headless-shell chromium); "
                "Playwright's own browser download is not used"
            )
        self.executable, self.max_idle, self.launch_timeout_s = executable, max_idle, launch_timeout_s
        self.loop = LoopThread("agentflow-browser")
        self._pw: Any = None
        self._browser: Any = None
        self._lock: Any = None  # an asyncio.Lock, made on the loop
        self._idle: list[Lease] = []
        self.generation = 0
        self.launches = 0
        self.browser_pid: int | None = None

    # -- sharing -----------------------------------------------------------------------------------------------
    @classmethod
    def shared(cls) -> BrowserPool:
        """The process-wide pool (made on first use); pair each call with :meth:`unshare`."""
        with cls._shared_lock:
            if cls._shared is None or not cls._shared.loop.alive:
                cls._shared = cls()
            cls._shared_users += 1
            return cls._shared

    @classmethod
    def unshare(cls, pool: BrowserPool) -> None:
        """Let go of the shared pool; the last user closes it."""
        with cls._shared_lock:
            if pool is not cls._shared:
                return
            cls._shared_users -= 1
            if cls._shared_users > 0:
                return
            cls._shared = None
        pool.close()

    # -- browser -----------------------------------------------------------------------------------------------
    def browser_alive(self, generation: int | None = None) -> bool:
        """True while the browser (of ``generation``, when given) is connected."""
        if generation is not None and generation != self.generation:
            return False
        return self._browser is not None and self._browser.is_connected()

    async def _ensure_browser(self) -> Any:
        import asyncio

        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self.browser_alive():
                return self._browser
            if self._browser is not None:  # it died: forget it and every context it had
                self._idle.clear()
                try:
                    await self._browser.close()
                except Exception:  # noqa: BLE001 - already dead; closing only frees driver-side objects
                    pass
            if self._pw is None:
                from playwright.async_api import async_playwright

                self._pw = await async_playwright().start()
            marker = f"--agentflow-browser={uuid.uuid4().hex}"
            self._browser = await self._pw.chromium.launch(
                executable_path=self.executable,
                headless=True,
                args=[*CHROMIUM_FLAGS, marker],
                timeout=self.launch_timeout_s * 1000,
            )
            self.generation += 1
            self.launches += 1
            self.browser_pid = _find_pid(marker)
            return self._browser

    # -- leases ------------------------------------------------------------------------------------------------
    async def acquire(self, allowed_origin: str) -> Lease:
        """A clean context whose requests are limited to ``allowed_origin`` (a new browser if the old one died)."""
        browser = await self._ensure_browser()
        while self._idle:
            lease = self._idle.pop()
            if self.browser_alive(lease.generation):
                lease.allowed_origin = origin_of(allowed_origin)
                return lease
        context = await browser.new_context(viewport=VIEWPORT, java_script_enabled=True, service_workers="block")
        lease = Lease(context, self.generation, origin_of(allowed_origin))
        await context.route("**/*", lambda route: self._route(lease, route))
        return lease

    async def _route(self, lease: Lease, route: Any) -> None:
        url = route.request.url
        scheme = urlsplit(url).scheme
        if scheme in _LOCAL_SCHEMES or origin_of(url) == lease.allowed_origin:
            if scheme not in _LOCAL_SCHEMES:
                lease.visited.add(origin_of(url))
            await route.continue_()
        else:
            lease.blocked.append(url)
            await route.abort("blockedbyclient")

    async def release(self, lease: Lease) -> None:
        """Wipe ``lease``'s context (extra pages, cookies, storage, permissions; its page goes to ``about:blank``
        with its history) and keep it for reuse (or drop it)."""
        if not self.browser_alive(lease.generation):
            return
        ctx = lease.context
        try:
            if lease.crashed:
                raise EnvError("the page's renderer crashed")
            page = await lease.ensure_page()  # also the target CDP's storage wipe needs
            for p in list(ctx.pages):
                if p is not page:
                    await p.close()
            await page.goto("about:blank")  # leaves the site: no script of the last episode keeps running
            for origin in lease.visited:
                await lease.cdp.send("Storage.clearDataForOrigin", {"origin": origin, "storageTypes": "all"})
            await ctx.clear_cookies()
            await ctx.clear_permissions()
        except Exception:  # noqa: BLE001 - a context that cannot be wiped is closed instead of reused
            await _close_quietly(ctx)
            return
        lease.visited.clear()
        lease.blocked.clear()
        lease.allowed_origin = ""
        if len(self._idle) < self.max_idle:
            self._idle.append(lease)
        else:
            await _close_quietly(ctx)

    # -- shutdown ----------------------------------------------------------------------------------------------
    async def _aclose(self) -> None:
        self._idle.clear()
        if self._browser is not None:
            await _close_quietly(self._browser)
            self._browser = None
        if self._pw is not None:
            try:
                await self._pw.stop()
            except Exception:  # noqa: BLE001 - the driver may already be gone
                pass
            self._pw = None

    def close(self, timeout: float = 30.0) -> None:
        """Close the browser and the Playwright driver, then stop the loop. Safe to call twice; a loop that does
        not answer within ``timeout`` has its browser killed instead."""
        if not self.loop.alive:
            return
        try:
            self.loop.run(self._aclose(), timeout)
        except Exception:  # noqa: BLE001 - a blocked loop or a dead driver: kill what is left
            self._kill_browser()
        finally:
            self.loop.stop(timeout=min(timeout, 10.0))

    def restart(self) -> None:
        """Replace a loop that stopped answering: kill the browser (a call blocked on it returns), close what
        answers, and start a new loop with no browser (the next :meth:`acquire` launches one). Leases of the old
        browser are dead: their envs see it at their next action, and their web apps start again on the new loop."""
        self._kill_browser()
        self.close(timeout=5.0)
        self.loop = LoopThread("agentflow-browser")
        self._pw = self._browser = self._lock = None
        self._idle = []
        self.generation += 1

    def _kill_browser(self) -> None:
        if self.browser_pid is not None:
            try:
                os.kill(self.browser_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.browser_pid = None


async def _close_quietly(obj: Any) -> None:
    try:
        await obj.close()
    except Exception:  # noqa: BLE001 - closing something already dead
        pass


def _find_pid(marker: str) -> int | None:
    """The PID of the browser's main process: the one whose command line has ``marker`` and no ``--type=``."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker.encode() in argv and not any(a.startswith(b"--type=") for a in argv):
            return int(entry)
    return None
