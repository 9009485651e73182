"""Trajectory-level GRPO vs per-turn credit vs tree credit, at an equal budget of generated tokens.

Every method starts from the same warmed-up policy; held-out success (``--eval-episodes``) is measured every
``--eval-every`` steps with the model tokens generated so far. Methods:

- ``grpo``: ``rollout.group_size`` roots per group, trajectory-level advantages;
- ``turn``: the same groups, ``trainer.turn_credit`` (per-turn returns by turn index, reverse-order updates in
  ``PHASES`` bands of turn depths);
- ``tree``: half the roots per group and as many branches (``--tree-branches``) from their turns (``rollout.tree``,
  chosen by ``--tree-select``, default where the roots disagree), ``trainer.tree_credit`` (per-turn advantages from
  the tree's state values, reverse-order updates in ``PHASES`` bands);
- ``tree-contested``: half the roots, and ``CONTESTED_BRANCHES`` branches only at the states where they disagreed
  (``rollout.tree.select=contested``), none in a group whose roots acted alike; tree credit as for ``tree``.

A branch starts mid-episode, so the tree method generates fewer tokens per step. ``--tokens`` gives every run the
same budget of generated tokens (``run.max_generated_tokens``; ``--steps`` is then only a cap), so the tree makes
more steps; the comparison at equal tokens takes each run's success at the smallest final token count of any run
(``equal_tokens``; linear between evaluations). Writes ``benchmarks/results/turn_credit.json`` (one section per
workload) and ``turn_credit.png``. The long-horizon job runs at the rates its stored runs had (``AS_MEASURED``);
``--shipped`` runs it at the config's own rates instead, into a section of its own (``agentic-shipped``). ``--tag
NAME`` puts runs into a section of their own (``demo-NAME``) when they must not be compared with the stored ones
(another kind of machine, where the warm-up came out differently).

    .venv/bin/python benchmarks/turn_credit.py --workload agentic --seeds 0 1 2 --tokens 300000 --steps 200
    .venv/bin/python benchmarks/turn_credit.py --workload demo
    .venv/bin/python benchmarks/turn_credit.py --shipped --seeds 0 --tokens 200000 --steps 200  # shipped rates
    .venv/bin/python benchmarks/turn_credit.py --quick            # a tiny random model, a few steps
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import _path  # noqa: F401  (must come before the project's imports: see _path.py)
from _agentic_workload import AS_MEASURED
from _agentic_workload import section as section_of
from async_vs_sync import TINY

from agentflow.config import load_config
from agentflow.model_init import init_model
from agentflow.recipes.rl import run_job
from agentflow.tree import SELECT

CONFIGS = {"demo": "configs/demo.yaml", "agentic": "configs/agentic.yaml"}
PHASES = 4
"""Reverse-order update phases per step of the turn-level methods (``trainer.turn_phases``): one phase per turn
depth trained the long-horizon job's steps ~10x slower than GRPO (up to 20 depths, each a forward and backward
pass)."""


TARGET_REF, TARGET_MARGIN = "turn", 0.02
"""The cost-to-target comparison: tokens to reach the per-turn method's final success minus 0.02, per seed."""

CONTESTED_BRANCHES = 12
"""Branches per group of ``tree-contested``: all of them at the states where the group's roots disagreed."""


def methods(group_size: int, select: str = "disagree", branches: int | None = None) -> dict[str, list[str]]:
    """Each method's overrides; the tree keeps half the roots and ``branches`` (default: the other half) branches,
    chosen by ``select``; ``tree-contested`` keeps half the roots too and spends ``CONTESTED_BRANCHES`` (or
    ``branches``) where they disagreed (``rollout.tree.select=contested``)."""
    half = max(1, group_size // 2)
    tree = ["trainer.turn_credit=false", f"rollout.group_size={half}", "trainer.tree_credit=true",
            f"trainer.turn_phases={PHASES}"]  # fmt: skip
    return {
        "grpo": ["trainer.turn_credit=false", "trainer.turn_phases=null"],
        "turn": ["trainer.turn_credit=true", f"trainer.turn_phases={PHASES}"],
        "tree": [
            *tree,
            f"rollout.tree.branches={group_size - half if branches is None else branches}",
            f"rollout.tree.select={select}",
        ],
        "tree-contested": [
            *tree,
            f"rollout.tree.branches={CONTESTED_BRANCHES if branches is None else branches}",
            "rollout.tree.select=contested",
        ],
    }


def run_one(args: argparse.Namespace, method: str, seed: int, model: Path | None) -> dict[str, Any]:
    base = load_config(CONFIGS[args.workload])
    run_dir = Path(args.runs) / f"turn_credit-{section(args)}-{method}-s{seed}"
    over = [f"run.seed={seed}", f"data.seed={seed}", f"run.dir={run_dir}", f"run.steps={args.steps}",
            "run.progress=false", "run.overwrite=true", f"eval.every_steps={args.eval_every}",
            f"eval.episodes={args.eval_episodes}",
            *([f"run.max_generated_tokens={args.tokens}"] if args.tokens else []),
            *methods(base.rollout.group_size, args.tree_select, args.tree_branches)[method]]  # fmt: skip
    if args.workload == "agentic" and not args.shipped:  # the stored runs' rates: new runs compare with them
        over += AS_MEASURED
    if model is not None:  # --quick
        over += [
            f"model.path={model}",
            "sft.enabled=false",
            "store.batch_groups=2",
            "trainer.drop_uniform_groups=false",
        ]
    s = run_job(load_config(CONFIGS[args.workload], over), log=lambda *_: None)
    evals = [{"step": 0, "success": s["success_before_rl"], "generated_tokens": 0, "rl_s": 0.0}]
    keep = ("step", "success", "per_type", "generated_tokens", "rl_s")
    evals += [{k: e[k] for k in keep if k in e} for e in s["evals"]]
    return {"success_before_rl": s["success_before_rl"], "success_after_rl": s["success_after_rl"],
            "rl_wall_s": s["rl_wall_s"], "evals": evals, "tree": s.get("tree"), "rl_steps": s["rl_steps"],
            "token_budget": args.tokens, "generated_tokens": s["generated_tokens"],
            "per_type_after_rl": s["per_type_after_rl"]}  # fmt: skip


def section(args: argparse.Namespace) -> str:
    """The results section of a run (``--tag``: another machine or warm-up, never compared with untagged runs)."""
    return section_of(args.workload, args.shipped, args.tag)


def curve(run: dict[str, Any]) -> list[dict[str, Any]]:
    """A run's evaluations, ending with its final one (after the last step, at its final token count) when the last
    periodic evaluation came before it (a run stopped by its token budget between evaluations)."""
    evals = run["evals"]
    if run.get("generated_tokens", 0) > evals[-1]["generated_tokens"]:
        evals = [*evals, {"step": run["rl_steps"], "success": run["success_after_rl"],
                          "generated_tokens": run["generated_tokens"]}]  # fmt: skip
    return evals


def at_tokens(evals: list[dict[str, Any]], tokens: float) -> float:
    """Held-out success at ``tokens`` generated tokens, linear between evaluations."""
    for a, b in zip(evals, evals[1:], strict=False):
        if a["generated_tokens"] <= tokens <= b["generated_tokens"]:
            span = b["generated_tokens"] - a["generated_tokens"]
            w = (tokens - a["generated_tokens"]) / span if span else 1.0
            return a["success"] + w * (b["success"] - a["success"])
    return evals[-1]["success"]


def tokens_to(evals: list[dict[str, Any]], target: float) -> float | None:
    """Generated tokens at which held-out success first reaches ``target`` (linear between evaluations), or None."""
    for a, b in zip(evals, evals[1:], strict=False):
        if a["success"] >= target:
            return float(a["generated_tokens"])
        if b["success"] >= target:
            w = (target - a["success"]) / (b["success"] - a["success"])
            return a["generated_tokens"] + w * (b["generated_tokens"] - a["generated_tokens"])
    return None


def to_target(runs: dict[str, dict[int, dict[str, Any]]], seeds: list[int]) -> dict[str, Any]:
    """Tokens each method needs to reach ``TARGET_REF``'s final success minus ``TARGET_MARGIN`` (per seed, against that
    seed's reference run): a cost to a level that does not saturate when every method nears full success."""
    out: dict[str, Any] = {"target": f"{TARGET_REF} final success - {TARGET_MARGIN}", "per_seed": {}, "median": {}}
    for s in seeds:
        target = runs[TARGET_REF][s]["success_after_rl"] - TARGET_MARGIN
        out["per_seed"][s] = {"target": round(target, 4)} | {m: tokens_to(curve(runs[m][s]), target) for m in runs}
    for m in runs:  # a run that never reached its target counts as infinitely costly
        costs = [out["per_seed"][s][m] for s in seeds]
        out["median"][m] = statistics.median(c if c is not None else float("inf") for c in costs)
        if out["median"][m] == float("inf"):
            out["median"][m] = None
    return out


def summarize(runs: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    seeds = sorted(set.intersection(*(set(r) for r in runs.values())))
    out: dict[str, Any] = {"seeds": seeds, "methods": {}}
    for m, by_seed in runs.items():
        out["methods"][m] = {"final_success_mean": statistics.fmean(by_seed[s]["success_after_rl"] for s in seeds)}
    # one token count for every seed and method: the fewest any run reached (runs of other budgets are read there)
    equal = min(curve(runs[m][s])[-1]["generated_tokens"] for m in runs for s in seeds)
    out["equal_tokens"] = equal
    for s in seeds:
        for m in runs:
            runs[m][s]["success_at_equal_tokens"] = at_tokens(curve(runs[m][s]), equal)
    for m in runs:
        out["methods"][m]["success_at_equal_tokens_mean"] = statistics.fmean(
            runs[m][s]["success_at_equal_tokens"] for s in seeds
        )
    if TARGET_REF in runs:
        out["to_target"] = to_target(runs, seeds)
    out["runs"] = runs
    return out


def plot(table: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(table), figsize=(6 * len(table), 4), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (workload, t) in zip(axes[0], table.items(), strict=True):
        for m, by_seed in t["runs"].items():  # one colour per method (the same in every panel), a line style per seed
            i = list(methods(8)).index(m)
            for j, (s, r) in enumerate(sorted(by_seed.items())):
                points = curve(r)
                xs = [e["generated_tokens"] for e in points]
                ax.plot(xs, [e["success"] for e in points], marker=".", color=colors[i % len(colors)],
                        ls=("-", "--", ":", "-.")[j % 4], label=f"{m} s{s}")  # fmt: skip
        ax.set_xlabel("generated model tokens")
        ax.set_ylabel("held-out success")
        ax.set_title(workload)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", choices=list(CONFIGS), default="agentic")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=60, help="RL steps (the most, with --tokens)")
    ap.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="budget of generated tokens per run (run.max_generated_tokens): each method stops there",
    )
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-episodes", type=int, default=100)
    ap.add_argument("--methods", nargs="+", choices=list(methods(8)), default=list(methods(8)),
                    help="methods to (re)run; other methods' runs already in the results file are kept")  # fmt: skip
    ap.add_argument("--tree-select", choices=SELECT, default="disagree", help="where the tree branches")
    ap.add_argument("--tree-branches", type=int, default=None, help="branches per group (default: half the roots)")
    ap.add_argument(
        "--shipped",
        action="store_true",
        help="agentic: the shipped warm-up and RL rates (results in their own section), not AS_MEASURED",
    )
    ap.add_argument("--tag", default=None, help="a section of its own for these runs (another machine or warm-up)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--report", action="store_true", help="only rewrite the table and plot from the stored runs")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--runs", default="runs")
    args = ap.parse_args()
    if args.shipped and args.workload != "agentic":
        ap.error("--shipped applies to --workload agentic only (the demo has no pinned rates)")
    if args.quick:
        args.seeds, args.steps, args.eval_every, args.eval_episodes = [0], 2, 1, 4
    if args.report:
        args.seeds = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("turn_credit_quick.json" if args.quick else "turn_credit.json")
    table = json.loads(path.read_text()) if path.is_file() else {}
    runs: dict[str, dict[int, dict[str, Any]]] = {m: {} for m in methods(8)}
    for m, by_seed in table.get(section(args), {}).get("runs", {}).items():  # runs kept from an earlier invocation
        runs.setdefault(m, {}).update({int(s): r for s, r in by_seed.items()})
    if args.report and any(runs.values()):
        table[section(args)] = summarize({k: v for k, v in runs.items() if v})
        path.write_text(json.dumps(table, indent=2, default=str))
    with tempfile.TemporaryDirectory() as tmp:
        model = init_model(Path(tmp) / "model", TINY, env_ids=["agentflow/Calc-v0"]) if args.quick else None
        if args.quick:
            args.runs = str(Path(tmp) / "runs")
        for seed in args.seeds:
            for m in args.methods:  # interleaved so machine noise hits every method alike
                runs[m][seed] = run_one(args, m, seed, model)
                table[section(args)] = summarize({k: v for k, v in runs.items() if v})
                path.write_text(json.dumps(table, indent=2, default=str))
    plot(table, path.with_suffix(".png"))
    print(json.dumps({w: t["methods"] for w, t in table.items()}, indent=2))


if __name__ == "__main__":
    main()
