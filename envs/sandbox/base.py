"""Sandbox contracts: resource limits, the result of one command, and the :class:`Sandbox` protocol."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from envs.errors import SandboxError


@dataclass(frozen=True)
class Limits:
    """Resource limits of a sandbox and of every process of one ``exec``.

    Per process: ``memory_mb`` is the address-space limit (RLIMIT_AS), ``cpu_s`` the CPU-time limit (RLIMIT_CPU),
    ``file_size_mb`` the largest file a process may write (RLIMIT_FSIZE). For the whole sandbox: ``max_procs`` caps
    the processes and threads (a pids cgroup), ``sandbox_memory_mb`` the memory of all its processes together (a
    memory cgroup; its files in ``/tmp`` and the workdir count too), ``tmp_mb`` the scratch space (``/tmp`` and
    ``/dev/shm`` together) and ``workdir_mb`` the workdir (sized tmpfs mounts), each where the machine allows: the
    sandbox's ``enforced`` says which hold. ``output_kb`` caps how much of stdout and of stderr is kept (the rest is
    read and dropped so the command never blocks on a full pipe). The sandbox-wide caps follow the limits of the
    latest ``exec``.
    """

    memory_mb: int = 512
    cpu_s: int = 10
    file_size_mb: int = 16
    max_procs: int = 64
    output_kb: int = 1024
    sandbox_memory_mb: int = 1024
    tmp_mb: int = 64
    workdir_mb: int = 256

    def __post_init__(self) -> None:
        for name in LIMIT_FIELDS:
            if getattr(self, name) <= 0:
                raise ValueError(f"Limits.{name} must be > 0, got {getattr(self, name)}")


LIMIT_FIELDS = (
    "memory_mb", "cpu_s", "file_size_mb", "max_procs", "output_kb", "sandbox_memory_mb", "tmp_mb", "workdir_mb",
)  # fmt: skip
LIMITS_HIT = ("timeout", "output", "cpu", "memory", "pids", "tmp", "workdir")
"""What :attr:`ExecResult.limits_hit` may name: the limits an exec ran into."""


@dataclass
class ExecResult:
    """What one command did: its output (decoded as UTF-8 with replacement), exit code and timing.

    ``exit_code`` is negative (``-signal``) when the process was killed by a signal, as in :mod:`subprocess`.
    ``limits_hit`` names the limits the exec ran into (see :data:`LIMITS_HIT`): ``"timeout"``, ``"output"`` (some
    output was dropped), ``"cpu"`` (RLIMIT_CPU), ``"memory"`` (the sandbox's memory cap killed a process),
    ``"pids"`` (a fork was refused), ``"tmp"`` / ``"workdir"`` (that space is full).
    """

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool
    duration_s: float
    limits_hit: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """True when the command exited 0 within its time."""
        return self.exit_code == 0 and not self.timed_out


@runtime_checkable
class Sandbox(Protocol):
    """An isolated place to run commands: ``exec`` / ``aexec``, file put/get relative to ``workdir``, ``close``."""

    workdir: str
    """The working directory as commands inside the sandbox see it."""

    def exec(
        self, cmd: list[str] | str, stdin: str | None = None, timeout: float = 10.0, limits: Limits | None = None
    ) -> ExecResult:
        """Run ``cmd`` (a string runs via ``/bin/sh -c``) in ``workdir``; never raises for the command's failure."""
        ...

    async def aexec(
        self, cmd: list[str] | str, stdin: str | None = None, timeout: float = 10.0, limits: Limits | None = None
    ) -> ExecResult:
        """The awaitable twin of :meth:`exec`."""
        ...

    def put_file(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` (relative to ``workdir``), creating parent directories."""
        ...

    def get_file(self, path: str) -> bytes:
        """Read ``path`` (relative to ``workdir``)."""
        ...

    def close(self) -> None:
        """Kill everything still running and delete the workdir. Safe to call twice."""
        ...


def resolve_inside(root: str, path: str, inside_workdir: str | None = None) -> str:
    """Map ``path`` (relative to the workdir, or absolute under ``inside_workdir``) to a host path under ``root``.

    Raises :class:`SandboxError` when the path (after resolving ``..`` and symlinks) would leave ``root``.
    """
    if not path:
        raise SandboxError("empty path")
    rel = path
    if os.path.isabs(path):
        base = inside_workdir if inside_workdir is not None else root
        if os.path.commonpath([base, os.path.normpath(path)]) != base:
            raise SandboxError(f"path {path!r} is outside the sandbox workdir {base!r}")
        rel = os.path.relpath(os.path.normpath(path), base)
    real_root = os.path.realpath(root)
    host = os.path.realpath(os.path.join(real_root, rel))
    if host == real_root or os.path.commonpath([real_root, host]) != real_root:
        raise SandboxError(f"path {path!r} escapes the sandbox workdir")
    return host


def cmd_argv(cmd: list[str] | str) -> list[str]:
    """The argv for ``cmd``: a string runs through ``/bin/sh -c``; a list is used as is."""
    if isinstance(cmd, str):
        return ["/bin/sh", "-c", cmd]
    if not cmd or not all(isinstance(a, str) for a in cmd):
        raise SandboxError("cmd must be a non-empty list of strings or a shell string")
    return list(cmd)
