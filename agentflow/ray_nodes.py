"""Which Ray node each part of a job runs on: label selectors per role, and what a lost node took with it.

A role (``trainer``, ``engine``, ``env_worker``) with labels in the ``ray`` section is scheduled by Ray's label
selector instead of a placement-group bundle, so a user puts engines and env workers on rollout nodes and the trainer
on its own node. When every node matching a role's labels is gone, ``ray.on_node_loss`` decides: ``replace`` adds a
fallback that admits any node (Ray restarts the actor on a remaining node; a resumed job places its trainer there),
``wait`` leaves the actor pending until a matching node joins.

Selectors use Ray's syntax: ``value`` (equal), ``!value`` (not equal), ``in(a,b)`` and ``!in(a,b)``. They are checked
before the cluster is touched; under ``wait`` they are also matched against the live nodes, so a selector no node
satisfies fails the job at start with the nodes' labels in the message instead of an actor waiting forever.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

ROLES = ("trainer", "engine", "env_worker")
"""The job's actor roles, named as in the ``ray`` section's ``<role>_labels`` keys."""


class PlacementError(ValueError):
    """A label selector is malformed or matches no node; the message names the ``ray`` key."""


def role_labels(ray_cfg: Any) -> dict[str, dict[str, str]]:
    """The label selector of each role (empty: placed by ``ray.placement``), syntax-checked."""
    labels = {role: dict(getattr(ray_cfg, f"{role}_labels")) for role in ROLES}
    for role, selector in labels.items():
        for key, value in selector.items():
            if not key or not isinstance(value, str) or not _values(value)[1]:
                raise PlacementError(f"ray.{role}_labels: bad selector {key!r}: {value!r}")
        problem = _ray_check(selector)
        if problem:
            raise PlacementError(f"ray.{role}_labels: {problem}")
    return labels


def _ray_check(selector: dict[str, str]) -> str | None:
    """Ray's own validation of a selector, where this Ray version exposes it (else ours alone)."""
    try:
        from ray._private.label_utils import validate_label_selector
    except ImportError:  # pragma: no cover - a Ray without it: the actor call validates
        return None
    return validate_label_selector(selector) if selector else None


def _values(expr: str) -> tuple[bool, set[str]]:
    """``(negated, values)`` of one selector expression; empty values for a malformed one."""
    negated = expr.startswith("!")
    body = expr[1:] if negated else expr
    if body.startswith("in(") and body.endswith(")"):
        return negated, {v.strip() for v in body[3:-1].split(",") if v.strip()}
    return negated, ({body} if body else set())


def matches(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    """Whether a node with ``labels`` satisfies ``selector`` (every key; a missing label fails a positive term)."""
    for key, expr in selector.items():
        negated, values = _values(expr)
        present = labels.get(key) in values
        if present == negated:
            return False
    return True


def alive_nodes() -> dict[str, dict[str, str]]:
    """The cluster's live nodes: node id -> labels."""
    import ray

    return {n["NodeID"]: dict(n.get("Labels") or {}) for n in ray.nodes() if n.get("Alive")}


def require_matching_nodes(labels: dict[str, dict[str, str]], nodes: dict[str, dict[str, str]]) -> None:
    """Fail (naming the key and the nodes' labels) when a role's selector matches no live node."""
    for role, selector in labels.items():
        if selector and not any(matches(selector, node) for node in nodes.values()):
            seen = sorted(
                {f"{k}={v}" for node in nodes.values() for k, v in node.items() if not k.startswith("ray.io/")}
            )
            raise PlacementError(f"ray.{role}_labels {selector} match no node of the cluster (its labels: {seen})")


def actor_options(selector: dict[str, str], on_node_loss: str) -> dict[str, Any]:
    """Ray actor options that place an actor by ``selector`` (with the ``replace`` fallback to any node)."""
    opts: dict[str, Any] = {"label_selector": dict(selector)}
    if on_node_loss == "replace":
        opts["fallback_strategy"] = [{"label_selector": {}}]
    return opts


def node_report(
    start_nodes: dict[str, dict[str, str]], start: dict[str, list[str | None]], now: dict[str, list[str | None]]
) -> dict[str, Any]:
    """What changed between the job's start and now: nodes lost (with what of ours they held), actors moved, and where
    every actor runs now.

    ``start``/``now``: node id of each actor by role (None: the actor did not answer).
    """
    alive = alive_nodes()
    lost = []
    for node, labels in start_nodes.items():
        if node in alive:
            continue
        held = [f"{role} {i}" for role, ids in start.items() for i, n in enumerate(ids) if n == node]
        lost.append({"node": node, "labels": labels, "held": held})
    moved = []
    for role, ids in start.items():
        for i, (a, b) in enumerate(zip(ids, now.get(role, []), strict=False)):
            if a != b:
                moved.append({"actor": f"{role} {i}", "from": a, "to": b})
    return {
        "nodes_at_start": len(start_nodes),
        "nodes_now": len(alive),
        "nodes_lost": lost,
        "actors_moved": moved,
        "placement": now,
    }
