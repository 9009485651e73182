"""Weight updates of :class:`agentflow.engine.sglang_client.SGLangEngine`: the choreography real SGLang needs.

A real SGLang server (0.5.23) applies an update while requests decode but cannot then drop the KV the old weights
computed; it reports the update as failed ("weights were updated, but the cache was not flushed") and its radix
cache goes on serving that KV to new requests. It also answers 200 to an update whose tensor names its model does
not have (it only logs them), and ignores buckets it does not understand. So every update to a plain SGLang server
here goes:

1. names checked against the checkpoint the server loaded: an unknown name is refused before anything is sent;
2. ``/pause_generation`` with ``retract`` (an ``in_place`` or ``none`` pause is made a retract: requests go back to
   the queue without KV and are prefilled again by the new weights) or ``abort``;
3. ``/begin_weight_update``, the update (it names the version, so the label changes with the weights),
   ``/end_weight_update``;
4. a checked flush: ``/flush_cache`` until it succeeds (bounded), else the update fails;
5. ``/model_info`` must show the new label on every server; then ``/continue_generation``.

Our own servers (``agentflow serve``) announce ``transfer_mesh`` in ``/server_info``; they verify checksummed buckets
and pause, flush and resume on their side, so they take TransferMesh's buckets directly.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from agentflow.engine import protocol as P
from agentflow.engine.tensors import serialize_named_tensors
from transfer_mesh.transport import VersionRefused, WeightSyncError

NOT_FLUSHED = "Weights were updated, but the cache was not flushed"
SAFE_PAUSE = {"none": "retract", "in_place": "retract", "retract": "retract", "abort": "abort"}
"""How a plain SGLang server pauses for an update, by the configured pause mode (in place would keep stale KV)."""


def checkpoint_names(model_dir: str | Path) -> set[str] | None:
    """Tensor names of a Hugging Face directory's safetensors files (headers only), or None if it has none."""
    root = Path(model_dir)
    files = sorted(root.glob("*.safetensors")) if root.is_dir() else []
    if not files:
        return None
    names: set[str] = set()
    for f in files:
        with f.open("rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size))
        names |= {k for k in header if k != "__metadata__"}
    return names


class SGLangWeightUpdates:
    """The weight-update half of the SGLang client (mixed into ``SGLangEngine``, which provides the plumbing)."""

    choreographs_updates = True
    """Its ``update_weights`` pauses, flushes (checked) and resumes by itself (see ``choreograph``)."""
    servers: list[Any]
    model_dir: str | None
    flush_timeout_s: float
    _version: int
    _kinds: list[str] | None
    _names: set[str] | None

    # provided by SGLangEngine
    def _each(self, path: str, bodies: list[Any]) -> list[tuple[int, Any]]:
        raise NotImplementedError

    def _broadcast(self, path: str, body: Any = None, method: str = "POST") -> list[tuple[int, Any]]:
        raise NotImplementedError

    def pause(self, mode: Any = "in_place") -> None:
        raise NotImplementedError

    def resume(self) -> None:
        raise NotImplementedError

    def server_infos(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------ what they are

    def speaks_transfer_mesh(self) -> bool:
        """True when every server verifies TransferMesh buckets (ours); a plain SGLang server would ignore them."""
        if self._kinds is None:
            self._kinds = ["agentflow" if info.get("transfer_mesh") else "sglang" for info in self.server_infos()]
        return all(k == "agentflow" for k in self._kinds)

    def known_names(self) -> set[str] | None:
        """Tensor names the servers' model has: the checkpoint they loaded (``/model_info``'s ``model_path`` when it
        is a local directory, else the job's model directory); None when neither can be read."""
        if self._names is None:
            paths = [d.get("model_path") for _, d in self._broadcast("/model_info", method="GET")]
            for path in [*paths, self.model_dir]:
                names = checkpoint_names(path) if path else None
                if names:
                    self._names = names
                    break
        return self._names

    def check_names(self, names: list[str]) -> None:
        """Refuse, before sending, tensors the servers' model does not have (SGLang would answer 200 and skip them)."""
        known = self.known_names()
        if known is None:
            return
        unknown = sorted(set(names) - known)
        if unknown:
            raise VersionRefused(
                f"{len(unknown)} tensor names are not in the served model's checkpoint (the server would skip them "
                f"and still report success): {', '.join(unknown[:5])}"
            )

    # ------------------------------------------------------------------------------------------ choreography

    def prepare_update(self, names: list[str], pause_mode: str = "retract") -> None:
        """Before an update of plain SGLang servers: names checked, pause (retract or abort), begin."""
        self.check_names(names)
        self.pause(SAFE_PAUSE.get(pause_mode, "retract"))
        try:
            self._all_ok("begin_weight_update", self._each("/begin_weight_update", [{}] * len(self.servers)))
        except BaseException:
            self.resume()
            raise

    def finish_update(self, version: int, replies: list[tuple[int, Any]] | None, flush_cache: bool = True) -> None:
        """After it (``replies``: each server's answer to the update; None when it failed before them): end, the
        replies checked, a checked flush, the label checked on every server, continue. The version becomes this
        client's only when all of that succeeded; the servers resume generating either way."""
        try:
            self._each("/end_weight_update", [{}] * len(self.servers))
            if replies is None:
                return
            self._all_ok(f"weight update to version {version}", replies)
            if flush_cache:
                self.flush_checked()
            self.check_label(version)
        finally:
            self.resume()
        self._version = version

    def flush_checked(self) -> None:
        """``/flush_cache`` on every server until all succeed; WeightSyncError after ``flush_timeout_s``."""
        deadline = time.monotonic() + self.flush_timeout_s
        while True:
            replies = self._broadcast("/flush_cache", None)
            if all(status == 200 for status, _ in replies):
                return
            if time.monotonic() > deadline:
                bad = [s.url for s, (st, _) in zip(self.servers, replies, strict=True) if st != 200]
                raise WeightSyncError(f"the prefix cache could not be flushed after a weight update on {bad}")
            time.sleep(0.1)

    def check_label(self, version: int) -> None:
        """Every server's ``/model_info`` names ``version`` (an update that did not happen leaves the old label)."""
        labels = [d.get("weight_version") for _, d in self._broadcast("/model_info", method="GET")]
        wrong = [(s.url, lab) for s, lab in zip(self.servers, labels, strict=True) if lab != str(version)]
        if wrong:
            raise WeightSyncError(f"after the update to version {version} the servers report {wrong}")

    def _all_ok(self, what: str, replies: list[tuple[int, Any]]) -> None:
        """Raise VersionRefused naming each server whose reply is not a success; a reply that says the weights
        changed but the cache was not flushed counts as applied (the checked flush follows)."""
        problems = []
        for srv, (status, data) in zip(self.servers, replies, strict=True):
            applied = status == 200 and (not isinstance(data, dict) or data.get("success", True) is not False)
            if not applied and not P.error_text(data).startswith(NOT_FLUSHED):
                problems.append(f"{srv.url}: HTTP {status}: {P.error_text(data)}")
        if problems:
            raise VersionRefused(f"{what} failed: {'; '.join(problems)}")

    # ---------------------------------------------------------------------------------------------- updates

    def update_weights(
        self, version: int, named_tensors: dict[str, Any], pause_mode: str = "retract", flush_cache: bool = True
    ) -> None:
        """Push a whole version to every server through ``/update_weights_from_tensor`` (same host only: tensors
        travel as shared-memory handles), with the choreography above on plain SGLang servers. Raises
        VersionRefused (nothing applied: unknown names, a refusal) or WeightSyncError (applied, but the cache
        could not be flushed or the label did not change)."""
        tensors = [(name, t.detach().to("cpu").contiguous().clone()) for name, t in named_tensors.items()]
        body: dict[str, Any] = {"serialized_named_tensors": [serialize_named_tensors(tensors)]}
        body.update(weight_version=str(version), flush_cache=flush_cache)
        self.prepare_update([n for n, _ in tensors], pause_mode)
        replies = None
        try:
            replies = self._each("/update_weights_from_tensor", [body] * len(self.servers))
        finally:
            self.finish_update(version, replies, flush_cache)
            del tensors  # the servers have copied them out of shared memory
