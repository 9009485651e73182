"""An asyncio event loop on a virtual clock, for the planner's simulations of whole jobs.

When nothing is ready the loop jumps its clock to the next timer instead of sleeping, so ``asyncio.sleep``,
``call_later`` and ``wait_for`` cost no real time and a simulated hour runs in seconds. A function handed to the
executor (``asyncio.to_thread``, as the controller loop does for training steps and weight syncs) runs inline; its
result arrives after the virtual seconds it :meth:`VirtualLoop.charge` d, or, when it returns a deferred result (an
object with a ``done`` future and a ``result``), once that future resolves: a simulated trainer step ends when its
work does, at whatever CPU share it gets, without a thread. A loop where every task waits and no timer is set can
never move again: that is reported as :class:`Stalled` rather than hanging.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable
from typing import Any


class Stalled(RuntimeError):
    """Every task waits on another and no timer is set: the simulated job can never progress."""


class _JumpSelector(selectors.DefaultSelector):
    """Never blocks: a timeout becomes a jump of the loop's virtual clock."""

    def __init__(self, loop: VirtualLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        events = super().select(0)
        if timeout is None and not events:
            raise Stalled("the simulation stalled: every task waits and no timer is set")
        if timeout and not events:
            self._loop._now += timeout
        return events


class VirtualLoop(asyncio.SelectorEventLoop):
    """The event loop of a simulation: virtual time, inline executor with charged durations."""

    def __init__(self) -> None:
        super().__init__(_JumpSelector(self))
        self._now = 0.0
        self._charged = 0.0

    def time(self) -> float:
        return self._now

    def charge(self, seconds: float) -> None:
        """Inside a function run by the executor: it takes ``seconds`` more of virtual time."""
        self._charged += max(0.0, seconds)

    def run_in_executor(self, executor: Any, func: Callable[..., Any], *args: Any) -> asyncio.Future:
        self._charged = 0.0
        fut = self.create_future()
        try:
            result = func(*args)
        except BaseException as e:  # noqa: BLE001 - delivered to the awaiting task, as a thread's would be
            fut.set_exception(e)
            return fut
        done = getattr(result, "done", None)
        if isinstance(done, asyncio.Future) and hasattr(result, "result"):  # a Deferred: ready when its work is
            done.add_done_callback(lambda _: _deliver(fut, result.result))
            return fut
        self.call_later(self._charged, _deliver, fut, result)
        return fut


def _deliver(fut: asyncio.Future, result: Any) -> None:
    if not fut.done():
        fut.set_result(result)


def run_virtual(coro: Any) -> Any:
    """Run ``coro`` to completion on a fresh :class:`VirtualLoop` (closed afterwards)."""
    loop = VirtualLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()
