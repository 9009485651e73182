"""The desktop env on a real Xvfb with the shipped Tk apps, driven through XTEST."""

from __future__ import annotations

import asyncio
import importlib.util
import shutil

import pytest
from conftest import check_job_config, require
from test_browser import check_png

from envs.core import answer_action, tool_action

pytestmark = pytest.mark.desktop


def require_desktop() -> None:
    ok = shutil.which("Xvfb") is not None and all(importlib.util.find_spec(m) for m in ("Xlib", "mss", "tkinter"))
    require(ok, "Xvfb + python-xlib + mss + tkinter (apt-get install xvfb; pip install python-xlib mss)")


@pytest.fixture(scope="module")
def env():
    require_desktop()
    from envs.desktop.env import DesktopEnv

    e = DesktopEnv()
    yield e
    e.close()


def play_expert(env, seed: int, task_type: str) -> tuple[float, dict, list[bytes]]:
    from envs.desktop.tasks import expert_action

    _, info = env.reset(seed=seed, options={"task_type": task_type})
    images = list(info["images"])
    history: list[tuple[str, str]] = []
    while True:
        action = expert_action(env, history)
        obs, reward, terminated, truncated, info = env.step(action)
        images += info["images"]
        history.append((action, obs))
        if terminated or truncated:
            return reward, info, images


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("task_type", ["calculator", "editor"])
def test_expert_solves_every_task_type(env, task_type, seed, tmp_path):
    reward, info, images = play_expert(env, seed, task_type)
    assert reward == 1.0 and info["success"] and all(info["checks"].values()), info
    for i, png in enumerate(images):
        check_png(png, (640, 480))
        (tmp_path / f"{task_type}-{i}.png").write_bytes(png)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_expert_fails_every_total_and_the_right_entry_solves_it(env, seed):
    """``total`` is the type the expert gets wrong, by one misread digit of the last amount, never by chance; the
    right sum entered the same way succeeds."""
    from envs.desktop.tasks import find_center

    reward, info, _ = play_expert(env, seed, "total")
    assert reward == 0.0 and not info["success"] and info["checks"] == {"expression": False, "result": False}
    obs, _ = env.reset(seed=seed, options={"task_type": "total"})
    task = env.unwrapped.task
    assert task.prompt.startswith("Add up ") and task.goal["expression"].count("+") == 2
    env.step(tool_action("click", dict(zip("xy", find_center(obs, "display"), strict=True))))
    obs, *_ = env.step(tool_action("type_text", {"text": task.goal["expression"]}))
    env.step(tool_action("click", dict(zip("xy", find_center(obs, "equals"), strict=True))))
    _, reward, terminated, _, info = env.step(answer_action("done"))
    assert terminated and reward == 1.0 and info["success"], info


def test_total_misread_differs_in_the_last_digit_only():
    from envs.desktop.tasks import EXPERT_FAILS, expert_plan, make_task

    assert EXPERT_FAILS == ("total",)
    wrong_digits = set()
    for seed in range(40):
        task = make_task(seed, "train", "total")
        typed = expert_plan(task)[1][1]
        right = task.goal["shown"]  # typed as the prompt shows it
        assert typed[:-1] == right[:-1] and typed[-1] != right[-1] and task.prompt.endswith(right)
        wrong_digits.add((int(typed[-1]) - int(right[-1])) % 10)
    assert len(wrong_digits) >= 6  # the mistake varies with the task: no one digit for a model to learn


def test_async_twin(env):
    from envs.desktop.tasks import expert_action

    async def episode() -> float:
        await env.areset(seed=4, options={"task_type": "editor"})
        history: list[tuple[str, str]] = []
        while True:
            action = expert_action(env, history)
            obs, reward, terminated, truncated, _ = await env.astep(action)
            history.append((action, obs))
            if terminated or truncated:
                return reward

    assert asyncio.run(episode()) == 1.0


def test_the_observation_is_the_apps_widget_tree(env):
    from envs.desktop.tasks import find_center

    obs, _ = env.reset(seed=0, options={"task_type": "calculator"})
    assert "Window: Calculator" in obs and 'Button "equals" "=" center (' in obs
    x, y = find_center(obs, "display")
    obs, *_ = env.step(tool_action("click", {"x": x, "y": y}))
    assert 'Entry "display" center' in obs and "[focused]" in obs
    env.step(tool_action("type_text", {"text": "12*3"}))
    obs, *_ = env.step(tool_action("key", {"combo": "Return"}))
    assert 'Entry "display" "36"' in obs


def test_changes_observation_lists_only_what_changed():
    """``observation="changes"``: the first screen is the whole tree, later ones the widgets whose line changed,
    each line as the whole tree shows it; the expert still solves the task from it, and the env passes its check."""
    require_desktop()
    from envs.checker import check_agent_env
    from envs.desktop.env import DesktopEnv
    from envs.desktop.tasks import find_center

    env = DesktopEnv(observation="changes")
    try:
        obs, _ = env.reset(seed=0, options={"task_type": "calculator"})
        assert 'Button "equals" "=" center (' in obs and "changed widgets" not in obs
        obs, *_ = env.step(tool_action("click", dict(zip("xy", find_center(obs, "display"), strict=True))))
        head, *lines, task = obs.splitlines()
        assert head == "Window: Calculator (changed widgets; the rest as before)"
        assert lines == [line for line in env.last_observation.splitlines() if '"display"' in line]
        assert lines[0].endswith("[focused]") and task.startswith("Task: ")
        obs, *_ = env.step(tool_action("type_text", {"text": "12*3"}))
        assert obs.splitlines()[1].startswith('- Entry "display" "12*3" center (')
        obs, *_ = env.step(tool_action("key", {"combo": "Shift_L"}))  # a modifier alone changes nothing
        assert obs.splitlines()[0] == "Window: Calculator (no change)"
        assert play_expert(env, 1, "calculator")[0] == 1.0 and play_expert(env, 1, "editor")[0] == 1.0
        check_agent_env(env)
    finally:
        env.close()
    with pytest.raises(ValueError, match="observation 'pixels'"):
        DesktopEnv(observation="pixels")  # type: ignore[arg-type]


def _widget(cls: str, name: str, text: str, focus: str) -> dict:
    return {"class": cls, "name": name, "text": text, "focus": bool(focus), "depth": 0, "box": (40, 5, 20, 10)}


def test_changes_text_reports_new_changed_and_gone_widgets():
    from envs.desktop.env import changes_text, widget_head, widget_line

    def screen(*widgets: tuple[str, str, str, str]) -> list[tuple[str, str]]:
        return [(widget_head(w), widget_line(w)) for w in (_widget(*x) for x in widgets)]

    before = screen(("Button", "ok", "OK", ""), ("Entry", 'say "hi"', "", "focus"))
    after = screen(("Entry", 'say "hi"', 'a "b"', "focus"), ("Label", "new", "hi", ""))
    assert changes_text("W", before, after).splitlines() == [
        "Window: W (changed widgets; the rest as before)",
        '- Entry "say "hi"" "a \\"b\\"" center (50, 10) [focused]',
        '- Label "new" "hi" center (50, 10)',
        '- Button "ok" [gone]',
    ]
    assert changes_text("W", before, before) == "Window: W (no change)"


def test_check_env_passes(env):
    from envs.checker import check_agent_env

    check_agent_env(env)


def test_bad_input_is_an_error_observation(env):
    env.reset(seed=0, options={"task_type": "editor"})
    out, *_ = env.step(tool_action("click", {"x": 5000, "y": 3}))
    assert out.startswith("Error: (5000, 3) is outside the screen")
    out, *_ = env.step(tool_action("key", {"combo": "ctrl+NoSuchKey"}))
    assert out.startswith("Error: unknown key 'NoSuchKey'")
    out, *_ = env.step(tool_action("type_text", {"text": "中"}))
    assert out.startswith("Error: cannot type '中'")


def test_desktop_config_fits_its_traces_and_its_job_runs(tmp_path):
    """``configs/desktop.yaml``: every expert trace (with a turn's budget) fits ``engine.max_len`` with the job's own
    tokenizer, and the job runs end to end (a tiny random model, a few steps) writing the long-horizon keys."""
    require_desktop()
    from envs.desktop.tasks import expert_action

    check_job_config("configs/desktop.yaml", tmp_path, expert_action, traces=12, min_longest=1000)
