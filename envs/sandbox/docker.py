"""The ``docker`` sandbox: one container per sandbox, driven through the ``docker`` SDK.

The container makes the bwrap sandbox's promises: no network (``network_mode="none"``), a read-only root
filesystem, every capability dropped, ``no-new-privileges``, the image's non-root user (the local image runs as
``sandbox``, uid 1000), the same seccomp filter (:mod:`envs.sandbox.seccomp`, as the container's profile), memory
(``sandbox_memory_mb``, swap included) and pids limits for the whole container, and ``docker-init`` as pid 1 so
orphans are reaped. ``/tmp`` and ``/dev/shm`` are private tmpfs mounts of ``tmp_mb`` each, and the workdir ``/work``
is a volume of the ``local`` driver backed by a ``workdir_mb`` tmpfs (a volume, not a tmpfs mount, so that file
put/get through tar archives see it). Where the engine runs on this machine, the limits an exec hits are read from
the container's cgroups and mounts (through ``/proc/PID``) and reported in ``limits_hit``.

Each ``exec`` runs ``sh -c WRAPPER`` which sets the per-process rlimits (``ulimit -v -t -f -c``), runs the command,
then kills whatever the command left behind. Every process of one exec carries an environment marker
(``AGENTFLOW_EXEC=<token>``) that survives ``setsid``; on timeout a second exec kills every process with the marker.
A process that scrubs its own environment escapes that per-exec kill, but not :meth:`DockerSandbox.close` (the
container is removed) and not the container's pids limit. Should the killer itself fail to start (a fork bomb holding
every pid of the container), the container is restarted: the workdir volume survives, ``/tmp`` does not.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import io
import os
import posixpath
import selectors
import socket
import struct
import tarfile
import threading
import time
import uuid
import weakref
from typing import Any

from envs.errors import SandboxError
from envs.sandbox import mounts
from envs.sandbox.base import ExecResult, Limits, cmd_argv
from envs.sandbox.cgroup import SandboxCgroup
from envs.sandbox.image import IMAGE_TAG, SANDBOX_UID, SANDBOX_WORKDIR, ensure_image
from envs.sandbox.seccomp import docker_profile

INSTALL_HINT = "install the SDK with `pip install docker` (extra `agentflow[docker]`) and a docker engine"
LABEL = "agentflow.sandbox"
MARKER = "AGENTFLOW_EXEC"
_MB = 1024 * 1024
_POLL_S = 0.05
_EXIT_GRACE_S = 0.2  # after the command exits, how long to wait for output still held by leftovers
_KILL_GRACE_S = 1.0  # after a kill, how long to wait for the stream to end before dropping it
_BASE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
# Kills every process whose environment holds the marker ($1 = token), a few rounds (forks race the scan).
_KILLER = (
    "i=0; while [ $i -lt 20 ]; do i=$((i+1)); found=; "
    'for f in $(grep -lsxz "' + MARKER + '=$1" /proc/[0-9]*/environ); do '
    'p=${f#/proc/}; kill -9 ${p%/environ} 2>/dev/null && found=1; done; [ -z "$found" ] && break; done; exit "$0"'
)
# $0 = token, $1 = the killer script, $2..$4 = the rlimits, then the command. The shell stays the parent of the
# command so that it can kill the leftovers afterwards (as a process without the marker).
_WRAPPER = (
    "t=$0; k=$1; ulimit -v $2 && ulimit -S -t $3 && ulimit -H -t $(($3+1)) && ulimit -f $4 && ulimit -c 0 || exit 125; "
    'shift 4; "$@"; '
    "rc=$?; exec env -u " + MARKER + ' /bin/sh -c "$k" "$rc" "$t"'
)
_EXECUTOR: concurrent.futures.ThreadPoolExecutor | None = None
_EXECUTOR_LOCK = threading.Lock()


def _docker_module() -> Any:
    try:
        import docker
    except ImportError as e:
        raise SandboxError(f"sandbox kind 'docker' needs the docker SDK; {INSTALL_HINT}") from e
    return docker


@functools.cache
def docker_client(base_url: str | None = None) -> Any:
    """A shared ``docker.DockerClient`` for ``base_url`` (default: ``$DOCKER_HOST`` or the standard socket)."""
    docker = _docker_module()
    url = base_url or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    try:
        client = docker.DockerClient(base_url=url, version="auto", timeout=60, max_pool_size=64)
        client.ping()
    except Exception as e:  # noqa: BLE001 - the SDK raises several unrelated types when no engine answers
        raise SandboxError(f"no docker engine answers at {url}: {e}") from e
    return client


def docker_works(base_url: str | None = None) -> bool:
    """True when the docker SDK is installed and an engine answers at ``base_url``."""
    try:
        docker_client(base_url)
    except SandboxError:
        return False
    return True


@functools.cache
def _image_user(client: Any, image: str) -> str:
    """The image's configured user, or ``""`` when it runs as root."""
    user = (client.images.get(image).attrs.get("Config") or {}).get("User") or ""
    return "" if user.split(":")[0] in ("", "0", "root") else user


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="docker-exec")
        return _EXECUTOR


def _remove_container(container: Any, volume: Any = None) -> None:
    with contextlib.suppress(Exception):
        container.remove(force=True, v=True)
    if volume is not None:
        with contextlib.suppress(Exception):
            volume.remove(force=True)


class _Demux:
    """Splits docker's multiplexed attach stream into stdout and stderr, keeping at most ``cap`` bytes of each."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.pending = bytearray()
        self.out = {1: bytearray(), 2: bytearray()}
        self.dropped = False

    def feed(self, data: bytes) -> None:
        self.pending += data
        while len(self.pending) >= 8:
            kind, size = struct.unpack(">BxxxL", self.pending[:8])
            if len(self.pending) < 8 + size:
                return
            buf = self.out.get(kind)
            if buf is not None:
                room = max(self.cap - len(buf), 0)
                self.dropped = self.dropped or size > room
                buf += self.pending[8 : 8 + min(size, room)]
            del self.pending[: 8 + size]

    def text(self, kind: int) -> str:
        return bytes(self.out[kind]).decode("utf-8", errors="replace")


class _HostView:
    """A container seen from this machine (when its engine runs here): its cgroups' counters and its mounts."""

    def __init__(self, pid: int) -> None:
        self.cgroup = SandboxCgroup.of_process(pid)
        self.root = f"/proc/{pid}/root"

    @classmethod
    def of(cls, container: Any) -> _HostView | None:
        with contextlib.suppress(Exception):
            container.reload()
            pid = int(container.attrs["State"]["Pid"])
            if pid > 0 and os.access(f"/proc/{pid}/root{SANDBOX_WORKDIR}", os.R_OK):
                return cls(pid)
        return None

    def events(self) -> dict[str, int]:
        return self.cgroup.events() if self.cgroup is not None else {}

    def hits(self, before: dict[str, int]) -> list[str]:
        """The sandbox-wide limits hit since ``before`` (an :meth:`events` reading) or full now."""
        after, hit = self.events(), []
        for key, name in (("oom_kills", "memory"), ("pids_refused", "pids")):
            if after.get(key, 0) > before.get(key, 0):
                hit.append(name)
        if mounts.full(self.root + "/tmp") or mounts.full(self.root + "/dev/shm"):
            hit.append("tmp")
        if mounts.full(self.root + SANDBOX_WORKDIR):
            hit.append("workdir")
        return hit


class DockerSandbox:
    """A container with network off, read-only root, no capabilities, seccomp, sized scratch and workdir (module doc).

    ``memory_mb`` (default ``limits.sandbox_memory_mb``) is the memory cgroup of the whole container, ``cpus`` its
    CPU share, ``tmp_mb`` (default ``limits.tmp_mb``) the size of ``/tmp`` and of ``/dev/shm``; ``limits`` also gives
    the per-process rlimits of each exec, the container's pids limit and the workdir's size (``workdir_mb``).
    """

    kind = "docker"
    pids_limit_enforced = True
    enforced = {"pids": True, "memory": True, "tmp": True, "workdir": True}
    """Every sandbox-wide cap holds in a container (the engine enforces them)."""

    def __init__(
        self,
        limits: Limits | None = None,
        env: dict[str, str] | None = None,
        image: str = IMAGE_TAG,
        base_url: str | None = None,
        user: str | None = None,
        memory_mb: int | None = None,
        cpus: float = 1.0,
        tmp_mb: int | None = None,
    ) -> None:
        self.limits = limits or Limits()
        self.client = docker_client(base_url)
        self.image = ensure_image(self.client, image) if image == IMAGE_TAG else image
        self.user = _image_user(self.client, self.image) if user is None else user
        self._extra_env = dict(env or {})
        self._pids_max = self.limits.max_procs
        self._memory_fixed = memory_mb is not None
        self._memory_mb = memory_mb or self.limits.sandbox_memory_mb
        self._closed = False
        self._lock = threading.Lock()
        self.volume = self._make_volume(self.limits.workdir_mb)
        try:
            self.container = self._start_container(self._memory_mb, cpus, tmp_mb or self.limits.tmp_mb)
        except BaseException:
            _remove_container(None, self.volume)
            raise
        self._finalizer = weakref.finalize(self, _remove_container, self.container, self.volume)
        self._host = _HostView.of(self.container)

    @property
    def workdir(self) -> str:
        """``/work``: the workdir as commands inside see it."""
        return SANDBOX_WORKDIR

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._closed

    def _make_volume(self, workdir_mb: int) -> Any:
        """The workdir: a ``local`` volume backed by a tmpfs of ``workdir_mb``, owned by the sandbox's user."""
        uid = SANDBOX_UID if self.user else 0
        opts = {"type": "tmpfs", "device": "tmpfs", "o": f"size={workdir_mb}m,uid={uid},gid={uid},mode=0755"}
        labels = {LABEL: "1", f"{LABEL}.pid": str(os.getpid())}
        try:
            return self.client.volumes.create(
                name=f"agentflow-sbx-{uuid.uuid4().hex[:16]}", driver="local", driver_opts=opts, labels=labels
            )
        except Exception as e:  # noqa: BLE001 - docker.errors and connection errors alike
            raise SandboxError(f"could not create the sandbox's workdir volume: {e}") from e

    def _start_container(self, memory_mb: int, cpus: float, tmp_mb: int) -> Any:
        docker = _docker_module()
        kw: dict[str, Any] = dict(
            command=["sleep", "infinity"],
            detach=True,
            init=True,
            network_mode="none",
            read_only=True,
            tmpfs={"/tmp": f"rw,nosuid,nodev,size={tmp_mb}m,mode=1777"},
            shm_size=f"{tmp_mb}m",
            mounts=[docker.types.Mount(SANDBOX_WORKDIR, self.volume.name, type="volume")],
            working_dir=SANDBOX_WORKDIR,
            mem_limit=f"{memory_mb}m",
            memswap_limit=f"{memory_mb}m",
            pids_limit=self._pids_max,
            nano_cpus=int(cpus * 1e9),
            cap_drop=["ALL"],
            security_opt=["no-new-privileges", f"seccomp={docker_profile()}"],
            user=self.user,
            hostname="sandbox",
            labels={LABEL: "1", f"{LABEL}.pid": str(os.getpid())},
        )
        try:
            return self.client.containers.run(self.image, **kw)
        except docker.errors.DockerException as e:
            raise SandboxError(f"could not start a sandbox container from {self.image!r}: {e}") from e

    # -- exec --------------------------------------------------------------------------------------------------
    def exec(
        self, cmd: list[str] | str, stdin: str | None = None, timeout: float = 10.0, limits: Limits | None = None
    ) -> ExecResult:
        """Run ``cmd`` in ``/work`` with ``limits``; kill its processes after ``timeout`` seconds (``timed_out``)."""
        if self._closed:
            raise SandboxError("the sandbox is closed")
        lim = limits or self.limits
        self._apply(lim)
        token = uuid.uuid4().hex
        rl = [str(lim.memory_mb * 1024), str(lim.cpu_s), str(lim.file_size_mb * 2048)]  # KiB, s, 512-byte blocks
        argv = ["/bin/sh", "-c", _WRAPPER, token, _KILLER, *rl, *cmd_argv(cmd)]
        env = {**_BASE_ENV, "HOME": SANDBOX_WORKDIR, "TMPDIR": "/tmp", **self._extra_env, MARKER: token}
        host = self._host
        before = host.events() if host is not None else {}
        start = time.monotonic()
        try:
            exec_id = self.client.api.exec_create(
                self.container.id, argv, stdin=stdin is not None, environment=env, workdir=SANDBOX_WORKDIR
            )["Id"]
            sock = self.client.api.exec_start(exec_id, socket=True)
        except Exception as e:  # noqa: BLE001 - docker.errors and connection errors alike
            raise SandboxError(f"could not start the command in the container: {e}") from e
        raw = getattr(sock, "_sock", sock)
        demux = _Demux(lim.output_kb * 1024)
        try:
            timed_out = self._pump(raw, exec_id, token, (stdin or "").encode() if stdin is not None else None, demux,
                                   start + timeout)  # fmt: skip
        finally:
            with contextlib.suppress(OSError):
                sock.close()
        code = -9 if timed_out else self._exit_code(exec_id)
        hits = ["timeout"] * timed_out + ["output"] * demux.dropped + ["cpu"] * (code == 128 + 24)
        hits += host.hits(before) if host is not None else []
        return ExecResult(demux.text(1), demux.text(2), code, timed_out, time.monotonic() - start, tuple(hits))

    def _pump(
        self, raw: socket.socket, exec_id: str, token: str, data: bytes | None, demux: _Demux, deadline: float
    ) -> bool:
        """Feed stdin and read the stream until EOF, the deadline or shortly after the exit; True on timeout."""
        raw.setblocking(False)
        sent, end, timed_out, exited = 0, deadline, False, False
        with selectors.DefaultSelector() as sel:
            sel.register(raw, selectors.EVENT_READ | (selectors.EVENT_WRITE if data is not None else 0))
            while True:
                now = time.monotonic()
                if now >= end:
                    if exited or timed_out:
                        self._kill_marked(token)  # leftovers still hold the stream
                        return timed_out
                    timed_out, end = True, now + _KILL_GRACE_S
                    self._kill_marked(token)
                    continue
                events = sel.select(min(end - now, _POLL_S))
                for _, mask in events:
                    if mask & selectors.EVENT_WRITE and data is not None:
                        sent = self._send_stdin(raw, data, sent)
                        if sent >= len(data):
                            data = None
                            sel.modify(raw, selectors.EVENT_READ)
                    if mask & selectors.EVENT_READ:
                        chunk = self._recv(raw)
                        if chunk == b"":
                            return timed_out
                        demux.feed(chunk or b"")
                if not events and not exited and not timed_out and not self._running(exec_id):
                    exited, end = True, min(end, time.monotonic() + _EXIT_GRACE_S)

    @staticmethod
    def _send_stdin(raw: socket.socket, data: bytes, sent: int) -> int:
        try:
            sent += raw.send(data[sent : sent + 65536])
        except BlockingIOError:
            return sent
        except OSError:
            return len(data)  # the command closed its stdin: drop the rest
        if sent >= len(data):
            with contextlib.suppress(OSError):
                raw.shutdown(socket.SHUT_WR)
        return sent

    @staticmethod
    def _recv(raw: socket.socket) -> bytes | None:
        try:
            return raw.recv(262144)
        except BlockingIOError:
            return None
        except OSError:
            return b""

    def _running(self, exec_id: str) -> bool:
        try:
            return bool(self.client.api.exec_inspect(exec_id).get("Running"))
        except Exception:  # noqa: BLE001
            return False

    def _exit_code(self, exec_id: str) -> int:
        try:
            code = self.client.api.exec_inspect(exec_id).get("ExitCode")
        except Exception:  # noqa: BLE001
            return -9
        return -9 if code is None else int(code)

    def _kill_marked(self, token: str) -> None:
        """Kill every process of one exec (by its marker); restart the container when even that cannot run."""
        try:
            r = self.container.exec_run(["/bin/sh", "-c", _KILLER, "0", token], environment=dict(_BASE_ENV))
            if r.exit_code == 0:
                return
        except Exception:  # noqa: BLE001 - e.g. no pid left to start the killer under a fork bomb
            pass
        with contextlib.suppress(Exception):
            if not self._closed:
                self.container.restart(timeout=0)
                self._host = _HostView.of(self.container)  # a new init process

    def _apply(self, lim: Limits) -> None:
        """Follow the exec's pids and memory limits (the sizes of ``/tmp`` and the workdir are fixed at start)."""
        with self._lock:
            if lim.max_procs != self._pids_max:
                self._update({"PidsLimit": lim.max_procs})
                self._pids_max = lim.max_procs
            if not self._memory_fixed and lim.sandbox_memory_mb != self._memory_mb:
                mem = lim.sandbox_memory_mb * _MB
                self._update({"Memory": mem, "MemorySwap": mem})
                self._memory_mb = lim.sandbox_memory_mb

    def _update(self, body: dict[str, int]) -> None:
        """``POST /containers/ID/update`` (the SDK's ``update`` has no pids limit)."""
        api = self.client.api
        try:
            api._raise_for_status(api._post_json(api._url("/containers/{0}/update", self.container.id), data=body))
        except Exception as e:  # noqa: BLE001
            raise SandboxError(f"could not change the sandbox container's limits {body}: {e}") from e

    async def aexec(
        self, cmd: list[str] | str, stdin: str | None = None, timeout: float = 10.0, limits: Limits | None = None
    ) -> ExecResult:
        """The awaitable twin of :meth:`exec` (runs it on a shared pool of 64 threads)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(_executor(), functools.partial(self.exec, cmd, stdin, timeout, limits))

    # -- files -------------------------------------------------------------------------------------------------
    def _inside(self, path: str) -> str:
        if self._closed:
            raise SandboxError("the sandbox is closed")
        if not path:
            raise SandboxError("empty path")
        full = posixpath.normpath(posixpath.join(SANDBOX_WORKDIR, path))
        if full == SANDBOX_WORKDIR or not full.startswith(SANDBOX_WORKDIR + "/"):
            raise SandboxError(f"path {path!r} escapes the sandbox workdir")
        return full

    def put_file(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` relative to ``/work`` (parents created, owned by the sandbox user)."""
        rel = posixpath.relpath(self._inside(path), SANDBOX_WORKDIR)
        uid = SANDBOX_UID if self.user else 0
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            parts = rel.split("/")
            for i in range(1, len(parts)):
                info = tarfile.TarInfo("/".join(parts[:i]))
                info.type, info.mode, info.uid, info.gid = tarfile.DIRTYPE, 0o755, uid, uid
                tar.addfile(info)
            info = tarfile.TarInfo(rel)
            info.size, info.mode, info.uid, info.gid, info.mtime = len(data), 0o644, uid, uid, int(time.time())
            tar.addfile(info, io.BytesIO(data))
        try:
            ok = self.container.put_archive(SANDBOX_WORKDIR, buf.getvalue())
        except Exception as e:  # noqa: BLE001
            raise SandboxError(f"could not write {path!r} into the sandbox: {e}") from e
        if not ok:
            raise SandboxError(f"could not write {path!r} into the sandbox")

    def get_file(self, path: str) -> bytes:
        """Read the regular file ``path`` relative to ``/work`` (a symlink is refused)."""
        full = self._inside(path)
        docker = _docker_module()
        try:
            chunks, _ = self.container.get_archive(full)
            blob = b"".join(chunks)
        except docker.errors.NotFound as e:
            raise SandboxError(f"no such file in the sandbox: {path!r}") from e
        except Exception as e:  # noqa: BLE001
            raise SandboxError(f"could not read {path!r} from the sandbox: {e}") from e
        with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
            member = tar.next()
            if member is None or not member.isreg():
                raise SandboxError(f"{path!r} is not a regular file in the sandbox workdir")
            f = tar.extractfile(member)
            return f.read() if f is not None else b""

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Kill every process but the container's own and empty ``/work`` and ``/tmp``: a fresh sandbox again."""
        if self._closed:
            raise SandboxError("the sandbox is closed")
        script = (
            "for p in $(ls /proc | grep -x '[0-9]*'); do [ $p -gt 1 ] && [ $p != $$ ] && "
            '[ "$(cat /proc/$p/cmdline 2>/dev/null | tr "\\0" " ")" != "sleep infinity " ] && kill -9 $p 2>/dev/null; '
            "done; find /work /tmp -mindepth 1 -delete 2>/dev/null; true"
        )
        r = self.container.exec_run(["/bin/sh", "-c", script], environment=dict(_BASE_ENV))
        if r.exit_code != 0:
            raise SandboxError(f"could not reset the sandbox: {r.output[-500:]!r}")

    def close(self) -> None:
        """Remove the container (killing everything in it) and its workdir volume. Safe to call twice."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> DockerSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
