"""GPU check of the Megatron trainer's GPU path: one short script for a lent GPU machine; prints one JSON line.

On one CUDA device (world size 1) it checks:

1. ``build``: the demo-size Qwen2 model (``ModelInitConfig()`` defaults; ``--quick``: hidden 64, 2 layers) loads
   into ``MegatronTrainer(device="cuda")``: megatron-core's local layer spec on CUDA (``--layer-spec``), wrapped
   in Megatron's ``DistributedDataParallel`` and stepped by its distributed optimizer (``get_megatron_optimizer``
   with ``OptimizerConfig(use_distributed_optimizer=True)``), see ``trainer/gpu.py``;
2. ``train``: 3 SFT steps with gradient clipping: finite losses and norms, weights moved; the same 3 steps on the
   CPU trainer give the same losses (1e-4) and grad norms (1e-4 relative);
3. ``engine_update``: an in-process weight update of the embedded engine
   (``EmbeddedEngine.update_weights(version, trainer.export_weights())``) after which the engine's scored log-probs
   match the trainer's (``sequence_logprobs``) within 1e-4 (fp32; TF32 off), and differ before the update.

Exit code 0 iff every check passed; ``--out`` also writes the JSON. ``--device cpu`` dry-runs the script.

Measured on one NVIDIA H200 (Python 3.12, PyTorch 2.11.0 with CUDA 13.0, megatron-core 0.16.1; fp32, TF32 off,
local layer spec): both sizes pass (``benchmarks/results/gpu_check.json``, demo size; ``gpu_check_quick.json``).
At demo size the wrapper is Megatron's ``DistributedDataParallel`` with parameters on ``cuda:0`` and one
``DistributedOptimizer`` over torch ``AdamW``; the 3 steps' losses 6.9700, 6.6337, 6.3528 match the CPU trainer's
within 9.5e-7, grad norms within 3.1e-6 (relative), weights within 3.2e-5 after the 3 steps; steps take 0.49 s
(the first) and 0.03 s; after the update the engine's log-probs are within 1.4e-6 of the trainer's (1.74 before),
the update itself 3 ms. ``--quick``: losses equal, grad norms within 2.0e-6, engine within 4.8e-7.

A machine whose Python has torch but not the project's other requirements (and no network) takes them as wheels
for its Python version (megatron-core's are per CPython version and platform), downloaded elsewhere with
``pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform
manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d WHEELS megatron-core==0.16.1 pydantic pydantic-core
annotated-types typing-inspection typing-extensions`` (pydantic 2.14 needs typing-extensions 4.16 or newer),
installed there with ``pip install --no-index --no-deps --target SITE WHEELS/*.whl`` and put on ``PYTHONPATH``
ahead of the repository. The ``gpu``-marked tests import no further packages.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import _path  # noqa: F401  (must come before the project's imports: see _path.py)

if TYPE_CHECKING:
    from trainer.megatron_trainer import MegatronTrainer
    from trainer.types import Sample, TrainerSettings

TOL = 1e-4
STEPS = 3


def make_model_dir(out: Path, quick: bool) -> Path:
    """A random-init Qwen2 HF directory (config.json + model.safetensors; no tokenizer needed here)."""
    from safetensors.torch import save_file

    from agentflow.model_init import ModelInitConfig, _init_weights, hf_config

    cfg = ModelInitConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=176) if quick else ModelInitConfig()
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(cfg, 2, 0), indent=2))
    save_file(_init_weights(cfg), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def make_samples(vocab: int, rows: int, seq: int, seed: int = 0) -> list[Any]:
    """SFT rows of random ids: a 4-token prompt (masked out), the rest trained."""
    import torch

    from trainer.types import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(rows):
        n = seq - (i % 4) * (seq // 8)
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        out.append(Sample(ids, [0] * 4 + [1] * (n - 4), [0.0] * n, sample_id=f"r{i}"))
    return out


def describe_gpu_path(trainer: MegatronTrainer) -> dict[str, Any]:
    """Which wrappers the trainer really uses (DDP, distributed optimizer) and where its parameters live."""
    info: dict[str, Any] = {
        "model_wrapper": type(trainer.model).__name__,
        "param_device": str(next(trainer.model.parameters()).device),
        "optimizer": type(trainer.optimizer).__name__,
    }
    mega = getattr(trainer.optimizer, "megatron_optimizer", None)
    if mega is not None:
        parts = getattr(mega, "chained_optimizers", [mega])
        info["megatron_optimizers"] = [type(p).__name__ for p in parts]
        info["inner_optimizers"] = [type(getattr(p, "optimizer", None)).__name__ for p in parts]
    return info


def run_steps(trainer: MegatronTrainer, samples: list[Sample]) -> dict[str, Any]:
    """``STEPS`` SFT steps; losses, grad norms, step times and how far the weights moved."""
    before = trainer.export_weights()
    losses, norms, times = [], [], []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        m = trainer.train_step(samples, "sft")
        times.append(time.perf_counter() - t0)
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
    after = trainer.export_weights()
    moved = max(float((after[k] - before[k]).abs().max()) for k in before)
    return {"losses": losses, "grad_norms": norms, "step_s": times, "max_weight_change": moved, "weights": after}


def check_engine_update(
    trainer: MegatronTrainer, model_dir: Path, weights: dict[str, Any], seqs: list[list[int]]
) -> dict:
    """Update an embedded engine in-process with ``weights``; compare its log-probs with the trainer's."""
    from agentflow.engine.embedded import EmbeddedEngine

    engine = EmbeddedEngine(model_dir, max_slots=2, max_len=max(len(s) for s in seqs) + 8)
    try:

        def diff() -> float:
            worst = 0.0
            for ids in seqs:
                mine = trainer.sequence_logprobs(ids, temperature=1.0)
                theirs = engine.score(ids, 1).logprobs
                worst = max(worst, max(abs(a - b) for a, b in zip(mine, theirs, strict=True)))
            return worst

        stale = diff()
        t0 = time.perf_counter()
        engine.update_weights(trainer.version, weights)
        update_s = time.perf_counter() - t0
        fresh = diff()
        return {
            "max_abs_diff_before_update": stale,
            "max_abs_diff": fresh,
            "engine_version": engine.weight_version,
            "update_s": update_s,
            "ok": fresh < TOL < stale and engine.weight_version == trainer.version,
        }
    finally:
        engine.close()


def _stage(result: dict[str, Any], name: str, fn: Any) -> Any:
    """Run one check; record its outcome (or error) under ``result["checks"][name]``."""
    t0 = time.perf_counter()
    try:
        value, record = fn()
        result["checks"][name] = {**record, "seconds": round(time.perf_counter() - t0, 3)}
        return value
    except Exception as exc:
        result["checks"][name] = {"ok": False, "error": repr(exc), "traceback": traceback.format_exc()[-3000:]}
        return None


def _cpu_reference(model_dir: Path, settings: TrainerSettings, samples: list[Sample]) -> dict[str, Any]:
    from trainer.megatron_trainer import MegatronTrainer

    return run_steps(MegatronTrainer(model_dir, settings, device="cpu"), samples)


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """All checks; the JSON-ready result."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from trainer.types import TrainerSettings

    result: dict[str, Any] = {"ok": False, "verified_on_gpu": False, "checks": {}, "args": vars(args)}
    result["torch"] = torch.__version__
    result["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    if args.device == "cuda" and not torch.cuda.is_available():
        result["error"] = "CUDA is not available (use --device cpu to dry-run the script)"
        return result
    settings = TrainerSettings(lr=1e-3, grad_clip=0.5, threads=args.threads, micro_batch_tokens=4096)
    model_dir = make_model_dir(work / "model", args.quick)
    spec = json.loads((model_dir / "config.json").read_text())
    samples = make_samples(spec["vocab_size"], rows=8, seq=32 if args.quick else 128)

    def build() -> tuple[Any, dict]:
        from trainer.megatron_trainer import MegatronTrainer

        trainer = MegatronTrainer(model_dir, settings, device=args.device, layer_spec=args.layer_spec)
        info = describe_gpu_path(trainer)
        want_gpu = args.device == "cuda"
        ok = not want_gpu or (info["model_wrapper"] == "DistributedDataParallel" and "cuda" in info["param_device"])
        ok = ok and (not want_gpu or "DistributedOptimizer" in info.get("megatron_optimizers", []))
        return trainer, {**info, "ok": ok}

    trainer = _stage(result, "build", build)
    if trainer is None:
        return result

    def train() -> tuple[Any, dict]:
        mine = run_steps(trainer, samples)
        ref = _cpu_reference(model_dir, settings, samples)
        loss_diff = max(abs(a - b) for a, b in zip(mine["losses"], ref["losses"], strict=True))
        norm_rel = max(abs(a - b) / b for a, b in zip(mine["grad_norms"], ref["grad_norms"], strict=True))
        weight_diff = max(float((mine["weights"][k] - ref["weights"][k]).abs().max()) for k in ref["weights"])
        finite = all(math.isfinite(x) for x in mine["losses"] + mine["grad_norms"])
        ok = finite and mine["max_weight_change"] > 10 * TOL and loss_diff < TOL and norm_rel < TOL
        record = {k: v for k, v in mine.items() if k != "weights"}
        record.update(cpu_losses=ref["losses"], loss_max_abs_diff=loss_diff, grad_norm_max_rel_diff=norm_rel)
        return mine["weights"], {**record, "weights_max_abs_diff_vs_cpu": weight_diff, "ok": ok}

    weights = _stage(result, "train", train)
    if weights is not None:
        seqs = [s.token_ids for s in samples[:3]]
        _stage(result, "engine_update", lambda: (None, check_engine_update(trainer, model_dir, weights, seqs)))
    result["ok"] = all(c.get("ok") for c in result["checks"].values()) and len(result["checks"]) == 3
    result["verified_on_gpu"] = result["ok"] and args.device == "cuda"
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model (hidden 64, 2 layers) instead of demo size")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: dry-run of the script")
    parser.add_argument("--layer-spec", default="local", choices=["local", "sdpa", "te", "auto"])
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        try:
            result = run(args, Path(tmp))
        except Exception as exc:  # missing packages and the like: still one JSON line
            result = {"ok": False, "error": repr(exc), "traceback": traceback.format_exc()[-3000:]}
    line = json.dumps(result, default=str)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, default=str, indent=2))
    print(line, flush=True)
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
