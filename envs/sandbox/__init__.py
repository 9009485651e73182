"""Sandboxes that run commands with limits: ``bwrap`` (default, isolated), ``docker`` (one container per sandbox)
and ``process`` (fallback, not isolated); :class:`SandboxPool` keeps sandboxes started ahead of use.

``bwrap`` and ``docker`` make the same promises, whether the host runs as root or not: no privilege inside (an
unprivileged uid, no capabilities, the :mod:`envs.sandbox.seccomp` filter), a minimal read-only view, no network, and
caps on the whole sandbox's memory, processes, ``/tmp`` and workdir (see :class:`Limits` and each kind's module).
"""

from __future__ import annotations

from typing import Any

from envs.errors import SandboxError
from envs.sandbox.base import ExecResult, Limits, Sandbox
from envs.sandbox.bwrap import INSTALL_HINT, BwrapSandbox, bwrap_path, bwrap_works
from envs.sandbox.docker import DockerSandbox, docker_works
from envs.sandbox.pool import SandboxPool
from envs.sandbox.process import ProcessSandbox

SANDBOX_KINDS = ("bwrap", "docker", "process")

__all__ = [
    "SANDBOX_KINDS",
    "BwrapSandbox",
    "DockerSandbox",
    "ExecResult",
    "Limits",
    "ProcessSandbox",
    "Sandbox",
    "SandboxPool",
    "bwrap_works",
    "docker_works",
    "make_sandbox",
]


def make_sandbox(kind: str = "bwrap", **kw: Any) -> BwrapSandbox | DockerSandbox | ProcessSandbox:
    """Create a sandbox of ``kind`` (``"bwrap"``, ``"docker"`` or ``"process"``); keywords go to its constructor.

    ``docker`` takes ``base_url`` (default ``$DOCKER_HOST``) and ``image`` (default: the local image, built on first
    use); see :class:`DockerSandbox`.
    """
    if kind == "bwrap":
        if bwrap_path() is None:
            raise SandboxError(f"sandbox kind 'bwrap' needs bubblewrap, which is not installed; {INSTALL_HINT}")
        return BwrapSandbox(**kw)
    if kind == "docker":
        return DockerSandbox(**kw)
    if kind == "process":
        return ProcessSandbox(**kw)
    raise SandboxError(f"unknown sandbox kind {kind!r}; available kinds: {', '.join(SANDBOX_KINDS)}")
