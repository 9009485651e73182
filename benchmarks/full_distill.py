"""Cost of the full-vocabulary distillation terms: time and memory of one micro-batch's forward + backward.

For each model shape, the student's forward and backward over one packed micro-batch with

- ``sampled``: the student's log-probs of its tokens only (what ``k1``/``k2``/``k3`` cost the trainer: the teacher's
  log-probs come from its engine);
- ``topk``: the same plus the student's log-probs of 8 teacher ids per position (``topk``);
- ``full cN``: ``full_rkl`` through ``trainer.full_distill`` with the teacher evaluated in the trainer, chunks of N
  positions (``cAll``: one chunk for the whole micro-batch, checkpointed);
- ``naive``: both models' full ``[tokens, vocab]`` logits at once, no chunks (the way the chunks avoid).

Shapes: ``tiny`` (the tests' student: hidden 64, 2 layers, vocab 1,024), ``demo`` (the demo student: hidden 256,
4 layers, vocab 1,024) and ``demo-qwen-vocab`` (the demo's trunk with Qwen's 151,936-token vocabulary). Weights are
random (cost does not depend on them); teacher and student share the shape. Each case runs in a fresh process (one
torch thread): a warm-up, the median of 3 timed runs, then peak memory as the peak bytes of live tensor storages
made by the step (deterministic) and as the process's peak RSS above its RSS before the first step. Writes
``benchmarks/results/full_distill.json``.

    .venv/bin/python benchmarks/full_distill.py --quick   # tiny and demo only (< 1 min)
    .venv/bin/python benchmarks/full_distill.py
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import _path  # noqa: F401  (must come before the project's imports: see _path.py)

SHAPES = {
    "tiny": dict(hidden=64, layers=2, ffn=176, heads=4, groups=4, vocab=1024, rows=8, length=256),
    "demo": dict(hidden=256, layers=4, ffn=688, heads=4, groups=2, vocab=1024, rows=8, length=256),
    "demo-qwen-vocab": dict(hidden=256, layers=4, ffn=688, heads=4, groups=2, vocab=151_936, rows=4, length=256),
}
METHODS = ["sampled", "topk", "full c256", "full c1024", "full cAll", "naive"]
OUT = Path(__file__).resolve().parent / "results" / "full_distill.json"


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_case(shape: str, method: str) -> dict[str, float]:
    """One case in this process: seconds per step and peak memory."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from trainer.batching import pack_rows
    from trainer.full_distill import full_vocab_terms
    from trainer.losses import full_reverse_kl
    from trainer.model import _logits, build_gpt_model, init_distributed_cpu, token_logprobs, token_logprobs_at
    from transfer_mesh.layouts import ModelSpec

    torch.set_num_threads(1)
    p = SHAPES[shape]
    spec = ModelSpec("qwen2", p["hidden"], p["layers"], p["heads"], p["groups"], p["ffn"], p["vocab"],
                     tie_word_embeddings=True)  # fmt: skip
    init_distributed_cpu()
    student, teacher = build_gpt_model(spec, seed=0), build_gpt_model(spec, seed=1)
    teacher.requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, spec.vocab_size, (p["rows"], p["length"]), generator=gen)
    lengths = torch.full((p["rows"],), p["length"])
    packing = pack_rows(ids, lengths)
    top = torch.randint(0, spec.vocab_size, (p["rows"], p["length"] - 1, 8), generator=gen)
    targets = p["rows"] * (p["length"] - 1)

    def step() -> None:
        student.zero_grad(set_to_none=True)
        if method == "sampled":
            loss = token_logprobs(student, ids, packing=packing).sum()
        elif method == "topk":
            logp, extra = token_logprobs_at(student, ids, top, packing=packing)
            loss = logp.sum() + extra.sum()
        elif method.startswith("full"):
            chunk = targets if method == "full cAll" else int(method.split("c")[1])
            out = full_vocab_terms(student, [(teacher, list(range(p["rows"])))], ids, lengths, full_reverse_kl,
                                   chunk=chunk, packing=packing)  # fmt: skip
            loss = out.divergence.sum() + out.logp.sum()
        else:
            logp_s = torch.log_softmax(_logits(student, ids, None)[:, :-1], -1)
            with torch.no_grad():
                logp_t = torch.log_softmax(_logits(teacher, ids, None)[:, :-1], -1)
            loss = full_reverse_kl(logp_s, logp_t).sum() + logp_s.gather(-1, ids[:, 1:, None]).sum()
        loss.backward()

    class PeakStorage(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.live: dict[int, tuple[StorageWeakRef, int]] = {}
            self.peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            for x in tree_flatten(out)[0]:
                if isinstance(x, torch.Tensor):
                    st = x.untyped_storage()
                    self.live[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
            self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
            self.peak = max(self.peak, sum(n for _, n in self.live.values()))
            return out

    base = _rss()
    step()  # warm-up
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    rss_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base  # the process's peak, past the models
    student.zero_grad(set_to_none=True)
    with PeakStorage() as mem:
        step()
    return {"step_s": statistics.median(times), "peak_tensor_mb": mem.peak / 2**20, "rss_growth_mb": rss_growth / 2**20,
            "targets": targets, "one_logits_mb": targets * spec.vocab_size * 4 / 2**20}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny and demo shapes only")
    ap.add_argument("--case", nargs=2, metavar=("SHAPE", "METHOD"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        print(json.dumps(run_case(*args.case)))
        return
    shapes = ["tiny", "demo"] if args.quick else list(SHAPES)
    results: dict[str, dict[str, dict[str, float]]] = {}
    for shape in shapes:
        results[shape] = {}
        for method in METHODS:
            proc = subprocess.run([sys.executable, __file__, "--case", shape, method], capture_output=True, text=True,
                                  check=True)  # fmt: skip
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            results[shape][method] = row
            print(f"{shape:16s} {method:11s} {row['step_s']:7.3f} s  tensors {row['peak_tensor_mb']:8.1f} MiB  "
                  f"rss +{row['rss_growth_mb']:8.1f} MiB  (one [targets, vocab] fp32: {row['one_logits_mb']:.1f} MiB)",
                  flush=True)  # fmt: skip
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"threads": 1, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
