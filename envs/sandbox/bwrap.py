"""The default sandbox: bubblewrap (``bwrap``) namespaces, no capabilities and a seccomp filter around every command.

What a command inside gets, whether the host runs as root or not:

- **No privilege.** It runs as ``sandbox`` (uid 1000) in its own user namespace, with every capability dropped
  (``--cap-drop ALL``, bounding set empty), ``no_new_privs``, no way to make further user namespaces, and the
  :mod:`envs.sandbox.seccomp` filter (no mount, ``setns``/``unshare``, ``ptrace``, key-ring, ``bpf``...). As root
  the host drops to ``nobody`` (uid 65534) before ``bwrap`` starts, so the sandbox's processes are ``nobody`` on the
  host too; elsewhere they are the calling user.
- **A minimal filesystem view**, read-only: ``/usr`` with the ``/bin``, ``/lib*`` and ``/sbin`` links, an
  allow-listed copy of ``/etc`` (:mod:`envs.sandbox.etc`), its own ``/proc`` (of its own pid namespace; it cannot be
  unmounted) and a minimal ``/dev``. No ``/root``, ``/home``, ``/etc/shadow``, checkout or run directory. Writable:
  the workdir ``/tmp/sandbox`` (a host directory, deleted on close), and ``/tmp`` and ``/dev/shm`` (the sandbox's
  scratch space; they last until reset or close).
- **No network** (an empty network namespace: the host's loopback services and DNS are unreachable), its own pid,
  IPC, UTS and cgroup namespaces.
- **Caps** (:class:`~envs.sandbox.base.Limits`): the workdir and the scratch space are tmpfs mounts of
  ``workdir_mb`` and ``tmp_mb`` (as root; see ``enforced``), a memory cgroup caps all its processes together and a
  pids cgroup their number (where the machine allows), and every process has the address-space, CPU-time and
  file-size rlimits.

As root each command runs in a pid namespace made by util-linux ``unshare --pid --fork --mount-proc`` (bwrap's own
leaves one zombie per exec where pid 1 never reaps), whose ``/proc`` bwrap binds read-only; the exec's process group
and cgroup are killed when it ends, and everything in the namespace dies with its first process. Where the kernel
refuses user namespaces to ``nobody``, bwrap runs as root and makes the user namespace itself (the sandbox's uid then
maps to host root, still without any capability): see :func:`unprivileged_userns`.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess

from envs.errors import SandboxError
from envs.sandbox import mounts, seccomp
from envs.sandbox.base import Limits
from envs.sandbox.etc import SANDBOX_UID, sandbox_etc
from envs.sandbox.local import LocalSandbox

SANDBOX_WORKDIR = "/tmp/sandbox"  # under the scratch /tmp: the read-only root cannot get a new top-level dir
HOST_UID = 65534  # as root, the host uid the sandbox's processes run as (nobody)
INSTALL_HINT = "install it with `apt-get install bubblewrap`, or use make_sandbox('process') (no network isolation)"


def bwrap_path() -> str | None:
    """The path of the ``bwrap`` executable, or None when bubblewrap is not installed."""
    return shutil.which("bwrap")


@functools.cache
def bwrap_works() -> bool:
    """True when bubblewrap and the seccomp filter work here and bwrap can create namespaces (checked once)."""
    if bwrap_path() is None:
        return False
    try:
        with BwrapSandbox(use_cgroup=False) as sandbox:
            return sandbox.exec(["true"], timeout=10).ok
    except (OSError, SandboxError):
        return False


@functools.cache
def bwrap_version() -> tuple[int, ...]:
    """The installed bubblewrap's version, e.g. ``(0, 8, 0)``; ``()`` when it cannot be read."""
    exe = bwrap_path()
    if exe is None:
        return ()
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    parts = out.split()[-1].split(".") if out.split() else []
    return tuple(int(p) for p in parts if p.isdigit())


@functools.cache
def unprivileged_userns() -> bool:
    """True when ``nobody`` may create a user namespace here (root then runs bwrap as ``nobody``); checked once."""
    exe, setpriv = bwrap_path(), shutil.which("setpriv")
    if exe is None or setpriv is None:
        return False
    drop = [setpriv, f"--reuid={HOST_UID}", f"--regid={HOST_UID}", "--clear-groups", "--"]
    probe = [exe, "--unshare-user", "--ro-bind", "/usr", "/usr", *_root_links(), "--", "/usr/bin/true"]
    try:
        return subprocess.run(drop + probe, capture_output=True, timeout=10, cwd="/").returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@functools.cache
def _unshare_sets_uid(unshare: str) -> bool:
    """True when util-linux ``unshare`` has ``--setuid``/``--setgid`` (2.38 and later)."""
    try:
        out = subprocess.run([unshare, "--help"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "--setuid" in out and "--setgid" in out


@functools.cache
def _root_links() -> tuple[str, ...]:
    """bwrap arguments for ``/bin``, ``/sbin`` and ``/lib*``: the host's symlinks (merged ``/usr``) or binds."""
    args: list[str] = []
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = f"/{name}"
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return tuple(args)


class BwrapSandbox(LocalSandbox):
    """A bubblewrap sandbox: no privilege, seccomp, minimal read-only view, no network, sized scratch (module doc).

    ``enforced`` says which sandbox-wide caps hold here (``pids``, ``memory``, ``tmp``, ``workdir``); where the
    machine forbids cgroups or mounts the per-process limits still hold.
    """

    kind = "bwrap"

    def __init__(
        self,
        limits: Limits | None = None,
        env: dict[str, str] | None = None,
        use_cgroup: bool = True,
        extra_args: list[str] | None = None,
        ro_binds: list[str] | None = None,
    ) -> None:
        exe = bwrap_path()
        if exe is None:
            raise SandboxError(f"bubblewrap (bwrap) is not installed; {INSTALL_HINT}")
        self._bwrap = exe
        seccomp.bpf_program()  # raises SandboxError (with the install hint) where libseccomp is missing
        self._as_root = os.geteuid() == 0
        self._as_nobody = self._as_root and unprivileged_userns()
        self._pidns = self._root_prefix() if self._as_root else []
        self._extra_args = list(extra_args or [])
        self._ro_binds = [os.path.abspath(p) for p in ro_binds or []]
        missing = [p for p in self._ro_binds if not os.path.exists(p)]
        if missing:
            raise SandboxError(f"paths to show read-only in the sandbox do not exist: {missing}")
        super().__init__(limits=limits, env=env, use_cgroup=use_cgroup)

    def _root_prefix(self) -> list[str]:
        """As root: the pid namespace (util-linux ``unshare``) and the drop to ``nobody`` that come before bwrap.

        ``unshare --setuid`` (util-linux >= 2.38) drops in the same process start; older ones need ``setpriv``.
        ``--kill-child`` would not survive that uid change, so it is left out there: the exec's process group and
        cgroup are killed instead, and the namespace ends with its first process.
        """
        unshare, setpriv = shutil.which("unshare"), shutil.which("setpriv")
        if unshare is None or setpriv is None:
            raise SandboxError("the bwrap sandbox as root needs util-linux's unshare and setpriv")
        pidns = [unshare, "--pid", "--fork", "--mount-proc"]
        if not self._as_nobody:
            return [*pidns, "--kill-child", "--"]
        if _unshare_sets_uid(unshare):
            return [*pidns, f"--setuid={HOST_UID}", f"--setgid={HOST_UID}", "--"]
        drop = [setpriv, f"--reuid={HOST_UID}", f"--regid={HOST_UID}", "--clear-groups", "--inh-caps=-all"]
        return [*pidns, "--kill-child", "--", *drop, "--bounding-set=-all", "--"]

    @property
    def workdir(self) -> str:
        """``/tmp/sandbox``: the workdir as commands inside see it."""
        return SANDBOX_WORKDIR

    @property
    def _host_uid(self) -> int | None:
        """The host uid of the sandbox's processes when the host must hand files over to it (root dropping)."""
        return HOST_UID if self._as_nobody else None

    def _owned_by(self) -> int | None:
        return self._host_uid

    def _popen_cwd(self) -> str | None:
        return "/"

    # -- host side ---------------------------------------------------------------------------------------------
    def _prepare_host(self) -> None:
        mounts.sweep_leftovers()
        root, uid = self._root, self._host_uid
        self._etc = sandbox_etc()
        self._work, self._scratch = os.path.join(root, "work"), os.path.join(root, "scratch")
        for path in (self._work, self._scratch):
            os.mkdir(path, 0o700)
        lim = self.limits
        for key, path, size in (("workdir", self._work, lim.workdir_mb), ("tmp", self._scratch, lim.tmp_mb)):
            if mounts.mount_tmpfs(path, size, uid=uid if uid is not None else os.geteuid()):
                self._mounted.append(path)
                self.enforced[key] = True
        # Without a sized scratch mount (not root), bwrap >= 0.9 gives each exec a sized tmpfs instead.
        self._per_exec_tmp = not self.enforced["tmp"] and bwrap_version() >= (0, 9)
        self.enforced["tmp"] = self.enforced["tmp"] or self._per_exec_tmp
        self._tmp, self._shm = os.path.join(self._scratch, "tmp"), os.path.join(self._scratch, "shm")
        for path in (self._tmp, self._shm):
            os.mkdir(path)
            os.chmod(path, 0o1777)
        if uid is not None:
            for path in (root, self._work, self._scratch, self._tmp, self._shm):
                os.chown(path, uid, uid)
        self.host_workdir = self._work

    def _scratch_dirs(self) -> list[str]:
        return [self._tmp, self._shm]

    def _sized_paths(self) -> dict[str, str]:
        paths = {"tmp": self._scratch, "workdir": self._work}
        return {name: path for name, path in paths.items() if path in self._mounted}

    def _resize(self, old: Limits, lim: Limits) -> None:
        if self._scratch in self._mounted and lim.tmp_mb != old.tmp_mb:
            mounts.resize_tmpfs(self._scratch, lim.tmp_mb)
        if self._work in self._mounted and lim.workdir_mb != old.workdir_mb:
            mounts.resize_tmpfs(self._work, lim.workdir_mb)

    # -- the command line --------------------------------------------------------------------------------------
    def _exec_fds(self) -> list[int]:
        return [seccomp.program_fd()]

    def _scratch_view(self) -> list[str]:
        """``/tmp`` and ``/dev/shm``: the sized scratch mount; without one, bwrap >= 0.9 sizes a tmpfs per exec."""
        if not self._per_exec_tmp:
            return ["--bind", self._tmp, "/tmp", "--bind", self._shm, "/dev/shm"]
        size = str(self._applied.tmp_mb * 1024 * 1024)
        return [*("--perms", "01777", "--size", size, "--tmpfs", "/tmp")] + [
            *("--perms", "01777", "--size", size, "--tmpfs", "/dev/shm")
        ]

    def _view(self) -> list[str]:
        """The filesystem the command sees (bwrap arguments, applied in order)."""
        proc = ["--ro-bind", "/proc", "/proc"] if self._as_root else ["--proc", "/proc"]
        return [
            "--ro-bind", "/usr", "/usr",
            *_root_links(),
            "--ro-bind", self._etc, "/etc",
            *proc,
            "--dev", "/dev",
            *self._scratch_view(),
            "--bind", self._work, SANDBOX_WORKDIR,
            *(a for p in self._ro_binds for a in ("--ro-bind", p, p)),  # before the root turns read-only
            "--remount-ro", "/dev",
            "--remount-ro", "/",
        ]  # fmt: skip

    def _wrap(self, argv: list[str], fds: list[int]) -> list[str]:
        # As root the pid namespace comes from `unshare` (see the module doc); otherwise bwrap makes it.
        ns = ["--unshare-ipc", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
        if not self._as_root:
            ns.append("--unshare-pid")
        user = ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
        if bwrap_version() >= (0, 8):
            user.append("--disable-userns")  # the seccomp filter refuses new user namespaces too
        return [
            *self._pidns,
            self._bwrap,
            *user,
            *ns,
            "--cap-drop", "ALL",
            "--die-with-parent",
            "--new-session",
            "--seccomp", str(fds[0]),
            *self._view(),
            "--chdir", SANDBOX_WORKDIR,
            "--hostname", "sandbox",
            *self._extra_args,
            "--",
            *argv,
        ]  # fmt: skip
