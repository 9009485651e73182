"""Machinery shared by the sandboxes that run host processes (``bwrap`` and ``process``).

Each ``exec`` runs ``[sh -c 'join cgroup'] prlimit --as --cpu --fsize --core -- <isolation> cmd`` in a new session,
so the whole process group can be killed on timeout. Where a pids cgroup is available, each exec also gets its own
sub-cgroup (under the sandbox's, which holds ``pids.max``), so every process it started, including ``setsid``
grandchildren, is killed when it ends. Output pipes are closed after the kill: a leaked grandchild holding a pipe
cannot hang the call.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator
from typing import IO, Any

from envs.errors import SandboxError
from envs.sandbox.base import ExecResult, Limits, cmd_argv, resolve_inside
from envs.sandbox.cgroup import PidsCgroup

_MB = 1024 * 1024
_EXIT_GRACE_S = 0.2  # after the command exits, how long to wait for output still held by leftovers
_KILL_GRACE_S = 1.0  # after a kill, how long to wait for the pipes to close before closing them ourselves
_POLL_S = 0.05
_BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
}


def _cleanup(host_workdir: str, cgroup: PidsCgroup | None) -> None:
    if cgroup is not None:
        cgroup.remove()
    shutil.rmtree(host_workdir, ignore_errors=True)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(pgid, signal.SIGKILL)


def _exited_unreaped(pid: int) -> bool:
    """True when ``pid`` has exited; it stays a zombie (its pid cannot be reused until it is reaped)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


class LocalSandbox:
    """Base of sandboxes made of host processes: workdir, limits, cgroup, and the exec loop. Subclasses wrap argv."""

    kind = "local"

    def __init__(self, limits: Limits | None = None, env: dict[str, str] | None = None, use_cgroup: bool = True):
        self.limits = limits or Limits()
        self.host_workdir = tempfile.mkdtemp(prefix="agentflow-sbx-")
        self._cgroup = PidsCgroup.create(self.limits.max_procs) if use_cgroup else None
        self._cgroup_max = self.limits.max_procs
        self.pids_limit_enforced: bool = self._cgroup is not None
        """True when a pids cgroup limits the number of processes of this sandbox (RLIMIT_NPROC cannot, for root)."""
        self._extra_env = dict(env or {})
        self._closed = False
        self._live: set[int] = set()
        self._lock = threading.Lock()
        self._counter = itertools.count()
        self._finalizer = weakref.finalize(self, _cleanup, self.host_workdir, self._cgroup)

    # -- what subclasses provide -------------------------------------------------------------------------------
    @property
    def workdir(self) -> str:
        """The working directory as commands see it."""
        return self.host_workdir

    def _wrap(self, argv: list[str]) -> list[str]:
        """The argv that runs ``argv`` inside this sandbox's isolation."""
        return argv

    def _popen_cwd(self) -> str | None:
        return self.host_workdir

    def _env(self) -> dict[str, str]:
        return {**_BASE_ENV, "HOME": self.workdir, "TMPDIR": "/tmp", **self._extra_env}

    # -- files -------------------------------------------------------------------------------------------------
    def put_file(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` relative to the workdir (parents created); refuses paths escaping it."""
        host = resolve_inside(self._open_dir(), path, self.workdir)
        os.makedirs(os.path.dirname(host), exist_ok=True)
        with open(host, "wb") as f:
            f.write(data)

    def get_file(self, path: str) -> bytes:
        """Read ``path`` relative to the workdir; refuses paths escaping it (symlinks included)."""
        host = resolve_inside(self._open_dir(), path, self.workdir)
        try:
            with open(host, "rb") as f:
                return f.read()
        except FileNotFoundError as e:
            raise SandboxError(f"no such file in the sandbox: {path!r}") from e

    def _open_dir(self) -> str:
        if self._closed:
            raise SandboxError("the sandbox is closed")
        return self.host_workdir

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Kill every process still running, remove the cgroup and delete the workdir. Safe to call twice."""
        with self._lock:
            self._closed = True
            live = list(self._live)
        for pid in live:
            _kill_group(pid)
        self._finalizer()

    def reset(self) -> None:
        """Kill every process of the sandbox and empty its workdir: a fresh sandbox again (used by the pool)."""
        with self._lock:
            live = list(self._live)
        for pid in live:
            _kill_group(pid)
        if self._cgroup is not None and not self._cgroup.kill_all():
            raise SandboxError("could not kill every process of the sandbox")
        root = self._open_dir()
        for name in os.listdir(root):
            path = os.path.join(root, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._closed

    def __enter__(self) -> LocalSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- exec --------------------------------------------------------------------------------------------------
    def _prepare(self, cmd: list[str] | str, limits: Limits | None) -> tuple[list[str], Limits, PidsCgroup | None]:
        if self._closed:
            raise SandboxError("the sandbox is closed")
        lim = limits or self.limits
        inner = self._wrap(cmd_argv(cmd))
        rlimits = [
            "prlimit",
            f"--as={lim.memory_mb * _MB}",
            f"--cpu={lim.cpu_s}:{lim.cpu_s + 1}",
            f"--fsize={lim.file_size_mb * _MB}",
            "--core=0",
            "--",
        ]
        argv = rlimits + inner
        group = None
        if self._cgroup is not None:
            with self._lock:
                if lim.max_procs != self._cgroup_max:
                    self._cgroup.set_max(lim.max_procs)
                    self._cgroup_max = lim.max_procs
                group = self._cgroup.child(f"exec-{next(self._counter)}")
        if group is not None:
            argv = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', group.procs_file, *argv]
        return argv, lim, group

    @contextlib.contextmanager
    def _stdin(self, stdin: str | None) -> Iterator[IO[bytes] | int]:
        if stdin is None:
            yield subprocess.DEVNULL
            return
        with tempfile.TemporaryFile() as f:
            f.write(stdin.encode())
            f.seek(0)
            yield f

    def _popen_kwargs(self, stdin: Any) -> dict[str, Any]:
        return dict(
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=self._popen_cwd(),
            env=self._env(),
            start_new_session=True,
        )

    def _finish(self, pid: int, group: PidsCgroup | None) -> None:
        """Kill whatever the exec left behind (its cgroup, which also removes it) after the command was reaped."""
        if group is not None:
            group.remove()
        with self._lock:
            self._live.discard(pid)

    def exec(
        self, cmd: list[str] | str, stdin: str | None = None, timeout: float = 10.0, limits: Limits | None = None
    ) -> ExecResult:
        """Run ``cmd`` in the workdir with ``limits``; kill it after ``timeout`` seconds (``timed_out=True``)."""
        argv, lim, group = self._prepare(cmd, limits)
        start = time.monotonic()
        try:
            with self._stdin(stdin) as fin:
                proc = subprocess.Popen(argv, **self._popen_kwargs(fin))
        except OSError as e:
            if group is not None:
                group.remove()
            raise SandboxError(f"could not start the sandboxed command: {e}") from e
        with self._lock:
            self._live.add(proc.pid)
        try:
            out, err, timed_out = self._collect(proc, start + timeout, lim.output_kb * 1024, group)
        finally:
            _kill_group(proc.pid)  # the command is not reaped yet, so its pid (the group id) is not reused
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
            proc.wait()
            self._finish(proc.pid, group)
        return ExecResult(_decode(out), _decode(err), proc.returncode, timed_out, time.monotonic() - start)

    def _collect(
        self, proc: subprocess.Popen[bytes], deadline: float, cap: int, group: PidsCgroup | None
    ) -> tuple[bytes, bytes, bool]:
        """Read both pipes (keeping ``cap`` bytes of each) until EOF, the deadline, or shortly after the exit."""
        bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}  # type: ignore[union-attr]
        timed_out, exited = False, False
        end = deadline
        with selectors.DefaultSelector() as sel:
            for fd in bufs:
                sel.register(fd, selectors.EVENT_READ)
            while sel.get_map():
                now = time.monotonic()
                if now >= end:
                    if exited or timed_out:
                        break
                    timed_out, end = True, now + _KILL_GRACE_S
                    self._kill(proc.pid, group)
                    continue
                for key, _ in sel.select(min(end - now, _POLL_S)):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fd)
                    elif len(bufs[key.fd]) < cap:
                        bufs[key.fd] += chunk[: cap - len(bufs[key.fd])]
                if not exited and not timed_out and _exited_unreaped(proc.pid):
                    exited, end = True, min(end, time.monotonic() + _EXIT_GRACE_S)
        if not timed_out and not _exited_unreaped(proc.pid):
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0))
            except subprocess.TimeoutExpired:
                timed_out = True
                self._kill(proc.pid, group)
        out, err = bufs.values()
        return bytes(out), bytes(err), timed_out

    @staticmethod
    def _kill(pid: int, group: PidsCgroup | None) -> None:
        _kill_group(pid)
        if group is not None:
            group.kill_all()

    async def aexec(
        self, cmd: list[str] | str, stdin: str | None = None, timeout: float = 10.0, limits: Limits | None = None
    ) -> ExecResult:
        """The awaitable twin of :meth:`exec` (asyncio subprocess; no thread is held while the command runs)."""
        argv, lim, group = self._prepare(cmd, limits)
        start = time.monotonic()
        try:
            with self._stdin(stdin) as fin:
                proc = await asyncio.create_subprocess_exec(*argv, **self._popen_kwargs(fin))
        except OSError as e:
            if group is not None:
                group.remove()
            raise SandboxError(f"could not start the sandboxed command: {e}") from e
        with self._lock:
            self._live.add(proc.pid)
        cap = lim.output_kb * 1024
        bufs = (bytearray(), bytearray())
        pipes = (proc.stdout, proc.stderr)
        readers = [asyncio.ensure_future(_read_capped(s, b, cap)) for s, b in zip(pipes, bufs, strict=True)]
        waiter = asyncio.ensure_future(proc.wait())
        try:
            timed_out = await self._await_exit(proc, waiter, start + timeout, group)
        finally:
            _kill_group(proc.pid)
            if group is not None:
                group.kill_all()
            await asyncio.wait([waiter, *readers], timeout=_KILL_GRACE_S)
            for task in (waiter, *readers):
                task.cancel()
            if not waiter.done() or proc.returncode is None:
                proc._transport.close()  # type: ignore[attr-defined]  # pipes held by leftovers: stop reading
            with contextlib.suppress(asyncio.TimeoutError, ProcessLookupError):
                await asyncio.wait_for(proc.wait(), timeout=_KILL_GRACE_S)
            self._finish(proc.pid, group)
        code = proc.returncode if proc.returncode is not None else -signal.SIGKILL
        return ExecResult(_decode(bufs[0]), _decode(bufs[1]), code, timed_out, time.monotonic() - start)

    async def _await_exit(
        self, proc: asyncio.subprocess.Process, waiter: asyncio.Future[int], deadline: float, group: PidsCgroup | None
    ) -> bool:
        """Wait for exit (and closed pipes); True when the deadline passed first and the command was killed."""
        exited_at: float | None = None
        while not waiter.done():
            now = time.monotonic()
            if proc.returncode is not None:
                exited_at = exited_at or now
                if now - exited_at > _EXIT_GRACE_S:
                    return False
            elif now >= deadline:
                self._kill(proc.pid, group)
                return True
            await asyncio.wait([waiter], timeout=min(_POLL_S, max(deadline - now, 0.001)))
        return False


async def _read_capped(stream: asyncio.StreamReader | None, buf: bytearray, cap: int) -> None:
    if stream is None:
        return
    while chunk := await stream.read(65536):
        if len(buf) < cap:
            buf += chunk[: cap - len(buf)]


def _decode(data: bytes | bytearray) -> str:
    return bytes(data).decode("utf-8", errors="replace")
