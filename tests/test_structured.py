"""Constrained decoding through the proxy with the real ``openai`` client, on a model with random weights that has
never seen the tools (so every well-formed reply is the grammar's doing), and the trainer reproducing the
constrained log-probs from the recorded tokens."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
import requests
import torch
from test_proxy import Served
from test_proxy_model import MODEL, TINY, tool_model_dir

from agentflow.chat import ChatTokenizer
from agentflow.controller import to_samples
from agentflow.engine.embedded import EmbeddedEngine
from agentflow.model_init import init_model
from agentflow.structured import ConstraintMismatch, bound_schema, grammars_for, request_grammar
from agentflow.types import Group, SamplingParams, Trajectory

pytestmark = pytest.mark.timeout(900)
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=160)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}
BOOK = {
    "type": "function",
    "function": {
        "name": "book_table",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {
                "people": {"type": "integer", "minimum": 1, "maximum": 12},
                "tags": {"type": "array", "items": {"type": "string", "enum": ["quiet", "window", "late"]}},
                "when": {
                    "type": "object",
                    "properties": {"day": {"type": "string"}},
                    "required": ["day"],
                    "additionalProperties": False,
                },  # fmt: skip
                "vip": {"type": "boolean"},
            },
            "required": ["people", "tags", "when", "vip"],
            "additionalProperties": False,
        },
    },
}
ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}, "why": {"type": "string"}, "ok": {"type": "boolean"}},
    "required": ["answer", "why", "ok"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Plan my evening in Paris."}]


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("never-seen"), TINY)


@pytest.fixture(scope="module")
def served(base_model):
    s = Served(base_model)
    yield s
    s.close()


def _client(served, tid):
    served.open(tid, SAMPLED, max_len=1024, client_sampling=True)
    return openai.AsyncOpenAI(base_url=served.proxy.base_url(tid), api_key=served.proxy.api_key, max_retries=0)


async def _many(client, n, **kwargs):
    sem = asyncio.Semaphore(8)

    async def one(i):
        async with sem:
            return await client.chat.completions.create(model=MODEL, messages=MESSAGES, seed=i, **kwargs)

    return await asyncio.gather(*(one(i) for i in range(n)))


def _check_calls(replies, tool, n):
    valid = 0
    for r in replies:
        calls = r.choices[0].message.tool_calls or []
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
        assert len(calls) == 1 and calls[0].function.name == tool["function"]["name"]
        jsonschema.validate(json.loads(calls[0].function.arguments), tool["function"]["parameters"])
        valid += 1
    assert valid == n


def test_required_and_named_tool_choice_always_give_a_schema_valid_call(served):
    client = _client(served, "forced")
    replies = served.call(_many(client, 100, tools=[WEATHER, BOOK], tool_choice="required"))
    names = {r.choices[0].message.tool_calls[0].function.name for r in replies}
    for r in replies:
        tool = WEATHER if r.choices[0].message.tool_calls[0].function.name == "get_weather" else BOOK
        _check_calls([r], tool, 1)
    assert names <= {"get_weather", "book_table"}
    named = {"type": "function", "function": {"name": "get_weather"}}
    _check_calls(served.call(_many(client, 100, tools=[WEATHER, BOOK], tool_choice=named)), WEATHER, 100)


def test_strict_tool_arguments_are_schema_valid(served):
    client = _client(served, "strict")
    named = {"type": "function", "function": {"name": "book_table"}}
    _check_calls(served.call(_many(client, 100, tools=[BOOK, WEATHER], tool_choice=named)), BOOK, 100)


def test_response_format_json_schema_and_json_object(served):
    client = _client(served, "json")
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    for r in served.call(_many(client, 100, response_format=fmt)):
        jsonschema.validate(json.loads(r.choices[0].message.content), ANSWER)
        assert r.choices[0].finish_reason == "stop"
    for r in served.call(_many(client, 20, response_format={"type": "json_object"})):
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_recorded_constrained_logprobs_are_what_the_trainer_recomputes(served, base_model):
    from trainer.megatron_trainer import MegatronTrainer
    from trainer.types import TrainerSettings

    served.open("replay", SamplingParams(temperature=0.8, max_new_tokens=64), max_len=1024)
    client = openai.OpenAI(base_url=served.proxy.base_url("replay"), api_key=served.proxy.api_key)
    client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[BOOK], tool_choice="required")
    rec = served.close_session("replay")
    seg = rec.segments[0]
    assert seg.constraints and "start: call" in seg.constraints[0][2]
    traj = Trajectory("replay", "t", "g", "env", segments=[seg], reward=1.0)
    (sample,) = to_samples([Group("g", 0, [traj])], model_dir=base_model)
    start, end, _ = seg.constraints[0]
    assert [p for p, _ in sample.vocab_masks] == list(range(start, end))
    trainer = MegatronTrainer(base_model, TrainerSettings(threads=1, temperature=0.8))
    masked = trainer.sequence_logprobs(seg.token_ids, vocab_masks=sample.vocab_masks)
    plain = trainer.sequence_logprobs(seg.token_ids)
    got = [masked[p - 1] for p in range(start, end)]
    want = seg.logprobs[start:end]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4
    # without the masks the trainer would see other numbers: the test can fail
    assert max(abs(plain[p - 1] - seg.logprobs[p]) for p in range(start, end)) > 1e-2
    forced = [lp for lp in want if lp == 0.0]  # tokens the grammar forced (the tool name, punctuation)
    assert len(forced) >= 5


def test_replay_refuses_a_token_the_grammar_forbids(base_model):
    grammar = request_grammar([WEATHER], "required", True, None, 64)
    ids = ChatTokenizer(base_model).encode("hello")
    with pytest.raises(ConstraintMismatch, match="not allowed"):
        grammars_for(str(base_model)).replay(grammar.lark, ids)


def test_tool_choice_none_and_no_tools_never_give_tool_calls(tmp_path_factory):
    s = Served(tool_model_dir(tmp_path_factory))  # this model does call tools when it may
    try:
        s.open("none", SamplingParams(temperature=0.0, max_new_tokens=48), client_sampling=True)
        client = openai.OpenAI(base_url=s.proxy.base_url("none"), api_key=s.proxy.api_key)
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
        auto = client.chat.completions.create(model=MODEL, messages=msgs, tools=[_calc()])
        assert auto.choices[0].message.tool_calls, "the tool model should call the tool in auto mode"
        none = client.chat.completions.create(model=MODEL, messages=msgs, tools=[_calc()], tool_choice="none")
        assert not none.choices[0].message.tool_calls and none.choices[0].finish_reason != "tool_calls"
        assert "<tool_call>" not in (none.choices[0].message.content or "")
        bare = client.chat.completions.create(model=MODEL, messages=msgs)
        assert not bare.choices[0].message.tool_calls
    finally:
        s.close()


def _calc():
    return {"type": "function", "function": {"name": "calc", "description": "Evaluate an arithmetic expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                           "required": ["expression"]}}}  # fmt: skip


def test_top_logprobs_stop_strings_and_the_reported_sampling(served):
    served.open("fields", SamplingParams(temperature=0.0, max_new_tokens=32), client_sampling=True)
    client = openai.OpenAI(base_url=served.proxy.base_url("fields"), api_key=served.proxy.api_key)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=3, temperature=0.0
    )
    assert raw.headers["x-agentflow-sampling"].startswith("temperature=0; ")
    r = raw.parse()
    for entry in r.choices[0].logprobs.content:
        assert 1 <= len(entry.top_logprobs) <= 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)  # greedy: the best one
    text = r.choices[0].message.content
    stop = text[5:8]
    cut = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0.0, stop=[stop])
    assert cut.choices[0].message.content == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0.0, stop=stop, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text[: text.find(stop)]


def test_fields_we_cannot_honour_are_refused_by_name(served):
    served.open("refuse", SAMPLED)
    client = openai.OpenAI(base_url=served.proxy.base_url("refuse"), api_key=served.proxy.api_key, max_retries=0)
    for kwargs, param in [
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"logit_bias": {"5": 3}}, "logit_bias"),
        ({"extra_body": {"bogus_field": 1}}, "bogus_field"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]}, "tool_choice"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "strict": True,
                        "schema": {"type": "string", "format": "no-such-format"},
                    },
                }
            },
            "response_format",
        ),  # fmt: skip
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, **kwargs)
        assert err.value.body["param"] == param, err.value.body
    ok = client.chat.completions.create(model=MODEL, messages=MESSAGES, frequency_penalty=0, logit_bias={}, user="u")
    assert ok.choices[0].message.role == "assistant"


def test_a_schema_refused_before_the_reply_leaves_no_call_in_flight(served):
    """Streamed or not, on either route, a call refused for its schema releases its plan: nothing stays in flight
    and the trajectory's next call is still its root."""
    served.open("refused-schema", SAMPLED)
    proxy = served.proxy
    schema = {"type": "string", "format": "no-such-format"}
    openai_body = {"model": MODEL, "messages": MESSAGES, "response_format": {"type": "json_schema",
                   "json_schema": {"name": "x", "strict": True, "schema": schema}}}  # fmt: skip
    anthropic_body = {"model": MODEL, "max_tokens": 8, "messages": MESSAGES[1:], "system": MESSAGES[0]["content"],
                      "output_config": {"format": {"type": "json_schema", "schema": schema}}}  # fmt: skip
    anthropic_headers = {"x-api-key": proxy.api_key, "anthropic-version": "2023-06-01"}
    routes = [("/v1/chat/completions", openai_body, {"Authorization": f"Bearer {proxy.api_key}"}),
              ("/v1/messages", anthropic_body, anthropic_headers)]  # fmt: skip
    for path, body, headers in routes:
        for stream in (True, False):
            r = requests.post(f"{proxy.url}/refused-schema/0{path}", json={**body, "stream": stream},
                              headers=headers, timeout=30)  # fmt: skip
            assert r.status_code == 400 and "cannot constrain the reply" in r.text, (path, stream, r.text)
    client = openai.OpenAI(base_url=proxy.base_url("refused-schema"), api_key=proxy.api_key, max_retries=0)
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    rec = served.close_session("refused-schema")
    assert rec.summary()["segments"] == ["root"] and rec.refused == 4 and proxy.in_flight == 0


def test_bound_schema_bounds_only_what_is_unbounded():
    schema, added = bound_schema(ANSWER | {"properties": {**ANSWER["properties"], "notes": {"type": "array"}}}, 64)
    assert (
        schema["properties"]["why"]["maxLength"] >= 1 and added["maxLength"] == schema["properties"]["why"]["maxLength"]
    )
    assert schema["properties"]["notes"]["maxItems"] == 4
    assert "maxLength" not in ANSWER["properties"]["why"]  # the caller's schema is left alone
    fixed, none_added = bound_schema({"type": "string", "enum": ["a"]}, 64)
    assert none_added == {} and fixed == {"type": "string", "enum": ["a"]}


def test_engine_refuses_a_broken_grammar_and_masks_per_request(base_model):
    tok = ChatTokenizer(base_model)
    grammar = request_grammar([WEATHER], {"mode": "required", "names": ["get_weather"]}, False, None, 64)
    with EmbeddedEngine(base_model, max_slots=4, max_len=256) as engine:
        with pytest.raises(ValueError, match="invalid grammar"):
            engine.generate_sync([1, 2, 3], SamplingParams(grammar="start: %json {"))
        prompt = tok.encode("hello")
        sp = SamplingParams(temperature=1.0, max_new_tokens=64, stop_token_ids=tok.stop_ids)
        futs = [
            engine.submit(prompt, sp),
            engine.submit(prompt, SamplingParams(**{**sp.__dict__, "grammar": grammar.lark})),
        ]
        free, forced = (f.result(60) for f in futs)
    assert tok.decode(forced.output_ids).startswith('<tool_call>\n{"name": "get_weather", "arguments": {"city": "')
    assert not tok.decode(free.output_ids).startswith("<tool_call>")
    assert all(torch.isfinite(torch.tensor(forced.logprobs)))
