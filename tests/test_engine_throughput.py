"""Decode throughput of the embedded engine on a ~3M-parameter Qwen2 (1 thread): batch 1 and batch 16."""

from __future__ import annotations

import time

import pytest
import torch

from agentflow.engine.embedded import EmbeddedEngine
from agentflow.engine.qwen2 import param_count
from agentflow.types import SamplingParams

pytest.importorskip("transformers")
from test_engine_model import make_model_dir  # noqa: E402

SMALL = dict(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1024,
    max_position_embeddings=1024,
)
NEW_TOKENS = 128


def measure(eng: EmbeddedEngine, batch: int) -> float:
    """Generated tokens per second of ``batch`` concurrent greedy requests (16-token prompts)."""
    sp = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, 1024, (16,), generator=gen).tolist() for _ in range(batch)]
    before = eng.stats()["tokens_generated"]
    t0 = time.perf_counter()
    futs = [eng.submit(p, sp) for p in prompts]
    results = [f.result(timeout=120) for f in futs]
    elapsed = time.perf_counter() - t0
    assert all(len(r.output_ids) == NEW_TOKENS for r in results)
    assert eng.stats()["tokens_generated"] - before == batch * NEW_TOKENS
    return batch * NEW_TOKENS / elapsed


def test_decode_throughput(tmp_path) -> None:
    torch.set_num_threads(1)
    make_model_dir(tmp_path, "qwen2", scale=0.05, **SMALL)
    with EmbeddedEngine(tmp_path, max_slots=16, max_len=256) as eng:
        n_params = param_count(eng.model.config)
        measure(eng, 1)  # warm-up
        tps1 = measure(eng, 1)
        tps16 = measure(eng, 16)
        stats = eng.stats()
    print(f"\n{n_params / 1e6:.2f}M params, 1 thread: batch 1 {tps1:.0f} tok/s, batch 16 {tps16:.0f} tok/s; {stats}")
    assert 2.5e6 < n_params < 3.5e6
    assert tps1 > 20 and tps16 > tps1
