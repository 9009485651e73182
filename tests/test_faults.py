"""Faults: SIGKILL an env worker and an engine (Ray actors) during a real run; Ray restarts them, the episodes that were
on them are replayed, and the run finishes and reports what it retried."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import require

from agentflow.model_init import ModelInitConfig, init_model
from agentflow.store import Journal

REPO = Path(__file__).resolve().parent.parent
TINY = ModelInitConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=176, num_attention_heads=4)

pytestmark = pytest.mark.ray


def _have_ray() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


def ray_job_overrides(model: Path, run_dir: Path, steps: int) -> list[str]:
    return [
        f"model.path={model}",
        "sft.enabled=false",
        f"run.steps={steps}",
        f"run.dir={run_dir}",
        "run.progress=false",
        "store.batch_groups=2",
        "store.stale_steps=1",
        "rollout.group_size=4",
        "rollout.max_new_tokens=16",
        "eval.episodes=2",
        "engine.max_len=384",
        "trainer.micro_batch_tokens=2048",
        "trainer.drop_uniform_groups=false",
        "ray.enabled=true",
        "ray.env_workers=2",
    ]


def _steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _wait(what: str, pred, proc: subprocess.Popen, log: Path, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if proc.poll() is not None:
            raise AssertionError(f"job exited ({proc.returncode}) waiting for {what}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_killed_env_worker_and_engine_are_restarted_and_their_episodes_retried(tmp_path):
    require(_have_ray(), "ray")
    model = init_model(tmp_path / "model", TINY)
    run_dir = tmp_path / "run"
    log = tmp_path / "log.txt"
    cmd = [sys.executable, "-m", "agentflow.cli", "train", *ray_job_overrides(model, run_dir, steps=6)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait("the first step", lambda: _steps_logged(run_dir) >= 1, proc, log)
        pids = json.loads((run_dir / "processes.json").read_text())
        os.kill(pids["env_workers"][0], signal.SIGKILL)
        time.sleep(1.0)
        os.kill(pids["engines"][0], signal.SIGKILL)
        assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    summary = json.loads((run_dir / "summary.json").read_text())
    faults = summary["faults"]
    assert summary["rl_steps"] == 6 and summary["trajectories_trained"] == 6 * 2 * 4
    assert faults["retried_episodes"]["env_worker"] >= 1, faults
    assert faults["retried_episodes"]["engine"] >= 1 and faults["engine_restarts"] >= 1, faults
    assert len(faults["retried_ids"]) == sum(faults["retried_episodes"].values())
    assert summary["max_staleness_seen"] <= 1  # a restarted engine got the newest weights before serving again
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    errors = [(t.id, t.info) for t in Journal.read(run_dir / "journal.jsonl") if t.status == "error"]
    assert sum(r.get("rollout/error_frac", 0) for r in rows) == 0, errors  # every lost episode was replayed in full
