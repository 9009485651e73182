"""Agentic rollout policies on the long-horizon job: KV across env pauses and weight updates, version pinning.

The workload is ``configs/agentic.yaml`` (agentflow/Trail-v0: 5-20 turns, contexts past 1,000 tokens) from its
cached warm-up, with every ``sh`` call also waiting a lognormal time (median 0.3 s, sigma 1, capped at 8 s:
``bench/SlowTrail-v0``), as a remote tool would. Every policy trains the same number of samples from the same
policy on the same task draws; only the rollout settings differ:

- ``sync``: ``run.mode=sync`` with today's rollout settings (the reference for the async speed-up);
- ``lru+flush``: async as it ships: plain LRU eviction of cached contexts, the prefix cache flushed at every
  weight update, FIFO admission, partial rollouts continued under the new version;
- ``aware+flush``: the same with paused contexts protected (``engine.kv_paused_aware``: ended and expired entries
  evicted first, a shared system prompt copied rather than cut), as every policy below;
- ``keep`` / ``recompute``: ``engine.kv_on_update`` keep or recompute;
- ``pin``: ``rollout.partial=pin`` (one weight version per trajectory);
- ``keep+resumed_first+spill``: keep, resumed turns admitted first, displaced entries spilled to a host tier;
- ``keep+first_finished``: keep, batches of the earliest-finished groups, slow groups dropped at the staleness bound
  (``store.collect=first_finished``, ``store.length_aware=false``: over-sampling within the window);
- ``keep@96``: keep with 96 episodes in flight (the whole window: ``(1 + stale_steps) * B * group_size``) and 96
  engine slots, instead of 32. ``sync`` plays 32 episodes a step whatever the limit, so it gains nothing from it;
- ``pin@24`` / ``pin@16``: pin with 24 or 16 episodes in flight: where the cores are already saturated, fewer
  episodes at once each finish sooner, at whatever throughput the cores still give.

Reported per policy: trained samples/s, episode time p50/p99 (every finished training episode, and p99 of those
trained: they differ where groups are dropped), groups dropped as stale and the length bias, prefix tokens reused /
prompt tokens during RL (from the engine's counters in ``metrics.jsonl``, first step to last), the train/infer log-prob
gap (``train/is_approx_k3_kl``, median over steps), mixed-version trajectories, held-out success before and after.
Writes ``benchmarks/results/agentic_rollout.json`` and ``.png``.

    .venv/bin/python benchmarks/agentic_rollout.py                 # 30 steps per policy, 100 held-out episodes
    .venv/bin/python benchmarks/agentic_rollout.py --only keep pin  # more runs of some policies (medians)
    .venv/bin/python benchmarks/agentic_rollout.py --frozen         # scheduling alone: the policy does not move

Learning moves the workload under the policies: a run whose policy drifts into 20-turn episodes does about twice the
work per trained sample of one that does not, which is most of the spread between repeats. ``--frozen`` trains at
lr 1e-12, so every step, weight update and version happens as usual but every policy meets the same episodes
(``agentic_rollout_frozen.json``); per-run ``turns_mean``, ``truncated_frac`` and generated tokens/s show the drift.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import statistics
import time
from pathlib import Path
from typing import Any

import _path  # noqa: F401  (must come before the project's imports: see _path.py)
from _agentic_workload import GRPO_JOB

import envs
from agentflow.config import load_config
from agentflow.recipes.common import ensure_model
from agentflow.recipes.rl import run_job
from agentflow.recipes.warmup import run_sft
from agentflow.resume import checkpoints
from agentflow.store import Journal
from envs.trail import TrailEnv

CONFIG = "configs/agentic.yaml"
AWARE = "engine.kv_paused_aware=true"
POLICIES: dict[str, list[str]] = {
    "sync": ["run.mode=sync"],
    "lru+flush": [],
    "aware+flush": [AWARE],
    "keep": [AWARE, "engine.kv_on_update=keep"],
    "recompute": [AWARE, "engine.kv_on_update=recompute"],
    "pin": [AWARE, "rollout.partial=pin"],
    "keep+resumed_first+spill": [
        AWARE,
        "engine.kv_on_update=keep",
        "engine.admission=resumed_first",
        f"engine.kv_spill_bytes={256 << 20}",
    ],
    "keep+first_finished": [
        AWARE,
        "engine.kv_on_update=keep",
        "store.collect=first_finished",
        "store.length_aware=false",
    ],
    "keep@96": [AWARE, "engine.kv_on_update=keep", "rollout.max_concurrency=96", "engine.max_slots=96"],
    "pin@24": [AWARE, "rollout.partial=pin", "rollout.max_concurrency=24"],
    "pin@16": [AWARE, "rollout.partial=pin", "rollout.max_concurrency=16"],
}


class SlowTrail(TrailEnv):
    """Trail whose tool calls also wait a lognormal time (median ``median_s``, sigma, capped)."""

    _instances = itertools.count()

    def __init__(self, *args: Any, median_s: float = 0.3, sigma: float = 1.0, cap_s: float = 8.0, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.median_s, self.sigma, self.cap_s = median_s, sigma, cap_s
        self._rng = random.Random(next(SlowTrail._instances))

    async def acall_tool(self, name: str, arguments: dict[str, Any]) -> str:
        if self.median_s > 0:
            await asyncio.sleep(min(self.cap_s, self._rng.lognormvariate(math.log(self.median_s), self.sigma)))
        return await super().acall_tool(name, arguments)


def policy_model() -> Path:
    """The long-horizon job's warmed-up policy (its cached warm-up; made on first use, ~17 min)."""
    cfg = load_config(CONFIG)
    return run_sft(cfg, ensure_model(cfg), Path(cfg.run.dir).parent / "cache", lambda *_: None)


def run(name: str, model: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    run_dir = out / name.replace("+", "-")
    overrides = [
        *GRPO_JOB,
        f"model.path={model}",
        "sft.enabled=false",
        "env.id=bench/SlowTrail-v0",
        f"env.kwargs={{median_s: {args.median_s}}}",
        f"run.steps={args.steps}",
        f"run.dir={run_dir}",
        "run.progress=false",
        "run.overwrite=true",
        f"eval.episodes={args.eval_episodes}",
        *(["trainer.lr=1e-12"] if args.frozen else []),
        *POLICIES[name],
    ]
    cfg = load_config(CONFIG, overrides)
    t0 = time.monotonic()
    s = run_job(cfg, log=lambda *_: None)
    return measure(s, run_dir, time.monotonic() - t0)


def _trained_ids(run_dir: Path) -> set[str]:
    """Ids of the trajectories the run trained (its last checkpoint's record)."""
    import torch

    _, last = checkpoints(run_dir)[0]  # the newest complete one
    return set(torch.load(last, map_location="cpu", weights_only=False)["extra"]["trained_ids"])


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def measure(s: dict[str, Any], run_dir: Path, job_s: float) -> dict[str, Any]:
    """What the table compares, from the run's summary, metrics and journal."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    k3 = [r["train/is_approx_k3_kl"] for r in rows if "train/is_approx_k3_kl" in r]
    trajs = [t for t in Journal.read(run_dir / "journal.jsonl") if t.info.get("split", "train") == "train"]
    episode_s = [t.timings["episode_s"] for t in trajs if "episode_s" in t.timings]
    trained = _trained_ids(run_dir)
    trained_s = [t.timings["episode_s"] for t in trajs if "episode_s" in t.timings and t.id in trained]
    kv = s.get("kv_cache") or {}
    steps = [r for r in rows if "rollout/turns_mean" in r]
    eng = [r for r in rows if "engine/prefill_tokens" in r]  # cumulative engine counters at each step's end
    reused = prompt = None
    if len(eng) >= 2:  # from the first step's end to the last: RL only, no held-out evaluation in between
        reused = eng[-1]["engine/prefix_tokens_reused"] - eng[0]["engine/prefix_tokens_reused"]
        prompt = reused + eng[-1]["engine/prefill_tokens"] - eng[0]["engine/prefill_tokens"]
    return {
        "trained_samples_per_s": s["trajectories_trained"] / max(s["rl_wall_s"], 1e-9),
        "trajectories_trained": s["trajectories_trained"],
        "rl_wall_s": s["rl_wall_s"],
        "job_wall_s": job_s,
        "episode_s_p50": _pct(episode_s, 0.5),
        "episode_s_p99": _pct(episode_s, 0.99),
        "episodes_timed": len(episode_s),
        "turns_mean": statistics.mean(r["rollout/turns_mean"] for r in steps) if steps else None,
        "truncated_frac": statistics.mean(r["rollout/truncated_frac"] for r in steps) if steps else None,
        "generated_tokens_per_s": steps[-1]["store/generated_tokens"] / max(s["rl_wall_s"], 1e-9) if steps else None,
        "trained_episode_s_p99": _pct(trained_s, 0.99),
        "dropped_stale_groups": s["dropped_stale_groups"],
        "length_bias": s["length_bias"],
        "reused_over_prompt_tokens": reused / prompt if reused is not None and prompt else None,
        "recomputed_tokens_rl": (eng[-1]["engine/kv_recomputed_tokens"] - eng[0]["engine/kv_recomputed_tokens"])
        if len(eng) >= 2
        else None,
        "kv_cache": kv,
        "k3_gap_median": statistics.median(k3) if k3 else None,
        "k3_gap_max": max(k3) if k3 else None,
        "mixed_version_trajectories": sum(t.min_version() != t.max_version() for t in trajs),
        "held_weights_bytes": kv.get("held_weights_bytes"),
        "trajectories_journaled": len(trajs),
        "success_before_rl": s["success_before_rl"],
        "success_after_rl": s["success_after_rl"],
        "mean_staleness": s["mean_staleness"],
        "max_staleness_seen": s["max_staleness_seen"],
        "engine_busy_fraction": s["engine_busy_fraction"],
        "trainer_busy_fraction": s["trainer_busy_fraction"],
    }


def summarize(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    base = results.get("lru+flush")
    held = ", policy held still (lr 1e-12)" if args.frozen else ""
    out: dict[str, Any] = {"workload": f"{CONFIG} on bench/SlowTrail-v0 (tool latency median {args.median_s} s){held}"}
    out["policies"] = results
    if "sync" in results:
        out["async_over_sync"] = {
            n: r["trained_samples_per_s"] / results["sync"]["trained_samples_per_s"]
            for n, r in results.items()
            if n != "sync"
        }
    if base:
        out["vs_baseline"] = {
            name: {
                "samples_per_s": r["trained_samples_per_s"] / base["trained_samples_per_s"],
                "episode_p99": r["episode_s_p99"] / base["episode_s_p99"],
                "success_after_minus": r["success_after_rl"] - base["success_after_rl"],
            }
            for name, r in results.items()
        }
    out["config"] = {
        "steps": args.steps,
        "eval_episodes": args.eval_episodes,
        "median_s": args.median_s,
        "frozen": args.frozen,
    }
    return out


def plot(table: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pol = table["policies"]
    names = list(pol)
    fig, axes = plt.subplots(1, 4, figsize=(17, 4))
    panels = [
        ("trained samples/s", "trained_samples_per_s"),
        ("episode time p99 (s)", "episode_s_p99"),
        ("prefix tokens reused / prompt tokens", "reused_over_prompt_tokens"),
        ("train/infer gap (k3, median)", "k3_gap_median"),
    ]
    for ax, (title, key) in zip(axes, panels, strict=True):
        ax.bar(range(len(names)), [pol[n].get(key) or 0.0 for n in names], color="tab:blue")
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=9)
    fig.suptitle(table["workload"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--eval-episodes", type=int, default=100)
    ap.add_argument("--median-s", type=float, default=0.3)
    ap.add_argument("--only", nargs="*", choices=list(POLICIES), default=None)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--runs", default="runs/agentic_rollout", help="where the policies' run directories go")
    ap.add_argument("--repeats", type=int, default=1, help="runs per policy (medians reported)")
    ap.add_argument("--fresh", action="store_true", help="drop the runs already in the json")
    ap.add_argument(
        "--frozen",
        action="store_true",
        help="train at lr 1e-12: every step, update and version as usual, but the policy (so the episodes' lengths) "
        "stays put; compares scheduling alone (results in agentic_rollout_frozen.json)",
    )
    args = ap.parse_args()
    envs.register("bench/SlowTrail-v0", SlowTrail, max_turns=20)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "_frozen" if args.frozen else ""  # held-still runs: their own json, png and run directories
    path = out / f"agentic_rollout{suffix}.json"
    runs: dict[str, list[dict[str, Any]]] = {}
    if path.is_file() and not args.fresh:  # a rerun adds repeats to the runs already measured
        for name, row in json.loads(path.read_text())["policies"].items():
            runs[name] = row.get("runs", [row])
    model = policy_model()
    for _ in range(args.repeats):
        for name in args.only or list(POLICIES):  # interleaved so machine noise hits every policy alike
            r = run(name, model, Path(args.runs + suffix), args)
            runs.setdefault(name, []).append(r)
            table = summarize({n: median_row(runs[n]) for n in POLICIES if n in runs}, args)
            path.write_text(json.dumps(table, indent=2))  # after every run: an interrupted benchmark keeps them
            print(name, json.dumps({k: v for k, v in r.items() if k != "kv_cache"}), flush=True)
    plot(table, path.with_suffix(".png"))


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of every numeric key over a policy's repeats, with the repeats themselves under ``runs``."""
    out: dict[str, Any] = {}
    for key in dict.fromkeys(k for r in rows for k in r):  # a key added later is in the newer repeats only
        vals = [r[key] for r in rows if isinstance(r.get(key), int | float) and not isinstance(r.get(key), bool)]
        if vals:
            out[key] = statistics.median(vals)
    out["repeats"] = len(rows)
    out["runs"] = rows
    return out


if __name__ == "__main__":
    main()
