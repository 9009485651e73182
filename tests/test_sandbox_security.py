"""Attacks on the sandboxes: each is contained by ``bwrap`` and ``docker``, and succeeds under ``process``.

The positive control runs the same attack under an unconfined ``process`` sandbox (no pids cgroup, loose rlimits),
so a test cannot pass because its attack was broken. Every sandbox is made with a token in its environment; the
host's ``/proc/*/environ`` then counts the sandbox's processes (container processes are host processes too), and
after ``close()`` that count must be 0. Every ``exec`` must return within a bound: the caller never hangs.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import dockerd
import pytest
from conftest import require

from envs.sandbox import Limits, ProcessSandbox, bwrap_works, make_sandbox

TIGHT = Limits(memory_mb=256, cpu_s=5, file_size_mb=8, max_procs=32, output_kb=1024)
LOOSE = Limits(memory_mb=4096, cpu_s=60, file_size_mb=1024, max_procs=4096, output_kb=200 * 1024)
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
