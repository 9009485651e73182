"""Chat format: Jinja template and Python renderer agree, prefix property, tool-call parsing."""

import json

import jinja2
import pytest

from agentflow.chat import (
    CHAT_TEMPLATE,
    ChatTokenizer,
    ToolCall,
    parse_reply,
    render_conversation,
    render_tool_call,
)
from agentflow.model_init import ModelInitConfig, init_model

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate <an> 'expression' & more",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
CALL = {"type": "function", "function": {"name": "calc", "arguments": {"expression": "1 + 2"}}}
CONV = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "What is 1 + 2?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "3"},
    {"role": "assistant", "content": "3"},
]


def _jinja(messages, tools, gen):
    # Hugging Face renders chat templates with a tojson that keeps key order and does not HTML-escape
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
    return env.from_string(CHAT_TEMPLATE).render(messages=messages, tools=tools, add_generation_prompt=gen)


@pytest.mark.parametrize("n", range(1, len(CONV) + 1))
def test_python_renderer_matches_jinja_template(n):
    for gen in (False, True):
        assert render_conversation(CONV[:n], TOOLS, gen) == _jinja(CONV[:n], TOOLS, gen)


def test_each_conversation_is_a_prefix_of_the_next():
    for n in range(1, len(CONV)):
        assert render_conversation(CONV[n:], TOOLS).startswith("<|im_start|>")
        assert render_conversation(CONV[: n + 1], TOOLS).startswith(render_conversation(CONV[:n], TOOLS))


def test_parse_reply_tool_calls_answers_and_errors():
    call = ToolCall("calc", {"expression": "2*3"})
    r = parse_reply(render_tool_call(call) + "<|im_end|>")
    assert r.error is None and r.tool_calls == (call,)
    assert parse_reply("  42 <|im_end|>").content == "42"
    bad = parse_reply('<tool_call>\n{"name": "calc", "arguments": {"expression": }\n</tool_call>')
    assert bad.error is not None and "invalid JSON" in bad.error
    assert "unbalanced" in parse_reply('<tool_call>{"name": "calc"').error
    assert "arguments must be" in parse_reply('<tool_call>{"name": "calc", "arguments": [1]}</tool_call>').error
    as_string = parse_reply('<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"1\\"}"}</tool_call>')
    assert as_string.tool_calls == (ToolCall("calc", {"expression": "1"}),)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("m"), ModelInitConfig(hidden_size=64, num_hidden_layers=1))


def test_incremental_tokens_decode_to_the_full_rendering(model_dir):
    tok = ChatTokenizer(model_dir)
    ids = tok.prompt_ids("You are helpful.", "What is 1 + 2?", TOOLS)
    generated = tok.encode(render_tool_call(ToolCall("calc", {"expression": "1 + 2"})) + "<|im_end|>")
    ids += generated + tok.continuation_ids([{"role": "tool", "content": "3"}])
    ids += tok.encode("3<|im_end|>")
    assert tok.decode(ids) == render_conversation(CONV, TOOLS).removesuffix("\n")


def test_model_init_is_deterministic_and_small(tmp_path):
    a = init_model(tmp_path / "a", ModelInitConfig(seed=3))
    b = init_model(tmp_path / "b", ModelInitConfig(seed=3))
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    from agentflow.model_init import count_parameters

    assert count_parameters(ModelInitConfig()) <= 8_000_000
    tok = ChatTokenizer(a)
    assert tok.encode("12345") == [tok.encode(d)[0] for d in "12345"]  # one token per digit


def test_hf_transformers_loads_the_model_and_renders_the_template(model_dir):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.config.model_type == "qwen2"
    hf_tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    for n in range(2, len(CONV) + 1):
        text = hf_tok.apply_chat_template(CONV[:n], tools=TOOLS, tokenize=False)
        assert text == render_conversation(CONV[:n], TOOLS)
