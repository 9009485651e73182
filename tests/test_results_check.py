"""The results check compares new runs with the documented figures and flags a moved result."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentflow.demos import check_results as cr

ROOT = Path(__file__).resolve().parents[1]


def _rl_run(root: Path, name: str, before: float, after: float) -> Path:
    run = root / name
    run.mkdir(parents=True)
    summary = {"success_before_rl": before, "success_after_rl": after, "scripted_policy_success": 0.43}
    (run / "summary.json").write_text(json.dumps(summary))
    return run


def _distill_run(root: Path, calc: float, shell: float) -> Path:
    run = root / "distill-seed0"
    (run / "distill").mkdir(parents=True)
    (run / "rl").mkdir()
    models = {"success": {"teacher-calc": {"calc": 0.77}, "teacher-shell": {"shell": 0.715}}}
    (run / "models.json").write_text(json.dumps(models))
    rows = {"calc": {"after_seq_kd": 0.77, "after": calc}, "shell": {"after_seq_kd": 0.67, "after": shell}}
    (run / "distill" / "summary.json").write_text(json.dumps({"per_source": rows}))
    (run / "rl" / "summary.json").write_text(
        json.dumps({"per_source": {"calc": {"after": 0.505}, "shell": {"after": 0}}})
    )
    return run


def test_documented_figures_are_the_ones_the_check_reads():
    documented = json.loads((ROOT / cr.DOCUMENTED).read_text())
    assert set(cr.FAMILIES) <= set(documented)
    for family, runs in cr.FAMILIES.items():
        assert runs and all(name in cr.RESULTS for name in runs)
        assert documented[family]


def test_a_reproduced_result_passes_and_a_moved_one_fails(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    good = {"rl-seed0": _rl_run(tmp_path / "good", "rl-seed0", 0.24, 0.50)}
    assert cr.report(good, tmp_path / "good.json", quick=False)
    moved = {"rl-seed0": _rl_run(tmp_path / "moved", "rl-seed0", 0.24, 0.30)}  # the gain is gone
    assert not cr.report(moved, tmp_path / "moved.json", quick=False)
    rows = json.loads((tmp_path / "moved.json").read_text())["rl"]["rows"]
    assert any(r.get("claim") == "RL beats its warm-up by more than 0.15" and not r["holds"] for r in rows)
    assert any(r.get("figure") == "after" and not r["within_spread"] for r in rows)


def test_the_distillation_claims(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert cr.report({"distill-seed0": _distill_run(tmp_path / "a", 0.77, 0.68)}, tmp_path / "a.json", quick=False)
    assert not cr.report({"distill-seed0": _distill_run(tmp_path / "b", 0.62, 0.68)}, tmp_path / "b.json", quick=False)


def test_the_quick_check_tries_once_more_after_a_collapse_and_reports_both(tmp_path, monkeypatch):
    made = []

    def fake_run(name, runs, quick=False, retry=False):  # the two reduced runs, without their 5 minutes of RL
        made.append((name, quick, retry))
        after = 0.25 if retry else collapsed_after
        return _rl_run(runs, f"{name}-retry" if retry else name, 0.21, after)

    monkeypatch.setattr(cr, "run_result", fake_run)
    collapsed_after = 0.0
    runs = cr.run_quick(tmp_path / "a")
    assert made == [("rl-seed0", True, False), ("rl-seed0", True, True)]
    result = cr.quick_direction(runs)
    assert result["ok"] and result["tries"] == 2
    lost = [r for r in result["rows"] if r["claim"] == "RL does not lose more than 0.10"]
    assert [(r["result"], r["holds"], r["after"]) for r in lost] == [
        ("rl-seed0", False, 0.0),
        ("rl-seed0-retry", True, 0.25),
    ]

    made.clear()
    collapsed_after = 0.24  # a first try that keeps the direction is the only one
    assert set(cr.run_quick(tmp_path / "b")) == {"rl-seed0"} and len(made) == 1

    both_lost = {"rl-seed0": _rl_run(tmp_path / "c", "rl-seed0", 0.21, 0.0),
                 "rl-seed0-retry": _rl_run(tmp_path / "c", "rl-seed0-retry", 0.21, 0.05)}  # fmt: skip
    assert not cr.quick_direction(both_lost)["ok"]
    assert cr.QUICK_RETRY == ["run.seed=1"]  # not a trainer seed: that is in the warm-up's cache key


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_quick_check_runs_the_demo_code_path_and_keeps_the_direction(tmp_path, monkeypatch):
    """The reduced-size RL run CI can afford: the demo's config, warm-up and code path, and 40 RL steps."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "check.json"
    assert cr.main(["run", "--quick", "--runs", str(tmp_path / "runs"), "--out", str(out)]) == 0, out.read_text()
