"""In-process transport: engines in the trainer's process receive a verified copy of each version.

Three passes over memory per version, each a single read or copy of every byte:

1. pack: each tensor is copied into the transport's own staging buckets (allocated once, reused across versions)
   and every cache-sized chunk is hashed right after it was copied, while it is still in cache;
2. verify: the receiving side re-hashes every bucket and, in the same chunked pass, refuses NaN/inf; only when
   every bucket checked out is the version handed on (all or nothing);
3. apply: each engine copies the typed bucket views straight into its own parameters (between decode steps).
   Engines whose ``update_weights`` takes ``finite_checked`` skip their own NaN/inf scan (pass 2 did it).

No storage is shared with the trainer (staging is a copy) or between the transport and the engines (they copy
out of staging).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from torch import Tensor

from transfer_mesh.buckets import IntegrityError
from transfer_mesh.transport import TransportBase, TransportConfig, UpdateReport, VersionRefused, choreograph


class InProcessConfig(TransportConfig):
    type: Literal["inprocess"] = "inprocess"


class InProcessTransport(TransportBase):
    """Delivers to :class:`~transfer_mesh.transport.LocalEngine` objects in this process."""

    type = "inprocess"

    def __init__(self, cfg: InProcessConfig, engines: Sequence[Any]) -> None:
        super().__init__(cfg, engines)
        self._buffers: list[Tensor] | None = None

    def send(self, version: int, named: Mapping[str, Tensor]) -> UpdateReport:
        t0 = time.perf_counter()
        plan = self.plan_for(named)
        if self._buffers is None:
            self._buffers = plan.new_buffers()
        wire: dict[int, Tensor] = {}
        digests: dict[int, str] = {}
        for i, buf in enumerate(self._buffers):
            digests[i] = plan.pack_bucket(i, named, buf)
            wire[i] = self._wire(i, buf)
        t1 = time.perf_counter()
        try:  # the receiving side's checks, on the whole version before any engine sees it
            tensors = plan.decode_version(version, wire, digests, check_finite=True)
        except IntegrityError as exc:
            raise VersionRefused(f"version {version} refused: {exc}") from exc
        t2 = time.perf_counter()
        report = UpdateReport(version, self.type, plan.total_bytes, plan.num_buckets, pack_s=t1 - t0)
        report.transfer_s = t2 - t1
        for k, engine in enumerate(self.engines):
            report.engines.append(self._deliver(k, engine, version, tensors))
        report.apply_s = max((e["apply_s"] for e in report.engines), default=0.0)
        report.stall_s = max((e["stall_s"] for e in report.engines), default=0.0)
        report.total_s = time.perf_counter() - t0
        self.reports.append(report)
        return report

    def _deliver(self, k: int, engine: Any, version: int, tensors: dict[str, Tensor]) -> dict[str, Any]:
        extra: dict[str, Any] = {"finite_checked": True} if _takes(engine, "finite_checked") else {}
        if _takes(engine, "flush_cache"):  # an engine that flushes by itself (SGLang) is told whether to
            extra["flush_cache"] = self.cfg.flush_cache
        try:
            timing = choreograph(
                engine,
                self.cfg.pause_mode,
                self.cfg.flush_cache,
                lambda: engine.update_weights(version, dict(tensors), **extra),
            )
        except (ValueError, IntegrityError) as exc:
            raise VersionRefused(f"engine {k} refused version {version}: {exc}") from exc
        return {"engine": k, "weight_version": engine.weight_version, **timing}

    def close(self) -> None:
        self._buffers = None
        super().close()


def _takes(engine: Any, keyword: str) -> bool:
    """Whether ``engine.update_weights`` accepts ``keyword`` (others get the plain two-argument call)."""
    try:
        return keyword in inspect.signature(engine.update_weights).parameters
    except (TypeError, ValueError):  # builtins and some proxies have no signature
        return False


CONFIG = InProcessConfig
TRANSPORT = InProcessTransport
