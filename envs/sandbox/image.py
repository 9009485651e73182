"""The local docker image of the ``docker`` sandbox, made offline from the host's own Debian packages.

No image registry is reachable on our machines, so the image is a ``docker import`` of a small root filesystem
assembled from files the host already has: the files of a few installed Debian packages (``dash``, ``bash``,
``coreutils``, ``grep``, ``sed``, ``findutils``, ``procps``, the Python 3 interpreter and its standard library), the
shared libraries they link (found with one ``ldd`` call), ``setsid``, and an ``/etc/passwd`` with a non-root
``sandbox`` user (uid 1000) that owns ``/work``. Measured here: ~2 s to build and import, ~45 MB; ``debootstrap``
of the same took ~32 s and needs the Debian mirror. The image is built once per engine and found by its tag.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Iterable
from typing import Any

from envs.errors import SandboxError

IMAGE_TAG = "agentflow-sandbox:local"
SANDBOX_UID = 1000
SANDBOX_WORKDIR = "/work"
ROOTFS_PACKAGES = (
    "dash",
    "bash",
    "coreutils",
    "grep",
    "sed",
    "findutils",
    "procps",
    "python3-minimal",
    "python3.11-minimal",
    "libpython3.11-minimal",
    "libpython3.11-stdlib",
)
EXTRA_FILES = ("/usr/bin/setsid", "/etc/ld.so.cache")
_SKIP = re.compile(r"^/usr/share/(doc|man|info|locale|lintian|bash-completion|doc-base|menu)/")
_PASSWD = (
    "root:x:0:0:root:/root:/bin/sh\nsandbox:x:1000:1000:sandbox:/work:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n"
)
_GROUP = "root:x:0:\nsandbox:x:1000:\nnogroup:x:65534:\n"
_IMAGE_CHANGES = [
    f"USER {SANDBOX_UID}:{SANDBOX_UID}",
    f"WORKDIR {SANDBOX_WORKDIR}",
    "ENV PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8 PYTHONDONTWRITEBYTECODE=1",
    'CMD ["/bin/sh"]',
]


def _package_files(packages: Iterable[str]) -> list[str]:
    """Regular files and symlinks installed by ``packages`` (docs and manuals left out)."""
    try:
        out = subprocess.run(["dpkg", "-L", *packages], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise SandboxError(f"cannot list the files of Debian packages {list(packages)}: {e}") from e
    files = []
    for line in out.splitlines():
        if not line.startswith("/") or _SKIP.match(line) or os.path.isdir(line):  # dirs, and links to dirs
            continue
        if os.path.islink(line) or os.path.isfile(line):
            files.append(line)
    return files


def _is_elf(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def _shared_libraries(files: Iterable[str]) -> set[str]:
    """The shared libraries (and the dynamic loader) that the ELF files among ``files`` need."""
    elves = [f for f in files if not os.path.islink(f) and _is_elf(f)]
    if not elves:
        return set()
    out = subprocess.run(["ldd", *elves], capture_output=True, text=True).stdout
    libs = set()
    for m in re.finditer(r"(?:=>\s*)?(/\S+)\s+\(0x", out):
        libs.add(m.group(1))
    return libs


def _canonical(path: str) -> str:
    """``path`` with its directory part resolved (merged-/usr: ``/bin/sh`` -> ``/usr/bin/sh``), the name kept."""
    return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))


def rootfs_files(packages: Iterable[str] = ROOTFS_PACKAGES, extra: Iterable[str] = EXTRA_FILES) -> list[str]:
    """Every host path the root filesystem holds: package files, extra files and their shared libraries."""
    files = {_canonical(f) for f in [*_package_files(packages), *(e for e in extra if os.path.lexists(e))]}
    for _ in range(3):  # libraries of libraries; the closure is reached after one or two rounds
        new = {_canonical(lib) for lib in _shared_libraries(files)} - files
        for lib in list(new):
            real = os.path.realpath(lib)
            if real != lib:
                new.add(real)
        if not new:
            break
        files |= new
    return sorted(files)


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    tar.addfile(info, io.BytesIO(data))


def _add_dir(tar: tarfile.TarFile, name: str, mode: int = 0o755, uid: int = 0) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.uid, info.gid = tarfile.DIRTYPE, mode, uid, uid
    tar.addfile(info)


def write_rootfs(dest: str, files: list[str] | None = None) -> int:
    """Write the root filesystem tarball to ``dest``; returns the number of host files in it."""
    files = rootfs_files() if files is None else files
    dirs = {os.path.dirname(f) for f in files}
    for d in list(dirs):
        while d not in ("/", ""):
            dirs.add(d)
            d = os.path.dirname(d)
    with tarfile.open(dest, "w") as tar:
        for d in sorted(dirs):
            _add_dir(tar, d.lstrip("/"))
        for top in ("bin", "sbin", "lib", "lib64"):  # merged-/usr links, as on the host
            if os.path.islink(f"/{top}"):
                info = tarfile.TarInfo(top)
                info.type, info.linkname = tarfile.SYMTYPE, os.readlink(f"/{top}")
                tar.addfile(info)
        for path in files:
            info = tar.gettarinfo(path, arcname=path.lstrip("/"))
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            info.mode &= 0o777  # no setuid/setgid bits in the sandbox
            if info.isreg():
                with open(path, "rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
        for name, mode in (("tmp", 0o1777), ("proc", 0o555), ("sys", 0o555), ("dev", 0o755), ("root", 0o700)):
            _add_dir(tar, name, mode)
        _add_dir(tar, SANDBOX_WORKDIR.lstrip("/"), 0o755, SANDBOX_UID)
        _add_bytes(tar, "etc/passwd", _PASSWD.encode())
        _add_bytes(tar, "etc/group", _GROUP.encode())
    return len(files)


def ensure_image(client: Any, tag: str = IMAGE_TAG) -> str:
    """Return ``tag``, building and importing the local sandbox image into the engine first when it lacks it."""
    import docker.errors

    try:
        client.images.get(tag)
        return tag
    except docker.errors.ImageNotFound:
        pass
    if shutil.which("dpkg") is None or shutil.which("ldd") is None:
        raise SandboxError(f"image {tag!r} is missing and cannot be built here (needs a Debian host: dpkg, ldd)")
    repo, _, version = tag.rpartition(":")
    with tempfile.TemporaryDirectory(prefix="agentflow-rootfs-") as tmp:
        path = os.path.join(tmp, "rootfs.tar")
        write_rootfs(path)
        client.api.import_image(src=path, repository=repo, tag=version, changes=_IMAGE_CHANGES)
    client.images.get(tag)
    return tag
