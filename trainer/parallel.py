"""Rank-side pieces of tensor and data parallelism for the Megatron trainer.

- :func:`shard_for_dp`: each data-parallel rank's disjoint, token-balanced share of a batch.
- :func:`allreduce_sum`, :func:`allreduce_grads`: sums over the DP group (the loss of every rank is already divided
  by the *global* token count, so summing gradients gives exactly the one-rank gradient).
- :func:`allreduce_tp_partial_grads`: the TP-replicated parameters whose gradient each TP rank holds only part of
  (per-head q/k norms; under sequence parallelism the norms and routers) summed over the TP group.
- :func:`clip_grad_norm_tp` and :class:`ParallelAdamW`: gradient clipping with the *global* norm under TP (norms of
  TP-split parameters summed over the TP group, replicated parameters counted once: megatron's convention),
  identical to ``torch.nn.utils.clip_grad_norm_`` at TP=1.
- ``RANK_CALLS``: functions of a trainer rank that a trainer group can run on every rank by name (inspection,
  per-rank checkpoints).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from trainer.types import Sample

__all__ = [
    "RANK_CALLS",
    "ParallelAdamW",
    "allreduce_grads",
    "allreduce_sum",
    "allreduce_tp_partial_grads",
    "clip_grad_norm_tp",
    "neutral_row",
    "rank_checkpoint_path",
    "shard_for_dp",
]


# ---------------------------------------------------------------------------------------------- data parallel


def _padding_sample(base: Sample) -> Sample:
    """``base`` with an all-zero loss mask: no tokens, no loss, zero gradients, the same metric keys."""
    n = len(base.token_ids)
    return dataclasses.replace(
        base,
        loss_mask=[0] * n,
        behaviour_logprobs=[0.0] * n,
        sample_id=f"{base.sample_id}#dp-padding",
        extra={**base.extra, "dp_padding": True},
    )


def neutral_row(row: Any) -> Any:
    """A per-sample training row with every number zeroed (advantages 0, masks 0), structure kept; None stays."""
    if row is None or isinstance(row, bool):
        return row
    if isinstance(row, int | float):
        return type(row)(0)
    if isinstance(row, tuple | list):
        return type(row)(neutral_row(x) for x in row)
    if isinstance(row, Tensor):
        return torch.zeros_like(row)
    raise TypeError(f"cannot make a padding row from {type(row).__name__}")


def shard_for_dp(
    samples: list[Sample], rows: list[Any], dp_rank: int, dp_size: int
) -> tuple[list[Sample], list[Any], list[int]]:
    """This DP rank's share: ``(samples, their rows, indices into the batch)``.

    ``rows`` holds one item per sample (an advantage, or the trainer's ``(advantages, mask, old)`` tuple). Shares are
    disjoint and cover the batch; they are balanced by token count (longest first, each to the rank with the fewest
    tokens so far, ties to the lower rank) and keep the batch order. Every rank computes the same split. A rank left
    without samples (fewer samples than ranks) gets one padding sample (the shortest, with an all-zero loss mask and
    ``extra["dp_padding"]``) and a :func:`neutral_row`, so that every rank runs the same collectives; its indices
    list is empty.
    """
    if len(samples) != len(rows):
        raise ValueError(f"{len(samples)} samples but {len(rows)} rows")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
    if dp_size == 1:
        return list(samples), list(rows), list(range(len(samples)))
    loads = [0] * dp_size
    owner = [0] * len(samples)
    for i in sorted(range(len(samples)), key=lambda i: (-len(samples[i].token_ids), i)):
        r = min(range(dp_size), key=lambda r: (loads[r], r))
        owner[i] = r
        loads[r] += len(samples[i].token_ids)
    mine = [i for i in range(len(samples)) if owner[i] == dp_rank]
    if not mine and samples:
        j = min(range(len(samples)), key=lambda i: (len(samples[i].token_ids), i))
        return [_padding_sample(samples[j])], [neutral_row(rows[j])], []
    return [samples[i] for i in mine], [rows[i] for i in mine], mine


def allreduce_sum(value: float, group: Any, device: torch.device | str = "cpu") -> float:
    """Sum of a Python number over ``group`` (float64, exact for integer counts below 2**53)."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return float(t.item())


@torch.no_grad()
def allreduce_grads(params: Iterable[torch.nn.Parameter], group: Any) -> None:
    """Sum ``.grad`` of every parameter over ``group`` in one flat all-reduce (a missing grad counts as zeros)."""
    params = [p for p in params if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    _sum_in_place([p.grad for p in params], group)


def _sum_in_place(tensors: list[Tensor], group: Any) -> None:
    """Sum ``tensors`` over ``group`` in place, in one flat all-reduce."""
    if not tensors:
        return
    flat = torch._utils._flatten_dense_tensors(tensors)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    for t, synced in zip(tensors, torch._utils._unflatten_dense_tensors(flat, tensors), strict=True):
        t.copy_(synced)


# ---------------------------------------------------------------------------------- partial gradients under TP


def tp_partial_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Replicated parameters whose gradient each TP rank computes only part of: the per-head q/k norms (a rank
    normalises its own heads) and, under sequence parallelism, every parameter megatron marks ``sequence_parallel``
    (norms and routers that see one rank's share of the tokens)."""
    out = []
    for name, p in model.named_parameters():
        if not p.requires_grad or getattr(p, "tensor_model_parallel", False):
            continue
        if getattr(p, "sequence_parallel", False) or "q_layernorm" in name or "k_layernorm" in name:
            out.append(p)
    return out


@torch.no_grad()
def allreduce_tp_partial_grads(model: torch.nn.Module, tp_group: Any) -> None:
    """Sum the gradients of :func:`tp_partial_params` over ``tp_group`` (megatron's DDP buffers: ``main_grad``), so
    every TP rank applies the same, whole gradient to its copy. Nothing to do at TP=1."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return
    grads = []
    for p in tp_partial_params(model):
        grad = getattr(p, "main_grad", None)
        if grad is None:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grad = p.grad
        grads.append(grad)
    _sum_in_place(grads, tp_group)


# -------------------------------------------------------------------------------------------- clipping under TP


def _is_tp_duplicate(param: Tensor, tp_rank: int) -> bool:
    """True for a replicated parameter on a TP rank other than 0 (megatron marks split ones tensor_model_parallel)."""
    return not getattr(param, "tensor_model_parallel", False) and tp_rank != 0


@torch.no_grad()
def clip_grad_norm_tp(params: Iterable[Tensor], max_norm: float, tp_group: Any | None = None) -> Tensor:
    """Clip gradients by the global L2 norm over the TP group; returns that norm (fp32 scalar).

    Each TP rank adds the squared norms of its TP-split parameters' shards and, on TP rank 0 only, of the replicated
    ones; the sum is all-reduced over ``tp_group``. Without a group (or TP=1) this is ``clip_grad_norm_`` itself.
    """
    params = [p for p in params if p.grad is not None]
    size = dist.get_world_size(tp_group) if tp_group is not None else 1
    if size == 1:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    rank = dist.get_rank(tp_group)
    device = params[0].grad.device if params else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        if not _is_tp_duplicate(p, rank):
            sq += p.grad.detach().float().pow(2).sum()
    dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=tp_group)
    total = sq.sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


class ParallelAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` that also knows its TP group, for :meth:`clip_grad_norm_` with the global norm.

    The group is kept out of ``defaults``/``state_dict`` (checkpoints are those of plain AdamW).
    """

    def __init__(self, params: Iterable[Any], tp_group: Any | None = None, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.tp_group = tp_group

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip every parameter's gradient by the global (TP-aware) norm; returns the norm before clipping."""
        params = [p for group in self.param_groups for p in group["params"]]
        return float(clip_grad_norm_tp(params, max_norm, self.tp_group))


# ---------------------------------------------------------------------------------------- per-rank calls by name


def rank_checkpoint_path(path: str | Path, tp_rank: int, tp_size: int) -> Path:
    """The file of one TP rank's checkpoint: ``path`` itself at TP=1, else ``stem.tpR.suffix`` beside it."""
    p = Path(path)
    return p if tp_size == 1 else p.with_name(f"{p.stem}.tp{tp_rank}{p.suffix}")


def rank_info(trainer: Any) -> dict[str, Any]:
    """Where this rank sits and what it last trained on (for tests and logs)."""
    from trainer.dist import dp_rank_and_size, tp_rank_and_size

    tp_rank, tp_size = tp_rank_and_size()
    dp_rank, dp_size = dp_rank_and_size()
    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "tp_rank": tp_rank,
        "tp_size": tp_size,
        "dp_rank": dp_rank,
        "dp_size": dp_size,
        "device": str(next(trainer.model.parameters()).device),
        "version": trainer.version,
        "step": trainer.step,
        "last_dp_shard": list(getattr(trainer, "last_dp_shard", [])),
    }


def rank_shards(trainer: Any) -> dict[str, Tensor]:
    """This rank's parameters by megatron name (its TP shards), as detached CPU fp32 clones."""
    from trainer.model import model_parameters

    return {n: p.detach().to("cpu", torch.float32).clone() for n, p in model_parameters(trainer.model).items()}


def rank_save_checkpoint(trainer: Any, path: str, extra: dict[str, Any] | None = None) -> str:
    """Save this TP rank's checkpoint (DP rank 0 only: DP replicas are identical). Returns the file written, or ''."""
    from trainer.dist import dp_rank_and_size, tp_rank_and_size

    tp_rank, tp_size = tp_rank_and_size()
    if dp_rank_and_size()[0] != 0:
        return ""
    target = rank_checkpoint_path(path, tp_rank, tp_size)
    trainer.save_checkpoint(target, extra)
    return str(target)


def rank_load_checkpoint(trainer: Any, path: str) -> dict[str, Any]:
    """Load this TP rank's checkpoint (every DP replica reads the file of its TP rank). Returns the saved extra."""
    from trainer.dist import tp_rank_and_size

    tp_rank, tp_size = tp_rank_and_size()
    return trainer.load_checkpoint(rank_checkpoint_path(path, tp_rank, tp_size))


RANK_CALLS: dict[str, Callable[..., Any]] = {
    "rank_info": rank_info,
    "rank_shards": rank_shards,
    "rank_save_checkpoint": rank_save_checkpoint,
    "rank_load_checkpoint": rank_load_checkpoint,
}
"""Functions a trainer group may call by name on every rank, as ``fn(trainer, *args, **kwargs)``."""
