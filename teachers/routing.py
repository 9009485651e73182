"""Routing: which teacher(s) score a data source, from its tags; checks made before a job starts."""

from __future__ import annotations

import difflib
import hashlib
from collections.abc import Mapping, Sequence

from teachers.types import DEFAULT_ROUTE, MixMode, Route, TeacherError, TeacherSpec


def _did_you_mean(name: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def parse_routes(raw: Mapping[str, str | Mapping[str, float]], mix: MixMode = "probs") -> list[Route]:
    """Routes from config: ``{tag: teacher}`` or ``{tag: {teacher: weight, ...}}``."""
    routes = []
    for tag, target in raw.items():
        if isinstance(target, str):
            routes.append(Route(tag, ((target, 1.0),), mix))
        elif isinstance(target, Mapping):
            routes.append(Route(tag, tuple((str(k), v) for k, v in target.items()), mix))
        else:
            raise TeacherError(f"route {tag!r} must map to a teacher name or {{teacher: weight}}, got {target!r}")
    return routes


class Router:
    """Tags -> teachers. A source's first tag with a route wins; ``default`` catches the rest.

    Built only over known teachers: a route naming an unknown teacher is a :class:`TeacherError` with the known
    names (and a "did you mean").
    """

    def __init__(self, teachers: Sequence[TeacherSpec], routes: Sequence[Route]) -> None:
        names = [t.name for t in teachers]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise TeacherError(f"teacher names must be unique; repeated: {dupes}")
        if not teachers:
            raise TeacherError("no teachers configured (teachers.models is empty)")
        self.teachers = {t.name: t for t in teachers}
        self.routes: dict[str, Route] = {}
        for r in routes:
            if r.tag in self.routes:
                raise TeacherError(f"two routes for tag {r.tag!r}")
            for name in r.teachers:
                if name not in self.teachers:
                    raise TeacherError(
                        f"route {r.tag!r} -> unknown teacher {name!r}; teachers: {sorted(self.teachers)}."
                        + _did_you_mean(name, list(self.teachers))
                    )
            self.routes[r.tag] = r
        if not self.routes:
            raise TeacherError("no teacher routes configured (teachers.routes maps data-source tags to teachers)")

    def route(self, tags: Sequence[str], source: str = "") -> Route:
        """The route of a data source with ``tags``; a :class:`TeacherError` when none applies."""
        for tag in tags:
            if tag in self.routes:
                return self.routes[tag]
        if DEFAULT_ROUTE in self.routes:
            return self.routes[DEFAULT_ROUTE]
        what = f"data source {source!r}" if source else "a data source"
        raise TeacherError(
            f"{what} with tags {list(tags)} has no teacher route; routes: {sorted(self.routes)} "
            f"(tag the source, add a route, or a '{DEFAULT_ROUTE}' route)"
        )

    def assign(self, key: str, tags: Sequence[str]) -> dict[str, float]:
        """Teachers (with weights) that score sequence ``key``: all of the route's for ``probs``, or one drawn by
        weight from a stable hash of ``key`` for ``sample`` (the same sequence always gets the same teacher)."""
        r = self.route(tags)
        if r.mix == "probs" or len(r.weights) == 1:
            return dict(r.weights)
        return {self.pick(key, tags): 1.0}

    def pick(self, key: str, tags: Sequence[str]) -> str:
        """One teacher of the route, drawn by weight from a stable hash of ``key`` (whatever the mix mode): who
        generates sequence ``key`` when teachers, not the student, play it."""
        r = self.route(tags)
        u = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64
        acc = 0.0
        for name, w in r.weights:
            acc += w
            if u < acc:
                return name
        return r.weights[-1][0]

    def check_sources(self, sources: Mapping[str, Sequence[str]]) -> None:
        """Every data source (name -> tags) must have a route."""
        for name, tags in sources.items():
            self.route(tags, name)

    def used_teachers(self) -> list[str]:
        return sorted({n for r in self.routes.values() for n in r.teachers})
