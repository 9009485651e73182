"""The stdio transport of :mod:`envs.mcp`: an MCP server process inside one of our sandboxes.

The SDK's own ``stdio_client`` starts the command itself, so it cannot hand the process the descriptors a ``bwrap``
sandbox passes (its seccomp program) nor put it in the sandbox's cgroup. This transport starts the command the
sandbox prepared (:meth:`envs.sandbox.local.LocalSandbox.launch`) and speaks the same wire format: one JSON-RPC
message per line on stdin/stdout, stderr kept (its tail goes into start-up errors). Shutdown follows the MCP
lifecycle: close stdin, give the server a grace period, then kill its process group and cgroup.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import anyio

from envs.errors import SandboxError

if TYPE_CHECKING:
    from envs.mcp import MCPServer

EXIT_GRACE_S = 2.0
"""How long a server has to exit after its stdin closed, before it is killed."""
STDERR_KEEP = 4096
"""Bytes of the server's stderr kept for error messages."""


class Launched:
    """The started server: its process, the sandbox that owns it (if any) and the tail of its stderr."""

    def __init__(self, process: Any, sandbox: Any, launch: Any) -> None:
        self.process, self.sandbox, self.launch = process, sandbox, launch
        self.stderr = bytearray()
        self.stopped = False

    def stderr_tail(self) -> str:
        return self.stderr[-STDERR_KEEP:].decode(errors="replace").strip()


async def _start(server: MCPServer) -> Launched:
    argv = list(server.command)
    if server.sandbox is None:
        env = {**os.environ, **server.env}
        proc = await anyio.open_process(argv, env=env, start_new_session=True)
        return Launched(proc, None, None)
    from envs.sandbox import BwrapSandbox, ProcessSandbox

    sandbox: BwrapSandbox | ProcessSandbox
    if server.sandbox == "bwrap":
        sandbox = BwrapSandbox(server.limits, dict(server.env), ro_binds=list(server.mounts))
    else:
        sandbox = ProcessSandbox(server.limits, dict(server.env))
    try:
        launch = sandbox.launch(argv, server.limits)
        pk = launch.popen_kwargs
        try:
            proc = await anyio.open_process(
                launch.argv, env=pk["env"], cwd=pk["cwd"], pass_fds=pk["pass_fds"], start_new_session=True
            )
        except BaseException:
            launch.started(0)
            raise
        launch.started(proc.pid)
    except BaseException:
        sandbox.close()
        raise
    return Launched(proc, sandbox, launch)


@contextlib.asynccontextmanager
async def sandboxed_stdio(server: MCPServer, started: Callable[[Any], None] | None = None) -> AsyncIterator[Any]:
    """The ``(read_stream, write_stream)`` pair ``mcp.Client`` talks over, for a stdio ``server``; ``started`` is
    given the started server (its ``process.returncode`` says whether it still runs, ``stderr_tail()`` what it
    wrote last)."""
    import mcp_types
    from mcp.shared.message import SessionMessage

    try:
        run = await _start(server)
    except (OSError, SandboxError) as e:
        raise SandboxError(f"could not start MCP server {server.label!r}: {e}") from e
    proc = run.process
    if started is not None:
        started(run)
    to_session, from_server = anyio.create_memory_object_stream[Any](0)
    to_server, from_session = anyio.create_memory_object_stream[Any](0)

    async def read_stdout() -> None:
        buffer = b""
        async with to_session:
            with contextlib.suppress(anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
                async for chunk in proc.stdout:
                    lines = (buffer + chunk).split(b"\n")
                    buffer = lines.pop()
                    for line in lines:
                        if not line.strip():
                            continue
                        try:
                            item: Any = SessionMessage(mcp_types.jsonrpc_message_adapter.validate_json(line))
                        except ValueError as e:
                            item = e
                        await to_session.send(item)

    async def read_stderr() -> None:
        with contextlib.suppress(anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            async for chunk in proc.stderr:
                run.stderr += chunk
                del run.stderr[:-STDERR_KEEP]

    async def write_stdin() -> None:
        async with from_session:
            with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
                async for message in from_session:
                    data = message.message.model_dump_json(by_alias=True, exclude_unset=True)
                    await proc.stdin.send(data.encode() + b"\n")

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(read_stdout)
            tg.start_soon(read_stderr)
            tg.start_soon(write_stdin)
            try:
                yield from_server, to_server
            finally:
                with anyio.CancelScope(shield=True):
                    await _stop(run)
                tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await _stop(run)


async def _stop(run: Launched) -> None:
    """Close stdin, wait out the grace period, then kill the process group (and the sandbox's cgroup)."""
    if run.stopped:  # the transport's inner and outer shutdown paths both call this
        return
    run.stopped = True
    proc = run.process
    with contextlib.suppress(Exception):
        await proc.stdin.aclose()
    with anyio.move_on_after(EXIT_GRACE_S):
        while proc.returncode is None:
            await anyio.sleep(0.02)
    if run.launch is not None:
        run.launch.ended(proc.pid)
    else:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
    with anyio.move_on_after(EXIT_GRACE_S):
        while proc.returncode is None:
            await anyio.sleep(0.02)
    for stream in (proc.stdout, proc.stderr):
        with contextlib.suppress(Exception):
            await stream.aclose()
    if run.sandbox is not None:
        run.sandbox.close()
