"""Versioned weight buckets with checksums: the unit TransferMesh moves from trainer to engines.

A version is a list of :class:`Bucket`; each packs several HF-named tensors into one flat byte buffer with a
SHA-256 over the bytes. :func:`unpack_version` verifies every bucket, that none is missing, and that every expected
name arrived with its shape before it returns anything, so a receiver applies a whole version or none of it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch


class IntegrityError(ValueError):
    """A bucket is corrupt, missing, or from another version; the version must be refused."""


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass
class Bucket:
    version: int
    index: int
    total: int
    metas: list[TensorMeta]
    data: bytes
    sha256: str


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int64": torch.int64}


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: move the raw 16-bit words
        return t.view(torch.int16).numpy().tobytes()
    return t.numpy().tobytes()


def pack_version(named: Mapping[str, torch.Tensor], version: int, bucket_bytes: int = 32 << 20) -> list[Bucket]:
    """Pack tensors (in the given order) into buckets of at most ``bucket_bytes`` (a larger tensor gets its own)."""
    groups: list[list[tuple[str, bytes, torch.Tensor]]] = [[]]
    size = 0
    for name, t in named.items():
        raw = _tensor_bytes(t)
        if groups[-1] and size + len(raw) > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, raw, t))
        size += len(raw)
    buckets = []
    for i, group in enumerate(groups):
        metas, offset = [], 0
        for name, raw, t in group:
            dtype = str(t.dtype).removeprefix("torch.")
            metas.append(TensorMeta(name, dtype, tuple(t.shape), offset, len(raw)))
            offset += len(raw)
        data = b"".join(raw for _, raw, _ in group)
        buckets.append(Bucket(version, i, len(groups), metas, data, hashlib.sha256(data).hexdigest()))
    return buckets


def _decode(meta: TensorMeta, data: bytes) -> torch.Tensor:
    raw = data[meta.offset : meta.offset + meta.nbytes]
    if meta.dtype == "bfloat16":
        arr = np.frombuffer(raw, dtype=np.int16).copy()
        return torch.from_numpy(arr).view(torch.bfloat16).reshape(meta.shape)
    if meta.dtype not in _DTYPES:
        raise IntegrityError(f"tensor {meta.name}: unsupported dtype {meta.dtype}")
    arr = np.frombuffer(raw, dtype=np.dtype(meta.dtype)).copy()  # copy: the receiver owns its storage
    return torch.from_numpy(arr).reshape(meta.shape)


def unpack_version(
    buckets: list[Bucket], expected_shapes: Mapping[str, tuple[int, ...]] | None = None
) -> tuple[int, dict[str, torch.Tensor]]:
    """Verify and decode one whole version; raise :class:`IntegrityError` naming the first problem found."""
    if not buckets:
        raise IntegrityError("no buckets received")
    version, total = buckets[0].version, buckets[0].total
    seen = sorted(b.index for b in buckets)
    if seen != list(range(total)):
        raise IntegrityError(f"version {version}: got buckets {seen}, expected 0..{total - 1}")
    out: dict[str, torch.Tensor] = {}
    for b in buckets:
        if b.version != version:
            raise IntegrityError(f"bucket {b.index} is version {b.version}, expected {version}")
        if hashlib.sha256(b.data).hexdigest() != b.sha256:
            raise IntegrityError(f"version {version}: checksum mismatch in bucket {b.index}")
        for meta in b.metas:
            out[meta.name] = _decode(meta, b.data)
    if expected_shapes is not None:
        missing = sorted(set(expected_shapes) - set(out))
        if missing:
            raise IntegrityError(f"version {version}: missing tensors {missing[:3]}")
        for name, t in out.items():
            if name not in expected_shapes:
                raise IntegrityError(f"version {version}: unexpected tensor {name}")
            if tuple(t.shape) != tuple(expected_shapes[name]):
                raise IntegrityError(
                    f"version {version}: {name} has shape {tuple(t.shape)}, expected {tuple(expected_shapes[name])}"
                )
    return version, out
