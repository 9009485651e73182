"""Sandboxes: real bubblewrap, docker (a private engine) and process sandboxes, and the warm pool; no mocks."""

import asyncio
import os
import socket
import subprocess
import sys
import time

import dockerd
import pytest
from conftest import require

from envs.errors import SandboxError
from envs.sandbox import BwrapSandbox, Limits, ProcessSandbox, SandboxPool, bwrap_works, make_sandbox

ISOLATED = ["bwrap", pytest.param("docker", marks=pytest.mark.docker)]


def _make(kind: str, **kw):
    if kind == "docker":
        return make_sandbox("docker", base_url=dockerd.engine().base_url, **kw)
    require(bwrap_works(), "bubblewrap (bwrap)")
    return make_sandbox(kind, **kw)


@pytest.fixture(params=ISOLATED)
def sb(request):
    sandbox = _make(request.param)
    yield sandbox
    sandbox.close()


def _pgrep(pattern: str) -> str:
    return subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True).stdout.strip()


def test_stdout_stderr_exit_code_stdin(sb):
    r = sb.exec("echo out; echo err >&2; exit 3")
    assert (r.stdout, r.stderr, r.exit_code, r.timed_out) == ("out\n", "err\n", 3, False)
    r = sb.exec(["python3", "-c", "import sys; print(sys.stdin.read().upper())"], stdin="hello")
    assert r.ok and r.stdout == "HELLO\n"
    assert sb.exec("pwd").stdout.strip() == sb.workdir


def test_aexec_matches_exec(sb):
    r = asyncio.run(sb.aexec(["sh", "-c", "cat; echo e >&2; exit 2"], stdin="abc"))
    assert (r.stdout, r.stderr, r.exit_code) == ("abc", "e\n", 2)


@pytest.mark.parametrize("use_async", [False, True])
def test_timeout_kills_process_group(sb, use_async):
    cmd = "sleep 101 & setsid sleep 102 & sleep 103"
    start = time.monotonic()
    r = asyncio.run(sb.aexec(cmd, timeout=0.5)) if use_async else sb.exec(cmd, timeout=0.5)
    assert r.timed_out and r.exit_code != 0 and "timeout" in r.limits_hit
    assert time.monotonic() - start < 2.0
    time.sleep(0.1)
    assert _pgrep("sleep 10[123]") == ""


def test_network_is_off(sb):
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    try:
        code = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); print('connected')"
        r = sb.exec(["python3", "-c", code])
        assert r.exit_code != 0 and "connected" not in r.stdout
        assert "Error" in r.stderr
    finally:
        server.close()


def test_host_filesystem_read_only_and_private_tmp(sb):
    r = sb.exec("touch /usr/agentflow_probe || echo denied; echo hi > /tmp/x && cat /tmp/x")
    assert "denied" in r.stdout and "hi" in r.stdout
    assert not os.path.exists("/usr/agentflow_probe")
    assert int(sb.exec("ls /proc | grep -c '^[0-9]'").stdout) < 10, "the sandbox must not see host processes"


def test_memory_limit(sb):
    r = sb.exec(["python3", "-c", "x = bytearray(400 * 1024 * 1024); print('ok')"], limits=Limits(memory_mb=200))
    assert r.exit_code != 0 and "MemoryError" in r.stderr


def test_file_size_limit(sb):
    sb.exec("head -c 3000000 /dev/zero > big; echo done", limits=Limits(file_size_mb=1))
    assert len(sb.get_file("big")) == 1024 * 1024


def test_cpu_limit(sb):
    start = time.monotonic()
    r = sb.exec(["python3", "-c", "while True: pass"], timeout=10, limits=Limits(cpu_s=1))
    assert r.exit_code != 0 and not r.timed_out and r.limits_hit == ("cpu",), r
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("kind", ISOLATED)
def test_fork_bomb_contained(kind):
    with _make(kind, limits=Limits(max_procs=32)) as sandbox:
        if not sandbox.pids_limit_enforced:
            pytest.skip("no pids cgroup on this machine (cgroupfs not writable): fork bombs are not contained")
        r = sandbox.exec("bomb() { bomb | bomb & }; bomb; sleep 1; echo alive", timeout=5)
        assert "fork" in r.stderr.lower() and not r.timed_out and "pids" in r.limits_hit
        assert sandbox.exec("echo after").stdout == "after\n", "the sandbox must stay usable after a fork bomb"


def test_put_get_file_and_escapes(sb):
    sb.put_file("sub/data.bin", b"\x00\x01abc")
    assert sb.exec("cat sub/data.bin | wc -c").stdout.strip() == "5"
    sb.exec("echo made > out.txt; ln -s /etc/passwd link")
    assert sb.get_file("out.txt") == b"made\n"
    assert sb.get_file(f"{sb.workdir}/out.txt") == b"made\n"
    for bad in ("../escape", "/etc/passwd", "link", "sub/../../x"):
        with pytest.raises(SandboxError):
            sb.get_file(bad)
    with pytest.raises(SandboxError):
        sb.put_file("../escape", b"x")


def test_nothing_left_after_close():
    require(bwrap_works(), "bubblewrap (bwrap)")
    sandbox = BwrapSandbox()
    host_dir = sandbox.host_workdir
    cgroups = [d.path for d in sandbox._cgroup.dirs.values()] if sandbox._cgroup is not None else []
    sandbox.exec("echo x > f; echo y > /tmp/y")
    sandbox.close()
    sandbox.close()
    assert not os.path.exists(host_dir)
    assert not any(p.exists() for p in cgroups)
    with open("/proc/self/mountinfo") as f:
        assert os.path.dirname(host_dir) not in f.read(), "the sandbox's tmpfs mounts are gone"
    with pytest.raises(SandboxError, match="closed"):
        sandbox.exec("true")


def test_mounts_of_a_dead_process_are_swept():
    """A process that dies with its sandboxes open leaves their tmpfs mounts; the next process sweeps them."""
    require(bwrap_works(), "bubblewrap (bwrap)")
    from envs.sandbox import mounts

    code = (
        "import os; from envs.sandbox import BwrapSandbox; b = BwrapSandbox(); print(b._root, flush=True); os._exit(0)"
    )
    root = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    with open("/proc/self/mountinfo") as f:
        leaked = root in f.read()
    if not leaked:
        pytest.skip("no sized mounts here (not root)")
    assert mounts.sweep_leftovers.__wrapped__() >= 2
    with open("/proc/self/mountinfo") as f:
        assert root not in f.read()
    assert not os.path.exists(root)


def test_process_sandbox_basics_and_leftovers():
    with ProcessSandbox() as sandbox:
        r = sandbox.exec("pwd; echo $HOME")
        assert r.stdout.split() == [sandbox.host_workdir, sandbox.host_workdir]
        start = time.monotonic()
        r = sandbox.exec("setsid sleep 104 & echo started")
        assert r.stdout == "started\n" and time.monotonic() - start < 3
        if sandbox.pids_limit_enforced:
            time.sleep(0.1)
            assert _pgrep("sleep 104") == ""
        host_dir = sandbox.host_workdir
    assert not os.path.exists(host_dir)


def test_make_sandbox_errors(monkeypatch):
    with pytest.raises(SandboxError, match="unknown sandbox kind 'docker2'; available kinds: bwrap, docker, process"):
        make_sandbox("docker2")
    monkeypatch.setattr("envs.sandbox.bwrap_path", lambda: None)
    with pytest.raises(SandboxError, match="apt-get install bubblewrap"):
        make_sandbox("bwrap")


def test_output_is_capped(sb):
    r = sb.exec("head -c 5000000 /dev/zero | tr '\\0' a", limits=Limits(output_kb=4))
    assert r.ok and len(r.stdout) == 4096 and r.limits_hit == ("output",), r
    r = sb.exec("echo small")
    assert r.limits_hit == (), r


@pytest.mark.parametrize("kind", ISOLATED)
def test_sandbox_wide_caps_hold(kind):
    """As root (CI), every sandbox-wide cap holds: pids and memory cgroups, sized /tmp and workdir."""
    with _make(kind) as sandbox:
        missing = [name for name, held in sandbox.enforced.items() if not held]
        require(not missing or os.geteuid() != 0, f"sandbox caps {missing} (cgroups and tmpfs mounts, as root)")
        assert sandbox.exec("df -k /tmp | tail -1").stdout.split()[1] == str(64 * 1024)


@pytest.mark.docker
def test_docker_container_settings_and_removal():
    import docker

    with _make("docker", limits=Limits(memory_mb=200, sandbox_memory_mb=300, max_procs=40)) as sandbox:
        r = sandbox.exec("id -u; cat /proc/self/status | grep -E '^(NoNewPrivs|CapEff|Seccomp):'; ls /sys/class/net")
        assert r.stdout.split() == ["1000", "CapEff:", "0000000000000000", "NoNewPrivs:", "1", "Seccomp:", "2", "lo"]
        host = sandbox.container.attrs["HostConfig"]
        assert (host["NetworkMode"], host["ReadonlyRootfs"], host["PidsLimit"]) == ("none", True, 40)
        assert host["Memory"] == 300 * 1024 * 1024
        volume = sandbox.container.attrs["Mounts"][0]["Name"]
        client = sandbox.client
        cid = sandbox.container.id
    with pytest.raises(docker.errors.NotFound):
        client.containers.get(cid)
    with pytest.raises(docker.errors.NotFound):
        client.volumes.get(volume)
    with pytest.raises(SandboxError, match="closed"):
        sandbox.exec("true")


@pytest.mark.parametrize("kind", ["bwrap", pytest.param("docker", marks=pytest.mark.docker)])
def test_pool_hands_out_ready_sandboxes_and_wipes_them(kind):
    kw = {"base_url": dockerd.engine().base_url} if kind == "docker" else {}
    if kind == "bwrap":
        require(bwrap_works(), "bubblewrap (bwrap)")
    with SandboxPool(kind, size=2, **kw) as pool:
        assert pool.idle == 2
        start = time.monotonic()
        box = pool.acquire()
        assert time.monotonic() - start < 0.01, "a warm sandbox is handed out at once"
        box.exec("echo secret > f; echo secret > /tmp/t; echo secret > /dev/shm/s; sleep 105 >/dev/null 2>&1 &")
        pool.release(box)
        with pytest.raises(SandboxError, match="not acquired"):
            pool.release(box)
        assert pool.wait_ready(timeout=10)
        boxes = [pool.acquire(), pool.acquire(), pool.acquire()]  # the third one is a cold start
        assert pool.cold_starts == 1
        for b in boxes:
            assert b.exec("ls -A").stdout == "", "a recycled sandbox starts with an empty workdir"
            assert b.exec("cat /tmp/t /dev/shm/s").stdout == "", "and empty scratch space"
        assert _pgrep("sleep 105") == ""
        for b in boxes[:2]:
            pool.release(b)
        leased = boxes[2]
    assert leased.closed, "close() also closes the sandboxes still leased"
    assert all(b.closed for b in boxes)


def test_pool_async_and_reuse_false():
    require(bwrap_works(), "bubblewrap (bwrap)")

    async def episode(pool):
        box = await pool.aacquire()
        try:
            return (await box.aexec("echo hi")).stdout
        finally:
            pool.release(box)

    with SandboxPool("bwrap", size=1, reuse=False) as pool:
        first = pool.acquire()
        pool.release(first)
        assert pool.wait_ready(timeout=5)
        assert first.closed, "reuse=False closes a released sandbox and starts a new one"
        assert asyncio.run(episode(pool)) == "hi\n"
