"""The sandboxes' system-call filter: one deny list, compiled by libseccomp for bwrap and written as a docker profile.

Everything is allowed except what lets a process leave or reshape its sandbox, or reach the kernel's more exposed
corners: mounting and ``pivot_root``, entering or creating namespaces (``setns``, ``unshare``, ``clone`` with a
``CLONE_NEW*`` flag; ``clone3`` answers ``ENOSYS`` so that libc falls back to ``clone``, whose flags can be checked),
``ptrace`` and cross-process memory access, the key-ring, ``bpf``, ``perf_event_open``, ``userfaultfd``,
``io_uring``, kernel modules, ``kexec``, reboot, clock and host-name changes, file handles, and the terminal-injecting
``ioctl`` requests (``TIOCSTI``, ``TIOCLINUX``). A refused call fails with ``EPERM``. System calls of another ABI
(32-bit ``int 0x80``, x32) kill the process: libseccomp's filter only admits the native architecture.

The bwrap sandbox compiles the filter with libseccomp (through ``pyseccomp``, a ctypes binding of the system's
``libseccomp.so.2``) and hands the BPF program to ``bwrap --seccomp FD``; the docker sandbox passes the same rules as
a seccomp profile (``security_opt``).
"""

from __future__ import annotations

import errno
import functools
import json
import os
import platform
import tempfile
from typing import Any

from envs.errors import SandboxError

INSTALL_HINT = (
    "the sandbox's seccomp filter needs libseccomp and its Python binding: `apt-get install libseccomp2` and "
    "`pip install pyseccomp` (both come with scripts/setup.sh)"
)

DENIED = (
    # mounts and the root
    "mount", "umount2", "pivot_root", "chroot", "mount_setattr", "move_mount", "open_tree",
    "fsopen", "fsconfig", "fsmount", "fspick",
    # namespaces
    "setns", "unshare",
    # other processes
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
    # the kernel's exposed corners
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "fanotify_init",
    "name_to_handle_at", "open_by_handle_at", "lookup_dcookie", "quotactl", "quotactl_fd",
    # the machine itself
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot",
    "swapon", "swapoff", "acct", "syslog", "vhangup", "iopl", "ioperm",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "sethostname", "setdomainname",
    "uselib",
)  # fmt: skip
ENOSYS_CALLS = ("clone3",)
# clone flags that create namespaces (CLONE_NEWTIME shares its bit with the exit signal: only clone3/unshare set it)
CLONE_NS_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
DENIED_IOCTLS = (0x5412, 0x541C)  # TIOCSTI, TIOCLINUX
_DOCKER_ARCH = {"x86_64": "SCMP_ARCH_X86_64", "aarch64": "SCMP_ARCH_AARCH64", "arm64": "SCMP_ARCH_AARCH64"}


def _module() -> Any:
    try:
        import pyseccomp
    except (ImportError, OSError, RuntimeError) as e:  # RuntimeError: the binding found no libseccomp.so
        raise SandboxError(f"{INSTALL_HINT} ({e})") from e
    return pyseccomp


def _known(sc: Any, name: str) -> bool:
    """True when libseccomp knows ``name`` on this architecture (older libraries lack the newest calls)."""
    try:
        sc.resolve_syscall(sc.system_arch(), name)
    except (ValueError, OSError, RuntimeError):
        return False
    return True


def _filter() -> Any:
    sc = _module()
    f = sc.SyscallFilter(sc.ALLOW)
    deny = sc.ERRNO(errno.EPERM)
    for name in DENIED:
        if _known(sc, name):
            f.add_rule(deny, name)
    for name in ENOSYS_CALLS:
        if _known(sc, name):
            f.add_rule(sc.ERRNO(errno.ENOSYS), name)
    for flag in CLONE_NS_FLAGS:
        f.add_rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    for request in DENIED_IOCTLS:
        f.add_rule(deny, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, request))
    return f


@functools.cache
def bpf_program() -> bytes:
    """The filter as a classic BPF program (libseccomp's ``export_bpf``), compiled once per process."""
    f = _filter()
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        program = out.read()
    if not program:
        raise SandboxError("libseccomp produced an empty seccomp program")
    return program


def seccomp_works() -> bool:
    """True when the filter can be compiled here (libseccomp and its binding are installed)."""
    try:
        bpf_program()
    except SandboxError:
        return False
    return True


def program_fd() -> int:
    """A fresh, readable file descriptor holding :func:`bpf_program` (for ``bwrap --seccomp FD``; caller closes)."""
    program = bpf_program()
    fd = os.memfd_create("agentflow-seccomp", os.MFD_CLOEXEC)
    try:
        os.write(fd, program)
        os.lseek(fd, 0, os.SEEK_SET)
    except OSError:
        os.close(fd)
        raise
    return fd


def docker_profile() -> str:
    """The same rules as a docker seccomp profile (JSON for ``security_opt=["seccomp=..."]``)."""
    eperm = {"action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM}
    rules: list[dict[str, Any]] = [
        {"names": list(DENIED), **eperm},
        {"names": list(ENOSYS_CALLS), "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS},
    ]
    for flag in CLONE_NS_FLAGS:
        arg = {"index": 0, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ"}
        rules.append({"names": ["clone"], "args": [arg], **eperm})
    for request in DENIED_IOCTLS:
        arg = {"index": 1, "value": 0xFFFFFFFF, "valueTwo": request, "op": "SCMP_CMP_MASKED_EQ"}
        rules.append({"names": ["ioctl"], "args": [arg], **eperm})
    arch = _DOCKER_ARCH.get(platform.machine())
    profile = {"defaultAction": "SCMP_ACT_ALLOW", "architectures": [arch] if arch else [], "syscalls": rules}
    return json.dumps(profile)
