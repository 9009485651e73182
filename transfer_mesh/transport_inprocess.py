"""In-process transport: engines in the trainer's process receive a verified copy of each version.

Each bucket is packed into the transport's own staging buffer (reused across versions), checksummed, and verified
by the receiving side; only when every bucket checked out is the version handed to each engine, which copies it
into its own tensors (the embedded engine does so between decode steps). No storage is shared with the trainer
(staging is a copy) or between the transport and the engines (they copy out of staging).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from torch import Tensor

from transfer_mesh.buckets import IntegrityError
from transfer_mesh.transport import TransportConfig, UpdateReport, VersionRefused, WeightTransport, choreograph


class InProcessConfig(TransportConfig):
    type: Literal["inprocess"] = "inprocess"


class InProcessTransport(WeightTransport):
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
            tensors = plan.decode_version(version, wire, digests)
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
        try:
            timing = choreograph(
                engine,
                self.cfg.pause_mode,
                self.cfg.flush_cache,
                lambda: engine.update_weights(version, dict(tensors)),
            )
        except (ValueError, IntegrityError) as exc:
            raise VersionRefused(f"engine {k} refused version {version}: {exc}") from exc
        return {"engine": k, "weight_version": engine.weight_version, **timing}

    def close(self) -> None:
        self._buffers = None
        super().close()


CONFIG = InProcessConfig
TRANSPORT = InProcessTransport
