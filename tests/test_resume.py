"""Lossless resume: SIGKILL the trainer at random points of a real run (once mid-checkpoint), resume each time with
``agentflow train --resume``, and prove by trajectory ids that nothing accepted was lost or trained twice."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from agentflow.model_init import ModelInitConfig, init_model
from agentflow.resume import ResumeError, checkpoints, group_index, untrained_groups
from agentflow.store import Journal
from agentflow.types import Segment, Trajectory

REPO = Path(__file__).resolve().parent.parent
TINY = ModelInitConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=176, num_attention_heads=4)
STEPS, B, G = 60, 2, 2  # enough steps that every kill lands before the run ends, even on a fast machine
KILL_JITTER_S = 0.15  # random delay after the target step: a tiny model steps every ~50 ms on a quiet machine, so a
# delay of up to 1 s once let a first run reach step 23 of 30 and the third run finish before its kill


def _traj(gid: str, i: int) -> Trajectory:
    seg = Segment()
    seg.append_context([1, 2])
    seg.append_generated([3], [-0.1], [0])
    return Trajectory(id=f"{gid}-{i}", task_id="t", group_id=gid, env_id="e", segments=[seg], reward=1.0)


def test_untrained_groups_skip_trained_and_torn_groups():
    journal = [_traj(g, i) for g in ("g0", "g2", "g1") for i in range(2)] + [_traj("g3", 0)]  # g3 torn
    groups, nxt = untrained_groups(journal, {"g0-0", "g0-1"}, group_size=2)
    assert [g.id for g in groups] == ["g1", "g2"] and nxt == 4  # dispatch order, after the journal's last group
    with pytest.raises(ResumeError, match="partly trained"):
        untrained_groups(journal, {"g1-0"}, group_size=2)
    with pytest.raises(ResumeError, match="twice"):
        untrained_groups(journal + [_traj("g0", 0)], set(), group_size=2)
    with pytest.raises(ResumeError, match="g<n>"):
        group_index("eval-3")


def test_journal_drops_a_torn_last_line_only(tmp_path):
    j = Journal(tmp_path / "j.jsonl")
    j.append([_traj("g0", 0), _traj("g0", 1)])
    j.close()
    with open(tmp_path / "j.jsonl", "a") as f:
        f.write(_traj("g1", 0).to_json()[:40])  # a write cut by a crash
    assert [t.id for t in Journal.read(tmp_path / "j.jsonl")] == ["g0-0", "g0-1"]
    (tmp_path / "bad.jsonl").write_text("{not json}\n" + _traj("g0", 0).to_json() + "\n")
    with pytest.raises(ValueError, match="line 1"):
        Journal.read(tmp_path / "bad.jsonl")


def test_journal_cuts_a_torn_tail_before_appending(tmp_path):
    path = tmp_path / "j.jsonl"
    j = Journal(path)
    j.append([_traj("g0", 0), _traj("g0", 1)])
    j.close()
    with open(path, "a") as f:
        f.write(_traj("g1", 0).to_json()[:40])  # a write cut by a crash
    j = Journal(path)  # the resumed run opens the journal again
    assert j.cut_bytes == 40
    j.append([_traj("g1", 0), _traj("g1", 1)])
    j.close()
    assert [t.id for t in Journal.read(path)] == ["g0-0", "g0-1", "g1-0", "g1-1"]  # nothing merged, nothing lost


def test_a_truncated_newest_checkpoint_falls_back_to_the_one_before(tmp_path):
    from agentflow.resume import load_latest
    from trainer.launcher import LocalTrainerGroup
    from trainer.types import TrainerSettings

    model = init_model(tmp_path / "m", ModelInitConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=176,
                                                        num_attention_heads=4))  # fmt: skip
    group = LocalTrainerGroup(model, TrainerSettings(threads=1))
    try:
        ck = tmp_path / "run" / "checkpoints"
        ck.mkdir(parents=True)
        group.save_checkpoint(str(ck / "step_1.pt"), {"step": 1})
        group.save_checkpoint(str(ck / "step_2.pt"), {"step": 2})
        data = (ck / "step_2.pt").read_bytes()
        (ck / "step_2.pt").write_bytes(data[: len(data) // 3])
        path, extra, skipped = load_latest(tmp_path / "run", group.load_checkpoint)
        assert path == ck / "step_1.pt" and extra == {"step": 1}
        assert len(skipped) == 1 and skipped[0].startswith("step_2.pt")
    finally:
        group.close()


def test_resume_needs_a_run_directory(tmp_path):
    from agentflow.cli import main

    assert main(["train", "--resume", str(tmp_path / "nope")]) == 2


# ------------------------------------------------------------------------------------------- crash and resume


def _start(
    run_dir: Path, model: Path, log: Path, resume: bool, env_extra: dict | None = None, extra: tuple[str, ...] = ()
) -> subprocess.Popen:
    (run_dir / "processes.json").unlink(missing_ok=True)
    args = ["--resume", str(run_dir)] if resume else []
    overrides = [
        f"model.path={model}",
        "sft.enabled=false",
        "run.mode=async",
        f"run.steps={STEPS}",
        f"run.dir={run_dir}",
        "run.progress=false",
        "run.checkpoint_every=1",
        f"store.batch_groups={B}",
        "store.stale_steps=1",
        f"rollout.group_size={G}",
        "rollout.max_new_tokens=12",
        "eval.episodes=2",
        "engine.max_len=384",
        "trainer.micro_batch_tokens=2048",
        "trainer.drop_uniform_groups=false",
        *extra,
    ]
    if resume:
        overrides = []  # the run directory's saved config, unchanged
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    cmd = [sys.executable, "-m", "agentflow.cli", "train", *args, *overrides]
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _wait(what: str, pred, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if proc.poll() is not None:
            raise AssertionError(f"job exited ({proc.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _kill_trainer(run_dir: Path, proc: subprocess.Popen, log: Path) -> None:
    _wait("processes.json", lambda: (run_dir / "processes.json").is_file(), proc)
    pid = json.loads((run_dir / "processes.json").read_text())["trainer"][0]
    os.kill(pid, signal.SIGKILL)
    try:
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert "agentflow train --resume" in log.read_text(), log.read_text()[-3000:]


def _assert_resumed_without_loss(run_dir: Path, tmp_path: Path) -> None:
    """After the three kills and the final resume: every group trained exactly once, none skipped."""
    logs = "".join((tmp_path / f"log{i}.txt").read_text() for i in (2, 3, 4))
    assert logs.count("resumed ") == 3
    final = torch.load(run_dir / "checkpoints" / f"step_{STEPS:06d}.pt", weights_only=False)["extra"]
    trained = final["trained_ids"]
    journal = Journal.read(run_dir / "journal.jsonl")
    journal_ids = [t.id for t in journal]
    assert len(journal_ids) == len(set(journal_ids))  # no group was dispatched twice under one id
    assert len(trained) == len(set(trained)) == STEPS * B * G  # nothing trained twice
    assert set(trained) <= set(journal_ids)
    # nothing lost: training consumed accepted groups strictly in dispatch order, across all four runs, so the
    # trained groups are exactly the oldest journaled ones; a lost (never restored) group would leave a gap
    by_index = sorted({t.group_id for t in journal}, key=group_index)
    trained_groups = {i.rsplit("-", 1)[0] for i in trained}
    assert trained_groups == set(by_index[: STEPS * B])
    assert set(final["pending_ids"]) == set(journal_ids) - set(trained)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rl_steps"] == STEPS and summary["max_staleness_seen"] <= 1


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_trainer_three_times_then_resume_loses_nothing(tmp_path):
    seed = int(os.environ.get("AGENTFLOW_TEST_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    print(f"kill points seed {seed}")
    model = init_model(tmp_path / "model", TINY)
    run_dir = tmp_path / "run"
    procs: list[subprocess.Popen] = []
    try:
        # 1: a random point of the first run
        procs.append(p := _start(run_dir, model, tmp_path / "log1.txt", resume=False))
        target = rng.randint(1, 2)
        _wait(f"step {target}", lambda: _steps_logged(run_dir) >= target, p)
        time.sleep(rng.uniform(0.0, KILL_JITTER_S))
        _kill_trainer(run_dir, p, tmp_path / "log1.txt")

        # 2: in the middle of a checkpoint write (the write is held open by the trainer's fault-injection hook)
        newest = checkpoints(run_dir)[0][0] if checkpoints(run_dir) else 0
        name = f"step_{newest + rng.randint(1, 2):06d}"
        for stale in (run_dir / "checkpoints").glob("*.tmp"):  # the first kill may have left one mid-write
            stale.unlink()
        pause = {"AGENTFLOW_FAULT_CHECKPOINT_PAUSE": f"{name}.pt:60"}
        procs.append(p := _start(run_dir, model, tmp_path / "log2.txt", resume=True, env_extra=pause))
        tmp = run_dir / "checkpoints" / f"{name}.tmp"
        _wait(f"{tmp.name} being written", tmp.is_file, p)
        time.sleep(0.2)
        _kill_trainer(run_dir, p, tmp_path / "log2.txt")
        assert tmp.is_file() and not (run_dir / "checkpoints" / f"{name}.pt").exists()

        # 3: another random point
        procs.append(p := _start(run_dir, model, tmp_path / "log3.txt", resume=True))
        target = _steps_logged(run_dir) + rng.randint(1, 2)
        _wait(f"{target} metrics lines", lambda: _steps_logged(run_dir) >= target, p)
        time.sleep(rng.uniform(0.0, KILL_JITTER_S))
        _kill_trainer(run_dir, p, tmp_path / "log3.txt")

        # the last resume runs to the end
        procs.append(p := _start(run_dir, model, tmp_path / "log4.txt", resume=True))
        assert p.wait(timeout=240) == 0, (tmp_path / "log4.txt").read_text()[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    _assert_resumed_without_loss(run_dir, tmp_path)


def test_a_resumed_run_counts_its_journal_against_the_token_budget(tmp_path):
    from agentflow.resume import plan_resume

    (tmp_path / "config.yaml").write_text("{}\n")
    journal = Journal(tmp_path / "journal.jsonl")
    journal.append([_traj("g0", 0), _traj("g0", 1)])  # one generated token each
    journal.close()
    state = plan_resume(tmp_path, lambda path: {}, group_size=2)  # no checkpoint yet: nothing to load
    assert state.step == 0 and state.generated_tokens == 2 and [g.id for g in state.groups] == ["g0"]
