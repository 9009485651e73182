"""The pure-torch Qwen2/Llama decoder against Hugging Face transformers (fp32, tiny random models)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agentflow.engine.qwen2 import KVCache, load_hf_dir, param_count
from transfer_mesh.layouts import ModelSpec

transformers = pytest.importorskip("transformers")

TINY_QWEN2 = dict(
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    tie_word_embeddings=True,
    max_position_embeddings=512,
)
TINY_LLAMA = dict(TINY_QWEN2, tie_word_embeddings=False, attention_bias=True, rms_norm_eps=1e-5, rope_theta=5000.0)
TINY_QWEN3 = dict(TINY_QWEN2, head_dim=24, rope_parameters={"rope_theta": 20000.0, "rope_type": "default"})
TINY_QWEN3_MOE = dict(TINY_QWEN3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)


def make_model_dir(path: Path, arch: str = "qwen2", seed: int = 0, scale: float = 0.15, **overrides: object):
    """Save a random HF model with non-trivial weights (biases, norms) to ``path``; return the HF model."""
    torch.manual_seed(seed)
    if arch == "qwen2":
        cfg = transformers.Qwen2Config(**{**TINY_QWEN2, **overrides})
        model = transformers.Qwen2ForCausalLM(cfg)
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(**{**TINY_QWEN3, **overrides})
        model = transformers.Qwen3ForCausalLM(cfg)
    elif arch == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**{**TINY_QWEN3_MOE, **overrides})
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**{**TINY_LLAMA, **overrides})
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * scale + (1.0 if "norm" in name else 0.0))
    model.eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=["qwen2", "llama", "qwen3", "qwen3_moe"])
def hf_pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return make_model_dir(path, request.param), path


def test_missing_dir_names_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_hf_dir(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_hf_dir(tmp_path)


def test_config_fields(hf_pair) -> None:
    hf, path = hf_pair
    model = load_hf_dir(path)
    c = model.config
    qwen3 = c.model_type.startswith("qwen3")
    assert c.num_key_value_heads == 2 and c.kv_channels == (24 if qwen3 else 16)
    assert c.tie_word_embeddings == hf.config.tie_word_embeddings
    assert c.attention_bias == (not qwen3) and c.o_proj_bias == (c.model_type == "llama")
    assert c.qk_norm == qwen3 and c.is_moe == (c.model_type == "qwen3_moe")
    assert c.rope_theta == (20000.0 if qwen3 else {"qwen2": 10000.0, "llama": 5000.0}[c.model_type])
    n_hf = sum(p.numel() for p in hf.parameters())
    assert param_count(c) == n_hf


def test_unsupported_config_rejected() -> None:
    base = {"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2, "vocab_size": 4}
    with pytest.raises(ValueError, match="model_type"):
        ModelSpec.from_hf_config({**base, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="rope"):
        ModelSpec.from_hf_config(
            {**base, "intermediate_size": 8, "num_hidden_layers": 1, "rope_scaling": {"type": "yarn"}}
        )


def test_forward_paths_match_hf(hf_pair) -> None:
    hf, path = hf_pair
    model = load_hf_dir(path)
    ids = torch.randint(0, 128, (24,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    torch.testing.assert_close(model.forward_full(ids), ref, atol=2e-5, rtol=0)
    cache = KVCache(model.config, max_slots=3, max_len=32)
    # Prefill in two chunks (an uncached suffix after a cached prefix).
    torch.testing.assert_close(model.prefill(cache, 1, ids[:10], 0, all_logits=True), ref[:10], atol=2e-5, rtol=0)
    torch.testing.assert_close(model.prefill(cache, 1, ids[10:16], 10), ref[15], atol=2e-5, rtol=0)
    # A second slot at another position; a batched decode step of both.
    model.prefill(cache, 2, ids[:5], 0)
    logits = model.decode(cache, torch.tensor([1, 2]), torch.stack([ids[16], ids[5]]), torch.tensor([16, 5]))
    torch.testing.assert_close(logits[0], ref[16], atol=2e-5, rtol=0)
    torch.testing.assert_close(logits[1], ref[5], atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="max_len"):
        model.prefill(cache, 0, ids, 20)


@pytest.mark.parametrize(
    ("slots", "lengths"),
    [
        ([4, 0, 2], (9, 14, 6)),
        ([0, 7], (9, 14)),
        ([2, 3, 4], (11, 11, 11)),
        ([3, 2, 4], (11, 11, 11)),
        ([1, 0], (5, 9)),
    ],
    ids=["slot-range-with-holes", "sparse-gather", "dense-static-batch", "contiguous-out-of-order", "dense-masked"],
)
def test_decode_over_fragmented_slots_matches_full_forward(hf_pair, slots: list[int], lengths: tuple[int, ...]) -> None:
    """Decoding slots out of order, with idle slots between them (view path), far apart (gather path), or
    exactly a contiguous range (no scatter; no mask when every row is at the same position)."""
    _, path = hf_pair
    model = load_hf_dir(path)
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 128, (n,), generator=gen) for n in lengths]
    cache = KVCache(model.config, max_slots=8, max_len=32)
    cache.data.normal_(generator=gen)  # stale keys in idle slots must not leak into anyone's attention
    for slot, seq in zip(slots, seqs, strict=True):
        model.prefill(cache, slot, seq[:-1], 0)
    logits = model.decode(
        cache, torch.tensor(slots), torch.stack([s[-1] for s in seqs]), torch.tensor([len(s) - 1 for s in seqs])
    )
    for row, seq in enumerate(seqs):
        torch.testing.assert_close(logits[row], model.forward_full(seq)[-1], atol=2e-5, rtol=0)


def test_batched_prefill_matches_full_forward(hf_pair) -> None:
    """Several slots prefilled in one pass, one of them after a cached prefix."""
    _, path = hf_pair
    model = load_hf_dir(path)
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 128, (n,), generator=gen) for n in (7, 12, 3)]
    cache = KVCache(model.config, max_slots=4, max_len=32)
    model.prefill(cache, 3, seqs[1][:5], 0)  # slot 3 already holds the first 5 tokens of seqs[1]
    logits = model.prefill_batch(cache, [0, 3, 1], [seqs[0], seqs[1][5:], seqs[2]], [0, 5, 0])
    for row, seq in enumerate(seqs):
        torch.testing.assert_close(logits[row], model.forward_full(seq)[-1], atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="max_len"):
        model.prefill_batch(cache, [0], [seqs[1]], [25])


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_model_init_qwen3_is_a_transformers_qwen3(tmp_path: Path, arch: str) -> None:
    from agentflow.model_init import ARCHES, ModelInitConfig, init_model

    cfg = ModelInitConfig(hidden_size=32, num_hidden_layers=1, intermediate_size=48, vocab_size=384, arch=arch,
                          num_experts=4, moe_intermediate_size=16)  # fmt: skip
    path = init_model(tmp_path / "q3", cfg)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert type(hf).__name__ == ARCHES[arch]
    ours = load_hf_dir(path)
    assert ours.config.qk_norm and not ours.config.attention_bias
    assert ours.config.num_experts == (4 if arch == "qwen3_moe" else 0)
    ids = torch.arange(3, 40)
    with torch.no_grad():
        ref = hf(input_ids=ids[None]).logits[0]
    assert (ours.forward_full(ids) - ref).abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="unknown arch"):
        ModelInitConfig(arch="gpt2")
