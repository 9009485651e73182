"""The black-box proxy: its overhead per call over the engine's own latency, and a load run of many agents at once.

Model: a tiny Qwen2 made here and trained for a few seconds to call the ``calc`` tool after a question and answer
after the tool's result (``tests/test_proxy_model.py``), on the real embedded engine.

1. Overhead: one ``openai`` async client plays multi-turn conversations (each call splices the recorded history),
   sequentially; per call, the client's round trip minus the engine's own ``generate`` time for that call (timed
   inside the proxy) is the proxy's cost: HTTP, JSON, chat rendering, incremental tokenization, recording.
2. Load: N in-process async ``openai``-client agents plus M subprocess agents (this script with ``--agent``, run by
   the black-box runner's ``SubprocessProgram``), each asking 3 questions and so making 3 tool calls (6 chat calls),
   all started at once; reports calls in flight at the proxy, wall time, and that every call was recorded (none
   lost, ``tito_mismatch`` 0 in every trajectory).
3. Constrained decoding: decode throughput of the demo model (``agentflow model init`` defaults, 3.2M parameters)
   on the embedded engine, a batch of forced tool calls (a strict schema: the llguidance mask computed, applied
   and the matcher advanced every token) against the same batch unconstrained, rounds alternated; the ratio of
   median generated tokens/s is the cost of constraining.

Writes ``benchmarks/results/proxy.json`` and ``proxy.png``.

    .venv/bin/python benchmarks/proxy.py --quick     # CI size (< 1 min)
    .venv/bin/python benchmarks/proxy.py             # 256 async + 16 subprocess agents
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import _path  # noqa: F401  (must come before the project's imports: see _path.py)

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from test_proxy_model import MODEL, TOOLS  # noqa: E402  (the tool the tiny test model is trained on)

if TYPE_CHECKING:
    from agentflow.proxy import ProxyServer
    from agentflow.types import SamplingParams

QUESTIONS = 3


async def agent_loop(chat: Any, tool_wait_s: float = 0.02) -> dict[str, int]:
    """Ask QUESTIONS questions in one conversation; run every tool call (after a short wait, like a sandbox).
    ``chat(messages) -> assistant message dict`` is the transport (the openai client, or raw HTTP)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Answer the arithmetic question."}]
    calls = tool_calls = 0
    for _ in range(QUESTIONS):
        messages.append({"role": "user", "content": "What is 2 + 3?"})
        for _ in range(4):
            msg = await chat(messages)
            calls += 1
            messages.append(msg)
            if not msg.get("tool_calls"):
                break
            for c in msg["tool_calls"]:
                await asyncio.sleep(tool_wait_s)  # the agent awaits its tool: it holds no engine slot meanwhile
                messages.append({"role": "tool", "tool_call_id": c["id"], "content": "5"})
                tool_calls += 1
    return {"calls": calls, "tool_calls": tool_calls}


def openai_chat(client: Any, walls: list[float] | None = None) -> Any:
    async def chat(messages: list[dict[str, Any]]) -> dict[str, Any]:
        t = time.perf_counter()
        r = await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        if walls is not None:
            walls.append(time.perf_counter() - t)
        return r.choices[0].message.model_dump(exclude_none=True)

    return chat


def raw_chat(http: Any, base_url: str, walls: list[float]) -> Any:
    """The same calls over plain aiohttp: what the proxy costs without a client library's own processing."""

    async def chat(messages: list[dict[str, Any]]) -> dict[str, Any]:
        body = {"model": MODEL, "messages": messages, "tools": TOOLS}
        t = time.perf_counter()
        async with http.post(f"{base_url}/chat/completions", json=body) as r:
            data = await r.json()
        walls.append(time.perf_counter() - t)
        return data["choices"][0]["message"]

    return chat


def _subprocess_agent() -> None:
    import openai

    async def go() -> dict[str, int]:
        async with openai.AsyncOpenAI(max_retries=0, timeout=600) as client:
            return await agent_loop(openai_chat(client))

    print(json.dumps(asyncio.run(go())))


async def overhead(proxy: ProxyServer, sampling: SamplingParams, n_calls: int) -> dict[str, Any]:
    """Sequential conversations, over raw HTTP and with the openai client; per call, the round trip minus the
    engine's own time for that call (timed inside the proxy)."""
    out = {mode: await _overhead_runs(proxy, sampling, n_calls, mode) for mode in ("raw", "openai")}
    raw = out["raw"]
    return {
        "overhead_p50_ms": raw["overhead_p50_ms"],
        "overhead_p95_ms": raw["overhead_p95_ms"],
        "engine_p50_ms": raw["engine_p50_ms"],
        "overhead_over_engine_p50": round(raw["overhead_p50_ms"] / raw["engine_p50_ms"], 4),
        "server_side_overhead_p50_ms": raw["server_side_overhead_p50_ms"],
        "openai_client_overhead_p50_ms": out["openai"]["overhead_p50_ms"],
        "note": "overhead = client round trip - engine generate time of the same call; 'raw' is plain aiohttp on "
        "loopback (the proxy's cost as a program sees it), 'openai' adds the openai client's own processing",
        "samples_ms": raw["samples_ms"],
        "openai": out["openai"],
    }


async def _overhead_runs(proxy: ProxyServer, sampling: SamplingParams, n_calls: int, mode: str) -> dict[str, Any]:
    import aiohttp
    import openai

    samples, engine_ms, server_ms = [], [], []
    while len(samples) < n_calls:
        tid = f"ovh-{mode}-{len(samples)}"
        proxy.open(tid, sampling, 1024)
        walls: list[float] = []
        if mode == "raw":
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {proxy.api_key}"}) as http:
                await agent_loop(raw_chat(http, proxy.base_url(tid), walls), tool_wait_s=0.0)
        else:
            async with openai.AsyncOpenAI(base_url=proxy.base_url(tid), api_key=proxy.api_key) as client:
                await agent_loop(openai_chat(client, walls), tool_wait_s=0.0)
        for call, wall in zip(proxy.close(tid).calls, walls, strict=True):
            samples.append((wall - call.engine_s) * 1e3)
            engine_ms.append(call.engine_s * 1e3)
            server_ms.append((call.total_s - call.engine_s) * 1e3)
    return {
        "calls": len(samples),
        "overhead_p50_ms": round(statistics.median(samples), 3),
        "overhead_p95_ms": round(statistics.quantiles(samples, n=20)[18], 3),
        "engine_p50_ms": round(statistics.median(engine_ms), 3),
        "server_side_overhead_p50_ms": round(statistics.median(server_ms), 3),
        "samples_ms": [round(x, 3) for x in samples],
    }


async def load(proxy: ProxyServer, sampling: SamplingParams, n_async: int, n_proc: int) -> dict[str, Any]:
    import openai

    from agentflow.proxy.runner import SubprocessProgram
    from agentflow.proxy.types import BlackBoxTask

    timeline: list[tuple[float, int]] = []
    stop = asyncio.Event()

    async def sample() -> None:
        t0 = time.perf_counter()
        while not stop.is_set():
            timeline.append((time.perf_counter() - t0, proxy.in_flight))
            await asyncio.sleep(0.05)

    async def in_process(i: int) -> dict[str, Any]:
        tid = f"a{i}"
        proxy.open(tid, sampling, 1024)
        async with openai.AsyncOpenAI(base_url=proxy.base_url(tid), api_key=proxy.api_key, max_retries=0,
                                      timeout=600) as client:  # fmt: skip
            out = await agent_loop(openai_chat(client))
        return {**out, "recorder": proxy.close(tid)}

    program = SubprocessProgram([sys.executable, str(Path(__file__).resolve()), "--agent"], {"PYTHONPATH": str(ROOT)})

    async def subprocess_agent(i: int) -> dict[str, Any]:
        tid = f"p{i}"
        proxy.open(tid, sampling, 1024)
        task = BlackBoxTask(tid, proxy.base_url(tid), proxy.api_key, MODEL, [], TOOLS, 8, proxy.tools_url(tid))
        outcome = await program(task, 600)
        rec = proxy.close(tid)
        if outcome.error:
            raise RuntimeError(outcome.error)
        return {**json.loads(outcome.answer or "{}"), "recorder": rec}

    sampler = asyncio.create_task(sample())
    t0 = time.perf_counter()
    results = await asyncio.gather(
        *(in_process(i) for i in range(n_async)), *(subprocess_agent(i) for i in range(n_proc)), return_exceptions=True
    )
    wall = time.perf_counter() - t0
    stop.set()
    await sampler
    return _load_summary(proxy, results, n_async, n_proc, wall, timeline)


def _load_summary(
    proxy: Any, results: list[Any], n_async: int, n_proc: int, wall: float, timeline: list[tuple[float, int]]
) -> dict[str, Any]:
    """The load run's report: episodes and calls made against calls the proxy recorded (none may be lost)."""
    ok = [r for r in results if isinstance(r, dict)]
    errors = [repr(r)[:300] for r in results if not isinstance(r, dict)]
    recs = [r["recorder"] for r in ok]
    made = sum(r["calls"] for r in ok)
    recorded = sum(len(rec.calls) for rec in recs)
    return {
        "async_agents": n_async,
        "subprocess_agents": n_proc,
        "concurrent_episodes": n_async + n_proc,
        "episodes_completed": len(ok),
        "errors": errors[:5],
        "chat_calls": made,
        "chat_calls_recorded": recorded,
        "lost_calls": made - recorded + len(errors),
        "tool_calls_min_per_agent": min((r["tool_calls"] for r in ok), default=0),
        "tito_mismatch_total": sum(rec.tito_mismatch() for rec in recs),
        "root_segments_only": all([s.kind for s in rec.segments] == ["root"] for rec in recs),
        "max_in_flight": proxy.max_in_flight,
        "wall_s": round(wall, 2),
        "calls_per_s": round(made / wall, 1),
        "timeline": [(round(t, 2), n) for t, n in timeline],
    }


CONSTRAINED_TOOL = {
    "type": "function",
    "function": {
        "name": "book_table",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "people": {"type": "integer", "minimum": 1, "maximum": 12},
                "note": {"type": "string"},
                "tags": {"type": "array", "items": {"type": "string", "enum": ["quiet", "window", "late"]}},
            },
            "required": ["name", "people", "note", "tags"],
            "additionalProperties": False,
        },
    },
}


def constrained(model_dir: Path, batch: int, rounds: int, new_tokens: int) -> dict[str, Any]:
    """Generated tokens/s of a batch with and without a forced-tool-call grammar (same prompts, same budget)."""
    from agentflow.chat import ChatTokenizer
    from agentflow.engine.embedded import EmbeddedEngine
    from agentflow.structured import canonical, request_grammar
    from agentflow.types import SamplingParams

    tok = ChatTokenizer(model_dir)
    grammar = canonical(request_grammar([CONSTRAINED_TOOL], "required", False, None, new_tokens,
                                        lambda t: len(tok.encode(t))))  # fmt: skip
    prompt = tok.prompt_ids("Be brief.", "Book a table for four by the window.", [CONSTRAINED_TOOL])
    plain = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)  # no stop ids: runs the whole budget
    forced = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, stop_token_ids=tok.stop_ids,
                            grammar=grammar.lark)  # fmt: skip
    rates: dict[str, list[float]] = {"unconstrained": [], "constrained": []}
    lengths: list[int] = []
    with EmbeddedEngine(model_dir, max_slots=batch, max_len=1024, prefix_cache=False) as engine:
        engine.generate_sync(prompt, plain)  # warm-up
        for _ in range(rounds):
            # Constrained replies end when their grammar does, so the unconstrained batch is given the same
            # lengths, request by request: both batches shrink alike, and the ratio is the per-token cost.
            t0 = time.perf_counter()
            done = [f.result() for f in [engine.submit(prompt, forced) for _ in range(batch)]]
            rates["constrained"].append(sum(len(x.output_ids) for x in done) / (time.perf_counter() - t0))
            sizes = [len(x.output_ids) for x in done]
            lengths += sizes
            t0 = time.perf_counter()
            futs = [engine.submit(prompt, replace(plain, max_new_tokens=n)) for n in sizes]
            same = [f.result() for f in futs]
            rates["unconstrained"].append(sum(len(x.output_ids) for x in same) / (time.perf_counter() - t0))
    med = {k: statistics.median(v) for k, v in rates.items()}
    return {
        "model": str(model_dir),
        "batch": batch,
        "rounds": rounds,
        "max_new_tokens": new_tokens,
        "tokens_per_s_unconstrained": round(med["unconstrained"], 1),
        "tokens_per_s_constrained": round(med["constrained"], 1),
        "throughput_ratio": round(med["constrained"] / med["unconstrained"], 3),
        "constrained_reply_tokens_median": statistics.median(lengths),
        "rates": {k: [round(x, 1) for x in v] for k, v in rates.items()},
        "note": "ratio of median generated tokens/s, constrained over unconstrained, same prompt; each "
        "unconstrained request generates as many tokens as its constrained twin did",
    }


def _demo_model(tmp: Path) -> Path:
    from agentflow.model_init import ModelInitConfig, init_model

    demo = ROOT / "runs" / "models" / "demo-init"
    return demo if (demo / "config.json").is_file() else init_model(tmp / "demo-init", ModelInitConfig())


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4))
    o = result["overhead"]
    a.hist(o["samples_ms"], bins=30)
    a.axvline(o["overhead_p50_ms"], color="k", ls="--", label=f"p50 {o['overhead_p50_ms']:.2f} ms")
    a.set(xlabel="proxy overhead per call (ms): round trip - engine time", ylabel="calls",
          title=f"overhead (engine p50 {o['engine_p50_ms']:.1f} ms)")  # fmt: skip
    a.legend()
    ld = result["load"]
    ts = ld["timeline"]
    b.plot([t for t, _ in ts], [n for _, n in ts])
    title = f"{ld['concurrent_episodes']} agents, max in flight {ld['max_in_flight']}, lost {ld['lost_calls']}"
    b.set(xlabel="s", ylabel="chat calls in flight at the proxy", title=title)
    cd = result["constrained"]
    c.bar(["unconstrained", "constrained"], [cd["tokens_per_s_unconstrained"], cd["tokens_per_s_constrained"]])
    c.set(ylabel="generated tokens/s (median)", title=f"demo model, batch {cd['batch']}: "
          f"ratio {cd['throughput_ratio']:.2f}")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=100)


async def run(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    from agentflow.chat import ChatTokenizer
    from agentflow.engine.embedded import EmbeddedEngine
    from agentflow.proxy import ProxyServer
    from agentflow.types import SamplingParams

    sampling = SamplingParams(temperature=0.0, max_new_tokens=40)
    with EmbeddedEngine(model_dir, max_slots=args.slots, max_len=1024) as engine:
        async with ProxyServer(engine, ChatTokenizer(model_dir), MODEL) as proxy:
            ovh = await overhead(proxy, sampling, args.overhead_calls)
            proxy.max_in_flight = 0
            ld = await load(proxy, sampling, args.agents, args.subprocesses)
    return {"overhead": ovh, "load": ld}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CI size: 32 async + 4 subprocess agents")
    ap.add_argument("--agent", action="store_true", help=argparse.SUPPRESS)  # a subprocess agent of the load run
    ap.add_argument("--model", help="a tool-calling HF model directory (default: trained here in a temp dir)")
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--out", default=str(RESULTS / "proxy.json"))
    args = ap.parse_args()
    if args.agent:
        return _subprocess_agent()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    args.agents, args.subprocesses = (32, 4) if args.quick else (256, 16)
    args.overhead_calls = 30 if args.quick else 200
    from test_proxy_model import train_tool_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else train_tool_model(Path(tmp) / "tool-model")
        result = {"quick": args.quick, **asyncio.run(run(model_dir, args))}
        rounds = 3 if args.quick else 7
        result["constrained"] = constrained(_demo_model(Path(tmp)), 32, rounds, 96)
    result["constrained_throughput_ratio"] = result["constrained"]["throughput_ratio"]
    result["overhead_p50_ms"] = result["overhead"]["overhead_p50_ms"]
    result["concurrent_episodes"] = result["load"]["concurrent_episodes"]
    result["max_in_flight"] = result["load"]["max_in_flight"]
    result["lost_calls"] = result["load"]["lost_calls"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    keys = ("overhead_p50_ms", "concurrent_episodes", "max_in_flight", "lost_calls", "constrained_throughput_ratio")
    print(json.dumps({k: result[k] for k in keys} | {"wall_s": result["load"]["wall_s"]}))


if __name__ == "__main__":
    main()
