"""Wire types and protocols of AgentFlow: the contracts the rest of the package builds on.

A :class:`Trajectory` keeps the token ids exactly as the inference engine consumed and produced them. Nothing
downstream re-tokenizes text: the trainer reads ``Segment.token_ids`` and ``Segment.loss_mask`` as they are.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "abort"]
TrajectoryStatus = Literal["ok", "truncated", "aborted", "error"]
SegmentKind = Literal["root", "compact", "subagent", "side", "retry"]
"""``root``: an episode's main context; ``compact``/``subagent``: a new context the agent (or the white-box loop)
opened on purpose; ``side``: a black-box call that continued no conversation and was not marked; ``retry``: a
reply the agent asked again for and dropped (docs/architecture.md)."""
PauseMode = Literal["abort", "retract", "in_place"]

#: Version stamped on tokens the model did not generate (prompt, tool output).
NO_VERSION = -1


@dataclass
class SamplingParams:
    """How the engine samples one request (SGLang's ``sampling_params`` subset)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends with the token that completes one (it stays in the output ids)."""
    grammar: str | None = None
    """A Lark grammar (llguidance) the output must match (:mod:`agentflow.structured`); logits outside it are
    masked before sampling, and the behaviour log-probs are those of the masked distribution."""
    top_logprobs: int = 0
    """Alternatives to return per generated token (``GenerateResult.top_logprobs``), from the same distribution."""
    weight_version: int | None = None
    """Generate with this weight version, which the engine must still serve (``rollout.partial: pin``, embedded
    engine); None: the newest."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")


@dataclass
class GenerateResult:
    """One finished request: the sampled ids with their behaviour log-probs and weight versions.

    ``logprobs[i]`` is the log-prob of ``output_ids[i]`` under the sampling distribution after temperature and
    before top-k/top-p truncation (docs/architecture.md); ``versions[i]`` is the weight version whose logits it
    came from.
    """

    rid: str
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int = 0
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """When ``SamplingParams.top_logprobs > 0``: the best ``(id, log-prob)`` alternatives at each output token."""
    routed_experts: list[tuple[int, list[list[int]]]] | None = None
    """Mixture-of-experts models on the embedded engine: ``(position, experts per layer)`` for every input position
    this request ran through the model (the uncached prompt, then each decoded token as it was fed back)."""


@dataclass
class ScoreResult:
    """Prompt log-probs of ``ids[start:]`` (each token given its prefix), optionally with the top-k alternatives."""

    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None = None
    weight_version: int = 0


#: Called after each sampled token by engines that stream (:class:`StreamingEngine`): (token id, behaviour
#: log-prob, weight version).
OnToken = Callable[[int, float, int], None]


class EnvProvider(Protocol):
    """Where rollouts get env instances: a local pool, or env workers in other processes (Ray)."""

    def acquire(self, env_id: str | None = None, kwargs: dict[str, Any] | None = None) -> Any:
        """An env of ``env_id`` made with ``kwargs`` (the provider's default env when None), reused if one is free."""
        ...

    def release(self, env: Any) -> None:
        """Give an env back for a later episode."""
        ...

    def discard(self, env: Any) -> None:
        """Drop an env that must not be reused (its call timed out), closing it without waiting."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class InferenceEngine(Protocol):
    """Token-in/token-out generation: what every engine offers (embedded, SGLang client, Ray engines).

    Engine-specific extras are separate protocols: :class:`StreamingEngine` (per-token callback),
    :class:`RecyclingEngine` (aborts stale generations on an update), :class:`SupervisedEngine` (engines in
    restartable worker processes).
    """

    @property
    def weight_version(self) -> int:
        """The version of the weights the next logits will be computed with."""
        ...

    async def generate(self, input_ids: list[int], sampling: SamplingParams, rid: str | None = None) -> GenerateResult:
        """Generate from ``input_ids``; cancelling the awaiting task aborts the request. Requests whose ``rid``
        share the part before ``:`` belong to one trajectory (engines may route them together)."""
        ...

    def score(self, ids: list[int], start: int, top_k: int = 0) -> ScoreResult:
        """Log-probs of ``ids[start:]`` each given its prefix, with ``top_k`` alternatives if > 0."""
        ...

    def pause(self, mode: PauseMode = "in_place") -> None:
        """Stop generating (``abort``: finish in-flight requests now; ``retract``: keep them, drop their KV;
        ``in_place``: keep them and their KV) until :meth:`resume`."""
        ...

    def resume(self) -> None: ...

    def abort(self, rid: str) -> None:
        """Finish request ``rid`` with ``finish_reason="abort"`` and its partial output; unknown ids are ignored."""
        ...

    def flush_cache(self) -> bool:
        """Drop the prefix cache; True when it was dropped."""
        ...

    def update_weights(self, version: int, named_tensors: dict[str, Any]) -> None:
        """Apply a whole version (HF names -> tensors) between decode steps, or raise and keep the old one."""
        ...

    def close(self) -> None:
        """Release the engine (threads, sessions, workers); requests still in flight end aborted."""
        ...


class StreamingEngine(InferenceEngine, Protocol):
    """An engine whose ``generate`` also reports every token as it is sampled (the embedded engine).

    Static only: ``isinstance`` cannot see a parameter, so a caller deciding at run time checks the signature of
    ``generate`` for ``on_token``."""

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        rid: str | None = None,
        on_token: OnToken | None = None,
    ) -> GenerateResult: ...


@runtime_checkable
class RecyclingEngine(InferenceEngine, Protocol):
    """An engine that can abort, at a weight update, the generations already holding old-version tokens (partial
    rollouts recycled by the caller)."""

    abort_on_update: bool


@runtime_checkable
class SupervisedEngine(InferenceEngine, Protocol):
    """Engines in worker processes that a supervisor restarts (Ray): episodes can be lost under a restart."""

    lost: set[str]
    """Trajectory ids whose engine died under them (the rollout layer retries them and discards the ids)."""
    restarts: int
    """How many engine restarts were seen."""

    def pids(self) -> list[int]:
        """Process ids of the engine workers."""
        ...


@dataclass
class Segment:
    """One contiguous token sequence the engine saw: prompt, model turns and environment turns interleaved.

    ``loss_mask[i]`` is 1 for tokens the model sampled, 0 for prompt and environment tokens. ``logprobs`` and
    ``versions`` are aligned with ``token_ids``; non-model tokens carry 0.0 and :data:`NO_VERSION`.
    """

    kind: SegmentKind = "root"
    trained: bool = True
    """Whether the trainer sees this segment; black-box ``side`` and ``retry`` segments are recorded but not trained
    unless ``agent.train_side_calls`` (journals written before this field load as trained)."""
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    constraints: list[tuple[int, int, str]] = field(default_factory=list)
    """``(start, end, grammar)``: the tokens in ``[start, end)`` were sampled under that Lark grammar; the trainer
    masks its own logits there by replaying it (:mod:`agentflow.structured`)."""
    routes: list[tuple[int, list[list[int]]]] = field(default_factory=list)
    """Mixture-of-experts models: ``(position, experts per layer)`` the engine routed each position it ran to
    (``GenerateResult.routed_experts``, gathered over the segment's requests; ``trainer.routing_replay``)."""

    def append_context(self, ids: list[int]) -> None:
        """Append tokens the model did not generate (prompt or tool output)."""
        self.token_ids.extend(ids)
        self.loss_mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
        self.versions.extend([NO_VERSION] * len(ids))

    def append_generated(self, ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        """Append tokens exactly as the engine returned them."""
        if not len(ids) == len(logprobs) == len(versions):
            raise ValueError(f"length mismatch: {len(ids)} ids, {len(logprobs)} logprobs, {len(versions)} versions")
        self.token_ids.extend(ids)
        self.loss_mask.extend([1] * len(ids))
        self.logprobs.extend(logprobs)
        self.versions.extend(versions)

    def check(self) -> None:
        n = len(self.token_ids)
        if not (len(self.loss_mask) == len(self.logprobs) == len(self.versions) == n):
            raise ValueError("segment arrays are not aligned")


@dataclass
class Turn:
    """One model turn and the environment's answer to it."""

    index: int
    action: str | None
    """Canonical action string sent to the env (JSON), or None when the model's output was not a valid action."""
    observation: str
    reward: float = 0.0
    error: str | None = None
    """Why the model's output could not become an action (malformed tool call), shown to the model as an error."""
    images: list[bytes] = field(default_factory=list)
    """PNG screenshots observed after this turn (browser and desktop envs)."""
    segment: int = 0
    span: tuple[int, int] = (0, 0)
    """[start, end) of the model's tokens for this turn in ``segments[segment].token_ids``."""


@dataclass
class Trajectory:
    """One episode of one agent in one environment, with every token as the engine saw it."""

    id: str
    task_id: str
    group_id: str
    env_id: str
    data_source: str = "default"
    tags: list[str] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    reward: float | None = None
    status: TrajectoryStatus = "ok"
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    def model_versions(self) -> list[int]:
        return [v for s in self.segments for v, m in zip(s.versions, s.loss_mask, strict=True) if m]

    def min_version(self) -> int:
        versions = self.model_versions()
        return min(versions) if versions else NO_VERSION

    def max_version(self) -> int:
        versions = self.model_versions()
        return max(versions) if versions else NO_VERSION

    def num_model_tokens(self) -> int:
        return sum(sum(s.loss_mask) for s in self.segments)

    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.segments)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for t in d["turns"]:
            t["images"] = [img.hex() for img in t["images"]]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trajectory:
        d = dict(d)
        d["segments"] = [Segment(**s) for s in d.get("segments", [])]
        for seg in d["segments"]:
            seg.constraints = [(int(a), int(b), str(g)) for a, b, g in seg.constraints]
        turns = []
        for t in d.get("turns", []):
            t = dict(t)
            t["images"] = [bytes.fromhex(x) for x in t.get("images", [])]
            t["span"] = tuple(t.get("span", (0, 0)))
            turns.append(Turn(**t))
        d["turns"] = turns
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> Trajectory:
        return cls.from_dict(json.loads(text))


@dataclass
class Group:
    """The trajectories of one task sampled together (GRPO normalises rewards within a group)."""

    id: str
    task_seed: int
    trajectories: list[Trajectory] = field(default_factory=list)
    dispatch_version: int = 0

    def min_version(self) -> int:
        versions = [t.min_version() for t in self.trajectories if t.min_version() != NO_VERSION]
        return min(versions) if versions else self.dispatch_version
