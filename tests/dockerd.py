"""The tests' private docker engine: one ``dockerd`` per test process, started on first use, stopped at exit.

Built on :class:`envs.sandbox.engine.PrivateDockerd` (own socket, data root and exec root; ``--iptables=false
--bridge=none``; stopped by its pid, and killed with the test process should that die). Images are built locally
by the sandbox (see ``envs.sandbox.image``): no registry is needed.
"""

from __future__ import annotations

import atexit
import threading

from conftest import require

from envs.sandbox.engine import PrivateDockerd, private_dockerd_available

_lock = threading.Lock()
_engine: PrivateDockerd | None = None


def engine() -> PrivateDockerd:
    """The test process's private engine, started on first use (a test that calls this needs docker)."""
    global _engine
    ok, what = private_dockerd_available()
    require(ok, what)
    with _lock:
        if _engine is None:
            eng = PrivateDockerd()
            eng.start()
            atexit.register(eng.stop)
            _engine = eng
        return _engine
