"""SGLang HTTP transport: versions through ``/update_weights_from_tensor`` of SGLang-protocol servers (same host).

With ``protocol: transfer_mesh`` (our servers) the buckets travel as shared-memory ``uint8`` tensors with the plan and
their checksums in a ``transfer_mesh`` field, and each server verifies the whole version before applying it (pause,
apply, flush or keep, resume on the server, which reports its stall). With ``protocol: sglang`` the tensors go as
they are through the client's ``update_weights``, which drives real SGLang's choreography from the trainer side
(names checked before sending, retract or abort, begin/update/end, a checked flush, the label checked, continue).
``auto`` (the default) takes ``transfer_mesh`` when every server announces it in ``/server_info`` and ``sglang``
otherwise: a plain SGLang server answers success to buckets it cannot read, so they are never sent to one.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from torch import Tensor

from transfer_mesh.transport import TransportBase, TransportConfig, UpdateReport, VersionRefused, choose_protocol


class HttpConfig(TransportConfig):
    type: Literal["http"] = "http"
    protocol: Literal["auto", "transfer_mesh", "sglang"] = "auto"
    """``transfer_mesh``: checksummed buckets (our servers); ``sglang``: plain named tensors (real SGLang); ``auto``:
    ``transfer_mesh`` when every server verifies buckets, else ``sglang``."""


class HttpTransport(TransportBase):
    """Delivers to ``SGLangEngine`` clients (``update_weights_from_buckets`` / ``update_weights``)."""

    type = "http"

    def __init__(self, cfg: HttpConfig, engines: Sequence[Any]) -> None:
        super().__init__(cfg, engines)
        self.cfg: HttpConfig = cfg
        self._buffers: list[Tensor] | None = None
        self._protocol: str | None = None

    def protocol(self) -> str:
        """The protocol in use: the configured one, or for ``auto`` what every engine's servers speak."""
        if self._protocol is None:
            self._protocol = choose_protocol(self.cfg.protocol, self.engines)
        return self._protocol

    def send(self, version: int, named: Mapping[str, Tensor]) -> UpdateReport:
        t0 = time.perf_counter()
        plan = self.plan_for(named)
        report = UpdateReport(version, self.type, plan.total_bytes, plan.num_buckets)
        if self.protocol() == "sglang":
            for k, e in enumerate(self.engines):
                t1 = time.perf_counter()
                try:
                    e.update_weights(
                        version, dict(named), pause_mode=self.cfg.pause_mode, flush_cache=self.cfg.flush_cache
                    )
                except VersionRefused as exc:
                    raise VersionRefused(f"engine {k} refused version {version}: {exc}") from exc
                stall = time.perf_counter() - t1
                report.engines.append({"engine": k, "stall_s": stall, "apply_s": stall})
        else:
            # fresh staging per version: the serialization moves it into shared memory that the servers copy out
            # of and that is released after the call (torch's file_system handles cannot be reopened)
            self._buffers = plan.new_buffers()
            digests = {}
            for i, buf in enumerate(self._buffers):
                digests[str(i)] = plan.pack_bucket(i, named, buf)
            report.pack_s = time.perf_counter() - t0
            ext = {**plan.to_wire(), "digests": digests}
            wire = [self._wire(i, b) for i, b in enumerate(self._buffers)]
            replies = []
            try:
                for e in self.engines:
                    replies += e.update_weights_from_buckets(
                        version, ext, wire, self.cfg.pause_mode, self.cfg.flush_cache
                    )
            finally:
                self._buffers = None
                del wire
            self._collect(version, replies, report)
        report.apply_s = max((float(e.get("apply_s", 0.0)) for e in report.engines), default=0.0)
        report.stall_s = max((float(e.get("stall_s", 0.0)) for e in report.engines), default=0.0)
        report.total_s = time.perf_counter() - t0
        report.transfer_s = report.total_s - report.pack_s - report.apply_s
        self.reports.append(report)
        return report

    @staticmethod
    def _collect(version: int, replies: list[tuple[int, Any]], report: UpdateReport) -> None:
        problems = []
        for k, (status, data) in enumerate(replies):
            body = data if isinstance(data, dict) else {"message": data}
            report.engines.append({"engine": k, "status": status, **body})
            if status != 200 or not body.get("success", False):
                problems.append(f"engine {k}: HTTP {status}: {body.get('message')}")
        if problems:
            raise VersionRefused(f"version {version} refused: {'; '.join(problems)}")

    def close(self) -> None:
        self._buffers = None
        super().close()


CONFIG = HttpConfig
TRANSPORT = HttpTransport
