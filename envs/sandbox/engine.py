"""A private docker engine: ``dockerd`` on its own socket, data root and exec root (for tests and benchmarks).

``PrivateDockerd().start()`` runs ``dockerd --iptables=false --bridge=none`` as a child of this process: containers
get no network at all, and the host's firewall and interfaces are left alone. ``stop()`` removes its containers and
stops it by its pid; it also gets SIGTERM when this process dies (``PR_SET_PDEATHSIG``), so nothing is left behind.
Needs root and Debian's ``docker.io`` (``dockerd``, ``containerd``, ``runc``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import tempfile
import time

_PR_SET_PDEATHSIG = 1


def private_dockerd_available() -> tuple[bool, str]:
    """Whether a private engine can start here, and else what is missing."""
    try:
        import docker  # noqa: F401
    except ImportError:
        return False, "the docker SDK (pip install docker)"
    if shutil.which("dockerd") is None:
        return False, "a docker engine (Debian docker.io: dockerd)"
    if os.geteuid() != 0:
        return False, "root, to start a private dockerd"
    return True, ""


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class PrivateDockerd:
    """One ``dockerd`` process with everything it owns under a private temp directory."""

    def __init__(self) -> None:
        self.root = tempfile.mkdtemp(prefix="af-dockerd-", dir="/tmp")  # short: unix socket paths are capped
        self.base_url = f"unix://{self.root}/docker.sock"
        self.log_path = os.path.join(self.root, "dockerd.log")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> None:
        """Start the daemon and wait until it answers a ping; raises RuntimeError with its log otherwise."""
        argv = [
            "dockerd",
            "--iptables=false",
            "--ip-masq=false",
            "--bridge=none",
            "--userland-proxy=false",
            "-H", self.base_url,
            "--data-root", f"{self.root}/data",
            "--exec-root", f"{self.root}/exec",
            "--pidfile", f"{self.root}/docker.pid",
        ]  # fmt: skip
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if self._ping():
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"dockerd did not become ready; its log:\n{self.log()[-3000:]}")

    def _ping(self) -> bool:
        import docker

        try:
            client = docker.DockerClient(base_url=self.base_url, timeout=2)
            try:
                return bool(client.ping())
            finally:
                client.close()
        except Exception:  # noqa: BLE001 - not listening yet
            return False

    def log(self) -> str:
        """The daemon's log so far."""
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def stop(self) -> None:
        """Remove the containers, stop the daemon (SIGTERM, then SIGKILL) and delete its directory."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            self._remove_containers()
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)

    def _remove_containers(self) -> None:
        import docker

        with contextlib.suppress(Exception):
            client = docker.DockerClient(base_url=self.base_url, timeout=10)
            for c in client.containers.list(all=True):
                with contextlib.suppress(Exception):
                    c.remove(force=True, v=True)
            client.close()
