"""The planner (``agentflow plan``) against measured runs, and its predictions at 8, 64 and 1,024 devices.

Three local workloads, each run for real in ``sync`` and ``async`` mode:

- **demo**: the Calc demo with a lognormal tool latency (median 0.3 s, sigma 1, capped at 8 s: ``bench/SlowCalc-v0``
  of ``async_vs_sync.py``), 100 steps per mode (``--measure demo``; runs in ``runs/plan-demo-<mode>``);
- **agentic**: the long-horizon job (``configs/agentic.yaml``), 40 steps per mode (``--measure agentic``; runs in
  ``runs/async_vs_sync_agentic-<mode>``, where ``async_vs_sync.py --workload agentic`` also leaves them);
- **agentic-latency**: the long-horizon job with lognormal tool latency, the ``sync`` and ``lru-flush`` runs of
  ``benchmarks/agentic_rollout.py`` (``runs/agentic_rollout/<policy>``).

For each workload the planner is calibrated on one mode's run and predicts the other mode (both directions): the
predicted samples/s and async/sync ratio are compared with the measured ones. The contention model uses this
machine's effective cores (concurrent single-threaded spinners' summed rate over one alone) and the env's CPU seconds
per step, both measured apart (the demo's tool latency is a sleep: 0 s; Trail's tool calls run in the sandbox:
measured on its expert's episodes); the engines' prefill rate is the engine benchmark's (``engine.json``) relative
to its decode rate. Then the cluster table: from the calibration on the demo's and the long-horizon job's async run,
the best trainer:engine split and its samples/s at 8, 64 and 1,024 devices for sync, async and async with adaptive
replay (each device its own, no contention). Writes ``benchmarks/results/plan.json`` and ``plan.png``.

    .venv/bin/python benchmarks/plan.py --measure demo agentic   # the runs (~35 min), then the plan
    .venv/bin/python benchmarks/plan.py                          # the plan from runs already measured
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import time
from pathlib import Path
from typing import Any

import _path  # noqa: F401  (must come before the project's imports: see _path.py)

from agentflow.planner import (
    RunProfile,
    calibrate,
    default_curve,
    default_prefill_ratio,
    load_profile,
    measure_effective_cores,
    plan,
    predict,
)

WORKLOADS = {
    "demo": {"sync": "runs/plan-demo-sync", "async": "runs/plan-demo-async"},
    "agentic": {"sync": "runs/async_vs_sync_agentic-sync", "async": "runs/async_vs_sync_agentic-async"},
    # the long-horizon job with lognormal tool latency, as benchmarks/agentic_rollout.py runs it (async: LRU + flush)
    "agentic-latency": {"sync": "runs/agentic_rollout/sync", "async": "runs/agentic_rollout/lru-flush"},
}
#: workloads whose async calibration the cluster table starts from
CLUSTER_WORKLOADS = ("demo", "agentic")


def measure_agentic(steps: int = 40, eval_episodes: int = 50) -> None:
    """The long-horizon job in sync and async mode (its cached warm-up), kept in ``runs/async_vs_sync_agentic-*``."""
    from _agentic_workload import _run

    args = argparse.Namespace(steps=steps, eval_episodes=eval_episodes, quick=False)
    for mode in ("sync", "async"):
        _run(mode, Path(WORKLOADS["agentic"][mode]), args, None)


def measure_demo(steps: int, eval_episodes: int) -> None:
    """The demo latency workload in sync and async mode, kept in ``runs/plan-demo-<mode>``."""
    import shutil

    from async_vs_sync import SlowCalc, demo_policy, run

    import envs

    envs.register("bench/SlowCalc-v0", SlowCalc, max_turns=3)
    model = demo_policy()
    args = argparse.Namespace(steps=steps, batch_groups=6, group_size=8, stale_steps=2, eval_episodes=eval_episodes,
                              quick=False)  # fmt: skip
    for mode in ("sync", "async"):
        tmp = Path("runs") / "plan-demo-tmp"
        run(mode, model, tmp, args, 0.3)
        dest = Path(WORKLOADS["demo"][mode])
        shutil.rmtree(dest, ignore_errors=True)
        (tmp / f"{mode}-fifo-0.3").rename(dest)
        shutil.rmtree(tmp, ignore_errors=True)


def env_cpu_per_step(env_id: str, episodes: int = 12) -> dict[str, float]:
    """CPU seconds (this process and its children) and wall seconds of one env step, on the env's expert."""
    import envs
    from agentflow.config import load_config
    from agentflow.recipes.warmup import job_expert

    cfg = load_config(None, [f"env.id={env_id}", "sft.enabled=true"])
    expert, _ = job_expert(cfg)

    def cpu() -> float:
        a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime

    async def run() -> dict[str, float]:
        steps, wall, used = 0, 0.0, 0.0
        for seed in range(episodes):
            env = envs.make(env_id)
            await env.areset(seed=seed)
            history: list[tuple[str, str]] = []
            for _ in range(env.max_turns):
                action = expert(env, history)
                t0, c0 = time.perf_counter(), cpu()
                obs, _, term, trunc, _ = await env.astep(action)
                wall, used, steps = wall + time.perf_counter() - t0, used + cpu() - c0, steps + 1
                history.append((action, obs))
                if term or trunc:
                    break
            env.close()
        return {"steps": steps, "cpu_s_per_step": used / steps, "wall_s_per_step": wall / steps}

    return asyncio.run(run())


def _profile(workload: str, mode: str, cores: float, env_cpu_s: float) -> RunProfile | None:
    run_dir = Path(WORKLOADS[workload][mode])
    if not (run_dir / "summary.json").is_file():
        return None
    return load_profile(run_dir, default_curve(), cores, env_cpu_s, default_prefill_ratio())


def cross_check(workload: str, cores: float, env_cpu_s: float) -> tuple[dict[str, Any], RunProfile, float] | None:
    """Calibrate on each mode's run, predict the other; predicted vs measured samples/s and async/sync ratio.

    Also returns the async run's calibrated profile and engine speed (the cluster table starts from them)."""
    runs = {m: _profile(workload, m, cores, env_cpu_s) for m in ("sync", "async")}
    if any(p is None for p in runs.values()):
        return None
    fits: dict[str, tuple[RunProfile, float]] = {}
    measured = {m: p.measured_samples_per_s for m, p in runs.items() if p is not None}
    ratio = measured["async"] / measured["sync"]
    out: dict[str, Any] = {"measured_samples_per_s": measured, "measured_async_over_sync": ratio, "from": {}}
    for source, target in (("sync", "async"), ("async", "sync")):
        profile = runs[source]
        assert profile is not None
        fitted, speed = fits[source] = calibrate(profile)
        pred = predict(fitted, speed, target)
        got = pred.samples_per_s
        pred_ratio = got / measured["sync"] if target == "async" else measured["async"] / got
        out["from"][source] = {
            "engine_speed_tokens_per_s": speed,
            "trainer_s_per_sample_full_speed": fitted.train_b,
            f"predicted_{target}_samples_per_s": got,
            f"error_{target}_samples_per_s": got / measured[target] - 1,
            "predicted_async_over_sync": pred_ratio,
            "error_async_over_sync": pred_ratio / ratio - 1,
            f"predicted_{target}": pred.as_dict(),
        }
    return out, *fits["async"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--measure", nargs="*", choices=("demo", "agentic"), default=[],
                    help="first run these workloads in sync and async mode")  # fmt: skip
    ap.add_argument("--steps", type=int, default=100, help="RL steps of each measured demo run")
    ap.add_argument("--eval-episodes", type=int, default=50)
    ap.add_argument("--gpus", default="8,64,1024")
    ap.add_argument("--plan-steps", type=int, default=4, help="steps simulated per cluster scenario")
    ap.add_argument("--max-batch-groups", type=int, default=256, help="the largest cluster's batch, in groups")
    ap.add_argument("--cores", type=float, default=None, help="effective cores measured earlier (default: measure)")
    ap.add_argument("--env-cpu", default=None, help="JSON of env_cpu_per_step on Trail measured earlier")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    start = time.monotonic()
    if "agentic" in args.measure:
        measure_agentic()
    if "demo" in args.measure:
        measure_demo(args.steps, args.eval_episodes)
    # measured on a quiet machine: what the parts' overlap can use (below the CPU count on hyper-threads), and the
    # CPU seconds of a Trail tool call
    cores = args.cores or measure_effective_cores()
    trail = json.loads(Path(args.env_cpu).read_text()) if args.env_cpu else env_cpu_per_step("agentflow/Trail-v0")
    print(f"effective cores {cores:.2f}; Trail env step {json.dumps(trail)}", flush=True)
    env_cpu = {"demo": {"cpu_s_per_step": 0.0, "note": "the tool latency is a sleep"}, "agentic": trail,
               "agentic-latency": trail}  # fmt: skip
    table: dict[str, Any] = {"cpu_count": os.cpu_count(), "effective_cores": cores, "env_cpu": env_cpu,
                             "prefill_over_decode": default_prefill_ratio(), "workloads": {},
                             "clusters": {}}  # fmt: skip
    gpus = [int(g) for g in args.gpus.split(",")]
    fits = {}
    for workload in WORKLOADS:  # first every cross-check (the numbers that say whether to trust the rest)
        checked = cross_check(workload, cores, float(env_cpu[workload]["cpu_s_per_step"]))
        if checked is None:
            print(f"{workload}: no sync and async runs measured yet; skipped", flush=True)
            continue
        table["workloads"][workload], *fits[workload] = checked
        print(workload, json.dumps(_errors(table["workloads"][workload])), flush=True)
    for workload, (fitted, speed) in fits.items():
        if workload not in CLUSTER_WORKLOADS:
            continue
        clusters = replace_cores(fitted)
        table["clusters"][workload] = plan(clusters, speed, gpus, args.plan_steps, CLUSTER_MODES,
                                           args.max_batch_groups)  # fmt: skip
    errors = [abs(d["from"][m][k]) for d in table["workloads"].values() for m in d["from"]
              for k in d["from"][m] if k.startswith("error_")]  # fmt: skip
    table["max_abs_error"] = max(errors) if errors else None
    table["within_15_percent"] = bool(errors) and max(errors) <= 0.15
    table["bench_wall_s"] = time.monotonic() - start
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(table, indent=2))
    plot(table, out / "plan.png")
    print(json.dumps({k: table[k] for k in ("max_abs_error", "within_15_percent", "bench_wall_s")}, indent=2))


#: modes of the cluster table (``async+replay``: async with the store's adaptive replay)
CLUSTER_MODES = ("sync", "async", "async+replay")


def _errors(d: dict[str, Any]) -> dict[str, float]:
    wanted = ("error", "pred")
    return {f"{m}:{k}": round(v, 4) for m, f in d["from"].items() for k, v in f.items()
            if k.startswith(wanted) and isinstance(v, float)}  # fmt: skip


def replace_cores(profile: RunProfile) -> RunProfile:
    """The calibrated profile on a cluster: every engine and trainer GPU its own device (no shared cores)."""
    from dataclasses import replace

    return replace(profile, cores=None)


def plot(table: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    names, measured, predicted = [], [], []
    for workload, d in table["workloads"].items():
        for source, target in (("sync", "async"), ("async", "sync")):
            names.append(f"{workload}\n{target}\n(fit on {source})")
            measured.append(d["measured_samples_per_s"][target])
            predicted.append(d["from"][source][f"predicted_{target}_samples_per_s"])
    x = range(len(names))
    axes[0].bar([i - 0.2 for i in x], measured, width=0.4, label="measured")
    axes[0].bar([i + 0.2 for i in x], predicted, width=0.4, label="predicted")
    axes[0].set_xticks(list(x), names, fontsize=7)
    axes[0].set_ylabel("trained samples/s")
    axes[0].set_title("this machine: one mode's run predicts the other")
    axes[0].legend(fontsize=8)
    for workload, t in table["clusters"].items():
        for mode in CLUSTER_MODES:
            rows = [r for r in t["rows"] if r["mode"] == mode]
            axes[1].plot([r["gpus"] for r in rows], [r["best"]["steady_samples_per_s"] for r in rows], marker="o",
                         label=f"{workload} {mode}")  # fmt: skip
    axes[1].set_xscale("log")
    axes[1].set_yscale("log")
    axes[1].set_xlabel("devices (best trainer:engine split)")
    axes[1].set_ylabel("predicted trained samples/s (fresh)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
