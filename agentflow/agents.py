"""Agents by name: the registry, the base agent and its ``run(episode)`` hook, and the two built-in kinds.

``whitebox`` is our token loop (:mod:`agentflow.episode`); ``blackbox`` runs any program that speaks the OpenAI chat
API through the recording proxy (:mod:`agentflow.proxy`). A job picks one with ``agent.type``; a user's own agent
is a :class:`BaseAgent` named by ``module:Class``, declared as an ``agentflow.agents`` entry point, or registered
with :func:`register_agent` (its module imported before the job starts).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentflow.chat import ChatTokenizer
from agentflow.entrypoints import load_reference
from agentflow.episode import EpisodeSpec, run_episode
from agentflow.types import InferenceEngine, RecyclingEngine, SamplingParams, Trajectory


@dataclass
class Episode:
    """Everything one episode needs; the rollout scheduler builds it and hands it to :meth:`BaseAgent.run`."""

    spec: EpisodeSpec
    env: Any
    engine: InferenceEngine
    tokenizer: ChatTokenizer
    sampling: SamplingParams
    max_len: int


class BaseAgent:
    """An agent plays episodes. Subclasses implement :meth:`run`; :meth:`start`/:meth:`close` bracket a job."""

    name = "base"

    async def start(self, engine: InferenceEngine, tokenizer: ChatTokenizer) -> None:
        """Called once before the first episode (servers, programs to warm up)."""

    async def run(self, episode: Episode) -> Trajectory:
        """Play one episode and return its trajectory; never raise for a failed episode (mark it ``error``)."""
        raise NotImplementedError(f"agent {type(self).__name__} does not implement run(episode)")

    async def close(self) -> None:
        """Called once after the last episode."""


AgentFactory = Callable[..., BaseAgent]
_REGISTRY: dict[str, AgentFactory] = {}


def register_agent(name: str, factory: AgentFactory | None = None) -> Any:
    """Register ``factory(**settings) -> BaseAgent`` under ``name``; usable as a decorator."""

    def add(f: AgentFactory) -> AgentFactory:
        if name in _REGISTRY and _REGISTRY[name] is not f:
            raise ValueError(f"agent {name!r} is already registered")
        _REGISTRY[name] = f
        return f

    return add(factory) if factory is not None else add


def registered_agents() -> list[str]:
    return sorted(_REGISTRY)


ENTRY_POINT_GROUP = "agentflow.agents"
"""Installed packages may declare agents here: ``name = "package.module:AgentClass"``."""


def _entry_points() -> dict[str, Any]:
    import importlib.metadata  # lazily: it costs ~60 ms at import

    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def make_agent(name: str, **settings: Any) -> BaseAgent:
    """The agent ``name`` built with ``settings``: a registered name, an ``agentflow.agents`` entry point, or a
    ``module:Class`` reference. An unknown name says what is available and what is closest."""
    if name in _REGISTRY:
        factory = _REGISTRY[name]
    elif ":" in name:
        factory = load_reference(name, "agent.type")
    else:
        eps = _entry_points()
        if name not in eps:
            known = sorted({*_REGISTRY, *eps})
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown agent type {name!r}; registered: {known} (or use module:Class).{hint}")
        factory = eps[name].load()
    agent = factory(**settings)
    if not isinstance(agent, BaseAgent):
        raise ValueError(f"agent.type {name!r} made a {type(agent).__name__}, not an agentflow.agents.BaseAgent")
    return agent


@register_agent("whitebox")
class WhiteBoxAgent(BaseAgent):
    """Our token loop. ``context``: ``truncate`` ends an episode that fills the context, ``compact`` continues it in
    a new ``compact`` segment. ``unfinished_turn``: a reply cut at the token budget is acted on (``act``) or ends
    the episode unrewarded (``end``). ``recycle``: a generation aborted by a weight update is run again."""

    name = "whitebox"

    def __init__(
        self, context: str = "truncate", unfinished_turn: str = "act", recycle: bool = False, **_: Any
    ) -> None:
        if context not in ("truncate", "compact"):
            raise ValueError(f"agent.context must be 'truncate' or 'compact', got {context!r}")
        if unfinished_turn not in ("act", "end"):
            raise ValueError(f"agent.unfinished_turn must be 'act' or 'end', got {unfinished_turn!r}")
        self.context, self.unfinished_turn, self.recycle = context, unfinished_turn, recycle

    async def start(self, engine: InferenceEngine, tokenizer: ChatTokenizer) -> None:
        _abort_on_update(engine, self.recycle)

    async def run(self, episode: Episode) -> Trajectory:
        e = episode
        return await run_episode(e.engine, e.tokenizer, e.env, e.spec, e.sampling, e.max_len, context=self.context,
                                 recycle=self.recycle, unfinished_turn=self.unfinished_turn)  # fmt: skip


@register_agent("blackbox")
class BlackBoxAgent(BaseAgent):
    """A program speaking the OpenAI chat API (``entry``: ``module:function``, or ``command``: argv), recorded by a
    proxy this agent serves on 127.0.0.1 with a random key for the job's lifetime."""

    name = "blackbox"

    def __init__(
        self,
        entry: str | None = None,
        command: list[str] | None = None,
        timeout_s: float = 120.0,
        model_name: str = "agentflow-policy",
        recycle: bool = False,
        train_side_calls: bool = False,
        context: str = "truncate",
        unfinished_turn: str = "act",
        **_: Any,
    ) -> None:
        from agentflow.proxy.runner import CallableProgram, SubprocessProgram, load_callable

        if context != "truncate" or unfinished_turn != "act":  # the program, not our loop, decides what comes next
            raise ValueError("agent.context and agent.unfinished_turn apply to the whitebox agent only: a blackbox "
                             "program decides itself what a full context or a cut reply leads to")  # fmt: skip
        if (entry is None) == (command is None):
            raise ValueError("a blackbox agent needs exactly one of agent.entry (module:function) or agent.command")
        self.program = CallableProgram(load_callable(entry)) if entry else SubprocessProgram(list(command or []))
        self.timeout_s, self.model_name, self.recycle = timeout_s, model_name, recycle
        self.train_side_calls = train_side_calls
        self.proxy: Any = None
        self.runner: Any = None

    async def start(self, engine: InferenceEngine, tokenizer: ChatTokenizer) -> None:
        from agentflow.proxy.server import ProxyServer

        _abort_on_update(engine, self.recycle)
        self.proxy = await ProxyServer(
            engine, tokenizer, self.model_name, recycle=self.recycle, train_side_calls=self.train_side_calls
        ).start()

    async def run(self, episode: Episode) -> Trajectory:
        from agentflow.proxy.runner import BlackBoxRunner

        if self.proxy is None:
            raise RuntimeError("BlackBoxAgent.run before start()")
        runner = BlackBoxRunner(self.proxy, self.program, self.timeout_s, episode.max_len)
        return await runner.run(episode.env, episode.spec, episode.sampling)

    async def close(self) -> None:
        if self.proxy is not None:
            await self.proxy.stop()
            self.proxy = None


def _abort_on_update(engine: InferenceEngine, recycle: bool) -> None:
    """``partial: recycle`` needs the engine to abort in-flight generations at a weight update (embedded engine;
    SGLang servers do it with ``pause_generation(mode="abort")`` around the update)."""
    if recycle and isinstance(engine, RecyclingEngine):
        engine.abort_on_update = True


def agent_from_config(cfg: Any) -> BaseAgent:
    """The job's agent from its ``agent`` and ``rollout`` sections."""
    a = cfg.agent
    settings = {"context": a.context, "unfinished_turn": a.unfinished_turn, "entry": a.entry, "command": a.command,
                "timeout_s": a.timeout_s, "model_name": a.model_name, "recycle": cfg.rollout.partial == "recycle",
                "train_side_calls": a.train_side_calls, **a.kwargs}  # fmt: skip
    return make_agent(a.type, **settings)
