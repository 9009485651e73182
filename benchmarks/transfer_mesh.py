"""TransferMesh weight updates vs saving an HF directory and reloading it, side by side in one run.

For models of about 25M, 100M and 400M parameters (random Qwen2, fp32): the time of one verified weight update
in-process (bucket pack + checksum + verify + engine apply) and over gloo to 2 engine server processes, against
saving the HF directory (safetensors) and reloading it (in-process engine; and both servers'
``/update_weights_from_disk``); the in-process bandwidth as a fraction of a plain memcpy of the same bytes measured
in the same run (each update interleaved with one copy; checksums included), and the generation stall per update
(engine paused -> resumed). Writes
``benchmarks/results/transfer_mesh.json`` and ``transfer_mesh.png``.

    .venv/bin/python benchmarks/transfer_mesh.py --quick   # 25M and 100M (CI)
    .venv/bin/python benchmarks/transfer_mesh.py           # + 400M
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _path  # noqa: F401  (must come before the project's imports: see _path.py)
import requests
import torch
from safetensors.torch import save_file

from agentflow.engine.embedded import EmbeddedEngine
from agentflow.engine.launch import start_servers, stop_servers
from agentflow.engine.qwen2 import load_hf_dir
from agentflow.engine.sglang_client import SGLangEngine
from agentflow.model_init import ModelInitConfig, init_model
from transfer_mesh.transport import make_transport

RESULTS = Path(__file__).resolve().parent / "results"
KEY = "bench-key"
SIZES = {  # name -> model shape (vocab 8192, tied embeddings)
    "25M": dict(hidden_size=512, num_hidden_layers=7, intermediate_size=1536, num_attention_heads=8),
    "100M": dict(hidden_size=1024, num_hidden_layers=7, intermediate_size=3072, num_attention_heads=16),
    "400M": dict(hidden_size=1536, num_hidden_layers=12, intermediate_size=4608, num_attention_heads=16),
}


def timed(fn: Callable[[], Any], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def new_weights(engine: EmbeddedEngine, step: int) -> dict[str, torch.Tensor]:
    """A trainer's export stand-in: fresh tensors of the engine's names and shapes (distinct every version)."""
    return {k: v + 1e-3 * step for k, v in engine.model.params.items()}


def bench_inprocess(engine: EmbeddedEngine, named: dict, repeats: int) -> dict[str, Any]:
    """Updates interleaved with plain copies of the same bytes, so both see the same machine load."""
    nbytes = sum(t.numel() * t.element_size() for t in named.values())
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    tm = make_transport({"type": "inprocess", "pause_mode": "in_place"}, [engine])
    first = tm.send(engine.weight_version + 1, named)  # pays for fresh staging pages
    reports, memcpy = [], []
    for _ in range(repeats):
        memcpy += timed(lambda: dst.copy_(src), 1)
        reports.append(tm.send(engine.weight_version + 1, named))
    tm.close()
    total = statistics.median(r.total_s for r in reports)
    mem = statistics.median(memcpy)
    return {
        "bytes": nbytes,
        "memcpy_s": mem,
        "update_s": total,
        "pack_s": statistics.median(r.pack_s for r in reports),
        "verify_s": statistics.median(r.transfer_s for r in reports),
        "transport_s": statistics.median(r.pack_s + r.transfer_s for r in reports),
        "apply_s": statistics.median(r.apply_s for r in reports),
        "stall_s": statistics.median(r.stall_s for r in reports),
        "first_update_s": first.total_s,
        "fraction_of_memcpy": mem / total,
        "fraction_of_memcpy_per_round": statistics.median(m / r.total_s for m, r in zip(memcpy, reports, strict=True)),
    }


def bench_disk(engine: EmbeddedEngine, named: dict, model_dir: Path, tmp: Path, repeats: int) -> dict[str, Any]:
    """Save the HF directory and reload it into the engine: as most RL stacks do it (the file lands in the page
    cache and is read back from there), and durably (fsync'd, then evicted from the page cache before the reload, as
    a reader on another machine or after memory pressure would see it)."""
    out = tmp / "export"
    weights = out / "model.safetensors"

    def once(durable: bool) -> None:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        shutil.copy(model_dir / "config.json", out / "config.json")
        save_file({k: v.contiguous() for k, v in named.items()}, str(weights))
        if durable:
            fd = os.open(weights, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages only: hence after the fsync
            finally:
                os.close(fd)
        engine.update_weights(engine.weight_version + 1, load_hf_dir(out).params)

    cached, durable = [], []
    for _ in range(repeats):  # interleaved, so both see the same machine load
        cached += timed(lambda: once(False), 1)
        durable += timed(lambda: once(True), 1)
    return {
        "save_reload_s": statistics.median(cached),
        "durable_save_cold_reload_s": statistics.median(durable),
        "dir": str(out),
    }


def bench_gloo(urls: list[str], named: dict, export_dir: str, repeats: int) -> dict[str, Any]:
    client = SGLangEngine(urls, api_key=KEY)
    tm = make_transport({"type": "gloo", "pause_mode": "in_place"}, [client])
    reports = [tm.send(100 + i, named) for i in range(repeats + 1)]  # the first joins the group
    tm.close()
    headers = {"Authorization": f"Bearer {KEY}"}

    def disk_both() -> None:
        with cf.ThreadPoolExecutor(len(urls)) as pool:
            body = {"model_path": export_dir}
            futs = [
                pool.submit(requests.post, u + "/update_weights_from_disk", json=body, headers=headers) for u in urls
            ]
            assert all(f.result().status_code == 200 for f in futs)

    disk = statistics.median(timed(disk_both, repeats))
    client.close()
    rs = reports[1:]
    return {
        "update_s": statistics.median(r.total_s for r in rs),
        "transfer_s": statistics.median(r.transfer_s for r in rs),
        "stall_s": statistics.median(r.stall_s for r in rs),
        "first_update_s": reports[0].total_s,
        "servers_reload_from_disk_s": disk,
    }


def run_size(name: str, shape: dict, tmp: Path, repeats: int) -> dict[str, Any]:
    model_dir = tmp / name
    init_model(model_dir, ModelInitConfig(vocab_size=8192, num_key_value_heads=shape["num_attention_heads"], **shape))
    engine = EmbeddedEngine(model_dir, max_slots=2, max_len=128)
    params = sum(t.numel() for t in engine.model.params.values())
    named = new_weights(engine, 1)
    row: dict[str, Any] = {"params": params}
    row["inprocess"] = bench_inprocess(engine, named, repeats)
    row["disk"] = bench_disk(engine, named, model_dir, tmp, repeats)
    engine.close()
    procs, urls = start_servers(model_dir, 2, KEY, max_slots=2, max_len=128, timeout=300, quiet=False)
    try:
        row["gloo"] = bench_gloo(urls, named, row["disk"]["dir"], repeats)
    finally:
        stop_servers(procs)
    disk = row["disk"]["save_reload_s"]
    row["speedup_vs_disk"] = disk / row["inprocess"]["update_s"]
    row["speedup_vs_disk_gloo"] = disk / row["gloo"]["update_s"]
    durable = row["disk"]["durable_save_cold_reload_s"]
    row["speedup_vs_durable_disk"] = durable / row["inprocess"]["update_s"]
    row["speedup_vs_durable_disk_gloo"] = durable / row["gloo"]["update_s"]
    # both servers reloading the saved directory themselves (the save itself not counted: conservative)
    row["speedup_vs_servers_reload_gloo"] = row["gloo"]["servers_reload_from_disk_s"] / row["gloo"]["update_s"]
    row["fraction_of_memcpy"] = row["inprocess"]["fraction_of_memcpy"]
    return row


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["sizes"])
    rows = [results["sizes"][n] for n in names]
    series = {
        "in-process": [r["inprocess"]["update_s"] for r in rows],
        "gloo, 2 engine processes": [r["gloo"]["update_s"] for r in rows],
        "save HF dir + reload": [r["disk"]["save_reload_s"] for r in rows],
        "durable save + cold reload": [r["disk"]["durable_save_cold_reload_s"] for r in rows],
    }
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(series)
    for k, (label, values) in enumerate(series.items()):
        ax.bar([i + k * width for i in range(len(names))], values, width, label=label)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(names))], names)
    ax.set_ylabel("seconds per weight update")
    ax.set_title("TransferMesh (fp32, 1 thread per process)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="leave out the 400M model")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    sizes = {k: v for k, v in SIZES.items() if not (args.quick and k == "400M")}
    results: dict[str, Any] = {"quick": args.quick, "threads_per_process": 1, "sizes": {}}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tm_bench_") as tmp:
        for name, shape in sizes.items():
            results["sizes"][name] = row = run_size(name, shape, Path(tmp), args.repeats)
            print(f"{name}: {json.dumps({k: v for k, v in row.items() if not isinstance(v, dict)})}", flush=True)
    results["wall_s"] = time.perf_counter() - t0
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "transfer_mesh.json").write_text(json.dumps(results, indent=2))
    plot(results, RESULTS / "transfer_mesh.png")
    print(f"wrote {RESULTS / 'transfer_mesh.json'} in {results['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
