"""Per-sandbox cgroups: a process limit that holds for root (RLIMIT_NPROC does not) and one memory cap for all of
a sandbox's processes together.

Supports cgroup v1 (separate ``pids`` and ``memory`` hierarchies, e.g. ``/sys/fs/cgroup/pids`` and
``/sys/fs/cgroup/memory``) and cgroup v2 (one unified hierarchy with the ``pids`` and ``memory`` controllers).
:meth:`SandboxCgroup.create` returns ``None`` when the machine allows neither controller (not root, read-only
cgroupfs, v2 without delegable controllers); callers then run without those limits and say so. Each controller is
used independently: a machine with a pids hierarchy but no memory one still gets the process limit
(:attr:`SandboxCgroup.has_memory` tells).

The memory cap is ``memory.max`` (v2) or ``memory.limit_in_bytes`` (v1, and ``memory.memsw.limit_in_bytes`` where
swap is accounted). When it is hit the kernel's OOM killer ends a process of the sandbox; :meth:`events` counts
those kills and the times the process limit refused a fork.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from pathlib import Path

_CGROUP_ROOT = Path("/sys/fs/cgroup")
_MB = 1024 * 1024


def _own_cgroup_paths(pid: str = "self") -> dict[str, str]:
    """Map controller name (or ``""`` for the v2 unified entry) to the cgroup path of ``pid`` (default: this one)."""
    paths: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for name in controllers.split(",") if controllers else [""]:
                paths[name] = path
    return paths


def _v2_parent(own: dict[str, str]) -> Path | None:
    """The v2 cgroup under which to create sandboxes, with ``pids`` and ``memory`` enabled for its children."""
    if not (_CGROUP_ROOT / "cgroup.controllers").exists() or "" not in own:
        return None
    parent = _CGROUP_ROOT / own[""].lstrip("/")
    control = parent / "cgroup.subtree_control"
    try:
        enabled = control.read_text().split()
        for name in ("pids", "memory"):
            if name not in enabled:
                with contextlib.suppress(OSError):
                    control.write_text(f"+{name}")
        enabled = control.read_text().split()
    except OSError:
        return None
    return parent if "pids" in enabled else None


def _parent_dirs() -> dict[str, Path]:
    """Where to create sandbox cgroups: ``{"v2": dir}`` or ``{"pids": dir, "memory": dir}`` (v1; either optional)."""
    own = _own_cgroup_paths()
    found: dict[str, Path] = {}
    for name in ("pids", "memory"):
        v1 = _CGROUP_ROOT / name
        if name in own and (v1 / "cgroup.procs").exists():
            found[name] = v1 / own[name].lstrip("/")
    if found:
        return found
    v2 = _v2_parent(own)
    return {"v2": v2} if v2 is not None else {}


class _Dir:
    """One cgroup directory of one hierarchy."""

    def __init__(self, path: Path, version: str) -> None:
        self.path, self.version = path, version

    def write(self, name: str, value: str) -> None:
        (self.path / name).write_text(value)

    def read(self, name: str) -> str:
        try:
            return (self.path / name).read_text()
        except OSError:
            return ""

    def pids(self) -> list[int]:
        try:
            return [int(x) for x in (self.path / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            return []

    def children(self) -> list[_Dir]:
        try:
            return [_Dir(p, self.version) for p in self.path.iterdir() if p.is_dir()]
        except OSError:
            return []

    def all_pids(self) -> list[int]:
        found = self.pids()
        for sub in self.children():
            found.extend(sub.all_pids())
        return found

    def remove(self) -> None:
        for sub in self.children():
            sub.remove()
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.01)  # zombies still being reaped


def _make_dir(path: Path, version: str) -> _Dir | None:
    try:
        path.mkdir()
    except OSError:
        return None
    return _Dir(path, version)


def _counter(text: str, key: str) -> int:
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key and parts[1].isdigit():
            return int(parts[1])
    return 0


class SandboxCgroup:
    """A sandbox's cgroups: ``pids`` (a process limit) and ``memory`` (a cap on all its processes), and a kill-all.

    ``dirs`` maps ``"pids"`` and/or ``"memory"`` to the directory that holds that controller (the same directory
    for both under cgroup v2).
    """

    def __init__(self, dirs: dict[str, _Dir], owned: list[_Dir] | None = None) -> None:
        self.dirs = dirs
        self._owned = owned if owned is not None else list({id(d): d for d in dirs.values()}.values())
        self._memory_mb: int | None = None

    @property
    def version(self) -> str:
        return next(iter(self.dirs.values())).version

    @property
    def has_pids(self) -> bool:
        """True when a pids controller limits the processes of the sandbox."""
        return "pids" in self.dirs

    @property
    def has_memory(self) -> bool:
        """True when a memory controller caps all the processes of the sandbox together."""
        return "memory" in self.dirs

    @property
    def procs_files(self) -> list[str]:
        """The files a process writes ``0`` to in order to join (one per hierarchy)."""
        unique = {str(d.path / "cgroup.procs") for d in self.dirs.values()}
        return sorted(unique)

    @classmethod
    def create(
        cls, max_pids: int, memory_mb: int | None = None, prefix: str = "agentflow-sbx-"
    ) -> SandboxCgroup | None:
        """Fresh cgroups with ``pids.max = max_pids`` and the memory cap, or None where the machine forbids both."""
        name = f"{prefix}{uuid.uuid4().hex[:12]}"
        dirs: dict[str, _Dir] = {}
        for where, parent in _parent_dirs().items():
            made = _make_dir(parent / name, "v2" if where == "v2" else "v1")
            if made is None:
                continue
            if where == "v2":
                with contextlib.suppress(OSError):
                    made.write("cgroup.subtree_control", "+pids +memory")
                controllers = made.read("cgroup.controllers").split()
                dirs.update({c: made for c in ("pids", "memory") if c in controllers})
            else:
                dirs[where] = made
        group = cls(dirs)
        try:
            if group.has_pids:
                group.set_max(max_pids)
            if group.has_memory and memory_mb is not None:
                group.set_memory(memory_mb)
        except OSError:
            group.remove()
            return None
        if not group.has_pids:
            group.remove()
            return None
        return group

    @classmethod
    def of_process(cls, pid: int) -> SandboxCgroup | None:
        """A read-only view of the cgroups ``pid`` is in (e.g. a container's), for :meth:`events`; None if unseen."""
        own = _own_cgroup_paths(str(pid))
        dirs: dict[str, _Dir] = {}
        for name in ("pids", "memory"):
            v1 = _CGROUP_ROOT / name / own.get(name, "").lstrip("/")
            if name in own and (v1 / "cgroup.procs").exists():
                dirs[name] = _Dir(v1, "v1")
        unified = _CGROUP_ROOT / own.get("", "").lstrip("/")
        if not dirs and "" in own and (unified / "cgroup.procs").exists():
            controllers = _Dir(unified, "v2").read("cgroup.controllers").split()
            dirs = {c: _Dir(unified, "v2") for c in ("pids", "memory") if c in controllers}
        return cls(dirs, owned=[]) if dirs else None

    def child(self, name: str) -> SandboxCgroup | None:
        """A sub-cgroup for one exec (in the pids hierarchy; v2: both), counted against this one's limits."""
        made = _make_dir(self.dirs["pids"].path / name, self.version)
        if made is None:
            return None
        dirs = {"pids": made}
        if self.version == "v2" and self.has_memory:
            dirs["memory"] = made
        elif self.has_memory:
            dirs["memory"] = self.dirs["memory"]  # v1: the exec joins the sandbox's own memory cgroup
        return SandboxCgroup(dirs, owned=[made])

    def set_max(self, max_pids: int) -> None:
        """Set the maximum number of processes and threads of the group (hierarchical)."""
        self.dirs["pids"].write("pids.max", str(max_pids))

    def set_memory(self, memory_mb: int) -> None:
        """Cap the memory (and, v1 with swap accounting, memory + swap) of all the group's processes together."""
        if memory_mb == self._memory_mb or not self.has_memory:
            return
        d, value = self.dirs["memory"], str(memory_mb * _MB)
        if d.version == "v2":
            d.write("memory.max", value)
            with contextlib.suppress(OSError):
                d.write("memory.swap.max", "0")
        else:
            grow = self._memory_mb is None or memory_mb > self._memory_mb
            names = ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"]
            for name in reversed(names) if grow else names:  # memsw must stay >= the memory limit
                if (d.path / name).exists():
                    with contextlib.suppress(OSError):
                        d.write(name, value)
            if int(d.read("memory.limit_in_bytes") or 0) != memory_mb * _MB:
                raise OSError(f"could not set the memory limit of {d.path}")
        self._memory_mb = memory_mb

    def events(self) -> dict[str, int]:
        """Counters since creation: ``oom_kills`` (memory cap) and ``pids_refused`` (forks the process limit denied)."""
        out = {"oom_kills": 0, "pids_refused": 0}
        if self.has_memory:
            d = self.dirs["memory"]
            text = d.read("memory.events" if d.version == "v2" else "memory.oom_control")
            out["oom_kills"] = _counter(text, "oom_kill")
        if self.has_pids:
            out["pids_refused"] = _counter(self.dirs["pids"].read("pids.events"), "max")
        return out

    def pids(self) -> list[int]:
        """Pids currently in this group's pids cgroup (not in its children)."""
        return self.dirs["pids"].pids() if self.has_pids else []

    def kill_all(self, timeout: float = 2.0) -> bool:
        """SIGKILL every process in the group and its children until it is empty; True when empty."""
        d = self.dirs["pids"]
        deadline = time.monotonic() + timeout
        while True:
            members = d.all_pids()
            if not members:
                return True
            if d.version == "v2" and (d.path / "cgroup.kill").exists():
                with contextlib.suppress(OSError):
                    d.write("cgroup.kill", "1")
            for pid in members:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)

    def remove(self, kill: bool = True) -> None:
        """Kill the members and remove the directories this group made (children first). Safe to call twice.

        An exec's group under cgroup v1 removes only its pids directory: the memory cgroup is the sandbox's.
        """
        if kill and self.has_pids:
            self.kill_all()
        for d in self._owned:
            d.remove()
