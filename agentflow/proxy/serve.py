"""``agentflow proxy serve``: the recording proxy without a training job, so an agent can be tried before training.

The proxy serves a model directory on the embedded engine (or on SGLang servers given by URL, with the directory's
tokenizer and chat template) on 127.0.0.1. How a client maps to trajectories:

* ``base_url = http://127.0.0.1:PORT/v1``: every call goes to the trajectory ``default``;
* ``base_url = http://127.0.0.1:PORT/{trajectory_id}/0/v1``: a trajectory of its own, opened on its first call
  (ids of letters, digits, ``_`` and ``-``; another attempt number starts that trajectory over).

Calls are recorded exactly as in a job (segments, splicing, ``tito_mismatch``); the client's ``temperature``,
``top_p`` and ``seed`` are honoured. Each trajectory's record is written as ``DIR/{trajectory_id}.json`` (attempt N
> 0: ``{trajectory_id}.N.json``), atomically, after every call and once more on shutdown (Ctrl-C or SIGTERM).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import secrets
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentflow.chat import ChatTokenizer
from agentflow.files import dump_json
from agentflow.proxy.recorder import Recorder
from agentflow.proxy.server import DEFAULT_TRAJECTORY, ProxyServer
from agentflow.proxy.types import ProxyError
from agentflow.types import InferenceEngine, SamplingParams

#: Environment variable with the proxy's API key (keeps it off the command line); generated when unset.
KEY_ENV = "AGENTFLOW_PROXY_KEY"
_TRAJECTORY_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")  # a file name as it is: no dots, no separators
_ATTEMPT = re.compile(r"0|[1-9][0-9]{0,8}")


@dataclass
class ServeOptions:
    """What ``agentflow proxy serve`` was asked for."""

    model_dir: str
    port: int = 8000
    sglang: list[str] = field(default_factory=list)
    """SGLang server URLs; empty: the embedded engine on ``model_dir``."""
    record: str = "runs/proxy"
    api_key: str | None = None
    model_name: str = "agentflow-policy"
    max_len: int = 2048
    max_slots: int = 8
    max_new_tokens: int = 512
    """Upper bound of one call's new tokens (a request's ``max_tokens`` may ask for fewer)."""
    temperature: float = 1.0
    """Sampling temperature of a request that names none."""
    seed: int = 0
    train_side_calls: bool = False


class ServedTrajectories:
    """The trajectories of a standalone proxy: opened on their first call, each written to its record file."""

    def __init__(self, directory: Path, tokenizer: ChatTokenizer, sampling: SamplingParams, max_len: int) -> None:
        self.directory, self.tokenizer, self.sampling, self.max_len = directory, tokenizer, sampling, max_len
        self.proxy: ProxyServer | None = None
        self.recorders: dict[tuple[str, int], Recorder] = {}

    def open(self, trajectory_id: str, attempt: str) -> None:
        """The proxy's opener: a trajectory's first call (or a new attempt of it) starts its record."""
        if not _TRAJECTORY_ID.fullmatch(trajectory_id):
            raise ProxyError(400, f"trajectory id {trajectory_id!r} must be 1-128 letters, digits, '_' or '-'",
                             code="invalid_trajectory")  # fmt: skip
        if not _ATTEMPT.fullmatch(attempt):
            raise ProxyError(400, f"attempt {attempt!r} must be a number (0 for a trajectory's first)",
                             code="invalid_trajectory")  # fmt: skip
        assert self.proxy is not None, "attach the proxy first"
        if self.proxy.is_open(trajectory_id):  # a new attempt: the old one's record is complete
            self.write(self.proxy.close(trajectory_id))
        rec = self.proxy.open(trajectory_id, self.sampling, self.max_len, int(attempt), client_sampling=True)
        self.recorders[(trajectory_id, rec.attempt)] = rec

    def path(self, rec: Recorder) -> Path:
        name = rec.trajectory_id if rec.attempt == 0 else f"{rec.trajectory_id}.{rec.attempt}"
        return self.directory / f"{name}.json"

    def write(self, rec: Recorder) -> None:
        dump_json(self.path(rec), record_of(rec, self.tokenizer))

    def write_all(self) -> int:
        for rec in self.recorders.values():
            self.write(rec)
        return len(self.recorders)


def record_of(rec: Recorder, tokenizer: ChatTokenizer) -> dict[str, Any]:
    """A trajectory's record as JSON: its summary, segments (with their decoded text) and calls. A call's input is
    its segment's first ``prompt_tokens`` ids and its output the ids at ``span`` (``tito_mismatch`` checks both)."""
    segments = [{**dataclasses.asdict(s), "text": tokenizer.decode(s.token_ids)} for s in rec.segments]
    calls = []
    for c in rec.calls:
        call = {k: v for k, v in dataclasses.asdict(c).items() if k not in ("input_ids", "logprobs", "versions")}
        calls.append({**call, "prompt_tokens": len(c.input_ids)})
    return {"trajectory_id": rec.trajectory_id, "attempt": rec.attempt, "summary": rec.summary(),
            "segments": segments, "calls": calls}  # fmt: skip


def make_serve_engine(opts: ServeOptions) -> tuple[InferenceEngine, str]:
    """The engine to serve and how to name it: embedded on the model directory, or the SGLang servers."""
    from agentflow.config import EngineConfig
    from agentflow.engine.factory import make_engine

    kind = "sglang" if opts.sglang else "embedded"
    cfg = EngineConfig(type=kind, urls=list(opts.sglang), max_slots=opts.max_slots, max_len=opts.max_len)
    what = f"SGLang at {', '.join(opts.sglang)}" if opts.sglang else "embedded engine"
    return make_engine(cfg, opts.model_dir, seed=opts.seed), what


def serve_proxy(opts: ServeOptions) -> None:
    """Serve until SIGINT or SIGTERM, then write every record and stop."""
    if not (Path(opts.model_dir) / "config.json").is_file():
        raise FileNotFoundError(
            f"model directory not found: {opts.model_dir} (create one with `agentflow model init {opts.model_dir}`)"
        )
    asyncio.run(_serve(opts))


async def _serve(opts: ServeOptions) -> None:
    tokenizer = ChatTokenizer(opts.model_dir)
    sampling = SamplingParams(temperature=opts.temperature, max_new_tokens=opts.max_new_tokens)
    served = ServedTrajectories(Path(opts.record), tokenizer, sampling, opts.max_len)
    key, key_from = _api_key(opts)
    engine, what = make_serve_engine(opts)
    proxy = ProxyServer(engine, tokenizer, opts.model_name, api_key=key, port=opts.port,
                        train_side_calls=opts.train_side_calls, opener=served.open, on_call=served.write)  # fmt: skip
    served.proxy = proxy
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await proxy.start()
        _banner(opts, proxy, what, key_from)
        await stop.wait()
    finally:
        # Records first (a call in flight cannot hold them back), then the engine: its end aborts what is still
        # generating, so the server stops at once; then the records again, with those calls' refusals.
        served.write_all()
        engine.close()
        await proxy.stop()
        n = served.write_all()
        print(f"agentflow proxy: stopped; {n} trajectory record(s) in {opts.record}", file=sys.stderr, flush=True)


def _api_key(opts: ServeOptions) -> tuple[str, str | None]:
    """The key and where it came from (None: generated here, so it is printed)."""
    if opts.api_key:
        return opts.api_key, "--api-key"
    if os.environ.get(KEY_ENV):
        return os.environ[KEY_ENV], f"${KEY_ENV}"
    return "sk-agentflow-" + secrets.token_urlsafe(24), None


def _banner(opts: ServeOptions, proxy: ProxyServer, what: str, key_from: str | None) -> None:
    """What a client needs, one ``name: value`` per line (the key only when it was generated here)."""
    lines = [
        f"agentflow proxy: serving {opts.model_dir} ({what}) as model '{opts.model_name}'",
        f"base_url: {proxy.url}/v1",
        f"trajectory_base_url: {proxy.url}/{{trajectory_id}}/0/v1",
        f"api_key: {proxy.api_key if key_from is None else 'from ' + key_from}",
        f"records: {Path(opts.record) / '{trajectory_id}.json'}",
        f"calls to base_url are trajectory '{DEFAULT_TRAJECTORY}'; records are written after every call and when "
        "Ctrl-C or SIGTERM stops the proxy",
    ]
    print("\n".join(lines), flush=True)
