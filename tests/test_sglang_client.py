"""SGLangEngine: parses recorded SGLang replies, and drives two of our servers (routing, pause, abort, updates)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading

import pytest
import torch
from test_server_fixtures import FIXTURES, load

from agentflow.config import EngineConfig
from agentflow.engine.background import ServerThread
from agentflow.engine.embedded import EmbeddedEngine
from agentflow.engine.factory import make_engine
from agentflow.engine.sglang_client import (
    SGLangEngine,
    SGLangRequestError,
    SGLangServerError,
    error_text,
    parse_generate_reply,
    parse_score_reply,
    sampling_json,
)
from agentflow.model_init import ModelInitConfig, init_model
from agentflow.types import InferenceEngine, SamplingParams
from transfer_mesh.transport import VersionRefused

KEY = "client-key"
LONG = SamplingParams(temperature=1.0, max_new_tokens=1500)
fixtures = pytest.mark.skipif(not FIXTURES.is_dir(), reason="SGLang fixtures not found")


# ------------------------------------------------------------------------------------ recorded replies


@fixtures
@pytest.mark.parametrize("prefix", ["05", "06", "09", "10", "12", "15", "20", "44", "50", "54"])
def test_parse_recorded_generate_replies(prefix) -> None:
    fx = load(prefix)
    res = parse_generate_reply(fx["response"])
    meta = fx["response"]["meta_info"]
    assert res.output_ids == fx["response"]["output_ids"] and res.rid == meta["id"]
    assert len(res.logprobs) == len(res.versions) == len(res.output_ids)
    assert res.finish_reason == meta["finish_reason"]["type"] and res.prompt_tokens == meta["prompt_tokens"]
    if "output_token_logprobs" in meta:
        assert res.logprobs == [t[0] for t in meta["output_token_logprobs"]]
    if prefix == "50":  # spans of two versions, v4 then v5-retract (foreign labels map to their first number)
        spans = meta["weight_versions"]
        assert res.versions[0] == 4 and res.versions.index(5) == spans[1]["start"] and res.versions[-1] == 5


@fixtures
def test_parse_recorded_scoring_stream_and_errors() -> None:
    score = parse_score_reply(load("12")["response"])
    assert len(score.logprobs) == 5 and score.weight_version == 0  # the first prompt token has no log-prob
    chunks = [json.loads(p) for p in load("14")["response"][:-1]]
    last = parse_generate_reply(chunks[-1])
    assert last.finish_reason == "length" and len(last.logprobs) == len(last.output_ids) == 6
    assert parse_generate_reply(json.loads(load("21")["response"][-2])).finish_reason == "abort"
    assert error_text(load("66")["response"]).startswith("max_new_tokens must be at least 0")
    assert error_text(load("69")["response"]).startswith("unknown field `max_tokens`")
    assert "validation error" in error_text(load("65")["response"])
    assert error_text(load("34")["response"]) == "Flush cache failed."
    assert error_text(load("39")["response"]).startswith("update_weights_from_tensor must run")


class FakeServer:
    """Serves recorded (status, content type, body) triples in order; ``None`` closes without answering."""

    def __init__(self, replies: list[dict | None]) -> None:
        self.replies = list(replies)
        self.requests: list[bytes] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while self.replies:
            conn, _ = self.sock.accept()
            with conn:
                data = conn.recv(1 << 20)
                while b"\r\n\r\n" not in data:
                    data += conn.recv(1 << 20)
                head, body = data.split(b"\r\n\r\n", 1)
                length = int(
                    next(
                        (ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")),
                        b"0",
                    )
                )
                while len(body) < length:
                    body += conn.recv(1 << 20)
                self.requests.append(body)
                fx = self.replies.pop(0)
                if fx is None:
                    continue
                payload = fx["response"] if isinstance(fx["response"], str) else json.dumps(fx["response"])
                ctype = f"Content-Type: {fx['content_type']}\r\n" if fx["content_type"] else ""
                raw = payload.encode()
                head = f"HTTP/1.1 {fx['status']} X\r\n{ctype}Content-Length: {len(raw)}\r\nConnection: close\r\n\r\n"
                conn.sendall(head.encode() + raw)


@fixtures
def test_client_over_recorded_transport() -> None:
    """Recorded replies through a socket: a result, an abort, error shapes, a dropped connection then a retry."""
    gen, aborted = load("05"), load("20")
    fake = FakeServer([gen, aborted, load("66"), None, load("19"), gen])  # drop, abort there, retry
    with SGLangEngine([fake.url], api_key=KEY, max_retries=1, health_interval=60) as client:
        res = client.generate_sync([5, 6, 7, 8, 9, 10], SamplingParams(max_new_tokens=8), rid="t:0")
        assert res.output_ids == gen["response"]["output_ids"] and res.versions == [0] * 8
        assert client.generate_sync([5], SamplingParams(), rid="t:1").finish_reason == "abort"
        with pytest.raises(SGLangRequestError, match="max_new_tokens"):
            client.generate_sync([5], SamplingParams(), rid="t:2")
        assert client.generate_sync([5], SamplingParams(), rid="t:3").output_ids == gen["response"]["output_ids"]
        sent = json.loads(fake.requests[0])
        assert sent["rid"] == "t:0" and sent["return_logprob"] is True
        assert sent["sampling_params"]["max_new_tokens"] == 8
        assert json.loads(fake.requests[4]) == {"rid": "t:3"}  # aborted where the connection broke


def test_unreachable_servers_raise() -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    with SGLangEngine([f"http://127.0.0.1:{port}"], max_retries=1, health_interval=60) as client:
        with pytest.raises(SGLangServerError, match="no server answered"):
            client.generate_sync([1, 2], SamplingParams(max_new_tokens=2))
        assert client.check_health() == [False]


# ----------------------------------------------------------------------------- against two of our servers


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_client")
    init_model(path, ModelInitConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=176))
    engines = [EmbeddedEngine(path, max_slots=8, max_len=2048, seed=i) for i in range(2)]
    servers = [ServerThread(e, api_key=KEY) for e in engines]
    client = SGLangEngine([s.url for s in servers], api_key=KEY, health_interval=0.5)
    yield client, engines, path
    client.close()
    for s, e in zip(servers, engines, strict=True):
        s.close()
        e.close()


async def started(engines: list[EmbeddedEngine], n: int) -> None:
    for _ in range(4000):
        if sum(e.stats()["running"] for e in engines) >= n and all(
            e.stats()["tokens_generated"] > 0 for e in engines if e.stats()["running"]
        ):
            await asyncio.sleep(0.05)
            return
        await asyncio.sleep(0.005)
    raise AssertionError("requests did not start")


def test_protocol_routing_and_prefix_cache(cluster) -> None:
    client, engines, _ = cluster
    assert isinstance(client, InferenceEngine) and client.check_health() == [True, True]
    sp = SamplingParams(temperature=0.0, max_new_tokens=6)

    async def main():
        ctx = {f"traj{i}": [5 + i, 6, 7, 8, 9, 10, 11, 12] for i in range(4)}
        first = await asyncio.gather(*(client.generate(c, sp, rid=f"{t}:0") for t, c in ctx.items()))
        ctx = {t: c + r.output_ids + [3, 4] for (t, c), r in zip(ctx.items(), first, strict=True)}
        second = await asyncio.gather(*(client.generate(c, sp, rid=f"{t}:1") for t, c in ctx.items()))
        return first, second

    first, second = asyncio.run(main())
    assert {client.server_of(f"traj{i}:0") for i in range(4)} == {0, 1}  # new trajectories spread out
    for r in second:  # the same server again: everything but the last sampled token was cached
        assert r.cached_tokens == 8 + 6 - 1
    local = engines[0].score([5, 6, 7, 8, 9, 10], 2, top_k=2)
    remote = client.score([5, 6, 7, 8, 9, 10], 2, top_k=2)
    torch.testing.assert_close(torch.tensor(remote.logprobs), torch.tensor(local.logprobs), atol=1e-5, rtol=0)
    assert [t for t, _ in remote.top_logprobs[0]] == [t for t, _ in local.top_logprobs[0]]


def test_abort_and_pause_modes(cluster) -> None:
    client, engines, _ = cluster

    async def main() -> None:
        task = asyncio.ensure_future(client.generate([5, 6, 7], LONG, rid="ab:0"))
        await started(engines, 1)
        await asyncio.to_thread(client.abort, "ab:0")
        res = await task
        assert res.finish_reason == "abort" and 0 < len(res.output_ids) < 1500
        tasks = [asyncio.ensure_future(client.generate([5, 6, 7], LONG, rid=f"pa{i}:0")) for i in range(4)]
        await started(engines, 4)
        await asyncio.to_thread(client.pause, "abort")
        done = await asyncio.gather(*tasks)
        assert all(r.finish_reason == "abort" and len(r.logprobs) == len(r.output_ids) > 0 for r in done)
        late = asyncio.ensure_future(client.generate([5, 6], SamplingParams(max_new_tokens=4), rid="late:0"))
        await asyncio.sleep(0.2)
        assert not late.done()  # paused servers queue new work
        await asyncio.to_thread(client.resume)
        assert (await late).finish_reason == "length"

    asyncio.run(main())


def test_weight_update_during_decoding(cluster) -> None:
    """Pause in place, push v1 to both servers, resume: every request returns once, later tokens are v1."""
    client, engines, path = cluster
    new = {k: v + 0.01 for k, v in engines[0].model.params.items()}

    async def main():
        rids = [f"wu{i}:0" for i in range(6)]
        sp = SamplingParams(temperature=1.0, max_new_tokens=600)
        tasks = [asyncio.ensure_future(client.generate([5, 6, 7, i], sp, rid=r)) for i, r in enumerate(rids)]
        await started(engines, 6)
        await asyncio.to_thread(client.pause, "in_place")
        await asyncio.to_thread(client.update_weights, 1, new)
        await asyncio.to_thread(client.resume)
        return rids, await asyncio.gather(*tasks)

    rids, results = asyncio.run(main())
    assert sorted(r.rid for r in results) == sorted(rids)  # none lost, none duplicated
    for r in results:
        assert r.finish_reason == "length" and len(r.output_ids) == 600
        k = r.versions.index(1)
        assert k > 0 and set(r.versions[:k]) == {0} and set(r.versions[k:]) == {1}
    assert client.weight_version == 1 and client.sync_version() == 1
    assert all(e.weight_version == 1 for e in engines)
    torch.testing.assert_close(engines[1].model.params["model.norm.weight"], new["model.norm.weight"])


def test_retry_on_a_dead_server_and_factory(cluster, tmp_path) -> None:
    client, engines, path = cluster
    with socket.create_server(("127.0.0.1", 0)) as s:
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    cfg = EngineConfig(type="sglang", urls=[dead, client.servers[0].url], api_key=KEY)
    other = make_engine(cfg, path)
    try:
        res = other.generate_sync([5, 6, 7], SamplingParams(max_new_tokens=3), rid="dead:0")
        assert res.finish_reason == "length" and other.servers[0].healthy is False
        assert other.server_of("dead:0") == 1
    finally:
        other.close()
    embedded = make_engine(EngineConfig(max_slots=2, max_len=64), path)
    try:
        assert isinstance(embedded, EmbeddedEngine) and embedded.max_slots == 2
    finally:
        embedded.close()
    with pytest.raises(ValueError, match="urls"):
        make_engine(EngineConfig(type="sglang"), path)


@pytest.mark.gpu
def test_real_sglang_server() -> None:
    """Against a real SGLang server named by AGENTFLOW_SGLANG_URL (started with the run's key, if any)."""
    url = os.environ.get("AGENTFLOW_SGLANG_URL")
    if not url:
        pytest.skip("set AGENTFLOW_SGLANG_URL to a running SGLang server")
    with SGLangEngine([url], api_key=os.environ.get("AGENTFLOW_ENGINE_KEY")) as client:
        assert client.check_health() == [True]
        res = client.generate_sync([1, 2, 3, 4], SamplingParams(temperature=0.0, max_new_tokens=8), rid="gpu:0")
        assert len(res.output_ids) == len(res.logprobs) == len(res.versions) > 0
        assert len(client.score([1, 2, 3, 4], 1).logprobs) == 3
        client.pause("in_place")
        client.resume()
        assert client.flush_cache()


# ------------------------------------------------------------------------- what real SGLang needs, on our server


def test_sampling_json_sets_ignore_eos_only_without_stop_ids() -> None:
    """SGLang's ``ignore_eos`` disables ``stop_token_ids`` too; our server follows it."""
    assert sampling_json(SamplingParams(stop_token_ids=()))["ignore_eos"] is True
    sp = sampling_json(SamplingParams(stop_token_ids=(7,)))
    assert sp["ignore_eos"] is False and sp["stop_token_ids"] == [7]


def test_score_positions_and_refused_updates(cluster) -> None:
    client, engines, path = cluster
    ids = [5, 6, 7, 8, 9, 10, 11]
    for start in (1, 3, 6):
        got = client.score(ids, start).logprobs
        assert len(got) == len(ids) - start
        torch.testing.assert_close(
            torch.tensor(got), torch.tensor(engines[0].score(ids, start).logprobs), atol=1e-5, rtol=0
        )
    assert client.speaks_transfer_mesh()  # ours verify buckets; a plain SGLang server is told apart by /server_info
    version = client.weight_version
    with pytest.raises(VersionRefused, match="not in the served model"):
        client.update_weights(version + 1, {"decoder.norm.weight": torch.ones(64)})
    assert client.sync_version() == version and all(e.weight_version == version for e in engines)
    stop = client.generate_sync([5, 6, 7], SamplingParams(max_new_tokens=8, stop_token_ids=tuple(range(1024))))
    assert stop.finish_reason == "stop" and len(stop.output_ids) == 1


def _reply(body: object, status: int = 200) -> dict:
    ctype = "application/json" if not isinstance(body, str) else "text/plain"
    return {"status": status, "content_type": ctype, "response": body}


def test_an_update_the_server_ignores_or_rejects_is_never_done() -> None:
    """A plain SGLang server that answers success but keeps its label, or refuses: the update raises, the client's
    version stays, and the server is told to continue either way."""
    from transfer_mesh.transport import WeightSyncError

    ok, info = (
        _reply({"success": True, "message": "Success"}),
        _reply({"model_path": "/nowhere", "weight_version": "4"}),
    )
    paused = _reply({"message": "Generation paused successfully.", "status": "ok"})
    ignored = [info, paused, ok, ok, ok, _reply("Cache flushed.\n"), info, paused]
    refused = [
        info,
        paused,
        ok,
        _reply({"success": False, "message": "Failed to update weights: boom"}, 400),
        ok,
        paused,
    ]
    for replies, error in ((ignored, WeightSyncError), (refused, VersionRefused)):
        fake = FakeServer(replies)
        with SGLangEngine([fake.url], health_interval=60) as client:
            with pytest.raises(error):
                client.update_weights(5, {"model.norm.weight": torch.ones(4)})
            assert client.weight_version == 0
        assert not fake.replies  # every call was made, /continue_generation last
