"""The weight-update interface: the :class:`WeightTransport` protocol, a tagged config, a factory, the choreography.

A transport moves whole versions from the trainer to engines: ``send(version, named_tensors)`` on the trainer side
(HF names, full tensors, as exported) returns an :class:`UpdateReport` once every engine applied the version, or
raises :class:`VersionRefused` (an engine refused it: checksum, missing bucket, shape; it keeps the previous
version) or :class:`WeightSyncError` (the transport failed). The receiving side applies a version with
:func:`choreograph`: pause (mode by config), apply, flush or keep the prefix cache, resume, timing the stall.

Adding a transport is one file: ``transfer_mesh/transport_<type>.py`` defining ``CONFIG`` (a
:class:`TransportConfig` subclass with ``type: Literal["<type>"]``) and ``TRANSPORT`` (a class built as
``TRANSPORT(config, engines)`` that implements :class:`WeightTransport`; the shipped ones subclass
:class:`TransportBase`). :func:`make_transport` imports it by the config's ``type``.
"""

from __future__ import annotations

import importlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Literal, Protocol, Self, cast, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from transfer_mesh.buckets import IntegrityError
from transfer_mesh.plan import TransferPlan

PauseMode = Literal["none", "in_place", "retract", "abort"]
EnginePauseMode = Literal["in_place", "retract", "abort"]
"""How an engine pauses (the transport's ``none`` means: the engine is not paused at all)."""
TRANSPORT_TYPES = ("inprocess", "gloo", "http", "cuda_ipc")


class WeightSyncError(RuntimeError):
    """A transport failed to deliver a version (unreachable engine, broken group, timeout)."""


class VersionRefused(IntegrityError):
    """An engine refused a version (checksum, missing bucket, shape...) and keeps serving the previous one."""


class TransportConfig(BaseModel):
    """Settings shared by every transport; subclasses add their own and narrow ``type``."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    type: str
    """Which transport: ``inprocess``, ``gloo``, ``http`` or ``cuda_ipc``."""
    bucket_bytes: int = Field(32 << 20, gt=0)
    """Target size of one flat bucket (a larger tensor gets a bucket of its own)."""
    checksum: Literal["auto", "xxh3", "crc32", "sha256"] = "auto"
    """Per-bucket checksum; ``auto`` is xxh3 when the ``xxhash`` package is installed, else crc32."""
    pause_mode: PauseMode = "in_place"
    """How engines stop generating while a verified version is applied (``none``: apply between decode steps). A
    plain SGLang server cannot drop KV of requests paused in place: its client makes ``in_place`` and ``none`` a
    ``retract``."""
    flush_cache: bool = True
    """Drop the engines' prefix caches with the update (False keeps stale KV)."""


@dataclass
class UpdateReport:
    """What one update cost; ``stall_s`` is the longest time any engine stopped generating for it."""

    version: int
    transport: str
    bytes: int
    buckets: int
    pack_s: float = 0.0
    transfer_s: float = 0.0
    apply_s: float = 0.0
    stall_s: float = 0.0
    total_s: float = 0.0
    engines: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@runtime_checkable
class WeightTransport(Protocol):
    """Trainer side of a weight update, as the controller drives it (every transport implements it)."""

    def send(self, version: int, named: Mapping[str, Tensor]) -> UpdateReport:
        """Deliver ``named`` (HF names -> full tensors) as ``version`` to every engine, verified, whole or not.

        Raises :class:`VersionRefused` (an engine refused it and keeps its previous version) or
        :class:`WeightSyncError` (the transport failed)."""
        ...

    def close(self) -> None:
        """Release the transport's resources (groups, buffers); engines keep their weights."""
        ...


@runtime_checkable
class LocalEngine(Protocol):
    """An engine the sending side calls directly (the embedded engine, a Ray engine, an SGLang client): what
    :func:`choreograph` and the in-process delivery need."""

    @property
    def weight_version(self) -> int: ...

    def update_weights(self, version: int, named_tensors: dict[str, Any]) -> None: ...

    def pause(self, mode: EnginePauseMode = "in_place") -> None: ...

    def resume(self) -> None: ...

    def flush_cache(self) -> bool: ...


@runtime_checkable
class KeepsCacheOnUpdate(Protocol):
    """An engine whose own update drops or keeps its prefix cache as this flag says (the embedded engine)."""

    keep_cache_on_update: bool


@runtime_checkable
class ChoreographsUpdates(Protocol):
    """An engine whose own ``update_weights`` pauses, applies, flushes (checked) and resumes (the SGLang client:
    real SGLang needs its own choreography), so :func:`choreograph` only times it."""

    choreographs_updates: bool


def choreograph(engine: LocalEngine, pause_mode: str, flush_cache: bool, apply: Callable[[], None]) -> dict[str, float]:
    """Pause ``engine`` (unless ``none``), run ``apply``, flush or keep its prefix cache, resume; time the stall.

    A :class:`KeepsCacheOnUpdate` engine is told for this update whether its update keeps the cache; others get
    ``flush_cache()`` after the update when asked. Exceptions from ``apply`` propagate after the engine has resumed
    (it keeps serving its previous version).
    """
    if isinstance(engine, ChoreographsUpdates) and engine.choreographs_updates:
        t0 = time.perf_counter()
        apply()
        took = time.perf_counter() - t0
        return {"stall_s": took, "apply_s": took}
    keeper = engine if isinstance(engine, KeepsCacheOnUpdate) else None
    previous = keeper.keep_cache_on_update if keeper is not None else False
    if keeper is not None:
        keeper.keep_cache_on_update = not flush_cache
    t0 = time.perf_counter()
    paused = pause_mode != "none"
    try:
        if paused:
            engine.pause(cast(EnginePauseMode, pause_mode))
        t1 = time.perf_counter()
        apply()
        if flush_cache and keeper is None:
            engine.flush_cache()
        apply_s = time.perf_counter() - t1
    finally:
        if paused:
            engine.resume()
        if keeper is not None:
            keeper.keep_cache_on_update = previous
    return {"stall_s": time.perf_counter() - t0, "apply_s": apply_s}


class TransportBase(ABC):
    """What the shipped transports share: the plan (computed once, then checked), the wire hook, the reports.

    Subclasses implement :meth:`send`; they are :class:`WeightTransport` s.
    """

    type: ClassVar[str] = ""

    def __init__(self, cfg: TransportConfig, engines: Sequence[Any]) -> None:
        self.cfg = cfg
        self.engines = list(engines)
        self.plan: TransferPlan | None = None
        self.reports: list[UpdateReport] = []

    def plan_for(self, named: Mapping[str, Tensor]) -> TransferPlan:
        """The plan, computed at the first version and reused; later versions must match it exactly."""
        if self.plan is None:
            algo = None if self.cfg.checksum == "auto" else self.cfg.checksum
            self.plan = TransferPlan.for_tensors(named, self.cfg.bucket_bytes, algo)
        self.plan.check_tensors(named)
        return self.plan

    def _wire(self, index: int, buf: Tensor) -> Tensor:
        """The bytes of bucket ``index`` as they go out, after checksumming (a hook for fault-injection tests)."""
        return buf

    @abstractmethod
    def send(self, version: int, named: Mapping[str, Tensor]) -> UpdateReport:
        """Deliver ``named`` (HF names -> full tensors) as ``version`` to every engine, verified, whole or not."""

    def close(self) -> None:
        """Release the transport's resources (groups, buffers); engines keep their weights."""
        self.plan = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def choose_protocol(configured: str, engines: Sequence[Any]) -> str:
    """``configured``, or for ``auto``: TransferMesh buckets when every engine's servers announce them, else the
    plain SGLang update endpoints."""
    if configured != "auto":
        return configured
    return "transfer_mesh" if all(e.speaks_transfer_mesh() for e in engines) else "sglang"


def _module(kind: str) -> Any:
    if not kind.replace("_", "").isalnum():
        raise ValueError(f"bad transport type {kind!r}")
    try:
        return importlib.import_module(f"transfer_mesh.transport_{kind}")
    except ModuleNotFoundError as exc:
        if exc.name != f"transfer_mesh.transport_{kind}":
            raise
        raise ValueError(f"unknown transport type {kind!r}; known: {', '.join(TRANSPORT_TYPES)}") from exc


def parse_transport_config(raw: Mapping[str, Any] | TransportConfig) -> TransportConfig:
    """Validate a tagged config (``{"type": "gloo", ...}``) with its transport's own config class."""
    if isinstance(raw, TransportConfig):
        return raw
    kind = raw.get("type") if isinstance(raw, Mapping) else None
    if not isinstance(kind, str):
        raise ValueError("transport config needs a 'type' (one of " + ", ".join(TRANSPORT_TYPES) + ")")
    return _module(kind).CONFIG.model_validate(dict(raw))


def make_transport(cfg: Mapping[str, Any] | TransportConfig, engines: Sequence[Any]) -> WeightTransport:
    """Build the configured transport for ``engines`` (local engines, or SGLang-protocol clients)."""
    parsed = parse_transport_config(cfg)
    return _module(parsed.type).TRANSPORT(parsed, engines)
