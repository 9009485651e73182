"""Sandbox costs, side by side in one process: exec latency per backend, warm-pool start-up, paused episodes.

Writes ``benchmarks/results/sandbox.json`` and ``.png``:
- ``exec_latency_ms``: p50/p99 of ``exec(["true"])`` per backend (``process``, ``bwrap``, ``docker``) on a started
  sandbox (target: ``bwrap`` p50 <= 60 ms).
- ``first_call_ms``: an episode's first tool call, started cold (create + exec) and from a warm :class:`SandboxPool`
  (acquire + exec), and ``startup_overhead_ms`` = first call - steady exec p50 (target for the pool: <= 10 ms).
- ``paused_episodes``: N episodes held at once by this process, each with generated tokens (a synthetic list of
  token ids: no engine runs here) and a live ``bwrap`` sandbox whose ``sleep`` is still running (an awaited
  ``aexec``), and the proportional memory (PSS, ``/proc/*/smaps_rollup``) of the whole process tree per episode.
  With docker, a few containers are measured the same way (their processes and ``containerd-shim``).
- ``hardening``: what the measured sandboxes enforce here (the caps that hold, the bwrap version, whether the host ran
  as root and bwrap as ``nobody``), and ``before_hardening``: the bwrap figures of the last run before the sandbox was
  hardened (no user namespace, capabilities or seccomp filter as root), carried over from the previous results file.

    .venv/bin/python benchmarks/sandbox.py            # full: 1000 paused episodes
    .venv/bin/python benchmarks/sandbox.py --quick    # CI: < 60 s
    .venv/bin/python benchmarks/sandbox.py --against REV  # also bwrap exec side by side with an older commit
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sandbox_ab import side_by_side  # noqa: E402  (this directory is on sys.path)

from envs.sandbox import Limits, SandboxPool, bwrap_works, docker_works, make_sandbox  # noqa: E402
from envs.sandbox.bwrap import bwrap_version, unprivileged_userns  # noqa: E402
from envs.sandbox.engine import PrivateDockerd, private_dockerd_available  # noqa: E402

EPISODE_LIMITS = Limits(memory_mb=256, cpu_s=5, file_size_mb=8, max_procs=16, output_kb=64)
TOKENS_PER_EPISODE = 512


def pct(xs: list[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank) of ``xs``."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s)) - 1))]


def summary_ms(xs: list[float]) -> dict[str, float]:
    ms = [x * 1000 for x in xs]
    return {"p50": round(statistics.median(ms), 2), "p99": round(pct(ms, 99), 2), "n": len(ms)}


# -- process tree and PSS -------------------------------------------------------------------------------------
def _ppids() -> dict[int, int]:
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    out[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    return out


def tree(root: int) -> list[int]:
    """``root`` and all its descendants."""
    children: dict[int, list[int]] = {}
    for pid, ppid in _ppids().items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def pss_kb(pids: list[int]) -> int:
    """The summed PSS (kB) of ``pids``."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1])
                        break
        except OSError:
            continue
    return total


def with_env_token(token: str) -> list[int]:
    needle = f"AF_BENCH={token}".encode()
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        found.append(int(name))
            except OSError:
                continue
    return found


# -- latency --------------------------------------------------------------------------------------------------
def exec_latency(kind: str, n: int, kw: dict[str, Any]) -> dict[str, float]:
    with make_sandbox(kind, **kw) as sb:
        sb.exec(["true"])
        times = []
        for _ in range(n):
            t = time.perf_counter()
            r = sb.exec(["true"])
            times.append(time.perf_counter() - t)
            assert r.ok, r
    return summary_ms(times)


def first_calls(kind: str, n: int, kw: dict[str, Any], steady_p50_ms: float) -> dict[str, Any]:
    """Cold (create + exec) vs warm pool (acquire + exec) first calls of ``n`` episodes each."""
    cold, warm, acquire = [], [], []
    for _ in range(n):
        t = time.perf_counter()
        sb = make_sandbox(kind, **kw)
        sb.exec(["true"])
        cold.append(time.perf_counter() - t)
        sb.close()
    with SandboxPool(kind, size=min(n, 8), **kw) as pool:
        for _ in range(n):
            pool.wait_ready(timeout=60)
            t = time.perf_counter()
            sb = pool.acquire()
            t_acq = time.perf_counter()
            sb.exec(["true"])
            warm.append(time.perf_counter() - t)
            acquire.append(t_acq - t)
            pool.release(sb)
        cold_starts = pool.cold_starts
    out: dict[str, Any] = {"cold": summary_ms(cold), "warm_pool": summary_ms(warm), "pool_acquire": summary_ms(acquire)}
    out["startup_overhead_ms"] = {
        "cold_p50": round(out["cold"]["p50"] - steady_p50_ms, 2),
        "warm_pool_p50": round(out["warm_pool"]["p50"] - steady_p50_ms, 2),
    }
    out["pool_cold_starts"] = cold_starts
    return out


# -- paused episodes ------------------------------------------------------------------------------------------
async def paused_episodes(n: int, batch: int, exclude: int | None = None) -> dict[str, Any]:
    """Hold ``n`` episodes, each with tokens and a bwrap sandbox running ``sleep``; measure the tree's PSS.

    ``exclude``: the pid of a subtree left out of the measure (the private docker engine this script started).
    """
    me = os.getpid()
    skip = set(tree(exclude)) if exclude else set()

    def tree_here() -> list[int]:
        return [p for p in tree(me) if p not in skip]

    base_tree = tree_here()
    base_pss = pss_kb(base_tree)
    episodes: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for start in range(0, n, batch):
        for i in range(start, min(n, start + batch)):
            sb = make_sandbox("bwrap", limits=EPISODE_LIMITS)
            tokens = list(range(i, i + TOKENS_PER_EPISODE))  # what the episode generated so far
            task = asyncio.ensure_future(sb.aexec(["sleep", "3600"], timeout=3600))
            episodes.append({"sandbox": sb, "tokens": tokens, "tool_call": task})
        await wait_sleeping(len(episodes))
    started_s = time.perf_counter() - t0
    pids = tree_here()
    running = sum(1 for p in pids if _comm(p) == "sleep")
    total_pss = pss_kb(pids)
    t1 = time.perf_counter()
    for ep in episodes:
        ep["sandbox"].close()
    results = await asyncio.gather(*(ep["tool_call"] for ep in episodes), return_exceptions=True)
    close_s = time.perf_counter() - t1
    await asyncio.sleep(0.2)
    left = [p for p in tree(me) if p != me and _comm(p) == "sleep"]
    return {
        "episodes": n,
        "sleeps_running": running,
        "processes_in_tree": len(pids),
        "processes_per_episode": round((len(pids) - len(base_tree)) / n, 2),
        "tree_pss_mb": round(total_pss / 1024, 1),
        "pss_per_episode_kb": round(total_pss / n, 1),
        "marginal_pss_per_episode_kb": round((total_pss - base_pss) / n, 1),
        "baseline_pss_mb": round(base_pss / 1024, 1),
        "start_all_s": round(started_s, 2),
        "close_all_s": round(close_s, 2),
        "calls_ended_on_close": sum(1 for r in results if not isinstance(r, BaseException)),
        "sleeps_left_after_close": len(left),
    }


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


async def wait_sleeping(expected: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(1 for p in tree(os.getpid()) if _comm(p) == "sleep") >= expected:
            return
        await asyncio.sleep(0.05)
    raise RuntimeError(f"{expected} sleeps did not start in {timeout} s")


def docker_paused(n: int, kw: dict[str, Any]) -> dict[str, Any]:
    """``n`` containers, each running ``sleep``: the PSS of their processes and their ``containerd-shim``."""
    token = uuid.uuid4().hex
    boxes = [make_sandbox("docker", env={"AF_BENCH": token}, limits=EPISODE_LIMITS, **kw) for _ in range(n)]
    try:
        for b in boxes:
            b.container.exec_run(["sleep", "3600"], detach=True, environment={"AF_BENCH": token})
        time.sleep(0.5)
        ppid = _ppids()
        for b in boxes:
            b.container.reload()
        inits = {int(b.container.attrs["State"]["Pid"]) for b in boxes}
        shims = {ppid.get(p, 0) for p in inits} - {0}
        procs = set(with_env_token(token)) | inits | shims
        total = pss_kb(sorted(procs))
        return {"episodes": n, "pss_per_episode_kb": round(total / n, 1), "processes_per_episode": len(procs) / n}
    finally:
        for b in boxes:
            b.close()


# -- hardening ------------------------------------------------------------------------------------------------
def hardening() -> dict[str, Any]:
    """What the bwrap sandbox enforces on this machine."""
    with make_sandbox("bwrap") as sb:
        status = sb.exec("grep -E '^(CapEff|NoNewPrivs|Seccomp):' /proc/self/status; id -u").stdout.split()
    return {
        "enforced": dict(sb.enforced),
        "bwrap_version": ".".join(map(str, bwrap_version())),
        "host_root": os.geteuid() == 0,
        "bwrap_as_nobody": os.geteuid() == 0 and unprivileged_userns(),
        "inside": {k.rstrip(":"): v for k, v in zip(status[0:-1:2], status[1:-1:2], strict=False)}
        | {"uid": status[-1]},
    }


def before_hardening(previous: Path) -> dict[str, Any] | None:
    """The bwrap figures of the last results file written before the hardening (kept from run to run)."""
    try:
        old = json.loads(previous.read_text())
    except (OSError, ValueError):
        return None
    if "before_hardening" in old:
        return old["before_hardening"]
    if "hardening" in old or "bwrap" not in old.get("exec_latency_ms", {}):
        return None
    return {
        "quick": old.get("quick"),
        "exec_latency_ms": old["exec_latency_ms"]["bwrap"],
        "first_call_ms": {k: old["first_call_ms"]["bwrap"][k] for k in ("cold", "warm_pool")},
    }


# -- main -----------------------------------------------------------------------------------------------------
def docker_kwargs(url: str | None) -> tuple[dict[str, Any] | None, PrivateDockerd | None]:
    """Keyword arguments for docker sandboxes: a given engine, the default one, or a private one started here."""
    if url or docker_works():
        return ({"base_url": url} if url else {}), None
    ok, why = private_dockerd_available()
    if not ok:
        print(f"docker: skipped ({why} missing)")
        return None, None
    eng = PrivateDockerd()
    eng.start()
    return {"base_url": eng.base_url}, eng


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    lat = res["exec_latency_ms"]
    kinds = list(lat)
    x = range(len(kinds))
    a.bar([i - 0.2 for i in x], [lat[k]["p50"] for k in kinds], 0.4, label="p50")
    a.bar([i + 0.2 for i in x], [lat[k]["p99"] for k in kinds], 0.4, label="p99")
    a.set_xticks(list(x), kinds)
    a.set_ylabel("exec latency (ms)")
    a.axhline(60, ls="--", c="grey", lw=1)
    a.set_title("exec(['true']) on a started sandbox")
    a.legend()
    names, cold, warm = [], [], []
    for k, v in res["first_call_ms"].items():
        names.append(k)
        cold.append(v["cold"]["p50"])
        warm.append(v["warm_pool"]["p50"])
    y = range(len(names))
    b.bar([i - 0.2 for i in y], cold, 0.4, label="cold: create + exec")
    b.bar([i + 0.2 for i in y], warm, 0.4, label="warm pool: acquire + exec")
    b.set_xticks(list(y), names)
    b.set_ylabel("first tool call p50 (ms)")
    pe = res["paused_episodes"]
    b.set_title(f"{pe['episodes']} paused bwrap episodes: {pe['pss_per_episode_kb']:.0f} kB PSS each")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def targets(res: dict[str, Any]) -> dict[str, bool]:
    first = res["first_call_ms"]["bwrap"]
    return {
        "bwrap_exec_p50_le_60ms": res["exec_latency_ms"]["bwrap"]["p50"] <= 60,
        "bwrap_warm_pool_first_call_le_10ms": first["warm_pool"]["p50"] <= 10,
        "bwrap_warm_pool_startup_overhead_le_10ms": first["startup_overhead_ms"]["warm_pool_p50"] <= 10,
        "paused_episodes_ge_1000": res["paused_episodes"]["episodes"] >= 1000
        and res["paused_episodes"]["sleeps_running"] >= 1000,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer samples and episodes (CI, < 60 s)")
    ap.add_argument("--episodes", type=int, default=None, help="paused episodes (default 1000; --quick 100)")
    ap.add_argument("--docker-host", default=None, help="engine URL (default: $DOCKER_HOST, else a private dockerd)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--against", default=None, help="also time bwrap exec side by side with this older commit")
    args = ap.parse_args()
    if not bwrap_works():
        sys.exit("benchmarks/sandbox.py needs bubblewrap: apt-get install bubblewrap")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # ~3 pipes per paused episode
    n_exec, n_first = (30, 10) if args.quick else (200, 40)
    episodes = args.episodes or (100 if args.quick else 1000)
    dkw, eng = docker_kwargs(args.docker_host)
    kinds: dict[str, dict[str, Any]] = {"process": {}, "bwrap": {}}
    if dkw is not None:
        kinds["docker"] = dkw
    res: dict[str, Any] = {
        "quick": args.quick,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_1m": os.getloadavg()[0]},
        "hardening": hardening(),
    }
    try:
        res["exec_latency_ms"] = {k: exec_latency(k, n_exec, kw) for k, kw in kinds.items()}
        print("exec latency (ms):", json.dumps(res["exec_latency_ms"]))
        res["first_call_ms"] = {
            k: first_calls(k, n_first, kw, res["exec_latency_ms"][k]["p50"])
            for k, kw in kinds.items()
            if k != "process"
        }
        print("first call (ms):", json.dumps(res["first_call_ms"]))
        engine_pid = eng.proc.pid if eng is not None and eng.proc is not None else None
        res["paused_episodes"] = asyncio.run(paused_episodes(episodes, batch=50, exclude=engine_pid))
        print("paused episodes:", json.dumps(res["paused_episodes"]))
        if dkw is not None:
            res["docker_paused_episodes"] = docker_paused(5 if args.quick else 20, dkw)
            print("docker paused:", json.dumps(res["docker_paused_episodes"]))
    finally:
        if eng is not None:
            eng.stop()
    if args.against:
        res["side_by_side"] = side_by_side(args.against, rounds=3 if args.quick else 8)
        print("side by side:", json.dumps(res["side_by_side"]))
    res["targets"] = targets(res)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res["before_hardening"] = before_hardening(out / "sandbox.json")
    (out / "sandbox.json").write_text(json.dumps(res, indent=2) + "\n")
    plot(res, out / "sandbox.png")
    print(f"wrote {out / 'sandbox.json'} and {out / 'sandbox.png'}")


if __name__ == "__main__":
    main()
