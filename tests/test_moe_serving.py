"""Routed experts over the SGLang protocol: ``return_routed_experts`` on ``agentflow serve``'s ``/generate`` and the
SGLang client's decoding of it (what routing replay takes from SGLang servers)."""

from __future__ import annotations

import pytest

from agentflow.engine.background import ServerThread
from agentflow.engine.embedded import EmbeddedEngine
from agentflow.engine.protocol import ProtocolError, decode_routed_experts, encode_routed_experts
from agentflow.engine.sglang_client import SGLangEngine, SGLangRequestError
from agentflow.model_init import ModelInitConfig, init_model
from agentflow.types import SamplingParams

MOE = ModelInitConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, arch="qwen3_moe", num_experts=4,
                      moe_intermediate_size=48, vocab_size=512)  # fmt: skip


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("moe"), MOE)


def test_codec_round_trip_and_errors() -> None:
    routes = [(0, [[1, 2], [0, 3]]), (2, [[3, 1], [2, 0]])]
    data = encode_routed_experts(routes, 3, 2, 2)
    assert decode_routed_experts(data, 2, 2) == routes  # position 1 (unknown, all -1) is left out
    with pytest.raises(ValueError, match="not a multiple"):
        decode_routed_experts(data, 5, 2)


def test_served_routes_match_the_engines_own(moe_dir) -> None:
    prompt = list(range(5, 30))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    with EmbeddedEngine(moe_dir, max_slots=2, max_len=128, seed=0) as direct:
        want = direct.generate_sync(prompt, greedy)
    assert want.routed_experts is not None
    assert {p for p, _ in want.routed_experts} == set(range(len(prompt) + len(want.output_ids) - 1))
    eng = EmbeddedEngine(moe_dir, max_slots=2, max_len=128, seed=0)
    srv = ServerThread(eng)
    client = SGLangEngine([srv.url], model_dir=moe_dir, routed_experts=True)
    try:
        got = client.generate_sync(prompt, greedy)
        assert got.output_ids == want.output_ids
        assert sorted(got.routed_experts or []) == sorted(want.routed_experts)
    finally:
        client.close()
        srv.close()
        eng.close()


def test_dense_models_refuse_routed_experts(tmp_path) -> None:
    dense = init_model(tmp_path / "dense", ModelInitConfig(hidden_size=32, num_hidden_layers=1, intermediate_size=48))
    eng = EmbeddedEngine(dense, max_slots=1, max_len=64, seed=0)
    srv = ServerThread(eng)
    client = SGLangEngine([srv.url], model_dir=dense, routed_experts=True)
    client._moe = (1, 2)  # as if the client thought the model were MoE: the server says it is not
    try:
        with pytest.raises((SGLangRequestError, ProtocolError), match="needs a mixture-of-experts model"):
            client.generate_sync([1, 2, 3], SamplingParams(max_new_tokens=2))
    finally:
        client.close()
        srv.close()
        eng.close()
