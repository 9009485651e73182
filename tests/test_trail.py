"""``agentflow/Trail-v0`` in a real bubblewrap sandbox: its trails, the expert's systematic failures, the vault."""

import re

import pytest
from conftest import check_job_config, play_episode, require

import envs
from envs.checker import check_agent_env
from envs.core import answer_action, tool_action
from envs.sandbox import bwrap_works
from envs.tasks import misread, task_hash
from envs.trail import EXPERT_FAILS, TASK_TYPES, expert_action, make_trail_task


@pytest.fixture
def env():
    require(bwrap_works(), "bubblewrap (bwrap)")
    made = envs.make("agentflow/Trail-v0")
    yield made
    made.close()


def play(env, policy, seed, split="train", task_type=None):
    """One episode of ``policy(env, history)``; returns (history, info)."""
    history, _, info = play_episode(env, policy, seed, split, **({"task_type": task_type} if task_type else {}))
    return history, info


def faithful(env, history):
    """What RL should learn: the expert's moves with every pointer and code copied exactly."""
    if not history:
        return tool_action("sh", {"command": "cat start.txt"})
    last = history[-1][1].strip().splitlines()[-1]
    if m := re.match(r"^code: (\d+)$", last):
        return answer_action(m.group(1))
    if m := re.match(r"^locked: run python3 vault\.py (\d+)$", last):
        return tool_action("sh", {"command": f"python3 vault.py {m.group(1)}"})
    m = re.match(r"^(?:next|relay): (\S+)$", last)
    assert m, last
    return tool_action("sh", {"command": f"cat {m.group(1)}"})


def test_expert_right_on_short_and_long_and_wrong_on_every_relay_and_vault(env):
    turns = {k: [] for k in TASK_TYPES}
    for split in ("train", "eval"):
        for seed in range(6):
            for kind in TASK_TYPES:
                history, info = play(env, expert_action, seed, split, kind)
                assert info["success"] is (kind not in EXPERT_FAILS), (split, seed, kind, history[-1])
                if kind in EXPERT_FAILS:  # it reached a decoy's code, not a dead end or an error
                    assert re.fullmatch(r"code: \d", history[-1][0].split('"')[3]) and history[-1][1] != "Correct."
                turns[kind].append(len(history))
    assert 5 <= min(turns["short"]) and max(turns["short"]) <= 7
    assert 13 <= min(turns["long"]) and max(turns["long"]) <= 17
    assert min(turns["relay"]) >= 6 and min(turns["vault"]) >= 6


def test_a_faithful_agent_solves_every_type(env):
    for seed in range(4):
        for kind in TASK_TYPES:
            history, info = play(env, faithful, seed, "eval", kind)
            assert info["success"] is True, (seed, kind, history[-2:])


def test_the_misread_digit_varies_and_never_matches():
    offsets = set()
    for seed in range(60):
        salt = task_hash("trail", seed)
        wrong = misread("4172", salt)
        assert wrong != "4172" and wrong[:-1] == "417"
        offsets.add((int(wrong[-1]) - 2) % 10)
    assert offsets == set(range(1, 10))  # every other digit occurs: an imitator cannot predict which


def test_vault_answers_right_code_denies_others_and_takes_its_time(env):
    delays = []
    for seed in range(40):
        task = make_trail_task(seed, "train", "vault")
        delays.append(task.vault_delay_s)
        assert 0.05 <= task.vault_delay_s <= 2.5
    assert max(delays) > 4 * min(delays)  # the tool latency varies by task
    env.reset(seed=3, options={"task_type": "vault"})
    locked = next(t for t in env.task.files.values() if "locked:" in t).strip().splitlines()[-1]
    code = locked.rsplit(" ", 1)[1]
    obs, *_ = env.step(tool_action("sh", {"command": f"python3 vault.py {code}"}))
    assert obs.startswith("next: ") and obs.split(" ")[1] in env.task.trail
    bad = code[:-1] + str((int(code[-1]) + 5) % 10)
    if bad != misread(code, task_hash("trail", env.task.task_id.rsplit("-", 1)[1])):
        obs, *_ = env.step(tool_action("sh", {"command": f"python3 vault.py {bad}"}))
        assert obs.startswith("access denied")


def test_tasks_deterministic_and_paths_unique():
    for seed in range(30):
        a, b = make_trail_task(seed, "train"), make_trail_task(seed, "train")
        assert a == b
        assert len(set(a.trail)) == len(a.trail) and all(p in a.files for p in a.trail)
        assert a.files[a.trail[-1]].strip().endswith(f"code: {a.answer}")
    assert {make_trail_task(s, "train").task_type for s in range(40)} == set(TASK_TYPES)


def test_task_types_option_and_unknown_type():
    require(bwrap_works(), "bubblewrap (bwrap)")
    env = envs.make("agentflow/Trail-v0", task_types=["relay"])
    try:
        assert {env.reset(seed=s)[1]["task_type"] for s in range(8)} == {"relay"}
    finally:
        env.close()
    with pytest.raises(ValueError, match="unknown Trail task types"):
        envs.make("agentflow/Trail-v0", task_types=["loop"])


def test_check_agent_env_with_expert_actions(env):
    check_agent_env(env)
    history, info = play(env, expert_action, 0)
    check_agent_env(env, actions=[a for a, _ in history], seed=0)


def test_episode_shape_hand_computed():
    from agentflow.recipes.evaluate import pooled
    from agentflow.rollout import episode_shape

    lengths = {
        "turns": [5, 7, 13, 6, 16, 2, 9, 8, 12, 14],
        "context_tokens": [400, 600, 1100, 500, 1300, 150, 700, 650, 1000, 1200],
        "episode_s": [0.2, 0.4, 1.0, 0.3, 2.0, 0.1, 0.5, 0.5, 0.9, 1.6],
        "success": [True, True, True, False, True, False, False, True, True, False],
    }
    shape = episode_shape(lengths)
    assert shape["median_turns_success"] == 8  # successes' turns 5 7 8 12 13 16: nearest rank 3 of 6
    assert shape["p90_turns"] == 14 and shape["max_turns"] == 16  # rank 9 of 10
    assert shape["p90_context_tokens"] == 1200 and shape["median_context_tokens"] == 650
    assert shape["median_episode_s"] == 0.5 and shape["p90_over_median_episode_s"] == pytest.approx(1.6 / 0.5)
    empty = episode_shape({k: [] for k in lengths})
    assert empty["p90_turns"] is None and empty["p90_over_median_episode_s"] is None
    half = {k: v[:5] for k, v in lengths.items()}, {k: v[5:] for k, v in lengths.items()}
    sources = {f"s{i}": {"success": 0.5, "episodes": 5, "errors": 0, "per_type": {}, "lengths": h} for i, h in
               enumerate(half)}  # fmt: skip
    assert episode_shape(pooled(sources)["lengths"]) == shape  # pooling two sources = one source of all episodes


def test_agentic_config_fits_the_longest_trails_and_its_job_runs(tmp_path):
    """``configs/agentic.yaml``: every expert trace (with a turn's budget) fits ``engine.max_len`` with the job's own
    tokenizer, and the job runs end to end (a tiny random model, a few steps) writing the long-horizon keys."""
    require(bwrap_works(), "bubblewrap (bwrap)")
    check_job_config("configs/agentic.yaml", tmp_path, expert_action, traces=16, min_longest=800,
                     overrides=["env.kwargs={task_types: [short]}"])  # fmt: skip


def test_the_right_code_counts_only_after_the_last_note_was_shown(env):
    """A one-digit code could be guessed: the verifier requires the trail's last note in some tool output."""
    env.reset(seed=3, options={"split": "eval", "task_type": "short"})
    code = env.unwrapped.task.answer
    env.step(tool_action("sh", {"command": "cat start.txt"}))
    *_, info = env.step(answer_action(code))
    assert info["success"] is False
    env.reset(seed=3, options={"split": "eval", "task_type": "short"})
    last = env.unwrapped.task.trail[-1]
    env.step(tool_action("sh", {"command": f"cat {last}"}))  # read the end directly: shown, so it counts
    *_, info = env.step(answer_action(f"code: {code}"))
    assert info["success"] is True
