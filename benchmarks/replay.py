"""Bounded replay vs none: async RL without replay, with a fixed replay share, and with the adaptive scheduler.

Every run starts from the same warmed-up policy and takes the same number of optimizer steps; held-out success
(``eval.episodes`` episodes) is measured every ``--eval-every`` steps together with the trajectories generated and the
RL wall time so far (evaluations excluded). Per seed the target is the no-replay run's final success minus 0.02; a
replay run's cost to target is its generated trajectories and RL seconds at the first evaluation that reaches it,
compared with the no-replay run's (ratios, median over seeds). Also reported: final success, trainer and engine busy
fractions, replayed share and the staleness of replayed tokens.

    .venv/bin/python benchmarks/replay.py                     # demo: Calc with tool latency (as async_vs_sync.py)
    .venv/bin/python benchmarks/replay.py --workload agentic  # the long-horizon job (configs/agentic.yaml)
    .venv/bin/python benchmarks/replay.py --workload agentic --shipped  # ... at its shipped rates, not AS_MEASURED
    .venv/bin/python benchmarks/replay.py --quick             # CI: a tiny random model, a few steps

Writes ``benchmarks/results/replay.json`` (one section per workload; rerunning one workload keeps the other) and
``replay.png``. Results are saved after each run; rerun with the same settings, a benchmark skips the runs it already
has (``--fresh`` reruns them, ``--rerun NAME ...`` those of some settings).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import _path  # noqa: F401  (must come before the project's imports: see _path.py)
from _agentic_workload import GRPO_JOB, GRPO_SHAPE
from _agentic_workload import section as section_of
from async_vs_sync import TINY, SlowCalc, demo_policy

import envs
from agentflow.config import load_config
from agentflow.model_init import init_model
from agentflow.recipes.common import busy_fraction, eval_spans
from agentflow.recipes.rl import run_job

#: replay settings compared: name -> store overrides (the same job staleness bound for all)
SETTINGS = {
    "none": [],
    "fixed": ["store.replay.max_reuse=2", "store.replay.ratio=0.5", "store.replay.schedule=fixed"],
    "adaptive": ["store.replay.max_reuse=2", "store.replay.ratio=0.75", "store.replay.schedule=adaptive"],
}
SETTINGS["adaptive-tight"] = SETTINGS["adaptive"]  # + replayed groups one version under the job's bound (_overrides)
#: adaptive with at most fixed's replays per batch, so the dispatch window (planned for the fewest fresh groups a batch
#: takes, ``B - round(ratio * B)``) is as wide as fixed's
SETTINGS["adaptive-half"] = ["store.replay.max_reuse=2", "store.replay.ratio=0.5", "store.replay.schedule=adaptive"]
#: adaptive-half whose groups may be replayed three times (for a bound loose enough to leave them that many versions)
SETTINGS["adaptive-half-3"] = [*SETTINGS["adaptive-half"][1:], "store.replay.max_reuse=3"]
#: fixed with adaptive-half-3's pool: three of six groups replayed whenever the pool has them, whatever generation does
SETTINGS["fixed-half-3"] = ["store.replay.max_reuse=3", "store.replay.ratio=0.5", "store.replay.schedule=fixed"]
KEYS = ("success_before_rl", "success_after_rl", "rl_wall_s", "trajectories_trained", "engine_busy_fraction",
        "trainer_busy_fraction", "trainer_wait_fraction", "rollout_slot_occupancy", "mean_staleness",
        "max_staleness_seen", "dropped_stale_groups")  # fmt: skip


def _overrides(args: argparse.Namespace, setting: str, seed: int, run_dir: Path, model: Path | None) -> list[str]:
    o = SETTINGS[setting] + [
        f"run.seed={seed}",
        f"run.dir={run_dir}",
        f"run.steps={args.steps}",
        "run.progress=false",
        "run.overwrite=true",
        f"store.stale_steps={args.stale_steps}",
        *([f"store.replay.stale_steps={args.stale_steps - 1}"] if setting == "adaptive-tight" else []),
        f"eval.every_steps={args.eval_every}",
        f"eval.episodes={args.eval_episodes}",
        *args.set,
    ]
    if args.workload == "demo":
        o += ["env.id=bench/SlowCalc-v0", "env.kwargs={median_s: 0.3}", "sft.enabled=false", f"model.path={model}"]
    else:  # the job as the benchmarks measure it (GRPO), this run's steps; --shipped: at the config's own rates
        o = [*(GRPO_SHAPE if args.shipped else GRPO_JOB), *o]
    if args.workload == "agentic" and model is not None:  # agentic --quick
        o += [f"model.path={model}", "sft.enabled=false", "env.kwargs={task_types: [short]}"]
    if args.quick:
        o += ["store.batch_groups=2", "rollout.group_size=4", "trainer.drop_uniform_groups=false"]
        o += ["store.replay.skip_uniform=false", "rollout.max_new_tokens=16", "engine.max_len=384"]
    return o


def run_dir_of(args: argparse.Namespace, setting: str, seed: int) -> Path:
    return Path(args.runs) / f"replay-{section_of(args.workload, args.shipped, args.tag)}-{setting}-s{seed}"


def rl_fractions(summary: dict[str, Any]) -> dict[str, float]:
    """Engine and trainer busy fractions of the RL time without the in-loop evaluations, from a run's timeline (what
    the job's summary reports; recomputed here for runs whose summary still counted the evaluations' time)."""
    evals, wall = eval_spans(summary["evals"]), summary["rl_wall_s"]
    tl = summary["timeline"]
    return {f"{k}_busy_fraction": busy_fraction([tuple(x) for x in tl[k]], evals, wall) for k in ("engine", "trainer")}


def run_one(args: argparse.Namespace, setting: str, seed: int, model: Path | None) -> dict[str, Any]:
    run_dir = run_dir_of(args, setting, seed)
    config = "configs/demo.yaml" if args.workload == "demo" else "configs/agentic.yaml"
    cfg = load_config(None if args.quick and args.workload == "demo" else config,
                      _overrides(args, setting, seed, run_dir, model))  # fmt: skip
    t0 = time.monotonic()
    s = run_job(cfg, log=lambda *_: None)
    out = {k: s.get(k) for k in KEYS}
    out["job_wall_s"] = time.monotonic() - t0
    out["generated_trajectories"] = s["evals"][-1]["generated_trajectories"] if s["evals"] else None
    out["evals"] = [{k: e[k] for k in ("step", "success", "rl_s", "generated_trajectories")} for e in s["evals"]]
    out["replay"] = s.get("replay")
    out["onsets"] = task_onsets(run_dir / "metrics.jsonl", s["evals"])
    return out


ONSET_SUCCESS, ONSET_WINDOW = 0.5, 5


def task_onsets(metrics: Path, evals: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per task type learned during RL: the step, trajectories generated and RL seconds at which its success in the
    training rollouts first averages ``ONSET_SUCCESS`` over the last ``ONSET_WINDOW`` steps that had the task (tasks
    already there in the first window are left out). Every step samples the tasks, so this sees when a skill is
    learned at one-step resolution from ~50 rollouts, where held-out success is sampled every ``--eval-every`` steps
    and moves in jumps. ``evals``: the run's in-loop evaluations (``summary.json``), whose time is taken out of the
    metrics' clock to give RL seconds as the held-out costs count them."""
    if not metrics.is_file():
        return {}
    rows = [r for r in map(json.loads, metrics.read_text().splitlines()) if "store/accepted_trajectories" in r]
    rl_s = _rl_clock(rows, evals)
    tasks = sorted({k.removeprefix("rollout/success_") for r in rows for k in r if k.startswith("rollout/success_")})
    out = {}
    for task in tasks:
        seen = [r for r in rows if f"rollout/success_{task}" in r]  # steps whose rollouts had the task
        v = [r[f"rollout/success_{task}"] for r in seen]
        means = [sum(v[i - ONSET_WINDOW : i]) / ONSET_WINDOW for i in range(ONSET_WINDOW, len(v) + 1)]
        hit = next((i for i, m in enumerate(means) if m >= ONSET_SUCCESS), None)
        if hit is None or hit == 0:
            continue
        r = seen[hit + ONSET_WINDOW - 1]  # the window's last step: when the onset is first known
        out[task] = {"step": r["step"], "generated_trajectories": r["store/accepted_trajectories"], "rl_s": rl_s(r)}
    return out


def _rl_clock(rows: list[dict[str, Any]], evals: list[dict[str, Any]]) -> Any:
    """A step's RL seconds from its ``time_s`` (seconds since the job's logger started, evaluations included): less
    the evaluations up to it (a step's row is logged after its evaluation) and the time before RL, which the first
    evaluation's row gives (its ``time_s`` less its own time and the RL seconds before it)."""
    at = {r["step"]: r["time_s"] for r in rows}
    first = next((e for e in evals if e["step"] in at), None)
    before = at[first["step"]] - first["eval_s"] - first["rl_s"] if first is not None else 0.0
    return lambda r: r["time_s"] - before - sum(e["eval_s"] for e in evals if e["step"] <= r["step"])


def to_target(run: dict[str, Any], target: float) -> dict[str, float] | None:
    """Trajectories generated and RL seconds at the first evaluation at or above ``target`` (None: never)."""
    for e in run["evals"]:
        if e["success"] >= target - 1e-9:
            return {"step": e["step"], "generated_trajectories": e["generated_trajectories"], "rl_s": e["rl_s"]}
    return None


#: targets, from the same seed's no-replay run: its final success - 0.02 (on the plateau, where 200 episodes' noise
#: of ~0.03 decides when it is first reached), and 80% of its gain over the warm-up (on the steep part of the curve)
TARGETS = {
    "to_target": lambda base: base["success_after_rl"] - 0.02,
    "to_80pct_gain": lambda b: b["success_before_rl"] + 0.8 * (b["success_after_rl"] - b["success_before_rl"]),
}


def summarize(runs: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """Per setting: medians over seeds, and the cost to reach each target of :data:`TARGETS`."""
    table: dict[str, Any] = {"settings": {}}
    for name, by_seed in runs.items():
        rs = list(by_seed.values())
        table["settings"][name] = {k: statistics.median(r[k] for r in rs) for k in KEYS if rs[0].get(k) is not None}
    for key, target_of in TARGETS.items():
        table[key] = _costs(runs, target_of)
    table["to_task_onset"] = _onset_costs(runs)
    return table


def _onset_costs(runs: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """Per replay setting: no-replay / replay ratios of steps, trajectories and RL seconds to each task's onset
    (:func:`task_onsets`), per (seed, task) learned in both runs, and their medians; onsets one run never had are
    counted, not ratioed."""
    out: dict[str, Any] = {}
    for name in [n for n in runs if n != "none"]:
        pairs, only = [], {"replay": 0, "none": 0}
        for seed, base in runs.get("none", {}).items():
            mine, ref = runs[name].get(seed, {}).get("onsets"), base.get("onsets")
            if mine is None or ref is None:
                continue
            for task in sorted(set(mine) | set(ref)):
                if task in mine and task in ref:
                    ratio = {
                        k: ref[task][k] / max(mine[task][k], 1e-9) for k in ("step", "generated_trajectories", "rl_s")
                    }
                    pairs.append({"seed": seed, "task": task, **ratio})
                else:
                    only["replay" if task in mine else "none"] += 1
        if pairs:
            med = {
                f"median_{k}_saving": statistics.median(p[k] for p in pairs)
                for k in ("step", "generated_trajectories", "rl_s")
            }
            out[name] = {"pairs": pairs, "learned_by_one_only": only, **med}
    return out


def _costs(runs: dict[str, dict[int, dict[str, Any]]], target_of: Any) -> dict[str, Any]:
    out = {}
    for name in [n for n in runs if n != "none"]:
        per_seed = {}
        for seed, base in runs.get("none", {}).items():
            if seed not in runs[name]:
                continue
            target = target_of(base)
            mine, ref = to_target(runs[name][seed], target), to_target(base, target)
            ratio = None
            if mine is not None and ref is not None:
                ratio = {
                    "trajectories": ref["generated_trajectories"] / max(mine["generated_trajectories"], 1),
                    "wall": ref["rl_s"] / max(mine["rl_s"], 1e-9),
                }
            elif ref is not None:  # the replay run never got there: no saving (it counts in the median as 0)
                ratio = {"trajectories": 0.0, "wall": 0.0, "never_reached": True}
            final_gap = runs[name][seed]["success_after_rl"] - base["success_after_rl"]
            per_seed[seed] = {"target": target, "replay": mine, "none": ref, "savings": ratio, "final_gap": final_gap}
        reached = [p["savings"] for p in per_seed.values() if p["savings"] is not None]
        out[name] = {
            "per_seed": per_seed,
            "seeds_reaching_target": sum(not r.get("never_reached") for r in reached),
            "median_trajectory_saving": statistics.median(r["trajectories"] for r in reached) if reached else None,
            "median_wall_saving": statistics.median(r["wall"] for r in reached) if reached else None,
            "median_final_gap": statistics.median(p["final_gap"] for p in per_seed.values()) if per_seed else None,
        }
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(results)
    fig, axes = plt.subplots(len(workloads), 2, figsize=(11, 3.6 * len(workloads)), squeeze=False)
    colors = {"none": "tab:gray", "fixed": "tab:blue", "adaptive": "tab:green", "adaptive-tight": "tab:olive",
              "adaptive-half": "tab:purple", "adaptive-half-3": "tab:red", "fixed-half-3": "tab:cyan"}  # fmt: skip
    for row, w in zip(axes, workloads, strict=True):
        for name, by_seed in results[w]["runs"].items():
            for i, r in enumerate(by_seed.values()):
                xs = [e["generated_trajectories"] for e in r["evals"]]
                ts = [e["rl_s"] for e in r["evals"]]
                ys = [e["success"] for e in r["evals"]]
                label = name if i == 0 else None
                row[0].plot(xs, ys, color=colors.get(name), alpha=0.7, marker=".", label=label)
                row[1].plot(ts, ys, color=colors.get(name), alpha=0.7, marker=".", label=label)
        row[0].set(xlabel="trajectories generated", ylabel="held-out success", title=f"{w}: success vs samples")
        row[1].set(xlabel="RL wall seconds (evaluations excluded)", title=f"{w}: success vs time")
        row[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", choices=("demo", "agentic"), default="demo")
    ap.add_argument("--quick", action="store_true", help="tiny random model, a few steps (CI)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=["none", "fixed", "adaptive"])
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--eval-every", type=int, default=None)
    ap.add_argument("--eval-episodes", type=int, default=None)
    ap.add_argument("--stale-steps", type=int, default=3, help="the staleness bound of every setting")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every setting")
    ap.add_argument("--shipped", action="store_true",
                    help="agentic: the config's own warm-up and RL rates (own section), not AS_MEASURED")  # fmt: skip
    ap.add_argument("--tag", default=None,
                    help="a section of its own (WORKLOAD-TAG), e.g. for another staleness bound")  # fmt: skip
    ap.add_argument("--runs", default="runs", help="where the run directories go")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--fresh", action="store_true", help="rerun runs already in replay.json with the same settings")
    ap.add_argument("--rerun", nargs="*", default=[], choices=list(SETTINGS),
                    help="rerun these settings' runs, keeping the others'")  # fmt: skip
    ap.add_argument("--summarize-only", action="store_true", help="recompute the tables and plot from replay.json")
    args = ap.parse_args()
    if args.shipped and args.workload != "agentic":
        ap.error("--shipped applies to --workload agentic only (the demo has no pinned rates)")
    full = {"demo": (150, 15, 200), "agentic": (40, 10, 100)}[args.workload]
    steps, every, episodes = (4, 2, 4) if args.quick else full
    args.steps, args.eval_every = args.steps or steps, args.eval_every or every
    args.eval_episodes = args.eval_episodes or episodes
    envs.register("bench/SlowCalc-v0", SlowCalc, max_turns=3)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("replay_quick.json" if args.quick else "replay.json")  # a quick run never overwrites the real one
    results = json.loads(path.read_text()) if path.is_file() and not args.quick else {}
    # not part of a benchmark's identity (shipped: in the section name)
    skip = ("out", "runs", "seeds", "settings", "fresh", "rerun", "summarize_only", "shipped", "tag")
    config = {k: v for k, v in vars(args).items() if k not in skip}
    section: dict[str, Any] = {"runs": {}, "config": config}
    old = results.get(section_of(args.workload, args.shipped, args.tag), {})
    if not args.fresh and old.get("config") == config:  # the same benchmark: keep its finished runs, skip them
        section["runs"] = {n: {int(k): r for k, r in by.items()} for n, by in old.get("runs", {}).items()}
        for name in args.rerun:
            section["runs"].pop(name, None)
    results[section_of(args.workload, args.shipped, args.tag)] = section
    if args.summarize_only:
        for sec in results.values():
            sec["runs"] = {n: {int(k): r for k, r in by.items()} for n, by in sec["runs"].items()}
        for name, by_seed in section["runs"].items():  # this workload's runs whose run directory is still here
            for seed, run in by_seed.items():
                summary = run_dir_of(args, name, seed) / "summary.json"
                if summary.is_file():
                    run_summary = json.loads(summary.read_text())
                    run.update(rl_fractions(run_summary))
                    run["onsets"] = task_onsets(summary.with_name("metrics.jsonl"), run_summary["evals"])
        for sec in results.values():
            sec.update(summarize(sec["runs"]))
        path.write_text(json.dumps(results, indent=2))
        plot(results, path.with_suffix(".png"))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = None
        if args.quick:
            env_id = "agentflow/Calc-v0" if args.workload == "demo" else "agentflow/Trail-v0"
            model = init_model(Path(tmp) / "model", TINY, env_ids=[env_id])
            args.runs = tmp
        elif args.workload == "demo":
            model = demo_policy()
        for seed in args.seeds:  # settings interleaved per seed, so machine noise hits all alike
            for name in args.settings:
                if seed in section["runs"].get(name, {}):
                    continue
                section["runs"].setdefault(name, {})[seed] = run_one(args, name, seed, model)
                section.update(summarize(section["runs"]))
                path.write_text(json.dumps(results, indent=2))
                print(name, seed, {k: section["runs"][name][seed][k] for k in KEYS}, flush=True)
    plot(results, path.with_suffix(".png"))
    print(json.dumps({k: v for k, v in section.items() if k != "runs"}, indent=2, default=str))


if __name__ == "__main__":
    main()
