"""Model provider: megatron-core ``GPTModel`` (local layer spec) for Llama/Qwen2, runnable on CPU, plus HF I/O.

Three patch-free adaptations make megatron-core 0.16.1 run on CPU (docs/decisions.md):

1. the RNG tracker is megatron's no-op inference tracker (dropout is 0 everywhere);
2. the spec's ``core_attention`` is :class:`SDPACoreAttention` (stock ``DotProductAttention`` allocates a CUDA
   scratch buffer; ``get_default_causal_mask`` defaults to CUDA);
3. ``model.rotary_pos_emb`` is :class:`CPURotaryEmbedding` (the stock one moves ``inv_freq`` to CUDA).

Sequence parallelism (an MoE model under TP > 1) needs one patch: megatron's sequence-parallel collectives allocate
on ``torch.cuda.current_device()``, which a CPU-only build answers with the CPU in trainer processes
(:func:`trainer.layer_specs.collectives_on_cpu`); the norms are ``trainer.layer_specs.RMSNorm``, and sequences are
padded to a multiple of the TP size. The layer specs and these adaptations live in :mod:`trainer.layer_specs`.

Packed micro-batches (``trainer.batching.Packing``) run in megatron's THD layout: ``PackedSeqParams`` makes RoPE
restart at every sequence and :class:`SDPACoreAttention` attends within each one (on GPU also TransformerEngine's
attention; megatron's local ``DotProductAttention`` cannot, see :func:`supports_packing`).

Weights cross the HF boundary only through ``transfer_mesh.layouts``. Under TP > 1 every rank loads the full HF
state and keeps its shard; export all-gathers shards over the TP group.

GPU path (``device="cuda"``; run on one GPU with the local spec in fp32, not yet with TransformerEngine or bf16):
megatron's stock modules on CUDA (the TransformerEngine spec when ``transformer_engine`` imports, else the local
spec), optional bf16 through megatron's ``Float16Module``; Megatron DDP and the distributed optimizer wrap the model
in :mod:`trainer.gpu`. Inputs may stay on the CPU: the model's device is used for the forward pass and log-probs
come back on the inputs' device. The CPU path is unchanged.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.transformer_config import TransformerConfig
from safetensors.torch import save_file
from torch import Tensor

from trainer import moe
from trainer.attention import SDPACoreAttention
from trainer.batching import Packing, VocabMasks
from trainer.dist import ep_rank_and_size, etp_rank_and_size, init_distributed_cpu, is_rank_zero, tp_rank_and_size
from trainer.layer_specs import (
    CPURotaryEmbedding,
    block_spec,
    collectives_on_cpu,
    cpu_layer_spec,
    cuda_layer_spec,
)
from transfer_mesh import hf
from transfer_mesh.layouts import (
    LayoutError,
    ModelSpec,
    check_megatron_layout,
    hf_to_megatron,
    megatron_shapes,
    megatron_to_hf,
    merge_from_tp,
    split_for_tp,
    tp_split_dim,
)

__all__ = [
    "CPURotaryEmbedding",
    "SDPACoreAttention",
    "build_gpt_model",
    "export_hf_state",
    "full_megatron_state",
    "init_distributed_cpu",
    "load_hf_dir",
    "load_into_model",
    "make_transformer_config",
    "model_parameters",
    "save_hf_dir",
    "token_logprobs",
    "token_logprobs_and_entropy",
]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


# ------------------------------------------------------------------------------------------------- building


def make_transformer_config(spec: ModelSpec, device: str = "cpu", bf16: bool = False) -> TransformerConfig:
    """The megatron TransformerConfig of a Llama/Qwen2/Qwen3 spec: fp32, no dropout, no fusions, CPU initialization.

    On ``cuda``: optionally bf16, and ``calculate_per_token_loss`` so that Megatron DDP *sums* gradients over DP
    ranks (every rank's loss is already divided by the global token count).
    """
    check_megatron_layout(spec)  # a spec built by hand, not read by load_hf_dir, is checked here
    tp = tp_rank_and_size()[1]
    on_cuda = device == "cuda"
    return TransformerConfig(
        num_layers=spec.num_hidden_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.intermediate_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_key_value_heads,
        kv_channels=spec.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.attention_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=not on_cuda,
        params_dtype=torch.bfloat16 if on_cuda and bf16 else torch.float32,
        bf16=on_cuda and bf16,
        fp16=False,
        attention_softmax_in_fp32=True,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        calculate_per_token_loss=on_cuda,
        tensor_model_parallel_size=tp,
        # megatron runs an MoE layer under TP only with sequence parallelism (hidden states split along the sequence
        # between the layers); dense models keep whole sequences on every rank
        sequence_parallel=spec.is_moe and tp > 1,
        **_moe_config(spec),
    )


def _moe_config(spec: ModelSpec) -> dict[str, object]:
    """Megatron's MoE settings for a Qwen3-MoE spec (nothing for a dense one): softmax router in fp32, top-k; the
    softmax before the top-k keeps the full softmax's probabilities, after it renormalises them over the chosen
    experts (``norm_topk_prob``). No load-balancing loss (RL and distillation do not add one), the all-gather
    dispatcher (the all-to-all one needs CUDA streams), no grouped GEMM (each expert is a plain MLP). Expert
    parallelism as :func:`trainer.dist.init_distributed` set it up."""
    ep = ep_rank_and_size()[1]
    if not spec.is_moe:
        if ep > 1:
            raise ValueError(f"expert parallelism (ep={ep}) needs a mixture-of-experts model; this one is dense")
        return {}
    if spec.num_experts % ep:
        raise ValueError(f"{spec.num_experts} experts cannot be spread evenly over ep={ep} expert-parallel ranks")
    return {
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": etp_rank_and_size()[1],
        "num_moe_experts": spec.num_experts,
        "moe_router_topk": spec.num_experts_per_tok,
        "moe_ffn_hidden_size": spec.moe_intermediate_size,
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not spec.norm_topk_prob,
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_token_dispatcher_type": "allgather",
        "moe_grouped_gemm": False,
    }


def build_gpt_model(
    spec: ModelSpec, seed: int = 0, device: str = "cpu", bf16: bool = False, layer_spec: str = "auto"
) -> torch.nn.Module:
    """An fp32 ``GPTModel`` for ``spec`` (random init from ``seed``); call init_distributed_cpu first.

    ``device="cpu"`` (default): the CPU-runnable model. ``device="cuda"``: built by :func:`_build_cuda_model`
    (``layer_spec`` as in :func:`cuda_layer_spec`; ``bf16`` wraps it in megatron's ``Float16Module``).
    """
    if device == "cuda":
        return _build_cuda_model(spec, seed, bf16, layer_spec)
    if device != "cpu":
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)
    config = make_transformer_config(spec)
    if config.sequence_parallel:
        collectives_on_cpu()
    layers = cpu_layer_spec(spec.qk_norm, spec.num_experts or None)
    model = GPTModel(
        config=config,
        transformer_layer_spec=block_spec(layers, spec.num_hidden_layers),
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.max_position_embeddings,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=spec.rope_theta,
    )
    model.rotary_pos_emb = CPURotaryEmbedding(
        kv_channels=config.kv_channels,
        rotary_percent=1.0,
        rotary_interleaved=config.rotary_interleaved,
        rotary_base=spec.rope_theta,
        use_cpu_initialization=True,
        cp_group=model.pg_collection.cp,
    )
    moe.install(model, on_cpu=True)
    return model


def _build_cuda_model(spec: ModelSpec, seed: int, bf16: bool, layer_spec: str) -> torch.nn.Module:
    """GPTModel on the current CUDA device with megatron's stock RNG tracker and modules."""
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    config = make_transformer_config(spec, device="cuda", bf16=bf16)
    model = GPTModel(
        config=config,
        transformer_layer_spec=cuda_layer_spec(layer_spec, spec.qk_norm, spec.num_experts or None),
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.max_position_embeddings,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=spec.rope_theta,
    )
    if layer_spec == "sdpa":
        model.rotary_pos_emb = CPURotaryEmbedding(
            kv_channels=config.kv_channels,
            rotary_percent=1.0,
            rotary_interleaved=config.rotary_interleaved,
            rotary_base=spec.rope_theta,
            use_cpu_initialization=False,
            cp_group=model.pg_collection.cp,
        )
    model = model.cuda(torch.cuda.current_device())
    moe.install(model, on_cpu=False)
    if bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    return model


# ------------------------------------------------------------------------------------------- weights in / out


def load_hf_dir(path: str | Path) -> tuple[ModelSpec, dict[str, Tensor]]:
    """Read an HF model directory (:func:`transfer_mesh.hf.load_hf_dir`: tensors as stored) that the trainer can
    build: a model megatron cannot hold is refused here, before any model is built."""
    spec, state = hf.load_hf_dir(path)
    check_megatron_layout(spec)
    return spec, state


# TransformerEngine fuses the norms into the next linear layer: its names -> the local spec's (the layouts' names).
_TE_RENAMES = (
    ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
)


def supports_packing(model: torch.nn.Module) -> bool:
    """Whether the model's core attention takes packed (THD) sequences: :class:`SDPACoreAttention` (the CPU spec)
    or TransformerEngine's; megatron's local ``DotProductAttention`` does not."""
    layers = unwrap_model(model).decoder.layers
    core = type(layers[0].self_attention.core_attention) if len(layers) else SDPACoreAttention
    return issubclass(core, SDPACoreAttention) or core.__name__ == "TEDotProductAttention"


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside Megatron's DDP and ``Float16Module`` wrappers (the model itself when unwrapped)."""
    while not isinstance(model, GPTModel) and isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def model_parameters(model: torch.nn.Module) -> dict[str, Tensor]:
    """The model's parameters by local-spec megatron name, through wrappers and TE's fused-norm names.

    Tied output weights appear once, as the embedding.
    """
    out = {}
    for name, p in unwrap_model(model).named_parameters():
        if p is None:
            continue
        for te_suffix, local_suffix in _TE_RENAMES:
            if name.endswith(te_suffix):
                name = name[: -len(te_suffix)] + local_suffix
        out[name] = p
    return out


#: A routed expert's parameter: (prefix, expert index, suffix). Global names index experts 0..num_experts-1; a
#: rank's own parameters index its local experts 0..num_experts/ep-1 (megatron's ``SequentialMLP``).
_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..+)$")


def _placement(name: str, spec: ModelSpec) -> tuple[str, int, int] | None:
    """Where this rank holds the global megatron parameter ``name``: ``(local name, split size, split rank)`` (a
    routed expert is split over the expert-TP ranks, the rest over TP), or None when another EP rank holds it."""
    m = _EXPERT.match(name)
    if m is None:
        rank, size = tp_rank_and_size()
        return name, size, rank
    ep_rank, ep = ep_rank_and_size()
    owner, j = divmod(int(m.group(2)), spec.num_experts // ep)
    if owner != ep_rank:
        return None
    etp_rank, etp = etp_rank_and_size()
    return f"{m.group(1)}{j}{m.group(3)}", etp, etp_rank


def load_into_model(model: torch.nn.Module, hf_state: dict[str, Tensor], spec: ModelSpec) -> None:
    """Copy a full HF state into the model (this rank's TP shard and, under EP, its experts), casting to the
    parameters' dtype."""
    full = hf_to_megatron(hf_state, spec)
    params = model_parameters(model)
    placed = {}
    for name, tensor in full.items():
        where = _placement(name, spec)
        if where is not None:
            placed[where[0]] = (name, tensor, where[1], where[2])
    problems = [f"model has no parameter {n}" for n in placed if n not in params]
    problems += [f"no value for model parameter {n}" for n in params if n not in placed]
    if problems:
        raise LayoutError("; ".join(problems))
    with torch.no_grad():
        for local, (name, tensor, size, rank) in placed.items():
            shard = split_for_tp(name, tensor, size, rank)
            if shard.shape != params[local].shape:
                raise LayoutError(f"{name}: shard shape {tuple(shard.shape)} != parameter {tuple(params[local].shape)}")
            params[local].copy_(shard)


def _gather_tp(name: str, tensor: Tensor, size: int, group: object = None) -> Tensor:
    """Full tensor from this rank's shard, all-gathered over ``group`` of ``size`` ranks (default: megatron's TP
    group); a replicated tensor is returned as it is."""
    if size == 1 or tp_split_dim(name) is None:
        return tensor
    from megatron.core import parallel_state

    group = group or parallel_state.get_tensor_model_parallel_group()
    shards = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    return merge_from_tp(name, shards)


def full_megatron_state(
    model: torch.nn.Module, spec: ModelSpec, values: dict[str, Tensor] | None = None
) -> dict[str, Tensor]:
    """The whole model's tensors under global megatron names, gathered from every rank: its parameters, or
    ``values`` (tensors shaped like them, such as their gradients, by the rank's own names). Collective under TP."""
    from megatron.core import parallel_state

    expected = megatron_shapes(spec)
    tp, ep, etp = tp_rank_and_size()[1], ep_rank_and_size()[1], etp_rank_and_size()[1]
    out = {}
    for name, param in model_parameters(model).items():
        tensor = (param if values is None else values[name]).detach()
        m = _EXPERT.match(name)
        if m is None:
            if name in expected:
                out[name] = _gather_tp(name, tensor, tp)
            continue
        whole = _gather_tp(name, tensor, etp, parallel_state.get_expert_tensor_parallel_group())
        peers = [whole]
        if ep > 1:  # each EP rank holds other experts: gather them all
            peers = [torch.empty_like(whole) for _ in range(ep)]
            dist.all_gather(peers, whole.contiguous(), group=parallel_state.get_expert_model_parallel_group())
        local = spec.num_experts // ep
        for owner, expert in enumerate(peers):
            out[f"{m.group(1)}{owner * local + int(m.group(2))}{m.group(3)}"] = expert
    return out


def export_hf_state(model: torch.nn.Module, spec: ModelSpec) -> dict[str, Tensor]:
    """The model's full weights under HF names: fp32 CPU tensors, detached clones that share no storage with the model.

    Collective under TP > 1 (every TP rank must call it).
    """
    hf = megatron_to_hf(full_megatron_state(model, spec), spec)
    return {name: _cpu_fp32_copy(t) for name, t in hf.items()}


def _cpu_fp32_copy(t: Tensor) -> Tensor:
    """A contiguous fp32 CPU tensor with its own storage."""
    if t.device.type == "cpu":
        return t.detach().to(torch.float32).clone(memory_format=torch.contiguous_format)
    return t.detach().to(device="cpu", dtype=torch.float32).contiguous()


def save_hf_dir(model: GPTModel, spec: ModelSpec, src_dir: str | Path, out_dir: str | Path) -> Path:
    """Write an HF directory: ``config.json`` (copied from ``src_dir``), ``model.safetensors`` and tokenizer files.

    Collective under TP > 1; only global rank 0 writes. Returns ``out_dir``.
    """
    src, out = Path(src_dir), Path(out_dir)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in source HF directory {src}")
    state = export_hf_state(model, spec)
    if not is_rank_zero():
        return out
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src / "config.json", out / "config.json")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    return out


# ------------------------------------------------------------------------------------------------ log-probs


def _logits(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
    """fp32 logits ``[b, s, v/tp]`` of a right-padded batch (positions 0..s-1, causal attention), on the model's
    device."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    if attention_mask is not None:
        mask = attention_mask.to(torch.bool)
        if mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask shape {tuple(mask.shape)} != input_ids {tuple(input_ids.shape)}")
        if (mask[:, 1:] & ~mask[:, :-1]).any():
            raise ValueError("attention_mask must be right-padded (ones, then zeros)")
    b, s = input_ids.shape
    device = next(model.parameters()).device
    if input_ids.device != device:
        input_ids = input_ids.to(device)
    pad = -s % _sequence_multiple(model)  # padding after the last position changes no earlier one (causal)
    if pad:
        input_ids = F.pad(input_ids, (0, pad))
    position_ids = torch.arange(s + pad, device=input_ids.device).unsqueeze(0).expand(b, s + pad)
    logits = model(input_ids, position_ids, attention_mask=None)
    return logits[:, :s].float()


def _sequence_multiple(model: torch.nn.Module) -> int:
    """What the sequence length must be a multiple of: the TP size under sequence parallelism (each rank holds an
    equal share of the positions), else 1."""
    config = unwrap_model(model).config
    return config.tensor_model_parallel_size if config.sequence_parallel else 1


def _stream_logits(model: torch.nn.Module, packing: Packing) -> Tensor:
    """fp32 logits ``[1, T, v/tp]`` of a packed stream: megatron's THD layout (``PackedSeqParams``), so RoPE
    positions restart at every row and attention stays inside it. Runs on the model's device."""
    device = next(model.parameters()).device
    cu = packing.cu_seqlens.to(device)
    n = packing.max_seqlen
    ids, pos = packing.input_ids.to(device), packing.position_ids.to(device)
    tokens = ids.shape[1]
    pad = -tokens % _sequence_multiple(model)
    if pad:  # a row of padding after the stream's last one (it attends only to itself)
        ids, pos = F.pad(ids, (0, pad)), F.pad(pos, (0, pad))
        cu, n = torch.cat([cu, cu[-1:] + pad]), max(n, pad)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=n, max_seqlen_kv=n)
    return model(ids, pos, attention_mask=None, packed_seq_params=params)[:, :tokens].float()


def _target_logits(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    vocab_masks: VocabMasks | None,
    packing: Packing | None,
) -> tuple[Tensor, Tensor]:
    """Restricted target-aligned logits and their target ids, on the model's device: over the ``[b, s-1]`` grid of
    ``input_ids``, or with ``packing`` over the ``[1, T-1]`` positions of its stream."""
    if packing is None:
        logits = restrict(_logits(model, input_ids, attention_mask)[:, :-1], vocab_masks)
        return logits, input_ids[:, 1:].to(logits.device)
    logits = restrict(_stream_logits(model, packing)[:, :-1], packing.stream_masks(vocab_masks))
    return logits, packing.input_ids[:, 1:].to(logits.device)


def _on_grid(values: Tensor, input_ids: Tensor, attention_mask: Tensor | None, packing: Packing | None) -> Tensor:
    """Per-target values on the grid of ``input_ids`` (its device), zero where the target is padding."""
    if packing is not None:
        return packing.to_grid(values).to(input_ids.device)
    return _mask_targets(values.to(input_ids.device), attention_mask)


#: Logit given to tokens outside a restricted vocabulary: finite, so a TP shard with no allowed token does not turn
#: the vocab-parallel max into NaN; exp() of it is exactly 0 in fp32.
_MASKED_LOGIT = -1e30


def restrict(logits: Tensor, vocab_masks: VocabMasks | None) -> Tensor:
    """``logits [b, s-1, v/tp]`` with disallowed tokens pushed to :data:`_MASKED_LOGIT` at the masked positions
    (out of place and differentiable; under TP this rank's vocab slice of each mask)."""
    if vocab_masks is None:
        return logits
    rank, size = tp_rank_and_size()
    width = logits.shape[-1]
    ok = vocab_masks.allowed(rank * width if size > 1 else 0, width).to(logits.device)
    rows, cols = vocab_masks.rows.to(logits.device), vocab_masks.cols.to(logits.device)
    picked = logits[rows, cols].masked_fill(~ok, _MASKED_LOGIT)
    return logits.index_put((rows, cols), picked)


def _mask_targets(values: Tensor, attention_mask: Tensor | None) -> Tensor:
    """Zero the entries whose target token is padding."""
    if attention_mask is None:
        return values
    return values * attention_mask[:, 1:].to(values.dtype)


class _GatherLastDim(torch.autograd.Function):
    """All-gather vocab shards along the last dim over the TP group; backward keeps this rank's slice.

    megatron's ``gather_from_tensor_model_parallel_region`` allocates its output on CUDA, hence this CPU-safe twin.
    """

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, shard: Tensor) -> Tensor:
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
        ctx.rank, ctx.width = dist.get_rank(group), shard.shape[-1]
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, shard.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> Tensor:
        return grad.narrow(-1, ctx.rank * ctx.width, ctx.width).contiguous()


def token_logprobs(
    model: GPTModel,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    temperature: float = 1.0,
    vocab_masks: VocabMasks | None = None,
    packing: Packing | None = None,
) -> Tensor:
    """``log p(ids[:, t+1] | ids[:, :t+1])`` as fp32 ``[b, s-1]``; zero where the target is right padding.

    ``temperature`` divides the logits first, so the result matches the engine's behaviour log-probs of tokens
    sampled at that temperature (after temperature, before top-k/top-p; docs/architecture.md). Differentiable;
    vocab-parallel under TP (megatron's ``vocab_parallel_cross_entropy``). ``vocab_masks``: positions whose token
    was drawn from a restricted vocabulary (structured output) get the log-prob of that restricted distribution.
    ``packing`` (``trainer.batching.Packing`` of these rows): the model runs on the padding-free stream instead,
    with the same result on the same grid.
    """
    logits, targets = _target_logits(model, input_ids, attention_mask, vocab_masks, packing)
    if temperature != 1.0:
        logits = logits / temperature
    if tp_rank_and_size()[1] > 1:
        logp = -tensor_parallel.vocab_parallel_cross_entropy(logits.contiguous(), targets.contiguous())
    else:
        logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return _on_grid(logp, input_ids, attention_mask, packing)


def token_logprobs_at(
    model: GPTModel,
    input_ids: Tensor,
    extra_ids: Tensor,
    attention_mask: Tensor | None = None,
    vocab_masks: VocabMasks | None = None,
    packing: Packing | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-token log-probs (as :func:`token_logprobs`, temperature 1) and the log-probs of ``extra_ids``
    ``[b, s-1, k]`` at each position (the teacher's top-k tokens, for a top-k KL). Vocab shards are gathered
    under TP."""
    logits, targets = _target_logits(model, input_ids, attention_mask, vocab_masks, packing)
    if tp_rank_and_size()[1] > 1:
        logits = _GatherLastDim.apply(logits)
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if packing is None:
        extra = logp_all.gather(-1, extra_ids.to(logits.device)).to(input_ids.device)
    else:
        extra = packing.to_grid(logp_all.gather(-1, packing.to_stream(extra_ids.to(logits.device))))
    return _on_grid(logp, input_ids, attention_mask, packing), extra.to(input_ids.device)


def token_logprobs_and_entropy(
    model: GPTModel,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    vocab_masks: VocabMasks | None = None,
    packing: Packing | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-token log-probs (as :func:`token_logprobs`) and the entropy of each next-token distribution, ``[b, s-1]``.

    Under TP the vocab shards are all-gathered (differentiably) before the softmax.
    """
    logits, targets = _target_logits(model, input_ids, attention_mask, vocab_masks, packing)
    if tp_rank_and_size()[1] > 1:
        logits = _GatherLastDim.apply(logits)
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return _on_grid(logp, input_ids, attention_mask, packing), _on_grid(entropy, input_ids, attention_mask, packing)
