"""The base of screen environments (browser, desktop): a backend event loop, async-native steps, screenshots.

A screen env's backend (Playwright, an X server and its apps) lives on one background asyncio loop
(:class:`LoopThread`). Every operation is a coroutine run there: the sync Gymnasium API blocks on it, the async twin
awaits it without holding a thread, so a paused episode waiting on a page load costs no inference slot.

Each observation is text (for text-only models) plus PNG screenshots, returned in the info under ``"images"``
(the white-box agent stores them in the trajectory's turns). A dead backend raises
:class:`~envs.errors.EnvCrashedError`, which ends the episode as ``error``; the next reset brings up a new one.

Two clocks bound an action. On the backend loop, a tool call that runs past ``action_timeout_s`` is cancelled and
answered with an ``"Error: ..."`` observation (the episode goes on). Seen from the caller, a backend that does not
answer within ``step_timeout_s`` at all (its loop blocked) raises :class:`~envs.errors.EnvCrashedError`, and the
next reset replaces the backend (:meth:`ScreenEnv.recover_backend`). Screen envs still open at interpreter exit are
closed then, so their loops, apps, X servers and browsers never outlive the process.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import threading
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import gymnasium

from envs.core import AgentEnv
from envs.errors import ActionError, EnvCrashedError, EnvError
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
        """Run ``coro`` on the loop and block until it finishes (never call this from the loop itself).

        Past ``timeout`` the coroutine is cancelled and :class:`BackendTimeoutError` is raised.
        """
        if threading.current_thread() is self._thread:
            coro.close()
            raise EnvError("LoopThread.run called from its own loop (it would deadlock); await the coroutine instead")
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            if fut.done():  # the coroutine's own TimeoutError
                raise
            fut.cancel()
            raise BackendTimeoutError(f"the backend did not answer within {timeout:g} s") from None

    async def arun(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Await ``coro`` running on the loop, from another event loop (no thread is held while it waits).

        Past ``timeout`` the coroutine is cancelled and :class:`BackendTimeoutError` is raised.
        """
        if asyncio.get_running_loop() is self.loop:
            return await coro
        fut = self.submit(coro)
        scope = asyncio.timeout(timeout)
        try:
            async with scope:
                return await asyncio.wrap_future(fut)
        except TimeoutError:
            if not scope.expired():
                raise
            fut.cancel()
            raise BackendTimeoutError(f"the backend did not answer within {timeout:g} s") from None

    @property
    def alive(self) -> bool:
        """True until :meth:`stop`."""
        return self._thread.is_alive() and not self.loop.is_closed()

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the loop, join the thread and close the loop (pending tasks are cancelled); False when the thread
        did not come back within ``timeout`` (a blocked loop: it is left to its daemon thread)."""
        if not self.alive:
            return True

        async def _cancel_rest() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.get_running_loop().shutdown_asyncgens()
            await asyncio.get_running_loop().shutdown_default_executor()

        try:
            asyncio.run_coroutine_threadsafe(_cancel_rest(), self.loop).result(timeout)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        self.loop.close()
        return True


class BackendTimeoutError(TimeoutError):
    """A backend coroutine that did not finish within the caller's timeout (it was cancelled)."""


_open_envs: weakref.WeakSet[ScreenEnv] = weakref.WeakSet()


@atexit.register
def _close_open_envs() -> None:
    """Close the screen envs still open at interpreter exit (their loops, apps, X servers and browsers)."""
    for env in list(_open_envs):
        try:
            env.close()
        except Exception:  # noqa: BLE001 - exiting: close the others anyway
            pass


class ScreenEnv(AgentEnv):
    """An :class:`AgentEnv` whose tools, resets and verifiers are coroutines on a backend :class:`LoopThread`.

    Subclasses implement :meth:`areset_task`, :meth:`atool` and :meth:`ascore` (all run on :attr:`backend`) and
    call :meth:`add_image` with each screenshot they take; the step's (or reset's) info then carries
    ``"images": [png bytes, ...]``.
    """

    action_timeout_s: float = 30.0
    """One tool call on the backend loop: past it the call is cancelled and answered with an error observation."""
    step_timeout_s: float = 60.0
    """Upper bound on one backend operation seen from the caller (a hung backend must not hang a caller): past it
    the call raises :class:`~envs.errors.EnvCrashedError` and the next reset replaces the backend."""
    split: str = "train"
    task_set: str = "default"
    task: Any = None
    """The current episode's task (see :meth:`draw_task`)."""

    def __init__(self, max_turns: int | None = None) -> None:
        super().__init__(max_turns=max_turns)
        self._images: list[bytes] = []
        self._wedged: str | None = None
        """Why the backend stopped answering (it is replaced at the next reset), or None."""
        _open_envs.add(self)

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

    def recover_backend(self) -> None:
        """Replace a backend that stopped answering (called from the caller's thread before the next reset)."""
        raise EnvCrashedError(f"{type(self).__name__} cannot replace its backend")

    # -- helpers for subclasses --------------------------------------------------------------------------------
    def draw_task(self, seed: int, options: dict[str, Any], make: Callable[[int, str, str | None], Any]) -> dict:
        """Draw the episode's task (``make(task_seed, split, task_type)``) from the options' split and task set
        (default: the env's ``split`` and ``task_set``) into ``self.task``; returns the reset info's task fields."""
        split = options.get("split", self.split)
        set_name = options.get("task_set", self.task_set)
        ts = lookup_task_set(self.task_sets, set_name, type(self).__name__).task_seed(seed, split)
        self.task = make(ts, split, options.get("task_type"))
        self._checks: dict[str, bool] = {}
        return {"task_id": self.task.task_id, "task_type": self.task.task_type, "split": split, "seed": ts,
                "task_set": set_name}  # fmt: skip

    def add_image(self, png: bytes) -> None:
        """Attach a screenshot to the current step's info."""
        self._images.append(png)

    # -- AgentEnv hooks: sync versions block on the backend loop, async versions await it ----------------------
    def reset_task(self, seed: int, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Blocking :meth:`areset_task` (after replacing a backend that stopped answering)."""
        if self._wedged is not None:
            self._recover()
        return self._blocking(self.areset_task(seed, options))

    def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        """Blocking :meth:`atool`, cancelled after ``action_timeout_s``."""
        return self._blocking(self._bounded(name, arguments))

    async def acall_tool(self, name: str, arguments: dict[str, Any]) -> str:
        """:meth:`atool`, awaited, cancelled after ``action_timeout_s``."""
        return await self._awaiting(self._bounded(name, arguments))

    def score_answer(self, text: str) -> tuple[float, bool]:
        """Blocking :meth:`ascore`."""
        return self._blocking(self.ascore(text))

    async def ascore_answer(self, text: str) -> tuple[float, bool]:
        """:meth:`ascore`, awaited."""
        return await self._awaiting(self.ascore(text))

    async def _bounded(self, name: str, arguments: dict[str, Any]) -> str:
        """:meth:`atool` on the backend loop; past ``action_timeout_s`` it is cancelled: an error observation."""
        scope = asyncio.timeout(self.action_timeout_s)
        try:
            async with scope:
                return await self.atool(name, arguments)
        except TimeoutError:
            if not scope.expired():
                raise
            raise ActionError(f"{name} did not finish within {self.action_timeout_s:g} s and was stopped") from None

    def _blocking(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._wedged is not None:
            coro.close()
            raise EnvCrashedError(f"{self._wedged}; reset() replaces the backend")
        try:
            return self.backend.run(coro, self.step_timeout_s)
        except BackendTimeoutError as e:
            self._wedged = f"{type(self).__name__}: {e}"
            raise EnvCrashedError(self._wedged) from None

    async def _awaiting(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._wedged is not None:
            coro.close()
            raise EnvCrashedError(f"{self._wedged}; reset() replaces the backend")
        try:
            return await self.backend.arun(coro, self.step_timeout_s)
        except BackendTimeoutError as e:
            self._wedged = f"{type(self).__name__}: {e}"
            raise EnvCrashedError(self._wedged) from None

    def _recover(self) -> None:
        self.recover_backend()
        self._wedged = None

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
        if self._wedged is not None:
            await asyncio.to_thread(self._recover)
        obs, info = await self._awaiting(self.areset_task(task_seed, dict(options or {})))
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

    def close(self) -> None:
        """Forget the env at interpreter exit (subclasses close their backend first)."""
        _open_envs.discard(self)
        super().close()

    def _with_images(self, info: dict[str, Any]) -> dict[str, Any]:
        images, self._images = self._images, []
        return {**info, "images": images}
