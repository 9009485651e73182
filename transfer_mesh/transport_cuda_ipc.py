"""CUDA IPC transport: trainer and engine processes share one GPU; buckets cross by IPC handle, not by copy.

The trainer packs each version into staging buckets on its GPU (allocated once, reused), computes a device-side
checksum per bucket, and hands every engine process the buckets' CUDA IPC handles (torch's documented
``torch.multiprocessing.reductions.reduce_tensor``: the same mechanism ``torch.multiprocessing`` uses to pass CUDA
tensors between processes, and what SGLang's colocated ``/update_weights_from_tensor`` receives). The engine
process maps the buckets (no copy), verifies every checksum and refuses NaN/inf, and only then copies the tensors
into its own parameters (all or nothing); it drops the mapping before it answers, so the trainer may overwrite the
staging for the next version.

Control goes over a ``multiprocessing`` connection: :class:`IpcEngineLink` (trainer side, one per engine
process) and :func:`serve_ipc_updates` (engine side: a loop that applies each version to a local engine).

Written against PyTorch's documented API and not run on the project's CPU machines (no CUDA there): the test is
``tests/test_transfer_mesh_cuda_ipc.py``, marked ``gpu``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

import torch
from pydantic import Field
from torch import Tensor

from transfer_mesh.buckets import IntegrityError
from transfer_mesh.checksum import finite
from transfer_mesh.plan import DTYPES, TransferPlan
from transfer_mesh.transport import TransportBase, TransportConfig, UpdateReport, VersionRefused, WeightSyncError

_MASK = (1 << 64) - 1
_WORDS_PER_STEP = 1 << 22


class CudaIpcConfig(TransportConfig):
    type: Literal["cuda_ipc"] = "cuda_ipc"
    device: str = "cuda"
    """The GPU the trainer's exported tensors and the staging buckets live on (shared with the engines)."""
    timeout_s: float = Field(120.0, gt=0)
    """How long to wait for an engine process to answer one version."""


class IpcEngine(Protocol):
    """Trainer-side handle of an engine process on the same GPU (:class:`IpcEngineLink` implements it)."""

    def apply_ipc(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]: ...


def device_digest(buf: Tensor) -> str:
    """Position-weighted sums of the bucket's 32-bit words, computed on its device (no copy to the host).

    Detects flipped, missing and swapped words; ``dev:`` marks it so it never compares equal to a host digest.
    """
    words = buf.view(torch.int32)
    s1 = s2 = 0
    for a in range(0, words.numel(), _WORDS_PER_STEP):
        w = words[a : a + _WORDS_PER_STEP].to(torch.int64)
        idx = torch.arange(a + 1, a + 1 + w.numel(), device=buf.device, dtype=torch.int64)
        s1 = (s1 + int(w.sum())) & _MASK
        s2 = (s2 + int((w * idx).sum())) & _MASK  # int64 products wrap: still deterministic on both sides
    return f"dev:{s1:016x}{s2:016x}"


def verify_device_buckets(
    plan: TransferPlan, version: int, buffers: Mapping[int, Tensor], digests: Mapping[int, str]
) -> dict[str, Tensor]:
    """The receiving side's checks on device buckets: all present, sizes, checksums, then NaN/inf; views by name."""
    plan.check_complete(version, buffers)
    for i in range(plan.num_buckets):
        buf = buffers[i]
        if buf.dtype != torch.uint8 or buf.numel() != plan.bucket_sizes[i]:
            raise IntegrityError(
                f"version {version}: bucket {i} has {buf.numel()} bytes, expected {plan.bucket_sizes[i]}"
            )
        if device_digest(buf) != digests.get(i):
            raise IntegrityError(f"version {version}: checksum mismatch in bucket {i}")
    views = plan.views(buffers)
    for s in plan.slots:
        if DTYPES[s.dtype].is_floating_point and not finite(views[s.name]):
            raise IntegrityError(f"version {version}: {s.name} contains NaN or inf")
    return views


# ---------------------------------------------------------------------------------------------- engine side


def apply_ipc_message(engine: Any, message: dict[str, Any]) -> dict[str, Any]:
    """Map the buckets named by ``message``, verify them, apply them to ``engine``; the reply to send back."""
    from transfer_mesh.transport import choreograph

    version = int(message["version"])
    buffers: dict[int, Tensor] = {}
    views: dict[str, Tensor] = {}
    try:
        plan = TransferPlan.from_wire(message["plan"])
        buffers = {i: fn(*args) for i, (fn, args) in enumerate(message["handles"])}  # maps, no copy
        views = verify_device_buckets(plan, version, buffers, dict(enumerate(message["digests"])))
        timing = choreograph(
            engine,
            message.get("pause_mode", "in_place"),
            bool(message.get("flush_cache", True)),
            lambda: engine.update_weights(version, views, finite_checked=True),
        )
    except (IntegrityError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        return {"success": False, "message": f"version {version} refused: {exc}"}
    finally:
        buffers, views = {}, {}  # noqa: F841 (drop the mapping before answering: the trainer reuses its staging)
        torch.cuda.synchronize()
    return {"success": True, "weight_version": engine.weight_version, **timing}


def serve_ipc_updates(conn: Any, engine: Any) -> None:
    """Engine process loop: apply every version that arrives on ``conn`` until it sends ``None`` or closes."""
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        conn.send(apply_ipc_message(engine, message))


class IpcEngineLink:
    """Trainer side of one engine process's connection (``multiprocessing.Pipe`` end)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def apply_ipc(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        self.conn.send(message)
        if not self.conn.poll(timeout_s):
            raise WeightSyncError(f"engine process did not answer within {timeout_s} s")
        return self.conn.recv()

    def close(self) -> None:
        try:
            self.conn.send(None)
        except (BrokenPipeError, OSError):  # the engine process is gone already
            pass
        self.conn.close()


# --------------------------------------------------------------------------------------------- trainer side


class CudaIpcTransport(TransportBase):
    """Delivers to engine processes on the trainer's GPU (:class:`IpcEngine` objects)."""

    type = "cuda_ipc"

    def __init__(self, cfg: CudaIpcConfig, engines: Sequence[Any]) -> None:
        super().__init__(cfg, engines)
        self.cfg: CudaIpcConfig = cfg
        self._buffers: list[Tensor] | None = None
        self._handles: list[Any] | None = None

    def send(self, version: int, named: Mapping[str, Tensor]) -> UpdateReport:
        from torch.multiprocessing.reductions import reduce_tensor

        t0 = time.perf_counter()
        plan = self.plan_for(named)
        if self._buffers is None:  # staging stays alive (and its handles valid) for the transport's lifetime
            self._buffers = [torch.empty(n, dtype=torch.uint8, device=self.cfg.device) for n in plan.bucket_sizes]
            self._handles = [reduce_tensor(b) for b in self._buffers]
        digests = []
        for i, buf in enumerate(self._buffers):
            for s in plan.bucket_slots(i):
                buf[s.offset : s.offset + s.nbytes].view(DTYPES[s.dtype]).view(s.shape).copy_(named[s.name])
            digests.append(device_digest(buf))
        handles = list(self._handles or [])
        wires = [self._wire(i, buf) for i, buf in enumerate(self._buffers)]  # alive until every engine answered
        for i, (wire, buf) in enumerate(zip(wires, self._buffers, strict=True)):
            if wire is not buf:  # a test's corrupted copy travels by its own handle
                handles[i] = reduce_tensor(wire)
        torch.cuda.synchronize(self.cfg.device)  # the engines read the staging from other processes
        report = UpdateReport(version, self.type, plan.total_bytes, plan.num_buckets, pack_s=time.perf_counter() - t0)
        message = {"version": version, "plan": plan.to_wire(), "digests": digests, "handles": handles}
        message.update(pause_mode=self.cfg.pause_mode, flush_cache=self.cfg.flush_cache)
        problems = []
        for k, engine in enumerate(self.engines):
            reply = engine.apply_ipc(message, self.cfg.timeout_s)
            report.engines.append({"engine": k, **reply})
            if not reply.get("success"):
                problems.append(f"engine {k}: {reply.get('message')}")
        del wires
        report.apply_s = max((float(e.get("apply_s", 0.0)) for e in report.engines), default=0.0)
        report.stall_s = max((float(e.get("stall_s", 0.0)) for e in report.engines), default=0.0)
        report.total_s = time.perf_counter() - t0
        report.transfer_s = report.total_s - report.pack_s - report.apply_s
        self.reports.append(report)
        if problems:
            raise VersionRefused(f"version {version} refused: {'; '.join(problems)}")
        return report

    def close(self) -> None:
        self._buffers = self._handles = None
        super().close()


CONFIG = CudaIpcConfig
TRANSPORT = CudaIpcTransport
