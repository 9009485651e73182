"""Per-request token sampling with behaviour log-probs taken before top-k/top-p truncation (docs/architecture.md)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from agentflow.types import SamplingParams


def behaviour_logprobs(logits: Tensor, temperatures: Sequence[float]) -> Tensor:
    """``log_softmax(logits / T)`` per row ``[B, V]``; a temperature of 0 (greedy) uses ``T = 1``."""
    temps = [t if t > 0 else 1.0 for t in temperatures]
    if all(t == 1.0 for t in temps):  # greedy and T=1 rows: no division (a full pass over [B, V] per step)
        return torch.log_softmax(logits, dim=-1)
    return torch.log_softmax(logits / torch.tensor(temps, dtype=logits.dtype)[:, None], dim=-1)


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
    return sample_batch_tokens(logp[None], [sampling], [generator])[0]


def _uniforms(generators: Sequence[torch.Generator]) -> Tensor:
    """One uniform draw per row from that row's own generator (so each request's stream is reproducible)."""
    return torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])


def sample_batch_tokens(
    logp: Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]
) -> list[int]:
    """Inverse-CDF sampling of every row of tempered log-probs ``logp [B, V]`` in one vectorised pass.

    Rows with top-k/top-p are truncated one by one (rare); untruncated rows need no per-row work. One uniform per
    row keeps requests independent of their batch neighbours, as separate ``multinomial`` calls did, for a fraction
    of the per-row dispatch cost (it dominated decode steps of small models).
    """
    probs = torch.exp(logp.to(torch.float64))
    for i, p in enumerate(params):
        if p.top_k > 0 or p.top_p < 1.0:
            probs[i] = truncate(logp[i], p.top_k, p.top_p).to(torch.float64)
    cdf = torch.cumsum(probs, dim=-1)
    target = _uniforms(generators) * cdf[:, -1]
    tokens = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
    return tokens.clamp_(max=logp.shape[-1] - 1).tolist()


def sample_batch(
    logits: Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]
) -> list[tuple[int, float]]:
    """Sample one token per row of ``logits [B, V]``; return ``(token, behaviour log-prob)`` pairs.

    The log-prob is that of the tempered, untruncated distribution (greedy rows: plain ``log_softmax``).
    """
    logp = behaviour_logprobs(logits, [p.temperature for p in params])
    tokens = logits.argmax(dim=-1)  # greedy rows; sampled rows are replaced below
    rows = [i for i, p in enumerate(params) if p.temperature != 0]
    if rows:
        picks = sample_batch_tokens(logp[rows], [params[i] for i in rows], [generators[i] for i in rows])
        tokens[rows] = torch.tensor(picks, dtype=tokens.dtype)
    picked = logp.gather(1, tokens[:, None])[:, 0]
    return list(zip(tokens.tolist(), picked.tolist(), strict=True))
