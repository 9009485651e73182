"""A multi-node Ray cluster on this machine (Ray's own test cluster: each node its own raylet, resources and labels).

Engines and env workers run on a rollout node, the trainer on a trainer node, chosen by the job's label selectors;
the job's driver joins the cluster like any user job. Removing the rollout node mid-run, the job waits for a
replacement node (``ray.on_node_loss: wait``), replays the lost episodes on it, gives the new engine the current
weights and completes, and its summary names the node lost and the actors moved. Removing the trainer node, the job
ends with its checkpoint, and ``--resume`` completes it on the remaining nodes (``replace``): by trajectory id,
nothing lost and nothing trained twice.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import require
from test_faults import ray_job_overrides

from agentflow.config import apply_override
from agentflow.model_init import ModelInitConfig, init_model
from agentflow.resume import checkpoints
from agentflow.store import Journal

REPO = Path(__file__).resolve().parent.parent
TINY = ModelInitConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=176, num_attention_heads=4)
ROLE = "agentflow/role"
STEPS = 6
#: every node and the job's driver resolve "this machine" to loopback (Ray would otherwise advertise the host's
#: routable address, and nodes started on 127.0.0.1 are not reachable there)
LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]


class Nodes:
    """The test cluster and the nodes added to it."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster

    def add(self, role: str) -> Any:
        return self.cluster.add_node(
            num_cpus=2, node_ip_address="127.0.0.1", labels={ROLE: role}, object_store_memory=100 << 20
        )

    def remove(self, node: Any) -> None:
        self.cluster.remove_node(node, allow_graceful=False)


@pytest.fixture(scope="module")
def nodes() -> Iterator[Nodes]:
    try:
        from ray.cluster_utils import Cluster
    except ImportError:
        require(False, "ray")
    saved = {k: os.environ.get(k) for k in [*LOOPBACK, "RAY_TMPDIR"]}
    os.environ.update(LOOPBACK)  # the nodes' processes inherit it
    temp = tempfile.mkdtemp(prefix="afrc", dir="/tmp")  # short: Ray's socket paths are limited to 107 bytes
    # the test cluster writes its address file under $RAY_TMPDIR/ray (default /tmp/ray, absent on a fresh machine)
    os.environ["RAY_TMPDIR"] = temp
    os.makedirs(os.path.join(temp, "ray"), exist_ok=True)
    fast_health = {
        "health_check_period_ms": 500,
        "health_check_failure_threshold": 4,
        "health_check_initial_delay_ms": 0,
    }
    head = {"num_cpus": 2, "node_ip_address": "127.0.0.1", "labels": {ROLE: "head"}, "temp_dir": temp,
            "object_store_memory": 100 << 20, "include_dashboard": False, "_system_config": fast_health}  # fmt: skip
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        yield Nodes(cluster)
    finally:
        cluster.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _write_config(tmp_path: Path, run_dir: Path, extra: dict[str, Any]) -> Path:
    model = init_model(tmp_path / "model", TINY)
    data: dict[str, Any] = {}
    for item in ray_job_overrides(model, run_dir, steps=STEPS):
        apply_override(data, item)
    for section, values in extra.items():
        data.setdefault(section, {}).update(values)
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(data))
    return config


def _job_env(nodes: Nodes) -> dict[str, str]:
    env = {**os.environ, **LOOPBACK, "OMP_NUM_THREADS": "1", "RAY_ADDRESS": nodes.cluster.address}
    return env


def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    out = open(log, "w")  # noqa: SIM115 - closed by the process' end (the file stays with the test's tmp dir)
    cmd = [sys.executable, "-m", "agentflow.cli", "train", *args]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _wait_for(what: str, pred: Any, proc: subprocess.Popen, log: Path, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if proc.poll() is not None:
            raise AssertionError(f"job exited ({proc.returncode}) waiting for {what}:\n{log.read_text()[-3000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _finish(proc: subprocess.Popen, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        _kill(proc)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # only the job this test started (its own session)
        proc.wait()


def _trained_once(run_dir: Path, summary: dict[str, Any]) -> list[str]:
    """The final checkpoint's trained ids: each once, each journaled; every other journaled one is still pending."""
    import torch

    (step, last), *_ = checkpoints(run_dir)
    assert step == STEPS
    final = torch.load(last, map_location="cpu", weights_only=False)["extra"]
    trained = final["trained_ids"]
    journaled = [t.id for t in Journal.read(run_dir / "journal.jsonl")]
    assert len(journaled) == len(set(journaled))
    assert len(trained) == len(set(trained)) == summary["trajectories_trained"]
    assert set(trained) <= set(journaled)
    assert set(final["pending_ids"]) == set(journaled) - set(trained)  # the rest is in the store, not lost
    return trained


def test_lost_rollout_node_is_replaced_and_its_episodes_replayed(nodes: Nodes, tmp_path: Path) -> None:
    rollout = nodes.add("rollout-a")
    trainer_node = nodes.add("trainer-a")
    run_dir = tmp_path / "run"
    ray_section = {
        "engine_labels": {ROLE: "rollout-a"},
        "env_worker_labels": {ROLE: "rollout-a"},
        "trainer_labels": {ROLE: "trainer-a"},
        "on_node_loss": "wait",
        "recover_timeout_s": 240,
    }
    config = _write_config(tmp_path, run_dir, {"ray": ray_section})
    log = tmp_path / "log.txt"
    proc = _start([str(config)], _job_env(nodes), log)
    added = [trainer_node]
    try:
        _wait_for("the first step", lambda: _steps_logged(run_dir) >= 1, proc, log)
        nodes.remove(rollout)
        time.sleep(3.0)  # the job sees its engine and env workers gone (pending: no node has their labels)
        replacement = nodes.add("rollout-a")
        added.append(replacement)
        assert _finish(proc, timeout=400) == 0, log.read_text()[-3000:]
    finally:
        _kill(proc)
        for node in added:  # the next test starts from the head alone
            nodes.remove(node)
    summary = json.loads((run_dir / "summary.json").read_text())
    faults = summary["faults"]
    assert summary["rl_steps"] == STEPS and summary["runtime"] == "ray (joined cluster)"
    (lost,) = faults["nodes_lost"]
    assert lost["node"] == rollout.node_id and lost["labels"][ROLE] == "rollout-a"
    assert {"engine 0", "env_worker 0", "env_worker 1"} <= set(lost["held"])
    moved = {m["actor"]: m for m in faults["actors_moved"]}
    assert moved["engine 0"]["to"] == replacement.node_id and "trainer 0" not in moved
    # the episodes in flight on the lost node (none when the window happened to be full) were replayed in full
    assert faults["engine_restarts"] >= 1 and faults["lost_after_retries"] == 0, faults
    assert len(faults["retried_ids"]) == sum(faults["retried_episodes"].values())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(r.get("rollout/error_frac", 0) for r in rows) == 0
    assert summary["max_staleness_seen"] <= 1  # the new engine got the current weights before serving
    _trained_once(run_dir, summary)


def test_lost_trainer_node_ends_the_job_and_resume_completes_it(nodes: Nodes, tmp_path: Path) -> None:
    rollout = nodes.add("rollout-b")
    trainer_node = nodes.add("trainer-b")
    run_dir = tmp_path / "run"
    ray_section = {"engine_labels": {ROLE: "rollout-b"}, "env_worker_labels": {ROLE: "rollout-b"},
                   "trainer_labels": {ROLE: "trainer-b"}, "on_node_loss": "replace"}  # fmt: skip
    config = _write_config(tmp_path, run_dir, {"ray": ray_section, "run": {"checkpoint_every": 1}})
    env = _job_env(nodes)
    log = tmp_path / "log.txt"
    proc = _start([str(config)], env, log)
    try:
        _wait_for("two checkpoints", lambda: len(checkpoints(run_dir)) >= 2, proc, log)
        nodes.remove(trainer_node)
        assert _finish(proc, timeout=300) != 0
    finally:
        _kill(proc)
    text = log.read_text()
    assert f"agentflow train --resume {run_dir}" in text, text[-3000:]
    assert not (run_dir / "summary.json").exists()
    kept = checkpoints(run_dir)[0][0]
    assert 2 <= kept < STEPS

    log2 = tmp_path / "resume.txt"
    proc = _start(["--resume", str(run_dir)], env, log2)
    try:
        assert _finish(proc, timeout=400) == 0, log2.read_text()[-3000:]
    finally:
        nodes.remove(rollout)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"].endswith(f"step_{kept:06d}.pt")
    faults = summary["faults"]
    assert faults["nodes_lost"] == [] and faults["nodes_now"] == faults["nodes_at_start"]
    (trainer_at,) = faults["placement"]["trainer"]  # replaced: no node has its labels any more
    assert trainer_at not in (None, trainer_node.node_id)
    trained = _trained_once(run_dir, summary)
    assert len(trained) == STEPS * 2 * 4
