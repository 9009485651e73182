"""The base of screen environments (browser, desktop): a backend event loop, async-native steps, screenshots.

A screen env's backend (Playwright, an X server and its apps) lives on one background asyncio loop
(:class:`LoopThread`). Every operation is a coroutine run there: the sync Gymnasium API blocks on it, the async twin
awaits it without holding a thread, so a paused episode waiting on a page load costs no inference slot.

Each observation is text (for text-only models) plus PNG screenshots, returned in the info under ``"images"``
(the white-box agent stores them in the trajectory's turns). A dead backend raises
:class:`~envs.errors.EnvCrashedError`, which ends the episode as ``error``; the next reset brings up a new one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import gymnasium

from envs.core import AgentEnv
from envs.errors import EnvError
from envs.tasks import lookup_task_set

T = TypeVar("T")


class LoopThread:
    """An asyncio loop on a daemon thread; coroutines are submitted from any thread or any other loop."""

    def __init__(self, name: str = "agentflow-screen") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop."""
        if not self.alive:
            coro.close()
            raise EnvError("the backend loop is closed")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and block until it finishes (never call this from the loop itself)."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise EnvError("LoopThread.run called from its own loop (it would deadlock); await the coroutine instead")
        return self.submit(coro).result(timeout)

    async def arun(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` running on the loop, from another event loop (no thread is held while it waits)."""
        if asyncio.get_running_loop() is self.loop:
            return await coro
        return await asyncio.wrap_future(self.submit(coro))

    @property
    def alive(self) -> bool:
        """True until :meth:`stop`."""
        return self._thread.is_alive() and not self.loop.is_closed()

    def stop(self) -> None:
        """Stop the loop and join the thread (pending tasks are cancelled)."""
        if not self.alive:
            return

        async def _cancel_rest() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(_cancel_rest(), self.loop).result(10)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self.loop.close()


class ScreenEnv(AgentEnv):
    """An :class:`AgentEnv` whose tools, resets and verifiers are coroutines on a backend :class:`LoopThread`.

    Subclasses implement :meth:`areset_task`, :meth:`atool` and :meth:`ascore` (all run on :attr:`backend`) and
    call :meth:`add_image` with each screenshot they take; the step's (or reset's) info then carries
    ``"images": [png bytes, ...]``.
    """

    step_timeout_s: float = 60.0
    """Upper bound on one backend operation seen from the sync API (a hung backend must not hang a caller)."""
    split: str = "train"
    task_set: str = "default"
    task: Any = None
    """The current episode's task (see :meth:`draw_task`)."""

    def __init__(self, max_turns: int | None = None) -> None:
        super().__init__(max_turns=max_turns)
        self._images: list[bytes] = []

    # -- what subclasses implement -----------------------------------------------------------------------------
    @property
    def backend(self) -> LoopThread:
        """The loop the backend lives on."""
        raise NotImplementedError

    async def areset_task(self, seed: int, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Start the task of ``seed`` (on the backend loop): first text observation and info."""
        raise NotImplementedError

    async def atool(self, name: str, arguments: dict[str, Any]) -> str:
        """Run a tool (on the backend loop); raise :class:`EnvError` for an action that cannot be done."""
        raise NotImplementedError

    async def ascore(self, text: str) -> tuple[float, bool]:
        """Reward and success, read from the app's state (on the backend loop)."""
        raise NotImplementedError

    # -- helpers for subclasses --------------------------------------------------------------------------------
    def draw_task(self, seed: int, options: dict[str, Any], make: Callable[[int, str, str | None], Any]) -> dict:
        """Draw the episode's task (``make(task_seed, split, task_type)``) from the options' split and task set
        (default: the env's ``split`` and ``task_set``) into ``self.task``; returns the reset info's task fields."""
        split = options.get("split", self.split)
        set_name = options.get("task_set", self.task_set)
        ts = lookup_task_set(self.task_sets, set_name, type(self).__name__).task_seed(seed, split)
        self.task = make(ts, split, options.get("task_type"))
        self._checks = {}
        return {"task_id": self.task.task_id, "task_type": self.task.task_type, "split": split, "seed": ts,
                "task_set": set_name}  # fmt: skip

    def add_image(self, png: bytes) -> None:
        """Attach a screenshot to the current step's info."""
        self._images.append(png)

    # -- AgentEnv hooks: sync versions block on the backend loop, async versions await it ----------------------
    def reset_task(self, seed: int, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Blocking :meth:`areset_task`."""
        return self.backend.run(self.areset_task(seed, options), self.step_timeout_s)

    def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        """Blocking :meth:`atool`."""
        return self.backend.run(self.atool(name, arguments), self.step_timeout_s)

    async def acall_tool(self, name: str, arguments: dict[str, Any]) -> str:
        """:meth:`atool`, awaited."""
        return await self.backend.arun(self.atool(name, arguments))

    def score_answer(self, text: str) -> tuple[float, bool]:
        """Blocking :meth:`ascore`."""
        return self.backend.run(self.ascore(text), self.step_timeout_s)

    async def ascore_answer(self, text: str) -> tuple[float, bool]:
        """:meth:`ascore`, awaited."""
        return await self.backend.arun(self.ascore(text))

    # -- Gymnasium API with images ----------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Start an episode; the info carries the first screenshot(s) under ``"images"``."""
        self._images = []
        obs, info = super().reset(seed=seed, options=options)
        return obs, self._with_images(info)

    async def areset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        """Awaitable :meth:`reset`: the same bookkeeping, with the backend awaited instead of a blocked thread."""
        self._images = []
        gymnasium.Env.reset(self, seed=seed)
        task_seed = seed if seed is not None else int(self.np_random.integers(0, 2**31 - 1))
        obs, info = await self.backend.arun(self.areset_task(task_seed, dict(options or {})))
        missing = {"task_id", "task_type", "split"} - set(info)
        if missing:
            raise EnvError(f"{type(self).__name__}.areset_task info lacks {sorted(missing)}")
        self._task_info = {k: info[k] for k in ("task_id", "task_type", "split")}
        self._turn, self._done = 0, False
        return self._clip(obs), self._with_images(dict(info))

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """One action; the info carries the screenshot(s) taken after it under ``"images"``."""
        self._images = []
        obs, reward, terminated, truncated, info = super().step(action)
        return obs, reward, terminated, truncated, self._with_images(info)

    async def astep(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Awaitable :meth:`step`."""
        self._images = []
        obs, reward, terminated, truncated, info = await super().astep(action)
        return obs, reward, terminated, truncated, self._with_images(info)

    def _with_images(self, info: dict[str, Any]) -> dict[str, Any]:
        images, self._images = self._images, []
        return {**info, "images": images}
