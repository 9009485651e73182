"""Train/infer agreement per model family: the per-token log-prob gap between the engine that sampled an episode and
the trainer that scores it, with and without routing replay on the mixture-of-experts model.

Episodes of ``agentflow/Calc-v0`` are sampled by the embedded engine (temperature 1, the demo's settings), which
records each token's behaviour log-prob and, for an MoE model, the experts its router chose in every layer. The
Megatron trainer then scores the same tokens (what it does before every update): once following its own router,
once replaying the engine's experts (``trainer.routing_replay``). Per side: the k3 estimate of KL(behaviour ||
trainer) over sampled tokens, ``mean(r - 1 - log r)`` with ``r = p_trainer / p_behaviour``; the largest per-token
log-prob difference; and for the MoE model the share of (token, layer) routings where the trainer's router chose
other experts than the engine's (``routing_mismatch``). The dense model of the demo is the floor: no routing.

Models: ``--dense`` / ``--moe``, by default the dense demo's and the MoE demo's policies after their runs
(``runs/demo/model``, ``runs/demo-moe/model``), else freshly initialised ones of the same architecture (the JSON
names the models used). Writes
``benchmarks/results/models.json`` and a PNG.

    .venv/bin/python benchmarks/models.py            # 96 episodes per model
    .venv/bin/python benchmarks/models.py --quick    # 16 episodes, fresh models
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import _path  # noqa: F401, E402  (must come before the project's imports: see _path.py)

OUT = Path(__file__).parent / "results"
RUNS = {"dense": ("runs/demo/model", "qwen2"), "moe": ("runs/demo-moe/model", "qwen3_moe")}


def model_dir(kind: str, given: str | None, quick: bool, scratch: Path) -> tuple[Path, str]:
    """``given``, else the demo run's trained policy of this family, else a fresh model of the same architecture."""
    from agentflow.model_init import ModelInitConfig, init_model

    path, arch = RUNS[kind]
    path = given or path
    if not quick and (Path(path) / "config.json").is_file():
        return Path(path), path
    init_model(scratch / kind, ModelInitConfig(arch=arch), env_ids=["agentflow/Calc-v0"])
    return scratch / kind, f"fresh {arch} (demo size)"


def sample_episodes(model: Path, episodes: int, seed: int) -> list:
    """``episodes`` Calc-v0 episodes from the embedded engine, as trainer samples (behaviour log-probs, routes)."""
    import envs
    from agentflow.chat import ChatTokenizer
    from agentflow.controller import to_samples
    from agentflow.engine.embedded import EmbeddedEngine
    from agentflow.episode import EpisodeSpec, run_episode
    from agentflow.types import Group, SamplingParams

    tok = ChatTokenizer(model)

    async def play(engine) -> list:
        env_list = [envs.make("agentflow/Calc-v0") for _ in range(episodes)]
        try:
            sampling = [SamplingParams(temperature=1.0, max_new_tokens=64, seed=seed + i) for i in range(episodes)]
            specs = [EpisodeSpec(f"t{i}", "g", seed + i) for i in range(episodes)]
            runs = [
                run_episode(engine, tok, e, spec, sp, 512)
                for e, spec, sp in zip(env_list, specs, sampling, strict=True)
            ]
            return await asyncio.gather(*runs)
        finally:
            for env in env_list:
                env.close()

    with EmbeddedEngine(model, max_slots=32, max_len=512, seed=seed) as engine:
        trajs = asyncio.run(play(engine))
    for t in trajs:
        t.reward = t.reward if t.reward is not None else 0.0
    return to_samples([Group("g", 0, trajs)])


def agreement(trainer, samples: list, replay: bool) -> dict:
    """The trainer's log-probs of the sampled tokens against the engine's behaviour log-probs."""
    import torch

    from trainer import moe
    from trainer.losses import kl_k3

    trainer.settings = trainer.settings.model_copy(update={"routing_replay": replay})
    moe.take_mismatch(trainer.model)
    t0 = time.perf_counter()
    scored = trainer.sample_logprobs(samples)
    seconds = time.perf_counter() - t0
    pairs = [(b, t) for s, logp in zip(samples, scored, strict=True)
             for m, b, t in zip(s.loss_mask, s.behaviour_logprobs, logp, strict=True) if m]  # fmt: skip
    behaviour, mine = torch.tensor(pairs, dtype=torch.float64).T
    gap = (mine - behaviour).abs()
    out = {"tokens": len(pairs), "k3_kl": float(kl_k3(behaviour - mine).mean()),
           "max_abs_logprob_diff": float(gap.max()), "mean_abs_logprob_diff": float(gap.mean()),
           "score_s": seconds}  # fmt: skip
    if trainer.spec.is_moe:
        differing, compared = moe.take_mismatch(trainer.model)
        out.update(routing_mismatch=differing / max(compared, 1), routings_compared=compared)
    return out


def measure(model: Path, samples: list, lag: int, lr: float) -> dict:
    """Agreement at the engine's own weights, then ``lag`` GRPO updates later (on these samples, with replay, at the
    demo's learning rate): what an asynchronous run's trainer sees of a batch sampled ``lag`` versions ago."""
    from trainer.megatron_trainer import MegatronTrainer
    from trainer.types import TrainerSettings

    trainer = MegatronTrainer(str(model), TrainerSettings(threads=1, lr=lr, routing_replay=True))
    sides = [("with_replay", True), ("without_replay", False)] if trainer.spec.is_moe else [("trainer", False)]
    out: dict = {"same_weights": {name: agreement(trainer, samples, replay) for name, replay in sides}}
    trainer.settings = trainer.settings.model_copy(update={"routing_replay": True})
    for _ in range(lag):
        trainer.train_step(samples, "grpo")
    out[f"after_{lag}_updates"] = {name: agreement(trainer, samples, replay) for name, replay in sides}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="16 episodes per model, fresh models")
    ap.add_argument("--episodes", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lag", type=int, default=2, help="updates between sampling and scoring (the demo's bound)")
    ap.add_argument("--lr", type=float, default=1e-4, help="learning rate of those updates (the demo's)")
    ap.add_argument("--dense", help=f"dense model directory (default {RUNS['dense'][0]})")
    ap.add_argument("--moe", help=f"MoE model directory (default {RUNS['moe'][0]})")
    ap.add_argument("--out", default=str(OUT / "models.json"))
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    episodes = 16 if a.quick else a.episodes
    table: dict = {"episodes": episodes, "seed": a.seed, "lag": a.lag, "lr": a.lr, "env": "agentflow/Calc-v0",
                   "models": {}}  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch:
        for kind in RUNS:
            path, origin = model_dir(kind, getattr(a, kind), a.quick, Path(scratch))
            samples = sample_episodes(path, episodes, a.seed)
            table["models"][kind] = {"model": origin, **measure(path, samples, a.lag, a.lr)}
            print(kind, json.dumps(table["models"][kind], indent=1))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=2) + "\n")
    _plot(table, out.with_suffix(".png"))


def _plot(table: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    moe, dense = table["models"]["moe"], table["models"]["dense"]
    phases = ["same_weights", f"after_{table['lag']}_updates"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    width = 0.27
    sides = [("dense", dense, "trainer", "grey"), ("MoE, replay", moe, "with_replay", "tab:green"),
             ("MoE, no replay", moe, "without_replay", "tab:red")]  # fmt: skip
    for j, (label, model, side, color) in enumerate(sides):
        rows = [model[p][side] for p in phases]
        xs = [i + (j - 1) * width for i in range(len(phases))]
        axes[0].bar(xs, [max(r["k3_kl"], 1e-20) for r in rows], width, label=label, color=color)
        if label != "dense":
            axes[1].bar(xs, [100 * r["routing_mismatch"] for r in rows], width, label=label, color=color)
    for ax in axes:
        ax.set_xticks(range(len(phases)), ["engine's weights", f"{table['lag']} updates later"])
        ax.legend(fontsize=8)
    axes[0].set_yscale("log")
    axes[0].set_title("k3 KL(behaviour || trainer) per token")
    axes[1].set_title("routings differing from the engine's (%)")
    fig.suptitle(f"engine vs trainer on {table['episodes']} Calc-v0 episodes")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
