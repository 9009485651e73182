"""The SGLang client and transports against a live SGLang 0.5.23 server (CPU, tiny model; tests/sglang_live.py).

Reference log-probs come from the embedded engine on the same weights (it matches the trainer to ~1e-6). Weight
updates are checked by what the server then computes: a probe's log-probs equal the new weights' within 1e-4 and
differ from the old ones', also for a prompt whose KV the radix cache held before the update (no stale KV).
"""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch
from safetensors.torch import load_file

from agentflow.engine.embedded import EmbeddedEngine
from agentflow.engine.sglang_client import SGLangEngine
from agentflow.types import SamplingParams
from transfer_mesh.transport import VersionRefused, make_transport

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(600)]
PROBE = [5, 17, 33, 101, 7, 250, 12, 64, 9, 300, 41, 8]
VERSIONS = itertools.count(101)  # labels this module gives the server, never reused
TOL = 1e-4


def base_weights(model_dir) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def shifted(weights: dict[str, torch.Tensor], seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=gen) for k, v in weights.items()}


def reference(model_dir, weights: dict[str, torch.Tensor] | None = None) -> EmbeddedEngine:
    engine = EmbeddedEngine(model_dir, max_slots=1, max_len=256, prefix_cache=False)
    if weights is not None:
        engine.update_weights(1, weights)
    return engine


def _diff(a, b) -> float:
    return float((torch.as_tensor(a) - torch.as_tensor(b)).abs().max())


def probe(engine, ids=PROBE) -> torch.Tensor:
    return torch.tensor(engine.score(list(ids), 1).logprobs)


@pytest.fixture(scope="module")
def live(sglang_server):
    """A client on the live server, which first gets the base weights back (another module may have trained)."""
    client = SGLangEngine([sglang_server.url], model_dir=sglang_server.model_dir)
    client.update_weights(next(VERSIONS), base_weights(sglang_server.model_dir))
    ref = reference(sglang_server.model_dir)
    yield client, sglang_server, ref
    ref.close()
    client.close()


# ----------------------------------------------------------------------------------------------- generation


def test_generate_logprobs_and_stop_ids(live) -> None:
    client, _, ref = live
    prompt = [5, 6, 7, 8, 9, 10]
    res = client.generate_sync(prompt, SamplingParams(temperature=1.0, max_new_tokens=16), rid="gen:0")
    assert res.finish_reason == "length" and len(res.output_ids) == len(res.logprobs) == 16  # no stop ids: length
    expected = ref.score(prompt + res.output_ids, len(prompt)).logprobs
    torch.testing.assert_close(torch.tensor(res.logprobs), torch.tensor(expected), atol=TOL, rtol=0)
    print(f"behaviour log-probs: max |server - reference| {_diff(res.logprobs, expected):.2e}")
    stop = SamplingParams(temperature=1.0, max_new_tokens=16, stop_token_ids=tuple(range(1024)))
    res = client.generate_sync(prompt, stop, rid="gen:1")  # every id stops: the first token ends it
    assert res.finish_reason == "stop" and len(res.output_ids) == 1
    greedy = client.generate_sync(prompt, SamplingParams(temperature=0.0, max_new_tokens=8), rid="gen:2")
    cut = greedy.output_ids[2]
    res = client.generate_sync(prompt, SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(cut,)))
    assert res.finish_reason == "stop" and res.output_ids == greedy.output_ids[: greedy.output_ids.index(cut) + 1]


def test_seed_refused_when_the_server_ignores_it(live) -> None:
    client, _, _ = live
    with pytest.raises(ValueError, match="enable-deterministic-inference"):
        client.generate_sync([5, 6, 7], SamplingParams(max_new_tokens=2, seed=3))


def test_score_exact_positions(live) -> None:
    client, _, ref = live
    for start in (1, 2, 5, len(PROBE) - 1):
        got = client.score(PROBE, start, top_k=3)
        want = ref.score(PROBE, start, top_k=3)
        assert len(got.logprobs) == len(PROBE) - start
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=TOL, rtol=0)
        print(f"score from {start}: max |server - reference| {_diff(got.logprobs, want.logprobs):.2e}")
        assert [row[0][0] for row in got.top_logprobs] == [row[0][0] for row in want.top_logprobs]
    assert client.score(PROBE, len(PROBE)).logprobs == []


def test_multi_turn_resume_hits_the_cache(live) -> None:
    client, _, ref = live
    sp = SamplingParams(temperature=1.0, max_new_tokens=8)
    ctx = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    first = client.generate_sync(ctx, sp, rid="mt:0")
    ctx = ctx + first.output_ids + [3, 4, 5]  # the env's reply, then the next turn
    second = client.generate_sync(ctx, sp, rid="mt:1")
    assert second.cached_tokens >= 10
    expected = ref.score(ctx + second.output_ids, len(ctx)).logprobs
    torch.testing.assert_close(torch.tensor(second.logprobs), torch.tensor(expected), atol=TOL, rtol=0)


async def _wait_decoding(server, before: int) -> None:
    """Until the server logs decode progress made after ``before`` (its count then): requests are decoding."""
    for _ in range(600):
        if server.decode_logs() > before:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the requests did not start decoding within 30 s")


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_pause_and_continue(live, mode) -> None:
    client, server, _ = live
    n = 1800

    async def main():
        before = server.decode_logs()
        tasks = [
            asyncio.ensure_future(client.generate([5, 6, 7, i], SamplingParams(max_new_tokens=n))) for i in range(2)
        ]
        await _wait_decoding(server, before)
        await asyncio.to_thread(client.pause, mode)
        await asyncio.sleep(0.5)
        still = [not t.done() for t in tasks]
        await asyncio.to_thread(client.resume)
        return still, await asyncio.gather(*tasks)

    still, results = asyncio.run(main())
    for r in results:
        assert len(r.output_ids) == len(r.logprobs) == len(r.versions)
        if mode == "abort":
            assert r.finish_reason == "abort" and 0 < len(r.output_ids) < n
        else:
            assert all(still) and r.finish_reason == "length" and len(r.output_ids) == n


def test_abort_and_flush(live) -> None:
    client, server, _ = live

    async def main():
        before = server.decode_logs()
        task = asyncio.ensure_future(client.generate([5, 6, 7], SamplingParams(max_new_tokens=1800), rid="ab:0"))
        await _wait_decoding(server, before)
        await asyncio.to_thread(client.abort, "ab:0")
        return await task

    res = asyncio.run(main())
    assert res.finish_reason == "abort" and 0 < len(res.output_ids) < 1800
    assert client.flush_cache()


def test_teacher_scoring_by_url(live) -> None:
    """A teacher given by ``url`` scores through the live server: one log-prob per token, exactly positioned."""
    from agentflow.config import load_config
    from agentflow.teacher_scoring import make_scorer_factory
    from teachers.types import TeacherSpec

    client, server, ref = live
    factory = make_scorer_factory(load_config(None, []))
    scorer = factory(TeacherSpec("t", url=server.url, tokenizer=str(server.model_dir)))
    try:
        out = scorer.score(PROBE, 1, 2)
    finally:
        scorer.close()
    assert len(out.logprobs) == len(PROBE) - 1
    torch.testing.assert_close(torch.tensor(out.logprobs), probe(ref), atol=TOL, rtol=0)


# --------------------------------------------------------------------------------------------- weight updates


def _update_and_check(client, server, transport_cfg: dict, during_decode: bool, seed: int) -> None:
    """Send shifted weights through the transport (idle, or while requests decode), then check the server."""
    old = probe(client)
    client.score(PROBE, 1)  # the probe's KV now sits in the radix cache, computed by the old weights
    new = shifted(base_weights(server.model_dir), seed)
    version = next(VERSIONS)
    transport = make_transport(transport_cfg, [client])

    async def main():
        before = server.decode_logs()
        sp = SamplingParams(temperature=1.0, max_new_tokens=1200)
        tasks = [asyncio.ensure_future(client.generate([9, 8, 7, i], sp)) for i in range(3)] if during_decode else []
        if tasks:
            await _wait_decoding(server, before)
        await asyncio.to_thread(transport.send, version, new)
        return await asyncio.gather(*tasks)

    try:
        results = asyncio.run(main())
    finally:
        transport.close()
    for r in results:  # nothing lost: each request finished, its tokens stamped old then new
        assert r.finish_reason == "length" and len(r.output_ids) == 1200
        assert r.versions == sorted(r.versions) and r.versions[0] < version == r.versions[-1]
    with reference(server.model_dir, new) as ref_new:
        after, want = probe(client), probe(ref_new)
        torch.testing.assert_close(after, want, atol=TOL, rtol=0)  # the cached prefix was recomputed
        print(f"{transport_cfg['type']} update: probe max |server - new weights| {_diff(after, want):.2e}")
    assert (after - old).abs().max() > 1e-2
    assert client.weight_version == version and client.sync_version() == version


@pytest.mark.parametrize("during_decode", [False, True], ids=["idle", "mid_decode"])
@pytest.mark.parametrize("kind", ["http", "gloo"])
def test_weight_update(live, kind, during_decode) -> None:
    client, server, _ = live
    cfg = {"type": kind}
    transport = make_transport(cfg, [client])
    assert transport.protocol() == "sglang"  # auto: the plain server gets plain tensors
    transport.close()
    _update_and_check(client, server, cfg, during_decode, seed=len(kind) + 10 * during_decode)


def test_updates_the_server_would_skip_are_refused(live) -> None:
    """Unknown names, or TransferMesh buckets, would be answered 200 and skipped: they are refused before sending,
    and the server keeps its weights and its label."""
    client, server, _ = live
    before, label = probe(client), client.sync_version()
    weights = base_weights(server.model_dir)
    renamed = {k.replace("model.", "decoder."): v for k, v in weights.items()}
    for kind in ("http", "gloo"):
        transport = make_transport({"type": kind}, [client])
        try:
            with pytest.raises(VersionRefused, match="not in the served model"):
                transport.send(next(VERSIONS), renamed)
        finally:
            transport.close()
        transport = make_transport({"type": kind, "protocol": "transfer_mesh"}, [client])
        try:
            with pytest.raises(VersionRefused, match="plain SGLang server"):
                transport.send(next(VERSIONS), shifted(weights, 7))
        finally:
            transport.close()
    assert client.sync_version() == label
    torch.testing.assert_close(probe(client), before, atol=0, rtol=0)


# ------------------------------------------------------------------------------------------ constrained decoding


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"]}}}  # fmt: skip
BOOK = {"type": "function", "function": {"name": "book", "strict": True, "parameters": {
    "type": "object", "properties": {"people": {"type": "integer", "minimum": 1, "maximum": 12},
                                     "tags": {"type": "array", "items": {"enum": ["quiet", "late"]}},
                                     "vip": {"type": "boolean"}},
    "required": ["people", "tags", "vip"], "additionalProperties": False}}}  # fmt: skip
ANSWER = {"type": "object", "properties": {"answer": {"type": "integer"}, "why": {"type": "string"}},
          "required": ["answer", "why"], "additionalProperties": False}  # fmt: skip
CONSTRAINED = {
    "named": ([WEATHER, BOOK], {"mode": "required", "names": ["get_weather"]}, None),
    "strict": ([BOOK, WEATHER], {"mode": "required", "names": ["book"]}, None),
    "json_schema": ([], None, {"type": "json_schema", "schema": ANSWER, "strict": True}),
}


@pytest.mark.parametrize("case", list(CONSTRAINED))
def test_constrained_generation_is_schema_valid_and_replays_exactly(live, case) -> None:
    """Replies forced through the server's llguidance backend (a named tool call, a strict tool, a JSON schema):
    100 of 100 are schema-valid, our replay of the grammar allows every token the server sampled, and the server's
    log-probs are those of the masked distribution (what the trainer recomputes with the replayed masks)."""
    import json

    import jsonschema

    from agentflow.chat import ChatTokenizer
    from agentflow.structured import grammars_for, request_grammar

    client, server, ref = live
    client.update_weights(next(VERSIONS), base_weights(server.model_dir))  # earlier tests left other weights
    tok = ChatTokenizer(server.model_dir)
    tools, choice, fmt = CONSTRAINED[case]
    grammar = request_grammar(tools, choice, False, fmt, 96, lambda t: len(tok.encode(t)))
    prompt = tok.encode("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    sp = SamplingParams(temperature=1.0, max_new_tokens=96, stop_token_ids=tok.stop_ids, grammar=grammar.lark)

    async def many():
        sem = asyncio.Semaphore(8)

        async def one(i):
            async with sem:
                return await client.generate(prompt, sp, rid=f"grammar-{case}:{i}")

        return await asyncio.gather(*(one(i) for i in range(100)))

    results = client._run(many())
    grammars = grammars_for(str(server.model_dir))
    worst = 0.0
    for k, res in enumerate(results):
        if fmt is None:
            reply = tok.parse_reply_ids(res.output_ids)
            assert reply.error is None and len(reply.tool_calls) == 1, tok.decode(res.output_ids)
            tool = next(t for t in tools if t["function"]["name"] == choice["names"][0])
            assert reply.tool_calls[0].name == tool["function"]["name"]
            jsonschema.validate(reply.tool_calls[0].arguments, tool["function"]["parameters"])
        else:
            jsonschema.validate(json.loads(tok.decode(res.output_ids[:-1])), fmt["schema"])
        masks = grammars.replay(grammar.lark, res.output_ids, res.logprobs)  # raises if the server masked otherwise
        if k < 5:
            full = ref.score(prompt + res.output_ids, len(prompt), top_k=1024).top_logprobs
            for i, (t, lp) in enumerate(zip(res.output_ids, res.logprobs, strict=True)):
                row = dict(full[i])
                ok = [j for j in row if (int(masks[i, j // 32]) >> (j % 32)) & 1]
                want = row[t] - float(torch.logsumexp(torch.tensor([row[j] for j in ok]), 0))
                worst = max(worst, abs(want - lp))
    assert worst < TOL, worst
    print(f"{case}: 100 of 100 schema-valid; max |server - masked reference| log-prob {worst:.2e}")
