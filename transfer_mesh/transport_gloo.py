"""``torch.distributed`` transport: the trainer (rank 0) broadcasts buckets to N engine processes over a gloo group.

Control goes over the SGLang HTTP protocol, as with SGLang's NCCL path: ``/init_weights_update_group`` makes every
server join a dedicated group (rank ``rank_offset + i``) while the trainer joins as rank 0, and
``/update_weights_from_distributed`` (between ``/begin_weight_update`` and ``/end_weight_update``) makes each server
receive. With ``load_format: "transfer_mesh"`` (our servers) the body carries the plan (names, dtypes, shapes,
bucket size, checksum, fingerprint) and the data are framed buckets: per bucket an ``int64[8]`` header
``[MAGIC, version, index, nbytes, digest...]`` then the ``uint8`` bucket, and an end header (index -1). A receiver
therefore detects checksum errors, missing or repeated buckets and foreign versions, drains the stream either way
(the group stays in step) and refuses the version. ``protocol: sglang`` sends one broadcast per tensor, unverified,
as real SGLang servers expect, and the client drives their choreography around it (names checked before anything is
sent, retract or abort, begin/receive/end, a checked flush, the label checked, continue). ``auto`` (the default)
takes ``transfer_mesh`` when every server announces it, else ``sglang``. The group is built with the rendezvous of
SGLang's ``init_custom_process_group``, so the trainer joins a real SGLang server's weight-update group.

Pipelining: broadcasts are issued asynchronously; the next bucket is packed while the previous ones are in flight.
The group is a standalone ``ProcessGroupGloo`` over a ``TCPStore`` (it does not touch the default group).
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
from pydantic import Field
from torch import Tensor

from transfer_mesh.buckets import IntegrityError
from transfer_mesh.plan import DTYPES, TransferPlan
from transfer_mesh.transport import (
    TransportBase,
    TransportConfig,
    UpdateReport,
    VersionRefused,
    WeightSyncError,
    choose_protocol,
)

MAGIC = 0x544D4553  # "TMES"
END = -1
_DIGEST_BYTES = {"xxh3": 8, "crc32": 4, "sha256": 32}


class GlooConfig(TransportConfig):
    type: Literal["gloo"] = "gloo"
    master_address: str = "127.0.0.1"
    """Address the engines reach the trainer's rendezvous store at."""
    master_port: int = Field(0, ge=0)
    """Rendezvous port (0: a free one)."""
    group_name: str = "transfer_mesh"
    timeout_s: float = Field(120.0, gt=0)
    """Gloo timeout of one collective; also bounds waiting for the engines' replies."""
    protocol: Literal["auto", "transfer_mesh", "sglang"] = "auto"
    """``transfer_mesh``: checksummed buckets (our servers); ``sglang``: one broadcast per tensor (real SGLang);
    ``auto``: ``transfer_mesh`` when every server verifies buckets, else ``sglang``."""


class DistributedControl(Protocol):
    """The HTTP side of a distributed update (``SGLangEngine`` implements it for its servers)."""

    @property
    def num_servers(self) -> int: ...

    def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> None: ...

    def begin_weight_update(self) -> None: ...

    def update_weights_from_distributed(self, body: dict[str, Any]) -> list[tuple[int, Any]]: ...

    def end_weight_update(self) -> None: ...

    def destroy_weights_update_group(self, group_name: str) -> None: ...

    def speaks_transfer_mesh(self) -> bool: ...

    def prepare_update(self, names: list[str], pause_mode: str = "retract") -> None: ...

    def finish_update(self, version: int, replies: list[tuple[int, Any]] | None, flush_cache: bool = True) -> None: ...


# ----------------------------------------------------------------------------------------------------- the group


def make_group(
    address: str, port: int, rank: int, world_size: int, name: str, timeout_s: float, store: Any = None
) -> Any:
    """A standalone gloo group of ``world_size`` (rank 0 hosts the TCPStore unless ``store`` is given).

    Its rendezvous keys are those of SGLang's ``init_custom_process_group`` (a ``PrefixStore`` named after the
    group over the TCP store, then torch's own ``<group>/`` and ``cpu/`` prefixes, then the group's sequence
    number), so a trainer can join the weight-update group of a real SGLang server as rank 0 and our servers join
    the trainer's group the same way. It is not registered in torch's global group table (no name clashes)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(address, port, world_size, rank == 0, timeout=timeout, wait_for_workers=False)
    keys = dist.PrefixStore("cpu/", dist.PrefixStore(f"{name}/", dist.PrefixStore(name, store)))
    gloo: Any = dist.ProcessGroupGloo  # its _Options is not in torch's type stubs
    opts = gloo._Options()
    opts._devices = [gloo.create_device(hostname=address)]
    opts._timeout = timeout
    pg = dist.ProcessGroupGloo(keys, rank, world_size, opts)
    pg._set_sequence_number_for_group()
    return pg


def broadcast(pg: Any, tensor: Tensor) -> Any:
    """Asynchronous broadcast of ``tensor`` from rank 0; returns the Work."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return pg.broadcast([tensor], opts)


def header(version: int, index: int, nbytes: int, digest_hex: str = "") -> Tensor:
    raw = bytes.fromhex(digest_hex).ljust(32, b"\0")
    words = torch.frombuffer(bytearray(raw), dtype=torch.int64)
    return torch.cat([torch.tensor([MAGIC, version, index, nbytes], dtype=torch.int64), words])


def read_header(h: Tensor, algo: str) -> tuple[int, int, int, str]:
    """(version, index, nbytes, digest hex) of a received header; WeightSyncError if it is not one."""
    magic, version, index, nbytes = (int(x) for x in h[:4].tolist())
    if magic != MAGIC:
        raise WeightSyncError(f"weight stream out of step: bad header magic {magic:#x}")
    raw = h[4:].numpy().tobytes()[: _DIGEST_BYTES[algo]]
    return version, index, nbytes, raw.hex()


# ---------------------------------------------------------------------------------------------- receiving side


class GlooReceiver:
    """An engine process's end of the group: receives whole versions into its own staging buffers."""

    def __init__(self, pg: Any, group_name: str) -> None:
        self.pg = pg
        self.group_name = group_name
        self._buffers: dict[str, list[Tensor]] = {}

    @classmethod
    def join(cls, address: str, port: int, rank: int, world_size: int, name: str, timeout_s: float = 120.0) -> Any:
        return cls(make_group(address, port, rank, world_size, name, timeout_s), name)

    def receive_version(self, plan: TransferPlan, version: int | None) -> dict[str, Tensor]:
        """Receive buckets until the end header; raise IntegrityError naming the first problem (stream drained).

        ``version`` is the one the request announced (None: take the stream's). Pipelined: each bucket is
        verified (checksum and NaN/inf, one pass) while the next one is arriving (gloo receives on its own
        thread, and the hash releases the GIL)."""
        buffers = self._buffers.setdefault(plan.fingerprint(), plan.new_buffers())
        got: dict[int, Tensor] = {}
        problems: list[str] = []
        pending: tuple[int, Tensor, str] | None = None  # received, not yet verified
        h = torch.zeros(8, dtype=torch.int64)
        while True:
            broadcast(self.pg, h).wait()
            v, index, nbytes, hexd = read_header(h, plan.checksum)
            if index == END:
                break
            ok = 0 <= index < plan.num_buckets and nbytes == plan.bucket_sizes[index] and index not in got
            buf = buffers[index] if ok else torch.empty(nbytes, dtype=torch.uint8)
            work = broadcast(self.pg, buf)
            pending = self._verify(plan, version, pending, problems)
            work.wait()
            if not ok:
                problems.append(f"version {version}: unexpected bucket {index} of {nbytes} bytes")
            elif version is not None and v != version:
                problems.append(f"bucket {index} is version {v}, expected {version}")
            else:
                got[index], pending = buf, (index, buf, hexd)
                version = v if version is None else version
        self._verify(plan, version, pending, problems)
        if problems:
            raise IntegrityError(problems[0])
        plan.check_complete(-1 if version is None else version, got)
        return plan.views(got)

    @staticmethod
    def _verify(plan: TransferPlan, version: int | None, pending: Any, problems: list[str]) -> None:
        """Verify a received bucket unless a problem is already known (the stream is drained either way)."""
        if pending is not None and not problems:
            index, buf, hexd = pending
            try:
                plan.verify_bucket(-1 if version is None else version, index, buf, hexd, check_finite=True)
            except IntegrityError as exc:
                problems.append(str(exc))
        return None

    def receive_named(self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]) -> dict:
        """SGLang's per-tensor protocol: one broadcast per name, in order (no checksums)."""
        out = {}
        for name, dt, shape in zip(names, dtypes, shapes, strict=True):
            if dt not in DTYPES:
                raise IntegrityError(f"tensor {name}: unsupported dtype {dt!r}")
            t = torch.empty(tuple(shape), dtype=DTYPES[dt])
            broadcast(self.pg, t).wait()
            out[name] = t
        return out

    def close(self) -> None:
        self._buffers.clear()
        self.pg = None


# ------------------------------------------------------------------------------------------------ sending side


class GlooTransport(TransportBase):
    """Rank 0 of a gloo group whose other ranks are the servers behind ``engines`` (DistributedControl objects)."""

    type = "gloo"

    def __init__(self, cfg: GlooConfig, engines: Sequence[Any]) -> None:
        super().__init__(cfg, engines)
        self.cfg: GlooConfig = cfg
        self._pg: Any = None
        self._store: Any = None
        self._buffers: list[Tensor] | None = None
        self._pool = cf.ThreadPoolExecutor(max(2, len(self.engines)), thread_name_prefix="transfer-mesh-gloo")
        self._protocol: str | None = None

    def protocol(self) -> str:
        """The protocol in use: the configured one, or for ``auto`` what every engine's servers speak."""
        if self._protocol is None:
            self._protocol = choose_protocol(self.cfg.protocol, self.engines)
        return self._protocol

    @property
    def world_size(self) -> int:
        return 1 + sum(e.num_servers for e in self.engines)

    def _join(self) -> None:
        """Host the store, have every server join (over HTTP, concurrently), join as rank 0."""
        timeout = datetime.timedelta(seconds=self.cfg.timeout_s)
        addr = self.cfg.master_address
        self._store = dist.TCPStore(
            addr, self.cfg.master_port, self.world_size, True, timeout=timeout, wait_for_workers=False
        )
        futures: list[cf.Future[None]] = []
        offset = 1
        for e in self.engines:
            join = e.init_weights_update_group
            port, name = self._store.port, self.cfg.group_name
            futures.append(self._pool.submit(join, addr, port, offset, self.world_size, name, "gloo"))
            offset += e.num_servers
        try:
            self._pg = make_group(addr, 0, 0, self.world_size, self.cfg.group_name, self.cfg.timeout_s, self._store)
            for f in futures:
                f.result(timeout=self.cfg.timeout_s)
        except Exception as exc:
            self._pg = self._store = None
            raise WeightSyncError(f"engines could not join the weight-update group: {exc}") from exc

    def send(self, version: int, named: Mapping[str, Tensor]) -> UpdateReport:
        t0 = time.perf_counter()
        plan = self.plan_for(named)
        plain = self.protocol() == "sglang"
        if not plain and not all(e.speaks_transfer_mesh() for e in self.engines):
            raise VersionRefused("a plain SGLang server would skip TransferMesh buckets: use protocol sglang or auto")
        if plain:  # unknown names are refused before the group is even joined
            for e in self.engines:
                e.prepare_update(list(plan.to_wire()["names"]), self.cfg.pause_mode)
        try:
            if self._pg is None:
                self._join()
            report = UpdateReport(version, self.type, plan.total_bytes, plan.num_buckets)
            replies = self._deliver(plan, version, named, report, plain)
        except BaseException:
            if plain:
                for e in self.engines:
                    e.finish_update(version, None)
            raise
        if plain:
            for e, mine in zip(self.engines, self._split(replies), strict=True):
                e.finish_update(version, mine, self.cfg.flush_cache)
            report.engines = [{"engine": k, "status": st} for k, (st, _) in enumerate(replies)]
        else:
            self._collect(version, replies, report)
        report.total_s = time.perf_counter() - t0
        self.reports.append(report)
        return report

    def _deliver(
        self, plan: TransferPlan, version: int, named: Mapping[str, Tensor], report: UpdateReport, plain: bool
    ) -> list[tuple[int, Any]]:
        """Stream the version while every server receives it; (status, reply) per server."""
        body: dict[str, Any] = {"group_name": self.cfg.group_name, "flush_cache": self.cfg.flush_cache}
        body["weight_version"] = str(version)
        if plain:  # SGLang's own fields only (its session was begun by prepare_update)
            body.update({k: v for k, v in plan.to_wire().items() if k in ("names", "dtypes", "shapes")})
        else:
            body.update(plan.to_wire(), load_format="transfer_mesh", pause_mode=self.cfg.pause_mode)
            for e in self.engines:
                e.begin_weight_update()
        try:
            futures = [self._pool.submit(e.update_weights_from_distributed, body) for e in self.engines]
            try:
                self._stream(plan, version, named, futures, report)
            except BaseException:
                self._reset()
                raise
            return [r for f in futures for r in f.result(timeout=self.cfg.timeout_s)]
        finally:
            if not plain:
                for e in self.engines:
                    e.end_weight_update()

    def _split(self, replies: list[tuple[int, Any]]) -> list[list[tuple[int, Any]]]:
        """Replies per engine (each engine answers for its servers, in order)."""
        out, i = [], 0
        for e in self.engines:
            out.append(replies[i : i + e.num_servers])
            i += e.num_servers
        return out

    def _stream(
        self, plan: TransferPlan, version: int, named: Mapping[str, Tensor], futures: list, report: UpdateReport
    ) -> None:
        """Broadcast every bucket (packing the next one while earlier ones are in flight), then the end header."""
        t0 = time.perf_counter()
        inflight: list[tuple[Any, Tensor]] = []
        if self.protocol() == "sglang":
            for s in plan.slots:
                inflight.append((broadcast(self._pg, named[s.name].detach().contiguous()), named[s.name]))
        else:
            if self._buffers is None:
                self._buffers = plan.new_buffers()
            for i, buf in enumerate(self._buffers):
                t1 = time.perf_counter()
                hexd = plan.pack_bucket(i, named, buf)
                report.pack_s += time.perf_counter() - t1
                h = header(version, i, buf.numel(), hexd)
                wire = self._wire(i, buf)
                inflight += [(broadcast(self._pg, h), h), (broadcast(self._pg, wire), wire)]
                self._check_early(futures)
            end = header(version, END, 0)
            inflight.append((broadcast(self._pg, end), end))
        for work, _ in inflight:
            while not work.is_completed():
                self._check_early(futures)
                time.sleep(0.0005)
            work.wait()
        report.transfer_s = time.perf_counter() - t0

    @staticmethod
    def _check_early(futures: list[cf.Future]) -> None:
        """A server that answered before the stream ended will not receive it: stop instead of hanging."""
        for f in futures:
            if f.done():
                replies = f.result()
                bad = [r for r in replies if r[0] != 200]
                if bad:
                    raise WeightSyncError(f"a server stopped receiving: HTTP {bad[0][0]}: {bad[0][1]}")

    def _collect(self, version: int, replies: list[tuple[int, Any]], report: UpdateReport) -> None:
        problems = []
        for k, (status, data) in enumerate(replies):
            ok = status == 200 and isinstance(data, dict) and data.get("success", False)
            report.engines.append({"engine": k, "status": status, **(data if isinstance(data, dict) else {})})
            if not ok:
                problems.append(f"engine {k}: HTTP {status}: {data.get('message') if isinstance(data, dict) else data}")
        report.apply_s = max((float(e.get("apply_s", 0.0)) for e in report.engines), default=0.0)
        report.stall_s = max((float(e.get("stall_s", 0.0)) for e in report.engines), default=0.0)
        if problems:
            raise VersionRefused(f"version {version} refused: {'; '.join(problems)}")

    def _reset(self) -> None:
        """Drop a group that may be out of step (the next send joins a fresh one)."""
        for e in self.engines:
            try:
                e.destroy_weights_update_group(self.cfg.group_name)
            except Exception:  # best effort: the server may be gone
                pass
        self._pg = self._store = None

    def close(self) -> None:
        if self._pg is not None:
            self._reset()
        self._buffers = None
        self._pool.shutdown(wait=False, cancel_futures=True)
        super().close()


CONFIG = GlooConfig
TRANSPORT = GlooTransport
