"""Environment contracts: tool specs, the text space, canonical actions and the :class:`AgentEnv` base.

An action is one JSON string (a settled convention): ``{"tool": NAME, "arguments": {...}}`` to call a tool, or
``{"answer": TEXT}`` to answer and end the episode. Chat formats and the model's tool-call syntax live in
``agentflow``; environments only see this canonical form.
"""

from __future__ import annotations

import asyncio
import json
import string
from dataclasses import dataclass, field
from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces

from envs.errors import ActionError, EnvError, VerifierError
from envs.limits import DEFAULT_LIMITS, ActionLimits, check_action_text, check_text, check_value_tree
from envs.tasks import TaskSet

ACTION_FORMAT = 'expected {"tool": NAME, "arguments": {...}} or {"answer": TEXT}'


@dataclass(frozen=True)
class ToolSpec:
    """A tool an environment offers: its name, what it does, and a JSON-schema object for its arguments."""

    name: str
    description: str
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI chat ``tools`` entry for this tool."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": json.loads(json.dumps(self.parameters)),
            },
        }


_SAMPLE_CHARS = string.printable + "éüß→λ中"


class AnyText(spaces.Space[str]):
    """Any Python ``str`` of at most ``max_length`` characters (unlike ``spaces.Text``, no charset restriction)."""

    def __init__(self, max_length: int = 16384, seed: int | np.random.Generator | None = None) -> None:
        if max_length < 0:
            raise ValueError(f"max_length must be >= 0, got {max_length}")
        self.max_length = max_length
        super().__init__(shape=None, dtype=None, seed=seed)

    @property
    def is_np_flattenable(self) -> bool:
        """Text cannot be flattened into a numpy array."""
        return False

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        """A random string (printable ASCII plus a few non-ASCII characters) of up to 64 characters."""
        n = int(self.np_random.integers(0, min(self.max_length, 64) + 1))
        idx = self.np_random.integers(0, len(_SAMPLE_CHARS), size=n)
        return "".join(_SAMPLE_CHARS[i] for i in idx)

    def contains(self, x: Any) -> bool:
        """True for a ``str`` of at most ``max_length`` characters."""
        return isinstance(x, str) and len(x) <= self.max_length

    def to_jsonable(self, sample_n: Any) -> list[str]:
        """Strings are already JSON-able."""
        return list(sample_n)

    def from_jsonable(self, sample_n: list[Any]) -> list[str]:
        """Strings come back unchanged."""
        return [str(s) for s in sample_n]

    def __repr__(self) -> str:
        return f"AnyText(max_length={self.max_length})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AnyText) and other.max_length == self.max_length


@dataclass(frozen=True)
class ToolAction:
    """Call tool ``tool`` with ``arguments``."""

    tool: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class AnswerAction:
    """Answer ``text`` (ends the episode)."""

    text: str


def parse_action(s: str, limits: ActionLimits = DEFAULT_LIMITS) -> ToolAction | AnswerAction:
    """Parse a canonical action string; raises :class:`ActionError` saying what is wrong.

    ``"arguments"`` may be omitted (it then means ``{}``); any other extra key is an error. ``limits`` bound the
    action's size, its strings, its nesting and its numbers (:mod:`envs.limits`).
    """
    if not isinstance(s, str):
        raise ActionError(f"action must be a string, got {type(s).__name__}; {ACTION_FORMAT}")
    check_action_text(s, limits)
    if not s.strip():
        raise ActionError(f"action is empty; {ACTION_FORMAT}")
    obj = _load_json(s)
    if not isinstance(obj, dict):
        raise ActionError(f"action must be a JSON object, got {type(obj).__name__}; {ACTION_FORMAT}")
    keys = set(obj)
    if keys == {"answer"}:
        if not isinstance(obj["answer"], str):
            raise ActionError(f'"answer" must be a string, got {type(obj["answer"]).__name__}')
        check_text(obj["answer"], "the answer", limits)
        return AnswerAction(obj["answer"])
    if "tool" in keys and keys <= {"tool", "arguments"}:
        name, args = obj["tool"], obj.get("arguments", {})
        if not isinstance(name, str) or not name:
            raise ActionError('"tool" must be a non-empty string naming a tool')
        check_text(name, "the tool name", limits)
        if not isinstance(args, dict):
            raise ActionError(f'"arguments" must be a JSON object, got {type(args).__name__}')
        check_value_tree(args, "arguments", limits)
        return ToolAction(name, args)
    shown = sorted(k if len(k) <= 40 else k[:37] + "..." for k in list(keys)[:8])
    raise ActionError(f"action has keys {shown}; {ACTION_FORMAT}")


def _load_json(s: str) -> Any:
    """``json.loads``, with every way it can fail (nesting past the recursion limit, an integer with more digits than
    Python converts) as an :class:`ActionError`."""
    try:
        return json.loads(s)
    except json.JSONDecodeError as e:
        raise ActionError(f"action is not valid JSON ({e.msg} at position {e.pos}); {ACTION_FORMAT}") from None
    except RecursionError:
        raise ActionError("action nests too deeply to parse") from None
    except ValueError as e:  # e.g. "Exceeds the limit (4300 digits) for integer string conversion"
        raise ActionError(f"action is not usable JSON ({e})") from None


def tool_action(name: str, args: dict[str, Any] | None = None) -> str:
    """The canonical action string calling tool ``name`` with ``args``."""
    return json.dumps({"tool": name, "arguments": args or {}}, ensure_ascii=False)


def answer_action(text: str) -> str:
    """The canonical action string answering ``text``."""
    return json.dumps({"answer": text}, ensure_ascii=False)


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
    "null": (type(None),),
}


def validate_arguments(spec: ToolSpec, args: dict[str, Any]) -> None:
    """Check ``args`` against the top level of ``spec.parameters`` (required keys, known keys, basic types, enum)."""
    schema = spec.parameters
    props: dict[str, Any] = schema.get("properties", {})
    missing = [k for k in schema.get("required", []) if k not in args]
    if missing:
        raise ActionError(f"tool {spec.name!r} is missing required argument(s): {', '.join(missing)}")
    if schema.get("additionalProperties", True) is False:
        extra = sorted(set(args) - set(props))
        if extra:
            raise ActionError(f"tool {spec.name!r} got unknown argument(s): {', '.join(extra)}; known: {sorted(props)}")
    for key, value in args.items():
        prop = props.get(key, {})
        kinds = prop.get("type")
        names = [kinds] if isinstance(kinds, str) else list(kinds or [])
        if names and not any(_is_type(value, n) for n in names):
            got = type(value).__name__
            raise ActionError(f"argument {key!r} of tool {spec.name!r} must be {' or '.join(names)}, got {got}")
        if "enum" in prop and value not in prop["enum"]:
            raise ActionError(f"argument {key!r} of tool {spec.name!r} must be one of {prop['enum']}")
        check_max_length(prop, value, f"argument {key!r} of tool {spec.name!r}")


def check_max_length(schema: dict[str, Any], value: Any, where: str) -> None:
    """The schema's ``maxLength`` (strings) and ``maxItems`` (arrays), when it declares them."""
    if isinstance(value, str) and len(value) > schema.get("maxLength", len(value)):
        raise ActionError(f"{where} is {len(value)} characters; this tool takes at most {schema['maxLength']}")
    if isinstance(value, list) and len(value) > schema.get("maxItems", len(value)):
        raise ActionError(f"{where} has {len(value)} items; this tool takes at most {schema['maxItems']}")


def _is_type(value: Any, name: str) -> bool:
    if isinstance(value, bool) and name in ("integer", "number"):
        return False
    return isinstance(value, _JSON_TYPES.get(name, (object,)))


class AgentEnv(gymnasium.Env[str, str]):
    """Base of multi-turn text/tool environments: Gymnasium ``reset``/``step`` plus ``areset``/``astep``.

    Subclasses set ``tools`` and ``system_prompt`` and implement :meth:`reset_task`, :meth:`call_tool` and
    :meth:`score_answer` (and :meth:`acall_tool` when a tool waits on something slow). The base class parses
    actions, turns bad actions into ``"Error: ..."`` observations (reward 0, not terminated, a turn counted),
    truncates when ``max_turns`` turns pass without an answer, and fills the infos: reset's info has
    ``task_id``, ``task_type`` and ``split``; the final step's info has ``success`` and ``task_type`` (plus what
    :meth:`answer_info` adds). A :class:`~envs.errors.VerifierError` is never turned into an observation or a
    reward: it propagates, and the caller marks the trajectory ``error``.

    ``task_sets`` names the env's task sets (:class:`~envs.tasks.TaskSet`: disjoint train/eval seed ranges).
    """

    metadata: dict[str, Any] = {"render_modes": []}
    tools: list[ToolSpec] = []
    system_prompt: str = ""
    max_turns: int = 8
    max_observation_chars: int = 16384
    task_sets: dict[str, TaskSet] = {}
    action_limits: ActionLimits = DEFAULT_LIMITS
    """Bounds on one action (size, strings, nesting, numbers); see :mod:`envs.limits`."""
    branching: str | None = None
    """How an episode continues from a recorded prefix (:mod:`envs.branching`): ``snapshot`` (the env implements
    ``snapshot()``/``restore(state)``), ``replay`` (reset on the same seed and step the recorded actions again:
    deterministic envs) or ``none``; None: undeclared (``agentflow envs check`` says so; tree rollouts cannot branch
    it)."""

    def __init__(self, max_turns: int | None = None) -> None:
        if max_turns is not None:
            if max_turns < 1:
                raise ValueError(f"max_turns must be >= 1, got {max_turns}")
            self.max_turns = max_turns
        self.tools = list(self.tools)
        self.observation_space = AnyText(self.max_observation_chars)
        self.action_space = AnyText(self.max_observation_chars)
        self._turn = 0
        self._done = True
        self._task_info: dict[str, Any] = {}

    # -- what subclasses implement -----------------------------------------------------------------------------
    def reset_task(self, seed: int, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Start the task for ``seed``; return the first observation and an info with task_id, task_type, split."""
        raise NotImplementedError

    def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        """Run tool ``name`` (already validated against its spec) and return the observation text.

        Raise :class:`EnvError` (e.g. ``ActionError``, ``SandboxError``) to answer with an ``"Error: ..."``.
        """
        raise NotImplementedError

    async def acall_tool(self, name: str, arguments: dict[str, Any]) -> str:
        """Awaitable :meth:`call_tool`; by default runs it in a worker thread. Override for slow waits."""
        return await asyncio.to_thread(self.call_tool, name, arguments)

    def score_answer(self, text: str) -> tuple[float, bool]:
        """Reward and success of answering ``text``."""
        raise NotImplementedError

    async def ascore_answer(self, text: str) -> tuple[float, bool]:
        """Awaitable :meth:`score_answer`, in a worker thread by default: a verifier that hangs must not stall the
        event loop that every other episode runs on (the caller's step timeout can then end this one)."""
        return await asyncio.to_thread(self.score_answer, text)

    def answer_info(self) -> dict[str, Any]:
        """Extra keys for the final step's info after an answer (e.g. reward terms); empty by default."""
        return {}

    # -- Gymnasium API -----------------------------------------------------------------------------------------
    @property
    def turn(self) -> int:
        """Number of steps taken in the current episode."""
        return self._turn

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Start an episode. Without ``seed``, the task seed is drawn from ``np_random`` (seeded by earlier resets)."""
        super().reset(seed=seed)
        task_seed = seed if seed is not None else int(self.np_random.integers(0, 2**31 - 1))
        obs, info = self.reset_task(task_seed, dict(options or {}))
        missing = {"task_id", "task_type", "split"} - set(info)
        if missing:
            raise EnvError(f"{type(self).__name__}.reset_task info lacks {sorted(missing)}")
        self._task_info = {k: info[k] for k in ("task_id", "task_type", "split")}
        self._turn, self._done = 0, False
        return self._clip(obs), dict(info)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Apply one action; a bad action gives an ``"Error: ..."`` observation instead of raising."""
        parsed = self._begin_step(action)
        if isinstance(parsed, AnswerAction):
            return self._answer(parsed, self.score_answer(parsed.text))
        if isinstance(parsed, str):
            return self._end_step(parsed)
        try:
            obs = self.call_tool(parsed.tool, dict(parsed.arguments))
        except VerifierError:
            raise
        except EnvError as e:
            obs = f"Error: {e}"
        return self._end_step(obs)

    async def areset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        """Awaitable :meth:`reset` (in a worker thread by default)."""
        return await asyncio.to_thread(lambda: self.reset(seed=seed, options=options))

    async def astep(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Awaitable :meth:`step`: the same logic, with tools run through :meth:`acall_tool`."""
        parsed = self._begin_step(action)
        if isinstance(parsed, AnswerAction):
            return self._answer(parsed, await self.ascore_answer(parsed.text))
        if isinstance(parsed, str):
            return self._end_step(parsed)
        try:
            obs = await self.acall_tool(parsed.tool, dict(parsed.arguments))
        except VerifierError:
            raise
        except EnvError as e:
            obs = f"Error: {e}"
        return self._end_step(obs)

    # -- internals ---------------------------------------------------------------------------------------------
    def tool_spec(self, name: str) -> ToolSpec | None:
        """The spec of tool ``name``, or None."""
        return next((t for t in self.tools if t.name == name), None)

    def _begin_step(self, action: str) -> ToolAction | AnswerAction | str:
        """Count the turn and parse; returns the action, or an error observation for a bad one."""
        if self._done:
            raise EnvError("the episode is over (or never started): call reset() before step()")
        self._turn += 1
        try:
            parsed = parse_action(action, self.action_limits)
            if isinstance(parsed, ToolAction):
                spec = self.tool_spec(parsed.tool)
                if spec is None:
                    known = ", ".join(t.name for t in self.tools) or "none"
                    raise ActionError(f"unknown tool {parsed.tool!r}; available tools: {known}")
                validate_arguments(spec, parsed.arguments)
        except ActionError as e:
            return f"Error: {e}"
        return parsed

    def _answer(
        self, action: AnswerAction, scored: tuple[float, bool]
    ) -> tuple[str, float, bool, bool, dict[str, Any]]:
        reward, success = scored
        self._done = True
        info = {**self.answer_info(), **self._task_info, "turn": self._turn, "success": bool(success)}
        return self._clip("Correct." if success else "Incorrect."), float(reward), True, False, info

    def _end_step(self, obs: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        info: dict[str, Any] = {**self._task_info, "turn": self._turn}
        truncated = self._turn >= self.max_turns
        if truncated:
            self._done = True
            info["success"] = False
        return self._clip(obs), 0.0, False, truncated, info

    def _clip(self, text: str) -> str:
        limit = self.max_observation_chars
        if len(text) <= limit:
            return str(text)
        marker = "\n...[truncated]"
        return text[: limit - len(marker)] + marker
