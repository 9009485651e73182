"""Plots of a run directory: success over RL steps (overall and per task type) from ``metrics.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path


def _smooth(xs: list[float], k: int) -> list[float]:
    out = []
    for i in range(len(xs)):
        window = xs[max(0, i - k + 1) : i + 1]
        out.append(sum(window) / len(window))
    return out


def plot_success(run_dir: str | Path, out: str | Path | None = None, smooth: int = 5) -> Path:
    """Training-batch success per RL step (moving average), with greedy held-out success before/after as markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = Path(run_dir)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, _smooth([r["rollout/success"] for r in rows], smooth), color="k", lw=2, label="all (sampled)")
    for key in sorted({k for r in rows for k in r if k.startswith("rollout/success_")}):
        # a batch holds few task types, so each type is measured only at some steps: plot where it was
        xs = [r["step"] for r in rows if key in r]
        ys = _smooth([r[key] for r in rows if key in r], smooth)
        ax.plot(xs, ys, lw=1, marker=".", ms=3, label=key.removeprefix("rollout/success_"))
    summary_path = run / "summary.json"
    if summary_path.is_file():
        s = json.loads(summary_path.read_text())
        last = steps[-1] if steps else 0
        ax.scatter(
            [0, last], [s["success_before_rl"], s["success_after_rl"]], color="r", zorder=5, label="held-out, greedy"
        )
        if s.get("scripted_policy_success") is not None:  # measured when the job warms up on a scripted expert
            ax.axhline(s["scripted_policy_success"], color="gray", ls="--", lw=1, label="scripted policy")
    ax.set_xlabel("RL step")
    ax.set_ylabel("success")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(f"{run.name}: success over RL steps")
    fig.tight_layout()
    path = Path(out) if out else run / "success.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """The run report: reward per RL step, the staleness histogram, and when the engine and the trainer were busy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = Path(run_dir)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    s = json.loads((run / "summary.json").read_text())
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    steps = [r["step"] for r in rows]
    axes[0].plot(steps, [r.get("rollout/reward_mean", 0.0) for r in rows], color="k", lw=1, alpha=0.4)
    axes[0].plot(steps, _smooth([r.get("rollout/reward_mean", 0.0) for r in rows], 5), color="k", lw=2)
    axes[0].set(xlabel="RL step", ylabel="mean reward (sampled)", title="reward")
    hist = {int(k): v for k, v in s.get("staleness_histogram", {}).items()}
    axes[1].bar(list(hist), list(hist.values()), color="#58a")
    axes[1].axvline(s.get("stale_steps", 0) + 0.5, color="r", ls="--", lw=1, label="bound")
    axes[1].set(xlabel="staleness (versions)", ylabel="trajectories", title=f"staleness (max {max(hist, default=0)})")
    axes[1].legend(fontsize=8)
    timeline = s.get("timeline", {})
    for y, (name, color) in enumerate((("engine", "#2a7"), ("trainer", "#c63"))):
        spans = timeline.get(name, [])
        axes[2].broken_barh([(a, b - a) for a, b in spans], (y - 0.4, 0.8), color=color)
    axes[2].set_yticks([0, 1], ["engine", "trainer"])
    axes[2].set(xlabel="seconds since RL start", title=f"utilisation (overlap {s.get('overlap_fraction', 0):.0%})")
    fig.suptitle(f"{run.name}: {s.get('mode')} mode, {s.get('rl_steps')} steps")
    fig.tight_layout()
    path = Path(out) if out else run / "report.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
