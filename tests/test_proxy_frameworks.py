"""Agent frameworks driving the proxy through their own public APIs (pydantic-ai and the OpenAI Agents SDK), and the
real ``openai`` client's streamed, async and log-prob paths under constrained decoding.

The model has random weights and has never seen a tool: its replies are gibberish, but every structure the
framework relies on (a forced tool call it parses and runs, a typed output it validates) is the grammar's doing. The
tests assert on structure and validity, never on content. What each framework sent is captured on the wire, so a
test also checks that it exercises the fields it claims to (a forced ``tool_choice``, a ``response_format``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from test_proxy import Served
from test_proxy_model import MODEL, TINY

from agentflow.model_init import init_model
from agentflow.structured import allowed, grammars_for
from agentflow.types import SamplingParams

pytestmark = pytest.mark.timeout(300)
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=64)
MAX_TOKENS = 64
QUESTION = "What is 2 + 3? Use the calculator."


class Answer(BaseModel):
    """A typed final output: a bounded number, a short reason and a flag."""

    answer: int = Field(ge=0, le=999)
    why: str
    ok: bool


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
CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("never-seen"), TINY)


@pytest.fixture(scope="module")
def served(base_model):
    s = Served(base_model)
    yield s
    s.close()


class Wire:
    """An ``AsyncOpenAI`` client for one trajectory that keeps every chat request body it sends."""

    def __init__(self, served: Served, tid: str) -> None:
        served.open(tid, SAMPLED, max_len=1024, client_sampling=True)
        self.sent: list[dict] = []

        async def keep(request):
            if request.url.path.endswith("/chat/completions"):
                self.sent.append(json.loads(request.content))

        http = openai.DefaultAsyncHttpxClient(event_hooks={"request": [keep]})
        self.client = openai.AsyncOpenAI(
            base_url=served.proxy.base_url(tid), api_key=served.proxy.api_key, max_retries=0, http_client=http
        )


def _one_spliced_root(rec, calls: int) -> None:
    """The whole run is one conversation: one root segment, every call after the first spliced onto it."""
    summary = rec.summary()
    assert summary["segments"] == ["root"], summary
    assert summary["calls"] == calls and summary["spliced_calls"] == calls - 1, summary
    assert summary["tito_mismatch"] == 0 and summary["refused_calls"] == 0, summary


def _named(body: dict) -> str | None:
    """The function a request's ``tool_choice`` names, if it names one."""
    choice = body.get("tool_choice")
    return choice["function"]["name"] if isinstance(choice, dict) and choice.get("type") == "function" else None


def _tool_result_last(body: dict) -> None:
    msgs = body["messages"]
    assert msgs[-1]["role"] == "tool" and msgs[-2]["role"] == "assistant" and msgs[-2]["tool_calls"], msgs[-2:]


# ------------------------------------------------------------------------------------------------------ pydantic-ai


def _pydantic_agent(wire: Wire, output_type, tool_choice_at):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=wire.client))
    # per step: force the calculator on the first request, then let the agent finish
    settings = lambda ctx: {"max_tokens": MAX_TOKENS, "tool_choice": tool_choice_at(ctx.run_step)}
    agent = Agent(model, output_type=output_type, instructions="Be brief.", model_settings=settings)
    ran: list[str] = []

    @agent.tool_plain
    def calc(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        assert isinstance(expression, str)
        ran.append(expression)
        return "5"

    return agent, ran


def test_pydantic_ai_forced_tool_then_typed_output_through_its_output_tool(served):
    wire = Wire(served, "pyd-tool")
    agent, ran = _pydantic_agent(wire, Answer, lambda step: ["calc"] if step <= 1 else "none")
    result = served.call(agent.run(QUESTION))
    rec = served.close_session("pyd-tool")
    assert len(ran) == 1  # pydantic-ai parsed the forced call and ran its tool once
    assert isinstance(result.output, Answer) and Answer.model_validate(result.output.model_dump()) == result.output
    first, second = wire.sent
    assert _named(first) == "calc" and "response_format" not in first
    # "none" for function tools with a typed output: pydantic-ai forces its own output tool
    assert _named(second) == "final_result"
    assert sorted(t["function"]["name"] for t in second["tools"]) == ["calc", "final_result"]
    _tool_result_last(second)
    _one_spliced_root(rec, 2)
    assert [lark.count("start: call") for _, _, lark in rec.segments[0].constraints] == [1, 1]


def test_pydantic_ai_native_output_is_a_response_format_beside_a_forced_tool(served):
    from pydantic_ai import NativeOutput

    wire = Wire(served, "pyd-native")
    agent, ran = _pydantic_agent(wire, NativeOutput(Answer), lambda step: ["calc"] if step <= 1 else "none")
    result = served.call(agent.run(QUESTION))
    rec = served.close_session("pyd-native")
    assert len(ran) == 1 and isinstance(result.output, Answer)
    first, second = wire.sent
    # the first request forces the (only) tool and also carries the output's schema, as OpenAI accepts
    assert first["tool_choice"] == "required" and first["response_format"]["type"] == "json_schema"
    assert second.get("tool_choice") == "none" and second["response_format"] == first["response_format"]
    _tool_result_last(second)
    _one_spliced_root(rec, 2)


def test_pydantic_ai_streamed_typed_output(served):
    from pydantic_ai import NativeOutput

    wire = Wire(served, "pyd-stream")
    agent, ran = _pydantic_agent(wire, NativeOutput(Answer), lambda step: ["calc"] if step <= 1 else "none")

    async def go():
        partials = []
        async with agent.run_stream("Answer in JSON.") as run:
            async for partial in run.stream_output(debounce_by=None):
                partials.append(partial)
            return partials, await run.get_output()

    partials, output = served.call(go())
    rec = served.close_session("pyd-stream")
    assert len(ran) == 1 and isinstance(output, Answer) and partials
    assert [body["stream"] for body in wire.sent] == [True, True]
    assert wire.sent[1]["tool_choice"] == "none" and wire.sent[1]["response_format"]["type"] == "json_schema"
    _one_spliced_root(rec, 2)


# -------------------------------------------------------------------------------------------- OpenAI Agents SDK


def _sdk_agent(wire: Wire, output_type, tool_choice: str):
    from agents import Agent, AgentHooks, ModelSettings, OpenAIChatCompletionsModel, function_tool

    ran: list[str] = []

    @function_tool
    def calc(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        assert isinstance(expression, str)
        ran.append(expression)
        return "5"

    class AnswerAfterTheTool(AgentHooks):
        """Once the tool has run, the next request may not call tools. The SDK's own reset (``reset_tool_choice``)
        goes back to ``auto``, where a model that has never seen the tool may call it forever; the proxy's side of
        ``auto`` beside a ``response_format`` is tested on the wire below."""

        async def on_tool_end(self, context, agent, tool, result):
            agent.model_settings = dataclasses.replace(agent.model_settings, tool_choice="none")

    agent = Agent(
        name="calculator",
        instructions="Be brief.",
        tools=[calc],
        output_type=output_type,
        model=OpenAIChatCompletionsModel(model=MODEL, openai_client=wire.client),
        model_settings=ModelSettings(tool_choice=tool_choice, max_tokens=MAX_TOKENS),
        reset_tool_choice=False,
        hooks=AnswerAfterTheTool(),
    )
    return agent, ran


@pytest.fixture(scope="module")
def no_tracing():
    from agents import set_tracing_disabled

    set_tracing_disabled(True)  # the SDK would export traces to OpenAI
    yield
    set_tracing_disabled(False)


@pytest.mark.parametrize("tool_choice", ["required", "calc"])
def test_agents_sdk_forced_tool_round_trip_and_typed_output(served, no_tracing, tool_choice):
    from agents import Runner

    tid = f"sdk-{tool_choice}"
    wire = Wire(served, tid)
    agent, ran = _sdk_agent(wire, Answer, tool_choice)
    result = served.call(Runner.run(agent, QUESTION, max_turns=3))
    rec = served.close_session(tid)
    assert len(ran) == 1  # the SDK parsed the forced call and ran its function tool once
    assert isinstance(result.final_output, Answer)
    first, second = wire.sent
    named = {"type": "function", "function": {"name": "calc"}}
    assert first["tool_choice"] == ("required" if tool_choice == "required" else named)
    assert first["response_format"]["type"] == "json_schema"  # the SDK sends the output schema on every turn
    assert second["tool_choice"] == "none" and second["response_format"] == first["response_format"]
    _tool_result_last(second)
    _one_spliced_root(rec, 2)
    kinds = [("call" if "start: call" in lark else "json") for _, _, lark in rec.segments[0].constraints]
    assert kinds == ["call", "json"]


def test_agents_sdk_streamed_run(served, no_tracing):
    from agents import Runner

    wire = Wire(served, "sdk-stream")
    agent, ran = _sdk_agent(wire, Answer, "required")

    async def go():
        run = Runner.run_streamed(agent, QUESTION, max_turns=3)
        kinds = [event.type async for event in run.stream_events()]
        return run, kinds

    run, kinds = served.call(go())
    rec = served.close_session("sdk-stream")
    assert len(ran) == 1 and isinstance(run.final_output, Answer)
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    assert all(body["stream"] is True for body in wire.sent) and len(wire.sent) == 2
    _one_spliced_root(rec, 2)


# ------------------------------------------------------------------------------------------- the openai client


def test_streamed_forced_tool_call_arrives_in_deltas(served):
    served.open("stream-call", SAMPLED, max_len=1024, client_sampling=True)
    client = openai.OpenAI(base_url=served.proxy.base_url("stream-call"), api_key=served.proxy.api_key)
    for i, choice in enumerate(["required", {"type": "function", "function": {"name": "get_weather"}}]):
        stream = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=[WEATHER, CALC], tool_choice=choice, stream=True, seed=i,
            max_tokens=MAX_TOKENS, stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = list(stream)
        deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
        assert deltas and deltas[0].id and deltas[0].function.name in ("get_weather", "calc")
        assert {d.index for d in deltas} == {0}
        args = json.loads("".join(d.function.arguments or "" for d in deltas))
        tool = WEATHER if deltas[0].function.name == "get_weather" else CALC
        jsonschema.validate(args, tool["function"]["parameters"])
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish == ["tool_calls"]
        assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].usage.completion_tokens > 0
        if i:
            assert deltas[0].function.name == "get_weather"
    rec = served.close_session("stream-call")
    assert all(c.finish_reason == "stop" for c in rec.calls)


def test_async_streams_of_a_named_call_and_a_json_schema_at_once(served):
    served.open("async-stream", SAMPLED, max_len=1024, client_sampling=True)
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": Answer.model_json_schema(), "strict": True},
    }
    named = {"type": "function", "function": {"name": "calc"}}

    async def go():
        client = openai.AsyncOpenAI(base_url=served.proxy.base_url("async-stream"), api_key=served.proxy.api_key)

        async def collect(**kwargs):
            stream = await client.chat.completions.create(
                model=MODEL, messages=MESSAGES, stream=True, max_tokens=MAX_TOKENS, **kwargs
            )
            return [c async for c in stream]

        return await asyncio.gather(collect(response_format=fmt), collect(tools=[CALC, WEATHER], tool_choice=named))

    as_json, as_call = served.call(go())
    served.close_session("async-stream")
    text = "".join(c.choices[0].delta.content or "" for c in as_json if c.choices)
    Answer.model_validate_json(text)
    assert [c.choices[0].finish_reason for c in as_json if c.choices and c.choices[0].finish_reason] == ["stop"]
    deltas = [tc for c in as_call if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert {d.function.name for d in deltas if d.function.name} == {"calc"}
    jsonschema.validate(json.loads("".join(d.function.arguments or "" for d in deltas)), CALC["function"]["parameters"])
    assert [c.choices[0].finish_reason for c in as_call if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_logprobs_of_a_forced_tool_call_are_finite_and_only_of_allowed_tokens(served, base_model):
    served.open("lp-call", SAMPLED, max_len=1024, client_sampling=True)
    client = openai.OpenAI(base_url=served.proxy.base_url("lp-call"), api_key=served.proxy.api_key)
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice="required", logprobs=True, top_logprobs=5,
        max_tokens=MAX_TOKENS, seed=3,
    )  # fmt: skip
    rec = served.close_session("lp-call")
    assert r.choices[0].finish_reason == "tool_calls"
    entries = r.choices[0].logprobs.content
    call = rec.calls[0]
    assert [e.logprob for e in entries] == call.logprobs
    assert all(math.isfinite(e.logprob) and e.logprob <= 0 for e in entries)
    # the masks the tokens were drawn under, replayed from the recorded grammar
    (_, _, lark) = rec.segments[0].constraints[0]
    grammars = grammars_for(str(base_model))
    masks = allowed(grammars.replay(lark, call.output_ids), grammars.n_vocab)
    text_of = served.tok.tok.decode_batch([[i] for i in range(grammars.n_vocab)], skip_special_tokens=False)
    forced = 0
    for k, e in enumerate(entries):
        ok = {text_of[i] for i in masks[k].nonzero().flatten().tolist()}
        assert e.token in ok
        assert 1 <= len(e.top_logprobs) <= 5 and all(math.isfinite(a.logprob) for a in e.top_logprobs)
        assert all(a.token in ok for a in e.top_logprobs), (k, e.token, [a.token for a in e.top_logprobs])
        assert sum(math.exp(a.logprob) for a in e.top_logprobs) <= 1 + 1e-4
        if len(ok) == 1:  # the grammar forced this token: nothing else was possible
            forced += 1
            assert e.logprob == 0.0 and [a.token for a in e.top_logprobs] == [e.token]
    assert forced >= 5  # the tool call's opening and the function name at least


def test_auto_tool_choice_with_a_response_format_gives_a_call_or_the_json(served):
    """Tools left to the model's choice beside a ``response_format`` (what an agent's later turns send): each reply
    is a schema-valid call or the schema's JSON, never free text."""
    served.open("auto-json", SAMPLED, max_len=1024, client_sampling=True)
    client = openai.OpenAI(base_url=served.proxy.base_url("auto-json"), api_key=served.proxy.api_key)
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": Answer.model_json_schema(), "strict": True},
    }
    seen = set()
    for seed in range(12):
        r = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=[CALC], response_format=fmt, parallel_tool_calls=False, seed=seed,
            max_tokens=MAX_TOKENS,
        )  # fmt: skip
        msg = r.choices[0].message
        if msg.tool_calls:
            assert r.choices[0].finish_reason == "tool_calls" and len(msg.tool_calls) == 1 and not msg.content
            jsonschema.validate(json.loads(msg.tool_calls[0].function.arguments), CALC["function"]["parameters"])
            seen.add("call")
        else:
            Answer.model_validate_json(msg.content)
            seen.add("json")
    served.close_session("auto-json")
    assert seen == {"call", "json"}
