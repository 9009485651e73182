"""Composable rewards: a :class:`Rubric` is a weighted sum of verifier terms.

Each term is a function ``fn(answer, task, env) -> float`` (a ``bool`` counts as 0/1). The reward is
``sum(weight * value)``; success means the reward reached ``success_threshold`` (default: the sum of the positive
weights, i.e. every positive term at 1). A term with weight 0 is computed and reported, not rewarded.

An exception inside a term, or a value that is not a finite number, raises :class:`~envs.errors.VerifierError`
carrying the term's name and the message. It is never turned into a reward of 0: it propagates out of ``step``
and the caller marks the trajectory ``error``::

    rubric = Rubric([(1.0, exact_match()), (0.1, used_tool("search"))])
    score = rubric.score(answer, task, env)   # Score(reward, success, terms={"exact_match": 1.0, ...})
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from envs.errors import VerifierError

VerifierFn = Callable[[str, Any, Any], float | bool]


@dataclass(frozen=True)
class Term:
    """One weighted verifier; ``name`` defaults to the function's ``__name__``."""

    weight: float
    fn: VerifierFn
    name: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.weight, bool) or not isinstance(self.weight, int | float) or not math.isfinite(self.weight):
            raise ValueError(f"term weight must be a finite number, got {self.weight!r}")
        if not callable(self.fn):
            raise TypeError(f"term function must be callable, got {self.fn!r}")
        object.__setattr__(self, "name", self.name or getattr(self.fn, "__name__", "term"))


@dataclass(frozen=True)
class Score:
    """The result of a rubric: the reward, whether it counts as success, and each term's unweighted value."""

    reward: float
    success: bool
    terms: dict[str, float]


class Rubric:
    """A weighted sum of verifier terms: ``Rubric([(weight, fn), ...])`` or ``Rubric([Term(...), ...])``."""

    def __init__(
        self,
        terms: Sequence[Term | tuple[float, VerifierFn] | tuple[float, VerifierFn, str]],
        success_threshold: float | None = None,
    ) -> None:
        built = [t if isinstance(t, Term) else Term(*t) for t in terms]
        if not built:
            raise ValueError("a rubric needs at least one term")
        names = [t.name for t in built]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"rubric term names must be unique; repeated: {dupes} (pass a name as third element)")
        self.terms = tuple(built)
        positive = sum(t.weight for t in built if t.weight > 0)
        self.success_threshold = positive if success_threshold is None else float(success_threshold)
        self.max_reward = positive

    def score(self, answer: str, task: Any, env: Any = None) -> Score:
        """Run every term; raises :class:`VerifierError` when one fails or returns a non-number."""
        values: dict[str, float] = {}
        for term in self.terms:
            values[term.name] = _run_term(term, answer, task, env)
        reward = math.fsum(t.weight * values[t.name] for t in self.terms)
        return Score(reward, reward >= self.success_threshold - 1e-9, values)

    def __repr__(self) -> str:
        inner = ", ".join(f"{t.weight:g}*{t.name}" for t in self.terms)
        return f"Rubric({inner})"


def _run_term(term: Term, answer: str, task: Any, env: Any) -> float:
    try:
        value = term.fn(answer, task, env)
    except VerifierError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure is the verifier's, reported with its message
        raise VerifierError(f"verifier {term.name!r} failed: {type(e).__name__}: {e}") from e
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if not isinstance(value, int | float) or not math.isfinite(value):
        raise VerifierError(f"verifier {term.name!r} returned {value!r}; expected a finite number or a bool")
    return float(value)


# -- reusable terms ---------------------------------------------------------------------------------------------
def normalize_text(text: str) -> str:
    """Lowercase, strip accents and punctuation, collapse whitespace, drop a leading article."""
    text = unicodedata.normalize("NFKD", text)
    text = "".join(c for c in text if not unicodedata.combining(c)).lower()
    text = re.sub(r"[^\w\s.-]", " ", text)
    text = re.sub(r"(?<!\d)[.]|[.](?!\d)", " ", text)
    text = " ".join(text.split())
    return re.sub(r"^(the|a|an) ", "", text)


def exact_match(expected: Callable[[Any], str] = lambda task: task.answer, name: str = "exact_match") -> VerifierFn:
    """A term: 1 when the normalised answer equals the normalised ``expected(task)``."""

    def term(answer: str, task: Any, env: Any) -> float:
        return float(normalize_text(answer) == normalize_text(str(expected(task))))

    term.__name__ = name
    return term


def numeric_match(
    expected: Callable[[Any], float] = lambda task: task.answer, tol: float = 1e-9, name: str = "numeric_match"
) -> VerifierFn:
    """A term: 1 when the answer is a number within ``tol`` of ``expected(task)`` (commas in numbers allowed)."""

    def term(answer: str, task: Any, env: Any) -> float:
        text = answer.strip().replace(",", "")
        if not re.fullmatch(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?", text):
            return 0.0
        return float(abs(float(text) - float(expected(task))) <= tol)

    term.__name__ = name
    return term


def used_tool(tool_name: str, name: str | None = None) -> VerifierFn:
    """A term: 1 when the env's ``tool_calls`` (a list of called tool names) contains ``tool_name``."""

    def term(answer: str, task: Any, env: Any) -> float:
        return float(tool_name in getattr(env, "tool_calls", ()))

    term.__name__ = name or f"used_{tool_name}"
    return term
