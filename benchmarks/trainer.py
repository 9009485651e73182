"""Megatron trainer vs a plain PyTorch training step on the same Hugging Face model, same size, same threads.

Each side runs in its own subprocess (so peak RSS is its own), alternating over repeats; both train the demo-size
Qwen2 model (fp32, AdamW, SFT loss on every token) on the same random batches. Writes
``benchmarks/results/trainer.json`` (tokens/s medians, ``ratio`` = megatron / plain, peak RSS) and a PNG.

    .venv/bin/python benchmarks/trainer.py            # full
    .venv/bin/python benchmarks/trainer.py --quick    # CI-sized
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
    fn = run_megatron if args.child == "megatron" else run_plain
    tps = fn(args.model, args.batch, args.seq, args.steps)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"tokens_per_s": tps, "peak_rss_mb": peak_mb}))


def _spawn(kind: str, model: str, a: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--model", model]
    cmd += ["--batch", str(a.batch), "--seq", str(a.seq), "--steps", str(a.steps)]
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
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--child")
    ap.add_argument("--model")
    a = ap.parse_args()
    if a.child:
        return _child(a)
    if a.quick:
        a.repeats, a.steps, a.seq = 1, 3, 128
    from agentflow.model_init import init_model

    results: dict[str, list[dict]] = {"megatron": [], "plain_pytorch": []}
    with tempfile.TemporaryDirectory() as tmp:
        model = str(init_model(Path(tmp) / "model"))
        for _ in range(a.repeats):  # alternate so machine noise hits both alike
            results["megatron"].append(_spawn("megatron", model, a))
            results["plain_pytorch"].append(_spawn("plain", model, a))
    table = {
        k: {
            "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in v),
            "peak_rss_mb_median": statistics.median(r["peak_rss_mb"] for r in v),
            "runs": v,
        }
        for k, v in results.items()
    }
    table["ratio"] = table["megatron"]["tokens_per_s_median"] / table["plain_pytorch"]["tokens_per_s_median"]
    table["config"] = {"batch": a.batch, "seq": a.seq, "steps": a.steps, "repeats": a.repeats, "threads": 1}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "trainer.json").write_text(json.dumps(table, indent=2))
    _plot(table, out / "trainer.png")
    print(json.dumps({k: v for k, v in table.items() if k != "megatron" and k != "plain_pytorch"}, indent=2))


def _plot(table: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["megatron", "plain_pytorch"]
    fig, ax = plt.subplots(1, 2, figsize=(8, 3.2))
    ax[0].bar(names, [table[n]["tokens_per_s_median"] for n in names], color=["#2a7", "#888"])
    ax[0].set_title(f"training tokens/s (ratio {table['ratio']:.2f})")
    ax[1].bar(names, [table[n]["peak_rss_mb_median"] for n in names], color=["#2a7", "#888"])
    ax[1].set_title("peak RSS (MB)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
