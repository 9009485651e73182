"""Attacks on the sandboxes: each is contained by ``bwrap`` and ``docker``, and succeeds under ``process``.

The positive control runs the same attack under an unconfined ``process`` sandbox (no pids cgroup, loose rlimits),
so a test cannot pass because its attack was broken. Every sandbox is made with a token in its environment; the
host's ``/proc/*/environ`` then counts the sandbox's processes (container processes are host processes too), and
after ``close()`` that count must be 0. Every ``exec`` must return within a bound: the caller never hangs.

The escape attempts (capabilities, mounts, ``/proc`` unmount, entering the host's namespaces, the host's process
environments and memory, host files, loopback TCP and DNS; ``sandbox_attacks``) run as the host's user (root in
CI) and, where the test can drop to it, as ``nobody`` (``sandbox_probe``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dockerd
import pytest
import sandbox_attacks
from conftest import require

from envs.sandbox import Limits, ProcessSandbox, bwrap_works, make_sandbox
from envs.sandbox.bwrap import HOST_UID, unprivileged_userns

TIGHT = Limits(
    memory_mb=256,
    cpu_s=5,
    file_size_mb=8,
    max_procs=32,
    output_kb=1024,
    sandbox_memory_mb=300,
    tmp_mb=16,
    workdir_mb=24,
)
LOOSE = Limits(
    memory_mb=4096, cpu_s=60, file_size_mb=1024, max_procs=4096, output_kb=200 * 1024, sandbox_memory_mb=8192
)
REPO = Path(__file__).resolve().parents[1]
AS_ROOT = os.geteuid() == 0
KINDS = ["process", "bwrap", pytest.param("docker", marks=pytest.mark.docker)]
CONTAINED = ["bwrap", pytest.param("docker", marks=pytest.mark.docker)]


def _procs_with(token: str) -> list[int]:
    """Host pids whose environment holds ``AF_SEC_TOKEN=token``."""
    needle = f"AF_SEC_TOKEN={token}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(name))
        except OSError:
            continue
    return found


def _wait_none(token: str, timeout: float = 3.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := _procs_with(token)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


class Box:
    """One sandbox under attack, with the token that finds its processes on the host."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.token = uuid.uuid4().hex
        env = {"AF_SEC_TOKEN": self.token}
        if kind == "process":  # the positive control: unconfined
            self.sb: Any = ProcessSandbox(limits=LOOSE, env=env, use_cgroup=False)
        elif kind == "bwrap":
            require(bwrap_works(), "bubblewrap (bwrap)")
            self.sb = make_sandbox("bwrap", limits=TIGHT, env=env)
        else:
            self.sb = make_sandbox("docker", limits=TIGHT, env=env, base_url=dockerd.engine().base_url)

    @property
    def contained(self) -> bool:
        return self.kind != "process"

    def run(self, cmd: list[str] | str, timeout: float = 10.0, bound: float = 15.0) -> Any:
        """Exec ``cmd`` and check the call returned within ``bound`` seconds."""
        start = time.monotonic()
        r = self.sb.exec(cmd, timeout=timeout)
        assert time.monotonic() - start < bound, f"the caller waited {time.monotonic() - start:.1f} s"
        return r

    def close_and_count(self) -> None:
        """Close the sandbox; no process of it may survive (the control's leftovers are killed here)."""
        self.sb.close()
        left = _wait_none(self.token, 3.0 if self.contained else 0.2)
        if not self.contained:
            for pid in left:  # the positive control leaks by design; clean up what we started
                os.kill(pid, signal.SIGKILL)
            return
        assert left == [], f"{len(left)} processes of the {self.kind} sandbox survived close()"


@pytest.fixture
def box() -> Iterator[Callable[[str], Box]]:
    made: list[Box] = []

    def make(kind: str) -> Box:
        b = Box(kind)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close_and_count()


@pytest.mark.parametrize("kind", KINDS)
def test_loopback_server_unreachable(box, kind):
    b = box(kind)
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(5)
    got: list[bytes] = []

    def serve() -> None:
        try:
            conn, _ = server.accept()
            got.append(conn.recv(100))
            conn.close()
        except OSError:
            pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    port = server.getsockname()[1]
    code = f"import socket; s = socket.create_connection(('127.0.0.1', {port}), timeout=3); s.sendall(b'pwned')"
    r = b.run(["python3", "-c", code])
    time.sleep(0.1)
    server.shutdown(socket.SHUT_RDWR)  # wakes the accept
    server.close()
    t.join(timeout=6)
    if b.contained:
        assert got == [] and r.exit_code != 0
    else:
        assert got == [b"pwned"] and r.ok


@pytest.mark.parametrize("kind", KINDS)
def test_write_outside_workdir(box, kind):
    b = box(kind)
    outside = tempfile.mkdtemp(prefix="af-sec-", dir="/var/tmp")
    target = os.path.join(outside, "target")
    try:
        with open(target, "w") as f:
            f.write("original")
        r = b.run(f"echo pwned > {target}; echo pwned > {outside}/new; echo pwned > /usr/af-sec-probe")
        if b.contained:
            assert r.exit_code != 0
            assert open(target).read() == "original" and os.listdir(outside) == ["target"]
            assert not os.path.exists("/usr/af-sec-probe")
        else:
            assert open(target).read() == "pwned\n"
    finally:
        shutil.rmtree(outside, ignore_errors=True)
        if os.path.exists("/usr/af-sec-probe"):
            os.unlink("/usr/af-sec-probe")


_MANY_CHILDREN = (
    "import os, time\nn = 0\nfor _ in range(100):\n    try:\n        pid = os.fork()\n"
    "    except OSError:\n        break\n"
    "    if pid == 0:\n        time.sleep(3)\n        os._exit(0)\n    n += 1\nprint(n)"
)


@pytest.mark.parametrize("kind", KINDS)
def test_process_limit(box, kind):
    """A bounded fork bomb (100 sleeping children): the limit (32) stops it; unconfined, all 100 start."""
    b = box(kind)
    r = b.run(["python3", "-c", _MANY_CHILDREN], timeout=10)
    n = int(r.stdout.strip() or 0)
    assert n < 32 if b.contained else n == 100, r


@pytest.mark.parametrize("kind", CONTAINED)
def test_fork_bomb(box, kind):
    b = box(kind)
    r = b.run("bomb() { bomb | bomb & }; bomb; sleep 1; echo alive", timeout=5, bound=12)
    assert "fork" in r.stderr.lower() and not r.timed_out, r
    assert _wait_none(b.token) == [], "the bomb outlived its exec"
    assert b.run("echo after").stdout == "after\n", "the sandbox must stay usable after a fork bomb"


@pytest.mark.parametrize("kind", KINDS)
def test_memory_bomb(box, kind):
    b = box(kind)
    r = b.run(["python3", "-c", "x = b'\\x01' * (512 << 20); print('allocated', len(x) >> 20)"])
    if b.contained:
        assert r.exit_code != 0 and "allocated" not in r.stdout
    else:
        assert r.stdout == "allocated 512\n"


@pytest.mark.parametrize("kind", KINDS)
def test_infinite_loop(box, kind):
    """A foreground loop is stopped by the timeout; a detached one (``setsid nohup``) must not outlive the exec."""
    b = box(kind)
    r = b.run(["python3", "-c", "while True: pass"], timeout=1.0, bound=4)
    assert r.timed_out
    r = b.run(
        "setsid nohup python3 -c 'while True: pass' >/dev/null 2>&1 & sleep 0.3; echo started", timeout=5, bound=8
    )
    assert r.stdout == "started\n"
    time.sleep(0.3)
    left = _procs_with(b.token)
    assert (left == []) if b.contained else (len(left) >= 1)


@pytest.mark.parametrize("kind", KINDS)
def test_100mb_output(box, kind):
    b = box(kind)
    r = b.run("head -c 100000000 /dev/zero | tr '\\0' a; echo done >&2", timeout=20, bound=25)
    assert not r.timed_out and "done" in r.stderr
    if b.contained:
        assert len(r.stdout) == TIGHT.output_kb * 1024
    else:
        assert len(r.stdout) == 100_000_000


@pytest.mark.parametrize("kind", KINDS)
def test_setsid_grandchild(box, kind):
    """A ``setsid`` grandchild that keeps the output pipe open: the call returns and the grandchild dies."""
    b = box(kind)
    r = b.run("sh -c 'setsid sleep 1000 &'; sleep 0.3; echo started", timeout=5, bound=8)
    assert r.stdout.startswith("started")
    time.sleep(0.3)
    left = _procs_with(b.token)
    assert (left == []) if b.contained else (len(left) == 1)
    r = b.run("setsid sleep 1000 & sleep 1000", timeout=1.0, bound=4)
    assert r.timed_out
    assert (_wait_none(b.token, 2) == []) if b.contained else True


# -- escape attempts ------------------------------------------------------------------------------------------
class HostTargets:
    """What the escape attempts aim at: a host process holding a secret, loopback TCP and UDP ("DNS") listeners,
    a host directory to write into, host files and directories to read. ``evidence()`` says what reached them."""

    def __init__(self, write_dir: str) -> None:
        self.secret = uuid.uuid4().hex
        self.helper = subprocess.Popen(["sleep", "120"], env={"AF_HOST_SECRET": self.secret})
        self.tcp = socket.create_server(("127.0.0.1", 0))
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 0))
        self.write_dir = write_dir
        self.read_dir = tempfile.mkdtemp(prefix="af-sec-read-", dir="/var/tmp")  # anyone on the host may read it
        os.chmod(self.read_dir, 0o755)
        Path(self.read_dir, "host-file").write_text("host data\n")
        os.chmod(Path(self.read_dir, "host-file"), 0o644)
        self.received: list[str] = []
        for target in (self._serve_tcp, self._serve_udp):
            threading.Thread(target=target, daemon=True).start()

    def _serve_tcp(self) -> None:
        while True:
            try:
                conn, _ = self.tcp.accept()
                conn.settimeout(2)
                self.received.append("tcp:" + conn.recv(100).decode(errors="replace"))
                conn.close()
            except OSError:
                return

    def _serve_udp(self) -> None:
        while True:
            try:
                _, peer = self.udp.recvfrom(512)
                self.received.append("udp")
                self.udp.sendto(b"answer", peer)
            except OSError:
                return

    def args(self, **over: Any) -> dict[str, Any]:
        files = [
            "/etc/shadow",
            str(REPO / "pyproject.toml"),
            str(Path(__file__).resolve()),
            f"{self.read_dir}/host-file",
        ]
        dirs = ["/root", str(REPO), self.read_dir]
        base = dict(secret=self.secret, helper_pid=self.helper.pid, files=files, dirs=dirs)
        base.update(write_dir=self.write_dir, tcp_port=self.tcp.getsockname()[1], udp_port=self.udp.getsockname()[1])
        return {**base, **over}

    def evidence(self) -> list[str]:
        return [*self.received, *os.listdir(self.write_dir)]

    def close(self) -> None:
        self.helper.kill()
        self.helper.wait()
        shutil.rmtree(self.read_dir, ignore_errors=True)
        for s in (self.tcp, self.udp):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


@pytest.fixture
def targets() -> Iterator[HostTargets]:
    write_dir = tempfile.mkdtemp(prefix="af-sec-", dir="/var/tmp")
    os.chmod(write_dir, 0o777)
    t = HostTargets(write_dir)
    yield t
    t.close()
    shutil.rmtree(write_dir, ignore_errors=True)


def _attempts(b: Box, args: dict[str, Any]) -> dict[str, Any]:
    argv = ["python3", "-I", "-c", sandbox_attacks.PROGRAM, json.dumps(args)]
    if not b.contained and AS_ROOT:  # the control's mount attempts must not touch the host's mounts
        argv = ["unshare", "--mount", "--propagation", "private", *argv]
    r = b.run(argv, timeout=30, bound=40)
    assert r.exit_code == 0 and r.stdout.strip(), r
    return json.loads(r.stdout)


@pytest.mark.parametrize("kind", KINDS)
def test_escape_attempts(box, kind, targets):
    """Capabilities, mounts, namespaces, host processes, files and loopback: all fail inside, all work outside."""
    b = box(kind)
    got = _attempts(b, targets.args())
    assert set(got) == set(sandbox_attacks.ATTEMPTS), got
    succeeded = {name for name, v in got.items() if v["ok"]}
    time.sleep(0.1)
    if b.contained:
        assert succeeded == set(), {n: got[n] for n in succeeded}
        assert targets.evidence() == [], "an attempt reached the host"
    else:
        expected = set(sandbox_attacks.ROOT_CAN if AS_ROOT else sandbox_attacks.USER_CAN)
        assert expected <= succeeded, {n: got[n] for n in expected - succeeded}
        assert "pwned" in targets.evidence() and "udp" in targets.evidence()


def test_escape_attempts_where_nobody_may_not_make_user_namespaces(monkeypatch, targets):
    """The fallback where the kernel refuses user namespaces to nobody: bwrap runs as root and makes the user
    namespace itself; the sandbox still has no capability, no host view and the seccomp filter."""
    require(bwrap_works(), "bubblewrap (bwrap)")
    if not AS_ROOT:
        pytest.skip("the fallback is for a host running as root")
    monkeypatch.setattr("envs.sandbox.bwrap.unprivileged_userns", lambda: False)
    b = Box("bwrap")
    try:
        got = _attempts(b, targets.args())
        succeeded = {name for name, v in got.items() if v["ok"]}
        assert succeeded == set(), {n: got[n] for n in succeeded}
        assert targets.evidence() == []
    finally:
        b.close_and_count()


def _probe_tree() -> str:
    """A copy of the sandbox package, pyseccomp and the probe that ``nobody`` can read and import."""
    root = tempfile.mkdtemp(prefix="af-probe-")
    (Path(root) / "envs").mkdir()
    (Path(root) / "envs" / "__init__.py").write_text("")
    shutil.copy(REPO / "envs" / "errors.py", Path(root) / "envs")
    shutil.copytree(REPO / "envs" / "sandbox", Path(root) / "envs" / "sandbox", ignore=shutil.ignore_patterns("__py*"))
    spec = importlib.util.find_spec("pyseccomp")
    assert spec is not None and spec.origin is not None, "pyseccomp is a dependency of the bwrap sandbox"
    shutil.copy(spec.origin, root)
    for name in ("sandbox_attacks.py", "sandbox_probe.py"):
        shutil.copy(Path(__file__).with_name(name), root)
    subprocess.run(["chmod", "-R", "a+rX", root], check=True)
    os.chmod(root, 0o755)
    return root


def test_escape_attempts_as_nobody(targets):
    """The same attempts from an unprivileged host user (``nobody``): contained inside, the user's own reach outside."""
    require(bwrap_works(), "bubblewrap (bwrap)")
    setpriv, python = shutil.which("setpriv"), shutil.which("python3", path="/usr/bin:/bin")
    if not AS_ROOT or setpriv is None or python is None:
        pytest.skip("dropping to nobody needs root, setpriv and the system python3")
    tree = _probe_tree()
    try:
        drop = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
        args = {k: v for k, v in targets.args().items() if k not in ("secret", "helper_pid")}
        r = subprocess.run(
            [*drop, python, "-I", f"{tree}/sandbox_probe.py", json.dumps(args)],
            capture_output=True, text=True, timeout=120, cwd=tree, env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"},
        )  # fmt: skip
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    inside = {n for n, v in res["inside"].items() if v["ok"]}
    outside = {n for n, v in res["outside"].items() if v["ok"]}
    assert set(res["inside"]) == set(sandbox_attacks.ATTEMPTS), res["inside"]
    assert inside == set(), {n: res["inside"][n] for n in inside}
    assert set(sandbox_attacks.USER_CAN) <= outside, res["outside"]
    assert res["left"] == 0, "a process of the unprivileged sandbox outlived close()"


@pytest.mark.parametrize("kind", CONTAINED)
def test_processes_are_unprivileged_on_the_host(box, kind):
    """Seen from the host, no process of the sandbox is root (as root with user namespaces: bwrap runs as nobody)."""
    b = box(kind)
    t = threading.Thread(target=b.run, args=("sleep 2",))
    t.start()
    deadline, inside = time.monotonic() + 5, []
    while not inside and time.monotonic() < deadline:
        time.sleep(0.05)  # util-linux unshare, the host side of the bwrap chain, waits outside the sandbox
        inside = [p for p in _procs_with(b.token) if Path(f"/proc/{p}/comm").read_text().strip() != "unshare"]
    uids = {int(line.split()[1]) for p in inside for line in open(f"/proc/{p}/status") if line.startswith("Uid:")}
    t.join()
    assert inside and 0 not in uids, uids
    if kind == "bwrap" and AS_ROOT and unprivileged_userns():
        assert uids == {HOST_UID}, uids


# -- resource caps --------------------------------------------------------------------------------------------
_TOGETHER = (
    "import os, time\nkids = []\nfor _ in range(3):\n    pid = os.fork()\n    if pid == 0:\n"
    "        x = bytearray(130 << 20)\n        for i in range(0, len(x), 4096): x[i] = 1\n"
    "        time.sleep(1.5)\n        os._exit(0)\n    kids.append(pid)\n"
    "ok = sum(os.waitpid(p, 0)[1] == 0 for p in kids)\nprint('held', ok)"
)


@pytest.mark.parametrize("kind", KINDS)
def test_memory_of_all_processes_together(box, kind):
    """Three processes of 130 MB each, every one under its own address-space limit: the sandbox's cap (300 MB)
    stops them together; unconfined, all three hold their memory."""
    b = box(kind)
    r = b.run(["python3", "-c", _TOGETHER], timeout=20, bound=30)
    if b.contained:
        assert r.stdout != "held 3\n", r
        assert "memory" in r.limits_hit, r
    else:
        assert r.stdout == "held 3\n", r


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", ["tmp", "workdir", "shm"])
def test_disk_bombs(box, kind, where):
    """48 MB written in 8 MB files into /tmp, /dev/shm (16 MB scratch cap) or the workdir (24 MB cap)."""
    b = box(kind)
    if not b.contained and where != "workdir":
        pytest.skip("the control writes only into its own workdir (its /tmp is the host's)")
    path = {"tmp": "/tmp", "shm": "/dev/shm", "workdir": "."}[where]
    r = b.run(f"for i in 1 2 3 4 5 6; do head -c 8000000 /dev/zero > {path}/bomb$i || break; done; du -sk {path}")
    used_kb = int(r.stdout.split()[-2])
    if b.contained:
        cap_mb = TIGHT.workdir_mb if where == "workdir" else TIGHT.tmp_mb
        assert used_kb <= cap_mb * 1024 + 64, r
        assert "No space left" in r.stderr, r
        assert ("workdir" if where == "workdir" else "tmp") in r.limits_hit, r
    else:
        assert used_kb >= 46_000, r
