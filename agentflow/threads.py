"""An executor of daemon threads for the job's event loop.

Envs run blocking work (tool calls, verifiers, resets) with ``asyncio.to_thread``. With asyncio's default executor a
call that never returns also blocks the job's exit, twice: ``asyncio.run`` joins the executor's threads when the
loop closes, and the interpreter joins them again at exit. A step that outlives its timeout is abandoned by the
rollout layer; with this executor its thread is a daemon that nobody waits for, so the job goes on and ends.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class DaemonExecutor(ThreadPoolExecutor):
    """Each call in a daemon thread of its own; at most ``max_threads`` run at once (the rest wait their turn).

    A ``ThreadPoolExecutor`` only in name (asyncio accepts no other kind as a loop's default executor): none of its
    pooled, joined-at-exit workers is ever started.
    """

    def __init__(self, max_threads: int = 64) -> None:
        super().__init__(max_workers=1)
        self._slots = threading.BoundedSemaphore(max_threads)
        self._closed = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        if self._closed:
            raise RuntimeError("cannot submit to a DaemonExecutor after shutdown")
        future: Future = Future()

        def run() -> None:
            with self._slots:
                if not future.set_running_or_notify_cancel():
                    return
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as e:  # noqa: BLE001 - handed to the awaiting caller
                    future.set_exception(e)

        threading.Thread(target=run, daemon=True, name="agentflow-io").start()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop taking calls; never waits for running ones (a hung tool call must not hold the job)."""
        self._closed = True


def use_daemon_threads() -> None:
    """Make the running loop's default executor (``asyncio.to_thread``) a :class:`DaemonExecutor`."""
    asyncio.get_running_loop().set_default_executor(DaemonExecutor())
