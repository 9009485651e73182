"""The engine-process side of the SGLang weight-update endpoints, independent of any web framework.

An HTTP server (``agentflow.engine.server``) hands request bodies to :class:`WeightReceiverService` and gets back
verified, decoded tensors (or an exception naming the problem) to apply as one version:

- ``/init_weights_update_group`` -> :meth:`WeightReceiverService.init_group` (joins a gloo group; blocks until the
  trainer joined too), ``/destroy_weights_update_group`` -> :meth:`WeightReceiverService.destroy_group`;
- ``/update_weights_from_distributed`` -> :meth:`WeightReceiverService.receive` (checksummed buckets with
  ``load_format: "transfer_mesh"``, else SGLang's one broadcast per tensor);
- ``/update_weights_from_tensor`` with a ``transfer_mesh`` field -> :meth:`WeightReceiverService.decode_packed`
  (buckets travelled as tensors; the field carries the plan and the per-bucket checksums).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from transfer_mesh.buckets import IntegrityError
from transfer_mesh.plan import TransferPlan
from transfer_mesh.transport_gloo import GlooReceiver

BUCKET_PREFIX = "__transfer_mesh_bucket__."
INIT_OK = "Succeeded to initialize custom process group."
DESTROY_OK = "Succeeded to destroy custom process group."


def expected_version(label: Any) -> int | None:
    """The int version a ``weight_version`` label names (None: not an int label, not checked)."""
    text = str(label) if label is not None else ""
    return int(text) if text.lstrip("-").isdigit() else None


class WeightReceiverService:
    """Weight-update groups of one engine process and the decoding of what arrives through them."""

    def __init__(self, timeout_s: float = 120.0) -> None:
        self.timeout_s = timeout_s
        self.groups: dict[str, GlooReceiver] = {}
        self._lock = threading.Lock()

    def init_group(self, body: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        """Join the group a trainer hosts; (HTTP status, SGLang-shaped reply)."""
        backend = body.get("backend", "nccl")
        if backend != "gloo":
            return 400, {"success": False, "message": f"backend {backend!r} is not available here (use gloo)"}
        try:
            name = str(body.get("group_name", "weight_update_group"))
            rank, world = int(body.get("rank_offset", 1)), int(body["world_size"])
            address, port = str(body["master_address"]), int(body["master_port"])
        except (KeyError, TypeError, ValueError) as exc:
            return 400, {"success": False, "message": f"Failed to initialize custom process group: bad field {exc}"}
        try:
            receiver = GlooReceiver.join(address, port, rank, world, name, self.timeout_s)
        except Exception as exc:  # rendezvous failures come as several types
            return 400, {"success": False, "message": f"Failed to initialize custom process group: {exc}"}
        with self._lock:
            old = self.groups.pop(name, None)
            self.groups[name] = receiver
        if old is not None:
            old.close()
        return 200, {"success": True, "message": INIT_OK}

    def destroy_group(self, body: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        name = str(body.get("group_name", "weight_update_group"))
        with self._lock:
            receiver = self.groups.pop(name, None)
        if receiver is None:
            return 400, {"success": False, "message": f"no weights update group named {name!r}"}
        receiver.close()
        return 200, {"success": True, "message": DESTROY_OK}

    def receive(self, body: Mapping[str, Any]) -> dict[str, Tensor]:
        """Receive one version through the body's group; IntegrityError/ValueError name the problem."""
        name = str(body.get("group_name", "weight_update_group"))
        receiver = self.groups.get(name)
        if receiver is None:
            raise ValueError(f"no weights update group named {name!r} (call /init_weights_update_group first)")
        if body.get("load_format") == "transfer_mesh":
            plan = TransferPlan.from_wire(body)
            return receiver.receive_version(plan, expected_version(body.get("weight_version")))
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
            raise ValueError("names, dtypes and shapes must be lists")
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError("names, dtypes and shapes differ in length")
        return receiver.receive_named(names, dtypes, shapes)

    @staticmethod
    def decode_packed(ext: Mapping[str, Any], tensors: Mapping[str, Tensor], label: Any) -> dict[str, Tensor]:
        """Buckets that came as tensors named ``BUCKET_PREFIX + i`` -> verified tensors by name."""
        if not isinstance(ext, Mapping):
            raise IntegrityError("transfer_mesh must be an object with the plan and the digests")
        plan = TransferPlan.from_wire(ext)
        buffers: dict[int, Tensor] = {}
        for key, t in tensors.items():
            if not key.startswith(BUCKET_PREFIX):
                raise IntegrityError(f"unexpected tensor {key!r} in a transfer_mesh update")
            buffers[int(key.removeprefix(BUCKET_PREFIX))] = t.contiguous().view(-1)
        digests = {int(k): str(v) for k, v in dict(ext.get("digests") or {}).items()}
        version = expected_version(label)
        return plan.decode_version(-1 if version is None else version, buffers, digests, check_finite=True)

    def close(self) -> None:
        with self._lock:
            groups, self.groups = self.groups, {}
        for g in groups.values():
            g.close()
