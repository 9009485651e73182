"""Megatron trainer vs a plain PyTorch training step on the same Hugging Face model, same size, same threads; and the
Megatron trainer's packed micro-batches vs padded ones on a mixed-length batch.

Each side runs in its own subprocess (so peak RSS is its own), alternating over repeats; all train the demo-size
Qwen2 model (fp32, AdamW, SFT loss on every token). ``megatron`` vs ``plain_pytorch``: the same random equal-length
batches. ``packed_vs_padded``: one batch of lengths like the demo's (most 100-300 tokens, a tail to ~1000) under the
demo's micro-batch budget, ``trainer.packing`` on and off; tokens/s counts real (trained) tokens only. Writes
``benchmarks/results/trainer.json`` (tokens/s medians, ``ratio`` = megatron / plain, ``packed_vs_padded.ratio`` =
packed / padded, peak RSS) and a PNG. ``--part`` reruns one comparison and keeps the other's stored results.

    .venv/bin/python benchmarks/trainer.py            # full
    .venv/bin/python benchmarks/trainer.py --quick    # CI-sized
    .venv/bin/python benchmarks/trainer.py --part packed_vs_padded
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _path  # noqa: F401, E402  (must come before the project's imports: see _path.py)


def _batches(vocab: int, batch: int, seq: int, n: int):
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(n)]


def run_megatron(model_dir: str, batch: int, seq: int, steps: int) -> float:
    from trainer.megatron_trainer import MegatronTrainer
    from trainer.types import Sample, TrainerSettings

    t = MegatronTrainer(model_dir, TrainerSettings(lr=1e-4, threads=1, micro_batch_tokens=batch * seq))
    batches = _batches(t.spec.vocab_size, batch, seq, steps + 1)
    rows = [[Sample(r.tolist(), [1] * seq, [0.0] * seq, sample_id=str(i)) for i, r in enumerate(b)] for b in batches]
    t.train_step(rows[0], "sft")  # warm-up
    t0 = time.perf_counter()
    for r in rows[1:]:
        t.train_step(r, "sft")
    return steps * batch * (seq - 1) / (time.perf_counter() - t0)


def mixed_lengths(n: int, seed: int = 0) -> list[int]:
    """Lengths like the demo's episodes: seven in eight uniform in 100-300 tokens, the rest a tail spread evenly
    up to 1000."""
    import random

    rng = random.Random(seed)
    tail = n // 8
    return [rng.randint(100, 300) for _ in range(n - tail)] + [300 + 700 * (k + 1) // tail for k in range(tail)]


def run_mixed(model_dir: str, lengths: list[int], budget: int, steps: int, packing: bool) -> dict:
    """Train steps on one mixed-length batch, packed or padded: real tokens/s and the micro-batch count."""
    import random

    from trainer.megatron_trainer import MegatronTrainer
    from trainer.types import Sample, TrainerSettings

    settings = TrainerSettings(lr=1e-4, threads=1, micro_batch_tokens=budget, packing=packing)
    t = MegatronTrainer(model_dir, settings)
    rng = random.Random(1)
    vocab = t.spec.vocab_size

    def sample(i: int, n: int) -> Sample:
        return Sample([rng.randrange(vocab) for _ in range(n)], [1] * n, [0.0] * n, sample_id=str(i))

    batches = [[sample(i, n) for i, n in enumerate(lengths)] for _ in range(steps + 1)]
    micro = int(t.train_step(batches[0], "sft")["micro_batches"])  # warm-up
    t0 = time.perf_counter()
    for b in batches[1:]:
        t.train_step(b, "sft")
    tokens = steps * sum(n - 1 for n in lengths)
    return {"tokens_per_s": tokens / (time.perf_counter() - t0), "micro_batches": micro}


def run_plain(model_dir: str, batch: int, seq: int, steps: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.99))
    batches = _batches(model.config.vocab_size, batch, seq, steps + 1)

    def step(ids):
        logits = model(input_ids=ids).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -logp.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    step(batches[0])
    t0 = time.perf_counter()
    for ids in batches[1:]:
        step(ids)
    return steps * batch * (seq - 1) / (time.perf_counter() - t0)


def _child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    if args.child in ("packed", "padded"):
        out = run_mixed(args.model, mixed_lengths(args.mixed_batch), args.budget, args.steps, args.child == "packed")
    else:
        fn = run_megatron if args.child == "megatron" else run_plain
        out = {"tokens_per_s": fn(args.model, args.batch, args.seq, args.steps)}
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out))


def _spawn(kind: str, model: str, a: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--model", model]
    cmd += ["--batch", str(a.batch), "--seq", str(a.seq), "--steps", str(a.steps)]
    cmd += ["--mixed-batch", str(a.mixed_batch), "--budget", str(a.budget)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--mixed-batch", type=int, default=32, help="samples in the packed-vs-padded batch")
    ap.add_argument("--budget", type=int, default=8192, help="micro-batch token budget (the demo's)")
    ap.add_argument("--part", choices=["all", "megatron_vs_plain", "packed_vs_padded"], default="all")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--child")
    ap.add_argument("--model")
    a = ap.parse_args()
    if a.child:
        return _child(a)
    if a.quick:
        a.repeats, a.steps, a.seq, a.mixed_batch = 1, 3, 128, 16
    from agentflow.model_init import init_model

    out = Path(a.out)
    stored = out / "trainer.json"
    table = json.loads(stored.read_text()) if a.part != "all" and stored.is_file() else {}
    pairs = {"megatron_vs_plain": ("megatron", "plain"), "packed_vs_padded": ("packed", "padded")}
    parts = list(pairs) if a.part == "all" else [a.part]
    with tempfile.TemporaryDirectory() as tmp:
        model = str(init_model(Path(tmp) / "model"))
        for part in parts:
            results: dict[str, list[dict]] = {k: [] for k in pairs[part]}
            for _ in range(a.repeats):  # alternate so machine noise hits both alike
                for kind in pairs[part]:
                    results[kind].append(_spawn(kind, model, a))
            if part == "megatron_vs_plain":
                table["megatron"], table["plain_pytorch"] = _summary(results["megatron"]), _summary(results["plain"])
                table["ratio"] = (
                    table["megatron"]["tokens_per_s_median"] / table["plain_pytorch"]["tokens_per_s_median"]
                )
                table["config"] = {"batch": a.batch, "seq": a.seq, "steps": a.steps, "repeats": a.repeats, "threads": 1}
            else:
                lengths = mixed_lengths(a.mixed_batch)
                section = {k: _summary(v) for k, v in results.items()}
                section["ratio"] = section["packed"]["tokens_per_s_median"] / section["padded"]["tokens_per_s_median"]
                section["config"] = {
                    "samples": len(lengths),
                    "lengths_min_median_max": [min(lengths), statistics.median(lengths), max(lengths)],
                    "real_tokens": sum(lengths),
                    "padded_tokens": _padded_size(lengths, a.budget),
                    "micro_batch_tokens": a.budget,
                    "micro_batches": {k: results[k][0]["micro_batches"] for k in results},
                    "steps": a.steps,
                    "repeats": a.repeats,
                    "threads": 1,
                    "loss": "sft",
                }
                table["packed_vs_padded"] = section
    out.mkdir(parents=True, exist_ok=True)
    stored.write_text(json.dumps(table, indent=2))
    _plot(table, out / "trainer.png")
    summary = {k: table[k] for k in ("ratio", "config") if k in table}
    if "packed_vs_padded" in table:
        pvp = table["packed_vs_padded"]
        summary["packed_vs_padded"] = {k: pvp[k] for k in ("ratio", "config")}
        summary["packed_vs_padded"].update({k: pvp[k]["tokens_per_s_median"] for k in ("packed", "padded")})
    print(json.dumps(summary, indent=2))


def _summary(runs: list[dict]) -> dict:
    return {
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in runs),
        "peak_rss_mb_median": statistics.median(r["peak_rss_mb"] for r in runs),
        "runs": runs,
    }


def _padded_size(lengths: list[int], budget: int) -> int:
    """Tokens the padded micro-batches hold, padding included (``trainer.batching``'s grouping)."""
    from trainer.batching import make_micro_batches
    from trainer.types import Sample

    samples = [Sample([0] * n, [1] * n, [0.0] * n) for n in lengths]
    return sum(mb.input_ids.numel() for mb in make_micro_batches(samples, [0.0] * len(samples), budget))


def _plot(table: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["megatron", "plain_pytorch"]
    pvp = table.get("packed_vs_padded")
    fig, ax = plt.subplots(1, 3 if pvp else 2, figsize=(12 if pvp else 8, 3.2))
    if "megatron" in table:
        ax[0].bar(names, [table[n]["tokens_per_s_median"] for n in names], color=["#2a7", "#888"])
        ax[0].set_title(f"training tokens/s (ratio {table['ratio']:.2f})")
        ax[1].bar(names, [table[n]["peak_rss_mb_median"] for n in names], color=["#2a7", "#888"])
        ax[1].set_title("peak RSS (MB)")
    if pvp:
        kinds = ["packed", "padded"]
        ax[2].bar(kinds, [pvp[k]["tokens_per_s_median"] for k in kinds], color=["#27a", "#888"])
        ax[2].set_title(f"mixed lengths, real tokens/s (ratio {pvp['ratio']:.2f})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
