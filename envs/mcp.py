"""Model Context Protocol tool servers as environment tools.

:class:`MCPServer` says where a server is: a command spoken to over stdio (started inside one of our sandboxes by
default) or a streamable-HTTP URL. :class:`MCPToolSet` connects to it with the official ``mcp`` SDK, turns the
server's tools into :class:`~envs.core.ToolSpec` s (name, description, input schema as the server declares them)
and calls them. :class:`MCPToolEnv` is a :class:`~envs.tools.ToolEnv` whose tools are its own ``@tool`` methods plus
those of its servers; its subclasses bring the task set and the verifier, as any env does.

Behaviour the env relies on:

- A tool result with ``isError`` becomes an ``"Error: ..."`` observation (the server's text), as does an MCP
  protocol error (unknown tool, invalid arguments), a call that outlives ``call_timeout_s`` (the SDK sends the
  server a cancel notification) and a server that died; none of them raises into the rollout.
- Text content is the observation; images and audio are described by type and size, resource links by URI, and a
  result with only ``structuredContent`` is shown as its JSON.
- The client runs on an event loop of its own in a daemon thread, so the env can be stepped from any thread or
  event loop (the rollout's, a worker thread's, a plain ``step``).
- ``close`` ends the session; for a stdio server the SDK's shutdown (close stdin, wait, kill the process group)
  runs first and then the sandbox kills whatever is left in the server's cgroup, so no process survives the env.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import threading
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from envs.core import ToolSpec
from envs.errors import EnvError
from envs.sandbox.base import Limits
from envs.tools import ToolEnv

if TYPE_CHECKING:
    from envs.mcp_stdio import Launched

SERVER_LIMITS = Limits(memory_mb=4096, cpu_s=3600, max_procs=64, sandbox_memory_mb=2048)
"""Sandbox limits of a stdio server: it lives as long as the env, so its CPU-time cap is an hour."""


CLOSE_TIMEOUT_S = 10.0
"""How long closing waits for the session to end (stdio: the server's grace period and kill included)."""


class MCPError(EnvError):
    """An MCP server could not be reached, listed or called (the message names the server and the cause)."""


@dataclass(frozen=True)
class MCPServer:
    """Where an MCP server is and how to talk to it: exactly one of ``command`` (stdio) or ``url`` (HTTP)."""

    command: tuple[str, ...] = ()
    """The server's command line (stdio transport)."""
    url: str = ""
    """The server's streamable-HTTP endpoint, e.g. ``http://127.0.0.1:8000/mcp``."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables of a stdio server."""
    sandbox: str | None = "bwrap"
    """Where a stdio server runs: ``bwrap`` (isolated: no network, read-only view), ``process`` (rlimits only) or
    ``None`` (a plain child process). Ignored for ``url``."""
    mounts: tuple[str, ...] = ()
    """Host paths a ``bwrap`` server sees read-only at the same place (its code, its interpreter's packages)."""
    limits: Limits = SERVER_LIMITS
    """The sandbox's limits for the server's processes."""
    headers: dict[str, str] = field(default_factory=dict)
    """HTTP headers sent with every request (e.g. an ``Authorization`` bearer token)."""
    call_timeout_s: float = 30.0
    """A tool call that takes longer is abandoned (the server is sent a cancel) and answered with an error."""
    connect_timeout_s: float = 30.0
    """Time to start the server, initialise the session and list the tools."""
    include: tuple[str, ...] | None = None
    """Offer only these of the server's tools (None: all)."""
    prefix: str = ""
    """Prepended to each tool name the env offers (keeps two servers' tools apart); calls strip it."""
    name: str = ""
    """How errors name this server (default: the command or the URL)."""

    def __post_init__(self) -> None:
        if bool(self.command) == bool(self.url):
            raise MCPError("an MCP server needs exactly one of 'command' (stdio) or 'url' (streamable HTTP)")
        if self.sandbox not in ("bwrap", "process", None):
            raise MCPError(f"MCP server sandbox must be 'bwrap', 'process' or null, got {self.sandbox!r}")
        if self.call_timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise MCPError("MCP server timeouts must be > 0")

    @property
    def label(self) -> str:
        return self.name or self.url or " ".join(self.command)

    @classmethod
    def python(cls, script: str, *args: str, **kw: Any) -> MCPServer:
        """A stdio server that is a Python script using packages of this interpreter's environment (the ``mcp``
        SDK, say). In a ``bwrap`` sandbox it runs on the system's ``python3`` (the same minor version is
        required) with this environment's ``site-packages`` and the script's directory mounted read-only."""
        script = os.path.abspath(script)
        sandbox = kw.get("sandbox", "bwrap")
        if sandbox != "bwrap":
            return cls(command=(sys.executable, "-u", script, *args), **kw)
        paths = _site_packages()
        env = {"PYTHONPATH": os.pathsep.join(paths), **kw.pop("env", {})}
        mounts = (*paths, os.path.dirname(script), *kw.pop("mounts", ()))
        return cls(command=("python3", "-u", script, *args), env=env, mounts=mounts, **kw)


def _site_packages() -> list[str]:
    import site

    return [p for p in site.getsitepackages() if os.path.isdir(p)]


def from_config(value: MCPServer | dict[str, Any]) -> MCPServer:
    """An :class:`MCPServer` from itself or a mapping of its fields (``limits`` as a mapping too; lists become
    tuples), as a YAML config or ``env.kwargs`` gives it."""
    if isinstance(value, MCPServer):
        return value
    if not isinstance(value, dict):
        raise MCPError(f"an MCP server is a mapping of MCPServer fields, got {type(value).__name__}")
    known = set(MCPServer.__dataclass_fields__)
    unknown = sorted(set(value) - known)
    if unknown:
        raise MCPError(f"unknown MCP server key(s) {unknown}; known: {sorted(known)}")
    kw = dict(value)
    for key in ("command", "mounts", "include"):
        if isinstance(kw.get(key), list):
            kw[key] = tuple(kw[key])
    if isinstance(kw.get("limits"), dict):
        kw["limits"] = Limits(**{**SERVER_LIMITS.__dict__, **kw["limits"]})
    return MCPServer(**kw)


# -- the client ------------------------------------------------------------------------------------------------
class MCPToolSet:
    """A live connection to one MCP server: its tools as specs, and calls to them (from any thread or loop)."""

    def __init__(self, server: MCPServer | dict[str, Any]) -> None:
        self.server = from_config(server)
        self.specs: list[ToolSpec] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="mcp-client")
        self._thread.start()
        self._client: Any = None
        self._stop: asyncio.Event | None = None
        self._owner: Future[None] | None = None
        self._closed = False
        self._broken = False
        self._began = threading.Event()  # the session's owner task started running
        self._ended = threading.Event()  # ... and finished (its shutdown included)
        self._launched: Launched | None = None  # a stdio server, once started
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    # -- connection: one task owns the session from its start to its end (anyio scopes must exit where entered)
    def _open(self) -> None:
        ready: Future[list[ToolSpec]] = Future()
        self._owner = asyncio.run_coroutine_threadsafe(self._own(ready), self._loop)
        try:
            self.specs = ready.result(self.server.connect_timeout_s)
        except TimeoutError:
            raise MCPError(
                f"MCP server {self.server.label!r} did not start and list its tools within "
                f"{self.server.connect_timeout_s:g} s"
            ) from None

    async def _own(self, ready: Future[list[ToolSpec]]) -> None:
        from mcp import Client

        self._stop = asyncio.Event()
        self._began.set()
        try:
            # the transport is entered here, not by the Client: a Client whose start fails or is cancelled may leave
            # it unclosed (the server process alive until garbage collection)
            async with self._transport() as streams, Client(_Opened(streams)) as client:
                self._client = client
                ready.set_result(await self._list_tools(client))
                await self._stop.wait()
        except BaseException as e:
            if not ready.done():
                tail = self._launched.stderr_tail()[-800:] if self._launched is not None else ""
                why = _describe(e) + (f" (its stderr: {tail})" if tail else "")
                ready.set_exception(MCPError(f"MCP server {self.server.label!r} failed to start: {why}"))
            if not isinstance(e, Exception):
                raise
        finally:
            self._client = None
            self._ended.set()

    @contextlib.asynccontextmanager
    async def _transport(self) -> AsyncIterator[Any]:
        s = self.server
        if s.url:
            import httpx2
            from mcp.client.streamable_http import streamable_http_client

            async with (
                httpx2.AsyncClient(headers=s.headers, timeout=httpx2.Timeout(s.call_timeout_s + 5)) as http,
                streamable_http_client(s.url, http_client=http) as streams,
            ):
                yield streams
            return
        from envs.mcp_stdio import sandboxed_stdio

        async with sandboxed_stdio(s, self._started) as streams:
            yield streams

    def _started(self, launched: Launched) -> None:
        self._launched = launched

    async def _list_tools(self, client: Any) -> list[ToolSpec]:
        specs, cursor, seen = [], None, set()
        while True:
            page = await client.list_tools(cursor=cursor)
            for t in page.tools:
                if self.server.include is not None and t.name not in self.server.include:
                    continue
                name = self.server.prefix + t.name
                if name in seen:
                    raise MCPError(f"MCP server {self.server.label!r} lists tool {t.name!r} twice")
                seen.add(name)
                schema = dict(t.input_schema or {"type": "object", "properties": {}})
                specs.append(ToolSpec(name, t.description or t.title or t.name, schema))
            cursor = page.next_cursor
            if not cursor:
                break
        missing = sorted(set(self.server.include or ()) - {s.name[len(self.server.prefix) :] for s in specs})
        if missing:
            raise MCPError(f"MCP server {self.server.label!r} has no tool(s) {missing} (asked for in 'include')")
        return specs

    # -- calls -------------------------------------------------------------------------------------------------
    def call(self, name: str, arguments: dict[str, Any]) -> str:
        """Call tool ``name`` (as the env names it) and return the observation; raises :class:`MCPError`."""
        fut = asyncio.run_coroutine_threadsafe(self._call(name, arguments), self._loop)
        try:
            return fut.result(self.server.call_timeout_s + 10)
        except TimeoutError:
            fut.cancel()
            raise MCPError(f"tool {name!r} timed out after {self.server.call_timeout_s:g} s") from None

    async def acall(self, name: str, arguments: dict[str, Any]) -> str:
        """Awaitable :meth:`call`, from any event loop."""
        fut = asyncio.run_coroutine_threadsafe(self._call(name, arguments), self._loop)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), self.server.call_timeout_s + 10)
        except TimeoutError:
            fut.cancel()
            raise MCPError(f"tool {name!r} timed out after {self.server.call_timeout_s:g} s") from None

    async def _call(self, name: str, arguments: dict[str, Any]) -> str:
        from mcp.shared.exceptions import MCPError as ProtocolError
        from mcp_types import CONNECTION_CLOSED, REQUEST_TIMEOUT

        client, s = self._client, self.server
        if client is None:
            raise MCPError(f"MCP server {s.label!r} is not connected (it exited, or the env was closed)")
        raw = name[len(s.prefix) :] if s.prefix and name.startswith(s.prefix) else name
        try:
            result = await client.call_tool(raw, arguments, read_timeout_seconds=s.call_timeout_s)
        except ProtocolError as e:
            if e.code == REQUEST_TIMEOUT:
                raise MCPError(f"tool {name!r} timed out after {s.call_timeout_s:g} s") from None
            if e.code == CONNECTION_CLOSED:
                self._broken = True
            raise MCPError(f"tool {name!r}: {e.error.message}") from None
        except Exception as e:
            self._broken = True
            raise MCPError(f"tool {name!r}: the MCP server {s.label!r} failed: {_describe(e)}") from None
        text = render_result(result)
        if result.is_error:
            raise MCPError(text or f"tool {name!r} failed")
        return text

    @property
    def connected(self) -> bool:
        """False once the session is known to be down (a call found it closed, or :meth:`close` ran)."""
        return self._client is not None and not self._broken and self._owner is not None and not self._owner.done()

    def alive(self) -> bool:
        """Whether the session is still usable as far as can be seen without a request: not closed, no call found
        it broken, and (stdio) the server process has not exited. An HTTP server's death shows at the next call."""
        if self._launched is not None and self._launched.process.returncode is not None:
            self._broken = True
        return self.connected

    def close(self) -> None:
        """End the session (and a stdio server with everything it started); idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._owner is not None:
            # a session that is up ends at the stop; one still starting (a server that never answers) is cancelled,
            # which runs the transport's shutdown all the same (the stdio server and its children are killed)
            if self._client is None:
                self._owner.cancel()
            if self._began.is_set() and not self._ended.wait(CLOSE_TIMEOUT_S):
                self._owner.cancel()
                self._ended.wait(CLOSE_TIMEOUT_S)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()


class _Opened:
    """Streams already opened, as the transport ``mcp.Client`` takes (an async context manager yielding them)."""

    def __init__(self, streams: Any) -> None:
        self._streams = streams

    async def __aenter__(self) -> Any:
        return self._streams

    async def __aexit__(self, *exc: object) -> None:
        return None


def _describe(e: BaseException) -> str:
    if isinstance(e, BaseExceptionGroup):
        return "; ".join(_describe(x) for x in e.exceptions)
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def render_result(result: Any) -> str:
    """A ``CallToolResult`` as observation text (see the module doc)."""
    parts: list[str] = []
    for block in result.content or []:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind in ("image", "audio"):
            parts.append(f"[{kind} {block.mime_type}, {len(block.data) * 3 // 4} bytes]")
        elif kind == "resource_link":
            parts.append(f"[resource {block.uri}]")
        elif kind == "resource":
            res = block.resource
            parts.append(getattr(res, "text", None) or f"[resource {res.uri}]")
        else:
            parts.append(f"[{kind or type(block).__name__} content]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False, default=str))
    return "\n".join(parts) if parts else "(no output)"


# -- the env ---------------------------------------------------------------------------------------------------
class MCPToolEnv(ToolEnv):
    """A :class:`~envs.tools.ToolEnv` whose tools are its ``@tool`` methods plus the tools of ``mcp_servers``.

    Subclasses set ``mcp_servers`` (or pass ``mcp_servers=``) and implement ``reset_task`` and the rubric or
    ``score_answer`` as for any ``ToolEnv``. The servers are connected when the env is made and stay up across
    episodes; one that died is reconnected at the next reset. Tool names must be unique across all of them.
    """

    branching = "none"  # the tools' state lives in the MCP servers, which cannot be copied or reset

    mcp_servers: Sequence[MCPServer | dict[str, Any]] = ()

    def __init__(
        self, max_turns: int | None = None, mcp_servers: Sequence[MCPServer | dict[str, Any]] | None = None
    ) -> None:
        super().__init__(max_turns=max_turns)
        self._servers = [from_config(s) for s in (self.mcp_servers if mcp_servers is None else mcp_servers)]
        self.mcp: list[MCPToolSet] = []
        try:
            for server in self._servers:
                self.mcp.append(MCPToolSet(server))
            self._route = self._routes()
        except BaseException:
            self.close()
            raise
        self.tools = [*self.toolset.specs, *(spec for ts in self.mcp for spec in ts.specs)]

    def _routes(self) -> dict[str, MCPToolSet]:
        route: dict[str, MCPToolSet] = {}
        own = {s.name for s in self.toolset.specs}
        for ts in self.mcp:
            for spec in ts.specs:
                if spec.name in own or spec.name in route:
                    raise MCPError(
                        f"tool name {spec.name!r} of MCP server {ts.server.label!r} is taken; set a 'prefix'"
                    )
                route[spec.name] = ts
        return route

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Reconnect a server that died, then reset as :meth:`ToolEnv.reset`."""
        for i, ts in enumerate(self.mcp):
            if not ts.alive():
                ts.close()
                self.mcp[i] = MCPToolSet(self._servers[i])
        self._route = self._routes()
        return super().reset(seed=seed, options=options)

    def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        if name not in self._route:
            return super().call_tool(name, arguments)
        self.tool_calls.append(name)
        return self._route[name].call(name, arguments)

    async def acall_tool(self, name: str, arguments: dict[str, Any]) -> str:
        if name not in self._route:
            return await super().acall_tool(name, arguments)
        self.tool_calls.append(name)
        return await self._route[name].acall(name, arguments)

    def close(self) -> None:
        for ts in getattr(self, "mcp", []):
            ts.close()
        super().close()
