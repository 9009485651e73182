"""bwrap exec latency of this checkout against an older commit's sandbox, side by side on the same machine.

Each round starts one process per side (the older one imports ``envs`` from ``git archive REV envs``), makes a
bwrap sandbox, and times ``n`` calls of ``exec(["true"])``; the sides alternate round by round and the result is
each side's median and the median of the per-round ratios (new / old), which holds under a shared machine's load.

    .venv/bin/python benchmarks/sandbox_ab.py --against REV     # prints the JSON
    .venv/bin/python benchmarks/sandbox.py --against REV        # the same, in sandbox.json as "side_by_side"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
_TIMER = """
import json, sys, time
from envs.sandbox import make_sandbox
with make_sandbox("bwrap") as sb:
    sb.exec(["true"])
    times, failed = [], []
    for _ in range(int(sys.argv[1])):
        t = time.perf_counter()
        r = sb.exec(["true"])
        times.append(time.perf_counter() - t)
        if not r.ok:
            failed.append(f"{r.exit_code}: {r.stderr[-200:]}")
print(json.dumps({"times": times, "failed": failed}))
"""


def _export(rev: str, dest: str) -> None:
    """The ``envs`` package of ``rev`` under ``dest``."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "envs"], capture_output=True, check=True)
    with tempfile.TemporaryFile() as f:
        f.write(archive.stdout)
        f.seek(0)
        with tarfile.open(fileobj=f) as tar:
            tar.extractall(dest, filter="data")


def _times(path: str, n: int, failed: list[str]) -> list[float]:
    """``n`` exec times under ``path``'s sandbox; the failed execs' codes and errors are added to ``failed``."""
    env = {**os.environ, "PYTHONPATH": path}
    out = subprocess.run([sys.executable, "-c", _TIMER, str(n)], capture_output=True, text=True, env=env, cwd=path)
    if out.returncode != 0:
        raise RuntimeError(f"the timer failed under {path}: {out.stderr[-2000:]}")
    got = json.loads(out.stdout)
    failed.extend(got["failed"])
    return [float(t) for t in got["times"]]


def side_by_side(rev: str, rounds: int = 6, n: int = 40) -> dict[str, Any]:
    """Exec p50 (ms) of ``rev``'s sandbox and of this checkout's, alternating, with the median per-round ratio."""
    with tempfile.TemporaryDirectory(prefix="af-sbx-ab-") as old:
        _export(rev, old)
        per_round, old_all, new_all = [], [], []
        old_failed: list[str] = []
        new_failed: list[str] = []
        for _ in range(rounds):
            a, b = _times(old, n, old_failed), _times(str(REPO), n, new_failed)
            old_all += a
            new_all += b
            per_round.append(statistics.median(b) / statistics.median(a))
    return {
        "against": rev,
        "rounds": rounds,
        "execs_per_round": n,
        "old_p50_ms": round(statistics.median(old_all) * 1000, 2),
        "new_p50_ms": round(statistics.median(new_all) * 1000, 2),
        "old_min_ms": round(min(old_all) * 1000, 2),
        "new_min_ms": round(min(new_all) * 1000, 2),
        "ratio_median": round(statistics.median(per_round), 3),
        "old_failed": old_failed[:5],
        "new_failed": new_failed[:5],
        "load_1m": round(os.getloadavg()[0], 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--against", required=True, help="the older commit (e.g. the one before the hardening)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("-n", type=int, default=40, help="execs per side and round")
    args = ap.parse_args()
    print(json.dumps(side_by_side(args.against, args.rounds, args.n), indent=2))


if __name__ == "__main__":
    main()
