"""The fallback sandbox: plain host processes with rlimits, for machines without bubblewrap.

It is NOT an isolation boundary: commands see and can write the host filesystem (they start in a private temp
workdir), and the network, the host's loopback services included, is reachable. What it does give: memory, CPU and
file-size rlimits, a pids cgroup where the machine allows (``pids_limit_enforced``), a timeout that kills the whole
process group (and the exec's cgroup, catching ``setsid`` grandchildren), and cleanup on close. Use it for trusted
code and tests only; use :class:`envs.sandbox.bwrap.BwrapSandbox` for model-written code.
"""

from __future__ import annotations

from envs.sandbox.local import LocalSandbox


class ProcessSandbox(LocalSandbox):
    """Host processes in a temp workdir with rlimits (no filesystem or network isolation; see the module doc)."""

    kind = "process"
