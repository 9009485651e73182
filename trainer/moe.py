"""Mixture-of-experts routing in the trainer: megatron's router on CPU, and routing replay.

Megatron's ``TopKRouter`` moves its weight to the current CUDA device in ``gating`` (and then calls a
TransformerEngine GEMM); on CPU :func:`install` binds a plain fp32 linear instead. On every device it also binds a
``routing`` that can **replay** the engine's choice: while :func:`replaying` is active with the experts the engine
routed each token to, a token that has them is sent to those experts, weighted by the router's own probabilities of
them (the full softmax's, or renormalised over the chosen experts when megatron's ``moe_router_pre_softmax`` is off,
as Qwen3's ``norm_topk_prob`` says), so the gradient still reaches the router; a token without them is routed by the
router as usual. Either way each router counts how many of the given (token, layer) choices differ from its own
top-k (as sets): the train/infer routing mismatch, measured with replay off as well.

Token order: megatron's hidden states are ``[s, b, h]``, so a router sees the padded micro-batch's tokens
position-major (``position * b + row``), and a packed stream's in stream order. Under sequence parallelism (an MoE
model with ``trainer.tp`` > 1) each TP rank's routers see a contiguous share of that order, so each takes its share
of the routes.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

_ROUTES = "_agentflow_routes"
_REPLAY = "_agentflow_replay"
_COUNTS = "_agentflow_mismatch"


def routers(model: torch.nn.Module) -> list[Any]:
    """The model's ``TopKRouter`` s in layer order (empty for a dense model)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def install(model: torch.nn.Module, on_cpu: bool) -> None:
    """Bind the replaying ``routing`` to every router of ``model`` (and, ``on_cpu``, the CPU ``gating``)."""
    for router in routers(model):
        if on_cpu:
            router.gating = types.MethodType(_cpu_gating, router)
        router.routing = types.MethodType(_make_routing(router.routing), router)
        setattr(router, _COUNTS, [0, 0])


def _cpu_gating(router: Any, hidden: Tensor) -> Tensor:
    bias = None if router.bias is None else router.bias.float()
    return F.linear(hidden.float(), router.weight.float(), bias)


def _local_routes(router: Any, given: Tensor, tokens: int) -> Tensor:
    """The rows of ``given`` for the ``tokens`` this router sees: all of them, or under sequence parallelism this TP
    rank's contiguous share of the sequence (padded at the end to a multiple of the TP size: no route there)."""
    if not router.config.sequence_parallel:
        return given
    from megatron.core import parallel_state

    size = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    total = tokens * size
    if given.shape[0] > total:
        return given  # refused by the shape check
    padded = torch.cat([given, given.new_full((total - given.shape[0], given.shape[1]), -1)])
    return padded[rank * tokens : (rank + 1) * tokens]


def _make_routing(own: Any) -> Any:
    def routing(router: Any, logits: Tensor, padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        given: Tensor | None = getattr(router, _ROUTES, None)
        if given is None:
            return own(logits, padding_mask)
        experts = router.config.num_moe_experts
        flat = logits.reshape(-1, experts)
        given = _local_routes(router, given, flat.shape[0])
        if given.shape != (flat.shape[0], router.topk):
            raise ValueError(
                f"replayed routes {tuple(given.shape)} do not match {flat.shape[0]} tokens x top-{router.topk}"
            )
        probs = torch.softmax(flat.float(), dim=-1)
        mine = torch.topk(probs, router.topk, dim=-1).indices
        have = (given >= 0).all(dim=-1)
        differs = (mine.sort(dim=-1).values != given.sort(dim=-1).values).any(dim=-1) & have
        counts = getattr(router, _COUNTS)
        counts[0] += int(differs.sum())
        counts[1] += int(have.sum())
        if not getattr(router, _REPLAY, False):
            return own(logits, padding_mask)
        chosen = torch.where(have[:, None], given, mine)
        weights = probs.gather(-1, chosen)
        if not router.config.moe_router_pre_softmax:  # softmax over the chosen experts only
            weights = weights / weights.sum(dim=-1, keepdim=True)
        dense = torch.zeros_like(flat).scatter(-1, chosen, weights.to(flat.dtype))
        routing_map = torch.zeros(flat.shape, dtype=torch.bool, device=flat.device).scatter(-1, chosen, True)
        return dense, routing_map

    return routing


def token_order(routes: Tensor, packing: Any = None, lengths: Tensor | None = None) -> Tensor:
    """Routes ``[b, s, layers, k]`` (-1: none) in the order the routers see the tokens: ``[layers, tokens, k]``."""
    if packing is not None:
        if lengths is None:
            raise ValueError("packed routes need the rows' lengths")
        stream = torch.cat([routes[r, : int(n)] for r, n in enumerate(lengths)])  # [T, layers, k]
        return stream.transpose(0, 1).contiguous()
    b, s = routes.shape[:2]
    return routes.transpose(0, 1).reshape(s * b, *routes.shape[2:]).transpose(0, 1).contiguous()


@contextlib.contextmanager
def replaying(model: torch.nn.Module, routes: Tensor | None, replay: bool) -> Iterator[None]:
    """Within the block, each router gets its layer's routes ``[layers, tokens, k]`` (from :func:`token_order`):
    replayed when ``replay``, only compared with its own choice otherwise. ``routes`` None: nothing changes."""
    rs = routers(model) if routes is not None else []
    if routes is not None and rs and routes.shape[0] != len(rs):
        raise ValueError(f"routes for {routes.shape[0]} layers, the model has {len(rs)} routers")
    try:
        for layer, router in enumerate(rs):
            setattr(router, _ROUTES, routes[layer].to(router.weight.device) if routes is not None else None)
            setattr(router, _REPLAY, replay)
        yield
    finally:
        for router in rs:
            setattr(router, _ROUTES, None)


def take_mismatch(model: torch.nn.Module) -> tuple[int, int]:
    """``(differing, compared)`` (token, layer) routings since the last call, summed over the routers; resets."""
    total = [0, 0]
    for router in routers(model):
        counts = getattr(router, _COUNTS, [0, 0])
        total[0] += counts[0]
        total[1] += counts[1]
        setattr(router, _COUNTS, [0, 0])
    return total[0], total[1]


def collate_routes(per_row: list[list[tuple[int, list[list[int]]]] | None], s: int) -> Tensor | None:
    """``[b, s, layers, k]`` routes of a micro-batch's rows (``Sample.routes``), -1 where a row has none; None when
    no row has any."""
    first = next((r for r in per_row if r), None)
    if first is None:
        return None
    layers, k = len(first[0][1]), len(first[0][1][0])
    out = torch.full((len(per_row), s, layers, k), -1, dtype=torch.long)
    for row, routes in enumerate(per_row):
        for pos, chosen in routes or ():
            if pos < s:
                out[row, pos] = torch.tensor(chosen, dtype=torch.long)
    return out
