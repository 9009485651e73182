"""Teacher Manager under a memory budget: 4 teachers, 2 resident, scoring requests interleaved across all 4.

Side by side in one process (one torch thread): the same rounds of scoring requests (each round a training batch's
worth, sequences routed round-robin to the 4 teachers) through

- ``all4``: every teacher resident (budget 4), the throughput reference;
- ``budget2``: at most 2 resident; the manager batches each round per teacher and loads the missing ones once;
- ``fifo2``: at most 2 resident, requests scored one by one in arrival order (a swap on almost every request), the
  naive way, for contrast;
- ``one``: a single teacher scoring its share, the memory reference.

Teachers are real embedded engines over locally made Qwen2 models (random weights, one tokenizer); idle teachers
are freed and reloaded from disk. Peak memory is RSS growth while a fresh manager scores two rounds (sampled every
5 ms, after a warm-up phase); throughput is requests per second of the median round after the first, the three ways
taking turns round by round so that the shared machine's load affects them alike. Writes
``benchmarks/results/teachers.json`` and ``teachers.png``.

    .venv/bin/python benchmarks/teachers.py --quick   # CI size (< 1 min)
    .venv/bin/python benchmarks/teachers.py
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import _path  # noqa: F401  (must come before the project's imports: see _path.py)
import torch
from _memory import PeakRSS
from safetensors.torch import save_file

from agentflow.model_init import ModelInitConfig, _init_weights, count_parameters, init_model
from agentflow.teacher_scoring import EngineScorer
from teachers.manager import TeacherManager
from teachers.routing import Router, parse_routes
from teachers.types import ScoreRequest, TeacherSpec

RESULTS = Path(__file__).resolve().parent / "results"
N_TEACHERS = 4
FIFO_ROUNDS = 3


def make_teachers(root: Path, cfg: ModelInitConfig) -> list[Path]:
    """Four model directories sharing one tokenizer, with different random weights."""
    first = init_model(root / "t0", cfg)
    dirs = [first]
    for i in range(1, N_TEACHERS):
        d = root / f"t{i}"
        shutil.copytree(first, d)
        save_file(_init_weights(replace(cfg, seed=i)), str(d / "model.safetensors"), metadata={"format": "pt"})
        dirs.append(d)
    return dirs


def make_manager(dirs: list[Path], budget: int) -> TeacherManager:
    specs = [TeacherSpec(f"t{i}", path=str(d)) for i, d in enumerate(dirs)]
    router = Router(specs, parse_routes({f"tag{i}": f"t{i}" for i in range(len(dirs))}))
    return TeacherManager(specs, router, lambda s: EngineScorer(s.path), max_resident=budget)


def make_rounds(rounds: int, per_round: int, seq_len: int, vocab: int, teachers: int) -> list[list[ScoreRequest]]:
    g = torch.Generator().manual_seed(0)
    return [
        [
            ScoreRequest(
                f"r{r}-{i}", torch.randint(10, vocab, (seq_len,), generator=g).tolist(), [f"tag{i % teachers}"]
            )
            for i in range(per_round)
        ]
        for r in range(rounds)
    ]


def memory_phase(dirs: list[Path], budget: int, rounds: list[list[ScoreRequest]]) -> float:
    """Peak RSS growth (MiB) while a fresh manager scores ``rounds`` and is closed."""
    with PeakRSS() as mem:
        manager = make_manager(dirs, budget)
        try:
            for batch in rounds:
                manager.score(batch)
        finally:
            manager.close()
            del manager
    return mem.growth / 2**20


def throughput(dirs: list[Path], rounds: list[list[ScoreRequest]]) -> dict[str, Any]:
    """Seconds per round of each way of scoring, the ways taking turns round by round (so that the machine's load
    drifts alike for all), and each way's teacher loads per round after the first."""
    ways = {"all4": (N_TEACHERS, False), "budget2": (2, False), "fifo2": (2, True)}
    managers = {name: make_manager(dirs, budget) for name, (budget, _) in ways.items()}
    times: dict[str, list[float]] = {name: [] for name in ways}
    loads: dict[str, list[int]] = {name: [] for name in ways}
    try:
        for r, batch in enumerate(rounds):
            for name, (_, one_by_one) in ways.items():
                if one_by_one and r >= FIFO_ROUNDS:  # the naive way is slow; a few rounds show it
                    continue
                before = managers[name].stats.loads
                t0 = time.perf_counter()
                for part in [[r] for r in batch] if one_by_one else [batch]:
                    managers[name].score(part)
                times[name].append(time.perf_counter() - t0)
                loads[name].append(managers[name].stats.loads - before)
    finally:
        for m in managers.values():
            m.close()
    return {
        name: {
            "round_s": times[name],
            "requests_per_s": len(rounds[0]) / statistics.median(times[name][1:]),  # round 0 loads every teacher
            "loads_per_round": statistics.mean(loads[name][1:]),
        }
        for name in ways
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mem, speed = result["peak_rss_growth_mb"], result["throughput"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = ["one", "budget2", "all4"]
    a.bar(names, [mem[n] / mem["one"] for n in names], color=["grey", "tab:blue", "tab:orange"])
    a.axhline(2.5, ls="--", color="red", label="target <= 2.5")
    a.set_ylabel("peak memory / one teacher")
    a.legend()
    names = ["all4", "budget2", "fifo2"]
    ref = speed["all4"]["requests_per_s"]
    b.bar(names, [speed[n]["requests_per_s"] / ref for n in names], color=["tab:orange", "tab:blue", "grey"])
    b.axhline(0.6, ls="--", color="red", label="target >= 0.6")
    b.set_ylabel("scoring throughput / all 4 resident")
    b.legend()
    fig.suptitle(f"4 teachers ({result['params_m']:.1f}M params each), 2 resident, interleaved requests")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CI size: smaller teachers, fewer rounds")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.quick:
        cfg = ModelInitConfig(hidden_size=384, num_hidden_layers=4, intermediate_size=1024, num_attention_heads=6,
                              num_key_value_heads=2)  # fmt: skip
        rounds, per_round, seq_len = 3, 24, 128
    else:
        cfg = ModelInitConfig(hidden_size=512, num_hidden_layers=8, intermediate_size=1376, num_attention_heads=8,
                              num_key_value_heads=2)  # fmt: skip
        rounds, per_round, seq_len = 8, 64, 256
    with tempfile.TemporaryDirectory() as tmp:
        dirs = make_teachers(Path(tmp), cfg)
        work = make_rounds(rounds, per_round, seq_len, cfg.vocab_size, N_TEACHERS)
        one_work = [[r for r in batch if r.tags[0] == "tag0"] for batch in work[:2]]
        memory_phase(dirs[:1], 1, one_work)  # warm-up: one-time allocations must not count for the first phase
        memory = {
            "one": memory_phase(dirs[:1], 1, one_work),
            "budget2": memory_phase(dirs, 2, work[:2]),
            "all4": memory_phase(dirs, N_TEACHERS, work[:2]),
        }
        speed = throughput(dirs, work)
    result = {
        "quick": args.quick,
        "params_m": count_parameters(cfg) / 1e6,
        "teacher_weights_mb": count_parameters(cfg) * 4 / 2**20,
        "requests_per_round": per_round,
        "rounds": rounds,
        "seq_len": seq_len,
        "peak_memory_teachers": memory["budget2"] / memory["one"],
        "peak_memory_all4_teachers": memory["all4"] / memory["one"],
        "throughput_ratio": speed["budget2"]["requests_per_s"] / speed["all4"]["requests_per_s"],
        "throughput_ratio_fifo": speed["fifo2"]["requests_per_s"] / speed["all4"]["requests_per_s"],
        "targets": {"peak_memory_teachers": "<= 2.5", "throughput_ratio": ">= 0.6"},
        "peak_rss_growth_mb": memory,
        "throughput": speed,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "teachers.json").write_text(json.dumps(result, indent=2))
    plot(result, RESULTS / "teachers.png")
    keys = ("peak_memory_teachers", "peak_memory_all4_teachers", "throughput_ratio", "throughput_ratio_fifo")
    print(json.dumps({k: round(result[k], 3) for k in keys}))


if __name__ == "__main__":
    main()
