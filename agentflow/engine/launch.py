"""Engine server processes: start ``agentflow serve`` on free loopback ports, wait until healthy, stop them.

Each server runs in its own session so that stopping it kills its whole process group, and nothing is left behind.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def start_servers(
    model_dir: str | Path,
    n: int,
    key: str,
    max_slots: int = 4,
    max_len: int = 256,
    timeout: float = 90.0,
    quiet: bool = True,
    extra_args: Sequence[str] = (),
) -> tuple[list[subprocess.Popen], list[str]]:
    """``n`` engine servers (seeds 0..n-1) with API key ``key``; returns the processes and their base URLs.
    ``extra_args``: more ``agentflow serve`` options (e.g. ``--max-request-mb 8``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AGENTFLOW_ENGINE_KEY": key}
    procs, urls = [], []
    try:
        for i in range(n):
            port = _free_port()
            cmd = [
                sys.executable,
                "-m",
                "agentflow.cli",
                "serve",
                str(model_dir),
                "--port",
                str(port),
                "--seed",
                str(i),
            ]
            cmd += ["--max-slots", str(max_slots), "--max-len", str(max_len), *extra_args]
            err = subprocess.DEVNULL if quiet else None
            procs.append(subprocess.Popen(cmd, env=env, start_new_session=True, stderr=err))
            urls.append(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + timeout
        for p, url in zip(procs, urls, strict=True):
            while not _healthy(url):
                if p.poll() is not None:
                    raise RuntimeError(f"engine server {url} exited with code {p.returncode}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"engine server {url} did not become healthy within {timeout} s")
                time.sleep(0.2)
    except BaseException:
        stop_servers(procs)
        raise
    return procs, urls


def stop_servers(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """SIGTERM each server's process group, then SIGKILL what is still there after ``grace_s``."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
