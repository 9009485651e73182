"""Malformed actions from a seeded generator, and the check that an env answers each one and stays usable.

:func:`malformed_actions` makes the actions a weak model writes: empty strings, prose, cut-off JSON, JSON that is
not an object, unknown tools, wrong keys, missing and unknown arguments, wrong argument types, megabyte arguments,
non-UTF-8 text and NUL characters, random bytes, deep nesting, huge and non-finite numbers, and ``file://``,
link-local and loopback URLs in string arguments. The same ``(tools, n, seed, limits)`` always gives the same
actions, so a failure is replayed from its seed.

:func:`fuzz_env` sends them (half through ``step``, half through ``astep``) and holds the env to its contract: each
action is answered within the step timeout, never with an exception, never with a reward or the end of the
episode; every malformed one is answered with an ``"Error: ..."`` observation (a well-formed action carrying a
hostile URL only has to be answered, unless its argument is a URL, which must be refused); and after the last one
the env still resets and plays a short episode.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from envs.core import AgentEnv, ToolSpec, answer_action, tool_action
from envs.limits import ActionLimits

DEFAULT_STEP_TIMEOUT_S = 30.0
HOSTILE_URLS = (
    "file:///etc/passwd",
    "file:///proc/self/environ",
    "http://169.254.169.254/latest/meta-data/",
    "http://[fe80::1]/",
    "http://127.0.0.1:1/",
    "http://localhost:22/",
    "javascript:alert(1)",
    "data:text/html,<script>alert(1)</script>",
)
_URL_PARAMS = ("url", "href", "link", "uri")


@dataclass(frozen=True)
class FuzzCase:
    """One malformed action: its kind, the action (a str, or bytes for the non-string case), and whether the env
    must answer it with an ``"Error: ..."`` observation."""

    kind: str
    action: Any
    must_error: bool = True

    def preview(self, limit: int = 80) -> str:
        """A short, printable view of the action."""
        text = repr(self.action)
        return text if len(text) <= limit else f"{text[: limit - 20]}...({len(text)} chars)"


@dataclass
class FuzzReport:
    """What :func:`fuzz_env` found: the failures (empty when the env passed) and how long it took."""

    seed: int
    cases: int
    failures: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    slowest_s: float = 0.0
    kinds: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when every action was answered as the contract says and the env stayed usable."""
        return not self.failures


# -- the generator -----------------------------------------------------------------------------------------------
def _params(tools: list[ToolSpec]) -> list[tuple[ToolSpec, str, dict[str, Any]]]:
    return [(t, name, prop) for t in tools for name, prop in t.parameters.get("properties", {}).items()]


def _string_params(tools: list[ToolSpec]) -> list[tuple[ToolSpec, str, dict[str, Any]]]:
    return [p for p in _params(tools) if "string" in _types(p[2]) and "enum" not in p[2]]


def _types(prop: dict[str, Any]) -> list[str]:
    kinds = prop.get("type")
    return [kinds] if isinstance(kinds, str) else list(kinds or [])


def _filled(tool: ToolSpec, override: dict[str, Any]) -> dict[str, Any]:
    """Arguments for ``tool``: its required ones with plausible values, then ``override``."""
    plausible = {"string": "x", "integer": 1, "number": 1.5, "boolean": True, "array": [], "object": {}}
    props = tool.parameters.get("properties", {})
    args: dict[str, Any] = {}
    for name in tool.parameters.get("required", []):
        prop = props.get(name, {})
        kinds = [k for k in _types(prop) if k != "null"]
        args[name] = prop["enum"][0] if prop.get("enum") else plausible.get(kinds[0] if kinds else "string", "x")
    return {**args, **override}


Maker = Callable[[random.Random, list[ToolSpec], ActionLimits], FuzzCase | None]


def _empty(rng: random.Random, tools: list[ToolSpec], limits: ActionLimits) -> FuzzCase:
    return FuzzCase("empty", rng.choice(["", " ", "\n", "\t \n", "{}", "[]", "null"]))


def _prose(rng: random.Random, tools: list[ToolSpec], limits: ActionLimits) -> FuzzCase:
    words = ["I", "think", "the", "answer", "is", "call", "the", "tool", "please", "42", "<tool_call>", "```json"]
    return FuzzCase("not_json", " ".join(rng.choice(words) for _ in range(rng.randint(1, 12))))


def _cut(rng: random.Random, tools: list[ToolSpec], limits: ActionLimits) -> FuzzCase:
    tool = rng.choice(tools) if tools else None
    full = tool_action(tool.name, _filled(tool, {})) if tool else answer_action("x")
    return FuzzCase("truncated_json", full[: rng.randint(1, len(full) - 1)])


def _not_object(rng: random.Random, tools: list[ToolSpec], limits: ActionLimits) -> FuzzCase:
    name = rng.choice(tools).name if tools else "tool"
    return FuzzCase("not_object", json.dumps(rng.choice([[name, {}], name, 3, 2.5, None, True, [{"tool": name}]])))


def _unknown_tool(rng: random.Random, tools: list[ToolSpec], limits: ActionLimits) -> FuzzCase:
    known = {t.name for t in tools}
    name = rng.choice(["search_web", "python", "bash", "", " ", "calc ", "CLICK", "../etc", "tool"])
    name = name if name not in known else name + "_x"
    return FuzzCase("unknown_tool", json.dumps({"tool": name, "arguments": {}}))


def _wrong_keys(rng: random.Random, tools: list[ToolSpec], limits: ActionLimits) -> FuzzCase:
    name = rng.choice(tools).name if tools else "tool"
    shapes = [
        {"tool": name, "args": {}},
        {"name": name, "arguments": {}},
        {"tool": 5},
        {"tool": [name]},
        {"answer": 3},
        {"answer": None},
        {"answer": "x", "tool": name},
        {"tool": name, "arguments": [1, 2]},
        {"tool": name, "arguments": "{}"},
        {"function": {"name": name, "arguments": "{}"}},
    ]
    return FuzzCase("wrong_keys", json.dumps(rng.choice(shapes)))


def _missing(rng: random.Random, tools: list[ToolSpec], limits: ActionLimits) -> FuzzCase | None:
    needy = [t for t in tools if t.parameters.get("required")]
    return FuzzCase("missing_argument", tool_action(rng.choice(needy).name, {})) if needy else None


def _wrong_type(rng: random.Random, tools: list[ToolSpec], limits: ActionLimits) -> FuzzCase | None:
    typed = [p for p in _params(tools) if _types(p[2])]
    if not typed:
        return None
    tool, name, prop = rng.choice(typed)
    accepted = set(_types(prop)) | ({"integer"} if "number" in _types(prop) else set())
    values = {"string": "1", "integer": 7, "number": 0.5, "boolean": False, "array": ["x"], "object": {"a": 1}}
    values["null"] = None
    wrong = [v for k, v in values.items() if k not in accepted]
    if not wrong:
        return None
    return FuzzCase("wrong_type", tool_action(tool.name, _filled(tool, {name: rng.choice(wrong)})))


def _unknown_argument(rng: random.Random, tools: list[ToolSpec], limits: ActionLimits) -> FuzzCase | None:
    strict = [t for t in tools if t.parameters.get("additionalProperties", True) is False]
    if not strict:
        return None
    tool = rng.choice(strict)
    return FuzzCase("unknown_argument", tool_action(tool.name, _filled(tool, {"__nope__": rng.choice([1, "x"])})))


def _huge(rng: random.Random, tools: list[ToolSpec], limits: ActionLimits) -> FuzzCase:
    strings = _string_params(tools)
    size = rng.choice([1 << 20, limits.max_string_chars + 1, limits.max_action_chars + 1])
    text = rng.choice("ab\u00e9\u4e2d ") * size
    if not strings or rng.random() < 0.2:
        return FuzzCase("huge_argument", answer_action(text) if rng.random() < 0.5 else text)
    tool, name, _ = rng.choice(strings)
    return FuzzCase("huge_argument", tool_action(tool.name, _filled(tool, {name: text})))


def _bad_text(rng: random.Random, tools: list[ToolSpec], limits: ActionLimits) -> FuzzCase:
    bad = rng.choice(["\udcff", "ok\ud800", "\udfff\udfff", "a\x00b", "\x00", "\ud83d"])
    strings = _string_params(tools)
    if not strings or rng.random() < 0.2:
        return FuzzCase("non_utf8", answer_action(bad))
    tool, name, _ = rng.choice(strings)
    action = tool_action(tool.name, _filled(tool, {name: bad}))
    return FuzzCase("non_utf8", action if rng.random() < 0.5 else json.dumps(json.loads(action)))  # raw or escaped


def _random_bytes(rng: random.Random, tools: list[ToolSpec], limits: ActionLimits) -> FuzzCase:
    raw = bytes(rng.randrange(256) for _ in range(rng.randint(1, 256)))
    if rng.random() < 0.3:
        return FuzzCase("random_bytes", raw)  # not even a str
    return FuzzCase("random_bytes", raw.decode("utf-8", "surrogateescape"))


def _deep(rng: random.Random, tools: list[ToolSpec], limits: ActionLimits) -> FuzzCase:
    depth = rng.choice([limits.max_depth + 1, 1000, 30_000])
    nested = "[" * depth + "]" * depth
    strings = _params(tools)
    if not strings or rng.random() < 0.3:
        return FuzzCase("deep_nesting", nested if rng.random() < 0.5 else "{" * depth)
    tool, name, _ = rng.choice(strings)
    head = json.dumps({"tool": tool.name, "arguments": {name: 0}})
    return FuzzCase("deep_nesting", head[: head.rindex("0")] + nested + "}}")


def _huge_number(rng: random.Random, tools: list[ToolSpec], limits: ActionLimits) -> FuzzCase | None:
    params = _params(tools)
    if not params:
        return None
    tool, name, _ = rng.choice(params)
    number = rng.choice(["9" * 5000, "-" + "9" * 30, "1e999", "-1e999", "NaN", "Infinity", str(2**64)])
    base = json.dumps({"tool": tool.name, "arguments": _filled(tool, {name: 0})})
    return FuzzCase("huge_number", base.replace(f"{json.dumps(name)}: 0", f"{json.dumps(name)}: {number}", 1))


def _url(rng: random.Random, tools: list[ToolSpec], limits: ActionLimits) -> FuzzCase | None:
    strings = _string_params(tools)
    if not strings:
        return None
    tool, name, _ = rng.choice(strings)
    url = rng.choice(HOSTILE_URLS)
    return FuzzCase("url", tool_action(tool.name, _filled(tool, {name: url})), name.lower() in _URL_PARAMS)


MAKERS: tuple[Maker, ...] = (_empty, _prose, _cut, _not_object, _unknown_tool, _wrong_keys, _missing, _wrong_type,
                             _unknown_argument, _huge, _bad_text, _random_bytes, _deep, _huge_number, _url)  # fmt: skip


def malformed_actions(tools: list[ToolSpec], n: int, seed: int, limits: ActionLimits | None = None) -> list[FuzzCase]:
    """``n`` malformed actions for an env with ``tools`` (the same for the same arguments)."""
    rng = random.Random(f"agentflow-fuzz:{seed}")
    limits = limits or ActionLimits()
    out: list[FuzzCase] = []
    while len(out) < n:
        case = rng.choice(MAKERS)(rng, tools, limits)
        if case is not None:
            out.append(case)
    return out


# -- the check ---------------------------------------------------------------------------------------------------
def step_timeout(env: AgentEnv) -> float:
    """The env's step timeout (``step_timeout_s`` where it declares one), else :data:`DEFAULT_STEP_TIMEOUT_S`."""
    declared = getattr(env, "step_timeout_s", None)
    return float(declared) if isinstance(declared, int | float) and declared > 0 else DEFAULT_STEP_TIMEOUT_S


def fuzz_env(env: AgentEnv, n: int, seed: int, timeout_s: float | None = None, reset_seed: int = 7) -> FuzzReport:
    """Send ``n`` malformed actions to ``env`` (the first half through ``step``, the rest through ``astep``) and
    report every broken contract; the env is reset whenever an episode ends, and once more at the end."""
    timeout = timeout_s if timeout_s is not None else step_timeout(env)
    cases = malformed_actions(list(env.tools), n, seed, env.action_limits)
    report = FuzzReport(seed, n)
    for case in cases:
        report.kinds[case.kind] = report.kinds.get(case.kind, 0) + 1
    t0 = time.perf_counter()
    half = n // 2
    ok = _fuzz_sync(env, cases[:half], timeout, reset_seed, report)
    if ok:
        ok = asyncio.run(_fuzz_async(env, cases[half:], timeout, reset_seed, report, half))
    if ok:
        _still_usable(env, timeout, reset_seed, report)
    report.wall_s = time.perf_counter() - t0
    return report


def _in_thread(fn: Callable[[], Any], timeout: float) -> Any:
    """``fn()`` in a daemon thread; raises :class:`TimeoutError` when it has not returned after ``timeout``
    (the thread is left behind: a hung env must not hang the check, nor the interpreter's exit)."""
    done: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def run() -> None:
        try:
            done.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            done.set_exception(e)

    threading.Thread(target=run, name="agentflow-fuzz", daemon=True).start()
    try:
        return done.result(timeout)
    except concurrent.futures.TimeoutError:
        raise TimeoutError from None


def _fuzz_sync(env: AgentEnv, cases: list[FuzzCase], timeout: float, reset_seed: int, report: FuzzReport) -> bool:
    """Steps in a worker thread, so a step that hangs is reported instead of hanging the check."""
    for i, case in enumerate(cases):
        if not _call(lambda: _reset_if_over(env, reset_seed), timeout, report, f"reset before case {i}"):
            return False
        t = time.perf_counter()
        try:
            step = _in_thread(functools.partial(env.step, case.action), timeout)
        except TimeoutError:
            report.failures.append(_where(i, case, f"no answer within the step timeout ({timeout:g} s)"))
            return False
        except Exception as e:  # noqa: BLE001 - any exception is the finding
            report.failures.append(_where(i, case, f"raised {type(e).__name__}: {_short(e)}"))
            continue
        _judge(env, i, case, step, time.perf_counter() - t, timeout, report)
    return True


async def _fuzz_async(
    env: AgentEnv, cases: list[FuzzCase], timeout: float, reset_seed: int, report: FuzzReport, first: int
) -> bool:
    for i, case in enumerate(cases, start=first):
        try:
            if env._done or env.turn >= env.max_turns:
                await asyncio.wait_for(env.areset(seed=reset_seed), timeout)
        except Exception as e:  # noqa: BLE001 - a reset that fails after malformed actions is the finding
            report.failures.append(f"areset before case {i} failed: {type(e).__name__}: {_short(e)}")
            return False
        t = time.perf_counter()
        try:
            step = await asyncio.wait_for(env.astep(case.action), timeout)
        except TimeoutError:
            report.failures.append(_where(i, case, f"astep: no answer within the step timeout ({timeout:g} s)"))
            return False
        except Exception as e:  # noqa: BLE001
            report.failures.append(_where(i, case, f"astep raised {type(e).__name__}: {_short(e)}"))
            continue
        _judge(env, i, case, step, time.perf_counter() - t, timeout, report)
    return True


def _reset_if_over(env: AgentEnv, reset_seed: int) -> None:
    if env._done or env.turn >= env.max_turns:
        env.reset(seed=reset_seed)


def _judge(env: AgentEnv, i: int, case: FuzzCase, step: Any, took: float, timeout: float, report: FuzzReport) -> None:
    report.slowest_s = max(report.slowest_s, took)
    obs, reward, terminated, truncated, _ = step
    problems = []
    if took > timeout:
        problems.append(f"answered after {took:.1f} s, past the step timeout ({timeout:g} s)")
    if not isinstance(obs, str) or obs not in env.observation_space:
        problems.append(f"observation not in the observation space: {_short(obs)}")
    elif case.must_error and not obs.startswith("Error: "):
        problems.append(f"answered {_short(obs)} instead of an 'Error: ...' observation")
    if reward != 0.0 or terminated:
        problems.append(f"ended the episode or paid for it (reward {reward}, terminated {terminated})")
    if truncated and env.turn < env.max_turns:
        problems.append("truncated the episode before max_turns")
    if problems:
        report.failures.append(_where(i, case, "; ".join(problems)))


def _still_usable(env: AgentEnv, timeout: float, reset_seed: int, report: FuzzReport) -> None:
    """After the fuzz: a reset, a call of the first tool with its required arguments, and an answer."""

    def episode() -> None:
        env.reset(seed=reset_seed)
        if env.tools:
            obs = env.step(tool_action(env.tools[0].name, _filled(env.tools[0], {})))[0]
            assert isinstance(obs, str), f"the tool call after the fuzz gave {type(obs).__name__}"
        final = env.step(answer_action("0"))
        assert final[2] or final[3] or env.turn < env.max_turns, "the answer after the fuzz did not end the episode"

    _call(episode, timeout * 3, report, "the episode after the fuzz")


def _call(fn: Callable[[], None], timeout: float, report: FuzzReport, what: str) -> bool:
    try:
        _in_thread(fn, timeout)
    except TimeoutError:
        report.failures.append(f"{what}: no answer within {timeout:g} s (the env did not recover)")
        return False
    except Exception as e:  # noqa: BLE001
        report.failures.append(f"{what} failed: {type(e).__name__}: {_short(e)}")
        return False
    return True


def _where(i: int, case: FuzzCase, problem: str) -> str:
    return f"case {i} ({case.kind}, action {case.preview()}): {problem}"


def _short(value: Any, limit: int = 160) -> str:
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
