"""MCP tool servers as env tools: a real server written with the SDK (tests/fixtures/mcp_server.py), over stdio in
the bwrap sandbox and over streamable HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from envs.core import answer_action, tool_action
from envs.mcp import MCPError, MCPServer, MCPToolEnv, MCPToolSet, from_config
from envs.sandbox import bwrap_works
from envs.tasks import simple_task_set

SERVER = Path(__file__).parent / "fixtures" / "mcp_server.py"
REQUIRE_ALL = os.environ.get("AGENTFLOW_REQUIRE_ALL") == "1"


def _needs_bwrap() -> None:
    if not bwrap_works():
        if REQUIRE_ALL:
            pytest.fail("bwrap is required (AGENTFLOW_REQUIRE_ALL=1) but does not work here")
        pytest.skip("bwrap does not work here")


class AddEnv(MCPToolEnv):
    """Answer a sum; the MCP server's ``add`` tool computes it."""

    system_prompt = "Use the add tool, then answer the sum."
    max_turns = 6
    task_sets = {"default": simple_task_set(task_types=("add",))}

    def reset_task(self, seed: int, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        split = options.get("split", "train")
        s = self.task_sets["default"].task_seed(seed, split)
        self.task = (s % 97, s % 89)
        return f"What is {self.task[0]} + {self.task[1]}?", {"task_id": f"add-{s}", "task_type": "add", "split": split}

    def score_answer(self, text: str) -> tuple[float, bool]:
        ok = text.strip() == str(sum(self.task))
        return float(ok), ok


def _processes_with(marker: str) -> list[int]:
    """Pids whose command line contains ``marker`` (only the processes these tests start carry it)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            found.append(int(entry))
    return found


def _gone(marker: str, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while _processes_with(marker):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture
def stdio_env() -> Iterator[AddEnv]:
    _needs_bwrap()
    env = AddEnv(mcp_servers=[MCPServer.python(str(SERVER), call_timeout_s=1.5)])
    try:
        yield env
    finally:
        env.close()


def test_stdio_server_in_the_sandbox_lists_and_calls_its_tools(stdio_env: AddEnv) -> None:
    env = stdio_env
    names = [t.name for t in env.tools]
    assert names == ["add", "fail", "hang", "spawn", "where"]
    add = env.tool_spec("add")
    assert add is not None and add.description == "Add two integers."
    assert add.parameters["required"] == ["a", "b"]
    assert add.parameters["properties"]["a"]["type"] == "integer"
    obs, info = env.reset(seed=3)
    a, b = env.task
    obs, reward, done, truncated, _ = env.step(tool_action("add", {"a": a, "b": b}))
    assert obs == str(a + b) and not done
    obs, reward, done, _, info = env.step(answer_action(obs))
    assert done and reward == 1.0 and info["success"]
    assert env.tool_calls == ["add"]
    where = json.loads(env.mcp[0].call("where", {}))
    assert where["network"] is False and where["cwd"] == "/tmp/sandbox" and where["uid"] != os.getuid()


def test_tool_errors_timeouts_and_bad_calls_are_error_observations(stdio_env: AddEnv) -> None:
    env = stdio_env
    env.reset(seed=0)
    obs, reward, done, truncated, _ = env.step(tool_action("fail", {"message": "boom"}))
    assert obs.startswith("Error: ") and "fail" in obs and not done and reward == 0.0
    t0 = time.monotonic()
    obs, *_ = env.step(tool_action("hang", {"seconds": 60}))
    assert obs == "Error: tool 'hang' timed out after 1.5 s"
    assert time.monotonic() - t0 < 10
    obs, *_ = env.step(tool_action("add", {"a": "x", "b": 1}))  # our schema check answers before the server
    assert obs.startswith("Error: argument 'a' of tool 'add' must be integer")
    obs, *_ = env.step(tool_action("nope", {}))
    assert obs.startswith("Error: unknown tool 'nope'")
    obs, *_ = env.step(tool_action("add", {"a": 20, "b": 22}))  # the session survived all of that
    assert obs == "42"


def test_async_steps_from_another_event_loop(stdio_env: AddEnv) -> None:
    env = stdio_env

    async def episode() -> list[str]:
        await env.areset(seed=5)
        calls = [env.astep(tool_action("hang", {"seconds": 0.2})), env.mcp[0].acall("add", {"a": 1, "b": 2})]
        first = await calls[0]
        return [first[0], await calls[1]]

    assert asyncio.run(episode()) == ["slept 0.2", "3"]


def test_closing_leaves_no_process_behind() -> None:
    _needs_bwrap()
    marker = "271.828"  # the grandchild's `sleep` argument: only this test starts it
    env = AddEnv(mcp_servers=[MCPServer.python(str(SERVER))])
    env.reset(seed=0)
    assert env.step(tool_action("spawn", {"seconds": marker}))[0] == "started"
    assert _processes_with(f"sleep {marker}") and _processes_with(str(SERVER))
    env.close()
    assert _gone(f"sleep {marker}") and _gone(str(SERVER))


def test_a_dead_server_is_an_error_then_reconnected_at_reset() -> None:
    env = AddEnv(mcp_servers=[MCPServer.python(str(SERVER), sandbox=None)])
    try:
        env.reset(seed=0)
        for pid in _processes_with(str(SERVER)):
            os.kill(pid, 9)
        obs, *_ = env.step(tool_action("add", {"a": 1, "b": 1}))
        assert obs.startswith("Error: ") and "add" in obs
        env.reset(seed=1)
        assert env.step(tool_action("add", {"a": 1, "b": 1}))[0] == "2"
    finally:
        env.close()
    assert _gone(str(SERVER))


def test_a_server_that_cannot_start_says_why() -> None:
    bad = MCPServer(command=(sys.executable, "-c", "import sys; sys.stderr.write('no such tool set'); sys.exit(3)"),
                    sandbox=None, connect_timeout_s=20)  # fmt: skip
    with pytest.raises(MCPError, match="failed to start.*no such tool set"):
        MCPToolSet(bad)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def http_server() -> Iterator[str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, str(SERVER), "http", str(port)], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the MCP HTTP server did not start") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.kill()
        proc.wait()


def test_http_server_lists_calls_errors_and_times_out(http_server: str) -> None:
    env = AddEnv(mcp_servers=[{"url": http_server, "call_timeout_s": 1.0, "prefix": "calc_"}])
    try:
        assert [t.name for t in env.tools] == ["calc_add", "calc_fail", "calc_hang", "calc_spawn", "calc_where"]
        env.reset(seed=2)
        assert env.step(tool_action("calc_add", {"a": 2, "b": 40}))[0] == "42"
        assert env.step(tool_action("calc_fail", {"message": "x"}))[0].startswith("Error: ")
        assert env.step(tool_action("calc_hang", {"seconds": 30}))[0] == "Error: tool 'calc_hang' timed out after 1 s"
        assert env.step(tool_action("calc_add", {"a": 1, "b": 2}))[0] == "3"
    finally:
        env.close()


def test_server_config_errors_are_named() -> None:
    with pytest.raises(MCPError, match="exactly one of 'command'"):
        MCPServer()
    with pytest.raises(MCPError, match="exactly one of 'command'"):
        MCPServer(command=("x",), url="http://127.0.0.1:1/mcp")
    with pytest.raises(MCPError, match=r"unknown MCP server key\(s\) \['commnd'\]"):
        from_config({"commnd": ["x"]})
    with pytest.raises(MCPError, match="sandbox must be"):
        from_config({"command": ["x"], "sandbox": "chroot"})
    server = from_config({"command": ["a", "b"], "limits": {"cpu_s": 5}, "include": ["add"]})
    assert server.command == ("a", "b") and server.limits.cpu_s == 5 and server.limits.memory_mb == 4096


def test_include_and_clashing_names(http_server: str) -> None:
    only = MCPToolSet(MCPServer(url=http_server, include=("add",)))
    try:
        assert [s.name for s in only.specs] == ["add"]
    finally:
        only.close()
    with pytest.raises(MCPError, match="has no tool"):
        MCPToolSet(MCPServer(url=http_server, include=("add", "mul")))
    with pytest.raises(MCPError, match="is taken; set a 'prefix'"):
        AddEnv(mcp_servers=[MCPServer(url=http_server), MCPServer(url=http_server)])


def test_the_mcp_env_passes_conformance_and_the_fuzz(stdio_env: AddEnv) -> None:
    from envs.checker import check_agent_env
    from envs.fuzz import fuzz_env

    check_agent_env(stdio_env, actions=[tool_action("add", {"a": 1, "b": 2}), answer_action("3")])
    report = fuzz_env(stdio_env, 120, seed=11)
    assert report.ok, report.failures[:3]


def test_a_server_that_never_answers_times_out_and_is_killed() -> None:
    marker = "314.159"  # only this test runs a `sleep` this long
    silent = MCPServer(command=("sleep", marker), sandbox=None, connect_timeout_s=1.5)
    t0 = time.monotonic()
    with pytest.raises(MCPError, match="did not start and list its tools within 1.5 s"):
        MCPToolSet(silent)
    assert time.monotonic() - t0 < 15
    assert _gone(f"sleep {marker}")
