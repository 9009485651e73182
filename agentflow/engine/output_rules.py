"""What a request asks of its output beyond plain sampling: a grammar, stop strings, top log-probs.

Runs on the decode thread. A grammar masks the logits before sampling (so behaviour log-probs are those of the
masked distribution, which the trainer reproduces by replaying the grammar); stop strings are matched on the decoded
tail of the output; top log-probs come from the same tempered, masked distribution the token was drawn from.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from agentflow.structured import Grammars, grammars_for, is_canonical
from agentflow.types import SamplingParams

_BYTE_BIAS = torch.zeros(256, 8).masked_fill(
    ~((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool(), float("-inf")
)
"""Logit bias of the eight tokens one bitmask byte covers, by byte value (bit ``j``: token ``8 * k + j``)."""

Masks = tuple[torch.Tensor | None, list[str | None]]
"""Per request an additive logit bias (``[B, vocab]``: 0 where its grammar allows a token, -inf elsewhere; None
when no row is masked), and per request an error or None."""


@dataclass(eq=False)
class RequestRules:
    """One request's grammar matcher and stop strings (the matcher advances with every accepted token)."""

    matcher: Any = None
    stop: tuple[str, ...] = ()
    tail_tokens: int = 0
    """Output tokens decoded to look for a stop string (enough to hold the longest one)."""
    canonical: bool = False
    """Forced text in canonical tokens only (``agentflow.structured.CANONICAL``)."""


class OutputRules:
    """Builds :class:`RequestRules` and applies them for one engine (its model directory and vocabulary)."""

    def __init__(self, model_dir: str, vocab: int) -> None:
        self.model_dir, self.vocab = model_dir, vocab

    @cached_property
    def grammars(self) -> Grammars:
        return grammars_for(self.model_dir, self.vocab)

    @cached_property
    def _decoder(self) -> Any:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(f"{self.model_dir}/tokenizer.json")

    def for_request(self, sampling: SamplingParams) -> RequestRules | None:
        """Rules of a new request; raises ValueError for a grammar that does not compile."""
        if sampling.grammar is None and not sampling.stop:
            return None
        matcher = None
        if sampling.grammar is not None:
            try:
                matcher = self.grammars.matcher(sampling.grammar)
            except ValueError as e:
                raise ValueError(f"invalid grammar: {e}") from None
        longest = max((len(s.encode()) for s in sampling.stop), default=0)
        marked = sampling.grammar is not None and is_canonical(sampling.grammar)
        return RequestRules(matcher, tuple(sampling.stop), longest + 2, marked)

    def compute(self, rules: list[RequestRules | None]) -> Masks:
        rows = [i for i, r in enumerate(rules) if r is not None and r.matcher is not None]
        errors: list[str | None] = [None] * len(rules)
        words = torch.zeros(len(rows), self.grammars.words, dtype=torch.int32)
        pairs = [(r.matcher, r.canonical) for r in (rules[i] for i in rows) if r is not None]
        for j, problem in enumerate(self.grammars.masks_into(pairs, words)):
            if problem is not None:
                errors[rows[j]] = f"grammar error: {problem}"
        for j in (~(words != 0).any(dim=1)).nonzero().flatten().tolist():
            errors[rows[j]] = errors[rows[j]] or "grammar error: no token is allowed"
        keep = [j for j, i in enumerate(rows) if errors[i] is None]  # a failed row is dropped, not sampled masked
        if not keep:
            return None, errors
        # An additive bias (0 where allowed, -inf elsewhere), read byte by byte from a table: adding it costs a few
        # microseconds, where a masked_fill with a boolean mask cost over a hundred and unpacking bits several.
        masked = _BYTE_BIAS[words[keep].view(torch.uint8).long()].reshape(len(keep), -1)[:, : self.vocab]
        if len(keep) == len(rules):
            return masked, errors
        bias = torch.zeros(len(rules), self.vocab)
        bias[[rows[j] for j in keep]] = masked
        return bias, errors

    def mask(self, logits: torch.Tensor, rules: list[RequestRules | None]) -> tuple[torch.Tensor, list[str | None]]:
        """``logits [B, V]`` with each row masked by its grammar (a new tensor: the model's are inference
        tensors), and per row an error or None. Computed on the decode thread between forward passes: on a
        helper thread during the forward pass it cost more than it saved (the two contend for the GIL and the
        cores)."""
        bias, errors = self.compute(rules)
        if bias is not None:
            logits = logits + bias[:, : logits.shape[-1]]
        return logits, errors

    def accept(self, rules: RequestRules, output: list[int]) -> tuple[bool, str | None]:
        """Advance the matcher with the last output token; returns (stop string matched, error)."""
        if rules.matcher is not None and not rules.matcher.consume_token(output[-1]):
            return False, f"grammar error: token {output[-1]} rejected ({rules.matcher.get_error()})"
        if rules.stop:
            tail = self._decoder.decode(output[-rules.tail_tokens :], skip_special_tokens=False)
            if any(s in tail for s in rules.stop):
                return True, None
        return False, None


def top_alternatives(logits: torch.Tensor, params: list[SamplingParams]) -> list[list[tuple[int, float]] | None]:
    """``(id, log-prob)`` of the best ``top_logprobs`` tokens per row, at the row's temperature (greedy: 1)."""
    out: list[list[tuple[int, float]] | None] = [None] * len(params)
    for i, p in enumerate(params):
        if p.top_logprobs > 0:
            t = p.temperature if p.temperature > 0 else 1.0
            logp = torch.log_softmax(logits[i] / t, dim=-1)
            vals, idx = torch.topk(logp, min(p.top_logprobs, logp.shape[-1]))
            out[i] = list(zip(idx.tolist(), vals.tolist(), strict=True))
    return out
