"""Browser and desktop env costs, side by side in one process: step latency and concurrent-episode throughput.

Writes ``benchmarks/results/desktop.json`` and ``.png``:
- ``step_latency_ms``: p50/p99 of one awaited ``astep`` (tool call + observation: ARIA snapshot or widget tree, and
  a PNG screenshot) for ``agentflow/Browser-v0`` and ``agentflow/Desktop-v0``, over scripted-expert episodes of
  every task type; ``reset_latency_ms`` likewise (a browser reset leases a context and loads the start page; a
  desktop reset starts the task's Tk app).
- ``browser_throughput``: expert episodes per second with 1 episode at a time, and with 4 concurrent episodes
  (4 envs, one shared Chromium with 4 contexts, awaited on one event loop, each env taking the next episode from a
  shared queue); ``speedup_4_vs_1`` (target >= 1.8 on 2 cores). Every episode must succeed, or the run fails.

    .venv/bin/python benchmarks/desktop.py            # full
    .venv/bin/python benchmarks/desktop.py --quick    # CI: < 60 s
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import _path  # noqa: F401  (puts the repository root first on sys.path)

RESULTS = Path(__file__).resolve().parent / "results"


def percentiles(xs: list[float]) -> dict[str, float]:
    """p50 / p99 / mean of ``xs`` (in the unit given), rounded."""
    s = sorted(xs)
    p99 = s[min(len(s) - 1, round(0.99 * (len(s) - 1)))]
    return {"p50": round(statistics.median(s), 2), "p99": round(p99, 2), "mean": round(statistics.fmean(s), 2)}


async def expert_episode(env: Any, expert: Any, seed: int, task_type: str, steps: list[float], resets: list[float]):
    """One scripted-expert episode through the async API; appends step and reset times (ms); returns the reward."""
    t = time.perf_counter()
    await env.areset(seed=seed, options={"task_type": task_type})
    resets.append((time.perf_counter() - t) * 1000)
    history: list[tuple[str, str]] = []
    while True:
        action = expert(env, history)
        t = time.perf_counter()
        obs, reward, terminated, truncated, info = await env.astep(action)
        if '"tool"' in action:
            steps.append((time.perf_counter() - t) * 1000)
        history.append((action, obs))
        if terminated or truncated:
            if reward != 1.0:
                raise RuntimeError(f"expert failed {task_type} seed {seed}: {info}")
            return reward


async def run_episodes(envs_: list[Any], expert: Any, types: tuple[str, ...], episodes: int) -> dict[str, Any]:
    """``episodes`` expert episodes, at most ``len(envs_)`` at a time: each env takes the next episode from a shared
    queue as soon as it is free (as an RL job keeps its episode slots full), so the run ends with one short tail
    instead of waiting for the env that drew the longest sequence; wall time, step and reset latencies."""
    steps: list[float] = []
    resets: list[float] = []
    queue: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
    for k in range(episodes):
        queue.put_nowait((1000 + k, types[k % len(types)]))

    async def worker(env: Any) -> None:
        while not queue.empty():
            seed, task_type = queue.get_nowait()
            await expert_episode(env, expert, seed, task_type, steps, resets)

    t = time.perf_counter()
    await asyncio.gather(*(worker(e) for e in envs_))
    wall = time.perf_counter() - t
    return {
        "episodes": episodes,
        "wall_s": round(wall, 2),
        "episodes_per_s": round(episodes / wall, 3),
        "steps": steps,
        "resets": resets,
    }


def bench_browser(quick: bool) -> dict[str, Any]:
    from envs.browser.env import BrowserEnv
    from envs.browser.pool import BrowserPool
    from envs.browser.tasks import TASK_TYPES, expert_action

    pool = BrowserPool()
    envs_ = [BrowserEnv(pool=pool) for _ in range(4)]
    rounds = 1 if quick else 3  # 1-episode and 4-episode runs alternate, so a change in machine load hits both
    ones, fours = [], []
    try:
        asyncio.run(run_episodes(envs_, expert_action, TASK_TYPES, 4))  # warm-up: launch, every env's context
        for _ in range(rounds):
            ones.append(asyncio.run(run_episodes(envs_[:1], expert_action, TASK_TYPES, 8 if quick else 12)))
            fours.append(asyncio.run(run_episodes(envs_, expert_action, TASK_TYPES, 16 if quick else 48)))
    finally:
        for e in envs_:
            e.close()
        pool.close()
    one, four = _merged(ones), _merged(fours)
    per_round = [f["episodes_per_s"] / o["episodes_per_s"] for o, f in zip(ones, fours, strict=True)]
    return {
        "step_latency_ms": percentiles(one["steps"]),
        "reset_latency_ms": percentiles(one["resets"]),
        "step_latency_ms_4_concurrent": percentiles(four["steps"]),
        "throughput": {
            "1_concurrent": {k: v for k, v in one.items() if k not in ("steps", "resets")},
            "4_concurrent": {k: v for k, v in four.items() if k not in ("steps", "resets")},
            "speedup_4_vs_1": round(statistics.median(per_round), 2),
            "speedup_4_vs_1_per_round": [round(r, 2) for r in per_round],
            "statistic": f"median over {rounds} alternating rounds of 1-episode and 4-episode runs",
            "target": 1.8,
        },
    }


def _merged(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several :func:`run_episodes` results as one: summed episodes and wall time, all latencies."""
    episodes, wall = sum(r["episodes"] for r in runs), sum(r["wall_s"] for r in runs)
    return {
        "episodes": episodes,
        "wall_s": round(wall, 2),
        "episodes_per_s": round(episodes / wall, 3),
        "steps": [x for r in runs for x in r["steps"]],
        "resets": [x for r in runs for x in r["resets"]],
    }


def bench_desktop(quick: bool) -> dict[str, Any]:
    from envs.desktop.env import DesktopEnv
    from envs.desktop.tasks import TASK_TYPES, expert_action

    env = DesktopEnv()
    try:
        asyncio.run(run_episodes([env], expert_action, TASK_TYPES, 1))  # warm-up: the X server
        run = asyncio.run(run_episodes([env], expert_action, TASK_TYPES, 6 if quick else 30))
    finally:
        env.close()
    return {
        "step_latency_ms": percentiles(run["steps"]),
        "reset_latency_ms": percentiles(run["resets"]),
        "episodes": run["episodes"],
    }


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    names = ["browser step", "desktop step", "browser reset", "desktop reset"]
    keys = [("browser", "step_latency_ms"), ("desktop", "step_latency_ms")]
    keys += [("browser", "reset_latency_ms"), ("desktop", "reset_latency_ms")]
    x = range(len(names))
    ax1.bar([i - 0.2 for i in x], [res[a][b]["p50"] for a, b in keys], 0.4, label="p50")
    ax1.bar([i + 0.2 for i in x], [res[a][b]["p99"] for a, b in keys], 0.4, label="p99")
    ax1.set_xticks(list(x), names, rotation=15)
    ax1.set_ylabel("ms")
    ax1.set_yscale("log")
    ax1.set_title("latency")
    ax1.legend()
    tp = res["browser"]["throughput"]
    vals = [tp["1_concurrent"]["episodes_per_s"], tp["4_concurrent"]["episodes_per_s"]]
    ax2.bar(["1 episode", "4 concurrent"], vals, color=["tab:gray", "tab:blue"])
    ax2.set_ylabel("browser episodes / s")
    ax2.set_title(f"throughput: {tp['speedup_4_vs_1']}x (target {tp['target']}x)")
    fig.suptitle(f"browser and desktop envs ({os.cpu_count()} CPUs)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer episodes (CI, < 60 s)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    t0 = time.perf_counter()
    res: dict[str, Any] = {
        "quick": args.quick,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_avg_1m": os.getloadavg()[0]},
        "desktop": bench_desktop(args.quick),
        "browser": bench_browser(args.quick),
    }
    res["machine"]["load_avg_1m_end"] = os.getloadavg()[0]
    res["total_s"] = round(time.perf_counter() - t0, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "desktop.json").write_text(json.dumps(res, indent=2) + "\n")
    plot(res, args.out / "desktop.png")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
