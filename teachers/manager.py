"""The Teacher Manager: route sequences to teachers, score them in per-teacher batches under a memory budget.

At most ``max_resident`` teachers are loaded at once. A call to :meth:`TeacherManager.score` takes all queued work
(a training batch), groups it by teacher and orders the groups to minimise swaps: teachers already resident go
first, then the others, each loaded once, evicting a resident teacher that has no work left in this call (the least
recently used). So a call loads exactly the teachers it needs that were not resident, which is the fewest any order
can, and the teachers with the most work are loaded last, to stay resident for the next batch.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence

from teachers.routing import Router
from teachers.teacher import Teacher
from teachers.types import (
    ManagerStats,
    ReleaseMode,
    ScoreOutput,
    ScoreRequest,
    ScorerFactory,
    TeacherError,
    TeacherScores,
    TeacherSpec,
)


class TeacherManager:
    """Scores student sequences with the teachers their data sources route to, within a residency budget."""

    def __init__(
        self,
        specs: Sequence[TeacherSpec],
        router: Router,
        factory: ScorerFactory,
        max_resident: int = 2,
        release: ReleaseMode = "free",
        top_k: int = 0,
    ) -> None:
        if max_resident < 1:
            raise TeacherError(f"max_resident must be >= 1, got {max_resident}")
        if top_k < 0:
            raise TeacherError(f"top_k must be >= 0, got {top_k}")
        if top_k > 0:
            mixed = [r.tag for r in router.routes.values() if r.mix == "probs" and len(r.weights) > 1]
            if mixed:
                raise TeacherError(
                    f"routes {mixed} mix teachers per token (mix: probs), which is undefined for top-k lists; "
                    "use mix: sample (one teacher per sequence) with top_k > 0"
                )
        self.router = router
        self.teachers = {s.name: Teacher(s, factory) for s in specs}
        self.max_resident = max_resident
        self.release_mode: ReleaseMode = release
        self.top_k = top_k
        self.stats = ManagerStats()
        self._lock = threading.Lock()

    def resident(self) -> list[str]:
        """Names of the teachers whose weights are loaded now."""
        return [n for n, t in self.teachers.items() if t.resident]

    def plan(self, requests: Sequence[ScoreRequest]) -> tuple[list[dict[str, float]], list[tuple[str, list[int]]]]:
        """Each request's teachers (with weights), and the per-teacher batches in the order they will run."""
        assignments = [self.router.assign(r.key, r.tags) for r in requests]
        work: dict[str, list[int]] = {}
        for i, a in enumerate(assignments):
            for name in a:
                work.setdefault(name, []).append(i)
        resident = sorted((n for n in work if self.teachers[n].resident), key=lambda n: self.teachers[n].last_used)
        others = sorted((n for n in work if not self.teachers[n].resident), key=lambda n: (len(work[n]), n))
        return assignments, [(n, work[n]) for n in resident + others]

    def score(self, requests: Sequence[ScoreRequest]) -> list[TeacherScores]:
        """Teacher log-probs of every request (aligned with ``ids[start:]``), in the order given."""
        with self._lock:
            assignments, batches = self.plan(requests)
            outputs: list[dict[str, ScoreOutput]] = [{} for _ in requests]
            pending = {name for name, _ in batches}
            for name, idx in batches:
                scorer = self._make_resident(name, pending)
                t0 = time.perf_counter()
                for i in idx:
                    req = requests[i]
                    try:
                        outputs[i][name] = scorer.score(req.ids, req.start, self.top_k)
                    except Exception as e:
                        raise RuntimeError(f"teacher {name!r} failed to score {req.key!r}: {e}") from e
                    self.stats.tokens_scored += len(req.ids) - req.start
                self.stats.score_s += time.perf_counter() - t0
                self.stats.sequences_scored += len(idx)
                self.stats.per_teacher[name] = self.stats.per_teacher.get(name, 0) + len(idx)
                pending.discard(name)
            self.stats.requests += len(requests)
            return [_combine(r, a, o) for r, a, o in zip(requests, assignments, outputs, strict=True)]

    def _make_resident(self, name: str, pending: set[str]):
        """Load (or restore) teacher ``name``, first releasing idle teachers to stay within the budget."""
        teacher = self.teachers[name]
        if not teacher.resident:
            while len(self.resident()) >= self.max_resident:
                idle = [t for t in self.teachers.values() if t.resident and t.name not in pending]
                if not idle:  # cannot happen with resident-first ordering; kept as a guard
                    raise TeacherError(f"no idle teacher to release for {name!r} (budget {self.max_resident})")
                victim = min(idle, key=lambda t: t.last_used)
                victim.release(self.release_mode)
                self.stats.releases += 1
        t0 = time.perf_counter()
        scorer, action = teacher.acquire()
        if action:
            self.stats.load_s += time.perf_counter() - t0
            self.stats.loads += action == "load"
            self.stats.restores += action == "restore"
        self.stats.peak_resident = max(self.stats.peak_resident, len(self.resident()))
        return scorer

    def close(self) -> None:
        """Free every teacher."""
        with self._lock:
            for t in self.teachers.values():
                t.close()


def _combine(req: ScoreRequest, weights: dict[str, float], outputs: dict[str, ScoreOutput]) -> TeacherScores:
    """One request's result: a single teacher's output as is, or the per-token mixture ``log sum_i w_i p_i``."""
    n = len(req.ids) - req.start
    for name, out in outputs.items():
        if len(out.logprobs) != n:
            raise RuntimeError(f"teacher {name!r} returned {len(out.logprobs)} log-probs for {n} tokens of {req.key!r}")
    if len(outputs) == 1:
        (out,) = outputs.values()
        top_ids = top_lps = None
        if out.top_logprobs is not None:
            top_ids = [[int(t) for t, _ in row] for row in out.top_logprobs]
            top_lps = [[float(lp) for _, lp in row] for row in out.top_logprobs]
        return TeacherScores(req.key, list(out.logprobs), dict(weights), top_ids, top_lps)
    mixed = []
    for t in range(n):
        terms = [math.log(w) + outputs[name].logprobs[t] for name, w in weights.items()]
        hi = max(terms)
        mixed.append(hi + math.log(sum(math.exp(x - hi) for x in terms)))
    return TeacherScores(req.key, mixed, dict(weights))
