"""Bucket checksums, one-shot and streaming, and the cache-sized chunking the pack and verify passes share.

A bucket's digest is the same whether it is computed in one call over the whole buffer (:func:`digest`) or
chunk by chunk with a :class:`Hasher` while the bytes are still in cache (right after they were copied in, or
together with the finiteness check): all three algorithms are streaming hashes, so the wire format does not
depend on how a side chose to compute it.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

CHECKSUMS = ("xxh3", "crc32", "sha256")
CHUNK_BYTES = 1 << 20
"""Bytes handled per step of a fused pass: small enough to stay in a core's L2 between the copy and the hash."""


def default_checksum() -> str:
    """``xxh3`` (fast, needs the ``xxhash`` package) when importable, else ``crc32`` (stdlib)."""
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return "crc32"
    return "xxh3"


def _check_algo(algo: str) -> None:
    if algo not in CHECKSUMS:
        raise ValueError(f"unknown checksum {algo!r}; one of {CHECKSUMS}")


class Hasher:
    """Streaming checksum over consecutive byte ranges of CPU ``uint8`` tensors (no copies)."""

    def __init__(self, algo: str) -> None:
        _check_algo(algo)
        self.algo = algo
        self._crc = 0
        self._state: Any = None
        if algo == "xxh3":
            import xxhash

            self._state = xxhash.xxh3_64()
        elif algo == "sha256":
            self._state = hashlib.sha256()

    def update(self, chunk: Tensor) -> None:
        view = chunk.numpy()
        if self._state is None:
            self._crc = zlib.crc32(view, self._crc)
        else:
            self._state.update(view)

    def hexdigest(self) -> str:
        return f"{self._crc:08x}" if self._state is None else self._state.hexdigest()


def digest(buf: Tensor, algo: str) -> str:
    """Hex checksum of a contiguous CPU ``uint8`` buffer in one call (equal to a :class:`Hasher` over its chunks)."""
    _check_algo(algo)
    view = buf.numpy()
    if algo == "xxh3":
        import xxhash

        return xxhash.xxh3_64_hexdigest(view)
    if algo == "crc32":
        return f"{zlib.crc32(view):08x}"
    return hashlib.sha256(view).hexdigest()


def chunks(start: int, end: int, step: int = CHUNK_BYTES) -> Iterator[tuple[int, int]]:
    """``[a, b)`` ranges covering ``[start, end)``; ``step`` is a multiple of every element size."""
    for a in range(start, end, step):
        yield a, min(a + step, end)


def finite(t: Tensor) -> bool:
    """Whether every element of a floating-point tensor is finite, in one fast read (a sum) in the usual case.

    A sum is finite only if every term is (NaN and inf propagate); a non-finite sum of finite terms (overflow)
    falls back to the exact elementwise check. Half types are summed in fp32 so they rarely overflow.
    """
    acc = torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else None
    if bool(torch.isfinite(t.sum(dtype=acc))):
        return True
    return bool(torch.isfinite(t).all())
