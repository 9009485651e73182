"""Run the SGLang-protocol server on a background thread with its own event loop (tests, benchmarks, in-process)."""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web

from agentflow.engine.embedded import EmbeddedEngine
from agentflow.engine.server import DEFAULT_MAX_REQUEST_BYTES, SGLangServer


class ServerThread:
    """A server on a background thread with its own event loop (tests, benchmarks, in-process use)."""

    def __init__(
        self,
        engine: EmbeddedEngine,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    ):
        self.engine = engine
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self.port = port
        self.host = host
        self._api_key = api_key
        self._max_request_bytes = max_request_bytes
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="sglang-server", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _main(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._start())
        except BaseException as exc:  # handed to the constructor
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup() if self._runner else asyncio.sleep(0))
        self._loop.close()

    async def _start(self) -> None:
        server = SGLangServer(self.engine, self._api_key, max_request_bytes=self._max_request_bytes)
        self._runner = web.AppRunner(server.app(), handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    def close(self) -> None:
        """Stop serving (the engine stays open: its owner closes it)."""
        if self._loop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
