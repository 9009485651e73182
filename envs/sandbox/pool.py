"""A warm pool of sandboxes, so that an episode does not pay start-up on its first tool call.

``SandboxPool(kind, size, **kw)`` keeps ``size`` sandboxes started ahead of use (bwrap/process: workdir and pids
cgroup made; docker: container running). :meth:`SandboxPool.acquire` hands one out at once (a cold one is made on
the spot only when the pool ran dry); :meth:`SandboxPool.release` gives it back: it is wiped (:meth:`reset`: every
process killed, workdir emptied) and returned to the pool, or closed and replaced when it cannot be wiped or when
``reuse=False``. Wiping, replacing and refilling happen on one background thread, off the episode's path.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import queue
import threading
from collections.abc import Iterator
from typing import Any

from envs.errors import SandboxError

log = logging.getLogger(__name__)


class SandboxPool:
    """Keeps ``size`` sandboxes of ``kind`` ready; keyword arguments go to :func:`envs.sandbox.make_sandbox`."""

    def __init__(self, kind: str = "bwrap", size: int = 4, reuse: bool = True, prefill: bool = True, **kw: Any):
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        self.kind, self.size, self.reuse = kind, size, reuse
        self._kw = kw
        self._idle: collections.deque[Any] = collections.deque()
        self._leased_boxes: dict[int, Any] = {}
        self._pending = 0  # creations queued or running
        self._cond = threading.Condition()
        self._closed = False
        self._jobs: queue.SimpleQueue[tuple[str, Any] | None] = queue.SimpleQueue()
        self._worker = threading.Thread(target=self._work, name=f"sandbox-pool-{kind}", daemon=True)
        self._worker.start()
        self.cold_starts = 0
        """How many acquires found the pool empty and had to start a sandbox on the spot."""
        self._refill()
        if prefill:
            self.wait_ready()

    def _make(self) -> Any:
        from envs.sandbox import make_sandbox

        return make_sandbox(self.kind, **self._kw)

    # -- public API --------------------------------------------------------------------------------------------
    def acquire(self) -> Any:
        """A ready sandbox (from the pool when one is idle, else started now); give it back with :meth:`release`."""
        with self._cond:
            if self._closed:
                raise SandboxError("the sandbox pool is closed")
            box = self._idle.popleft() if self._idle else None
            if box is not None:
                self._lease(box)
        self._refill()
        if box is None:
            box = self._make()
            with self._cond:
                self.cold_starts += 1
                if self._closed:
                    box.close()
                    raise SandboxError("the sandbox pool is closed")
                self._lease(box)
        return box

    async def aacquire(self) -> Any:
        """The awaitable twin of :meth:`acquire` (a cold start, when needed, runs in a worker thread)."""
        with self._cond:
            if self._idle and not self._closed:
                box = self._idle.popleft()
                self._lease(box)
                self._jobs.put(("refill", None))
                return box
        return await asyncio.to_thread(self.acquire)

    def release(self, box: Any) -> None:
        """Give ``box`` back: it is wiped and pooled again (or closed and replaced) in the background."""
        with self._cond:
            if self._leased_boxes.pop(id(box), None) is None:
                raise SandboxError("this sandbox was not acquired from this pool (or was released twice)")
            closed = self._closed
        if closed:
            box.close()
            return
        self._jobs.put(("recycle", box))

    @contextlib.contextmanager
    def sandbox(self) -> Iterator[Any]:
        """``with pool.sandbox() as box:`` acquires a sandbox and releases it afterwards."""
        box = self.acquire()
        try:
            yield box
        finally:
            self.release(box)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until ``size`` sandboxes are idle (or the pool is closed); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._closed or len(self._idle) >= self.size, timeout)

    @property
    def idle(self) -> int:
        """How many sandboxes are ready now."""
        with self._cond:
            return len(self._idle)

    def close(self) -> None:
        """Close every sandbox, idle and leased, and stop the background thread. Safe to call twice."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            boxes = list(self._idle) + list(self._leased_boxes.values())
            self._idle.clear()
            self._leased_boxes.clear()
            self._cond.notify_all()
        self._jobs.put(None)
        self._worker.join(timeout=60)
        for box in boxes:
            with contextlib.suppress(Exception):
                box.close()

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- background --------------------------------------------------------------------------------------------
    def _lease(self, box: Any) -> None:
        self._leased_boxes[id(box)] = box

    def _refill(self) -> None:
        with self._cond:
            missing = self.size - len(self._idle) - self._pending
            self._pending += max(missing, 0)
        for _ in range(max(missing, 0)):
            self._jobs.put(("create", None))

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            what, box = job
            try:
                if what == "create":
                    self._create_one()
                elif what == "recycle":
                    self._recycle(box)
                else:
                    self._refill()
            except Exception:  # noqa: BLE001 - a failed start must not kill the pool's thread
                log.exception("sandbox pool: %s failed", what)

    def _create_one(self) -> None:
        try:
            box = None if self._closed else self._make()
        finally:
            with self._cond:
                self._pending -= 1
        if box is not None:
            self._offer(box)

    def _recycle(self, box: Any) -> None:
        if self.reuse and hasattr(box, "reset"):
            try:
                box.reset()
                self._offer(box)
                return
            except Exception:  # noqa: BLE001 - an unwipeable sandbox is replaced
                log.warning("sandbox pool: reset failed; replacing the sandbox", exc_info=True)
        box.close()
        self._refill()

    def _offer(self, box: Any) -> None:
        with self._cond:
            keep = not self._closed and len(self._idle) < self.size
            if keep:
                self._idle.append(box)
                self._cond.notify_all()
        if not keep:
            box.close()
