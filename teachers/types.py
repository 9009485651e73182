"""Contracts of the Teacher Manager: teacher specs, routes, scoring requests and results, the scorer protocol.

``teachers`` imports nothing of ours (docs/architecture.md): it scores through any object with the engine's
``score`` method (:class:`Scorer`), built by a factory the caller injects, so the same manager drives the embedded
CPU engine and SGLang servers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

MixMode = Literal["probs", "sample"]
"""How a route with several teachers combines them: per-token mixture of their probabilities (``probs``), or one
teacher per sequence drawn by weight (``sample``; the only mode that keeps top-k lists exact)."""
ReleaseMode = Literal["free", "offload"]
"""What happens to an idle teacher over the budget: closed and freed (weights stay on disk, reloaded on demand), or
offloaded by a scorer that supports it (GPU -> CPU memory) and restored on demand."""
DEFAULT_ROUTE = "default"
"""The route tag that catches data sources none of whose tags has a route."""


class TeacherError(ValueError):
    """A teacher set-up that cannot work (missing model, route to an unknown teacher, tokenizer mismatch...)."""


@dataclass(frozen=True)
class TeacherSpec:
    """One teacher: a name and either a local Hugging Face model directory or an SGLang server URL.

    ``tokenizer`` is the directory holding its ``tokenizer.json`` (default: ``path``); a URL teacher needs one so
    that its tokenizer can be checked against the student's before a job starts.
    """

    name: str
    path: str | None = None
    url: str | None = None
    tokenizer: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise TeacherError(f"a teacher needs a non-empty name, got {self.name!r}")
        if (self.path is None) == (self.url is None):
            raise TeacherError(f"teacher {self.name!r}: give exactly one of path (model directory) or url (server)")

    @property
    def tokenizer_dir(self) -> str | None:
        return self.tokenizer or self.path


@dataclass(frozen=True)
class Route:
    """Data sources carrying ``tag`` are scored by these teachers, with these weights (normalised to sum 1)."""

    tag: str
    weights: tuple[tuple[str, float], ...]
    mix: MixMode = "probs"

    def __post_init__(self) -> None:
        if not self.weights:
            raise TeacherError(f"route {self.tag!r} names no teacher")
        for name, w in self.weights:
            if not isinstance(w, int | float) or isinstance(w, bool) or not w > 0:
                raise TeacherError(f"route {self.tag!r}: weight of teacher {name!r} must be > 0, got {w!r}")
        names = [n for n, _ in self.weights]
        if len(set(names)) != len(names):
            raise TeacherError(f"route {self.tag!r} names a teacher twice: {names}")
        total = sum(w for _, w in self.weights)
        object.__setattr__(self, "weights", tuple((n, float(w) / total) for n, w in self.weights))

    @property
    def teachers(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.weights)


class ScoreOutput(Protocol):
    """What a scorer returns: ``logprobs[i]`` of ``ids[start + i]``; ``top_logprobs[i]`` its (id, log-prob) list."""

    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None


@runtime_checkable
class Scorer(Protocol):
    """A loaded teacher: the inference engine's scoring method (prompt log-probs), and a way to free it."""

    def score(self, ids: list[int], start: int, top_k: int = 0) -> ScoreOutput: ...

    def close(self) -> None: ...


@runtime_checkable
class Offloadable(Protocol):
    """A scorer that can park its weights somewhere cheaper (GPU -> CPU) and bring them back."""

    def offload(self) -> None: ...

    def restore(self) -> None: ...


ScorerFactory = Callable[[TeacherSpec], Scorer]
"""Builds (loads) the scorer of a teacher; injected by the job (embedded engine, SGLang client, ...)."""


@dataclass
class ScoreRequest:
    """Score ``ids[start:]`` (each token given its prefix) for the data source tagged ``tags``."""

    key: str
    ids: list[int]
    tags: Sequence[str]
    start: int = 1


@dataclass
class TeacherScores:
    """A request's teacher log-probs, aligned with ``ids[start:]``, and the teachers (with weights) behind them."""

    key: str
    logprobs: list[float]
    teachers: dict[str, float]
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


@dataclass
class ManagerStats:
    """Counters of a :class:`~teachers.manager.TeacherManager`."""

    requests: int = 0
    sequences_scored: int = 0
    tokens_scored: int = 0
    loads: int = 0
    releases: int = 0
    restores: int = 0
    peak_resident: int = 0
    score_s: float = 0.0
    load_s: float = 0.0
    per_teacher: dict[str, int] = field(default_factory=dict)
