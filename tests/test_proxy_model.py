"""A real tool-calling model for the proxy tests, made here: a tiny Qwen2 trained for a few seconds to call ``calc``
with "2 + 3" after any user question and to answer "5" after a tool response (whatever the system prompt or tool
schema), so the OpenAI clients and the third-party framework see genuine tool calls from a real engine."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

from agentflow.chat import IM_END, ChatTokenizer, parse_reply, render_conversation
from agentflow.model_init import ModelInitConfig, init_model

pytestmark = pytest.mark.timeout(900)  # the tool model is trained on first use
# What the proxy tests and benchmarks/proxy.py send: the model name and the tool the tiny model was trained on.
MODEL = "agentflow-policy"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
TINY = ModelInitConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=176, num_attention_heads=4)
CALL = '<tool_call>\n{"name": "calc", "arguments": {"expression": "2 + 3"}}\n</tool_call>' + IM_END
ANSWER = "5" + IM_END


def _tools(rng: random.Random) -> list[dict]:
    params: dict = {"type": "object", "properties": {"expression": {"type": "string"}}}
    if rng.random() < 0.5:
        params["required"] = ["expression"]
    if rng.random() < 0.5:
        params["additionalProperties"] = False
    desc = rng.choice(["Evaluate an arithmetic expression.", "Compute.", "A calculator.", ""])
    fn = {"name": "calc", "description": desc, "parameters": params}
    if rng.random() < 0.3:
        fn["strict"] = True
    return [{"type": "function", "function": fn}]


def _example(tok: ChatTokenizer, rng: random.Random) -> tuple[list[int], list[int]]:
    system = rng.choice(["", "Answer the arithmetic question.", "You are a helpful assistant.", "Use tools."])
    question = rng.choice(["What is 2 + 3?", "Compute 2 + 3.", "what is two plus three", "2+3=?", "What is 41 * 7?"])
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    ids = tok.encode(render_conversation(msgs, _tools(rng), add_generation_prompt=True))
    mask = [0] * len(ids)
    for r in range(rng.choice([1, 1, 2, 3])):  # later rounds: a new question after an answer calls the tool again
        if r:
            user = tok.continuation_ids([{"role": "user", "content": question}])
            ids, mask = ids + user, mask + [0] * len(user)
        result = tok.continuation_ids([{"role": "tool", "content": rng.choice(["5", "5.0", "287"])}])
        o1, o2 = tok.encode(CALL), tok.encode(ANSWER)
        ids = ids + o1 + result + o2
        mask = mask + [1] * len(o1) + [0] * len(result) + [1] * len(o2)
    return ids, mask


def train_tool_model(out: Path, steps: int = 70) -> Path:
    """Init a tiny model, fit it to the tool-call pattern, save it as a Hugging Face directory at ``out``."""
    from transformers import Qwen2ForCausalLM

    base = init_model(out.parent / (out.name + "-init"), TINY)
    tok = ChatTokenizer(base)
    model = Qwen2ForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    rng = random.Random(0)
    torch.manual_seed(0)
    for _ in range(steps):
        batch = [_example(tok, rng) for _ in range(8)]
        n = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([i + [0] * (n - len(i)) for i, _ in batch])
        mask = torch.tensor([m + [0] * (n - len(m)) for _, m in batch], dtype=torch.float)[:, 1:]
        logp = torch.log_softmax(model(input_ids=ids).logits[:, :-1], -1).gather(2, ids[:, 1:, None])[..., 0]
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    tmp = out.parent / (out.name + "-tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    for f in base.iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, tmp / f.name)
    tmp.rename(out)
    return out


def tool_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's tool model (trained once, shared by the proxy test modules)."""
    out = tmp_path_factory.getbasetemp() / "proxy-tool-model"
    return out if (out / "config.json").is_file() else train_tool_model(out)


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    return tool_model_dir(tmp_path_factory)


def test_tool_model_calls_the_tool_then_answers(tool_model):
    from agentflow.engine.embedded import EmbeddedEngine
    from agentflow.types import SamplingParams

    tok = ChatTokenizer(tool_model)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    prompt = tok.encode(render_conversation(msgs, _tools(random.Random(5)), add_generation_prompt=True))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=40, stop_token_ids=tok.stop_ids)
    with EmbeddedEngine(tool_model, max_slots=2, max_len=512) as engine:
        first = engine.generate_sync(prompt, greedy)
        reply = parse_reply(tok.decode(first.output_ids))
        assert [c.name for c in reply.tool_calls] == ["calc"], tok.decode(first.output_ids)
        second = engine.generate_sync(
            prompt + first.output_ids + tok.continuation_ids([{"role": "tool", "content": "5"}]), greedy
        )
        assert parse_reply(tok.decode(second.output_ids)).content == "5"
