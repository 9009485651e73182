"""Samples -> micro-batches under a token budget, padded or packed.

Rows are right-padded (causal attention keeps padding from touching earlier positions). Every tensor is aligned
with the *targets*: position ``t`` describes token ``t + 1`` predicted from ``ids[: t + 1]``.

Packed micro-batches (``packing=True``) keep that padded ``[b, s-1]`` grid for everything the losses read, and add a
:class:`Packing`: the same rows laid end to end in one stream without padding, which is what the model runs on. The
log-prob functions of ``trainer.model`` map their results from the stream back onto the grid, so the losses see the
same tensors either way; the budget then counts real tokens instead of ``rows * longest``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trainer.moe import collate_routes
from trainer.types import Sample


@dataclass
class VocabMasks:
    """Restricted positions of a micro-batch: ``rows``/``cols`` index the target-aligned ``[b, s-1]`` grid."""

    rows: torch.Tensor  # [n] long
    cols: torch.Tensor  # [n] long
    bits: torch.Tensor  # [n, words] int32

    def allowed(self, lo: int, width: int) -> torch.Tensor:
        """Bool ``[n, width]``: which of the tokens ``lo .. lo + width - 1`` each position allows (a vocab shard
        under tensor parallelism; tokens past the mask's words are not allowed)."""
        bits = (self.bits.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        flat = bits.flatten(-2).bool()
        out = torch.zeros(flat.shape[0], width, dtype=torch.bool)
        part = flat[:, lo : lo + width]
        out[:, : part.shape[1]] = part
        return out


@dataclass
class Packing:
    """A micro-batch's rows laid end to end in one stream ``[1, T]``, ``T`` = the sum of the row lengths.

    The model runs on the stream with each row's positions restarting at 0 and attention kept inside each row
    (``cu_seqlens``, megatron's THD layout). Target-aligned values map between the stream's ``[1, T-1]`` and the
    micro-batch's ``[b, s-1]`` grid through ``rows``/``cols``/``index``: one entry per real target, grid position
    ``(rows[j], cols[j])`` is stream position ``index[j]``. Stream positions at a row's last token (which would
    predict the next row's first token) map to no grid position.
    """

    input_ids: torch.Tensor  # [1, T] long
    position_ids: torch.Tensor  # [1, T] long, 0 at each row's first token
    cu_seqlens: torch.Tensor  # [b + 1] int32, row r is stream[cu_seqlens[r] : cu_seqlens[r + 1]]
    max_seqlen: int
    grid: tuple[int, int]  # (b, s - 1)
    rows: torch.Tensor  # [N] long
    cols: torch.Tensor  # [N] long
    index: torch.Tensor  # [N] long

    def to_grid(self, values: torch.Tensor) -> torch.Tensor:
        """Stream values ``[1, T-1, ...]`` -> grid ``[b, s-1, ...]``, zero at padding (differentiable)."""
        d = values.device
        out = values.new_zeros(*self.grid, *values.shape[2:])
        return out.index_put((self.rows.to(d), self.cols.to(d)), values[0, self.index.to(d)])

    def to_stream(self, values: torch.Tensor) -> torch.Tensor:
        """Grid values ``[b, s-1, ...]`` -> stream ``[1, T-1, ...]``, zero at the rows' last tokens."""
        d = values.device
        out = values.new_zeros(1, self.input_ids.shape[1] - 1, *values.shape[2:])
        out[0, self.index.to(d)] = values[self.rows.to(d), self.cols.to(d)]
        return out

    def stream_masks(self, masks: VocabMasks | None) -> VocabMasks | None:
        """``masks`` (grid positions) at their stream positions."""
        if masks is None:
            return None
        starts = self.cu_seqlens[:-1].long()
        return VocabMasks(torch.zeros_like(masks.rows), starts[masks.rows] + masks.cols, masks.bits)


def pack_rows(input_ids: torch.Tensor, lengths: torch.Tensor) -> Packing:
    """The :class:`Packing` of right-padded rows ``input_ids [b, s]`` with true ``lengths [b]``."""
    ns = [int(n) for n in lengths]
    if not ns or min(ns) < 1:
        raise ValueError("every packed row needs at least one token")
    starts = [0]
    for n in ns:
        starts.append(starts[-1] + n)
    targets = [(r, c) for r, n in enumerate(ns) for c in range(n - 1)]
    rows = torch.tensor([r for r, _ in targets], dtype=torch.long)
    cols = torch.tensor([c for _, c in targets], dtype=torch.long)
    return Packing(
        input_ids=torch.cat([input_ids[r, :n] for r, n in enumerate(ns)]).unsqueeze(0),
        position_ids=torch.cat([torch.arange(n) for n in ns]).unsqueeze(0),
        cu_seqlens=torch.tensor(starts, dtype=torch.int32),
        max_seqlen=max(ns),
        grid=(len(ns), input_ids.shape[1] - 1),
        rows=rows,
        cols=cols,
        index=torch.tensor(starts[:-1], dtype=torch.long)[rows] + cols,
    )


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [b, s] long
    target_mask: torch.Tensor  # [b, s-1] float, 1 where the target token is trained in this phase
    behaviour_logprobs: torch.Tensor  # [b, s-1]
    advantages: torch.Tensor  # [b, s-1]
    lengths: torch.Tensor  # [b] true row lengths
    num_tokens: int
    rows: list[int]
    """Index of each row's sample in the list given to :func:`make_micro_batches`."""
    old_logprobs: torch.Tensor | None = None  # [b, s-1], when recomputed before the update
    ref_logprobs: torch.Tensor | None = None  # [b, s-1], when every sample carries them
    teacher_logprobs: torch.Tensor | None = None  # [b, s-1], when every sample carries them
    teacher_top_ids: torch.Tensor | None = None  # [b, s-1, k] long, when every sample carries them
    teacher_top_logprobs: torch.Tensor | None = None  # [b, s-1, k]
    vocab_masks: VocabMasks | None = None
    """Target positions whose token was drawn from a restricted vocabulary (``Sample.vocab_masks``)."""
    packing: Packing | None = None
    """The rows as one padding-free stream, when the micro-batch was built packed."""
    teachers: list[str] = field(default_factory=list)
    """Each row's ``Sample.teacher`` (the full-vocabulary distillation terms)."""
    replayed: torch.Tensor | None = None
    """``[b, s-1]`` 1.0 on the rows of replayed samples (``Sample.replayed``), when a row is one."""
    routes: torch.Tensor | None = None
    """``[b, s, layers, k]`` experts the engine routed each input token to (-1: not recorded), when a row has any."""

    def attention_mask(self) -> torch.Tensor:
        """[b, s] ones over each row's real tokens, zeros over right padding."""
        return (torch.arange(self.input_ids.shape[1]) < self.lengths[:, None]).long()


def make_micro_batches(
    samples: list[Sample],
    advantages: list[float] | list[list[float]],
    token_budget: int,
    masks: list[list[int]] | None = None,
    old: list[list[float]] | None = None,
    pad_id: int = 0,
    packing: bool = False,
) -> list[MicroBatch]:
    """Group samples (longest first) into micro-batches that fit the budget: consecutive runs whose padded size
    ``rows * max_len`` fits, or with ``packing`` first-fit bins of real tokens (each micro-batch then carries its
    :class:`Packing`). A sample longer than the budget gets a micro-batch of its own.

    ``advantages``: one float per sample or one per token; ``masks`` restrict which tokens train (default: each
    sample's loss mask); ``old``: per-token old log-probs aligned with ``token_ids``.
    """
    if len(samples) != len(advantages):
        raise ValueError("one advantage (or advantage list) per sample")
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i].token_ids))
    groups: list[list[int]] = []
    if packing:
        used: list[int] = []
        for i in order:
            n = len(samples[i].token_ids)
            g = next((g for g, u in enumerate(used) if u + n <= token_budget), len(groups))
            if g == len(groups):
                groups.append([])
                used.append(0)
            groups[g].append(i)
            used[g] += n
    else:
        current: list[int] = []
        for i in order:
            longest = len(samples[current[0]].token_ids) if current else len(samples[i].token_ids)
            if current and (len(current) + 1) * longest > token_budget:
                groups.append(current)
                current = []
            current.append(i)
        if current:
            groups.append(current)
    batches = [_collate(samples, g, advantages, masks, old, pad_id) for g in groups]
    for mb in batches if packing else ():
        mb.packing = pack_rows(mb.input_ids, mb.lengths)
    return batches


def _row(values: list[float], n: int) -> torch.Tensor:
    return torch.tensor(values[1:n], dtype=torch.float32)


def _collate(samples, rows, advantages, masks, old, pad_id) -> MicroBatch:
    s = max(len(samples[i].token_ids) for i in rows)
    b = len(rows)
    ids = torch.full((b, s), pad_id, dtype=torch.long)
    arrays = {k: torch.zeros(b, s - 1) for k in ("mask", "behav", "adv", "old", "ref")}
    with_ref = all(samples[i].ref_logprobs is not None for i in rows)
    for r, i in enumerate(rows):
        x, n = samples[i], len(samples[i].token_ids)
        ids[r, :n] = torch.tensor(x.token_ids)
        adv = advantages[i] if isinstance(advantages[i], list) else [advantages[i]] * n
        arrays["mask"][r, : n - 1] = _row(masks[i] if masks is not None else x.loss_mask, n)
        arrays["behav"][r, : n - 1] = _row(x.behaviour_logprobs, n)
        arrays["adv"][r, : n - 1] = _row(adv, n)
        if old is not None:
            arrays["old"][r, : n - 1] = _row(old[i], n)
        if with_ref:
            arrays["ref"][r, : n - 1] = _row(x.ref_logprobs, n)
    mask = arrays["mask"]
    teacher = _teacher_arrays([samples[i] for i in rows], s)
    vocab_masks = collate_vocab_masks([samples[i] for i in rows])
    return MicroBatch(
        input_ids=ids,
        target_mask=mask,
        behaviour_logprobs=arrays["behav"],
        advantages=arrays["adv"] * mask,
        lengths=torch.tensor([len(samples[i].token_ids) for i in rows]),
        num_tokens=int(mask.sum().item()),
        rows=list(rows),
        old_logprobs=arrays["old"] if old is not None else None,
        ref_logprobs=arrays["ref"] if with_ref else None,
        vocab_masks=vocab_masks,
        teachers=[samples[i].teacher for i in rows],
        routes=collate_routes([samples[i].routes for i in rows], s),
        replayed=_replayed_rows([samples[i] for i in rows], s),
        **teacher,
    )


def _replayed_rows(samples: list[Sample], s: int) -> torch.Tensor | None:
    if not any(x.replayed for x in samples):
        return None
    return torch.tensor([float(x.replayed) for x in samples])[:, None].expand(len(samples), s - 1).contiguous()


def collate_vocab_masks(samples: list[Sample]) -> VocabMasks | None:
    entries = [(r, pos, bits) for r, x in enumerate(samples) for pos, bits in x.vocab_masks]
    if not entries:
        return None
    for r, pos, _ in entries:
        if not 1 <= pos < len(samples[r].token_ids):
            raise ValueError(f"sample {samples[r].sample_id!r}: vocab mask at position {pos} outside the row")
    words = max(len(b) for _, _, b in entries) // 4
    bits = torch.zeros(len(entries), words, dtype=torch.int32)
    for k, (_, _, b) in enumerate(entries):
        row = torch.frombuffer(bytearray(b), dtype=torch.int32)
        bits[k, : row.numel()] = row
    rows = torch.tensor([r for r, _, _ in entries], dtype=torch.long)
    cols = torch.tensor([pos - 1 for _, pos, _ in entries], dtype=torch.long)  # row t-1 predicts token t
    return VocabMasks(rows, cols, bits)


def _teacher_arrays(samples: list[Sample], s: int) -> dict[str, torch.Tensor]:
    """Teacher log-probs (and top-k lists) as target-aligned tensors, when every row carries them."""
    out: dict[str, torch.Tensor] = {}
    if all(x.teacher_logprobs is not None for x in samples):
        lp = torch.zeros(len(samples), s - 1)
        for r, x in enumerate(samples):
            lp[r, : len(x.token_ids) - 1] = _row(x.teacher_logprobs, len(x.token_ids))
        out["teacher_logprobs"] = lp
    if all(x.teacher_top_ids is not None and x.teacher_top_logprobs is not None for x in samples):
        k = max((len(row) for x in samples for row in x.teacher_top_ids), default=0)
        ids = torch.zeros(len(samples), s - 1, k, dtype=torch.long)
        lps = torch.zeros(len(samples), s - 1, k)
        for r, x in enumerate(samples):
            for t in range(1, len(x.token_ids)):  # row t-1 predicts token t
                top, vals = x.teacher_top_ids[t], x.teacher_top_logprobs[t]
                if len(top) != k and x.loss_mask[t]:
                    raise ValueError(f"sample {x.sample_id!r}: {len(top)} top-k entries at token {t}, expected {k}")
                ids[r, t - 1, : len(top)] = torch.tensor(top, dtype=torch.long)
                lps[r, t - 1, : len(vals)] = torch.tensor(vals, dtype=torch.float32)
        out["teacher_top_ids"], out["teacher_top_logprobs"] = ids, lps
    return out
