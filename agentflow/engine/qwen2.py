"""A pure-torch Qwen2/Qwen3/Llama decoder (fp32) with a slot-based KV cache, loaded from Hugging Face names.

The model keeps its weights in a flat ``{hf_name: tensor}`` dict (the names a Hugging Face checkpoint and the
trainer's exporter use), so a weight update is a validated, name-by-name ``copy_``. Each layer's q/k/v and gate/up
entries are row views of one fused tensor, so the forward runs one matmul for each group. Three forward paths share one
layer loop and differ only in how attention sees keys and values:

- :meth:`DecoderModel.forward_full`: one sequence, no cache (scoring);
- :meth:`DecoderModel.prefill`: one sequence (or its uncached suffix) written into a cache slot at given positions;
- :meth:`DecoderModel.decode`: one new token for each of a set of slots, each at its own position.

The architecture is :class:`transfer_mesh.layouts.ModelSpec` and a directory is read by :mod:`transfer_mesh.hf`, the
same as the trainer's, so the engine and the trainer agree on what a checkpoint is and on its tensor names and shapes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from transfer_mesh import hf
from transfer_mesh.layouts import ModelSpec, hf_shapes

#: Per-layer attention: (layer index, q [N, heads, hd], k [N, kv_heads, hd], v [N, kv_heads, hd]) -> [N, heads * hd].
AttendFn = Callable[[int, Tensor, Tensor, Tensor], Tensor]


class KVCache:
    """Preallocated keys and values: ``[layers, 2, max_slots, kv_heads, max_len, head_dim]`` (fp32)."""

    def __init__(self, config: ModelSpec, max_slots: int, max_len: int) -> None:
        if max_slots < 1 or max_len < 2:
            raise ValueError(f"need max_slots >= 1 and max_len >= 2, got {max_slots}, {max_len}")
        self.max_slots = max_slots
        self.max_len = max_len
        shape = (config.num_hidden_layers, 2, max_slots, config.num_key_value_heads, max_len, config.kv_channels)
        self.data = torch.zeros(shape, dtype=torch.float32)

    def nbytes(self) -> int:
        """Memory held by the cache."""
        return self.data.numel() * self.data.element_size()


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Hugging Face RMSNorm: ``weight * x / sqrt(mean(x^2) + eps)``."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


Fused = tuple[Tensor, Tensor | None, list[tuple[Tensor, Tensor]]]
"""One layer's fused tensors: ``qkv_w``, ``qkv_b`` and its MLPs as ``(gate_up_w, down_w)``: one for a dense layer,
one per expert (in expert order) for an MoE layer."""


def _fused_storage(config: ModelSpec) -> tuple[dict[str, Tensor], list[Fused]]:
    """Zeroed fp32 parameters by Hugging Face name, where each layer's q/k/v (weights and biases) and each MLP's
    gate/up weights are row views of one tensor; also those fused tensors per layer (:data:`Fused`).

    The names stay the unit of loading and of weight updates (a view's ``copy_`` writes into the fused tensor).
    """
    shapes = hf_shapes(config)
    params: dict[str, Tensor] = {}
    fused: list[Fused] = []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        qkv = [p + f"self_attn.{x}_proj" for x in "qkv"]
        qkv_rows = sum(shapes[n + ".weight"][0] for n in qkv)
        qkv_w = _rows_of(params, torch.zeros(qkv_rows, config.hidden_size), [n + ".weight" for n in qkv], shapes)
        qkv_b = None
        if config.attention_bias:
            qkv_b = _rows_of(params, torch.zeros(qkv_w.shape[0]), [n + ".bias" for n in qkv], shapes)
        mlps = [f"{p}mlp.experts.{j}." for j in range(config.num_experts)] if config.is_moe else [p + "mlp."]
        width = config.moe_intermediate_size if config.is_moe else config.intermediate_size
        pairs = []
        for m in mlps:
            names = [m + "gate_proj.weight", m + "up_proj.weight"]
            gate_up = _rows_of(params, torch.zeros(2 * width, config.hidden_size), names, shapes)
            params[m + "down_proj.weight"] = torch.zeros(shapes[m + "down_proj.weight"])
            pairs.append((gate_up, params[m + "down_proj.weight"]))
        fused.append((qkv_w, qkv_b, pairs))
    for name, shape in shapes.items():
        if name not in params:
            params[name] = torch.zeros(shape)
    return {name: params[name] for name in shapes}, fused


def _rows_of(params: dict[str, Tensor], whole: Tensor, names: list[str], shapes: dict[str, tuple[int, ...]]) -> Tensor:
    """Register consecutive row blocks of ``whole`` as the parameters ``names``; return ``whole``."""
    start = 0
    for name in names:
        rows = shapes[name][0]
        params[name] = whole[start : start + rows]
        start += rows
    return whole


class DecoderModel:
    """A Qwen2/Llama causal LM over a flat dict of fp32 tensors named as in Hugging Face checkpoints."""

    def __init__(self, config: ModelSpec, weights: dict[str, Tensor]) -> None:
        self.config = config
        problem = validate_weights(config, weights)
        if problem:
            raise ValueError(problem)
        self.params, self._fused = _fused_storage(config)
        self.route_log: list[Tensor] | None = None
        """When a list (MoE models): each MoE layer appends the experts it chose, ``[tokens, k]``, in layer order."""
        self.load_(weights)
        hd = config.kv_channels
        self._inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))

    def _p(self, name: str) -> Tensor | None:
        return self.params.get(name)

    @property
    def lm_head(self) -> Tensor:
        """The output projection (the embedding matrix when tied)."""
        key = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        return self.params[key]

    def load_(self, weights: dict[str, Tensor]) -> None:
        """Copy already validated tensors into this model's own storage (no storage is shared with the input)."""
        with torch.no_grad():
            for name, dst in self.params.items():
                dst.copy_(weights[name].detach())

    def _rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[:, None, :], emb.sin()[:, None, :]

    def _layers(self, ids: Tensor, positions: Tensor, attend: AttendFn) -> Tensor:
        """Run every decoder layer on ``N`` tokens; return final-normed hidden states ``[N, hidden]``."""
        c = self.config
        n, nq, nkv = ids.shape[0], c.num_attention_heads, c.num_key_value_heads
        x = F.embedding(ids, self.params["model.embed_tokens.weight"])
        cos, sin = self._rope(positions)
        for i, (qkv_w, qkv_b, mlps) in enumerate(self._fused):
            p = f"model.layers.{i}."
            h = rms_norm(x, self.params[p + "input_layernorm.weight"], c.rms_norm_eps)
            # q, k and v in one matmul, and RoPE on q and k together: at decode batch sizes a step is mostly
            # per-op overhead, so fewer, larger ops are what makes it faster
            qkv = F.linear(h, qkv_w, qkv_b).view(n, nq + 2 * nkv, c.kv_channels)
            qk = qkv[:, : nq + nkv]
            if c.qk_norm:  # Qwen3: each query and key head RMS-normalised before RoPE
                q_w, k_w = self.params[p + "self_attn.q_norm.weight"], self.params[p + "self_attn.k_norm.weight"]
                qk = torch.cat(
                    (rms_norm(qk[:, :nq], q_w, c.rms_norm_eps), rms_norm(qk[:, nq:], k_w, c.rms_norm_eps)), 1
                )
            qk = qk * cos + _rotate_half(qk) * sin
            a = attend(i, qk[:, :nq], qk[:, nq:], qkv[:, nq + nkv :])
            x = x + F.linear(a, self.params[p + "self_attn.o_proj.weight"], self._p(p + "self_attn.o_proj.bias"))
            h = rms_norm(x, self.params[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
            x = x + (self._moe(i, h, mlps) if c.is_moe else _mlp(h, *mlps[0]))
        return rms_norm(x, self.params["model.norm.weight"], c.rms_norm_eps)

    def _moe(self, layer: int, h: Tensor, experts: list[tuple[Tensor, Tensor]]) -> Tensor:
        """Qwen3-MoE's sparse block: softmax router (fp32), top-k experts per token (renormalised with
        ``norm_topk_prob``), each expert's output weighted by its probability and summed."""
        c = self.config
        logits = F.linear(h, self.params[f"model.layers.{layer}.mlp.gate.weight"])
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, c.num_experts_per_tok, dim=-1)
        if c.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.route_log is not None:
            self.route_log.append(chosen.to(torch.int16))
        out = torch.zeros_like(h)
        for j, (gate_up_w, down_w) in enumerate(experts):
            tokens, rank = torch.where(chosen == j)
            if tokens.numel():
                out.index_add_(0, tokens, _mlp(h[tokens], gate_up_w, down_w) * weights[tokens, rank, None])
        return out

    @torch.inference_mode()
    def forward_full(self, ids: Tensor) -> Tensor:
        """Logits ``[T, vocab]`` of one sequence ``[T]`` with plain causal attention and no cache."""
        n = ids.shape[0]

        def attend(_: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
            )
            return out.transpose(0, 1).reshape(n, -1)

        hidden = self._layers(ids, torch.arange(n), attend)
        return F.linear(hidden, self.lm_head)

    @torch.inference_mode()
    def prefill(self, cache: KVCache, slot: int, ids: Tensor, start: int, all_logits: bool = False) -> Tensor:
        """Write ``ids`` (positions ``start..start+T-1``) into ``slot`` of ``cache``, attending to its cached prefix.

        Returns the logits of the last position ``[vocab]``, or of every position ``[T, vocab]`` if ``all_logits``.
        """
        n = ids.shape[0]
        end = start + n
        if n == 0 or start < 0 or end > cache.max_len:
            raise ValueError(f"prefill of {n} tokens at position {start} does not fit max_len {cache.max_len}")
        positions = torch.arange(start, end)
        mask = torch.arange(end)[None, :] <= positions[:, None]

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            kc, vc = cache.data[layer, 0, slot], cache.data[layer, 1, slot]
            kc[:, start:end] = k.transpose(0, 1)
            vc[:, start:end] = v.transpose(0, 1)
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1), kc[:, :end], vc[:, :end], attn_mask=mask, enable_gqa=True
            )
            return out.transpose(0, 1).reshape(n, -1)

        hidden = self._layers(ids, positions, attend)
        return F.linear(hidden if all_logits else hidden[-1], self.lm_head)

    @torch.inference_mode()
    def prefill_batch(self, cache: KVCache, slots: list[int], chunks: list[Tensor], starts: list[int]) -> Tensor:
        """:meth:`prefill` of several slots in one pass; returns each chunk's last-position logits ``[R, vocab]``.

        The projections and MLPs run once over all chunks' tokens; attention runs per chunk against its own slot.
        """
        lens = [int(c.shape[0]) for c in chunks]
        if len(slots) != len(chunks) or len(starts) != len(chunks):
            raise ValueError(f"{len(slots)} slots, {len(chunks)} chunks and {len(starts)} starts differ")
        for start, n in zip(starts, lens, strict=True):
            if n == 0 or start < 0 or start + n > cache.max_len:
                raise ValueError(f"prefill of {n} tokens at position {start} does not fit max_len {cache.max_len}")
        offsets = [0]
        for n in lens:
            offsets.append(offsets[-1] + n)
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens, strict=True)])
        masks = [
            torch.arange(s + n)[None, :] <= torch.arange(s, s + n)[:, None] for s, n in zip(starts, lens, strict=True)
        ]

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            outs = []
            for r, slot in enumerate(slots):
                a, b, start = offsets[r], offsets[r + 1], starts[r]
                end = start + b - a
                kc, vc = cache.data[layer, 0, slot], cache.data[layer, 1, slot]
                kc[:, start:end] = k[a:b].transpose(0, 1)
                vc[:, start:end] = v[a:b].transpose(0, 1)
                out = F.scaled_dot_product_attention(
                    q[a:b].transpose(0, 1), kc[:, :end], vc[:, :end], attn_mask=masks[r], enable_gqa=True
                )
                outs.append(out.transpose(0, 1).reshape(b - a, -1))
            return torch.cat(outs)

        hidden = self._layers(torch.cat(chunks), positions, attend)
        return F.linear(hidden[torch.tensor(offsets[1:]) - 1], self.lm_head)

    @torch.inference_mode()
    def decode(self, cache: KVCache, slots: Tensor, tokens: Tensor, positions: Tensor) -> Tensor:
        """One step for ``B`` slots: token ``tokens[b]`` at ``positions[b]`` in slot ``slots[b]``; logits ``[B, V]``.

        Each slot attends only to its own keys ``0..positions[b]``; keys beyond are masked out.
        """
        b = tokens.shape[0]
        length = int(positions.max()) + 1
        if length > cache.max_len:
            raise ValueError(f"decode position {length - 1} is beyond max_len {cache.max_len}")
        lo, hi = int(slots.min()), int(slots.max()) + 1
        # Attending over the slot range [lo, hi) as a view costs no copy; gathering B slots' keys and values every
        # layer was half of a decode step. Slots in the range that are not decoding get a dummy query (attending
        # to position 0 only, so no row is fully masked) and their outputs are dropped. A sparse range falls back
        # to the gather.
        span = hi - lo <= 2 * b
        # the slots are exactly lo..hi-1 in order: queries need no scatter, outputs no gather
        dense = span and hi - lo == b and torch.equal(slots, torch.arange(lo, hi))
        rows = slots - lo if span else torch.arange(b)
        n_rows = hi - lo if span else b
        bias = None  # additive mask [n_rows, 1, 1, length]; None when every row sees every key (a static batch)
        if not (dense and int(positions.min()) == length - 1):
            row_pos = torch.zeros(n_rows, dtype=torch.long)
            row_pos[rows] = positions
            hidden_keys = torch.arange(length)[None, :] > row_pos[:, None]
            bias = torch.zeros(hidden_keys.shape).masked_fill_(hidden_keys, float("-inf"))[:, None, None, :]
        # Flat row of each (slot, kv head, position) in a layer's key (or value) cache viewed as [-1, head_dim]:
        # one index_copy_ per write instead of advanced-index assignment.
        kvh, max_len = cache.data.shape[3], cache.data.shape[4]
        flat = ((slots * kvh)[:, None] + torch.arange(kvh)[None, :]) * max_len + positions[:, None]
        flat = flat.reshape(-1)

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            kc, vc = cache.data[layer, 0], cache.data[layer, 1]
            kc.view(-1, kc.shape[-1]).index_copy_(0, flat, k.reshape(-1, k.shape[-1]))
            vc.view(-1, vc.shape[-1]).index_copy_(0, flat, v.reshape(-1, v.shape[-1]))
            if dense:
                keys, values, queries = kc[lo:hi, :, :length], vc[lo:hi, :, :length], q
            elif span:
                keys, values = kc[lo:hi, :, :length], vc[lo:hi, :, :length]
                queries = q.new_zeros((n_rows, *q.shape[1:]))
                queries[rows] = q
            else:  # index_select on the sliced view: ~8x faster than advanced indexing on CPU
                keys, values = kc[:, :, :length].index_select(0, slots), vc[:, :, :length].index_select(0, slots)
                queries = q
            out = _decode_attention(queries, keys, values, bias)
            return (out if dense or not span else out[rows]).reshape(b, -1)

        hidden = self._layers(tokens, positions, attend)
        return F.linear(hidden, self.lm_head)


def _mlp(h: Tensor, gate_up_w: Tensor, down_w: Tensor) -> Tensor:
    """A gated SiLU MLP (ModelSpec admits no other activation) with gate and up in one matmul."""
    gate, up = F.linear(h, gate_up_w).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down_w)


def _decode_attention(q: Tensor, keys: Tensor, values: Tensor, bias: Tensor | None) -> Tensor:
    """Attention of one query per row: ``q [R, heads, hd]`` over ``keys``/``values`` ``[R, kv_heads, L, hd]``.

    Two batched matmuls and a softmax, grouped-query heads sharing their key/value head. With a single query per
    row, torch's CPU flash-attention kernel spent ~2x longer than this on per-(row, head) set-up at the lengths of
    our episodes (measured in benchmarks/engine.py; both agree within 1e-6).
    """
    rows, heads, hd = q.shape
    kv_heads = keys.shape[1]
    scores = torch.matmul(q.view(rows, kv_heads, heads // kv_heads, hd), keys.transpose(-1, -2))
    scores.mul_(hd**-0.5)
    if bias is not None:
        scores.add_(bias)
    return torch.matmul(torch.softmax(scores, dim=-1), values).view(rows, heads, hd)


def validate_weights(config: ModelSpec, weights: dict[str, Any], check_finite: bool = True) -> str | None:
    """Check a full set of HF-named tensors against ``config``; return the first problem found, or None.

    Every parameter must be present with its exact shape, floating point and finite; unknown names are
    rejected (``lm_head.weight`` is tolerated, and ignored, for tied embeddings). ``check_finite=False`` skips
    only the finiteness scan (a read of every byte), for callers that already made it on these very tensors.
    """
    expected = hf_shapes(config)
    optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
    unknown = sorted(set(weights) - set(expected) - optional)
    if unknown:
        return f"unknown weight names: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}"
    missing = sorted(set(expected) - set(weights))
    if missing:
        return f"missing weights: {missing[:5]}{' ...' if len(missing) > 5 else ''} ({len(missing)} in all)"
    for name, shape in expected.items():
        t = weights[name]
        if not isinstance(t, Tensor):
            return f"{name}: expected a torch.Tensor, got {type(t).__name__}"
        if tuple(t.shape) != shape:
            return f"{name}: shape {tuple(t.shape)} != expected {shape}"
        if not t.is_floating_point():
            return f"{name}: dtype {t.dtype} is not floating point"
        if check_finite and not (bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())):  # finite sum: all
            return f"{name}: contains NaN or inf"
    for name in optional & set(weights):
        if tuple(weights[name].shape) != expected["model.embed_tokens.weight"]:
            return f"{name}: shape {tuple(weights[name].shape)} does not match the tied embedding"
    return None


def load_hf_dir(path: str | Path) -> DecoderModel:
    """The decoder of a Hugging Face model directory (read by :func:`transfer_mesh.hf.load_hf_dir`; fp32 copies)."""
    config, weights = hf.load_hf_dir(path)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    return DecoderModel(config, weights)


def param_count(config: ModelSpec) -> int:
    """Number of parameters (tied embeddings counted once)."""
    return sum(math.prod(s) for s in hf_shapes(config).values())
