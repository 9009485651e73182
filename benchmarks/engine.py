"""Embedded engine vs Hugging Face ``generate``, side by side in one process at equal thread count.

On the demo-size model (made locally, random weights): decode tokens/s at batch 1, 8, 32, 64 (greedy, forced to
128 new tokens, HF with sdpa attention, KV cache and returned scores), a mixed-length workload (prompts 16-512
tokens, outputs 8-256; HF runs it in static batches, the engine with continuous batching), the cost of resuming a
multi-turn episode at 1k tokens of context with and without the prefix cache, and each engine's peak memory (RSS
growth over the phase). Writes ``benchmarks/results/engine.json`` and ``engine.png``.

    .venv/bin/python benchmarks/engine.py --quick      # CI size (< 2 min on one core)
    .venv/bin/python benchmarks/engine.py              # full
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _path  # noqa: F401  (must come before the project's imports: see _path.py)
import torch
from _memory import PeakRSS

from agentflow.engine.embedded import EmbeddedEngine
from agentflow.model_init import ModelInitConfig, init_model
from agentflow.types import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"
NEW_TOKENS = 128


def prompts(n: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def hf_generate(hf: Any, batch: list[list[int]], new_tokens: int) -> int:
    """Left-padded static batch, forced to ``new_tokens``; returns generated tokens."""
    width = max(len(p) for p in batch)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    return (out.sequences.shape[1] - width) * len(batch)


def engine_batch(eng: EmbeddedEngine, batch: list[list[int]], new_tokens: list[int]) -> int:
    pairs = zip(batch, new_tokens, strict=True)
    futs = [eng.submit(p, SamplingParams(temperature=0.0, max_new_tokens=n)) for p, n in pairs]
    return sum(len(f.result().output_ids) for f in futs)


def timed(fn: Callable[[], int]) -> tuple[float, float, float]:
    """(tokens/s, seconds, peak RSS growth MB) of one call returning a token count."""
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        tokens = fn()
        dt = time.perf_counter() - t0
    return tokens / dt, dt, mem.growth_mb


def decode_throughput(hf: Any, eng: EmbeddedEngine, batches: list[int], vocab: int, rounds: int) -> dict[str, Any]:
    """Tokens/s per batch size: HF and the engine alternate ``rounds`` times (so a change in machine load hits both);
    the medians are reported, with every round's ratio."""
    out: dict[str, Any] = {"hf": {}, "embedded": {}, "ratio_per_round": {}, "hf_peak_mb": 0.0, "embedded_peak_mb": 0.0}
    hf_generate(hf, prompts(1, 16, 0, vocab), 8)  # warm-up
    engine_batch(eng, prompts(1, 16, 0, vocab), [8])
    for b in batches:
        ps = prompts(b, 16, b, vocab)
        hf_runs, eng_runs = [], []
        for _ in range(rounds):
            tps, _, mb = timed(lambda ps=ps: hf_generate(hf, ps, NEW_TOKENS))
            hf_runs.append(tps)
            out["hf_peak_mb"] = max(out["hf_peak_mb"], round(mb, 1))
            eng.flush_cache()  # every round starts cold, as the first did (the prompts repeat across rounds)
            tps, _, mb = timed(lambda ps=ps, b=b: engine_batch(eng, ps, [NEW_TOKENS] * b))
            eng_runs.append(tps)
            out["embedded_peak_mb"] = max(out["embedded_peak_mb"], round(mb, 1))
        out["hf"][str(b)] = round(statistics.median(hf_runs), 1)
        out["embedded"][str(b)] = round(statistics.median(eng_runs), 1)
        out["ratio_per_round"][str(b)] = [round(e / h, 2) for e, h in zip(eng_runs, hf_runs, strict=True)]
        print(f"batch {b}: HF {out['hf'][str(b)]} tok/s, embedded {out['embedded'][str(b)]} tok/s (medians of "
              f"{rounds}; ratios {out['ratio_per_round'][str(b)]})", flush=True)  # fmt: skip
    return out


def mixed_workload(hf: Any, eng: EmbeddedEngine, n: int, vocab: int, max_batch: int) -> dict[str, Any]:
    rng = random.Random(0)
    lengths = [(rng.randint(16, 512), rng.randint(8, 256)) for _ in range(n)]
    ps = [prompts(1, p, i, vocab)[0] for i, (p, _) in enumerate(lengths)]
    outs = [o for _, o in lengths]

    def hf_run() -> int:  # static batches: each runs as long as its longest output; only wanted tokens count
        for i in range(0, n, max_batch):
            hf_generate(hf, ps[i : i + max_batch], max(outs[i : i + max_batch]))
        return sum(outs)

    hf_tps, hf_s, _ = timed(hf_run)
    eng_tps, eng_s, _ = timed(lambda: engine_batch(eng, ps, outs))
    print(f"mixed ({n} requests): HF {hf_tps:.0f} tok/s, embedded {eng_tps:.0f} tok/s", flush=True)
    return {"requests": n, "hf_tokens_per_s": round(hf_tps, 1), "embedded_tokens_per_s": round(eng_tps, 1)} | {
        "hf_seconds": round(hf_s, 2),
        "embedded_seconds": round(eng_s, 2),
    }


def resume_cost(model_dir: Path, vocab: int, repeats: int) -> dict[str, Any]:
    """Turn 2 of an episode at 1k tokens of context (1000-token turn 1, 16 sampled, 16 new env tokens), prefix
    cache on vs off: the resume cost (time to the first new token) and the whole turn (16 tokens generated)."""
    out: dict[str, Any] = {"context_tokens": 1000 + 16 + 16}
    for cache, tag in ((True, "with_cache"), (False, "without_cache")):
        with EmbeddedEngine(model_dir, max_slots=4, max_len=1200, prefix_cache=cache) as eng:
            ttft, turn = [], []
            for r in range(repeats):
                ctx = prompts(1, 1000, 100 + r, vocab)[0]
                first = eng.generate_sync(ctx, SamplingParams(temperature=0.0, max_new_tokens=16))
                nxt = ctx + first.output_ids + prompts(1, 16, 200 + r, vocab)[0]
                for n, times in ((1, ttft), (16, turn)):
                    t0 = time.perf_counter()
                    res = eng.generate_sync(nxt, SamplingParams(temperature=0.0, max_new_tokens=n))
                    times.append(time.perf_counter() - t0)
                    eng.generate_sync(ctx, SamplingParams(temperature=0.0, max_new_tokens=16))  # restore the slot
            out[f"{tag}_s"] = round(min(ttft), 4)
            out[f"{tag}_turn_s"] = round(min(turn), 4)
            out[f"{tag}_cached_tokens"] = res.cached_tokens
    print(f"resume at 1k: {out}", flush=True)
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    batches = list(result["decode"]["hf"])
    x = range(len(batches))
    a.bar([i - 0.2 for i in x], [result["decode"]["hf"][k] for k in batches], 0.4, label="HF generate")
    a.bar([i + 0.2 for i in x], [result["decode"]["embedded"][k] for k in batches], 0.4, label="embedded")
    a.set_xticks(list(x), batches)
    a.set(xlabel="batch", ylabel="tokens/s", title=f"decode, {NEW_TOKENS} new tokens, {result['threads']} thread(s)")
    a.legend()
    r = result["prefix_cache"]
    m = result["mixed"]
    b.bar(["resume: no cache", "resume: prefix cache"], [r["without_cache_s"], r["with_cache_s"]])
    b.set(
        ylabel="seconds",
        title=f"1k-context resume ({result['prefix_cache_speedup_1k']:.1f}x); mixed: "
        f"{m['embedded_tokens_per_s'] / m['hf_tokens_per_s']:.1f}x HF",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CI size: fewer mixed requests and resume repeats")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", help="HF model directory (default: a fresh demo-size model in a temp dir)")
    ap.add_argument("--out", default=str(RESULTS / "engine.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else init_model(Path(tmp) / "demo", ModelInitConfig())
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
        vocab = hf.config.vocab_size
        batches = [1, 8, 32, 64]
        with EmbeddedEngine(model_dir, max_slots=64, max_len=800) as eng:
            decode = decode_throughput(hf, eng, batches, vocab, 1 if args.quick else 5)
            mixed = mixed_workload(hf, eng, 16 if args.quick else 64, vocab, 32)
            kv_mb = eng.cache.nbytes() / 2**20
        prefix = resume_cost(model_dir, vocab, 1 if args.quick else 3)
    result = {
        "quick": args.quick,
        "threads": args.threads,
        "new_tokens": NEW_TOKENS,
        "decode": decode,
        "speedup_vs_hf_b32": round(decode["embedded"]["32"] / decode["hf"]["32"], 2),
        "speedup_vs_hf_b32_statistic": "median engine tok/s / median HF tok/s over alternating rounds",
        "mixed": mixed,
        "prefix_cache": prefix,
        "prefix_cache_speedup_1k": round(prefix["without_cache_s"] / prefix["with_cache_s"], 2),
        "peak_memory_mb": {
            "hf": decode["hf_peak_mb"],
            "embedded": round(decode["embedded_peak_mb"] + kv_mb, 1),
            "embedded_kv_cache_preallocated": round(kv_mb, 1),
            "note": "RSS growth during the decode phase; the embedded engine's preallocated KV cache is added",
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print(json.dumps({k: result[k] for k in ("speedup_vs_hf_b32", "prefix_cache_speedup_1k")}))


if __name__ == "__main__":
    main()
