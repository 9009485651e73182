"""The default sandbox: bubblewrap (``bwrap``) namespaces around every command.

Inside: no network (an empty network namespace, so the host's loopback services are not reachable), the host
filesystem read-only (``--ro-bind / /``), a private ``/tmp`` (tmpfs), fresh ``/proc`` and ``/dev``, and a private
read-write workdir at ``/tmp/sandbox`` (a host temp dir bound there, deleted on close). Each command runs in its own
pid namespace whose pid 1 is ``bwrap`` (as root the namespace comes from util-linux ``unshare --pid --fork
--mount-proc``, see :meth:`BwrapSandbox._wrap`), so killing it kills everything inside.
"""

from __future__ import annotations

import functools
import os
import shutil

from envs.errors import SandboxError
from envs.sandbox.base import Limits
from envs.sandbox.local import LocalSandbox

SANDBOX_WORKDIR = "/tmp/sandbox"  # under the private /tmp: the read-only host root cannot get a new top-level dir
INSTALL_HINT = "install it with `apt-get install bubblewrap`, or use make_sandbox('process') (no network isolation)"


def bwrap_path() -> str | None:
    """The path of the ``bwrap`` executable, or None when bubblewrap is not installed."""
    return shutil.which("bwrap")


@functools.cache
def bwrap_works() -> bool:
    """True when bubblewrap is installed and can create namespaces here (checked once per process)."""
    if bwrap_path() is None:
        return False
    try:
        with BwrapSandbox(use_cgroup=False) as sandbox:
            return sandbox.exec(["true"], timeout=10).ok
    except (OSError, SandboxError):
        return False


class BwrapSandbox(LocalSandbox):
    """A bubblewrap sandbox: network off, read-only host, private ``/tmp`` and ``/tmp/sandbox`` workdir, limits.

    ``pids_limit_enforced`` says whether a pids cgroup caps the number of processes (fork bombs); where the
    machine forbids cgroups the other limits still hold.
    """

    kind = "bwrap"

    def __init__(
        self,
        limits: Limits | None = None,
        env: dict[str, str] | None = None,
        use_cgroup: bool = True,
        extra_args: list[str] | None = None,
    ) -> None:
        exe = bwrap_path()
        if exe is None:
            raise SandboxError(f"bubblewrap (bwrap) is not installed; {INSTALL_HINT}")
        self._bwrap = exe
        unshare = shutil.which("unshare")
        self._unshare = unshare or "unshare"
        self._use_unshare = unshare is not None and os.geteuid() == 0
        self._extra_args = list(extra_args or [])
        super().__init__(limits=limits, env=env, use_cgroup=use_cgroup)

    @property
    def workdir(self) -> str:
        """``/tmp/sandbox``: the workdir as commands inside see it."""
        return SANDBOX_WORKDIR

    def _popen_cwd(self) -> str | None:
        return None

    def _wrap(self, argv: list[str]) -> list[str]:
        common = [
            "--die-with-parent",
            "--new-session",
            "--ro-bind", "/", "/",
            "--tmpfs", "/tmp",
            "--proc", "/proc",
            "--dev", "/dev",
            "--bind", self.host_workdir, SANDBOX_WORKDIR,
            "--chdir", SANDBOX_WORKDIR,
            "--hostname", "sandbox",
            *self._extra_args,
            "--",
            *argv,
        ]  # fmt: skip
        if self._use_unshare:
            # bwrap's own pid namespace leaves its pid-1 helper as an orphan zombie that a container's pid 1 may
            # never reap (each one holds a pid of the sandbox's pids cgroup). So `unshare` makes the pid namespace
            # (and waits for bwrap, its child) and mounts a fresh /proc there, which bwrap then binds.
            ns = ["--unshare-ipc", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
            return [self._unshare, "--pid", "--fork", "--kill-child", "--mount-proc", "--", self._bwrap, *ns, *common]
        return [self._bwrap, "--unshare-all", *common]
