"""The ``/etc`` a bwrap sandbox sees: a copy of the few host entries commands need, and a generated user list.

Binding each entry on its own cost ~0.3 ms per exec apiece (two dozen mounts in every new mount namespace), so the
entries are copied once per process into one directory that every sandbox binds read-only as ``/etc``. Symbolic
links are copied as links (``/etc/alternatives`` points into ``/usr``, which the sandbox sees). The copy is made
again when the host's loader cache or alternatives change; the copies are removed when the process exits.

Nothing else of the host's ``/etc`` is there: no ``shadow``, ``sudoers``, keys or service configuration.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import shutil
import tempfile
import threading

SANDBOX_UID = 1000  # the uid (and gid) commands run as inside
SANDBOX_HOME = "/tmp/sandbox"
ENTRIES = (
    "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime", "timezone", "nsswitch.conf",
    "host.conf", "hosts", "gai.conf", "protocols", "services", "mime.types", "magic", "magic.mime",
    "debian_version", "os-release", "inputrc", "profile", "bash.bashrc", "terminfo",
)  # fmt: skip
PASSWD = (
    "root:x:0:0:root:/root:/usr/sbin/nologin\n"
    f"sandbox:x:{SANDBOX_UID}:{SANDBOX_UID}:sandbox:{SANDBOX_HOME}:/bin/sh\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
)
GROUP = f"root:x:0:\nsandbox:x:{SANDBOX_UID}:\nnogroup:x:65534:\n"
_lock = threading.Lock()
_made: dict[str, object] = {}
_all: list[tuple[int, str]] = []  # (the pid that made it, path): every copy, removed at exit


@atexit.register
def _remove_all() -> None:
    for pid, path in _all:
        if pid == os.getpid():  # not from a forked child: its parent's sandboxes still bind the copy
            shutil.rmtree(path, ignore_errors=True)


def _stamp(host: str) -> tuple[float, ...]:
    """What, when it changes, calls for a new copy: the loader cache's and the alternatives' modification times."""
    out = []
    for name in ("ld.so.cache", "alternatives"):
        with contextlib.suppress(OSError):
            out.append(os.stat(os.path.join(host, name)).st_mtime)
    return tuple(out)


def _copy(host: str, dest: str) -> None:
    names = [*ENTRIES, *sorted(os.path.basename(p) for p in glob.glob(os.path.join(host, "python3*")))]
    for name in names:
        src = os.path.join(host, name)
        if os.path.islink(src):
            os.symlink(os.readlink(src), os.path.join(dest, name))
        elif os.path.isdir(src):
            shutil.copytree(src, os.path.join(dest, name), symlinks=True, ignore_dangling_symlinks=True)
        elif os.path.isfile(src):
            shutil.copy2(src, os.path.join(dest, name))
    for name, text in (("passwd", PASSWD), ("group", GROUP)):
        with open(os.path.join(dest, name), "w") as f:
            f.write(text)
    for root, dirs, files in os.walk(dest):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o755)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o644)
    os.chmod(dest, 0o755)


def sandbox_etc(host: str = "/etc") -> str:
    """The directory to bind as the sandbox's ``/etc`` (made on first use; made again when the host's changed)."""
    stamp = _stamp(host)
    with _lock:
        path = _made.get("path")
        if isinstance(path, str) and _made.get("stamp") == stamp and os.path.isdir(path):
            return path
        new = tempfile.mkdtemp(prefix="agentflow-sbx-etc-")
        try:
            _copy(host, new)
        except BaseException:
            shutil.rmtree(new, ignore_errors=True)
            raise
        _all.append((os.getpid(), new))  # an older copy stays until exit: running execs still see it as /etc
        _made.update(path=new, stamp=stamp)
        return new
