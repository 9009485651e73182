"""Model-family layouts: Hugging Face <-> megatron-core ``GPTModel`` tensor names and shapes.

Written once and used by the trainer (load/export of HF directories) and by weight sync. Covers the Llama, Qwen2
and Qwen3 families, dense and mixture-of-experts, with megatron-core's *local* layer spec names (``input_layernorm``
/ ``pre_mlp_layernorm``; Qwen3's per-head ``q_norm``/``k_norm`` are ``self_attention.q_layernorm``/``k_layernorm``;
a Qwen3-MoE layer's router ``mlp.gate`` is ``mlp.router`` and expert ``j``'s gate/up/down projections are
``mlp.experts.local_experts.{j}.linear_fc1`` (gate then up) and ``linear_fc2``, as megatron's ``SequentialMLP``).

Conventions of the megatron side:

- ``linear_qkv`` rows are interleaved per KV group: for each group, the rows of its query heads, then its key head,
  then its value head (biases likewise).
- ``linear_fc1`` is ``cat([gate_proj, up_proj], dim=0)``.
- With tied embeddings there is no ``output_layer.weight`` (and HF ``lm_head.weight`` is an alias that is dropped).
- ``*._extra_state`` entries (TransformerEngine/fp8 metadata, ``None`` on the local spec) are skipped.

Tensor-parallel helpers split a *full* megatron tensor into the shard that a TP rank holds and merge shards back.
All conversions are pure reshapes/concatenations, so round trips are bit-exact.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

SUPPORTED_MODEL_TYPES = ("qwen2", "llama", "qwen3", "qwen3_moe")


class LayoutError(ValueError):
    """A state dict does not match the layout: unmapped, missing or mis-shaped tensors, or an impossible split."""


@dataclass(frozen=True)
class ModelSpec:
    """The architecture facts of a Llama/Qwen2/Qwen3 model that the layouts and the trainer need."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 2048
    head_dim: int | None = None
    num_experts: int = 0
    """Routed experts per layer (0: a dense model)."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int = 0
    """Each expert's MLP width."""
    norm_topk_prob: bool = False
    """Renormalise the top-k routing probabilities to sum to 1 (else they are the full softmax's)."""

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {self.model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if (self.model_type == "qwen3_moe") != (self.num_experts > 0):
            raise ValueError("num_experts > 0 exactly for model_type 'qwen3_moe'")
        if self.num_experts and not (0 < self.num_experts_per_tok <= self.num_experts and self.moe_intermediate_size):
            raise ValueError(
                f"an MoE model needs 0 < num_experts_per_tok <= num_experts ({self.num_experts}) and a "
                f"moe_intermediate_size, got {self.num_experts_per_tok} and {self.moe_intermediate_size}"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size={self.hidden_size} not divisible by heads={self.num_attention_heads}")

    @property
    def kv_channels(self) -> int:
        """Per-head dimension (HF ``head_dim``; megatron ``kv_channels``)."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def heads_per_group(self) -> int:
        """Query heads per KV group."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def qk_norm(self) -> bool:
        """Whether queries and keys are RMS-normalised per head before RoPE (Qwen3's ``q_norm``/``k_norm``)."""
        return self.model_type in ("qwen3", "qwen3_moe")

    @property
    def is_moe(self) -> bool:
        """Whether every layer's MLP is a set of routed experts."""
        return self.num_experts > 0

    @property
    def o_proj_bias(self) -> bool:
        """Whether ``o_proj`` has a bias: Llama's ``attention_bias`` covers q, k, v and o; Qwen2's only q, k, v."""
        return self.attention_bias and self.model_type == "llama"

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelSpec:
        """Read a spec from an HF ``config.json`` dict (transformers 4.x ``rope_theta`` or 5.x ``rope_parameters``)."""
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
        _check_supported_features(config)
        heads = int(config["num_attention_heads"])
        head_dim = config.get("head_dim")
        if head_dim is not None and int(head_dim) == int(config["hidden_size"]) // heads:
            head_dim = None
        rope = config.get("rope_parameters") or {}
        moe = _moe_fields(config) if model_type == "qwen3_moe" else {}
        return cls(
            model_type=model_type,
            hidden_size=int(config["hidden_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(config.get("rope_theta", rope.get("rope_theta", 10000.0))),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=True if model_type == "qwen2" else bool(config.get("attention_bias", False)),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            head_dim=None if head_dim is None else int(head_dim),
            **moe,
        )


def _moe_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """A Qwen3-MoE config's expert fields; refuses dense layers among sparse ones and shared experts."""
    if int(config.get("decoder_sparse_step", 1)) != 1 or config.get("mlp_only_layers"):
        raise ValueError("unsupported MoE layout: dense MLP layers between MoE layers (decoder_sparse_step != 1 or "
                         "mlp_only_layers)")  # fmt: skip
    if config.get("shared_expert_intermediate_size"):
        raise ValueError("unsupported MoE layout: a shared expert")
    return {
        # released checkpoints say num_experts; transformers 5 writes num_local_experts
        "num_experts": int(config.get("num_experts") or config["num_local_experts"]),
        "num_experts_per_tok": int(config["num_experts_per_tok"]),
        "moe_intermediate_size": int(config["moe_intermediate_size"]),
        "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
    }


def _check_supported_features(config: Mapping[str, Any]) -> None:
    """Reject HF configs with features that no model code here implements (neither the engine's decoder nor the
    trainer's GPTModel). What only megatron lacks is refused by :func:`check_megatron_layout`."""
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r} (only 'silu')")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"unsupported rope scaling type {rope_type!r} (only 'default')")
    if config.get("mlp_bias"):
        raise ValueError("unsupported mlp_bias=True")
    if config.get("use_sliding_window"):
        raise ValueError("unsupported use_sliding_window=True")


# ----------------------------------------------------------------------------------------------------------- names


def _hf_layer(i: int) -> str:
    return f"model.layers.{i}."


def _mg_layer(i: int) -> str:
    return f"decoder.layers.{i}."


def hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of a full model with its shape, in checkpoint order."""
    h, d, inter = spec.hidden_size, spec.kv_channels, spec.intermediate_size
    q_out, kv_out = spec.num_attention_heads * d, spec.num_key_value_heads * d
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, h)}
    for i in range(spec.num_hidden_layers):
        p = _hf_layer(i)
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "self_attn.q_proj.weight"] = (q_out, h)
        out[p + "self_attn.k_proj.weight"] = (kv_out, h)
        out[p + "self_attn.v_proj.weight"] = (kv_out, h)
        if spec.attention_bias:
            out[p + "self_attn.q_proj.bias"] = (q_out,)
            out[p + "self_attn.k_proj.bias"] = (kv_out,)
            out[p + "self_attn.v_proj.bias"] = (kv_out,)
        out[p + "self_attn.o_proj.weight"] = (h, q_out)
        if spec.o_proj_bias:
            out[p + "self_attn.o_proj.bias"] = (h,)
        if spec.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (d,)
            out[p + "self_attn.k_norm.weight"] = (d,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        if spec.is_moe:
            m = spec.moe_intermediate_size
            out[p + "mlp.gate.weight"] = (spec.num_experts, h)
            for j in range(spec.num_experts):
                e = f"{p}mlp.experts.{j}."
                out[e + "gate_proj.weight"], out[e + "up_proj.weight"], out[e + "down_proj.weight"] = (
                    (m, h),
                    (m, h),
                    (h, m),
                )
            continue
        out[p + "mlp.gate_proj.weight"] = (inter, h)
        out[p + "mlp.up_proj.weight"] = (inter, h)
        out[p + "mlp.down_proj.weight"] = (h, inter)
    out["model.norm.weight"] = (h,)
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = (spec.vocab_size, h)
    return out


def check_megatron_layout(spec: ModelSpec) -> None:
    """Raise LayoutError for a model that megatron-core's GPTModel cannot hold.

    Llama's ``attention_bias`` also biases ``o_proj``; megatron's only switch for that bias adds MLP biases as well.
    """
    if spec.o_proj_bias:
        raise LayoutError("unsupported llama attention_bias=True (it also biases o_proj, which megatron cannot)")


def megatron_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every megatron-core GPTModel (local spec, TP=1) parameter name with its full shape."""
    check_megatron_layout(spec)
    h, d, inter = spec.hidden_size, spec.kv_channels, spec.intermediate_size
    qkv_out = (spec.num_attention_heads + 2 * spec.num_key_value_heads) * d
    out: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (spec.vocab_size, h)}
    for i in range(spec.num_hidden_layers):
        p = _mg_layer(i)
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "self_attention.linear_qkv.weight"] = (qkv_out, h)
        if spec.attention_bias:
            out[p + "self_attention.linear_qkv.bias"] = (qkv_out,)
        out[p + "self_attention.linear_proj.weight"] = (h, spec.num_attention_heads * d)
        if spec.qk_norm:
            out[p + "self_attention.q_layernorm.weight"] = (d,)
            out[p + "self_attention.k_layernorm.weight"] = (d,)
        out[p + "pre_mlp_layernorm.weight"] = (h,)
        if spec.is_moe:
            m = spec.moe_intermediate_size
            out[p + "mlp.router.weight"] = (spec.num_experts, h)
            for j in range(spec.num_experts):
                out[f"{p}mlp.experts.local_experts.{j}.linear_fc1.weight"] = (2 * m, h)
                out[f"{p}mlp.experts.local_experts.{j}.linear_fc2.weight"] = (h, m)
            continue
        out[p + "mlp.linear_fc1.weight"] = (2 * inter, h)
        out[p + "mlp.linear_fc2.weight"] = (h, inter)
    out["decoder.final_layernorm.weight"] = (h,)
    if not spec.tie_word_embeddings:
        out["output_layer.weight"] = (spec.vocab_size, h)
    return out


def iter_hf_names(spec: ModelSpec) -> Iterator[str]:
    """The HF tensor names a full model of this spec has (no ``lm_head`` when tied)."""
    yield from hf_shapes(spec)


def iter_megatron_names(spec: ModelSpec) -> Iterator[str]:
    """The megatron parameter names a full (TP=1) model of this spec has."""
    yield from megatron_shapes(spec)


# Names mapped one-to-one, as (HF suffix, megatron suffix) within a layer.
_LAYER_RENAMES = (
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("self_attn.o_proj.weight", "self_attention.linear_proj.weight"),
    ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight"),
)
_ROUTER_RENAME = (("mlp.gate.weight", "mlp.router.weight"),)
_QK_NORM_RENAMES = (
    ("self_attn.q_norm.weight", "self_attention.q_layernorm.weight"),
    ("self_attn.k_norm.weight", "self_attention.k_layernorm.weight"),
)
_TOP_RENAMES = (
    ("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
    ("model.norm.weight", "decoder.final_layernorm.weight"),
    ("lm_head.weight", "output_layer.weight"),
)


def _layer_renames(spec: ModelSpec) -> tuple[tuple[str, str], ...]:
    return _LAYER_RENAMES + (_QK_NORM_RENAMES if spec.qk_norm else ()) + (_ROUTER_RENAME if spec.is_moe else ())


def _mlps(spec: ModelSpec) -> list[tuple[str, str]]:
    """Each gated MLP of a layer as (HF prefix, megatron prefix): the dense one, or every expert."""
    if not spec.is_moe:
        return [("mlp.", "mlp.")]
    return [(f"mlp.experts.{j}.", f"mlp.experts.local_experts.{j}.") for j in range(spec.num_experts)]


def _is_ignorable(name: str, value: Any) -> bool:
    """Entries that carry no weights: TE extra state and cached rotary frequencies."""
    return name.endswith("._extra_state") or name.endswith("inv_freq") or value is None


def _validate(state: Mapping[str, Any], expected: dict[str, tuple[int, ...]], side: str) -> dict[str, Tensor]:
    """Drop ignorable entries, then raise a LayoutError naming unmapped, missing and mis-shaped tensors."""
    tensors = {k: v for k, v in state.items() if not _is_ignorable(k, v)}
    problems = []
    unmapped = sorted(set(tensors) - set(expected))
    missing = [k for k in expected if k not in tensors]
    if unmapped:
        problems.append(f"unmapped {side} tensors: {unmapped}")
    if missing:
        problems.append(f"missing {side} tensors: {missing}")
    for name, shape in expected.items():
        t = tensors.get(name)
        if t is not None and tuple(t.shape) != shape:
            problems.append(f"{side} tensor {name} has shape {tuple(t.shape)}, expected {shape}")
    if problems:
        raise LayoutError("; ".join(problems))
    return tensors


# --------------------------------------------------------------------------------------------------- conversions


def interleave_qkv(q: Tensor, k: Tensor, v: Tensor, spec: ModelSpec) -> Tensor:
    """HF q/k/v (weights ``[out, in]`` or biases ``[out]``) -> megatron ``linear_qkv`` rows, grouped per KV head."""
    g, d = spec.num_key_value_heads, spec.kv_channels
    rest = tuple(q.shape[1:])
    fused = torch.cat(
        [q.reshape(g, spec.heads_per_group * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1
    )
    return fused.reshape(-1, *rest)


def deinterleave_qkv(qkv: Tensor, spec: ModelSpec) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of :func:`interleave_qkv`: megatron ``linear_qkv`` rows -> contiguous HF q, k, v."""
    g, d = spec.num_key_value_heads, spec.kv_channels
    rest = tuple(qkv.shape[1:])
    grouped = qkv.reshape(g, (spec.heads_per_group + 2) * d, *rest)
    q, k, v = torch.split(grouped, [spec.heads_per_group * d, d, d], dim=1)
    return q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(), v.reshape(-1, *rest).contiguous()


def hf_to_megatron(hf_state: Mapping[str, Tensor], spec: ModelSpec) -> dict[str, Tensor]:
    """Convert a full HF state dict to full (TP=1) megatron GPTModel names; raises LayoutError on any mismatch.

    With tied embeddings an ``lm_head.weight`` entry (HF ``state_dict()`` includes it) is accepted and dropped.
    """
    check_megatron_layout(spec)
    state = dict(hf_state)
    if spec.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    tensors = _validate(state, hf_shapes(spec), "HF")
    out: dict[str, Tensor] = {}
    for hf_name, mg_name in _TOP_RENAMES:
        if hf_name in tensors:
            out[mg_name] = tensors[hf_name]
    for i in range(spec.num_hidden_layers):
        hp, mp = _hf_layer(i), _mg_layer(i)
        for hf_suffix, mg_suffix in _layer_renames(spec):
            out[mp + mg_suffix] = tensors[hp + hf_suffix]
        kinds = ("weight", "bias") if spec.attention_bias else ("weight",)
        for kind in kinds:
            q, k, v = (tensors[f"{hp}self_attn.{x}_proj.{kind}"] for x in "qkv")
            out[f"{mp}self_attention.linear_qkv.{kind}"] = interleave_qkv(q, k, v, spec)
        for hf_mlp, mg_mlp in _mlps(spec):
            gate, up = tensors[hp + hf_mlp + "gate_proj.weight"], tensors[hp + hf_mlp + "up_proj.weight"]
            out[mp + mg_mlp + "linear_fc1.weight"] = torch.cat([gate, up], dim=0)
            out[mp + mg_mlp + "linear_fc2.weight"] = tensors[hp + hf_mlp + "down_proj.weight"]
    return out


def megatron_to_hf(mg_state: Mapping[str, Tensor], spec: ModelSpec) -> dict[str, Tensor]:
    """Convert full (TP=1 or merged) megatron GPTModel tensors to HF names; raises LayoutError on any mismatch.

    ``*._extra_state`` entries are skipped. Outputs of QKV/fc1 splits are contiguous; renamed tensors are passed
    through as they are (callers that need independent storage clone them).
    """
    tensors = _validate(mg_state, megatron_shapes(spec), "megatron")
    out: dict[str, Tensor] = {"model.embed_tokens.weight": tensors["embedding.word_embeddings.weight"]}
    for i in range(spec.num_hidden_layers):
        hp, mp = _hf_layer(i), _mg_layer(i)
        out[hp + "input_layernorm.weight"] = tensors[mp + "input_layernorm.weight"]
        kinds = ("weight", "bias") if spec.attention_bias else ("weight",)
        for kind in kinds:
            q, k, v = deinterleave_qkv(tensors[f"{mp}self_attention.linear_qkv.{kind}"], spec)
            for x, t in zip("qkv", (q, k, v), strict=True):
                out[f"{hp}self_attn.{x}_proj.{kind}"] = t
        for hf_suffix, mg_suffix in _layer_renames(spec)[1:]:
            out[hp + hf_suffix] = tensors[mp + mg_suffix]
        for hf_mlp, mg_mlp in _mlps(spec):
            gate, up = torch.chunk(tensors[mp + mg_mlp + "linear_fc1.weight"], 2, dim=0)
            out[hp + hf_mlp + "gate_proj.weight"] = gate.contiguous()
            out[hp + hf_mlp + "up_proj.weight"] = up.contiguous()
            out[hp + hf_mlp + "down_proj.weight"] = tensors[mp + mg_mlp + "linear_fc2.weight"]
    out["model.norm.weight"] = tensors["decoder.final_layernorm.weight"]
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = tensors["output_layer.weight"]
    ordered = list(iter_hf_names(spec))
    return {name: out[name] for name in ordered}


# ------------------------------------------------------------------------------------------------ tensor parallel

_COLUMN_PARALLEL = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")
_ROW_PARALLEL = ("self_attention.linear_proj.weight", "linear_fc2.weight")  # the dense MLP's and each expert's
_VOCAB_PARALLEL = ("embedding.word_embeddings.weight", "output_layer.weight")
_FC1 = "linear_fc1.weight"  # the dense MLP's and each expert's (expert tensor parallelism = TP); the router is whole


def tp_split_dim(mg_name: str) -> int | None:
    """The dimension a megatron tensor is sharded on under TP (``None`` when replicated, e.g. norms)."""
    if mg_name.endswith(_COLUMN_PARALLEL) or mg_name.endswith(_FC1) or mg_name in _VOCAB_PARALLEL:
        return 0
    if mg_name.endswith(_ROW_PARALLEL):
        return 1
    return None


def _chunks(mg_name: str, tensor: Tensor, parts: int, dim: int) -> tuple[Tensor, ...]:
    if tensor.shape[dim] % parts:
        raise LayoutError(f"{mg_name}: dim {dim} of shape {tuple(tensor.shape)} is not divisible by {parts}")
    return torch.chunk(tensor, parts, dim=dim)


def split_for_tp(mg_name: str, tensor: Tensor, tp_size: int, rank: int) -> Tensor:
    """The shard of a full megatron tensor held by TP ``rank`` of ``tp_size`` (contiguous; replicated -> itself).

    Column-parallel ``linear_qkv`` splits rows (whole KV groups per rank, as the rows are grouped); ``linear_fc1``
    splits gate and up separately and concatenates the rank's parts; row-parallel ``linear_proj``/``linear_fc2``
    split columns; embeddings and ``output_layer`` split the vocabulary.
    """
    if not 0 <= rank < tp_size:
        raise LayoutError(f"rank {rank} is out of range for tp_size {tp_size}")
    dim = tp_split_dim(mg_name)
    if tp_size == 1 or dim is None:
        return tensor
    if mg_name.endswith(_FC1):
        gate, up = _chunks(mg_name, tensor, 2, 0)
        return torch.cat([_chunks(mg_name, gate, tp_size, 0)[rank], _chunks(mg_name, up, tp_size, 0)[rank]], dim=0)
    return _chunks(mg_name, tensor, tp_size, dim)[rank].contiguous()


def merge_from_tp(mg_name: str, shards: list[Tensor] | tuple[Tensor, ...]) -> Tensor:
    """Inverse of :func:`split_for_tp`: the full tensor from every rank's shard, in rank order."""
    if not shards:
        raise LayoutError(f"{mg_name}: no shards to merge")
    dim = tp_split_dim(mg_name)
    if len(shards) == 1 or dim is None:
        return shards[0]
    if mg_name.endswith(_FC1):
        halves = [_chunks(mg_name, s, 2, 0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(list(shards), dim=dim)
