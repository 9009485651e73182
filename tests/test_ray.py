"""The same job config runs on a local Ray cluster (files inside the run dir) and, unedited, on a cluster started with
``ray start --head`` (found through ``RAY_ADDRESS``, Ray's own convention)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from conftest import require
from test_faults import ray_job_overrides

from agentflow.config import apply_override
from agentflow.model_init import ModelInitConfig, init_model

REPO = Path(__file__).resolve().parent.parent
TINY = ModelInitConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=176, num_attention_heads=4)

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]


def _ray_bin() -> str | None:
    path = Path(sys.executable).parent / "ray"
    return str(path) if path.is_file() else shutil.which("ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _train(config: Path, run_dir: Path, env: dict[str, str]) -> dict:
    cmd = [sys.executable, "-m", "agentflow.cli", "train", str(config), f"run.dir={run_dir}"]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    return json.loads((run_dir / "summary.json").read_text())


def test_same_config_runs_on_a_local_cluster_and_on_ray_start_head(tmp_path):
    require(_ray_bin() is not None, "ray")
    model = init_model(tmp_path / "model", TINY)
    data: dict = {}
    for item in ray_job_overrides(model, tmp_path / "unused", steps=2):
        if not item.startswith("run.dir="):
            apply_override(data, item)
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(data))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")

    local = _train(config, tmp_path / "local", env)
    assert local["runtime"] == "ray (local cluster)" and local["rl_steps"] == 2
    assert list((tmp_path / "local" / "ray").glob("session_*"))  # Ray's files stayed inside the run directory

    temp = Path(tempfile.mkdtemp(prefix="afray", dir="/tmp"))  # short: Ray's socket paths are limited to 107 bytes
    port = _free_port()
    head_cmd = [_ray_bin(), "start", "--head", "--block", f"--port={port}", "--num-cpus=2", f"--temp-dir={temp}"]
    head_cmd += ["--include-dashboard=false", "--disable-usage-stats", "--node-ip-address=127.0.0.1"]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE}
    head = subprocess.Popen(head_cmd, env=env, start_new_session=True, **quiet)
    try:
        deadline = time.monotonic() + 60
        while not list(temp.glob("session_*/logs/raylet.out")):
            assert head.poll() is None, head.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "ray start --head did not come up"
            time.sleep(0.5)
        joined = _train(config, tmp_path / "joined", {**env, "RAY_ADDRESS": f"127.0.0.1:{port}"})
    finally:
        os.killpg(head.pid, signal.SIGTERM)  # only the cluster this test started (its own session)
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        shutil.rmtree(temp, ignore_errors=True)
    assert joined["runtime"] == "ray (joined cluster)" and joined["rl_steps"] == 2
    assert not (tmp_path / "joined" / "ray").exists()  # the external cluster keeps its own files
