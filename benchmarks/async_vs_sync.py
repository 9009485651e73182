"""Asynchronous vs synchronous RL on the same job, side by side in one process.

Runs the demo environment with the demo-size model (no warm-up, so rewards are mostly zero: this measures the
machinery, not learning) for the same number of steps in ``sync`` and ``async`` mode, and writes
``benchmarks/results/async_vs_sync.json`` and ``.png``: RL wall time, trained trajectories per second, the
engine/trainer busy fractions and their overlap, staleness.

    .venv/bin/python benchmarks/async_vs_sync.py --steps 8 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import _path  # noqa: F401  (must come before the project's imports: see _path.py)

from agentflow.config import load_config
from agentflow.job import run_job
from agentflow.model_init import init_model

KEYS = ("rl_wall_s", "overlap_fraction", "engine_busy_fraction", "trainer_busy_fraction", "mean_staleness")


def run(mode: str, model: Path, out: Path, steps: int) -> dict:
    cfg = load_config(
        "configs/demo.yaml",
        [
            f"model.path={model}",
            "sft.enabled=false",
            f"run.mode={mode}",
            f"run.steps={steps}",
            f"run.dir={out / mode}",
            "run.progress=false",
            "eval.episodes=8",
        ],
    )
    s = run_job(cfg, log=lambda *_: None)
    s["trajectories_per_s"] = s["trajectories_trained"] / s["rl_wall_s"]
    return s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory() as tmp:
        model = init_model(Path(tmp) / "model")
        for _ in range(args.repeats):
            for mode in ("sync", "async"):  # interleaved so machine noise hits both alike
                results[mode].append(run(mode, model, Path(tmp) / "runs", args.steps))
    table = {
        mode: {k: statistics.median(r[k] for r in runs) for k in (*KEYS, "trajectories_per_s")}
        for mode, runs in results.items()
    }
    table["speedup_async_over_sync"] = table["async"]["trajectories_per_s"] / table["sync"]["trajectories_per_s"]
    table["config"] = {"steps": args.steps, "repeats": args.repeats, "statistic": "median"}
    (out / "async_vs_sync.json").write_text(json.dumps(table, indent=2))
    plot(table, out / "async_vs_sync.png")
    print(json.dumps(table, indent=2))


def plot(table: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    modes = ["sync", "async"]
    axes[0].bar(modes, [table[m]["trajectories_per_s"] for m in modes], color=["#888", "#2a7"])
    axes[0].set_title(f"trained trajectories / s (x{table['speedup_async_over_sync']:.2f})")
    keys = ["engine_busy_fraction", "trainer_busy_fraction", "overlap_fraction"]
    for i, m in enumerate(modes):
        axes[1].bar([j + 0.4 * i for j in range(3)], [table[m][k] for k in keys], width=0.4, label=m)
    axes[1].set_xticks([j + 0.2 for j in range(3)], ["engine busy", "trainer busy", "overlap"])
    axes[1].set_title("share of RL wall time")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
