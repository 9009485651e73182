"""Sandboxes that run commands with limits: ``bwrap`` (default, isolated) and ``process`` (fallback, not isolated)."""

from __future__ import annotations

from typing import Any

from envs.errors import SandboxError
from envs.sandbox.base import ExecResult, Limits, Sandbox
from envs.sandbox.bwrap import INSTALL_HINT, BwrapSandbox, bwrap_path, bwrap_works
from envs.sandbox.process import ProcessSandbox

SANDBOX_KINDS = ("bwrap", "process")

__all__ = [
    "SANDBOX_KINDS",
    "BwrapSandbox",
    "ExecResult",
    "Limits",
    "ProcessSandbox",
    "Sandbox",
    "bwrap_works",
    "make_sandbox",
]


def make_sandbox(kind: str = "bwrap", **kw: Any) -> BwrapSandbox | ProcessSandbox:
    """Create a sandbox of ``kind`` (``"bwrap"`` or ``"process"``); keyword arguments go to its constructor."""
    if kind == "bwrap":
        if bwrap_path() is None:
            raise SandboxError(f"sandbox kind 'bwrap' needs bubblewrap, which is not installed; {INSTALL_HINT}")
        return BwrapSandbox(**kw)
    if kind == "process":
        return ProcessSandbox(**kw)
    raise SandboxError(f"unknown sandbox kind {kind!r}; available kinds: {', '.join(SANDBOX_KINDS)}")
