"""HTTP manners of ``agentflow serve``: the event loop stays free while a huge prompt is tokenized, bodies over the
request-size limit get a JSON 413, bodies that are not UTF-8 a JSON 400."""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from agentflow.engine import server_base
from agentflow.engine.background import ServerThread
from agentflow.engine.embedded import EmbeddedEngine
from agentflow.engine.launch import start_servers, stop_servers
from agentflow.model_init import ModelInitConfig, init_model

KEY = "k"
LIMIT = 1 << 20  # in-process server's request-size limit
WORDS = "the value of the sum is 12345 and the answer is what you compute first then final\n"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    init_model(path, ModelInitConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=176))
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    eng = EmbeddedEngine(model_dir, max_slots=4, max_len=256, seed=0)
    srv = ServerThread(eng, api_key=KEY, max_request_bytes=LIMIT)
    yield srv
    srv.close()
    eng.close()


def post(srv: ServerThread, path: str, data: Any, headers: dict[str, str] | None = None) -> tuple[int, str, Any]:
    """POST raw ``data`` (bytes, or an async iterator for a chunked body); (status, content type, reply)."""

    async def go() -> tuple[int, str, Any]:
        hdrs = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}", **(headers or {})}
        async with aiohttp.ClientSession() as s, s.post(srv.url + path, data=data, headers=hdrs) as r:
            text = await r.text()
            ctype = r.headers.get("Content-Type", "")
            return r.status, ctype, json.loads(text) if "json" in ctype else text

    return asyncio.run(go())


def padded(body: dict[str, Any], size: int) -> bytes:
    """``body`` as JSON padded with trailing whitespace to exactly ``size`` bytes (still valid JSON)."""
    raw = json.dumps(body).encode()
    assert len(raw) <= size
    return raw + b" " * (size - len(raw))


def message(reply: Any) -> str:
    assert isinstance(reply, dict) and isinstance(reply.get("error"), dict), reply
    return reply["error"]["message"]


# ------------------------------------------------------------------------------------------ request-size limit


def test_body_at_the_limit_is_served_and_one_byte_more_gets_a_json_413(server) -> None:
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
    status, _, reply = post(server, "/generate", padded(body, LIMIT))
    assert status == 200, reply
    assert reply["meta_info"]["prompt_tokens"] == 3

    status, ctype, reply = post(server, "/generate", padded(body, LIMIT + 1))
    assert status == 413 and "application/json" in ctype, (status, reply)
    assert "1 MiB (1048576 bytes)" in message(reply) and "--max-request-mb" in message(reply)

    status, _, reply = post(server, "/generate", json.dumps(body).encode())  # and the server goes on serving
    assert status == 200, reply


def test_a_chunked_body_over_the_limit_gets_the_same_json_413(server) -> None:
    async def chunks():  # no Content-Length: aiohttp finds out while reading, and raises its own (text) 413
        yield b'{"input_ids": [1, 2, 3]'
        for _ in range(LIMIT // (64 << 10) + 1):
            yield b" " * (64 << 10)
        yield b"}"

    status, ctype, reply = post(server, "/generate", chunks())
    assert status == 413 and "application/json" in ctype, (status, reply)
    assert "1 MiB (1048576 bytes)" in message(reply)


def test_the_limit_is_an_option_of_agentflow_serve() -> None:
    from agentflow.cli import _parser

    assert _parser().parse_args(["serve", "m"]).max_request_mb == 64.0
    assert _parser().parse_args(["serve", "m", "--max-request-mb", "0.5"]).max_request_mb == 0.5
    for bad in ("0", "-1", "x", "inf"):
        with pytest.raises(SystemExit):
            _parser().parse_args(["serve", "m", "--max-request-mb", bad])


# --------------------------------------------------------------------------------------------- bodies not UTF-8


@pytest.mark.parametrize("path", ["/generate", "/update_weight_version", "/abort_request"])
def test_a_body_that_is_not_utf8_gets_a_json_400(server, path) -> None:
    raw = b'\xff\xfe{"input_ids": [1, 2, 3]}'  # a UTF-16 byte-order mark: not JSON's encoding
    status, ctype, reply = post(server, path, raw)
    assert status == 400 and "application/json" in ctype, (status, reply)
    assert reply["object"] == "error" and reply["code"] == 400
    assert "not UTF-8" in reply["message"] and "0xff at offset 0" in reply["message"]

    latin1 = json.dumps({"text": "caf\u00e9"}, ensure_ascii=False).encode("latin-1")
    status, _, reply = post(server, path, latin1, {"Content-Type": "application/json; charset=latin-1"})
    assert status == 400 and "not UTF-8" in reply["message"], (status, reply)


def test_malformed_json_still_gets_the_validation_400(server) -> None:
    status, _, reply = post(server, "/generate", b'{"input_ids": [1, 2')
    assert status == 400 and "JSON decode error" in reply["message"], (status, reply)


# ------------------------------------------------------------------------------- work on the worker threads


def test_large_bodies_and_long_outputs_take_the_worker_thread_path_with_the_same_results(server, monkeypatch) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(server.engine.model_dir) / "tokenizer.json"))
    text = "<|im_start|>user\nwhat is 12 + 30?<|im_end|>\n"
    sampling = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    small = json.dumps({"text": text, "sampling_params": sampling}).encode()
    big = padded({"text": text, "sampling_params": sampling}, server_base.OFFLOAD_BYTES + 1)
    monkeypatch.setattr(server_base, "OFFLOAD_TOKENS", 1)  # detokenize every reply on a worker thread too
    replies = [post(server, "/generate", raw) for raw in (small, big)]
    for status, _, reply in replies:
        assert status == 200, reply
        assert reply["meta_info"]["prompt_tokens"] == len(tok.encode(text).ids)
        assert reply["text"] == tok.decode(reply["output_ids"])
    assert replies[0][2]["output_ids"] == replies[1][2]["output_ids"]


# ------------------------------------------------------------------ the event loop during a 4 MB prompt (real server)


@pytest.fixture(scope="module")
def served(model_dir):
    procs, urls = start_servers(model_dir, 1, KEY, max_slots=2, max_len=256, extra_args=["--max-request-mb", "8"])
    yield urls[0]
    stop_servers(procs)


def _health_ms(url: str) -> tuple[float, float]:
    t0 = time.perf_counter()
    with urllib.request.urlopen(url + "/health", timeout=30) as r:
        assert r.status == 200
    return t0, (time.perf_counter() - t0) * 1000


def test_health_answers_while_a_4mb_prompt_is_tokenized(served) -> None:
    text = (WORDS * (4_000_000 // len(WORDS) + 1))[:4_000_000]
    body = json.dumps({"text": text, "sampling_params": {"max_new_tokens": 1}}).encode()
    port = int(served.rsplit(":", 1)[1])
    head = (
        f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head + body)
        t_sent = time.perf_counter()
        answered: dict[str, Any] = {}

        def read_reply() -> None:
            data = sock.recv(1 << 16)
            answered["t"] = time.perf_counter()  # the first byte of the reply: the server is done with the request
            while chunk := sock.recv(1 << 16):
                data += chunk
            answered["reply"] = data

        reader = threading.Thread(target=read_reply)
        reader.start()
        probes = []
        while "t" not in answered:  # one probe every ~10 ms, spread over the whole request
            probes.append(_health_ms(served))
            time.sleep(0.01)
        reader.join(timeout=60)
    busy_ms = (answered["t"] - t_sent) * 1000
    during = [ms for t0, ms in probes if t0 < answered["t"]]  # probes sent while the big request was in progress
    status_line, _, rest = answered["reply"].partition(b"\r\n")
    reply = json.loads(rest.partition(b"\r\n\r\n")[2])
    # ~1M tokens: longer than the context, so a 400, but only after tokenizing the whole prompt
    assert status_line.split()[1] == b"400" and "longer than the model's context length" in message(reply), reply
    seen = f"/health during the {busy_ms:.0f} ms request: {len(during)} probes, {sorted(during)[-5:]} ms slowest"
    assert len(during) >= 3, seen
    assert statistics.median(during) < 100, seen
    # a loop blocked by the tokenizer leaves one probe waiting for most of the request (the median alone would
    # not show it: the probes made while the body is still being read are fast either way)
    assert max(during) < 0.5 * busy_ms, seen


def test_the_served_limit_comes_from_the_command_line(served) -> None:
    req = urllib.request.Request(served + "/generate", data=b" " * ((8 << 20) + 1), method="POST")
    req.add_header("Content-Type", "application/json")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    assert info.value.code == 413
    assert "8 MiB (8388608 bytes)" in message(json.loads(info.value.read()))
