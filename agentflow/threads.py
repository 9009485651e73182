"""An executor of daemon threads for the job's event loop.

Envs run blocking work (tool calls, verifiers, resets) with ``asyncio.to_thread``. With asyncio's default executor a
call that never returns also blocks the job's exit, twice: ``asyncio.run`` joins the executor's threads when the
loop closes, and the interpreter joins them again at exit. A step that outlives its timeout is abandoned by the
rollout layer; with this executor its thread is a daemon that nobody waits for, so the job goes on and ends.

Worker threads live as long as the process: some callers start child processes that die with the thread that
started them (Ray starts its GCS and raylet with a parent-death signal), so a thread may not end after its call.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class DaemonExecutor(ThreadPoolExecutor):
    """Daemon worker threads that never exit, started on demand (a call never waits behind a stuck one while
    fewer than ``max_threads`` exist); shutdown never waits for running calls.

    A ``ThreadPoolExecutor`` only in name (asyncio accepts no other kind as a loop's default executor): none of its
    pooled, joined-at-exit workers is ever started.
    """

    def __init__(self, max_threads: int = 64) -> None:
        super().__init__(max_workers=1)
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._max, self._threads, self._idle, self._pending = max_threads, 0, 0, 0
        self._closed = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        if self._closed:
            raise RuntimeError("cannot submit to a DaemonExecutor after shutdown")
        future: Future = Future()
        with self._lock:
            self._pending += 1
            if self._pending > self._idle and self._threads < self._max:
                self._threads += 1
                threading.Thread(target=self._work, daemon=True, name=f"agentflow-io-{self._threads}").start()
        self._calls.put((future, fn, args, kwargs))
        return future

    def _work(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            future, fn, args, kwargs = self._calls.get()
            with self._lock:
                self._idle -= 1
                self._pending -= 1
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting caller
                future.set_exception(e)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop taking calls; never waits for running ones (a hung tool call must not hold the job)."""
        self._closed = True


def use_daemon_threads() -> None:
    """Make the running loop's default executor (``asyncio.to_thread``) a :class:`DaemonExecutor`."""
    asyncio.get_running_loop().set_default_executor(DaemonExecutor())
