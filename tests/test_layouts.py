"""transfer_mesh.layouts: HF <-> megatron name maps, QKV interleave, TP split/merge, clear errors."""

from __future__ import annotations

import pytest
import torch

from transfer_mesh.layouts import (
    LayoutError,
    ModelSpec,
    deinterleave_qkv,
    hf_shapes,
    hf_to_megatron,
    interleave_qkv,
    iter_hf_names,
    megatron_shapes,
    megatron_to_hf,
    merge_from_tp,
    split_for_tp,
)

QWEN2_CONFIG = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "tie_word_embeddings": True,
    "max_position_embeddings": 512,
    "hidden_act": "silu",
}
LLAMA_CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 96,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "head_dim": 8,
    "max_position_embeddings": 2048,
}
QWEN3_CONFIG = {
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "vocab_size": 128,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "tie_word_embeddings": False,
    "attention_bias": False,
    "use_sliding_window": False,
    "max_position_embeddings": 512,
    "hidden_act": "silu",
}
CONFIGS = {"qwen2": QWEN2_CONFIG, "llama": LLAMA_CONFIG, "qwen3": QWEN3_CONFIG}


def random_hf_state(spec: ModelSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors for every HF name of the spec."""
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) for name, shape in hf_shapes(spec).items()}


@pytest.fixture(params=["qwen2", "llama", "qwen3"])
def spec(request: pytest.FixtureRequest) -> ModelSpec:
    return ModelSpec.from_hf_config(CONFIGS[request.param])


def test_from_hf_config_reads_both_families() -> None:
    qwen = ModelSpec.from_hf_config(QWEN2_CONFIG)
    assert qwen.attention_bias and qwen.tie_word_embeddings and qwen.rope_theta == 1e6
    assert (qwen.num_key_value_heads, qwen.kv_channels, qwen.heads_per_group) == (2, 16, 2)
    llama = ModelSpec.from_hf_config(LLAMA_CONFIG)
    assert not llama.attention_bias and not llama.tie_word_embeddings and llama.rope_theta == 5e5
    assert llama.kv_channels == 8 and llama.max_position_embeddings == 2048


@pytest.mark.parametrize(
    "override, match",
    [
        ({"model_type": "mistral"}, "unsupported model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, "rope"),
        ({"num_key_value_heads": 3}, "multiple"),
    ],
)
def test_from_hf_config_rejects_unsupported(override: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelSpec.from_hf_config({**QWEN2_CONFIG, **override})


def test_names_and_shapes(spec: ModelSpec) -> None:
    names = list(iter_hf_names(spec))
    assert ("lm_head.weight" in names) == (not spec.tie_word_embeddings)
    assert any(n.endswith("q_proj.bias") for n in names) == spec.attention_bias
    mg = megatron_shapes(spec)
    qkv_rows = (spec.num_attention_heads + 2 * spec.num_key_value_heads) * spec.kv_channels
    assert mg["decoder.layers.0.self_attention.linear_qkv.weight"] == (qkv_rows, spec.hidden_size)
    assert mg["decoder.layers.0.mlp.linear_fc1.weight"] == (2 * spec.intermediate_size, spec.hidden_size)


def test_round_trip_exact(spec: ModelSpec) -> None:
    hf = random_hf_state(spec)
    mg = hf_to_megatron(hf, spec)
    assert set(mg) == set(megatron_shapes(spec))
    for name, shape in megatron_shapes(spec).items():
        assert tuple(mg[name].shape) == shape
    back = megatron_to_hf(mg, spec)
    assert list(back) == list(iter_hf_names(spec))
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_qkv_interleave_order() -> None:
    """Rows of group g: its q heads, then its k head, then its v head."""
    spec = ModelSpec.from_hf_config(QWEN2_CONFIG)  # 4 q heads, 2 kv heads, head_dim 16
    d = spec.kv_channels
    q = torch.arange(4).repeat_interleave(d).float()  # head index per row
    k = 10 + torch.arange(2).repeat_interleave(d).float()
    v = 20 + torch.arange(2).repeat_interleave(d).float()
    fused = interleave_qkv(q, k, v, spec)
    heads = fused.view(-1, d)[:, 0].tolist()
    assert heads == [0, 1, 10, 20, 2, 3, 11, 21]
    q2, k2, v2 = deinterleave_qkv(fused, spec)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)


def test_fc1_is_gate_then_up() -> None:
    spec = ModelSpec.from_hf_config(LLAMA_CONFIG)
    hf = random_hf_state(spec)
    fc1 = hf_to_megatron(hf, spec)["decoder.layers.1.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[: spec.intermediate_size], hf["model.layers.1.mlp.gate_proj.weight"])
    assert torch.equal(fc1[spec.intermediate_size :], hf["model.layers.1.mlp.up_proj.weight"])


def test_tied_lm_head_alias_and_extra_state_are_dropped() -> None:
    spec = ModelSpec.from_hf_config(QWEN2_CONFIG)
    hf = random_hf_state(spec)
    hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    mg = hf_to_megatron(hf, spec)
    assert "output_layer.weight" not in mg
    mg["decoder.layers.0.mlp.linear_fc1._extra_state"] = None
    mg["output_layer._extra_state"] = None
    assert "lm_head.weight" not in megatron_to_hf(mg, spec)


@pytest.mark.parametrize("tp", [2])
def test_tp_split_merge_round_trip(spec: ModelSpec, tp: int) -> None:
    mg = hf_to_megatron(random_hf_state(spec), spec)
    for name, full in mg.items():
        shards = [split_for_tp(name, full, tp, r) for r in range(tp)]
        assert all(s.is_contiguous() for s in shards)
        assert torch.equal(merge_from_tp(name, shards), full), name


def test_tp_split_semantics() -> None:
    spec = ModelSpec.from_hf_config(QWEN2_CONFIG)
    hf = random_hf_state(spec)
    mg = hf_to_megatron(hf, spec)
    inter = spec.intermediate_size
    fc1 = split_for_tp("decoder.layers.0.mlp.linear_fc1.weight", mg["decoder.layers.0.mlp.linear_fc1.weight"], 2, 1)
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(fc1, torch.cat([gate[inter // 2 :], up[inter // 2 :]]))
    proj = split_for_tp(
        "decoder.layers.0.self_attention.linear_proj.weight", hf["model.layers.0.self_attn.o_proj.weight"], 2, 0
    )
    assert proj.shape == (spec.hidden_size, spec.hidden_size // 2) and proj.is_contiguous()
    emb = split_for_tp("embedding.word_embeddings.weight", mg["embedding.word_embeddings.weight"], 2, 1)
    assert torch.equal(emb, hf["model.embed_tokens.weight"][spec.vocab_size // 2 :])
    norm = mg["decoder.final_layernorm.weight"]
    assert split_for_tp("decoder.final_layernorm.weight", norm, 2, 1) is norm
    # rank 1 of the QKV holds exactly KV group 1 (its q heads, k, v)
    qkv = split_for_tp(
        "decoder.layers.0.self_attention.linear_qkv.bias", mg["decoder.layers.0.self_attention.linear_qkv.bias"], 2, 1
    )
    d = spec.kv_channels
    assert torch.equal(qkv[: 2 * d], hf["model.layers.0.self_attn.q_proj.bias"][2 * d :])
    assert torch.equal(qkv[2 * d : 3 * d], hf["model.layers.0.self_attn.k_proj.bias"][d:])


def test_tp_split_errors() -> None:
    with pytest.raises(LayoutError, match="not divisible"):
        split_for_tp("embedding.word_embeddings.weight", torch.zeros(5, 4), 2, 0)
    with pytest.raises(LayoutError, match="out of range"):
        split_for_tp("embedding.word_embeddings.weight", torch.zeros(4, 4), 2, 2)


def test_missing_tensor_is_named(spec: ModelSpec) -> None:
    hf = random_hf_state(spec)
    del hf["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(LayoutError, match=r"missing HF tensors: \['model.layers.1.mlp.up_proj.weight'\]"):
        hf_to_megatron(hf, spec)


def test_misshaped_tensor_is_named(spec: ModelSpec) -> None:
    hf = random_hf_state(spec)
    hf["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, spec.hidden_size)
    with pytest.raises(LayoutError, match=r"model.layers.0.self_attn.k_proj.weight has shape \(3, 64\)"):
        hf_to_megatron(hf, spec)
    mg = hf_to_megatron(random_hf_state(spec), spec)
    mg["decoder.final_layernorm.weight"] = torch.zeros(7)
    with pytest.raises(LayoutError, match="decoder.final_layernorm.weight has shape"):
        megatron_to_hf(mg, spec)


def test_unmapped_tensor_is_named(spec: ModelSpec) -> None:
    hf = random_hf_state(spec)
    hf["model.layers.0.self_attn.extra.weight"] = torch.zeros(1)
    with pytest.raises(LayoutError, match="unmapped HF tensors.*self_attn.extra.weight"):
        hf_to_megatron(hf, spec)
    mg = hf_to_megatron(random_hf_state(spec), spec)
    mg["decoder.layers.9.mlp.linear_fc1.weight"] = torch.zeros(1)
    with pytest.raises(LayoutError, match="unmapped megatron tensors"):
        megatron_to_hf(mg, spec)
