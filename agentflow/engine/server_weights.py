"""Weight routes of the SGLang server: updates from disk, tensors and a distributed group; versions; read-back.

Every update goes through :meth:`WeightRoutes._apply`, which lays the new tensors over the current weights and hands
the whole version to the engine as one update, under one lock, so two updates never interleave.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from agentflow.engine import protocol as P
from agentflow.engine.qwen2 import load_hf_dir
from agentflow.engine.server_base import ServerBase
from agentflow.engine.tensors import deserialize_named_tensors
from transfer_mesh.transport import choreograph


class WeightRoutes(ServerBase):
    """``/update_weights_from_*``, update-group set-up, weight-update sessions, version labels, read-back."""

    def _next_version(self, label: Any) -> tuple[int, str]:
        """Int version and wire label for an update that names ``label`` (None: the next int)."""
        current = self.engine.weight_version
        if label is None:
            return current + 1, str(current + 1)
        label = str(label)
        if label.lstrip("-").isdigit():
            return int(label), label
        return max([current, *self.labels]) + 1, label

    async def _apply(
        self, label: Any, partial: dict[str, Any], pause_mode: Any = "none", flush: Any = None, checked: bool = False
    ) -> tuple[str, dict[str, float]]:
        """Apply ``partial`` (HF names -> tensors) on top of the current weights as one new version: pause
        (``pause_mode``), update, flush or keep the prefix cache (``flush``; None: the engine's setting), resume.
        ``checked``: TransferMesh's receiver already refused NaN/inf in ``partial`` (the engine skips its scan)."""
        if pause_mode not in ("none", "in_place", "retract", "abort"):
            raise ValueError(f"pause_mode must be none, in_place, retract or abort; got {pause_mode!r}")
        version, name = self._next_version(label)
        merged = {k: v for k, v in self.engine.model.params.items()}
        merged.update(partial)
        keep = not bool(flush) if flush is not None else self.engine.keep_cache_on_update
        async with self._weights_lock:
            timing = await self._op(
                choreograph,
                self.engine,
                pause_mode,
                not keep,
                lambda: self.engine.update_weights(version, merged, finite_checked=checked),
            )
            if name != str(version):
                self.labels[version] = name
        return name, timing

    @staticmethod
    def _weights_body(body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise P.ProtocolError({"success": False, "message": "request body must be a JSON object"})
        return body

    async def update_from_disk(self, request: web.Request) -> web.Response:
        body = self._weights_body(await self._body(request))
        try:
            model = await self._op(load_hf_dir, str(body.get("model_path") or self.model_path))
            name, _ = await self._apply(body.get("weight_version"), model.params)
        except (OSError, ValueError) as exc:
            reply = {"success": False, "message": f"Failed to update weights: {exc}", "num_paused_requests": 0}
            return web.json_response(reply, status=400)
        message = f"Succeeded to update model weights. Weight version updated to {name}."
        return web.json_response({"success": True, "message": message, "num_paused_requests": 0})

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        body = self._weights_body(await self._body(request))
        if not self._session:
            message = P.SESSION_MESSAGE.format("update_weights_from_tensor")
            return web.json_response({"success": False, "message": message}, status=400)
        if body.get("load_format") not in (None, "direct"):
            message = f"load_format {body.get('load_format')!r} is not supported (use direct)"
            return web.json_response({"success": False, "message": message}, status=400)
        ext = body.get("transfer_mesh")
        try:
            tensors = await self._op(deserialize_named_tensors, body.get("serialized_named_tensors"))
            if ext is not None:  # checksummed buckets: verify the whole version before applying any of it
                tensors = await self._op(self.receivers.decode_packed, ext, tensors, body.get("weight_version"))
            flush = body.get("flush_cache") if ext is not None else None
            pause = body.get("pause_mode", "none")
            name, timing = await self._apply(body.get("weight_version"), tensors, pause, flush, ext is not None)
        except (ValueError, TypeError, OSError, RuntimeError) as exc:
            return web.json_response({"success": False, "message": f"Failed to update weights: {exc}"}, status=400)
        reply: dict[str, Any] = {"success": True, "message": f"Success Weight version updated to {name}."}
        return web.json_response({**reply, **timing} if ext is not None else reply)

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        body = self._weights_body(await self._body(request))
        status, reply = await self._op(self.receivers.init_group, body)
        return web.json_response(reply, status=status)

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        body = self._weights_body(await self._body(request))
        status, reply = await self._op(self.receivers.destroy_group, body)
        return web.json_response(reply, status=status)

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        body = self._weights_body(await self._body(request))
        if not self._session:
            message = P.SESSION_MESSAGE.format("update_weights_from_distributed")
            return web.json_response({"success": False, "message": message}, status=400)
        t0 = time.perf_counter()
        try:  # the engine keeps generating while the version streams in; it stalls only for the apply
            tensors = await self._op(self.receivers.receive, body)
            receive_s = time.perf_counter() - t0
            label, pause = body.get("weight_version"), body.get("pause_mode", "none")
            checked = body.get("load_format") == "transfer_mesh"
            name, timing = await self._apply(label, tensors, pause, body.get("flush_cache"), checked)
        except (ValueError, TypeError, RuntimeError) as exc:
            return web.json_response({"success": False, "message": f"Failed to update weights: {exc}"}, status=400)
        message = f"Succeeded to update parameter online. Weight version updated to {name}."
        reply: dict[str, Any] = {"success": True, "message": message}
        if body.get("load_format") == "transfer_mesh":
            reply.update(receive_s=receive_s, **timing)
        return web.json_response(reply)

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        """The first ``truncate_size`` rows of a parameter as nested lists (SGLang's read-back endpoint)."""
        body = self._weights_body(await self._body(request))
        t = self.engine.model.params.get(str(body.get("name")))
        if t is None:
            raise P.error_message("Get parameter by name failed")
        return web.json_response(t.detach()[: int(body.get("truncate_size", 100))].tolist())

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        self._session = True
        return web.json_response({"success": True, "message": "Success"})

    async def end_weight_update(self, request: web.Request) -> web.Response:
        self._session = False
        return web.json_response({"success": True, "message": "Success"})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = self._weights_body(await self._body(request))
        new = body.get("new_version")
        if not isinstance(new, str | int) or isinstance(new, bool):
            return web.json_response({"success": False, "message": "new_version must be a string"}, status=400)
        if body.get("abort_all_requests"):
            for rid in list(self._inflight):
                self.engine.abort(rid)
        self.labels[self.engine.weight_version] = str(new)
        return web.json_response({"success": True, "message": f"Weight version updated to {new}", "new_version": new})
