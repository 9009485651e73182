"""Test-wide manners: one thread per process (2-core machines), components required in CI."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import pytest  # noqa: E402

try:
    import torch

    torch.set_num_threads(1)
except ImportError:  # pragma: no cover - torch is a hard dependency
    pass


def require(condition: bool, what: str) -> None:
    """Skip when a component is missing, or fail when CI says every component must be present."""
    if condition:
        return
    if os.environ.get("AGENTFLOW_REQUIRE_ALL") == "1":
        pytest.fail(f"{what} is required in CI (AGENTFLOW_REQUIRE_ALL=1) but missing")
    pytest.skip(f"{what} not available")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny student and a teacher with the student's tokenizer and sharper, different weights."""
    import shutil
    from dataclasses import replace

    from safetensors.torch import save_file

    from agentflow.model_init import ModelInitConfig, _init_weights, init_model

    tiny = ModelInitConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=176, num_attention_heads=4)
    root = tmp_path_factory.mktemp("pair")
    student = init_model(root / "student", tiny)
    teacher = root / "teacher"
    shutil.copytree(student, teacher)
    weights = _init_weights(replace(tiny, seed=7))
    weights = {k: v * 10.0 if "proj" in k or "embed" in k else v for k, v in weights.items()}
    save_file(weights, str(teacher / "model.safetensors"), metadata={"format": "pt"})
    return student, teacher


@pytest.fixture(scope="session")
def sglang_server(tmp_path_factory):
    """A live SGLang server on CPU (tests/sglang_live.py), shared by the ``sglang`` tests of a session."""
    from sglang_live import start_server, venv_ready

    require(venv_ready(), "the SGLang test venv (scripts/sglang_test_venv.sh)")
    server = start_server(tmp_path_factory.mktemp("sglang"))
    yield server
    server.close()


# Envs that need more than bubblewrap: their marker and the components to require.
ENV_NEEDS = {
    "agentflow/Browser-v0": (pytest.mark.browser, ("chromium",), "playwright"),
    "agentflow/Desktop-v0": (pytest.mark.desktop, ("Xvfb",), "Xlib"),
}
ADAPTED_NEEDS = {"textarena/": "textarena", "reasoning_gym/": "reasoning_gym"}
"""The package each adapted env family (envs/adapters.py) runs on, by id prefix."""


def env_param(env_id: str):
    """``env_id`` as a pytest parameter carrying its component marker."""
    need = ENV_NEEDS.get(env_id)
    return pytest.param(env_id, marks=need[0]) if need else env_id


def require_env(env_id: str) -> None:
    """Skip, or fail in CI, when the components ``env_id`` runs on are missing."""
    import importlib.util
    import shutil

    from envs.sandbox import bwrap_works

    require(bwrap_works(), "bubblewrap (bwrap)")
    for prefix, package in ADAPTED_NEEDS.items():
        if env_id.startswith(prefix):
            require(importlib.util.find_spec(package) is not None, f"the {package} package for {env_id}")
    if env_id in ENV_NEEDS:
        _, programs, module = ENV_NEEDS[env_id]
        found = all(shutil.which(p) for p in programs) and importlib.util.find_spec(module) is not None
        require(found, f"{', '.join(programs)} and the {module} package for {env_id}")


def play_episode(env, expert, seed: int, split: str = "train", **options):
    """One scripted-expert episode (``options``: more ``reset`` options); returns ``(history of (action,
    observation), final reward, final info)``."""
    env.reset(seed=seed, options={"split": split, **options})
    history = []
    while True:
        action = expert(env, history)
        obs, reward, terminated, truncated, info = env.step(action)
        history.append((action, obs))
        if terminated or truncated:
            return history, reward, info


def check_job_config(config: str, tmp_path, expert, traces: int, min_longest: int, overrides: list[str] = ()) -> dict:
    """A shipped job config: its env declares ``expert``, whose longest trace (of ``traces`` eval episodes, plus a
    turn's budget) fits ``engine.max_len`` with the job's own tokenizer and is longer than ``min_longest`` tokens,
    and the job runs end to end (a tiny random model, 2 steps) writing the long-horizon summary keys."""
    from pathlib import Path

    import envs
    from agentflow.chat import ChatTokenizer
    from agentflow.config import load_config
    from agentflow.model_init import ModelInitConfig, init_model
    from agentflow.recipes.rl import SHAPE_KEYS, run_job
    from agentflow.recipes.warmup import expert_sample

    path = Path(__file__).resolve().parents[1] / config
    cfg = load_config(path)
    assert envs.spec(cfg.env.id).load_expert() is expert
    tiny = ModelInitConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=176, num_attention_heads=4)
    model = init_model(tmp_path / "model", tiny, env_ids=[cfg.env.id])
    tok, env = ChatTokenizer(model), envs.make(cfg.env.id)
    try:
        longest = max(len(expert_sample(env, expert, tok, s, "eval")[0].token_ids) for s in range(traces))
    finally:
        env.close()
    assert min_longest < longest and longest + cfg.rollout.max_new_tokens <= cfg.engine.max_len
    over = [f"model.path={model}", f"run.dir={tmp_path / 'run'}", "run.progress=false", "run.steps=2"]
    over += ["sft.episodes=8", "sft.val_episodes=4", "sft.max_epochs=1", "eval.episodes=4"]
    over += ["store.batch_groups=1", "rollout.group_size=2", "trainer.drop_uniform_groups=false", *overrides]
    summary = run_job(load_config(path, over), log=lambda *_: None)
    assert summary["rl_steps"] == 2 and summary["errors"] == 0
    assert all(k in summary for k in SHAPE_KEYS) and summary["p90_turns"] >= 1
    return summary
