"""``sync`` vs ``one_step`` vs ``async`` RL on the same job, side by side in one process.

The workload is the demo task (agentflow/Calc-v0) whose every env step (tool call or answer check) waits for real:
a lognormal latency with median 0.3 s and sigma 1, capped at 8 s (``bench/SlowCalc-v0``), as a remote tool or a
verifier would. Each mode runs the same model, data (task draws) and number of trained samples; the held-out
episodes before and after RL are the same for every mode. A second pass with zero latency measures what overlap
alone buys. Async mode also runs with each store collection strategy (``fifo``, ``first_finished``,
``first_finished`` + ``length_aware``) on the latency workload: throughput, staleness and ``length_bias`` (mean model
tokens per trained episode / per accepted episode; tool-call-heavy episodes are both longer and slower, so a strategy
that drops late groups skews short). Writes ``benchmarks/results/async_vs_sync.json`` and ``.png``.

    .venv/bin/python benchmarks/async_vs_sync.py            # demo model after warm-up SFT (cached), 200 steps (~1 h)
    .venv/bin/python benchmarks/async_vs_sync.py --quick    # CI: a tiny random model, a few steps
    .venv/bin/python benchmarks/async_vs_sync.py --workload agentic   # the three modes on configs/agentic.yaml

``--workload agentic`` runs the three modes on the long-horizon job instead (agentflow/Trail-v0: 5-16 turns,
contexts past 1,000 tokens, a sandboxed vault program whose latency varies by task), with that job's settings and
its cached warm-up, and writes ``async_vs_sync_agentic.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import _path  # noqa: F401  (must come before the project's imports: see _path.py)

import envs
from agentflow.config import load_config
from agentflow.model_init import ModelInitConfig, init_model
from agentflow.recipes.rl import run_job
from envs.demo import CalcEnv

MODES = ("sync", "one_step", "async")
#: async-mode store strategies compared on the latency workload: name -> overrides (``fifo`` is the plain async run)
STRATEGIES = {
    "fifo": [],
    "first_finished": ["store.collect=first_finished", "store.length_aware=false"],
    "first_finished+length_aware": ["store.collect=first_finished", "store.length_aware=true"],
}
TINY = ModelInitConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=176, num_attention_heads=4)


class SlowCalc(CalcEnv):
    """Calc whose tool calls and answer checks take a lognormal time (median ``median_s``, sigma, capped)."""

    _instances = itertools.count()

    def __init__(self, median_s: float = 0.3, sigma: float = 1.0, cap_s: float = 8.0, seed: int = 0, **kw: Any):
        super().__init__(**kw)
        self.median_s, self.sigma, self.cap_s = median_s, sigma, cap_s
        self._rng = random.Random(seed * 1000 + next(SlowCalc._instances))  # each env its own (reproducible) draws

    async def _wait(self) -> None:
        if self.median_s > 0:
            await asyncio.sleep(min(self.cap_s, self._rng.lognormvariate(math.log(self.median_s), self.sigma)))

    async def acall_tool(self, name: str, arguments: dict[str, Any]) -> str:
        await self._wait()
        return await super().acall_tool(name, arguments)

    async def ascore_answer(self, text: str) -> tuple[float, bool]:
        await self._wait()
        return await super().ascore_answer(text)


def demo_policy() -> Path:
    """The demo job's warmed-up policy: its warm-up SFT on ``agentflow/Calc-v0`` (cached across runs, made on first
    use), which every mode's RL then starts from on the slow variant of the same env."""
    from agentflow.recipes.common import ensure_model
    from agentflow.recipes.warmup import run_sft

    cfg = load_config("configs/demo.yaml")
    return run_sft(cfg, ensure_model(cfg), Path(cfg.run.dir).parent / "cache", lambda *_: None)


def run(mode: str, model: Path, out: Path, args: argparse.Namespace, median_s: float, strategy: str = "fifo") -> dict:
    overrides = STRATEGIES[strategy] + [
        f"model.path={model}",
        "env.id=bench/SlowCalc-v0",
        f"env.kwargs={{median_s: {median_s}}}",
        f"run.mode={mode}",
        f"run.steps={args.steps}",
        f"run.dir={out / f'{mode}-{strategy}-{median_s}'}",
        "run.progress=false",
        f"store.batch_groups={args.batch_groups}",
        f"store.stale_steps={args.stale_steps}",
        f"rollout.group_size={args.group_size}",
        f"eval.episodes={args.eval_episodes}",
    ]
    overrides.append("sft.enabled=false")  # ``model`` is the demo's warmed-up policy (or, --quick, a tiny model)
    if args.quick:
        overrides += ["rollout.max_new_tokens=16", "engine.max_len=384"]
        overrides += ["trainer.drop_uniform_groups=false", "trainer.micro_batch_tokens=2048"]
    cfg = load_config(None if args.quick else "configs/demo.yaml", overrides)
    t0 = time.monotonic()
    s = run_job(cfg, log=lambda *_: None)
    s["job_wall_s"] = time.monotonic() - t0  # the whole job: start-up, evals, RL
    s["trained_samples_per_s"] = s["trajectories_trained"] / s["rl_wall_s"]
    return s


KEYS = ("trained_samples_per_s", "rl_wall_s", "engine_busy_fraction", "trainer_busy_fraction", "overlap_fraction",
        "mean_staleness", "max_staleness_seen", "success_before_rl", "success_after_rl",
        "trajectories_trained", "length_bias", "dropped_stale_groups", "job_wall_s")  # fmt: skip
CONFIG_KEYS = ("quick", "steps", "repeats", "batch_groups", "group_size", "stale_steps", "eval_episodes", "strategies")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny random model, few steps (CI)")
    ap.add_argument(
        "--workload",
        choices=("latency", "agentic"),
        default="latency",
        help="latency: Calc with injected tool latency (default); agentic: configs/agentic.yaml",
    )
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--batch-groups", type=int, default=None)
    ap.add_argument("--group-size", type=int, default=None)
    ap.add_argument("--stale-steps", type=int, default=2, help="async mode's window (one_step is 1, sync 0)")
    ap.add_argument("--eval-episodes", type=int, default=None)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument(
        "--zero-latency-only",
        action="store_true",
        help="only sync vs async without tool latency (writes async_vs_sync_zero_latency.json)",
    )
    ap.add_argument(
        "--strategies",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run async with first_finished (with and without length_aware) on the latency workload",
    )
    args = ap.parse_args()
    if args.workload == "agentic":
        from _agentic_workload import run_agentic

        return run_agentic(args)
    quick = {"steps": 4, "batch_groups": 2, "group_size": 4, "eval_episodes": 4}
    full = {"steps": 200, "batch_groups": 6, "group_size": 8, "eval_episodes": 200}  # lr 1e-4 needs ~150 steps
    for k, v in (quick if args.quick else full).items():
        setattr(args, k, getattr(args, k) if getattr(args, k) is not None else v)
    envs.register("bench/SlowCalc-v0", SlowCalc, max_turns=3)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {}
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        if args.quick:
            model = init_model(Path(tmp) / "model", TINY, env_ids=["agentflow/Calc-v0"])
        else:
            model = demo_policy()
        for _ in range(args.repeats):
            for median in (0.0,) if args.zero_latency_only else (0.3, 0.0):
                for mode in MODES if median else ("sync", "async"):  # interleaved so machine noise hits all alike
                    runs.setdefault(f"{mode}@{median}", []).append(run(mode, model, Path(tmp) / "runs", args, median))
            for strategy in list(STRATEGIES)[1:] if args.strategies and not args.zero_latency_only else ():
                r = run("async", model, Path(tmp) / "runs", args, 0.3, strategy)
                runs.setdefault(f"async+{strategy}@0.3", []).append(r)
    if args.zero_latency_only:
        table = summarize_zero_latency(runs, args)
        table["bench_wall_s"] = time.monotonic() - start
        (out / "async_vs_sync_zero_latency.json").write_text(json.dumps(table, indent=2))
        print(json.dumps({k: v for k, v in table.items() if k != "zero_latency"}, indent=2))
        return
    table = summarize(runs, args)
    table["bench_wall_s"] = time.monotonic() - start
    (out / "async_vs_sync.json").write_text(json.dumps(table, indent=2))
    plot(table, out / "async_vs_sync.png")
    big = ("modes", "zero_latency", "async_strategies", "targets", "config", "latency")
    print(json.dumps({k: v for k, v in table.items() if k not in big}, indent=2))


def summarize(runs: dict[str, list[dict]], args: argparse.Namespace) -> dict:
    med = {name: {k: statistics.median(r[k] for r in rs) for k in KEYS} for name, rs in runs.items()}
    lat = {m: med[f"{m}@0.3"] for m in MODES}
    sync = lat["sync"]
    strategies = {"fifo": lat["async"]} | {s: med[f"async+{s}@0.3"] for s in STRATEGIES if f"async+{s}@0.3" in med}
    return {
        "modes": lat,
        "async_strategies": strategies if len(strategies) > 1 else {},
        "zero_latency": {m: med[f"{m}@0.0"] for m in ("sync", "async")},
        "speedup_async_vs_sync": lat["async"]["trained_samples_per_s"] / sync["trained_samples_per_s"],
        "speedup_one_step_vs_sync": lat["one_step"]["trained_samples_per_s"] / sync["trained_samples_per_s"],
        "speedup_zero_latency": med["async@0.0"]["trained_samples_per_s"] / med["sync@0.0"]["trained_samples_per_s"],
        "sync_success_gain": sync["success_after_rl"] - sync["success_before_rl"],
        "async_success_minus_sync": lat["async"]["success_after_rl"] - sync["success_after_rl"],
        "max_staleness_seen": max(m["max_staleness_seen"] for m in med.values()),
        "max_staleness_per_mode": {m: lat[m]["max_staleness_seen"] for m in MODES},
        "length_bias_per_mode": {m: lat[m]["length_bias"] for m in MODES},
        "length_bias_per_strategy": {s: v["length_bias"] for s, v in strategies.items()},
        "dropped_stale_per_strategy": {s: v["dropped_stale_groups"] for s, v in strategies.items()},
        "stale_steps": {"sync": 0, "one_step": 1, "async": args.stale_steps},
        "staleness_within_bound": all(
            med[f"{m}@0.3"]["max_staleness_seen"] <= {"sync": 0, "one_step": 1, "async": args.stale_steps}[m]
            for m in MODES
        )
        and all(v["max_staleness_seen"] <= args.stale_steps for v in strategies.values()),
        "targets": {
            "speedup_async_vs_sync": 2.0,
            "speedup_zero_latency": 1.3,
            "sync_success_gain": 0.10,
            "async_within_sync": 0.05,
        },  # fmt: skip
        "config": {k: getattr(args, k) for k in CONFIG_KEYS},
        "latency": {"median_s": 0.3, "sigma": 1.0, "cap_s": 8.0, "on": "every env step (tool call or answer check)"},
        "statistic": "median over repeats",
    }


def summarize_zero_latency(runs: dict[str, list[dict]], args: argparse.Namespace) -> dict:
    """The ``--zero-latency-only`` table: sync vs async without tool latency (a rerun of that pair alone)."""
    med = {name: {k: statistics.median(r[k] for r in rs) for k in KEYS} for name, rs in runs.items()}
    return {
        "zero_latency": {m: med[f"{m}@0.0"] for m in ("sync", "async")},
        "speedup_zero_latency": med["async@0.0"]["trained_samples_per_s"] / med["sync@0.0"]["trained_samples_per_s"],
        "targets": {"speedup_zero_latency": 1.3},
        "config": {k: getattr(args, k) for k in CONFIG_KEYS},
        "statistic": "median over repeats",
    }


def plot(table: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    strategies = table.get("async_strategies") or {}
    fig, axes = plt.subplots(1, 4 if strategies else 3, figsize=(17 if strategies else 13, 3.6))
    modes = list(MODES)
    axes[0].bar(modes, [table["modes"][m]["trained_samples_per_s"] for m in modes], color=["#888", "#58a", "#2a7"])
    axes[0].set_title(f"trained samples/s, tool latency (async x{table['speedup_async_vs_sync']:.2f})")
    zl = table["zero_latency"]
    axes[1].bar(["sync", "async"], [zl[m]["trained_samples_per_s"] for m in ("sync", "async")], color=["#888", "#2a7"])
    axes[1].set_title(f"trained samples/s, no latency (x{table['speedup_zero_latency']:.2f})")
    keys = ["engine_busy_fraction", "trainer_busy_fraction", "overlap_fraction"]
    for i, m in enumerate(modes):
        axes[2].bar([j + 0.27 * i for j in range(3)], [table["modes"][m][k] for k in keys], width=0.27, label=m)
    axes[2].set_xticks([j + 0.27 for j in range(3)], ["engine busy", "trainer busy", "overlap"])
    axes[2].set_title("share of RL wall time (with latency)")
    axes[2].legend(fontsize=8)
    if strategies:  # async store strategies: throughput (bars), length bias and drops (labels)
        names = list(strategies)
        axes[3].bar(range(len(names)), [strategies[n]["trained_samples_per_s"] for n in names], color="#2a7")
        v = [strategies[n] for n in names]
        labels = [
            n.replace("+", "+\n") + f"\nbias {x['length_bias']:.2f}, drop {x['dropped_stale_groups']:g}"
            for n, x in zip(names, v, strict=True)
        ]
        axes[3].set_xticks(range(len(names)), labels, fontsize=7)
        axes[3].set_title("async store strategies: trained samples/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
