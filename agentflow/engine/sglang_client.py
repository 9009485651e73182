"""``SGLangEngine``: the InferenceEngine protocol over HTTP, for N SGLang-protocol servers (real SGLang or ours).

Routing: requests of one trajectory (the rid's part before ``:``) stick to one server, so its prefix cache pays
off; a new trajectory goes to the healthy server with the fewest requests in flight. A request that cannot reach
its server (connection refused) is retried on another; one whose connection breaks mid-way is aborted there
(best effort) and retried. Servers that fail are marked unhealthy and re-checked with ``GET /health`` in the
background. Weight versions are ints here and ``str(version)`` on the wire.

All HTTP runs on one private event loop thread, so the synchronous methods (``score``, ``pause``,
``update_weights``...) work from any thread and ``generate`` from any event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading
import uuid
from collections import OrderedDict
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from agentflow.engine import protocol as P
from agentflow.engine.protocol import error_text
from agentflow.engine.sglang_weights import SGLangWeightUpdates
from agentflow.engine.tensors import serialize_named_tensors
from agentflow.types import GenerateResult, PauseMode, SamplingParams, ScoreResult
from transfer_mesh.transport import VersionRefused

T = TypeVar("T")
PLAIN_SGLANG_BUCKETS = (
    "a plain SGLang server would skip TransferMesh buckets (and still answer success): use protocol sglang or auto"
)
_REACHED_ERRORS = (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError)


class SGLangRequestError(ValueError):
    """The server rejected a request (HTTP 4xx); the message is the server's."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class SGLangServerError(RuntimeError):
    """The server failed (HTTP 5xx) or no server could be reached."""


def parse_generate_reply(
    data: dict[str, Any], rid: str | None = None, moe: tuple[int, int] | None = None
) -> GenerateResult:
    """A ``/generate`` reply object (or a stream's last chunk) as a GenerateResult; ``moe`` ``(layers, top-k)``:
    decode its ``routed_experts`` too."""
    meta = data["meta_info"]
    ids = [int(t) for t in data.get("output_ids", [])]
    triples = meta.get("output_token_logprobs") or []
    logprobs = [float(t[0]) if t[0] is not None else 0.0 for t in triples][: len(ids)]
    logprobs += [0.0] * (len(ids) - len(logprobs))
    current = P.parse_version(meta.get("weight_version", P.DEFAULT_VERSION_LABEL))
    reason = (meta.get("finish_reason") or {}).get("type", "abort")
    rows = meta.get("output_top_logprobs")
    top = None
    if rows:  # per token: [logprob, id, text] alternatives (tokens a grammar forbade come back as -inf or null)
        top = [[(int(t[1]), float(t[0])) for t in row or [] if t[0] is not None] for row in rows][: len(ids)]
    return GenerateResult(
        rid=str(meta.get("id", rid)),
        output_ids=ids,
        logprobs=logprobs,
        versions=P.versions_from_spans(meta.get("weight_versions"), len(ids), current),
        finish_reason=reason if reason in ("stop", "length", "abort") else "abort",
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        cached_tokens=int(meta.get("cached_tokens") or 0),
        top_logprobs=top,
        routed_experts=P.decode_routed_experts(meta["routed_experts"], *moe)
        if moe and meta.get("routed_experts")
        else None,
    )


def parse_score_reply(data: dict[str, Any], ids: list[int] | None = None, start: int | None = None) -> ScoreResult:
    """Prompt log-probs of a scoring ``/generate``: without ``ids``, every non-null ``input_token_logprobs`` entry;
    with them, exactly the entries of ``ids[start:]`` (the reply's last ``len(ids) - start``; SGLang answers
    ``logprob_start_len = s`` with null at ``s`` and values from ``s + 1``), checked id by id."""
    meta = data["meta_info"]
    triples = meta.get("input_token_logprobs") or []
    rows = meta.get("input_top_logprobs") or []
    if ids is None or start is None:
        keep = [i for i, t in enumerate(triples) if t[0] is not None]
    else:
        want = len(ids) - start
        keep = list(range(len(triples) - want, len(triples)))
        got = [int(triples[i][1]) for i in keep if i >= 0]
        if len(got) != want or got != list(ids[start:]) or any(triples[i][0] is None for i in keep):
            raise SGLangServerError(f"scoring reply does not cover tokens {start}..{len(ids) - 1} exactly")
    top = None
    if rows:
        top = [[(int(t[1]), float(t[0])) for t in rows[i]] for i in keep if i < len(rows) and rows[i]]
    return ScoreResult(
        logprobs=[float(triples[i][0]) for i in keep],
        top_logprobs=top,
        weight_version=P.parse_version(meta.get("weight_version", P.DEFAULT_VERSION_LABEL)),
    )


def sampling_json(s: SamplingParams) -> dict[str, Any]:
    """SGLang ``sampling_params`` for ours.

    SGLang's ``ignore_eos`` switches off ``stop_token_ids`` as well, so it is set only when there are no stop ids:
    then, as in the embedded engine, nothing but ``max_new_tokens`` ends a generation. With stop ids, the model's own
    EOS ids (its generation config) stop too; the agents' stop ids include them.
    """
    out: dict[str, Any] = {
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "max_new_tokens": s.max_new_tokens,
        "stop_token_ids": list(s.stop_token_ids),
        "ignore_eos": not s.stop_token_ids,
    }
    if s.seed is not None:
        out["sampling_seed"] = s.seed
    if s.stop:
        out["stop"] = list(s.stop)
        out["no_stop_trim"] = True  # the ids and text of the stop string stay, as the embedded engine keeps them
    if s.grammar is not None:
        out["ebnf"] = s.grammar  # the llguidance backend reads Lark here (checked by SGLangEngine)
    return out


@dataclass
class _Server:
    url: str
    healthy: bool = True
    inflight: int = 0


class SGLangEngine(SGLangWeightUpdates):
    """InferenceEngine over SGLang-protocol servers at ``urls`` (``http://host:port``).

    ``model_dir``: the job's model directory (the servers serve the same model); weight updates are checked
    against its tensor names when the servers' own checkpoint cannot be read here.
    """

    def __init__(
        self,
        urls: list[str],
        api_key: str | None = None,
        request_timeout: float = 3600.0,
        connect_timeout: float = 5.0,
        max_retries: int = 3,
        health_interval: float = 5.0,
        model_dir: str | Path | None = None,
        flush_timeout_s: float = 30.0,
        routed_experts: bool = False,
    ) -> None:
        if not urls:
            raise ValueError("SGLangEngine needs at least one server url")
        self.servers = [_Server(u.rstrip("/")) for u in urls]
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = aiohttp.ClientTimeout(total=request_timeout, sock_connect=connect_timeout)
        self.max_retries = max_retries
        self.health_interval = health_interval
        self._sticky: OrderedDict[str, int] = OrderedDict()
        self._where: dict[str, int] = {}
        self._version = 0
        self.model_dir = str(model_dir) if model_dir is not None else None
        self._moe: tuple[int, int] | None = None
        """A mixture-of-experts model's ``(layers, top-k)`` when ``routed_experts``: requests ask for them."""
        if routed_experts and model_dir is not None and (Path(model_dir) / "config.json").is_file():
            from transfer_mesh import hf

            spec = hf.read_config(model_dir)
            self._moe = (spec.num_hidden_layers, spec.num_experts_per_tok) if spec.is_moe else None
        self.flush_timeout_s = flush_timeout_s
        self._infos: list[dict[str, Any]] | None = None
        self._kinds: list[str] | None = None
        self._names: set[str] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sglang-client", daemon=True)
        self._thread.start()
        self._health_task = self._submit(self._health_loop())

    # ------------------------------------------------------------------------------------------- plumbing

    def _submit(self, coro: Coroutine[Any, Any, T]) -> cf.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self._thread:
            raise RuntimeError("blocking SGLangEngine call from its own event loop")
        return self._submit(coro).result()

    async def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers)
        return self._session

    async def _request(self, srv: _Server, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """One HTTP call; returns (status, parsed JSON or text). Connection errors propagate."""
        session = await self._http()
        async with session.request(method, srv.url + path, json=body) as r:
            text = await r.text()
            if "json" in (r.headers.get("Content-Type") or ""):
                return r.status, (await r.json(content_type=None)) if text else None
            return r.status, text

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            await asyncio.gather(*(self._check(s) for s in self.servers if not s.healthy))

    async def _check(self, srv: _Server) -> bool:
        try:
            status, _ = await asyncio.wait_for(self._request(srv, "GET", "/health"), 5.0)
            srv.healthy = status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            srv.healthy = False
        return srv.healthy

    def check_health(self) -> list[bool]:
        """``GET /health`` on every server now; returns (and records) each one's health."""

        async def all_() -> list[bool]:
            return list(await asyncio.gather(*(self._check(s) for s in self.servers)))

        return self._run(all_())

    # -------------------------------------------------------------------------------------------- routing

    def _choose(self, traj: str | None, exclude: set[int]) -> int:
        """The trajectory's server if it is healthy, else the least-loaded healthy one (sticky from now on)."""
        candidates = [i for i, s in enumerate(self.servers) if s.healthy and i not in exclude]
        if not candidates:
            candidates = [i for i in range(len(self.servers)) if i not in exclude] or list(range(len(self.servers)))
        if traj is not None and self._sticky.get(traj) in candidates:
            self._sticky.move_to_end(traj)
            return self._sticky[traj]
        idx = min(candidates, key=lambda i: (self.servers[i].inflight, i))
        if traj is not None:
            self._sticky[traj] = idx
            if len(self._sticky) > 100_000:
                self._sticky.popitem(last=False)
        return idx

    def server_of(self, rid: str) -> int | None:
        """Index of the server a trajectory (``rid``'s part before ``:``) sticks to, if any."""
        return self._sticky.get(rid.split(":", 1)[0])

    # ---------------------------------------------------------------------------------------- generation

    @property
    def weight_version(self) -> int:
        """The version of the last update this client applied (or read from the servers by :meth:`sync_version`)."""
        return self._version

    async def generate(self, input_ids: list[int], sampling: SamplingParams, rid: str | None = None) -> GenerateResult:
        """Generate on the trajectory's server; cancelling the awaiting task aborts the request there."""
        fut = self._submit(self._generate(list(input_ids), sampling, rid or uuid.uuid4().hex))
        return await asyncio.wrap_future(fut)

    def generate_sync(
        self, input_ids: list[int], sampling: SamplingParams | None = None, rid: str | None = None
    ) -> GenerateResult:
        """Blocking :meth:`generate`."""
        return self._run(self._generate(list(input_ids), sampling or SamplingParams(), rid or uuid.uuid4().hex))

    async def _generate(self, ids: list[int], sampling: SamplingParams, rid: str) -> GenerateResult:
        if sampling.weight_version is not None:
            raise ValueError(
                "sampling.weight_version: an SGLang server serves one weight version at a time; version pinning "
                "(rollout.partial: pin) needs the embedded engine"
            )
        if sampling.seed is not None or sampling.grammar is not None:
            await self._check_settings(sampling)
        body = {"input_ids": ids, "sampling_params": sampling_json(sampling), "return_logprob": True, "rid": rid}
        if sampling.top_logprobs:
            body["top_logprobs_num"] = sampling.top_logprobs
        if self._moe is not None:  # routing replay (servers need --enable-return-routed-experts)
            body["return_routed_experts"] = True
        status, data = await self._routed(rid.split(":", 1)[0], rid, "/generate", body)
        if status != 200:
            raise self._error(status, data)
        return parse_generate_reply(data, rid, self._moe)

    async def _routed(self, traj: str | None, rid: str | None, path: str, body: Any) -> tuple[int, Any]:
        """POST to the routed server, retrying elsewhere on connection errors (aborting ``rid`` where it broke)."""
        tried: set[int] = set()
        last: BaseException | None = None
        for _ in range(self.max_retries + 1):
            idx = self._choose(traj, tried)
            srv = self.servers[idx]
            srv.inflight += 1
            if rid is not None:
                self._where[rid] = idx
            try:
                return await self._request(srv, "POST", path, body)
            except aiohttp.ClientConnectorError as exc:  # never reached the server: safe to send elsewhere
                last = exc
            except _REACHED_ERRORS as exc:  # reached it, then the connection broke: make sure it stops
                last = exc
                if rid is not None:
                    await self._quiet(srv, "/abort_request", {"rid": rid})
            except asyncio.CancelledError:
                if rid is not None:
                    asyncio.ensure_future(self._quiet(srv, "/abort_request", {"rid": rid}))
                raise
            finally:
                srv.inflight -= 1
                if rid is not None and self._where.get(rid) == idx:
                    del self._where[rid]
            srv.healthy = False
            tried.add(idx)
            if len(tried) == len(self.servers):
                tried.clear()
                await asyncio.sleep(0.2)
        raise SGLangServerError(f"no server answered {path} after {self.max_retries + 1} tries: {last!r}")

    async def _quiet(self, srv: _Server, path: str, body: Any) -> None:
        try:
            await asyncio.wait_for(self._request(srv, "POST", path, body), 5.0)
        except (TimeoutError, aiohttp.ClientError, OSError):
            pass

    @staticmethod
    def _error(status: int, data: Any) -> Exception:
        cls = SGLangRequestError if 400 <= status < 500 else None
        return cls(status, error_text(data)) if cls else SGLangServerError(f"HTTP {status}: {error_text(data)}")

    def score(self, ids: list[int], start: int, top_k: int = 0) -> ScoreResult:
        """Log-probs of ``ids[start:]``, one per token (``/generate`` with ``max_new_tokens`` 0 and
        ``logprob_start_len = start - 1``: SGLang's first entry there is null, the values follow)."""
        if not 1 <= start <= len(ids):
            raise ValueError(f"score start must be in [1, {len(ids)}], got {start}")
        if start == len(ids):
            return ScoreResult(logprobs=[], top_logprobs=[] if top_k else None, weight_version=self._version)
        body = {
            "input_ids": list(ids),
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
            "return_logprob": True,
            "logprob_start_len": start - 1,
            "top_logprobs_num": top_k,
        }

        async def go() -> ScoreResult:
            status, data = await self._routed(None, None, "/generate", body)
            if status != 200:
                raise self._error(status, data)
            return parse_score_reply(data, list(ids), start)

        return self._run(go())

    # ------------------------------------------------------------------------------------ control (all servers)

    def _broadcast(self, path: str, body: Any = None, method: str = "POST") -> list[tuple[int, Any]]:
        async def all_() -> list[tuple[int, Any]]:
            return list(await asyncio.gather(*(self._request(s, method, path, body) for s in self.servers)))

        replies = self._run(all_())
        for status, data in replies:
            if status == 401 or status >= 500:
                raise self._error(status, data)
        return replies

    def pause(self, mode: PauseMode = "in_place") -> None:
        """``/pause_generation`` on every server."""
        for status, data in self._broadcast("/pause_generation", {"mode": mode}):
            if status != 200:
                raise self._error(status, data)

    def resume(self) -> None:
        """``/continue_generation`` on every server."""
        self._broadcast("/continue_generation", {})

    def abort(self, rid: str) -> None:
        """Abort ``rid`` on the server running it (or on all when unknown); unknown ids are ignored."""
        idx = self._where.get(rid)
        targets = [self.servers[idx]] if idx is not None else self.servers

        async def go() -> None:
            await asyncio.gather(*(self._quiet(s, "/abort_request", {"rid": rid}) for s in targets))

        self._run(go())

    def flush_cache(self) -> bool:
        """``/flush_cache`` on every server; True if all flushed (SGLang refuses while requests run)."""
        return all(status == 200 for status, _ in self._broadcast("/flush_cache", None))

    def sync_version(self) -> int:
        """Read ``weight_version`` from every server's ``/model_info``; set and return the lowest."""
        versions = [P.parse_version(d["weight_version"]) for _, d in self._broadcast("/model_info", method="GET")]
        self._version = min(versions)
        return self._version

    def server_infos(self) -> list[dict[str, Any]]:
        """Every server's ``/server_info`` (read once): its settings, ``version`` and capabilities."""
        if self._infos is None:
            self._infos = [d if isinstance(d, dict) else {} for _, d in self._broadcast("/server_info", method="GET")]
        return self._infos

    async def _check_settings(self, sampling: SamplingParams) -> None:
        """A seeded request needs servers that honour ``sampling_seed``: SGLang ignores it unless started with
        ``--enable-deterministic-inference`` (our servers always honour it). A constrained one needs the
        llguidance grammar backend (``--grammar-backend llguidance``): it reads our Lark grammars, and masks
        exactly as the trainer's replay does."""
        if self._infos is None:
            replies = await asyncio.gather(*(self._request(s, "GET", "/server_info") for s in self.servers))
            self._infos = [d if isinstance(d, dict) else {} for _, d in replies]
        if sampling.grammar is not None:
            other = [
                f"{s.url} ({i.get('grammar_backend')})"
                for s, i in zip(self.servers, self._infos, strict=True)
                if i.get("grammar_backend") != "llguidance"
            ]
            if other:
                raise ValueError(
                    f"constrained decoding needs SGLang's llguidance grammar backend; server(s) {other} run "
                    "another: start them with --grammar-backend llguidance"
                )
        if sampling.seed is None:
            return
        off = [
            s.url
            for s, i in zip(self.servers, self._infos, strict=True)
            if i.get("enable_deterministic_inference") is False
        ]
        if off:
            raise ValueError(
                f"sampling.seed is set but SGLang server(s) {off} ignore seeds (they run without "
                "--enable-deterministic-inference): start them with it, or leave the seed unset"
            )

    # ------------------------------------------------------------- TransferMesh: distributed and bucketed updates

    @property
    def num_servers(self) -> int:
        """Servers behind this client (each is one rank of a weight-update group)."""
        return len(self.servers)

    def _each(self, path: str, bodies: list[Any]) -> list[tuple[int, Any]]:
        """POST ``bodies[i]`` to server ``i``, concurrently; (status, reply) per server. Connection errors raise."""

        async def all_() -> list[tuple[int, Any]]:
            return list(
                await asyncio.gather(
                    *(self._request(s, "POST", path, b) for s, b in zip(self.servers, bodies, strict=True))
                )
            )

        return self._run(all_())

    def _check_all(self, what: str, replies: list[tuple[int, Any]]) -> None:
        problems = [
            f"{s.url}: HTTP {st}: {error_text(d)}"
            for s, (st, d) in zip(self.servers, replies, strict=True)
            if st != 200
        ]
        if problems:
            raise SGLangServerError(f"{what} failed: {'; '.join(problems)}")

    def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> None:
        """``/init_weights_update_group`` on every server (server ``i`` is rank ``rank_offset + i``); blocks until
        they joined, so the trainer must join as rank 0 concurrently."""
        body = {"master_address": master_address, "master_port": master_port, "world_size": world_size}
        body.update(group_name=group_name, backend=backend)
        bodies = [{**body, "rank_offset": rank_offset + i} for i in range(len(self.servers))]
        self._check_all("init_weights_update_group", self._each("/init_weights_update_group", bodies))

    def destroy_weights_update_group(self, group_name: str) -> None:
        """``/destroy_weights_update_group`` on every server (best effort: refusals are ignored)."""
        self._each("/destroy_weights_update_group", [{"group_name": group_name}] * len(self.servers))

    def begin_weight_update(self) -> None:
        self._check_all("begin_weight_update", self._each("/begin_weight_update", [{}] * len(self.servers)))

    def end_weight_update(self) -> None:
        self._check_all("end_weight_update", self._each("/end_weight_update", [{}] * len(self.servers)))

    def update_weights_from_distributed(self, body: dict[str, Any]) -> list[tuple[int, Any]]:
        """``/update_weights_from_distributed`` on every server (inside begin/end; the trainer broadcasts
        meanwhile). Returns each server's (status, reply); when all succeed, an int label becomes the version."""
        if body.get("load_format") == "transfer_mesh" and not self.speaks_transfer_mesh():
            raise VersionRefused(PLAIN_SGLANG_BUCKETS)
        replies = self._each("/update_weights_from_distributed", [body] * len(self.servers))
        if body.get("load_format") == "transfer_mesh":
            self._adopt(body.get("weight_version"), replies)
        return replies

    def update_weights_from_buckets(
        self, version: int, ext: dict[str, Any], buckets: list[Any], pause_mode: str, flush_cache: bool
    ) -> list[tuple[int, Any]]:
        """TransferMesh buckets (``uint8`` tensors, same host) through ``/update_weights_from_tensor`` with a
        ``transfer_mesh`` field (plan and checksums), inside begin/end on every server; (status, reply) each."""
        from transfer_mesh.receiver import BUCKET_PREFIX

        if not self.speaks_transfer_mesh():
            raise VersionRefused(PLAIN_SGLANG_BUCKETS)
        payload = serialize_named_tensors([(f"{BUCKET_PREFIX}{i}", b) for i, b in enumerate(buckets)])
        body: dict[str, Any] = {"serialized_named_tensors": [payload], "weight_version": str(version)}
        body.update(transfer_mesh=ext, pause_mode=pause_mode, flush_cache=flush_cache)
        self.begin_weight_update()
        try:
            replies = self._each("/update_weights_from_tensor", [body] * len(self.servers))
        finally:
            self.end_weight_update()
        self._adopt(str(version), replies)
        return replies

    def _adopt(self, label: Any, replies: list[tuple[int, Any]]) -> None:
        if all(st == 200 for st, _ in replies) and str(label).lstrip("-").isdigit():
            self._version = int(str(label))

    def close(self) -> None:
        """Close the HTTP session and stop the client's event loop."""

        async def shutdown() -> None:
            self._health_task.cancel()
            if self._session is not None:
                await self._session.close()

        if self._thread.is_alive():
            self._submit(shutdown()).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
