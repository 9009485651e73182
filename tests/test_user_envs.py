"""A user's env trains with nothing of the demo's: its own expert (or none), its own warm-up, its own evaluation.

The README's "Add your own environment" example is copied into a fresh module exactly as the README shows it and
trained on: without a warm-up (no expert used), and with the README's job config (its expert's warm-up, then RL),
which must improve held-out success over its warm-up. An env registered only with ``gymnasium.register`` trains
too.
"""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest

from agentflow.builder import JobError
from agentflow.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TINY_JOB = ["model.init_if_missing=false", "run.progress=false", "store.batch_groups=2", "rollout.group_size=2",
            "rollout.max_new_tokens=12", "eval.episodes=2", "engine.max_len=384", "engine.max_slots=8",
            "trainer.micro_batch_tokens=2048", "trainer.drop_uniform_groups=false"]  # fmt: skip

_GYM_MODULE = '''
import gymnasium
from gymnasium import spaces


class Guess(gymnasium.Env):
    """Say the secret letter; text in, text out."""

    observation_space = spaces.Text(64)
    action_space = spaces.Text(16)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.letter = "abcd"[int(self.np_random.integers(0, 4))]
        return "Which letter, a to d?", {"task_type": "guess"}

    def step(self, action):
        right = action.strip() == self.letter
        return ("right" if right else "no"), float(right), right, False, {}


gymnasium.register("gymjob/Guess-v0", entry_point=Guess, max_episode_steps=2)
'''


def readme_block(heading: str, lang: str) -> str:
    """The first ``lang`` code block after ``heading`` in README.md, exactly as written there."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index(heading) :]
    match = re.search(rf"```{lang}\n(.*?)```", section, re.S)
    assert match, f"no {lang} block after {heading!r}"
    return match.group(1)


@pytest.fixture
def on_path(tmp_path, monkeypatch):
    """A fresh directory on ``sys.path`` for user modules (removed from ``sys.modules`` afterwards)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        if name.split(".")[0] in ("gym_guess", "my_envs"):
            del sys.modules[name]


def test_a_job_trains_on_an_env_registered_only_with_gymnasium(pair, on_path):
    from agentflow.recipes.rl import run_job
    from agentflow.store import Journal

    (on_path / "gym_guess.py").write_text(_GYM_MODULE)
    student, _ = pair
    run_dir = on_path / "run"
    over = [f"model.path={student}", "env.id=gym_guess:gymjob/Guess-v0", "sft.enabled=false", "run.steps=2",
            f"run.dir={run_dir}", *TINY_JOB]  # fmt: skip
    summary = run_job(load_config(None, over), log=lambda *_: None)
    assert summary["rl_steps"] == 2 and summary["scripted_policy_success"] is None
    assert set(summary["per_type_before_rl"]) == {"guess"}
    trajs = Journal.read(run_dir / "journal.jsonl")
    assert trajs and all(t.env_id == "gym_guess:gymjob/Guess-v0" and t.status != "error" for t in trajs)


def test_a_warm_up_without_an_expert_is_refused_before_anything_starts(on_path):
    from agentflow.recipes.rl import run_job

    (on_path / "gym_guess.py").write_text(_GYM_MODULE)
    run_dir = on_path / "run"
    cfg = load_config(None, ["env.id=gym_guess:gymjob/Guess-v0", f"run.dir={run_dir}"])
    with pytest.raises(JobError, match=r"^sft.enabled=true needs a scripted expert, and gym_guess:gymjob/Guess-v0 "):
        run_job(cfg, log=lambda *_: None)
    bad = load_config(None, ["env.id=gym_guess:gymjob/Guess-v0", f"run.dir={run_dir}", "sft.expert=gym_guess:Gues"])
    with pytest.raises(JobError, match="sft.expert 'gym_guess:Gues': module 'gym_guess' has no callable 'Gues'"):
        run_job(bad, log=lambda *_: None)
    demo_next_to_sources = load_config(
        None, ["data.sources=[{env_id: gym_guess:gymjob/Guess-v0}]", f"run.dir={run_dir}"]
    )
    with pytest.raises(JobError, match="warms up on env.id=agentflow/Calc-v0, which is none of data.sources"):
        run_job(demo_next_to_sources, log=lambda *_: None)
    assert not run_dir.exists()


def test_each_shipped_env_declares_its_own_expert():
    import envs
    import envs.demo
    from agentflow.recipes.warmup import job_expert

    for env_id in (e for e in envs.list_envs() if e.startswith("agentflow/")):
        found = job_expert(load_config(None, [f"env.id={env_id}"]))
        assert found is not None and found[1].endswith(":expert_action"), env_id
    calc = job_expert(load_config(None, []))
    assert calc is not None and calc[0] is envs.demo.expert_action  # the demo keeps its expert
    override = job_expert(load_config(None, ["sft.expert=agentflow.demos.distill_experts:calc_expert"]))
    assert override is not None and override[1] == "agentflow.demos.distill_experts:calc_expert"


def _readme_env(on_path: Path) -> str:
    """The README's env file, written to ``my_envs/reverse.py`` exactly as the README shows it; its job id."""
    code = readme_block("### Add your own environment", "python")
    first = code.splitlines()[0]
    assert first == "# my_envs/reverse.py", first
    (on_path / "my_envs").mkdir()
    (on_path / "my_envs" / "reverse.py").write_text(code)
    return "my_envs.reverse:me/Reverse-v0"


@pytest.mark.slow
def test_the_readme_example_trains_without_a_warm_up(pair, on_path):
    from agentflow.recipes.rl import run_job

    env_id = _readme_env(on_path)
    student, _ = pair
    over = [f"model.path={student}", f"env.id={env_id}", "sft.enabled=false", "run.steps=2",
            f"run.dir={on_path / 'run'}", *TINY_JOB]  # fmt: skip
    summary = run_job(load_config(None, over), log=lambda *_: None)
    assert summary["rl_steps"] == 2 and summary["sft"] is None and summary["scripted_policy_success"] is None
    assert summary["eval_errors"] == {"before": 0, "after": 0}


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_readme_job_config_improves_on_its_warm_up(on_path):
    """The README's job config as documented, on the copy (the README's ``env.id=`` override; the model and run
    directories moved to a scratch place)."""
    from agentflow.recipes.rl import run_job

    env_id = _readme_env(on_path)
    config = readme_block("A job config for it", "yaml")
    assert config == (ROOT / "configs" / "reverse.yaml").read_text()
    path = on_path / "reverse.yaml"
    path.write_text(config)
    over = [f"env.id={env_id}", f"model.path={on_path / 'model'}", f"run.dir={on_path / 'runs' / 'reverse'}"]
    summary = run_job(load_config(path, over), log=print)
    assert summary["sft"] is not None and summary["scripted_policy_success"] is not None
    print(textwrap.shorten(str({k: summary[k] for k in ("scripted_policy_success", "success_before_rl",
                                                          "success_after_rl", "wall_s")}), 300))  # fmt: skip
    assert summary["success_after_rl"] > summary["success_before_rl"], summary["evals"]
