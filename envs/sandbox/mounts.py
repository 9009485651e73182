"""Sized tmpfs mounts on the host, for a sandbox's workdir and scratch space (``/tmp``, ``/dev/shm``).

Mounting needs ``CAP_SYS_ADMIN`` (the host runs as root, as CI does); :func:`mount_tmpfs` returns False where the
machine refuses, and the caller then keeps a plain directory and reports the cap as not enforced. The mounts are
made with ``mount(2)`` directly (no process start) and removed with a lazy unmount on close; those of a process that
died without closing its sandboxes (their directory names carry its pid) are removed by the next process's first
sandbox (:func:`sweep_leftovers`). A tmpfs's pages are
charged to the memory cgroup of the process that writes them, so a sandbox's files also count toward its memory cap.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import re
import shutil

_MS_NOSUID, _MS_NODEV, _MS_REMOUNT = 0x2, 0x4, 0x20
_MNT_DETACH = 0x2


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _options(size_mb: int, uid: int | None, mode: int) -> bytes:
    opts = f"size={size_mb}m,mode={mode:o}"
    if uid is not None:
        opts += f",uid={uid},gid={uid}"
    return opts.encode()


def mount_tmpfs(path: str, size_mb: int, uid: int | None = None, mode: int = 0o700) -> bool:
    """Mount a ``size_mb`` tmpfs (``nosuid,nodev``) owned by ``uid`` on ``path``; False where that is not allowed."""
    if os.geteuid() != 0:
        return False
    rc = _libc().mount(b"tmpfs", path.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, _options(size_mb, uid, mode))
    return rc == 0


def resize_tmpfs(path: str, size_mb: int) -> bool:
    """Change the size of the tmpfs on ``path`` (False when refused, e.g. below what its files already use)."""
    flags = _MS_REMOUNT | _MS_NOSUID | _MS_NODEV
    return _libc().mount(b"tmpfs", path.encode(), b"tmpfs", flags, f"size={size_mb}m".encode()) == 0


def unmount(path: str) -> None:
    """Lazily unmount ``path`` (its files are freed once nothing holds them); a no-op when nothing is mounted."""
    _libc().umount2(path.encode(), _MNT_DETACH)


def full(path: str, slack_kb: int = 64) -> bool:
    """True when the filesystem of ``path`` has at most ``slack_kb`` free (its size cap was reached)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize <= slack_kb * 1024


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@functools.cache
def sweep_leftovers(prefix: str = "agentflow-sbx-") -> int:
    """Unmount and delete the sandbox mounts left by dead processes (``/tmp/PREFIX<pid>-...``); once per process.

    Returns how many mounts were removed. A pid that was reused since looks alive: its leftovers stay (safe).
    """
    pattern = re.compile(rf"^(/.*/{re.escape(prefix)}(\d+)-[^/]+)/[^/]+$")
    found: dict[str, int] = {}
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            match = pattern.match(fields[4]) if len(fields) > 4 else None
            if match and " - tmpfs " in line and int(match.group(2)) != os.getpid():
                found[fields[4]] = int(match.group(2))
    removed = 0
    for path, pid in found.items():
        if not _alive(pid):
            unmount(path)
            removed += 1
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    return removed
