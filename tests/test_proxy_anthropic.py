"""The proxy's Anthropic Messages route driven by the real ``anthropic`` client (sync, async, streaming, tool use)
against the real embedded engine and the session's tool-calling model, a black-box agent on the Anthropic SDK, and
the request conversion and error shapes on their own."""

from __future__ import annotations

import asyncio
import json
import sys
from types import SimpleNamespace

import anthropic
import pytest
import requests
from test_proxy import GREEDY, Served
from test_proxy_model import MODEL, TOOLS, tool_model_dir

import envs
from agentflow.chat import IM_END, ChatTokenizer, render_conversation
from agentflow.engine.embedded import EmbeddedEngine
from agentflow.episode import EpisodeSpec, run_episode
from agentflow.proxy import BlackBoxTask, ProxyServer, anthropic_wire
from agentflow.proxy.runner import BlackBoxRunner, CallableProgram, SubprocessProgram
from agentflow.types import GenerateResult

pytestmark = pytest.mark.timeout(900)  # the tool model is trained on first use
CALC = [{"name": "calc", "description": "Evaluate an arithmetic expression.",
         "input_schema": TOOLS[0]["function"]["parameters"]}]  # fmt: skip
SYSTEM = "Answer the arithmetic question."
QUESTION = {"role": "user", "content": "What is 2 + 3?"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    s = Served(tool_model_dir(tmp_path_factory))
    yield s
    s.close()


def _client(served, tid: str, **kw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=served.proxy.anthropic_base_url(tid), api_key=served.proxy.api_key,
                               max_retries=0, **kw)  # fmt: skip


def _post(served, path: str, body, key: str | None = None, raw: str | None = None) -> requests.Response:
    headers = {"x-api-key": key or served.proxy.api_key, "anthropic-version": "2023-06-01",
               "content-type": "application/json"}  # fmt: skip
    data = raw if raw is not None else json.dumps(body)
    return requests.post(served.proxy.url + path, data=data, headers=headers, timeout=30)


def test_tool_use_round_trip_is_one_spliced_root_segment(served):
    """tool_use -> tool_result -> answer -> a new question: every call extends the root segment, and the engine
    consumed exactly the ids of the equivalent OpenAI conversation (first prompt, its outputs, the new messages)."""
    served.rec_engine.calls.clear()
    served.open("a-tools")
    client = _client(served, "a-tools")
    messages: list = [QUESTION]
    replies, sent = [], []
    for follow_up in ("And what is 2 + 3 again?", None):
        for _ in range(2):
            sent.append(list(messages))
            r = client.messages.create(model=MODEL, max_tokens=48, system=SYSTEM, messages=messages, tools=CALC)
            replies.append(r)
            messages.append({"role": "assistant", "content": r.content})
            if r.stop_reason != "tool_use":
                break
            results = [{"type": "tool_result", "tool_use_id": b.id, "content": "5"} for b in r.content
                       if b.type == "tool_use"]  # fmt: skip
            messages.append({"role": "user", "content": results})
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
    rec = served.close_session("a-tools")

    first, answer = replies[0], replies[1]
    [use] = first.content
    assert first.stop_reason == "tool_use" and first.stop_sequence is None and first.type == "message"
    assert use.type == "tool_use" and use.name == "calc" and use.input == {"expression": "2 + 3"}
    assert use.id.startswith("toolu_") and first.id.startswith("msg_") and first.role == "assistant"
    assert answer.stop_reason == "end_turn" and [b.type for b in answer.content] == ["text"]
    assert answer.content[0].text == "5" and replies[2].stop_reason == "tool_use" and len(replies) == 4
    assert rec.calls[0].reply["tool_calls"][0]["id"] == use.id  # the record holds the ids the program got

    summary = rec.summary()
    assert summary["segments"] == ["root"] and summary["tito_mismatch"] == 0
    assert summary["spliced_calls"] == len(rec.calls) - 1 == 3
    tok, engine_calls = served.tok, served.rec_engine.calls
    openai_first = [{"role": "system", "content": SYSTEM}, QUESTION]
    expected = tok.encode(render_conversation(openai_first, TOOLS, add_generation_prompt=True))
    for i, (inputs, res) in enumerate(engine_calls):
        if i > 0:  # only what the client added after echoing the reply, as OpenAI messages
            added = [m for m in sent[i][len(sent[i - 1]) + 1 :]]
            new = [{"role": "tool", "content": "5"} if isinstance(m["content"], list) else m for m in added]
            expected += tok.continuation_ids(new)
        assert inputs == expected, f"call {i} did not consume the spliced history"
        expected = expected + res.output_ids + (tok.encode(IM_END) if res.finish_reason == "length" else [])
    last = replies[-1].usage
    assert last.input_tokens + last.cache_read_input_tokens == len(engine_calls[-1][0])
    assert last.output_tokens == len(engine_calls[-1][1].output_ids)


def _tool_turn(served, tid: str) -> list:
    """The conversation after the first call's tool use (its answer is text) and that first reply."""
    served.open(tid)
    r = _client(served, tid).messages.create(model=MODEL, max_tokens=48, messages=[QUESTION], tools=CALC)
    result = {"type": "tool_result", "tool_use_id": r.content[0].id, "content": [{"type": "text", "text": "5"}]}
    return [QUESTION, {"role": "assistant", "content": r.content}, {"role": "user", "content": [result]}]


def test_streaming_text_and_tool_use_match_non_streaming(served):
    messages = _tool_turn(served, "a-plain")
    plain = _client(served, "a-plain").messages.create(model=MODEL, max_tokens=48, messages=messages, tools=CALC)
    rec_plain = served.close_session("a-plain")
    messages = _tool_turn(served, "a-stream")
    with _client(served, "a-stream").messages.stream(
        model=MODEL, max_tokens=48, messages=messages, tools=CALC
    ) as stream:
        deltas = list(stream.text_stream)
        final = stream.get_final_message()
    echoed = [*messages, {"role": "assistant", "content": final.content}, {"role": "user", "content": "Again?"}]
    _client(served, "a-stream").messages.create(model=MODEL, max_tokens=8, messages=echoed, tools=CALC)
    rec_stream = served.close_session("a-stream")
    assert "".join(deltas) == final.content[0].text == plain.content[0].text == "5"
    assert (
        final.stop_reason == plain.stop_reason == "end_turn" and final.usage.output_tokens == plain.usage.output_tokens
    )
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == len(rec_stream.calls[1].input_ids)
    assert rec_plain.calls[-1].output_ids == rec_stream.calls[1].output_ids  # greedy: the same tokens either way
    assert rec_stream.summary()["spliced_calls"] == 2 and rec_stream.tito_mismatch() == 0  # the streamed reply too

    async def tool_use_stream():  # the first call streamed: a tool_use block built from input_json_delta
        client = anthropic.AsyncAnthropic(base_url=served.proxy.anthropic_base_url("a-async"),
                                          api_key=served.proxy.api_key, max_retries=0)  # fmt: skip
        events = await client.messages.create(model=MODEL, max_tokens=48, messages=[QUESTION], tools=CALC, stream=True)
        return [e async for e in events]

    served.open("a-async")
    events = asyncio.run(tool_use_stream())
    rec = served.close_session("a-async")
    kinds = [e.type for e in events]
    assert kinds == ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]  # fmt: skip
    block, delta = events[1].content_block, events[2].delta
    assert block.type == "tool_use" and block.name == "calc" and block.input == {} and events[1].index == 0
    assert delta.type == "input_json_delta" and json.loads(delta.partial_json) == {"expression": "2 + 3"}
    assert events[4].delta.stop_reason == "tool_use" and events[4].usage.output_tokens == len(rec.calls[0].output_ids)
    assert events[0].message.usage.input_tokens == len(rec.calls[0].input_ids) and events[0].message.content == []
    assert rec.calls[0].reply["tool_calls"][0]["id"] == block.id


def test_raw_event_stream_follows_anthropics_framing(served):
    messages = _tool_turn(served, "a-raw")
    body = {"model": MODEL, "max_tokens": 48, "messages": messages, "tools": CALC, "stream": True}
    r = _post(served, "/a-raw/0/v1/messages", json.loads(json.dumps(body, default=lambda b: b.model_dump())))
    served.close_session("a-raw")
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    frames = [f for f in r.text.split("\n\n") if f]
    names = []
    for frame in frames:
        event, data = frame.split("\n")
        name = event.removeprefix("event: ")
        assert json.loads(data.removeprefix("data: "))["type"] == name  # every event names its type twice
        names.append(name)
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-2:] == ["message_delta",
                                                                                            "message_stop"]  # fmt: skip
    assert set(names[3:-3]) == {"content_block_delta"} and names[-3] == "content_block_stop"


def test_system_prompt_forms_render_alike(served):
    served.rec_engine.calls.clear()
    forms = {"str": SYSTEM, "blocks": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
             "two": [{"type": "text", "text": "Answer"}, {"type": "text", "text": "briefly."}]}  # fmt: skip
    for name, system in forms.items():
        served.open(f"a-sys-{name}")
        _client(served, f"a-sys-{name}").messages.create(model=MODEL, max_tokens=4, system=system, messages=[QUESTION])
        served.close_session(f"a-sys-{name}")
    served.open("a-sys-none")
    _client(served, "a-sys-none").messages.create(model=MODEL, max_tokens=4, messages=[QUESTION], tools=CALC)
    served.close_session("a-sys-none")
    tok, inputs = served.tok, [c[0] for c in served.rec_engine.calls]
    render = lambda msgs, tools=None: tok.encode(render_conversation(msgs, tools, add_generation_prompt=True))
    assert inputs[0] == inputs[1] == render([{"role": "system", "content": SYSTEM}, QUESTION])
    assert inputs[2] == render([{"role": "system", "content": "Answer\nbriefly."}, QUESTION])  # blocks: one per line
    assert inputs[3] == render([{"role": "system", "content": ""}, QUESTION], TOOLS)  # tools need a system message


def _body(**fields):
    return {"model": MODEL, "max_tokens": 8, "messages": [QUESTION], **fields}


def _user(*blocks):
    return [{"role": "user", "content": list(blocks)}]


INVALID = "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "raw", "status", "kind", "names"),
    [
        (None, "{not json", 400, INVALID, "JSON"),
        ({"model": MODEL, "messages": [QUESTION]}, None, 400, INVALID, "max_tokens"),
        (_body(max_tokens=0), None, 400, INVALID, "max_tokens"),
        (_body(messages=[]), None, 400, INVALID, "messages"),
        (_body(messages=_user({"type": "image", "source": {}})), None, 400, INVALID, "messages.0.content.0.type"),
        (_body(messages=_user({"type": "text"})), None, 400, INVALID, "messages.0.content.0.text"),
        (_body(messages=_user({"type": "text", "text": "x", "extra": 1})), None, 400, INVALID, "content.0.extra"),
        (_body(messages=_user("not a block")), None, 400, INVALID, "messages.0.content.0"),
        (_body(messages=[{"role": "system", "content": "x"}]), None, 400, INVALID, "messages.0.role"),
        (_body(messages=[QUESTION, {"role": "assistant", "content": "The answer is"}]), None, 400, INVALID, "prefill"),
        (_body(messages=_user({"type": "tool_use", "id": "t", "name": "calc", "input": {}})), None, 400, INVALID,
         "messages.0.content.0.type"),
        (_body(messages=_user({"type": "tool_result", "content": "5"})), None, 400, INVALID, "tool_use_id"),
        (_body(temperature=1.5), None, 400, INVALID, "temperature"),
        (_body(thinking={"type": "enabled", "budget_tokens": 1024}), None, 400, INVALID, "thinking"),
        (_body(n=2), None, 400, INVALID, "n:"),
        (_body(tools=[{"type": "web_search_20250305", "name": "web_search"}]), None, 400, INVALID, "tools.0.type"),
        (_body(tools=CALC + CALC), None, 400, INVALID, "unique"),
        (_body(tools=CALC, tool_choice={"type": "tool", "name": "nope"}), None, 400, INVALID, "tool_choice.name"),
        (_body(tool_choice={"type": "sometimes"}), None, 400, INVALID, "tool_choice.type"),
        (_body(model="claude-sonnet-4-5"), None, 404, "not_found_error", "claude-sonnet-4-5"),
    ],
)  # fmt: skip
def test_bad_requests_get_anthropic_errors_and_record_nothing(served, body, raw, status, kind, names):
    served.open("a-bad")
    try:
        r = _post(served, "/a-bad/0/v1/messages", body, raw=raw)
    finally:
        rec = served.close_session("a-bad")
    assert r.status_code == status
    err = r.json()
    assert set(err) == {"type", "error"} and err["type"] == "error" and set(err["error"]) == {"type", "message"}
    assert err["error"]["type"] == kind and names in err["error"]["message"]
    assert not rec.calls and not rec.segments


def test_sdk_raises_its_own_error_classes(served):
    served.open("a-sdk-err")
    client = _client(served, "a-sdk-err")
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": [{"type": "bogus"}]}])
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-opus-4-1", max_tokens=8, messages=[QUESTION])
    with pytest.raises(anthropic.BadRequestError) as extra:
        client.messages.create(model=MODEL, max_tokens=8, messages=[QUESTION], extra_body={"frobnicate": True})
    served.close_session("a-sdk-err")
    assert bad.value.body["error"]["type"] == "invalid_request_error" and "messages.0.content.0" in bad.value.message
    assert missing.value.body["error"]["type"] == "not_found_error"
    assert "frobnicate" in extra.value.body["error"]["message"]


def test_keys_trajectories_and_models(served):
    served.open("a-auth")
    assert _post(served, "/a-auth/0/v1/messages", {}, key="sk-wrong").json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=served.proxy.anthropic_base_url("a-auth"), api_key="sk-wrong",
                            max_retries=0).messages.create(model=MODEL, max_tokens=8, messages=[QUESTION])  # fmt: skip
    assert e.value.status_code == 401 and e.value.body["error"]["type"] == "authentication_error"
    body = {"model": MODEL, "max_tokens": 4, "messages": [QUESTION]}
    r = _post(served, "/a-auth/0/v1/messages", body)  # the key as x-api-key
    assert r.status_code == 200 and r.json()["type"] == "message"
    nobody = _post(served, "/nobody/0/v1/messages", body)
    assert nobody.status_code == 404 and nobody.json()["error"]["type"] == "not_found_error"
    wrong_path = _post(served, "/a-auth/0/v1/v1/messages", body)  # a base_url ending in /v1: Anthropic's shape
    assert wrong_path.status_code == 404 and wrong_path.json()["type"] == "error"
    models = _client(served, "a-auth").models.list()
    assert [m.id for m in models.data] == [MODEL] and models.data[0].type == "model"
    # The OpenAI routes are unchanged: OpenAI's error shape there.
    r = requests.post(served.proxy.url + "/a-auth/0/v1/chat/completions", json={}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert len(served.close_session("a-auth").calls) == 1


def test_wrong_paths_get_an_anthropic_clients_base_url_in_anthropics_shape(served):
    """A 404 on an Anthropic path names the base URL an Anthropic client needs (no /v1: the SDK appends
    /v1/messages), in Anthropic's error shape; a stale attempt's refusal names the current attempt's."""
    served.open("a-hint", attempt=1)
    try:
        body = {"model": MODEL, "max_tokens": 4, "messages": [QUESTION]}
        no_trajectory = _post(served, "/v1/messages", body)  # a job proxy serves no default trajectory
        no_attempt = _post(served, "/a-hint/v1/messages", body)
        doubled_v1 = _post(served, "/a-hint/1/v1/v1/messages", body)  # a base_url ending in /v1
        stale = _post(served, "/a-hint/0/v1/messages", body)
    finally:
        served.close_session("a-hint")
    for r in (no_trajectory, no_attempt, doubled_v1):
        assert r.status_code == 404 and r.json()["type"] == "error", r.text
        err = r.json()["error"]
        assert err["type"] == "not_found_error" and set(err) == {"type", "message"}
        assert "POST /v1/messages is served at /{trajectory_id}/{attempt}/v1/messages" in err["message"]
        assert "OpenAI" not in err["message"] and "/v1." not in err["message"]
    generic = f"An Anthropic client's base_url is {served.proxy.url}/{{trajectory_id}}/{{attempt}} (without /v1"
    assert generic in no_trajectory.json()["error"]["message"]
    own = f"This trajectory's base URL is {served.proxy.anthropic_base_url('a-hint', 1)} (without /v1"
    assert own in no_attempt.json()["error"]["message"] and own in doubled_v1.json()["error"]["message"]
    assert stale.status_code == 404 and stale.json()["type"] == "error"
    assert stale.json()["error"]["message"].endswith(f"base URL is {served.proxy.anthropic_base_url('a-hint', 1)}")


def test_max_tokens_stop_reason(served):
    served.open("a-len")
    r = _client(served, "a-len").messages.create(model=MODEL, max_tokens=2, messages=[QUESTION], tools=CALC)
    rec = served.close_session("a-len")
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 2 == len(rec.calls[0].output_ids)


def test_fields_the_openai_path_honours_are_honoured_here(served):
    """stop_sequences, tool_choice and structured tool inputs go through the OpenAI request, so they work alike."""
    runs = {"stop": {"stop_sequences": ["2 +"]}, "any": {"tool_choice": {"type": "any"}},
            "none": {"tool_choice": {"type": "none"}},
            "one": {"tool_choice": {"type": "tool", "name": "calc", "disable_parallel_tool_use": True}}}  # fmt: skip
    out = {}
    for name, fields in runs.items():
        served.open(f"a-opt-{name}")
        client = _client(served, f"a-opt-{name}")
        out[name] = client.messages.create(model=MODEL, max_tokens=40, messages=[QUESTION], tools=CALC, **fields)
        served.close_session(f"a-opt-{name}")
    stop = out["stop"]
    assert stop.stop_reason == "stop_sequence" and stop.stop_sequence == "2 +" and "2 +" not in stop.content[0].text
    assert out["any"].stop_reason == out["one"].stop_reason == "tool_use"
    assert out["none"].stop_reason == "end_turn" and all(b.type == "text" for b in out["none"].content)


def test_count_tokens(served):
    served.open("a-count")
    count = _client(served, "a-count").messages.count_tokens(
        model=MODEL, system=SYSTEM, messages=[QUESTION], tools=CALC
    )
    served.close_session("a-count")
    prompt = render_conversation([{"role": "system", "content": SYSTEM}, QUESTION], TOOLS, add_generation_prompt=True)
    assert count.input_tokens == len(served.tok.encode(prompt))


class _AbortingEngine:
    """An engine whose generation is aborted after two tokens (a weight update with ``partial: recycle`` off)."""

    weight_version = 0

    def __init__(self, tok: ChatTokenizer) -> None:
        self.tok = tok

    async def generate(self, input_ids, sampling, rid=None, on_token=None):
        ids = self.tok.encode("Hello there")
        for t in ids:
            on_token(t, -0.1, 0)
        return GenerateResult(rid or "r", ids, [-0.1] * len(ids), [0] * len(ids), "abort", len(input_ids))


def test_error_after_the_stream_began_is_an_error_event(tmp_path_factory):
    tok = ChatTokenizer(tool_model_dir(tmp_path_factory))

    async def go():
        async with ProxyServer(_AbortingEngine(tok), tok, MODEL) as proxy:
            rec = proxy.open("a-abort", GREEDY, 512)
            client = anthropic.AsyncAnthropic(base_url=proxy.anthropic_base_url("a-abort"), api_key=proxy.api_key,
                                              max_retries=0)  # fmt: skip
            seen = []
            with pytest.raises(anthropic.APIStatusError) as e:
                stream = await client.messages.create(model=MODEL, max_tokens=8, messages=[QUESTION], stream=True)
                async for event in stream:
                    seen.append(event.type)
            proxy.close("a-abort")
            return seen, e.value, rec

    seen, err, rec = asyncio.run(go())
    assert seen[:2] == ["message_start", "content_block_start"] and "message_stop" not in seen
    assert err.body["error"]["type"] == "overloaded_error" and "aborted" in err.body["error"]["message"]
    assert not rec.calls and rec.summary()["refused_calls"] == 1


def test_error_after_an_openai_stream_began_is_an_error_chunk_then_done(tmp_path_factory):
    """The OpenAI route's twin: the stream that began ends with an ``error`` data line and ``[DONE]``, and the
    openai client raises it; the call is counted refused, nothing recorded."""
    import openai

    tok = ChatTokenizer(tool_model_dir(tmp_path_factory))

    async def go():
        async with ProxyServer(_AbortingEngine(tok), tok, MODEL) as proxy:
            rec = proxy.open("o-abort", GREEDY, 512)
            client = openai.AsyncOpenAI(base_url=proxy.base_url("o-abort"), api_key=proxy.api_key, max_retries=0)
            seen = []
            with pytest.raises(openai.APIError) as e:
                stream = await client.chat.completions.create(model=MODEL, messages=[QUESTION], stream=True)
                async for chunk in stream:
                    seen.append(chunk.choices[0].delta.content if chunk.choices else None)
            proxy.close("o-abort")
            return seen, e.value, rec

    seen, err, rec = asyncio.run(go())
    assert seen and seen[0] == ""  # the role chunk: the stream had begun
    assert "aborted" in err.message and not rec.calls and rec.summary()["refused_calls"] == 1


class _SlowEngine:
    """An engine that streams a long text slowly and notes whether its generation was cancelled."""

    weight_version = 0

    def __init__(self, tok: ChatTokenizer) -> None:
        self.tok, self.cancelled = tok, asyncio.Event()

    async def generate(self, input_ids, sampling, rid=None, on_token=None):
        ids = self.tok.encode("Hello there, friend. " * 40)
        try:
            for t in ids:
                on_token(t, -0.1, 0)
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return GenerateResult(rid or "r", ids, [-0.1] * len(ids), [0] * len(ids), "length", len(input_ids))


@pytest.mark.parametrize("route", ["chat/completions", "messages"])
def test_a_client_that_leaves_mid_stream_cancels_its_generation(tmp_path_factory, route):
    """On either route: the generation is aborted, nothing is recorded, and the segment is free again."""
    import aiohttp

    tok = ChatTokenizer(tool_model_dir(tmp_path_factory))
    body = {"model": MODEL, "max_tokens": 400, "messages": [QUESTION], "stream": True}

    async def go():
        engine = _SlowEngine(tok)
        async with ProxyServer(engine, tok, MODEL) as proxy:
            rec = proxy.open("a-leave", GREEDY, 1024)
            headers = {"Authorization": f"Bearer {proxy.api_key}", "anthropic-version": "2023-06-01"}
            async with aiohttp.ClientSession() as session:
                resp = await session.post(f"{proxy.url}/a-leave/0/v1/{route}", json=body, headers=headers)
                for _ in range(6):  # a few events of the stream, then the client goes away
                    await resp.content.readline()
                resp.close()
            await asyncio.wait_for(engine.cancelled.wait(), 10)
            for _ in range(100):  # the handler unwinds after the generation's cancellation
                if proxy.in_flight == 0:
                    break
                await asyncio.sleep(0.01)
            assert proxy.in_flight == 0 and not rec.calls
            assert [o.busy for o in rec.open] == [] and rec._starting == 0
            proxy.close("a-leave")

    asyncio.run(go())


# ------------------------------------------------------------------------------------------- black-box agents


async def anthropic_agent(task: BlackBoxTask) -> str | None:
    """A tool agent on the Anthropic SDK: the env's tools through ``task.call_tool``, the final text its answer."""
    client = anthropic.AsyncAnthropic(base_url=task.anthropic_base_url, api_key=task.api_key, max_retries=0)
    system, messages = task.messages[0]["content"], [dict(m) for m in task.messages[1:]]
    for _ in range(task.max_turns):
        r = await client.messages.create(model=task.model, max_tokens=1024, system=system, messages=messages,
                                         tools=task.anthropic_tools())  # fmt: skip
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]})
        uses = [b for b in r.content if b.type == "tool_use"]
        if not uses:
            return "".join(b.text for b in r.content if b.type == "text")
        output, done = await task.call_tool(uses[0].name, uses[0].input)
        if done:
            return None
        messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                      "content": output}]})  # fmt: skip
    return None


def test_blackbox_agent_on_the_anthropic_sdk_yields_the_white_box_tokens(tmp_path_factory):
    model_dir = tool_model_dir(tmp_path_factory)
    tok = ChatTokenizer(model_dir)
    spec = EpisodeSpec("ep-a", "g0", 7, env_id="agentflow/Calc-v0")
    env = envs.make("agentflow/Calc-v0")

    async def go():
        with EmbeddedEngine(model_dir, max_slots=4, max_len=512) as engine:
            white = await run_episode(engine, tok, env, spec, GREEDY, 512)
        with EmbeddedEngine(model_dir, max_slots=4, max_len=512) as engine:  # a fresh one: no shared prefix cache
            async with ProxyServer(engine, tok) as proxy:
                runner = BlackBoxRunner(proxy, CallableProgram(anthropic_agent), 60.0, 512)
                black = await runner.run(env, spec, GREEDY)
        return white, black

    white, black = asyncio.run(go())
    env.close()
    assert black.status == white.status == "ok", black.error
    assert [s.kind for s in black.segments] == ["root"] and len(black.turns) == len(white.turns) == 2
    for field in ("token_ids", "loss_mask", "logprobs", "versions"):
        assert getattr(black.segments[0], field) == getattr(white.segments[0], field), field
    assert black.turns[0].observation == white.turns[0].observation == "5"
    assert black.reward == white.reward and black.info["answer"] == "5"
    assert black.info["tito_mismatch"] == 0 and black.info["spliced_calls"] == 1


def test_subprocess_agents_get_the_anthropic_environment():
    task = BlackBoxTask("t", "http://h/t/0/v1", "sk-1", "m", [], [], 1, "http://h/t/0/tools",
                        anthropic_base_url="http://h/t/0")  # fmt: skip
    code = "import os; print(*(os.environ['ANTHROPIC_' + k] for k in ('BASE_URL', 'API_KEY', 'MODEL')))"
    outcome = asyncio.run(SubprocessProgram([sys.executable, "-c", code])(task, 30.0))
    assert outcome.answer == "http://h/t/0 sk-1 m", outcome.error


# ------------------------------------------------------------------------------------------- the conversion


def test_request_becomes_the_openai_request_it_means():
    body = {
        "model": MODEL, "max_tokens": 16, "system": [{"type": "text", "text": "S"}], "tools": CALC,
        "tool_choice": {"type": "any"}, "stop_sequences": ["\n\n"], "temperature": 0.5, "metadata": {"user_id": "u"},
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "let me"},
                                              {"type": "tool_use", "id": "toolu_1", "name": "calc", "input": {"x": 1}},
                                              {"type": "tool_use", "id": "toolu_2", "name": "calc", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "1"},
                                         {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                                          "content": [{"type": "text", "text": "bad input"}]},
                                         {"type": "text", "text": "go on"}]},
        ],
    }  # fmt: skip
    out, wanted = anthropic_wire.to_openai(body)
    assert out["messages"] == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "let me", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "calc", "arguments": '{"x": 1}'}},
            {"id": "toolu_2", "type": "function", "function": {"name": "calc", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "1"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: bad input"},
        {"role": "user", "content": "go on"},
    ]  # fmt: skip
    assert out["tools"] == [{"type": "function", "function": {"name": "calc", "description": CALC[0]["description"],
                                                              "parameters": CALC[0]["input_schema"]}}]  # fmt: skip
    assert out["tool_choice"] == "required" and out["stop"] == ["\n\n"] and out["temperature"] == 0.5
    assert wanted == {"stop_sequences": ("stop", ["\n\n"])}
    named, _ = anthropic_wire.to_openai({**body, "tool_choice": {"type": "tool", "name": "calc"}})
    assert named["tool_choice"] == {"type": "function", "function": {"name": "calc"}}
    single, wanted = anthropic_wire.to_openai(
        {**body, "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}
    )
    assert single["tool_choice"] == "auto" and single["parallel_tool_calls"] is False
    assert wanted["tool_choice.disable_parallel_tool_use"] == ("parallel_tool_calls", False)
    assert anthropic_wire.to_openai({**body, "tool_choice": {"type": "none"}})[0]["tool_choice"] == "none"
    strict, _ = anthropic_wire.to_openai({**body, "tools": [{**CALC[0], "strict": True}]})
    assert strict["tools"][0]["function"]["strict"] is True
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    shaped, wanted = anthropic_wire.to_openai(
        {**body, "output_config": {"format": {"type": "json_schema", "schema": schema}}}
    )
    assert shaped["response_format"] == {"type": "json_schema", "json_schema": {"name": "output", "schema": schema,
                                                                                "strict": True}}  # fmt: skip
    assert "output_config.format" in wanted
    with pytest.raises(anthropic_wire.ProxyError, match="output_config.effort"):
        anthropic_wire.to_openai({**body, "output_config": {"effort": "high"}})


def test_fields_the_openai_path_does_not_take_up_are_refused(monkeypatch):
    """What the OpenAI request cannot carry is not honoured: refused, naming the Anthropic field."""
    body = {"model": MODEL, "max_tokens": 8, "messages": [QUESTION], "stop_sequences": ["END"], "top_k": 5}
    plain = SimpleNamespace()  # an OpenAI request that carries none of them
    monkeypatch.setattr(anthropic_wire.wire, "parse_request", lambda b: plain)
    with pytest.raises(anthropic_wire.ProxyError, match="top_k: not supported"):
        anthropic_wire.parse_request(body)
    with pytest.raises(anthropic_wire.ProxyError, match="stop_sequences: not supported"):
        anthropic_wire.parse_request({**body, "top_k": None})
    monkeypatch.setattr(anthropic_wire.wire, "parse_request", lambda b: SimpleNamespace(stop=("END",)))
    assert anthropic_wire.parse_request({**body, "top_k": None}).stop_sequences == ["END"]

    def refuse(b):
        raise anthropic_wire.wire.bad("only tool_choice 'auto' or 'none' is supported", "tool_choice")

    monkeypatch.setattr(anthropic_wire.wire, "parse_request", refuse)
    with pytest.raises(anthropic_wire.ProxyError) as e:
        anthropic_wire.parse_request({**body, "top_k": None, "tool_choice": {"type": "any"}, "tools": CALC})
    assert e.value.status == 400 and e.value.message.startswith("tool_choice: ")
    assert anthropic_wire.error_body(e.value)["error"]["type"] == "invalid_request_error"


def test_stop_reasons():
    reason = anthropic_wire.stop_reason
    call = {"content": "", "tool_calls": [{"id": "t", "function": {"name": "f", "arguments": {}}}]}
    assert reason(call, "stop", "", True, []) == ("tool_use", None)
    assert reason({"content": "ab"}, "length", "ab", False, ["b"]) == ("max_tokens", None)
    assert reason({"content": "x"}, "stop", "x END y STOP", False, ["STOP", "END"]) == ("stop_sequence", "END")
    assert reason({"content": "x END"}, "stop", "x END<|im_end|>", True, ["END"]) == ("end_turn", None)
    assert reason({"content": "x"}, "stop", "x", True, []) == ("end_turn", None)
