"""Every job key acts the same in RL and in distillation: one builder assembles both.

Each case runs a tiny ``train`` (RL) or ``distill`` job with one key set and checks that the key acted, from the
summary, the metrics or the journal. A key a recipe cannot honour would have to be refused before start instead;
none of these is.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import require

from agentflow.config import load_config
from agentflow.store import Journal

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BLACKBOX = ["agent.type=blackbox", "agent.entry=agentflow.demos.blackbox_agent:tool_agent"]


def _run(recipe: str, pair: tuple[Path, Path], run_dir: Path, extra: list[str]) -> dict:
    student, teacher = pair
    over = [f"model.path={student}", "model.init_if_missing=false", "sft.enabled=false", "run.steps=3",
            f"run.dir={run_dir}", "run.progress=false", "store.batch_groups=2", "store.stale_steps=1",
            "rollout.group_size=2", "rollout.max_new_tokens=12", "eval.episodes=2", "engine.max_len=384",
            "engine.max_slots=8", "trainer.micro_batch_tokens=2048", "trainer.drop_uniform_groups=false"]  # fmt: skip
    if recipe == "distill":
        over += [f'teachers.models=[{{"name": "t", "path": "{teacher}"}}]', 'teachers.routes={"default": "t"}']
        over += ["teachers.reward_coef=0.5"]
        from agentflow.recipes.distill import run_distill as run
    else:
        from agentflow.recipes.rl import run_job as run
    return run(load_config(None, [*over, *extra]), log=lambda *_: None)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _blackbox_acted(summary: dict, run_dir: Path) -> None:
    assert summary["agent"] == "blackbox"
    trajs = Journal.read(run_dir / "journal.jsonl")
    assert trajs and all(t.info.get("calls", 0) >= 1 for t in trajs)  # recorded by the proxy, call by call


def _recycle_acted(summary: dict, run_dir: Path) -> None:
    assert summary["partial"] == "recycle" and summary["recycled"] >= 0
    for traj in Journal.read(run_dir / "journal.jsonl"):  # no generation spans a weight update: each turn has one
        for turn in traj.turns:
            seg = traj.segments[turn.segment]
            a, b = turn.span
            versions = {v for v, m in zip(seg.versions[a:b], seg.loss_mask[a:b], strict=True) if m}
            assert len(versions) <= 1, (traj.id, versions)


def _no_retries_acted(summary: dict, run_dir: Path) -> None:
    assert summary["episode_retries"] == 0


def _sync_acted(summary: dict, run_dir: Path) -> None:
    assert summary["stale_steps"] == 0 and summary["max_staleness_seen"] == 0
    assert set(summary["staleness_histogram"]) == {"0"} and summary["gate_closures"] == summary["rl_steps"]
    assert all(r["store/max_staleness_seen"] == 0 for r in _metrics(run_dir))


def _kl_acted(summary: dict, run_dir: Path) -> None:
    assert summary["kl_reference"] is True
    assert all("train/kl_ref" in r for r in _metrics(run_dir))


def _ray_acted(summary: dict, run_dir: Path) -> None:
    assert summary["runtime"].startswith("ray")


def _pin_acted(summary: dict, run_dir: Path) -> None:
    assert summary["partial"] == "pin"
    trajs = Journal.read(run_dir / "journal.jsonl")
    assert trajs and all(t.min_version() == t.max_version() for t in trajs)  # no trajectory holds two versions
    rows = [r for r in _metrics(run_dir) if "rollout/partial_ratio" in r]
    assert rows and all(r["rollout/partial_ratio"] == 0 for r in rows)


def _recompute_acted(summary: dict, run_dir: Path) -> None:
    kv = summary["kv_cache"]
    assert kv["kv_on_update"] == "recompute" and kv["kv_max_age"] == 1
    assert kv["kv_recomputed_tokens"] > 0  # cached prefixes were prefilled again under newer weights


def _spill_acted(summary: dict, run_dir: Path) -> None:
    kv = summary["kv_cache"]
    assert kv["admission"] == "resumed_first" and kv["kv_spill_bytes"] == 50_000_000
    assert kv["evicted_live"] > 0 and kv["kv_spilled"] == kv["evicted_live"] and kv["kv_ttl_s"] > 0


CASES = {
    "engine.kv_spill_bytes=50000000": (
        [
            "engine.kv_spill_bytes=50000000",
            "engine.admission=resumed_first",
            "engine.max_slots=2",
            "engine.kv_paused_aware=true",
        ],
        _spill_acted,
    ),
    "rollout.partial=pin": (["rollout.partial=pin"], _pin_acted),
    "engine.kv_on_update=recompute": (["engine.kv_on_update=recompute"], _recompute_acted),
    "agent.type=blackbox": (BLACKBOX, _blackbox_acted),
    "rollout.partial=recycle": (["rollout.partial=recycle"], _recycle_acted),
    "rollout.episode_retries=0": (["rollout.episode_retries=0"], _no_retries_acted),
    "run.mode=sync": (["run.mode=sync"], _sync_acted),
    "trainer.kl_coef=0.01": (["trainer.kl_coef=0.01"], _kl_acted),
    "ray.enabled=true": (["ray.enabled=true", "ray.env_workers=1"], _ray_acted),
}


@pytest.mark.parametrize("recipe", ["train", "distill"])
@pytest.mark.parametrize("key", list(CASES))
def test_key_acts_in_every_recipe(recipe, key, pair, tmp_path):
    if key.startswith("ray"):
        require(shutil.which("ray") is not None or _has_ray(), "ray")
    extra, acted = CASES[key]
    run_dir = tmp_path / "run"
    summary = _run(recipe, pair, run_dir, extra)
    assert summary["rl_steps"] == 3
    acted(summary, run_dir)
    if recipe == "distill":  # the teachers' signal is there whatever else is set
        assert summary["teacher_stats"]["sequences_scored"] == summary["trajectories_trained"]
        assert all("train/teacher_k1" in r for r in _metrics(run_dir))


def _has_ray() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


def test_teacher_keys_without_teachers_are_refused_before_start(pair, tmp_path):
    from agentflow.builder import JobError
    from agentflow.recipes.rl import run_job

    student, _ = pair
    cfg = load_config(None, [f"model.path={student}", "sft.enabled=false", f"run.dir={tmp_path / 'run'}",
                             "teachers.seq_kd.episodes=20"])  # fmt: skip
    with pytest.raises(JobError, match="teachers.seq_kd is set but no teachers are configured"):
        run_job(cfg, log=lambda *_: None)
    assert not (tmp_path / "run").exists()


def test_unknown_agent_is_refused_before_start_with_a_suggestion(pair, tmp_path):
    from agentflow.builder import JobError
    from agentflow.recipes.rl import run_job

    student, _ = pair
    base = [f"model.path={student}", "sft.enabled=false", f"run.dir={tmp_path / 'run'}"]
    with pytest.raises(JobError, match="Did you mean 'blackbox'"):
        run_job(load_config(None, [*base, "agent.type=blackbx"]), log=lambda *_: None)
    with pytest.raises(JobError, match="Did you mean 'agentflow.agents:WhiteBoxAgent'"):
        run_job(load_config(None, [*base, "agent.type=agentflow.agents:WhiteBoxAgnt"]), log=lambda *_: None)
    assert not (tmp_path / "run").exists()


def test_distill_resume_is_refused_with_one_line(pair, tmp_path):
    from agentflow.builder import JobError
    from agentflow.recipes.distill import run_distill

    student, teacher = pair
    cfg = load_config(None, [f"model.path={student}", "sft.enabled=false", f"run.dir={tmp_path / 'run'}",
                             f'teachers.models=[{{"name": "t", "path": "{teacher}"}}]',
                             'teachers.routes={"default": "t"}', "trainer.drop_uniform_groups=false"])  # fmt: skip
    with pytest.raises(JobError, match="cannot be resumed"):
        run_distill(cfg, log=lambda *_: None, resume=True)


def test_agents_by_module_path_and_entry_point(monkeypatch):
    from agentflow import agents

    assert isinstance(agents.make_agent("agentflow.agents:WhiteBoxAgent"), agents.WhiteBoxAgent)

    class FakeEntryPoint:
        def load(self):
            return agents.WhiteBoxAgent

    monkeypatch.setattr(agents, "_entry_points", lambda: {"plugged": FakeEntryPoint()})
    assert isinstance(agents.make_agent("plugged", context="compact"), agents.WhiteBoxAgent)
    with pytest.raises(ValueError, match="Did you mean 'plugged'"):
        agents.make_agent("pluged")
    with pytest.raises(ValueError, match="not an agentflow.agents.BaseAgent"):
        agents.make_agent("collections:OrderedDict")
