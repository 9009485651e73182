"""Vectorised inverse-CDF sampling: right distribution, truncation respected, rows independent of neighbours."""

from __future__ import annotations

import torch

from agentflow.engine.sampling import sample_batch, sample_batch_tokens
from agentflow.types import SamplingParams


def test_frequencies_follow_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05])
    logp = probs.log()[None].expand(4000, -1)
    gens = [torch.Generator().manual_seed(i) for i in range(4000)]
    tokens = torch.tensor(sample_batch_tokens(logp, [SamplingParams()] * 4000, gens))
    freq = torch.bincount(tokens, minlength=5).double() / 4000
    assert freq[1] == 0  # a zero-probability token is never drawn
    assert torch.allclose(freq, probs.double(), atol=0.03), freq


def test_top_k_rows_stay_in_the_top_k() -> None:
    logp = torch.log_softmax(torch.randn(64, 50, generator=torch.Generator().manual_seed(0)), -1)
    params = [SamplingParams(top_k=3) if i % 2 else SamplingParams() for i in range(64)]
    tokens = sample_batch_tokens(logp, params, [torch.Generator().manual_seed(i) for i in range(64)])
    for i in range(1, 64, 2):
        assert tokens[i] in torch.topk(logp[i], 3).indices.tolist()


def test_a_row_does_not_depend_on_its_batch_neighbours() -> None:
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.8)] * 6
    together = sample_batch(logits, params, [torch.Generator().manual_seed(10 + i) for i in range(6)])
    alone = sample_batch(logits[3:4], params[:1], [torch.Generator().manual_seed(13)])
    assert together[3] == alone[0]
    greedy = sample_batch(logits, [SamplingParams(temperature=0.0)] * 6, [torch.Generator()] * 6)
    assert [t for t, _ in greedy] == logits.argmax(-1).tolist()
