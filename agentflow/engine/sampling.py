"""Per-request token sampling with behaviour log-probs taken before top-k/top-p truncation (DESIGN.md)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from agentflow.types import SamplingParams


def behaviour_logprobs(logits: Tensor, temperatures: Sequence[float]) -> Tensor:
    """``log_softmax(logits / T)`` per row ``[B, V]``; a temperature of 0 (greedy) uses ``T = 1``."""
    temps = torch.tensor([t if t > 0 else 1.0 for t in temperatures], dtype=logits.dtype)
    return torch.log_softmax(logits / temps[:, None], dim=-1)


def truncate(logp: Tensor, top_k: int, top_p: float) -> Tensor:
    """Probabilities ``[V]`` after top-k (``top_k <= 0``: off) then top-p on the renormalised top-k distribution."""
    vocab = logp.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logp, top_k).values[-1]
        logp = logp.masked_fill(logp < kth, float("-inf"))
    probs = torch.softmax(logp, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop = mass_before >= top_p
        drop[0] = False
        probs = probs.clone()
        probs[order[drop]] = 0.0
    return probs


def sample_token(logp: Tensor, sampling: SamplingParams, generator: torch.Generator) -> int:
    """Draw one token from the tempered log-probs ``logp [V]`` after truncation, using the request's generator."""
    probs = truncate(logp, sampling.top_k, sampling.top_p)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def sample_batch(
    logits: Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]
) -> list[tuple[int, float]]:
    """Sample one token per row of ``logits [B, V]``; return ``(token, behaviour log-prob)`` pairs.

    The log-prob is that of the tempered, untruncated distribution (greedy rows: plain ``log_softmax``).
    """
    logp = behaviour_logprobs(logits, [p.temperature for p in params])
    tokens = logits.argmax(dim=-1)  # greedy rows; sampled rows are replaced below
    for i, (p, g) in enumerate(zip(params, generators, strict=True)):
        if p.temperature != 0:
            tokens[i] = sample_token(logp[i], p, g)
    picked = logp.gather(1, tokens[:, None])[:, 0]
    return list(zip(tokens.tolist(), picked.tolist(), strict=True))
