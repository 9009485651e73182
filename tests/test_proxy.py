"""The recording proxy driven by the real ``openai`` client (sync, async, streaming, tools) and by a third-party agent
framework (pydantic-ai) offline, against the real embedded engine and a tool-calling model made in the session."""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import Future

import openai
import pytest
import requests
from test_proxy_model import MODEL, TOOLS, tool_model_dir

from agentflow.chat import IM_END, ChatTokenizer, render_conversation
from agentflow.engine.embedded import EmbeddedEngine
from agentflow.proxy import SEGMENT_HEADER, ProxyServer
from agentflow.types import SamplingParams

pytestmark = pytest.mark.timeout(900)  # the tool model is trained on first use
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=48)


class Recording:
    """The real engine, with every call's input and result kept (what the engine consumed and produced)."""

    def __init__(self, engine: EmbeddedEngine) -> None:
        self.engine, self.calls = engine, []

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    @property
    def canonical_forcing(self) -> bool:
        return self.engine.canonical_forcing

    async def generate(self, input_ids, sampling, rid=None, on_token=None):
        res = await self.engine.generate(input_ids, sampling, rid, on_token=on_token)
        self.calls.append((list(input_ids), res))
        return res


class Served:
    """Engine + proxy on an event loop in a background thread, so sync clients can call from the test thread."""

    def __init__(self, model_dir, **proxy_kwargs) -> None:
        self.tok = ChatTokenizer(model_dir)
        self.engine = EmbeddedEngine(model_dir, max_slots=8, max_len=1024)
        self.rec_engine = Recording(self.engine)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.proxy = ProxyServer(self.rec_engine, self.tok, MODEL, **proxy_kwargs)
        self.call(self.proxy.start())

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def on_loop(self, fn, *args):
        fut: Future = Future()
        self.loop.call_soon_threadsafe(lambda: fut.set_result(fn(*args)))
        return fut.result(10)

    def open(self, tid, sampling=GREEDY, max_len=1024, attempt=0, **kw):
        return self.on_loop(lambda: self.proxy.open(tid, sampling, max_len, attempt, **kw))

    def close_session(self, tid):
        return self.on_loop(self.proxy.close, tid)

    def close(self):
        self.call(self.proxy.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.engine.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    s = Served(tool_model_dir(tmp_path_factory))
    yield s
    s.close()


def _conversation(client, first):
    """An agent that sends back the whole conversation each turn (tool results, then a follow-up question)."""
    messages, sent, replies = list(first), [], []
    for turn in range(4):
        sent.append(list(messages))
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        replies.append(r)
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if msg.tool_calls:
            messages += [{"role": "tool", "tool_call_id": c.id, "content": "5"} for c in msg.tool_calls]
        elif turn < 2:
            messages.append({"role": "user", "content": "And what is 2 + 3 again?"})
        else:
            break
    return sent, replies


def test_sync_client_whole_conversation_is_one_spliced_root_segment(served):
    served.rec_engine.calls.clear()
    served.open("sync-1")
    client = openai.OpenAI(base_url=served.proxy.base_url("sync-1"), api_key=served.proxy.api_key)
    first = [{"role": "system", "content": "Answer the arithmetic question."}, {"role": "user", "content": "2+3?"}]
    sent, replies = _conversation(client, first)
    rec = served.close_session("sync-1")
    tool_calls = replies[0].choices[0].message.tool_calls
    assert replies[0].choices[0].finish_reason == "tool_calls" and tool_calls[0].function.name == "calc"
    assert json.loads(tool_calls[0].function.arguments) == {"expression": "2 + 3"}

    [seg] = rec.segments
    engine_calls = served.rec_engine.calls
    assert seg.kind == "root" and len(rec.calls) == len(replies) == len(engine_calls) >= 3
    # Expected ids, built independently: the first prompt; then per call the engine's own output ids and the encoding
    # of only the messages the client added after echoing the reply.
    tok = served.tok
    expected = tok.encode(render_conversation(first, TOOLS, add_generation_prompt=True))
    for i, (inputs, res) in enumerate(engine_calls):
        if i > 0:
            expected += tok.continuation_ids(sent[i][len(sent[i - 1]) + 1 :])
        assert inputs == expected, f"call {i} did not consume the spliced history"
        lo, hi = len(inputs), len(inputs) + len(res.output_ids)
        assert seg.logprobs[lo:hi] == res.logprobs and seg.versions[lo:hi] == res.versions
        expected = expected + res.output_ids + (tok.encode(IM_END) if res.finish_reason == "length" else [])
    assert seg.token_ids == expected
    assert sum(seg.loss_mask) == sum(len(r.output_ids) for _, r in engine_calls)
    summary = rec.summary()
    assert summary["tito_mismatch"] == 0 and summary["spliced_calls"] == len(rec.calls) - 1
    assert replies[-1].usage.prompt_tokens == len(engine_calls[-1][0])


def test_async_streaming_tool_call_and_logprobs_match_non_streaming(served):
    async def go():
        base = served.proxy
        served.open("plain")
        served.open("stream")
        messages = [{"role": "user", "content": "What is 2 + 3?"}]
        plain = openai.AsyncOpenAI(base_url=base.base_url("plain"), api_key=base.api_key)
        r = await plain.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, logprobs=True)
        streamer = openai.AsyncOpenAI(base_url=base.base_url("stream"), api_key=base.api_key)
        stream = await streamer.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, stream=True, logprobs=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = [c async for c in stream]
        return r, chunks

    r, chunks = asyncio.run(go())
    rec_plain, rec_stream = served.close_session("plain"), served.close_session("stream")
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [tc.function.name for tc in calls] == ["calc"]
    assert calls[0].function.arguments == r.choices[0].message.tool_calls[0].function.arguments
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["tool_calls"] == [r.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert rec_plain.calls[0].output_ids == rec_stream.calls[0].output_ids  # greedy: the same tokens either way
    lps = [x.logprob for x in r.choices[0].logprobs.content]
    assert lps == rec_plain.calls[0].logprobs
    streamed_lps = [
        x.logprob for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content
    ]
    assert streamed_lps == rec_stream.calls[0].logprobs


def test_third_party_framework_pydantic_ai_offline(served):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    served.open("pyd")
    provider = OpenAIProvider(base_url=served.proxy.base_url("pyd"), api_key=served.proxy.api_key)
    agent = Agent(OpenAIChatModel(MODEL, provider=provider), system_prompt="Answer the arithmetic question.")
    seen = []

    @agent.tool_plain
    def calc(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        seen.append(expression)
        return "5"

    async def go():
        return await agent.run("What is 2 + 3?")

    result = asyncio.run(go())
    rec = served.close_session("pyd")
    assert seen == ["2 + 3"] and result.output == "5"
    assert [s.kind for s in rec.segments] == ["root"] and len(rec.calls) == 2
    assert rec.summary()["spliced_calls"] == 1 and rec.tito_mismatch() == 0


def test_segments_root_marked_side_and_retry_and_what_is_trained(served):
    """Marked new contexts (subagent, compact) are trained; an unmarked one is a ``side`` segment and a re-send of
    the last call's messages a retry, whose dropped reply moves to a ``retry`` segment: both recorded, not trained,
    while the conversation goes on in the root segment."""
    from agentflow.controller import to_samples
    from agentflow.types import Group, Trajectory

    rec = served.open("seg")
    client = openai.OpenAI(base_url=served.proxy.base_url("seg"), api_key=served.proxy.api_key, max_retries=0)
    root = [{"role": "user", "content": "What is 2 + 3?"}]
    client.chat.completions.create(model=MODEL, messages=root, tools=TOOLS)
    for kind in ("subagent", "compact"):
        sub = [{"role": "user", "content": f"Summarise ({kind}): 2 + 3 is 5."}]
        client.chat.completions.create(model=MODEL, messages=sub, extra_headers={SEGMENT_HEADER: kind})
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=root, extra_headers={SEGMENT_HEADER: "main"})
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Fresh start."}])
    r2 = client.chat.completions.create(model=MODEL, messages=root, tools=TOOLS)  # the agent asks again
    call = r2.choices[0].message.tool_calls[0]
    resumed = root + [r2.choices[0].message.model_dump(exclude_none=True)]
    resumed.append({"role": "tool", "tool_call_id": call.id, "content": "5"})
    client.chat.completions.create(model=MODEL, messages=resumed, tools=TOOLS)
    served.close_session("seg")
    assert bad.value.body["code"] == "invalid_segment" and SEGMENT_HEADER in bad.value.body["message"]
    assert [s.kind for s in rec.segments] == ["root", "subagent", "compact", "side", "retry"]
    assert [s.trained for s in rec.segments] == [True, True, True, False, False]
    # the first reply moved to the retry segment; the retry and the next call continue the root
    assert [c.segment for c in rec.calls] == [4, 1, 2, 3, 0, 0] and rec.calls[5].spliced
    assert rec.calls[4].input_ids == rec.calls[0].input_ids and rec.calls[4].new_tokens == 0
    summary = rec.summary()
    assert summary["tito_mismatch"] == 0 and summary["untrained_calls"] == 2 and summary["refused_calls"] == 1
    root_seg, dropped = rec.segments[0], rec.segments[4]
    lo, hi = rec.calls[0].span
    assert sum(dropped.loss_mask) == hi - lo and dropped.token_ids[:lo] == root_seg.token_ids[:lo]

    traj = Trajectory("t", "task", "g", "env", segments=rec.segments, turns=rec.turns(), reward=1.0)
    samples = to_samples([Group("g", 0, [traj])])
    assert [s.sample_id for s in samples] == ["t/0", "t/1", "t/2"]
    assert samples[0].turn_rewards[-1] == 0.0 and samples[2].turn_rewards[-1] == 1.0  # the last trained segment's
    for s in rec.segments:
        s.trained = True  # as with agent.train_side_calls
    assert len(to_samples([Group("g", 0, [traj])])) == 5


def test_a_resent_older_call_reuses_its_recorded_input(served):
    rec = served.open("older")
    client = openai.OpenAI(base_url=served.proxy.base_url("older"), api_key=served.proxy.api_key)
    first = [{"role": "user", "content": "What is 2 + 3?"}]
    r1 = client.chat.completions.create(model=MODEL, messages=first, tools=TOOLS)
    call = r1.choices[0].message.tool_calls[0]
    second = first + [r1.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "5"}]  # fmt: skip
    client.chat.completions.create(model=MODEL, messages=second, tools=TOOLS)
    client.chat.completions.create(model=MODEL, messages=first, tools=TOOLS)  # back to the first question
    served.close_session("older")
    assert [s.kind for s in rec.segments] == ["root", "side"] and [c.segment for c in rec.calls] == [0, 0, 1]
    assert rec.calls[2].input_ids == rec.calls[0].input_ids and rec.tito_mismatch() == 0


def _post(served, path, body, key=None, raw=None):
    headers = {"Authorization": f"Bearer {key or served.proxy.api_key}", "Content-Type": "application/json"}
    data = raw if raw is not None else json.dumps(body)
    return requests.post(served.proxy.url + path, data=data, headers=headers, timeout=30)


@pytest.mark.parametrize(
    ("body", "raw", "status", "param"),
    [
        (None, "{not json", 400, None),
        ({"model": MODEL}, None, 400, "messages"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, None, 400, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "x"}]}, None, 400, "model"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 2}, None, 400, "n"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, None, 400,
         "temperature"),
        ({"model": MODEL, "messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
            "name": "calc", "arguments": "{oops"}}]}]}, None, 400, "messages[0].tool_calls[0].function.arguments"),
        ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None, 400,
         "messages[0].content"),
        ({"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}, None, 404, "model"),
    ],
)  # fmt: skip
def test_malformed_requests_get_openai_error_json(served, body, raw, status, param):
    served.open("bad")
    try:
        r = _post(served, "/bad/0/v1/chat/completions", body, raw=raw)
        rec = served.close_session("bad")
    finally:
        if served.proxy.is_open("bad"):
            served.close_session("bad")
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["param"] == param
    assert not rec.calls and not rec.segments  # nothing recorded, nothing lost


def test_refuses_wrong_key_unknown_trajectory_and_stale_attempt(served):
    served.open("auth", attempt=1)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    assert _post(served, "/auth/1/v1/chat/completions", body, key="sk-wrong").status_code == 401
    r = requests.get(served.proxy.url + "/v1/models", timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert _post(served, "/nobody/0/v1/chat/completions", body).json()["error"]["code"] == "unknown_trajectory"
    assert _post(served, "/auth/0/v1/chat/completions", body).status_code == 404  # an older attempt
    models = openai.OpenAI(base_url=served.proxy.base_url("auth", 1), api_key=served.proxy.api_key).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert _post(served, "/auth/1/v1/chat/completions", body).status_code == 200
    assert len(served.close_session("auth").calls) == 1


def test_context_limit_is_an_openai_error_counted_as_a_refused_call(served):
    served.open("ctx", max_len=24)
    client = openai.OpenAI(base_url=served.proxy.base_url("ctx"), api_key=served.proxy.api_key, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is 2 + 3? " * 10}])
    rec = served.close_session("ctx")
    assert e.value.body["code"] == "context_length_exceeded" and not rec.calls
    assert rec.refused == 1 and "context_length_exceeded" in rec.first_refusal


def test_unknown_route_and_wrong_method_name_the_route_to_use(served):
    served.open("rt")
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        plain = _post(served, "/v1/chat/completions", body)  # a client without the trajectory in its base_url
        missing_v1 = _post(served, "/rt/0/chat/completions", body)
        headers = {"Authorization": f"Bearer {served.proxy.api_key}"}
        wrong_method = requests.get(served.proxy.url + "/rt/0/v1/chat/completions", headers=headers, timeout=10)
    finally:
        served.close_session("rt")
    for r in (plain, missing_v1):
        err = r.json()["error"]
        assert r.status_code == 404 and set(err) == {"message", "type", "param", "code"}
        assert err["code"] == "unknown_route"
        assert "POST /v1/chat/completions is served at /{trajectory_id}/{attempt}/v1/chat/completions" in err["message"]
    assert f"base_url is {served.proxy.url}/{{trajectory_id}}/{{attempt}}/v1" in plain.json()["error"]["message"]
    assert f"base URL is {served.proxy.base_url('rt')}" in missing_v1.json()["error"]["message"]
    err = wrong_method.json()["error"]
    assert wrong_method.status_code == 405 and err["code"] == "method_not_allowed" and "POST" in err["message"]
    assert wrong_method.headers["Allow"] == "POST"
