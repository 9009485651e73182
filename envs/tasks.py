"""Task sets (disjoint train/eval seed ranges) and data sources mixed by weight.

A :class:`TaskSet` names the seed range of each split; the ranges are checked disjoint when it is built, so no
eval task can ever be trained on. An episode seed (any non-negative int) maps into a split with
:meth:`TaskSet.task_seed`. Environments list their task sets in ``AgentEnv.task_sets``.

A :class:`DataSource` is one env id + task set + weight + tags (the tags are what teachers route on);
a :class:`DataMixture` draws ``(source, split, seed)`` deterministically by weight::

    mix = DataMixture([DataSource("agentflow/PyCode-v0", weight=2, tags=("code",)),
                       DataSource("agentflow/Retrieval-v0", tags=("qa",))], seed=0)
    draw = mix.draw(0)            # the same Draw for the same (seed, index), in any process
    env.reset(seed=draw.seed, options=draw.reset_options())
"""

from __future__ import annotations

import difflib
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from envs.errors import EnvError

SPLITS: tuple[str, ...] = ("train", "eval")
DEFAULT_TASK_SET = "default"


class TaskSetError(EnvError, ValueError):
    """A task set or data source that is not valid (overlapping splits, unknown task set, bad weight...)."""


def _check_range(name: str, split: str, r: range) -> None:
    if not isinstance(r, range) or r.step != 1 or r.start < 0 or len(r) == 0:
        raise TaskSetError(f"task set {name!r}: split {split!r} must be a non-empty range(start, stop) of seeds >= 0")


@dataclass(frozen=True)
class TaskSet:
    """A named family of tasks of one env, with one seed range per split (``train`` and ``eval`` at least).

    The ranges are pairwise disjoint (checked). ``task_types`` lists the kinds of task it contains (informative).
    """

    name: str
    splits: Mapping[str, range] = field(hash=False)
    task_types: tuple[str, ...] = ()
    description: str = ""

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise TaskSetError(f"task set name must be a non-empty string, got {self.name!r}")
        missing = [s for s in SPLITS if s not in self.splits]
        if missing:
            raise TaskSetError(f"task set {self.name!r} lacks split(s) {missing}; every task set has {list(SPLITS)}")
        for split, r in self.splits.items():
            _check_range(self.name, split, r)
        items = sorted(self.splits.items(), key=lambda kv: kv[1].start)
        for (a, ra), (b, rb) in zip(items, items[1:], strict=False):
            if rb.start < ra.stop:
                lo, hi = rb.start, min(ra.stop, rb.stop)
                raise TaskSetError(f"task set {self.name!r}: splits {a!r} and {b!r} overlap on seeds [{lo}, {hi})")
        object.__setattr__(self, "splits", dict(self.splits))
        object.__setattr__(self, "task_types", tuple(self.task_types))

    def seed_range(self, split: str) -> range:
        """The task seeds of ``split``; raises :class:`TaskSetError` for an unknown split."""
        try:
            return self.splits[split]
        except KeyError:
            raise TaskSetError(
                f"task set {self.name!r} has no split {split!r}; splits: {sorted(self.splits)}"
            ) from None

    def task_seed(self, seed: int, split: str = "train") -> int:
        """The task seed of episode ``seed`` in ``split`` (``start + seed % size``: always inside the split)."""
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise TaskSetError(f"episode seed must be an int >= 0, got {seed!r}")
        r = self.seed_range(split)
        return r.start + seed % len(r)

    def split_of(self, task_seed: int) -> str:
        """The split a task seed belongs to; raises :class:`TaskSetError` when it is in none."""
        for split, r in self.splits.items():
            if task_seed in r:
                return split
        raise TaskSetError(f"seed {task_seed} is in no split of task set {self.name!r}")


def simple_task_set(
    name: str = DEFAULT_TASK_SET,
    eval_size: int = 10_000,
    train_size: int = 1_000_000,
    offset: int = 0,
    task_types: Sequence[str] = (),
    description: str = "",
) -> TaskSet:
    """A task set with ``train = [offset, offset + train_size)`` and ``eval`` right after it."""
    train = range(offset, offset + train_size)
    return TaskSet(
        name, {"train": train, "eval": range(train.stop, train.stop + eval_size)}, tuple(task_types), description
    )


def lookup_task_set(task_sets: Mapping[str, TaskSet], name: str, owner: str) -> TaskSet:
    """``task_sets[name]``, or a :class:`TaskSetError` with the known names and a "did you mean"."""
    if name in task_sets:
        return task_sets[name]
    close = difflib.get_close_matches(name, list(task_sets), n=1, cutoff=0.6)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise TaskSetError(f"{owner} has no task set {name!r}; task sets: {sorted(task_sets) or 'none'}.{hint}")


def env_task_sets(env_id: str) -> dict[str, TaskSet]:
    """The task sets of registered env ``env_id`` (from its class when the entry point is one, else from an instance).

    Unknown ids raise the registry's :class:`~envs.errors.UnknownEnvError` (with "did you mean").
    """
    from envs.registry import _load_entry_point, spec

    env_spec = spec(env_id)
    creator = _load_entry_point(env_spec.entry_point)
    if isinstance(creator, type):
        return dict(getattr(creator, "task_sets", {}) or {})
    env = env_spec.make()
    try:
        return dict(getattr(env, "task_sets", {}) or {})
    finally:
        env.close()


@dataclass(frozen=True)
class DataSource:
    """One stream of tasks: env id + task set + weight + tags (what teachers route on) + env kwargs.

    Validated when built: the env id must be registered, the task set must exist, the weight must be > 0.
    ``name`` defaults to ``"ENV_ID:TASK_SET"``.
    """

    env_id: str
    task_set: str = DEFAULT_TASK_SET
    weight: float = 1.0
    tags: tuple[str, ...] = ()
    name: str = ""
    env_kwargs: dict[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if isinstance(self.weight, bool) or not isinstance(self.weight, int | float):
            raise TaskSetError(f"data source {self.env_id!r}: weight must be a number, got {self.weight!r}")
        if not math.isfinite(self.weight) or self.weight <= 0:
            raise TaskSetError(f"data source {self.env_id!r}: weight must be finite and > 0, got {self.weight}")
        tags = (self.tags,) if isinstance(self.tags, str) else tuple(self.tags)
        if not all(isinstance(t, str) and t for t in tags):
            raise TaskSetError(f"data source {self.env_id!r}: tags must be non-empty strings, got {self.tags!r}")
        object.__setattr__(self, "tags", tags)
        object.__setattr__(self, "weight", float(self.weight))
        object.__setattr__(self, "name", self.name or f"{self.env_id}:{self.task_set}")
        lookup_task_set(env_task_sets(self.env_id), self.task_set, f"environment {self.env_id!r}")

    def get_task_set(self) -> TaskSet:
        """The :class:`TaskSet` this source draws from."""
        return lookup_task_set(env_task_sets(self.env_id), self.task_set, f"environment {self.env_id!r}")


@dataclass(frozen=True)
class Draw:
    """One sampled episode: which source, which split, the episode seed and the task seed it maps to."""

    source: DataSource
    split: str
    seed: int
    task_seed: int

    @property
    def tags(self) -> tuple[str, ...]:
        """The source's tags."""
        return self.source.tags

    def reset_options(self) -> dict[str, Any]:
        """The ``options`` for ``env.reset(seed=self.seed, options=...)``."""
        return {"split": self.split, "task_set": self.source.task_set}


class DataMixture:
    """Sources sampled by weight, deterministically: draw ``i`` depends only on (``seed``, ``i``, split).

    Source names must be unique. Each split's draws use their own stream, so adding eval draws never shifts the
    training stream.
    """

    def __init__(self, sources: Sequence[DataSource], seed: int = 0) -> None:
        if not sources:
            raise TaskSetError("a data mixture needs at least one data source")
        names = [s.name for s in sources]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise TaskSetError(f"data source names must be unique; repeated: {dupes} (set name=... to tell them apart)")
        self.sources = tuple(sources)
        self.seed = int(seed)
        self._task_sets = {s.name: s.get_task_set() for s in self.sources}
        total = sum(s.weight for s in self.sources)
        acc, self._cum = 0.0, []
        for s in self.sources:
            acc += s.weight / total
            self._cum.append(acc)

    @property
    def probabilities(self) -> dict[str, float]:
        """Each source's share of the draws (weights normalised)."""
        total = sum(s.weight for s in self.sources)
        return {s.name: s.weight / total for s in self.sources}

    def draw(self, index: int, split: str = "train") -> Draw:
        """Draw number ``index`` of ``split``: a source chosen by weight and an episode seed."""
        if index < 0:
            raise TaskSetError(f"draw index must be >= 0, got {index}")
        rng = random.Random(f"{self.seed}:{split}:{index}")
        u = rng.random()
        pos = next((i for i, c in enumerate(self._cum) if u < c), len(self.sources) - 1)
        source = self.sources[pos]
        seed = rng.randrange(2**31)
        return Draw(source, split, seed, self._task_sets[source.name].task_seed(seed, split))

    def take(self, n: int, split: str = "train", start: int = 0) -> list[Draw]:
        """Draws ``start .. start + n - 1`` of ``split``."""
        return [self.draw(i, split) for i in range(start, start + n)]

    def by_tag(self, tag: str) -> list[DataSource]:
        """The sources carrying ``tag``."""
        return [s for s in self.sources if tag in s.tags]


def task_hash(*parts: object) -> int:
    """A fixed, arbitrary-looking function of a task's identity, the same in every process (unlike Python's salted
    ``hash``): what picks a scripted expert's systematic mistakes."""
    h = 1_469_598_103
    for ch in "|".join(map(str, parts)):
        h = (h * 1_099_511_628_211 + ord(ch)) % 2**61
    return h


def misread(digits: str, salt: int) -> str:
    """``digits`` with its last digit read as another digit; ``salt`` (a :func:`task_hash` of the task) picks which.
    Never the right digit, and a model imitating it cannot tell which wrong one: so a warm-up keeps some probability
    on the right digit for RL to find."""
    last = int(digits[-1])
    return digits[:-1] + str((last + 1 + salt % 9) % 10)
