"""``serialized_named_tensors`` of SGLang's ``/update_weights_from_tensor``, both directions.

Each entry (one per TP rank) is base64 of a ``multiprocessing.reduction.ForkingPickler`` dump of
``[(name, tensor), ...]`` made under torch's ``file_system`` sharing strategy: a CPU tensor travels as a handle to
a shared-memory file, so the payload is only meaningful on the same host while the sender keeps the tensors alive.

Unpickling runs code named by the payload, so the server reads it with an allow-list unpickler: only the torch
functions and classes that rebuild shared tensors (plus plain containers) may be named. The endpoint is behind the
run's key as well.
"""

from __future__ import annotations

import base64
import contextlib
import io
import pickle
from collections.abc import Iterator
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import Tensor

_ALLOWED: dict[str, set[str]] = {
    "torch.multiprocessing.reductions": {"rebuild_tensor", "rebuild_typed_storage", "rebuild_storage_filename"},
    "torch._utils": {"_rebuild_tensor_v2", "_rebuild_parameter"},
    "torch.storage": {"UntypedStorage", "TypedStorage"},
    "torch": {"Tensor", "Size", "UntypedStorage"},
    "torch.nn.parameter": {"Parameter"},
    "collections": {"OrderedDict"},
    "builtins": {"list", "tuple", "dict"},
}


class _SafeUnpickler(pickle.Unpickler):
    """Resolves only allow-listed globals (and torch dtypes)."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, set()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in serialized_named_tensors")


@contextlib.contextmanager
def file_system_sharing() -> Iterator[None]:
    """Use torch's ``file_system`` sharing strategy inside the block (restored after)."""
    previous = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        mp.set_sharing_strategy(previous)


def serialize_named_tensors(named: list[tuple[str, Tensor]]) -> str:
    """One rank's payload: base64 of a ForkingPickler dump (tensors moved into shared memory, same host only)."""
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    with file_system_sharing():
        ForkingPickler(buf).dump(named)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def deserialize_named_tensors(payload: Any) -> dict[str, Tensor]:
    """Decode a ``serialized_named_tensors`` list (entries merged) into ``{name: tensor}`` (copies, own storage)."""
    if not isinstance(payload, list) or not payload or not all(isinstance(p, str) for p in payload):
        raise ValueError("serialized_named_tensors must be a non-empty list of base64 strings")
    out: dict[str, Tensor] = {}
    for entry in payload:
        try:
            raw = base64.b64decode(entry, validate=True)
            items = _SafeUnpickler(io.BytesIO(raw)).load()
        except (ValueError, pickle.UnpicklingError, EOFError) as exc:
            raise ValueError(f"cannot decode serialized_named_tensors: {exc}") from exc
        if isinstance(items, dict):
            items = list(items.items())
        for pair in items:
            if not (isinstance(pair, tuple | list) and len(pair) == 2 and isinstance(pair[1], Tensor)):
                raise ValueError("serialized_named_tensors must hold (name, tensor) pairs")
            out[str(pair[0])] = pair[1].detach().clone()
    return out
