"""A black-box tool agent for the demo: it knows nothing of tokens, only the OpenAI chat API over HTTP.

Each turn it sends the whole conversation with the env's tools; a reply with tool calls runs the first one on the
env (through the runner's handle, or the proxy's tool route when run as a subprocess) and continues; a reply
without one is the answer. A malformed tool call is not an answer: the proxy returns it as plain text (as
OpenAI-compatible servers do), and the agent tells the model the parse error in a tool message and goes on, exactly
as the white-box loop (agentflow/agent.py) does. So it plays the same policy in the same episode as the white-box
loop, token for token, through the proxy instead.

As a Python agent: ``agent.entry: agentflow.demos.blackbox_agent:tool_agent`` (plain aiohttp, a runtime dependency).
As a subprocess: ``agent.command: ["{python}", "-m", "agentflow.demos.blackbox_agent"]`` (the ``openai`` client).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from agentflow.chat import parse_reply
from agentflow.proxy.types import BlackBoxTask

Chat = Callable[[list[dict[str, Any]]], Awaitable[dict[str, Any]]]
Tool = Callable[[str, dict[str, Any]], Awaitable[tuple[str, bool]]]


async def play(messages: list[dict[str, Any]], max_turns: int, chat: Chat, tool: Tool) -> str | None:
    """The agent's loop over any chat and tool transport; returns the answer, or None when it ran out of turns."""
    messages = list(messages)
    for _ in range(max_turns):
        reply = await chat(messages)
        calls = reply.get("tool_calls") or []
        if not calls:
            text = reply.get("content") or ""
            error = parse_reply(text).error  # the proxy returns a malformed call as text
            if error is None:
                return text
            # As the white-box loop: the model sees the error (as a tool result) and the episode goes on.
            messages.append({"role": "assistant", "content": reply.get("content")})
            messages.append({"role": "tool", "content": f"Error: {error}"})
            continue
        messages.append({"role": "assistant", "content": reply.get("content"), "tool_calls": calls})
        fn = calls[0]["function"]
        output, done = await tool(fn["name"], json.loads(fn["arguments"] or "{}"))
        if done:
            return None
        messages.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": output})
    return None


async def tool_agent(task: BlackBoxTask) -> str | None:
    """The demo agent as a Python callable, speaking HTTP with aiohttp."""
    import aiohttp

    headers = {"Authorization": f"Bearer {task.api_key}"}
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=600)) as http:

        async def chat(messages: list[dict[str, Any]]) -> dict[str, Any]:
            body = {"model": task.model, "messages": messages, "tools": task.tools}
            async with http.post(f"{task.base_url}/chat/completions", json=body) as r:
                data = await r.json()
                if r.status != 200:
                    raise RuntimeError(f"chat call failed ({r.status}): {data.get('error', data)}")
            return data["choices"][0]["message"]

        async def tool(name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
            if task.call_tool is not None:
                return await task.call_tool(name, arguments)
            return await _http_tool(http, task.tools_url, name, arguments)

        return await play(task.messages, task.max_turns, chat, tool)


async def _http_tool(http: Any, tools_url: str, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
    async with http.post(f"{tools_url}/{name}", json={"arguments": arguments}) as r:
        data = await r.json()
        if r.status != 200:
            raise RuntimeError(f"tool call failed ({r.status}): {data.get('error', data)}")
    return data["output"], data["done"]


async def _main() -> None:
    """Subprocess entry: the ``openai`` client, configured only by the environment."""
    import aiohttp
    import openai

    task = json.loads(os.environ["AGENTFLOW_TASK"])
    client = openai.AsyncOpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment
    model = os.environ["OPENAI_MODEL"]

    async def chat(messages: list[dict[str, Any]]) -> dict[str, Any]:
        r = await client.chat.completions.create(model=model, messages=messages, tools=task["tools"])
        return r.choices[0].message.model_dump(exclude_none=True)

    headers = {"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}
    async with aiohttp.ClientSession(headers=headers) as http:

        async def tool(name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
            return await _http_tool(http, task["tools_url"], name, arguments)

        answer = await play(task["messages"], task["max_turns"], chat, tool)
    await client.close()
    if answer is not None:
        print(answer.replace("\n", " "))


if __name__ == "__main__":
    import asyncio

    asyncio.run(_main())
    sys.exit(0)
