"""Machinery shared by the sandboxes that run host processes (``bwrap`` and ``process``).

Each ``exec`` runs ``sh -c 'join the cgroups; ulimit -v -t -f -c; exec "$@"' <isolation> cmd`` in a new session,
so the whole process group can be killed on timeout. Where cgroups are available, each exec also gets its own
sub-cgroup (under the sandbox's, which holds ``pids.max`` and the memory cap), so every process it started,
including ``setsid`` grandchildren, is killed when it ends. Output pipes are closed after the kill: a leaked
grandchild holding a pipe cannot hang the call. After each exec the limits it ran into are reported in
:attr:`ExecResult.limits_hit`.
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
from envs.sandbox import mounts
from envs.sandbox.base import ExecResult, Limits, cmd_argv, resolve_inside
from envs.sandbox.cgroup import SandboxCgroup

_MB = 1024 * 1024
_EXIT_GRACE_S = 0.2  # after the command exits, how long to wait for output still held by leftovers
_KILL_GRACE_S = 1.0  # after a kill, how long to wait for the pipes to close before closing them ourselves
_POLL_S = 0.05
_SIGXCPU = int(signal.SIGXCPU)
_WRAPPER_FAILED = 125  # the limits shell could not join the cgroups or set the rlimits
# $0 = how many cgroup.procs files follow; then the files, the rlimits (KiB, s, 512-byte blocks) and the command.
_LIMITS_SH = (
    'n=$0; while [ "$n" -gt 0 ]; do echo 0 > "$1" || exit 125; shift; n=$((n-1)); done; '
    'ulimit -v "$1" && ulimit -S -t "$2" && ulimit -H -t $(($2+1)) && ulimit -f "$3" && ulimit -c 0 || exit 125; '
    'shift 3; exec "$@"'
)
_BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
}


def _cleanup(root: str, mounted: list[str], cgroup: SandboxCgroup | None) -> None:
    if cgroup is not None:
        cgroup.remove()
    for path in mounted:
        mounts.unmount(path)
    shutil.rmtree(root, ignore_errors=True)


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
        self._root = tempfile.mkdtemp(prefix=f"agentflow-sbx-{os.getpid()}-")  # the pid: see mounts.sweep_leftovers
        self.host_workdir = self._root
        self._mounted: list[str] = []
        lim = self.limits
        self._cgroup = SandboxCgroup.create(lim.max_procs, lim.sandbox_memory_mb) if use_cgroup else None
        self._finalizer = weakref.finalize(self, _cleanup, self._root, self._mounted, self._cgroup)
        group = self._cgroup
        self.enforced: dict[str, bool] = {
            "pids": group is not None and group.has_pids,
            "memory": group is not None and group.has_memory,
            "tmp": False,
            "workdir": False,
        }
        """Which sandbox-wide caps hold here: ``pids`` and ``memory`` (cgroups), ``tmp`` and ``workdir`` (sized
        mounts). Where one does not, the per-process rlimits still do (see the module docs for the fallbacks)."""
        self._applied = lim
        try:
            self._prepare_host()
        except BaseException:
            self._finalizer()
            raise
        self.pids_limit_enforced: bool = self.enforced["pids"]
        """True when a pids cgroup limits the number of processes of this sandbox (RLIMIT_NPROC cannot, for root)."""
        self._extra_env = dict(env or {})
        self._closed = False
        self._live: set[int] = set()
        self._lock = threading.Lock()
        self._counter = itertools.count()

    # -- what subclasses provide -------------------------------------------------------------------------------
    @property
    def workdir(self) -> str:
        """The working directory as commands see it."""
        return self.host_workdir

    def _prepare_host(self) -> None:
        """Make the host side of the sandbox (directories, mounts) under ``self._root``. Nothing by default."""

    def _wrap(self, argv: list[str], fds: list[int]) -> list[str]:
        """The argv that runs ``argv`` inside this sandbox's isolation (``fds``: from :meth:`_exec_fds`)."""
        return argv

    def _exec_fds(self) -> list[int]:
        """File descriptors the exec's processes inherit (opened per exec, closed after the start). None here."""
        return []

    def _scratch_dirs(self) -> list[str]:
        """Host directories emptied by :meth:`reset` besides the workdir."""
        return []

    def _owned_by(self) -> int | None:
        """The host uid that files put into the workdir must belong to (None: leave them as written)."""
        return None

    def _popen_cwd(self) -> str | None:
        return self.host_workdir

    def _env(self) -> dict[str, str]:
        return {**_BASE_ENV, "HOME": self.workdir, "TMPDIR": "/tmp", **self._extra_env}

    # -- files -------------------------------------------------------------------------------------------------
    def put_file(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` relative to the workdir (parents created); refuses paths escaping it."""
        root = self._open_dir()
        host = resolve_inside(root, path, self.workdir)
        owner = self._owned_by()
        made = _make_parents(os.path.realpath(root), os.path.dirname(host))
        with open(host, "wb") as f:
            f.write(data)
        if owner is not None:
            for p in [*made, host]:
                os.chown(p, owner, owner, follow_symlinks=False)

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
        for root in [self._open_dir(), *self._scratch_dirs()]:
            _empty(root)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._closed

    def __enter__(self) -> LocalSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- exec --------------------------------------------------------------------------------------------------
    def _prepare(self, cmd: list[str] | str, limits: Limits | None) -> tuple[list[str], Limits, _Exec]:
        if self._closed:
            raise SandboxError("the sandbox is closed")
        lim = limits or self.limits
        inner = cmd_argv(cmd)
        group = None
        with self._lock:
            self._apply(lim)
            if self._cgroup is not None:
                group = self._cgroup.child(f"exec-{next(self._counter)}")
        run = _Exec(group, self._cgroup.events() if self._cgroup is not None else {}, self._exec_fds())
        joins = group.procs_files if group is not None else []
        rlimits = [str(lim.memory_mb * 1024), str(lim.cpu_s), str(lim.file_size_mb * 2048)]
        limits_sh = ["/bin/sh", "-c", _LIMITS_SH, str(len(joins)), *joins, *rlimits]
        try:
            argv = [*limits_sh, *self._wrap(inner, run.fds)]
        except BaseException:
            run.close_fds()
            if group is not None:
                group.remove()
            raise
        return argv, lim, run

    def _apply(self, lim: Limits) -> None:
        """Bring the sandbox-wide caps (pids, memory, sized mounts) to ``lim`` when they changed (under the lock)."""
        old, self._applied = self._applied, lim
        if self._cgroup is not None:
            if lim.max_procs != old.max_procs:
                self._cgroup.set_max(lim.max_procs)
            self._cgroup.set_memory(lim.sandbox_memory_mb)
        self._resize(old, lim)

    def _resize(self, old: Limits, lim: Limits) -> None:
        """Resize the sized mounts when the limits changed. Nothing by default."""

    def _hits(self, lim: Limits, run: _Exec, code: int, timed_out: bool, dropped: bool) -> tuple[str, ...]:
        """The limits this exec ran into (see :data:`envs.sandbox.base.LIMITS_HIT`)."""
        hit = []
        if timed_out:
            hit.append("timeout")
        if dropped:
            hit.append("output")
        if code in (-_SIGXCPU, 128 + _SIGXCPU):
            hit.append("cpu")
        if self._cgroup is not None:
            after = self._cgroup.events()
            if after.get("oom_kills", 0) > run.events.get("oom_kills", 0):
                hit.append("memory")
            refused = after.get("pids_refused", 0) - run.events.get("pids_refused", 0)
            if refused > 0 or run.own_events.get("pids_refused", 0) > 0:
                hit.append("pids")
        for name, path in self._sized_paths().items():
            if self.enforced[name] and mounts.full(path):
                hit.append(name)
        return tuple(hit)

    def _sized_paths(self) -> dict[str, str]:
        """``{"tmp": host path, "workdir": host path}`` of the sized mounts (checked for a full disk after exec)."""
        return {}

    @contextlib.contextmanager
    def _stdin(self, stdin: str | None) -> Iterator[IO[bytes] | int]:
        if stdin is None:
            yield subprocess.DEVNULL
            return
        with tempfile.TemporaryFile() as f:
            f.write(stdin.encode())
            f.seek(0)
            yield f

    def _popen_kwargs(self, stdin: Any, fds: list[int]) -> dict[str, Any]:
        return dict(
            pass_fds=tuple(fds),
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=self._popen_cwd(),
            env=self._env(),
            start_new_session=True,
        )

    def _finish(self, pid: int, run: _Exec) -> None:
        """Kill whatever the exec left behind (its cgroup, which also removes it) after the command was reaped."""
        if run.group is not None:
            run.group.kill_all()
            run.own_events = run.group.events()  # cgroup v1 counts refused forks in the exec's own group
            run.group.remove()
        with self._lock:
            self._live.discard(pid)

    def exec(
        self, cmd: list[str] | str, stdin: str | None = None, timeout: float = 10.0, limits: Limits | None = None
    ) -> ExecResult:
        """Run ``cmd`` in the workdir with ``limits``; kill it after ``timeout`` seconds (``timed_out=True``)."""
        argv, lim, run = self._prepare(cmd, limits)
        group = run.group
        start = time.monotonic()
        try:
            with self._stdin(stdin) as fin:
                proc = subprocess.Popen(argv, **self._popen_kwargs(fin, run.fds))
        except OSError as e:
            if group is not None:
                group.remove()
            raise SandboxError(f"could not start the sandboxed command: {e}") from e
        finally:
            run.close_fds()
        with self._lock:
            self._live.add(proc.pid)
        try:
            out, err, timed_out, dropped = self._collect(proc, start + timeout, lim.output_kb * 1024, group)
        finally:
            _kill_group(proc.pid)  # the command is not reaped yet, so its pid (the group id) is not reused
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
            proc.wait()
            self._finish(proc.pid, run)
        code = proc.returncode
        hits = self._hits(lim, run, code, timed_out, dropped)
        return ExecResult(_decode(out), _decode(err), code, timed_out, time.monotonic() - start, hits)

    def _collect(
        self, proc: subprocess.Popen[bytes], deadline: float, cap: int, group: SandboxCgroup | None
    ) -> tuple[bytes, bytes, bool, bool]:
        """Read both pipes (keeping ``cap`` bytes of each) until EOF, the deadline, or shortly after the exit.

        Returns stdout, stderr, whether the deadline passed, and whether output beyond ``cap`` was dropped.
        """
        bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}  # type: ignore[union-attr]
        timed_out, exited, dropped = False, False, False
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
                    else:
                        room = cap - len(bufs[key.fd])
                        dropped = dropped or len(chunk) > room
                        bufs[key.fd] += chunk[: max(room, 0)]
                if not exited and not timed_out and _exited_unreaped(proc.pid):
                    exited, end = True, min(end, time.monotonic() + _EXIT_GRACE_S)
        if not timed_out and not _exited_unreaped(proc.pid):
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0))
            except subprocess.TimeoutExpired:
                timed_out = True
                self._kill(proc.pid, group)
        out, err = bufs.values()
        return bytes(out), bytes(err), timed_out, dropped

    def launch(self, cmd: list[str] | str, limits: Limits | None = None) -> Launch:
        """Prepare a long-running command (a server talking over its pipes) inside this sandbox: the caller starts
        the returned :class:`Launch`'s ``argv`` with its ``popen_kwargs`` and calls ``started(pid)``, then
        ``ended(pid)`` once it is done with it; ``ended`` kills everything the command left (its process group and
        its cgroup). The rlimits hold as for :meth:`exec` (``cpu_s`` counts the server's whole CPU time)."""
        argv, _lim, run = self._prepare(cmd, limits)
        kwargs = self._popen_kwargs(subprocess.PIPE, run.fds)
        return Launch(argv, kwargs, self, run)

    def _launched(self, pid: int, run: _Exec) -> None:
        run.close_fds()
        with self._lock:
            self._live.add(pid)

    def _ended(self, pid: int, run: _Exec) -> None:
        _kill_group(pid)
        self._finish(pid, run)

    @staticmethod
    def _kill(pid: int, group: SandboxCgroup | None) -> None:
        _kill_group(pid)
        if group is not None:
            group.kill_all()

    async def aexec(
        self, cmd: list[str] | str, stdin: str | None = None, timeout: float = 10.0, limits: Limits | None = None
    ) -> ExecResult:
        """The awaitable twin of :meth:`exec` (asyncio subprocess; no thread is held while the command runs)."""
        argv, lim, run = self._prepare(cmd, limits)
        group = run.group
        start = time.monotonic()
        try:
            with self._stdin(stdin) as fin:
                proc = await asyncio.create_subprocess_exec(*argv, **self._popen_kwargs(fin, run.fds))
        except OSError as e:
            if group is not None:
                group.remove()
            raise SandboxError(f"could not start the sandboxed command: {e}") from e
        finally:
            run.close_fds()
        with self._lock:
            self._live.add(proc.pid)
        cap = lim.output_kb * 1024
        bufs = (bytearray(), bytearray())
        pipes = (proc.stdout, proc.stderr)
        dropped = [False, False]
        readers = [
            asyncio.ensure_future(_read_capped(s, b, cap, dropped, i))
            for i, (s, b) in enumerate(zip(pipes, bufs, strict=True))
        ]
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
            self._finish(proc.pid, run)
        code = proc.returncode if proc.returncode is not None else -signal.SIGKILL
        hits = self._hits(lim, run, code, timed_out, any(dropped))
        return ExecResult(_decode(bufs[0]), _decode(bufs[1]), code, timed_out, time.monotonic() - start, hits)

    async def _await_exit(
        self,
        proc: asyncio.subprocess.Process,
        waiter: asyncio.Future[int],
        deadline: float,
        group: SandboxCgroup | None,
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


async def _read_capped(
    stream: asyncio.StreamReader | None, buf: bytearray, cap: int, dropped: list[bool], index: int
) -> None:
    if stream is None:
        return
    while chunk := await stream.read(65536):
        room = cap - len(buf)
        if len(chunk) > room:
            dropped[index] = True
        buf += chunk[: max(room, 0)]


class Launch:
    """A long-running command prepared by :meth:`LocalSandbox.launch` (see there)."""

    def __init__(self, argv: list[str], popen_kwargs: dict[str, Any], sandbox: LocalSandbox, run: _Exec) -> None:
        self.argv, self.popen_kwargs = argv, popen_kwargs
        self._sandbox, self._run = sandbox, run

    def started(self, pid: int) -> None:
        """The command runs as ``pid`` (or failed to start: ``pid`` 0): release what only the start needed."""
        if pid:
            self._sandbox._launched(pid, self._run)
        else:
            self._run.close_fds()
            self._sandbox._finish(0, self._run)

    def ended(self, pid: int) -> None:
        """Kill what is left of the command (its process group, then its cgroup); call once, after the start."""
        self._sandbox._ended(pid, self._run)


class _Exec:
    """One exec's cgroup, the sandbox's cgroup counters before it, and the descriptors its processes inherit."""

    def __init__(self, group: SandboxCgroup | None, events: dict[str, int], fds: list[int]) -> None:
        self.group, self.events, self.fds = group, events, fds
        self.own_events: dict[str, int] = {}

    def close_fds(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []


def _make_parents(root: str, directory: str) -> list[str]:
    """Create ``directory`` (under ``root``) and its missing parents; the directories made, outermost first."""
    missing = []
    d = directory
    while d != root and not os.path.isdir(d):
        missing.append(d)
        d = os.path.dirname(d)
    for d in reversed(missing):
        os.mkdir(d)
    return list(reversed(missing))


def _empty(root: str) -> None:
    """Delete everything inside ``root`` (which stays)."""
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)


def _decode(data: bytes | bytearray) -> str:
    return bytes(data).decode("utf-8", errors="replace")
