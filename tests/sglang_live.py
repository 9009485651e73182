"""A live SGLang server for the ``sglang`` tests: real SGLang 0.5.23 on CPU, serving a tiny ``agentflow model init``
model, from the venv that ``scripts/sglang_test_venv.sh`` builds (``.venv-sglang/``; ``scripts/setup.sh --dev`` runs
it). The session fixture ``sglang_server`` (tests/conftest.py) starts one per test session and stops it at the end.

The server runs in its own process group (SGLang starts a scheduler and a detokenizer process beside its HTTP
process), on 127.0.0.1 and a free port, one torch thread, fp32, a small KV pool (8192 tokens), no CUDA graphs.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from agentflow.model_init import ModelInitConfig, init_model

ROOT = Path(__file__).resolve().parent.parent
TINY = ModelInitConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=176, num_attention_heads=4)
START_TIMEOUT_S = 300.0


def venv_dir() -> Path:
    return Path(os.environ.get("AGENTFLOW_SGLANG_VENV", ROOT / ".venv-sglang"))


def venv_ready() -> bool:
    """The test venv is built (its stamp is written last, after sglang imported)."""
    return (venv_dir() / "agentflow-stamp").is_file() and (venv_dir() / "bin" / "python").is_file()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LiveServer:
    """One running SGLang server: its URL, the model it serves, its log, its process."""

    url: str
    model_dir: Path
    log: Path
    proc: subprocess.Popen
    startup_s: float

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:]) if self.log.is_file() else ""

    def decode_logs(self) -> int:
        """How many decode-progress lines the server has logged (one per 40 decode steps of a running batch)."""
        return self.log.read_text(errors="replace").count("Decode batch") if self.log.is_file() else 0

    def close(self) -> None:
        """Stop the whole process group (SIGTERM, then SIGKILL after 20 s)."""
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=20)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def start_server(work: Path, model_dir: Path | None = None, extra: tuple[str, ...] = ()) -> LiveServer:
    """Make the tiny model (unless given), launch SGLang on it and wait until ``/health`` answers."""
    if model_dir is None:
        model_dir = init_model(work / "tiny-qwen2", TINY)
    port = free_port()
    venv = venv_dir()
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env["PYTHONPATH"] = str(venv / "cpu_stubs")  # the CPU stand-in for sgl_kernel, and nothing of ours
    cmd = [str(venv / "bin" / "python"), "-m", "sglang.launch_server", "--model-path", str(model_dir)]
    cmd += ["--device", "cpu", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"]
    cmd += ["--mem-fraction-static", "0.05", "--max-total-tokens", "8192", "--disable-cuda-graph"]
    cmd += ["--grammar-backend", "llguidance"]  # reads our Lark grammars and masks as our replay does
    cmd += ["--sleep-on-idle", *extra]  # an idle server would otherwise keep half a core busy for the whole session
    log = work / "sglang-server.log"
    t0 = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    server = LiveServer(f"http://127.0.0.1:{port}", Path(model_dir), log, proc, 0.0)
    while time.monotonic() - t0 < START_TIMEOUT_S:
        if proc.poll() is not None:
            raise RuntimeError(f"SGLang server exited with {proc.returncode}:\n{server.log_tail()}")
        if _healthy(server.url):
            server.startup_s = time.monotonic() - t0
            return server
        time.sleep(1.0)
    server.close()
    raise RuntimeError(f"SGLang server not healthy after {START_TIMEOUT_S:.0f} s:\n{server.log_tail()}")
