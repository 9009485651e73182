"""The transfer plan: which tensor goes where, computed once and reused for every version.

A :class:`TransferPlan` fixes, for the engines' layout (HF names, full tensors), the order of the tensors, their
dtypes and shapes, and their bucket and byte offset. Senders pack a version into flat ``uint8`` buckets with
:meth:`TransferPlan.pack_bucket` and a checksum per bucket; receivers verify every bucket and decode the whole
version with :meth:`TransferPlan.decode_version` before anything is applied (whole version or none of it).

The plan travels as JSON (:meth:`TransferPlan.to_wire`); a receiver rebuilds it from the names, dtypes and shapes
(the same fields as SGLang's ``/update_weights_from_distributed``) and checks the fingerprint, so both sides agree
on every offset without sending them.

:func:`megatron_shards_to_hf` is the trainer-side half for TP > 1: per-rank megatron shards -> full HF tensors
through the model-family layouts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from transfer_mesh.buckets import IntegrityError
from transfer_mesh.checksum import CHECKSUMS, Hasher, chunks, default_checksum, digest, finite
from transfer_mesh.layouts import ModelSpec, hf_shapes, megatron_to_hf, merge_from_tp

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (SGLang's wire spelling)."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lives in a version: its bucket and byte range there."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    bucket: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class TransferPlan:
    """Names, dtypes, shapes and bucket assignment of every tensor of a version (engines' layout)."""

    slots: tuple[TensorSlot, ...]
    bucket_sizes: tuple[int, ...]
    bucket_bytes: int
    checksum: str

    # -------------------------------------------------------------------------------------------- building

    @classmethod
    def build(
        cls, metas: Iterable[tuple[str, str, Sequence[int]]], bucket_bytes: int = 32 << 20, checksum: str | None = None
    ) -> TransferPlan:
        """Plan ``(name, dtype, shape)`` in order: greedy buckets of at most ``bucket_bytes`` (a larger tensor
        gets a bucket of its own). Offsets are 64-byte aligned so every tensor view is aligned."""
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        algo = checksum or default_checksum()
        if algo not in CHECKSUMS:
            raise ValueError(f"unknown checksum {algo!r}; one of {CHECKSUMS}")
        slots: list[TensorSlot] = []
        sizes: list[int] = []
        for name, dtype, shape in metas:
            if dtype not in DTYPES:
                raise ValueError(f"tensor {name}: unsupported dtype {dtype!r}")
            shape = tuple(int(s) for s in shape)
            nbytes = DTYPES[dtype].itemsize * _numel(shape)
            if not sizes or (sizes[-1] and sizes[-1] + nbytes > bucket_bytes):
                sizes.append(0)
            offset = sizes[-1]
            slots.append(TensorSlot(name, dtype, shape, len(sizes) - 1, offset, nbytes))
            sizes[-1] = _align(offset + nbytes)
        if len({s.name for s in slots}) != len(slots):
            raise ValueError("duplicate tensor names in plan")
        return cls(tuple(slots), tuple(sizes), bucket_bytes, algo)

    @classmethod
    def for_tensors(
        cls, named: Mapping[str, Tensor], bucket_bytes: int = 32 << 20, checksum: str | None = None
    ) -> TransferPlan:
        """Plan the tensors of one exported version (their order, dtypes and shapes)."""
        return cls.build(((k, dtype_name(t.dtype), tuple(t.shape)) for k, t in named.items()), bucket_bytes, checksum)

    @classmethod
    def for_spec(
        cls,
        spec: ModelSpec,
        dtype: torch.dtype = torch.float32,
        bucket_bytes: int = 32 << 20,
        checksum: str | None = None,
    ) -> TransferPlan:
        """Plan a full HF model of ``spec`` (checkpoint order), e.g. for engines that know only the config."""
        name = dtype_name(dtype)
        return cls.build(((k, name, s) for k, s in hf_shapes(spec).items()), bucket_bytes, checksum)

    # ------------------------------------------------------------------------------------------ properties

    @property
    def num_buckets(self) -> int:
        return len(self.bucket_sizes)

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.slots)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {s.name: s.shape for s in self.slots}

    def fingerprint(self) -> str:
        """A short hash of everything both sides must agree on."""
        text = repr((self.slots, self.bucket_sizes, self.checksum))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def bucket_slots(self, index: int) -> list[TensorSlot]:
        return list(self._by_bucket[index])

    def new_buffers(self) -> list[Tensor]:
        """One empty ``uint8`` buffer per bucket (reuse them across versions: fresh pages cost as much as a copy)."""
        return [torch.empty(n, dtype=torch.uint8) for n in self.bucket_sizes]

    # ---------------------------------------------------------------------------------------------- wire

    def to_wire(self) -> dict[str, Any]:
        """JSON: SGLang-style ``names``/``dtypes``/``shapes`` plus bucket size, checksum and fingerprint."""
        return {
            "names": [s.name for s in self.slots],
            "dtypes": [s.dtype for s in self.slots],
            "shapes": [list(s.shape) for s in self.slots],
            "bucket_bytes": self.bucket_bytes,
            "checksum": self.checksum,
            "fingerprint": self.fingerprint(),
        }

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> TransferPlan:
        """Rebuild a plan from :meth:`to_wire`; raises IntegrityError if it does not reproduce the fingerprint."""
        try:
            names, dtypes, shapes = wire["names"], wire["dtypes"], wire["shapes"]
            if not len(names) == len(dtypes) == len(shapes):
                raise ValueError("names, dtypes and shapes differ in length")
            plan = cls.build(zip(names, dtypes, shapes, strict=True), int(wire["bucket_bytes"]), wire["checksum"])
        except (KeyError, TypeError, ValueError) as exc:
            raise IntegrityError(f"bad transfer plan: {exc}") from exc
        if wire.get("fingerprint") not in (None, plan.fingerprint()):
            raise IntegrityError(f"transfer plan fingerprint {wire['fingerprint']} != {plan.fingerprint()}")
        return plan

    # ------------------------------------------------------------------------------------- pack / decode

    def check_tensors(self, named: Mapping[str, Tensor]) -> None:
        """Raise IntegrityError unless ``named`` has exactly the plan's names, shapes and dtypes."""
        if len(named) != len(self.slots) or any(s.name not in named for s in self.slots):
            missing = sorted({s.name for s in self.slots} - set(named))
            extra = sorted(set(named) - {s.name for s in self.slots})
            raise IntegrityError(f"tensors do not match the plan: missing {missing[:3]}, unexpected {extra[:3]}")
        for s in self.slots:
            t = named[s.name]
            if tuple(t.shape) != s.shape or dtype_name(t.dtype) != s.dtype:
                raise IntegrityError(
                    f"{s.name}: {dtype_name(t.dtype)}{tuple(t.shape)} does not match the plan's {s.dtype}{s.shape}"
                )

    def pack_bucket(self, index: int, named: Mapping[str, Tensor], out: Tensor) -> str:
        """Copy bucket ``index``'s tensors into ``out`` (a plan-sized ``uint8`` buffer); return its checksum.

        One pass over memory: each cache-sized chunk is hashed right after it was copied in. Alignment padding is
        zeroed so the checksum covers deterministic bytes.
        """
        hasher = Hasher(self.checksum)
        pos = 0
        for s in self._by_bucket[index]:
            _zero_hashed(out[pos : s.offset], hasher)
            _copy_hashed(named[s.name].detach(), out[s.offset : s.offset + s.nbytes], s, hasher)
            pos = s.offset + s.nbytes
        _zero_hashed(out[pos : self.bucket_sizes[index]], hasher)
        return hasher.hexdigest()

    def verify_bucket(
        self, version: int, index: int, buf: Tensor, expected: str | None, check_finite: bool = False
    ) -> None:
        """Raise IntegrityError unless ``buf`` is bucket ``index`` with its size and checksum ``expected``.

        With ``check_finite`` the same pass (chunk by chunk, while in cache) also refuses NaN or inf in any
        floating-point tensor; a checksum mismatch is reported first (corruption can look like NaN).
        """
        if buf.dtype != torch.uint8 or buf.numel() != self.bucket_sizes[index]:
            raise IntegrityError(
                f"version {version}: bucket {index} has {buf.numel()} bytes, expected {self.bucket_sizes[index]}"
            )
        if not check_finite:  # one call over the whole bucket: the fastest way to hash cold bytes
            if digest(buf, self.checksum) != expected:
                raise IntegrityError(f"version {version}: checksum mismatch in bucket {index}")
            return
        hasher, bad, pos = Hasher(self.checksum), None, 0
        for s in self._by_bucket[index]:
            hasher.update(buf[pos : s.offset])
            dtype = DTYPES[s.dtype]
            for a, b in chunks(s.offset, s.offset + s.nbytes):
                hasher.update(buf[a:b])
                if bad is None and dtype.is_floating_point and not finite(buf[a:b].view(dtype)):
                    bad = s.name
            pos = s.offset + s.nbytes
        hasher.update(buf[pos:])
        if hasher.hexdigest() != expected:
            raise IntegrityError(f"version {version}: checksum mismatch in bucket {index}")
        if bad is not None:
            raise IntegrityError(f"version {version}: {bad} contains NaN or inf")

    def check_complete(self, version: int, buffers: Mapping[int, Tensor]) -> None:
        """Raise IntegrityError unless exactly buckets ``0..n-1`` are present."""
        got = sorted(buffers)
        if got != list(range(self.num_buckets)):
            missing = sorted(set(range(self.num_buckets)) - set(got))
            raise IntegrityError(f"version {version}: missing buckets {missing} (got {got} of {self.num_buckets})")

    def views(self, buffers: Mapping[int, Tensor]) -> dict[str, Tensor]:
        """Every tensor by name as a typed, shaped view of its bucket (no copy)."""
        return {
            s.name: buffers[s.bucket][s.offset : s.offset + s.nbytes].view(DTYPES[s.dtype]).view(s.shape)
            for s in self.slots
        }

    def decode_version(
        self,
        version: int,
        buffers: Mapping[int, Tensor],
        digests: Mapping[int, str],
        check_finite: bool = False,
    ) -> dict[str, Tensor]:
        """Verify that every bucket arrived with its size and checksum, then return views of the buffers by name.

        Raises IntegrityError naming the first problem (missing or unexpected bucket, size, checksum, and with
        ``check_finite`` NaN or inf); the views share storage with ``buffers`` only (the receiver's own staging
        memory), never with the sender.
        """
        self.check_complete(version, buffers)
        for i in range(self.num_buckets):
            self.verify_bucket(version, i, buffers[i], digests.get(i), check_finite)
        return self.views(buffers)

    @cached_property
    def _by_bucket(self) -> tuple[tuple[TensorSlot, ...], ...]:
        """Slots of each bucket in byte order (computed once: a plan serves every version)."""
        return tuple(tuple(s for s in self.slots if s.bucket == i) for i in range(self.num_buckets))


def _zero_hashed(region: Tensor, hasher: Hasher) -> None:
    if region.numel():
        region.zero_()
        hasher.update(region)


def _copy_hashed(src: Tensor, dst: Tensor, slot: TensorSlot, hasher: Hasher) -> None:
    """Copy ``src`` into the bucket bytes ``dst``, hashing each chunk while it is still in cache."""
    if src.device.type == "cpu" and src.is_contiguous() and dtype_name(src.dtype) == slot.dtype:
        raw = src.reshape(-1).view(torch.uint8)
        for a, b in chunks(0, slot.nbytes):
            dst[a:b].copy_(raw[a:b])
            hasher.update(dst[a:b])
        return
    # another device, a strided layout or another dtype: one converting copy, then the hash over the result
    dst.view(DTYPES[slot.dtype]).view(slot.shape).copy_(src)
    for a, b in chunks(0, slot.nbytes):
        hasher.update(dst[a:b])


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _align(n: int, to: int = 64) -> int:
    return -(-n // to) * to


def megatron_shards_to_hf(spec: ModelSpec, shards: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Full HF tensors from every TP rank's megatron state (rank order), via the layouts' merge and renames."""
    if not shards:
        raise ValueError("no TP shards given")
    names = [k for k, v in shards[0].items() if isinstance(v, Tensor)]  # skips ``_extra_state`` (None)
    merged = {name: merge_from_tp(name, [s[name] for s in shards]) for name in names}
    return megatron_to_hf(merged, spec)
