"""``agentflow/Browser-v0``: web tasks in the shipped apps, driven through Playwright and the system Chromium.

Observation: the page's path and title, then its ARIA snapshot with element refs (``[ref=e12]``) as text, plus a
PNG screenshot in the info's ``"images"``. Tools: ``click(ref)``, ``type(ref, text, submit)``, ``press(key)``,
``goto(url)``, ``scroll(direction)``, ``back()``; answering (any text) ends the episode and the verifier reads the
app's server state. Requests outside the episode's origin are refused (``goto`` says so; a link the page follows
is aborted and reported). A browser that dies mid-episode raises :class:`~envs.errors.EnvCrashedError`.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urljoin, urlsplit

from envs.browser.apps import WebApps
from envs.browser.pool import BrowserPool, Lease, origin_of
from envs.browser.tasks import TASK_TYPES, BrowserTask, check_state, make_task
from envs.core import ToolSpec
from envs.errors import ActionError, EnvCrashedError, EnvError
from envs.screen import ScreenEnv
from envs.tasks import DEFAULT_TASK_SET, lookup_task_set, simple_task_set

ACTION_TIMEOUT_MS = 5000
_SNAPSHOT_REF = re.compile(r"\[ref=(?:f(\d+))?e(\d+)\]")
_ACTION_REF = re.compile(r"(?:f(\d+))?e(\d+)")
SYSTEM_PROMPT = (
    "You operate a web browser to complete a task on a local website. Each observation shows the page's path, "
    "title and accessibility tree; elements carry refs like [ref=e5]. Act with the tools (refs change when the "
    "page changes: use the latest observation). When the task is complete, answer 'done'."
)


def _spec(name: str, description: str, props: dict[str, Any], required: list[str]) -> ToolSpec:
    params = {"type": "object", "properties": props, "required": required, "additionalProperties": False}
    return ToolSpec(name, description, params)


_REF = {"type": "string", "description": "the element's ref from the latest observation, e.g. e12"}
TOOLS = [
    _spec("click", "Click an element.", {"ref": _REF}, ["ref"]),
    _spec(
        "type",
        "Replace the text of a text field; with submit=true, press Enter afterwards.",
        {"ref": _REF, "text": {"type": "string"}, "submit": {"type": "boolean", "default": False}},
        ["ref", "text"],
    ),
    _spec("press", "Press a key or combination, e.g. Enter, Tab, Control+A.", {"key": {"type": "string"}}, ["key"]),
    _spec("goto", "Open a page of this site, e.g. /shop.", {"url": {"type": "string"}}, ["url"]),
    _spec("scroll", "Scroll the page.", {"direction": {"type": "string", "enum": ["up", "down"]}}, ["direction"]),
    _spec("back", "Go back to the previous page.", {}, []),
]


class BrowserEnv(ScreenEnv):
    """Web tasks (:data:`~envs.browser.tasks.TASK_TYPES`) with a Playwright context leased from a pool.

    ``pool``: a :class:`BrowserPool` to share (default: the process-wide one). ``reset(options={"task_type": ...})``
    forces a task type. ``last_observation`` is the latest text observation (the scripted expert reads refs there).
    """

    branching = "replay"  # a fresh page per episode, its content from the seed

    tools = TOOLS
    system_prompt = SYSTEM_PROMPT
    max_turns = 16
    task_sets = {"default": simple_task_set(task_types=TASK_TYPES, description="shop, sign-up form and todo tasks")}
    max_observation_chars = 16384

    def __init__(
        self,
        max_turns: int | None = None,
        split: str = "train",
        task_set: str = DEFAULT_TASK_SET,
        pool: BrowserPool | None = None,
    ) -> None:
        super().__init__(max_turns=max_turns)
        lookup_task_set(self.task_sets, task_set, type(self).__name__).seed_range(split)  # validates both
        self.split, self.task_set = split, task_set
        self._shared_pool = pool is None
        self.pool = BrowserPool.shared() if pool is None else pool
        self.apps = WebApps()
        self.task: BrowserTask | None = None
        self.last_observation = ""
        self._lease: Lease | None = None
        self._page: Any = None
        self._frame_base: int | None = None  # see _episode_refs
        self._frames: set[int] = set()
        self._checks: dict[str, bool] = {}
        self._closed = False
        self._apps_loop: Any = None
        """The loop the web apps serve on (the pool's, unless it was replaced since)."""

    @property
    def backend(self) -> Any:
        """The pool's loop (the browser and this env's web server live there)."""
        return self.pool.loop

    # -- episode -----------------------------------------------------------------------------------------------
    async def areset_task(self, seed: int, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Draw the task, reset the app's state, lease a clean context and open the start page."""
        info = self.draw_task(seed, options, make_task)
        if self._apps_loop is not self.pool.loop:  # first episode, or the pool's loop was replaced
            self.apps = WebApps()
            await self.apps.start()
            self._apps_loop = self.pool.loop
        self.apps.reset(self.task.catalog, list(self.task.todos))
        await self._release()
        self._lease = await self.pool.acquire(self.apps.origin)
        lease = self._lease
        try:
            self._page = await lease.ensure_page()
            self._frame_base = None
            await self._page.goto(self.apps.origin + self.task.start_path, timeout=ACTION_TIMEOUT_MS * 4)
            await lease.forget_history()
        except Exception as e:  # noqa: BLE001 - a crash is re-raised as such; anything else is a broken backend
            self._raise_if_crashed(e)
            raise EnvError(f"could not open the start page: {e}") from e
        return f"Task: {self.task.prompt}\n{await self._observe()}", info

    async def atool(self, name: str, arguments: dict[str, Any]) -> str:
        """Run a browser tool, then observe the page."""
        if self._page is None or self._lease is None:
            raise EnvError("no page: call reset() first")
        self._raise_if_crashed(None)
        action: Callable[[dict[str, Any]], Awaitable[None]] = getattr(self, f"_do_{name}")
        try:
            await action(arguments)
            await self._page.wait_for_load_state("load", timeout=ACTION_TIMEOUT_MS)
        except ActionError:
            raise
        except Exception as e:  # noqa: BLE001 - Playwright errors: a dead browser, or an action that failed
            self._raise_if_crashed(e)
            raise ActionError(f"{name} failed: {_first_line(e)}") from e
        return await self._observe()

    async def ascore(self, text: str) -> tuple[float, bool]:
        """1.0 when every goal condition holds in the app's server state."""
        if self.task is None:
            raise EnvError("no task: call reset() first")
        self._raise_if_crashed(None)  # the state may be intact, but an episode whose browser died is not scored
        self._checks = check_state(self.task, self.apps.state)
        ok = all(self._checks.values())
        return (1.0 if ok else 0.0), ok

    def answer_info(self) -> dict[str, Any]:
        """Which goal conditions held."""
        return {"checks": dict(self._checks)}

    # -- tools -------------------------------------------------------------------------------------------------
    async def _element(self, ref: str) -> Any:
        page_ref = self._page_ref(ref)
        loc = self._page.locator(f"aria-ref={page_ref}") if page_ref else None
        if loc is None or await loc.count() == 0:
            raise ActionError(f"no element with ref {ref!r} on this page; refs change when the page changes")
        return loc

    async def _do_click(self, args: dict[str, Any]) -> None:
        await (await self._element(args["ref"])).click(timeout=ACTION_TIMEOUT_MS)

    async def _do_type(self, args: dict[str, Any]) -> None:
        loc = await self._element(args["ref"])
        await loc.fill(args["text"], timeout=ACTION_TIMEOUT_MS)
        if args.get("submit"):
            await loc.press("Enter", timeout=ACTION_TIMEOUT_MS)

    async def _do_press(self, args: dict[str, Any]) -> None:
        await self._page.keyboard.press(args["key"])

    async def _do_goto(self, args: dict[str, Any]) -> None:
        url = urljoin(self.apps.origin + "/", args["url"].strip())
        if urlsplit(url).scheme not in ("http", "https") or origin_of(url) != self.apps.origin:
            raise ActionError(f"navigation to {args['url']!r} refused: only this site's pages (e.g. /shop) are allowed")
        await self._page.goto(url, timeout=ACTION_TIMEOUT_MS)

    async def _do_scroll(self, args: dict[str, Any]) -> None:
        dy = 500 if args["direction"] == "down" else -500
        await self._page.mouse.wheel(0, dy)

    async def _do_back(self, args: dict[str, Any]) -> None:
        if await self._page.go_back(timeout=ACTION_TIMEOUT_MS) is None:
            raise ActionError("there is no previous page")

    # -- observation and crashes -------------------------------------------------------------------------------
    async def _observe(self) -> str:
        """Path, title, refused requests and the ARIA snapshot; the screenshot goes to the info."""
        page, lease = self._page, self._lease
        try:
            snapshot = await page.aria_snapshot(mode="ai", timeout=ACTION_TIMEOUT_MS)
            title = await page.title()
            self.add_image(await lease.screenshot())
        except Exception as e:  # noqa: BLE001 - see atool
            self._raise_if_crashed(e)
            raise EnvError(f"could not observe the page: {_first_line(e)}") from e
        origin = self.apps.origin
        url = page.url
        where = url[len(origin) :] or "/" if url.startswith(origin) else url
        lines = [f"URL: {where}", f"Title: {title}"]
        refused = lease.take_blocked() if lease is not None else []
        if refused:
            lines.append("Refused (outside this site): " + ", ".join(refused))
        text = "\n".join(lines) + "\n" + self._episode_refs(snapshot).replace(origin, "")
        self.last_observation = text
        return text

    # Playwright names refs after the page's frame sequence number (``f12e5``: element 5 of the page's 12th
    # document), and the page is reused across episodes, so the same task would show different refs in each
    # episode. Observations count documents from the episode's first one instead (``e5``, then ``f1e5`` after a
    # navigation), and actions map them back: same refs for the same task, and a stale ref stays an error.
    # The documents of the latest observation are the only ones a ref may name (every tool call observes again).
    def _episode_refs(self, snapshot: str) -> str:
        self._frames = set()

        def relative(m: re.Match[str]) -> str:
            seq = int(m.group(1) or 0)
            if self._frame_base is None:
                self._frame_base = seq
            self._frames.add(seq)
            rel = seq - self._frame_base
            return f"[ref={f'f{rel}' if rel else ''}e{m.group(2)}]" if rel >= 0 else m.group(0)

        return _SNAPSHOT_REF.sub(relative, snapshot)

    def _page_ref(self, ref: str) -> str | None:
        """Playwright's name for an observation's ref, or None when it names no document of the latest one."""
        m = _ACTION_REF.fullmatch(ref.strip())
        if m is None or self._frame_base is None:
            return None
        seq = int(m.group(1) or 0) + self._frame_base
        return f"{f'f{seq}' if seq else ''}e{m.group(2)}" if seq in self._frames else None

    def _raise_if_crashed(self, cause: BaseException | None) -> None:
        lease = self._lease
        if lease is not None and not self.pool.browser_alive(lease.generation):
            reason = f"the browser (pid {self.pool.browser_pid}) died"
            raise EnvCrashedError(reason + (f": {_first_line(cause)}" if cause else "")) from cause
        if lease is not None and lease.crashed:
            raise EnvCrashedError("the page's renderer crashed") from cause

    async def _release(self) -> None:
        lease, self._lease, self._page = self._lease, None, None
        if lease is not None:
            await self.pool.release(lease)

    def recover_backend(self) -> None:
        """The pool's loop stopped answering: drop this episode's context; if the loop still does not answer,
        restart the pool (a new loop and browser; the next reset starts the web apps again on it)."""
        lease, self._lease, self._page = self._lease, None, None
        try:
            if lease is not None:
                self.pool.loop.run(_close_context(lease), 5)
            else:
                self.pool.loop.run(asyncio.sleep(0), 5)
        except Exception:  # noqa: BLE001 - still blocked (or closed): a new loop
            self.pool.restart()

    def close(self) -> None:
        """Give the context back, stop the web apps, let go of the pool. Safe to call twice, and after a backend
        that stopped answering."""
        if self._closed:
            return
        self._closed = True
        if self.pool.loop.alive and self._apps_loop is self.pool.loop:

            async def _shutdown() -> None:
                await self._release()
                await self.apps.stop()

            try:
                self.pool.loop.run(_shutdown(), 5 if self._wedged else 30)
            except Exception:  # noqa: BLE001 - a loop that does not answer: the pool kills its browser
                self.pool.restart()
        if self._shared_pool:
            BrowserPool.unshare(self.pool)
        super().close()


async def _close_context(lease: Lease) -> None:
    try:
        await lease.context.close()
    except Exception:  # noqa: BLE001 - a context of a dead browser
        pass


def _first_line(e: BaseException | None) -> str:
    text = str(e or "").strip().splitlines()
    return text[0] if text else type(e).__name__
