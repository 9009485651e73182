"""Label selectors per role (agentflow/ray_nodes.py): syntax, matching, refusals, and the node report's bookkeeping."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from agentflow.config import load_config
from agentflow.ray_nodes import PlacementError, actor_options, matches, require_matching_nodes, role_labels

ROLE = "agentflow/role"


def _ray(**labels: dict[str, str]) -> SimpleNamespace:
    return SimpleNamespace(**{f"{r}_labels": labels.get(r, {}) for r in ("trainer", "engine", "env_worker")})


@pytest.mark.parametrize(
    ("selector", "labels", "expected"),
    [
        ({ROLE: "rollout"}, {ROLE: "rollout"}, True),
        ({ROLE: "rollout"}, {ROLE: "trainer"}, False),
        ({ROLE: "rollout"}, {}, False),  # a missing label fails a positive term
        ({ROLE: "!trainer"}, {ROLE: "rollout"}, True),
        ({ROLE: "!trainer"}, {}, True),  # ... and satisfies a negative one
        ({ROLE: "!trainer"}, {ROLE: "trainer"}, False),
        ({ROLE: "in(a, b)"}, {ROLE: "b"}, True),
        ({ROLE: "in(a,b)"}, {ROLE: "c"}, False),
        ({ROLE: "!in(a,b)"}, {ROLE: "c"}, True),
        ({ROLE: "rollout", "zone": "z1"}, {ROLE: "rollout", "zone": "z2"}, False),  # every key must hold
        ({}, {ROLE: "x"}, True),
    ],
)
def test_selector_matching(selector: dict, labels: dict, expected: bool) -> None:
    assert matches(selector, labels) is expected


def test_malformed_selectors_are_refused_naming_the_key() -> None:
    with pytest.raises(PlacementError, match=r"ray\.engine_labels"):
        role_labels(_ray(engine={ROLE: "in()"}))
    with pytest.raises(PlacementError, match=r"ray\.trainer_labels"):
        role_labels(_ray(trainer={"bad key": "x"}))
    assert role_labels(_ray(env_worker={ROLE: "!in(a,b)"}))["env_worker"] == {ROLE: "!in(a,b)"}


def test_a_selector_no_live_node_matches_is_refused_with_the_nodes_labels() -> None:
    nodes = {"n1": {ROLE: "head", "ray.io/node-id": "n1"}, "n2": {ROLE: "rollout"}}
    require_matching_nodes({"engine": {ROLE: "rollout"}, "trainer": {}}, nodes)
    with pytest.raises(PlacementError, match=r"ray\.trainer_labels .* match no node.*agentflow/role=head"):
        require_matching_nodes({"engine": {}, "trainer": {ROLE: "trainer"}}, nodes)


def test_replace_falls_back_to_any_node_and_wait_does_not() -> None:
    assert actor_options({ROLE: "r"}, "replace") == {
        "label_selector": {ROLE: "r"},
        "fallback_strategy": [{"label_selector": {}}],
    }
    assert actor_options({ROLE: "r"}, "wait") == {"label_selector": {ROLE: "r"}}


def test_config_declares_the_placement_keys() -> None:
    cfg = load_config(None, ["ray.engine_labels={agentflow/role: rollout}", "ray.on_node_loss=wait"])
    assert cfg.ray.engine_labels == {ROLE: "rollout"} and cfg.ray.on_node_loss == "wait"
    with pytest.raises(Exception, match="on_node_loss"):
        load_config(None, ["ray.on_node_loss=sometimes"])
