"""Escape attempts, as one Python program that runs inside a sandbox (or, as the positive control, on the host).

The program needs only ``python3``'s standard library (the docker image has nothing more) and makes the system
calls itself through ``ctypes``, so the same attempts run under bwrap, docker and on the host. It prints one JSON
object: for each attempt, whether it **succeeded** and a short detail. Run on the host as root, every attempt
succeeds (that is what the sandboxes must stop); the mount attempts then run in a private mount namespace
(``unshare --mount``), so that the control changes nothing on the host.

Arguments (JSON, ``argv[1]``): ``secret`` (a value only a host process's environment holds), ``helper_pid``
(that process, whose namespaces are the host's), ``files`` (host files to read), ``dirs`` (host directories to
list), ``write_dir`` (a host directory to write into), ``tcp_port`` / ``udp_port`` (listeners on the host's
loopback).
"""

from __future__ import annotations

PROGRAM = r"""
import ctypes, errno, json, os, socket, sys

args = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
out = {}


def attempt(name):
    def run(fn):
        try:
            ok, detail = fn()
        except Exception as e:  # the attempt failed in a way we did not foresee: it did not succeed
            ok, detail = False, f"{type(e).__name__}: {e}"
        out[name] = {"ok": bool(ok), "detail": str(detail)[:200]}
        return fn
    return run


def err(rc):
    return "0" if rc == 0 else errno.errorcode.get(ctypes.get_errno(), str(rc))


NR = {"x86_64": {"keyctl": 250, "bpf": 321}, "aarch64": {"keyctl": 219, "bpf": 280}}[os.uname().machine]


def sys_call(nr, *a):
    libc.syscall.restype = ctypes.c_long
    rc = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(x) if isinstance(x, int) else x for x in a])
    return rc, errno.errorcode.get(ctypes.get_errno(), "0") if rc < 0 else "0"


@attempt("capabilities")
def _():
    eff = [ln.split()[1] for ln in open("/proc/self/status") if ln.startswith("CapEff:")][0]
    return int(eff, 16) != 0, eff


@attempt("mount_tmpfs")
def _():
    target = os.path.join(os.getcwd(), "af-mnt")
    os.makedirs(target, exist_ok=True)
    rc = libc.mount(b"none", target.encode(), b"tmpfs", 0, None)
    return rc == 0, err(rc)


@attempt("remount_rw")
def _():
    errs = []
    for target in (b"/usr", b"/"):
        if libc.mount(None, target, None, 0x20 | 0x1000, None) == 0:  # MS_REMOUNT | MS_BIND, without MS_RDONLY
            return True, target
        errs.append(err(-1))
    return False, errs


@attempt("setns_host_net")
def _():
    fd = os.open(f"/proc/{args['helper_pid']}/ns/net", os.O_RDONLY)
    rc = libc.setns(fd, 0)
    return rc == 0, err(rc)


@attempt("setns_host_cgroup")
def _():
    fd = os.open(f"/proc/{args['helper_pid']}/ns/cgroup", os.O_RDONLY)
    rc = libc.setns(fd, 0)
    return rc == 0, err(rc)


@attempt("unshare_user")
def _():
    pid = os.fork()
    if pid == 0:  # in a child: a new user namespace must not change this process
        os._exit(0 if libc.unshare(0x10000000) == 0 else 1)
    return os.waitpid(pid, 0)[1] == 0, "child unshare(CLONE_NEWUSER)"


@attempt("ptrace")
def _():
    pid = os.fork()
    if pid == 0:
        os._exit(0 if libc.ptrace(0, 0, None, None) == 0 else 1)  # PTRACE_TRACEME
    return os.waitpid(pid, 0)[1] == 0, "child PTRACE_TRACEME"


@attempt("keyctl")
def _():
    rc, err = sys_call(NR["keyctl"], 0, -3)  # keyctl(KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING)
    return rc >= 0, err


@attempt("bpf")
def _():
    rc, err = sys_call(NR["bpf"], 0, None, 0)  # bpf(BPF_MAP_CREATE, NULL, 0): EINVAL/EFAULT when allowed
    return err != "EPERM", err


@attempt("host_environ")
def _():
    needle = args["secret"].encode()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if needle in open(f"/proc/{name}/environ", "rb").read():
                    return True, f"found in /proc/{name}/environ"
            except OSError:
                continue
    return False, "not found"


@attempt("proc_mem_write")
def _():
    fd = os.open(f"/proc/{args['helper_pid']}/mem", os.O_RDWR)
    os.close(fd)
    return True, "opened"


@attempt("read_host_files")
def _():
    read = []
    for path in args["files"]:
        try:
            open(path, "rb").read(1)
            read.append(path)
        except OSError:
            pass
    for path in args["dirs"]:
        try:
            os.listdir(path)
            read.append(path)
        except OSError:
            pass
    return bool(read), read


@attempt("write_host_file")
def _():
    with open(os.path.join(args["write_dir"], "pwned"), "w") as f:
        f.write("pwned")
    return True, "written"


@attempt("loopback_tcp")
def _():
    s = socket.create_connection(("127.0.0.1", args["tcp_port"]), timeout=2)
    s.sendall(b"pwned")
    s.close()
    return True, "connected"


@attempt("loopback_dns")
def _():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(2)
    query = b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x07example\x03com\x00\x00\x01\x00\x01"
    s.sendto(query, ("127.0.0.1", args["udp_port"]))
    return s.recv(512) == b"answer", "answered"


@attempt("umount_proc")
def _():
    rc = libc.umount2(b"/proc", 2)  # MNT_DETACH
    return rc == 0, err(rc)


print(json.dumps(out))
"""

ATTEMPTS = (
    "capabilities", "mount_tmpfs", "remount_rw", "setns_host_net", "setns_host_cgroup", "unshare_user", "ptrace",
    "keyctl", "bpf", "host_environ", "proc_mem_write", "read_host_files", "write_host_file", "loopback_tcp",
    "loopback_dns", "umount_proc",
)  # fmt: skip
ROOT_CAN = ATTEMPTS
"""What root outside any sandbox can do: all of it."""


def _yama_allows_ptrace() -> bool:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return f.read().strip() == "0"
    except OSError:
        return True  # no Yama: same-uid processes may open each other's memory


USER_CAN = ("host_environ", "read_host_files", "write_host_file", "loopback_tcp", "loopback_dns") + (
    ("proc_mem_write",) if _yama_allows_ptrace() else ()
)
"""What an unprivileged user outside can do: its own processes (their memory unless Yama forbids it), files anyone
may read, the loopback services."""
