"""Runs the escape attempts of ``sandbox_attacks`` from an unprivileged host user: inside a bwrap sandbox and outside.

The security tests start it as ``nobody`` (``setpriv``) with the system ``python3``, from a copy of the sandbox
package that ``nobody`` can read; it needs nothing outside the standard library but ``pyseccomp``. Argument: the
attempts' arguments as JSON, without ``secret`` and ``helper_pid`` (this script starts the helper itself, so that it
belongs to the same user). Prints ``{"inside": ..., "outside": ..., "enforced": ..., "left": N}``, ``left`` being
the processes of the sandbox still alive after ``close()``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sandbox_attacks import PROGRAM  # noqa: E402

from envs.sandbox import BwrapSandbox, Limits  # noqa: E402


def _with_token(token: str) -> int:
    needle = f"AF_SEC_TOKEN={token}".encode()
    n = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    n += needle in f.read().split(b"\0")
            except OSError:
                continue
    return n


def main() -> None:
    args = json.loads(sys.argv[1])
    args["secret"] = uuid.uuid4().hex
    helper = subprocess.Popen(["sleep", "120"], env={"AF_PROBE_SECRET": args["secret"]})
    argv = ["python3", "-I", "-c", PROGRAM, json.dumps({**args, "helper_pid": helper.pid})]
    token = uuid.uuid4().hex
    try:
        outside = json.loads(subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd="/tmp").stdout)
        box = BwrapSandbox(limits=Limits(memory_mb=512, max_procs=64), env={"AF_SEC_TOKEN": token})
        r = box.exec(argv, timeout=30)
        inside = json.loads(r.stdout) if r.stdout.strip() else {"error": r.stderr}
        enforced = dict(box.enforced)
        box.exec("setsid sleep 1000 & sleep 0.2")
        box.close()
        time.sleep(0.5)
    finally:
        helper.kill()
    print(json.dumps({"inside": inside, "outside": outside, "enforced": enforced, "left": _with_token(token)}))


if __name__ == "__main__":
    main()
