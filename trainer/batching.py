"""Samples -> padded micro-batches under a token budget.

Rows are right-padded (causal attention keeps padding from touching earlier positions). Every tensor is aligned
with the *targets*: position ``t`` describes token ``t + 1`` predicted from ``ids[: t + 1]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.types import Sample


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [b, s] long
    target_mask: torch.Tensor  # [b, s-1] float, 1 where the target token is a model token
    behaviour_logprobs: torch.Tensor  # [b, s-1]
    advantages: torch.Tensor  # [b, s-1]
    lengths: torch.Tensor  # [b] true row lengths
    num_tokens: int

    def attention_mask(self) -> torch.Tensor:
        """[b, s] ones over each row's real tokens, zeros over right padding."""
        return (torch.arange(self.input_ids.shape[1]) < self.lengths[:, None]).long()


def make_micro_batches(
    samples: list[Sample], advantages: list[float], token_budget: int, pad_id: int = 0
) -> list[MicroBatch]:
    """Pack samples (longest first) into micro-batches whose padded size ``rows * max_len`` fits the budget."""
    if len(samples) != len(advantages):
        raise ValueError("one advantage per sample")
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i].token_ids))
    batches, current = [], []
    for i in order:
        longest = len(samples[current[0]].token_ids) if current else len(samples[i].token_ids)
        if current and (len(current) + 1) * longest > token_budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return [_collate([samples[i] for i in b], [advantages[i] for i in b], pad_id) for b in batches]


def _collate(samples: list[Sample], advantages: list[float], pad_id: int) -> MicroBatch:
    s = max(len(x.token_ids) for x in samples)
    b = len(samples)
    ids = torch.full((b, s), pad_id, dtype=torch.long)
    mask = torch.zeros(b, s - 1)
    behav = torch.zeros(b, s - 1)
    adv = torch.zeros(b, s - 1)
    for r, (x, a) in enumerate(zip(samples, advantages, strict=True)):
        n = len(x.token_ids)
        ids[r, :n] = torch.tensor(x.token_ids)
        mask[r, : n - 1] = torch.tensor(x.loss_mask[1:], dtype=torch.float32)
        behav[r, : n - 1] = torch.tensor(x.behaviour_logprobs[1:], dtype=torch.float32)
        adv[r, : n - 1] = a
    lengths = torch.tensor([len(x.token_ids) for x in samples])
    return MicroBatch(ids, mask, behav, adv * mask, lengths, int(mask.sum().item()))
