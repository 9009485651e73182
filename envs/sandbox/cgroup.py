"""Per-sandbox pids cgroups: the process limit that holds for root (RLIMIT_NPROC does not).

Supports cgroup v1 (a ``pids`` hierarchy, e.g. ``/sys/fs/cgroup/pids``) and cgroup v2 (a unified hierarchy with
the ``pids`` controller). :meth:`PidsCgroup.create` returns ``None`` when the machine does not allow it (not root,
read-only cgroupfs, v2 without a delegable ``pids`` controller); callers then run without the limit and say so.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from pathlib import Path

_CGROUP_ROOT = Path("/sys/fs/cgroup")


def _own_cgroup_paths() -> dict[str, str]:
    """Map controller name (or ``""`` for the v2 unified entry) to this process's cgroup path."""
    paths: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for name in controllers.split(",") if controllers else [""]:
                paths[name] = path
    return paths


def _parent_dir() -> tuple[Path, str] | None:
    """The directory under which to create pids cgroups and the cgroup version ("v1" or "v2")."""
    own = _own_cgroup_paths()
    v1 = _CGROUP_ROOT / "pids"
    if "pids" in own and (v1 / "cgroup.procs").exists():
        return v1 / own["pids"].lstrip("/"), "v1"
    if (_CGROUP_ROOT / "cgroup.controllers").exists() and "" in own:
        parent = _CGROUP_ROOT / own[""].lstrip("/")
        control = parent / "cgroup.subtree_control"
        with contextlib.suppress(OSError):
            if "pids" not in control.read_text().split():
                control.write_text("+pids")
            return parent, "v2"
    return None


class PidsCgroup:
    """One pids cgroup directory: a process limit, a membership file, and a way to kill every member."""

    def __init__(self, path: Path, version: str) -> None:
        self.path = path
        self.version = version

    @property
    def procs_file(self) -> str:
        """The file a process writes its pid to in order to join."""
        return str(self.path / "cgroup.procs")

    @classmethod
    def create(cls, max_pids: int, prefix: str = "agentflow-sbx-") -> PidsCgroup | None:
        """Create a fresh pids cgroup with ``pids.max = max_pids``, or return None where the machine forbids it."""
        where = _parent_dir()
        if where is None:
            return None
        parent, version = where
        return cls._make(parent / f"{prefix}{uuid.uuid4().hex[:12]}", version, max_pids)

    @classmethod
    def _make(cls, path: Path, version: str, max_pids: int | None) -> PidsCgroup | None:
        try:
            path.mkdir()
        except OSError:
            return None
        group = cls(path, version)
        try:
            if version == "v2":
                with contextlib.suppress(OSError):
                    (path / "cgroup.subtree_control").write_text("+pids")
            if max_pids is not None:
                group.set_max(max_pids)
        except OSError:
            group.remove()
            return None
        return group

    def child(self, name: str) -> PidsCgroup | None:
        """A sub-cgroup (counted against this one's limit), e.g. one per exec so it can be killed precisely."""
        return PidsCgroup._make(self.path / name, self.version, None)

    def set_max(self, max_pids: int) -> None:
        """Set the maximum number of processes and threads of the group (hierarchical)."""
        (self.path / "pids.max").write_text(str(max_pids))

    def pids(self) -> list[int]:
        """Pids currently in this group (not in its children)."""
        try:
            return [int(x) for x in (self.path / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            return []

    def kill_all(self, timeout: float = 2.0) -> bool:
        """SIGKILL every process in the group and its children until it is empty; True when empty."""
        kill_file = self.path / "cgroup.kill"
        deadline = time.monotonic() + timeout
        while True:
            members = self._all_pids()
            if not members:
                return True
            if self.version == "v2" and kill_file.exists():
                with contextlib.suppress(OSError):
                    kill_file.write_text("1")
            for pid in members:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)

    def _all_pids(self) -> list[int]:
        found = self.pids()
        for sub in self._children():
            found.extend(PidsCgroup(sub, self.version)._all_pids())
        return found

    def _children(self) -> list[Path]:
        try:
            return [p for p in self.path.iterdir() if p.is_dir()]
        except OSError:
            return []

    def remove(self) -> None:
        """Kill the members and remove the directory (children first). Safe to call twice."""
        self.kill_all()
        for sub in self._children():
            PidsCgroup(sub, self.version).remove()
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.01)  # zombies still being reaped
