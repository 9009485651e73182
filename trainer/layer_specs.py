"""What megatron-core builds a GPT from, adapted to run on CPU: the layer specs (CPU and GPU), the norm class that
allows sequence parallelism, RoPE that stays on the CPU, and the one switch sequence parallelism needs on a CPU-only
build. ``trainer.model`` assembles models from these."""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from trainer.attention import SDPACoreAttention

__all__ = ["CPURotaryEmbedding", "RMSNorm", "block_spec", "collectives_on_cpu", "cpu_layer_spec", "cuda_layer_spec"]


class CPURotaryEmbedding(RotaryEmbedding):
    """``RotaryEmbedding`` whose ``get_emb`` keeps ``inv_freq`` on the device it already lives on."""

    def get_emb(self, max_seq_len: int, offset: int = 0) -> Tensor:
        """RoPE angles ``[s, 1, 1, dim]`` on ``inv_freq``'s device (the base class forces CUDA)."""
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        return emb[:, None, None, :]


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` built the way megatron builds its norms, usable under sequence parallelism (megatron's
    torch-norm wrapper refuses it): the weight is marked ``sequence_parallel`` then, since each TP rank sees only its
    share of the tokens and the weight's gradient is summed over the TP group (``trainer.parallel``)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: object) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]


def cpu_layer_spec(qk_norm: bool = False, num_experts: int | None = None) -> ModuleSpec:
    """megatron's local GPT layer spec (RMSNorm; per-head q/k RMSNorm with ``qk_norm``; routed experts as a
    ``SequentialMLP`` with ``num_experts``) with :class:`SDPACoreAttention` as core attention and :class:`RMSNorm`
    as the norms."""
    layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_norm, num_experts=num_experts)
    layer = layer_spec.submodules
    layer.self_attention.submodules.core_attention = SDPACoreAttention
    layer.input_layernorm = layer.pre_mlp_layernorm = RMSNorm
    if qk_norm:
        layer.self_attention.submodules.q_layernorm = layer.self_attention.submodules.k_layernorm = RMSNorm
    return layer_spec


def block_spec(layer_spec: ModuleSpec, num_layers: int) -> TransformerBlockSubmodules:
    """Every layer from ``layer_spec``, and :class:`RMSNorm` as the final norm (megatron's default for a bare layer
    spec is its torch-norm wrapper)."""
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * num_layers, layer_norm=RMSNorm)


def cuda_layer_spec(kind: str = "auto", qk_norm: bool = False, num_experts: int | None = None) -> ModuleSpec:
    """The GPU layer spec: ``te`` (TransformerEngine), ``local`` (megatron's stock local spec), ``sdpa`` (the CPU spec)
    or ``auto`` (``te`` when transformer_engine imports, else ``local``)."""
    if kind == "auto":
        try:
            import transformer_engine  # noqa: F401

            kind = "te"
        except ImportError:
            kind = "local"
    if kind == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_norm, num_experts=num_experts)
    if kind == "local":
        return get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_norm, num_experts=num_experts)
    if kind == "sdpa":
        return cpu_layer_spec(qk_norm, num_experts)
    raise ValueError(f"unknown layer spec {kind!r}; choose auto, te, local or sdpa")


def collectives_on_cpu() -> None:
    """Sequence parallelism on a CPU-only build: megatron's sequence-parallel collectives (and its global buffer)
    allocate their outputs on ``torch.cuda.current_device()``, which only raises without CUDA; there it names the
    CPU instead. Nothing changes on a machine with CUDA."""
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
