"""Core attention for the CPU layer spec: ``scaled_dot_product_attention``, also over packed (THD) sequences.

megatron's stock ``DotProductAttention`` allocates a CUDA tensor and rejects packed input; this one runs on CPU in
fp32, handles grouped-query attention, and attends causally within each sequence of a packed stream.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from trainer.dist import tp_rank_and_size


class SDPACoreAttention(MegatronModule):
    """Core attention on ``torch.nn.functional.scaled_dot_product_attention`` (CPU-safe, GQA, fp32-exact).

    Inputs follow megatron's layout: query ``[sq, b, np, hn]``, key/value ``[sk, b, ng, hn]``; output
    ``[sq, b, np * hn]``. ``attention_mask`` is megatron's boolean mask (True = masked out), broadcastable to
    ``[b, np, sq, sk]``, or None for plain causal attention. Packed sequences (``packed_seq_params`` in the THD
    layout: query ``[t, np, hn]``, key/value ``[t, ng, hn]``) attend causally within each sequence (one SDPA call per
    run of equal-length sequences), so no work is spent on pairs across sequences; output ``[t, np * hn]``.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: object | None = None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPACoreAttention does not support context parallelism")
        tp = pg_collection.tp.size() if pg_collection is not None else tp_rank_and_size()[1]
        self.heads = config.num_attention_heads // tp
        self.groups = (config.num_query_groups or config.num_attention_heads) // tp
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: object | None = None,
    ) -> Tensor:
        """Attend; causal unless the mask type says otherwise."""
        if attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention does not support attention bias")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        sq, b = query.shape[0], query.shape[1]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if self.heads != self.groups:
            k = k.repeat_interleave(self.heads // self.groups, dim=1)
            v = v.repeat_interleave(self.heads // self.groups, dim=1)
        causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
        dropout = self.dropout_p if self.training else 0.0
        if attention_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout, scale=self.softmax_scale)
        else:
            allowed = ~attention_mask.to(torch.bool)
            if causal:
                allowed = allowed & torch.ones(sq, k.shape[2], dtype=torch.bool, device=q.device).tril()
            # A fully masked row (a padding query) would give NaN: let every query see itself.
            allowed = allowed | torch.eye(sq, k.shape[2], dtype=torch.bool, device=q.device)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, dropout_p=dropout, scale=self.softmax_scale
            )
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    def _packed(self, query: Tensor, key: Tensor, value: Tensor, params: PackedSeqParams) -> Tensor:
        """Causal attention inside each sequence of a THD-packed stream."""
        if params.qkv_format != "thd" or params.cu_seqlens_q_padded is not None:
            raise NotImplementedError("SDPACoreAttention packs sequences in the unpadded THD layout only")
        if self.attn_mask_type != AttnMaskType.causal:
            raise NotImplementedError("SDPACoreAttention packs causal attention only")
        if not torch.equal(params.cu_seqlens_q, params.cu_seqlens_kv):
            raise ValueError("packed queries and keys must share their sequence boundaries")
        if self.heads != self.groups:
            key = key.repeat_interleave(self.heads // self.groups, dim=1)
            value = value.repeat_interleave(self.heads // self.groups, dim=1)
        dropout = self.dropout_p if self.training else 0.0
        cu = params.cu_seqlens_q.tolist()
        runs: list[list[int]] = []  # [length, count] of consecutive sequences of one length: one SDPA call each
        for n in (e - a for a, e in zip(cu[:-1], cu[1:], strict=True)):
            if runs and runs[-1][0] == n:
                runs[-1][1] += 1
            else:
                runs.append([n, 1])
        # split, not slicing: its backward concatenates, where each slice's would fill a full-size zero gradient;
        # 4-d [count, heads, n, hn] pieces take torch's CPU flash kernel (3-d ones fall back to the math path)
        parts = []
        pieces = (t.split([n * m for n, m in runs]) for t in (query, key, value))
        for (n, m), *qkv in zip(runs, *pieces, strict=True):
            q, k, v = (t.reshape(m, n, *t.shape[1:]).transpose(1, 2) for t in qkv)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, scale=self.softmax_scale)
            parts.append(out.transpose(1, 2).reshape(m * n, -1))  # [m * n, heads * hn]
        return torch.cat(parts)
