"""Full-vocabulary distillation: frozen teachers inside the trainer, divergences computed in position chunks.

The full-vocabulary estimators (``full_rkl``, ``full_fkl``, ``jsd``; ``trainer/losses.py``) need the teacher's whole
next-token distribution at every model token. Shipping it from a teacher engine would cost ``tokens x vocab`` floats
per sample (151,936 per token for Qwen), so the trainer loads each teacher itself (a frozen megatron ``GPTModel`` of
the same vocabulary, built like the student: same layer spec, tensor parallelism and packing) and evaluates it on
the micro-batch the student trains on.

Memory stays bounded by the chunk size, not by the micro-batch: both models run up to their final hidden states
(``[tokens, hidden]``), and the output layers, softmaxes and divergence run over chunks of ``chunk`` target
positions. Each chunk sits inside an activation checkpoint, so the ``[chunk, vocab]`` tensors are freed when the
chunk is done and recomputed, one chunk at a time, in backward; gradients flow only through the student. The same
chunks give the student's log-probs of the target tokens (what the policy loss needs), the teacher's (for metrics)
and, optionally, the student's entropy, so the micro-batch needs no other forward pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from trainer.batching import Packing, VocabMasks, pack_rows
from trainer.dist import tp_rank_and_size
from trainer.model import _GatherLastDim, build_gpt_model, load_hf_dir, load_into_model, restrict, unwrap_model
from transfer_mesh.layouts import ModelSpec

Divergence = Callable[[Tensor, Tensor, float], Tensor]
"""``(student_logp [c, V], teacher_logp [c, V], beta) -> [c]``: a full-vocabulary estimator of the registry."""


def load_teachers(
    dirs: Mapping[str, str | Path],
    student: ModelSpec,
    seed: int = 0,
    device: str = "cpu",
    bf16: bool = False,
    layer_spec: str = "auto",
) -> dict[str, torch.nn.Module]:
    """Each teacher directory as a frozen model (eval mode, no gradients) built like the student's.

    A teacher whose vocabulary differs from the student's is refused (the divergences compare distributions over one
    vocabulary; the job's pre-flight check has already proved the tokenizers identical). Building a model reseeds
    torch, so the trainer's RNG state is kept as it was.
    """
    models = {}
    for name, path in dirs.items():
        spec, state = load_hf_dir(path)
        if spec.vocab_size != student.vocab_size:
            raise ValueError(
                f"teacher {name!r} ({path}) has a vocabulary of {spec.vocab_size} tokens, the student "
                f"{student.vocab_size}: the full-vocabulary distillation estimators need one vocabulary"
            )
        cuda = [torch.cuda.current_device()] if device == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            model = build_gpt_model(spec, seed, device, bf16=bf16, layer_spec=layer_spec)
        load_into_model(model, state, spec)
        model.eval()
        model.requires_grad_(False)
        models[name] = model
    return models


def teacher_groups(
    names: list[str], teachers: Mapping[str, torch.nn.Module]
) -> list[tuple[torch.nn.Module, list[int]]]:
    """The micro-batch's rows grouped by teacher (``names``: each row's ``Sample.teacher``; empty: the only one)."""
    if not teachers:
        raise ValueError("the full-vocabulary distillation loss needs teacher models in the trainer: settings.teachers")
    groups: dict[str, list[int]] = {}
    for r, name in enumerate(names):
        if not name:
            if len(teachers) != 1:
                raise ValueError(f"a row names no teacher and the trainer holds several: {sorted(teachers)}")
            name = next(iter(teachers))
        if name not in teachers:
            raise ValueError(f"a row names teacher {name!r}, which the trainer does not hold: {sorted(teachers)}")
        groups.setdefault(name, []).append(r)
    return [(teachers[n], rows) for n, rows in groups.items()]


@dataclass
class FullVocabTerms:
    """What the chunks give, each on the micro-batch's target grid ``[b, s-1]`` (zero at padding)."""

    logp: Tensor
    """The student's log-probs of the target tokens (differentiable)."""
    divergence: Tensor
    """The estimator between the student's and the teacher's full distributions (differentiable through the
    student)."""
    teacher_logp: Tensor
    """The teacher's log-probs of the target tokens (detached)."""
    entropy: Tensor | None = None
    """The student's entropy at each position, when asked for (differentiable)."""


@contextmanager
def _hidden_output(model: torch.nn.Module) -> Iterator[None]:
    """Make ``model``'s forward return its final hidden states (after the last norm) instead of logits."""
    gpt = unwrap_model(model)
    was = gpt.post_process
    gpt.post_process = False
    try:
        yield
    finally:
        gpt.post_process = was


def final_hidden(
    model: torch.nn.Module, input_ids: Tensor, lengths: Tensor, packing: Packing | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Final hidden states ``[N, h]`` at the real target positions of right-padded rows ``input_ids [b, s]``
    (row-major: row 0's positions first), and their grid ``rows``/``cols``. With ``packing`` the model runs on its
    stream (THD layout), else on the padded grid."""
    device = next(model.parameters()).device
    with _hidden_output(model):
        if packing is None:
            b, s = input_ids.shape
            position_ids = torch.arange(s, device=device).unsqueeze(0).expand(b, s)
            h = model(input_ids.to(device), position_ids, attention_mask=None)  # [s, b, h]
            on = torch.arange(s - 1) < (lengths[:, None] - 1)
            rows, cols = on.nonzero(as_tuple=True)
            return h[:-1].transpose(0, 1)[rows.to(device), cols.to(device)], rows, cols
        cu = packing.cu_seqlens.to(device)
        n = packing.max_seqlen
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=n, max_seqlen_kv=n)
        ids, pos = packing.input_ids.to(device), packing.position_ids.to(device)
        h = model(ids, pos, attention_mask=None, packed_seq_params=params)  # [T, 1, h]
        return h[:-1, 0][packing.index.to(device)], packing.rows, packing.cols


def _head(model: torch.nn.Module, hidden: Tensor, masks: VocabMasks | None) -> Tensor:
    """Logits ``[c, V]`` (fp32, or the model's dtype when wider) of hidden states ``[c, h]``: the output layer (tied or
    not), the restriction of ``masks`` (positions ``cols`` of this chunk), the vocab shards gathered under TP."""
    gpt = unwrap_model(model)
    weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
    dtype = (weight if weight is not None else gpt.output_layer.weight).dtype
    logits, _ = gpt.output_layer(hidden.unsqueeze(1).to(dtype), weight=weight)  # [c, 1, V/tp]
    logits = logits.transpose(0, 1)
    logits = restrict(logits if logits.dtype == torch.float64 else logits.float(), masks)[0]
    return _GatherLastDim.apply(logits) if tp_rank_and_size()[1] > 1 else logits


def _chunk(
    student_h: Tensor,
    teacher_h: Tensor,
    targets: Tensor,
    masks: VocabMasks | None,
    student: torch.nn.Module,
    teacher: torch.nn.Module,
    divergence: Divergence,
    beta: float,
    entropy: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One chunk's divergence, target log-probs (student, teacher) and entropy, each ``[c]``."""
    logp_s = torch.log_softmax(_head(student, student_h, masks), dim=-1)
    with torch.no_grad():
        logp_t = torch.log_softmax(_head(teacher, teacher_h, masks), dim=-1)
    div = divergence(logp_s, logp_t, beta)
    pick = targets.unsqueeze(-1)
    ent = -(logp_s.exp() * logp_s).sum(-1) if entropy else div.new_zeros(div.shape)
    return div, logp_s.gather(-1, pick).squeeze(-1), logp_t.gather(-1, pick).squeeze(-1), ent


def _chunk_masks(masks: VocabMasks | None, flat: Tensor, local: Tensor) -> VocabMasks | None:
    """``masks`` restricted to one chunk: ``local[j]`` is flat position ``j``'s index in the chunk, else -1."""
    if masks is None:
        return None
    at = local[flat[masks.rows, masks.cols]]
    keep = at >= 0
    if not bool(keep.any()):
        return None
    return VocabMasks(torch.zeros_like(at[keep]), at[keep], masks.bits[keep])


def full_vocab_terms(
    model: torch.nn.Module,
    groups: list[tuple[torch.nn.Module, list[int]]],
    input_ids: Tensor,
    lengths: Tensor,
    divergence: Divergence,
    beta: float = 0.5,
    chunk: int = 1024,
    vocab_masks: VocabMasks | None = None,
    packing: Packing | None = None,
    entropy: bool = False,
) -> FullVocabTerms:
    """The student's target log-probs and its divergence from each row's teacher (``groups``: teacher, rows), over
    chunks of at most ``chunk`` target positions of one teacher.

    ``input_ids [b, s]`` are right-padded rows of true ``lengths``; ``packing``, when given, is their stream (both
    models then run packed). ``vocab_masks`` restrict both distributions at their positions (renormalised over the
    allowed tokens). Results are on the ``[b, s-1]`` grid, on ``input_ids``' device.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    b, s = input_ids.shape
    hidden, rows, cols = final_hidden(model, input_ids, lengths, packing)
    device = hidden.device
    flat = torch.full((b, s - 1), -1, dtype=torch.long)
    flat[rows, cols] = torch.arange(rows.numel())
    targets = input_ids[:, 1:][rows, cols].to(device)
    grad = torch.is_grad_enabled() and hidden.requires_grad
    order, outs = [], []
    for teacher, members in groups:
        sel = sorted(members)
        picked = torch.tensor(sel, dtype=torch.long)
        positions = torch.isin(rows, picked).nonzero(as_tuple=True)[0]  # row-major, as the teacher's below
        with torch.no_grad():
            if packing is not None and len(sel) == b:
                sub_pack: Packing | None = packing
            elif packing is not None:
                sub_pack = pack_rows(input_ids[picked], lengths[picked])
            else:
                sub_pack = None
            longest = int(lengths[picked].max())
            teacher_h, _, _ = final_hidden(teacher, input_ids[picked, :longest], lengths[picked], sub_pack)
        teacher_h = teacher_h.to(device)
        for lo in range(0, positions.numel(), chunk):
            at = positions[lo : lo + chunk]
            local = torch.full((rows.numel(),), -1, dtype=torch.long)
            local[at] = torch.arange(at.numel())
            args = (hidden[at.to(device)], teacher_h[lo : lo + chunk], targets[at.to(device)])
            masks = _chunk_masks(vocab_masks, flat, local)
            if grad:
                out = checkpoint(_chunk, *args, masks, model, teacher, divergence, beta, entropy, use_reentrant=False)
            else:
                out = _chunk(*args, masks, model, teacher, divergence, beta, entropy)
            order.append(at)
            outs.append(out)
    if not outs:  # no row has a target
        zeros = torch.zeros(b, s - 1, device=input_ids.device)
        return FullVocabTerms(zeros, zeros.clone(), zeros.clone(), zeros.clone() if entropy else None)
    where = torch.cat(order)
    idx = (rows[where].to(device), cols[where].to(device))

    def grid(k: int) -> Tensor:
        values = torch.cat([o[k] for o in outs])
        return values.new_zeros(b, s - 1).index_put(idx, values).to(input_ids.device)

    return FullVocabTerms(grid(1), grid(0), grid(2).detach(), grid(3) if entropy else None)
