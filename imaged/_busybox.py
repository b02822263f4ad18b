"""A tiny root filesystem built from the host's static busybox (Debian `busybox-static`).

`build_busybox_rootfs(dest)` produces a directory with /bin/busybox, a symlink for every applet
(`busybox --list-full`), a few /etc files, and the usual empty mount-point dirs. The result is
deterministic (fixed modes, mtimes = 0) so it packs reproducibly into an image, and the build is
idempotent and atomic: it is assembled in a temp dir next to `dest` and renamed into place; an
existing `dest` built from the same busybox binary by the same builder version is left as is.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile

__all__ = ["build_busybox_rootfs", "BUSYBOX_PATH"]

BUSYBOX_PATH = "/bin/busybox"
_BUILDER_VERSION = "1"
_STAMP = "etc/.dsec-busybox-stamp"
_MTIME = 0

_FILES: dict[str, tuple[str, int]] = {
    "etc/passwd": (
        "root:x:0:0:root:/root:/bin/sh\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
        0o644,
    ),
    "etc/group": ("root:x:0:\nnogroup:x:65534:\n", 0o644),
    "etc/shadow": ("root:*:0:0:99999:7:::\nnobody:*:0:0:99999:7:::\n", 0o640),
    "etc/hostname": ("sandbox\n", 0o644),
    "etc/hosts": ("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n", 0o644),
    "etc/resolv.conf": ("", 0o644),
    "etc/profile": (
        'export PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"\n', 0o644
    ),
}

# dir -> mode (created in this order)
_DIRS: dict[str, int] = {
    "bin": 0o755,
    "sbin": 0o755,
    "usr": 0o755,
    "usr/bin": 0o755,
    "usr/sbin": 0o755,
    "usr/local": 0o755,
    "usr/local/bin": 0o755,
    "etc": 0o755,
    "root": 0o700,
    "home": 0o755,
    "tmp": 0o1777,
    "var": 0o755,
    "var/tmp": 0o1777,
    "run": 0o755,
    "proc": 0o555,
    "sys": 0o555,
    "dev": 0o755,
    "workspace": 0o755,
    ".dsec": 0o755,
    ".dsec/bin": 0o755,
    ".dsec/run": 0o755,
}


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _stamp_text(busybox: str) -> str:
    return f"builder={_BUILDER_VERSION}\nbusybox_sha256={_sha256(busybox)}\n"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _applets(busybox: str) -> list[str]:
    out = subprocess.run(
        [busybox, "--list-full"], check=True, capture_output=True, text=True
    ).stdout
    names = set()
    for line in out.splitlines():
        rel = line.strip().lstrip("/")
        # Entries without a directory (e.g. "linuxrc") have no place in a container root.
        if "/" not in rel or rel == "bin/busybox" or ".." in rel.split("/"):
            continue
        names.add(rel)
    return sorted(names)


def _build(root: str, busybox: str, stamp: str) -> None:
    for d, mode in _DIRS.items():
        p = os.path.join(root, d)
        os.makedirs(p, exist_ok=True)
        os.chmod(p, mode)
    shutil.copyfile(busybox, os.path.join(root, "bin/busybox"))
    os.chmod(os.path.join(root, "bin/busybox"), 0o755)
    for rel in _applets(busybox):
        link = os.path.join(root, rel)
        parent = os.path.dirname(link)
        if not os.path.isdir(parent):
            os.makedirs(parent, mode=0o755, exist_ok=True)
            os.chmod(parent, 0o755)
        if not os.path.lexists(link):
            os.symlink("/bin/busybox", link)
    for rel, (content, mode) in _FILES.items():
        p = os.path.join(root, rel)
        with open(p, "w") as f:
            f.write(content)
        os.chmod(p, mode)
    with open(os.path.join(root, _STAMP), "w") as f:
        f.write(stamp)
    os.chmod(os.path.join(root, _STAMP), 0o644)
    # Fixed ownership (when we can) and timestamps, deepest first so dir mtimes stick.
    is_root = os.geteuid() == 0
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames + dirnames:
            p = os.path.join(dirpath, name)
            if is_root:
                os.lchown(p, 0, 0)
            os.utime(p, (_MTIME, _MTIME), follow_symlinks=False)
    if is_root:
        os.lchown(root, 0, 0)
    os.chmod(root, 0o755)
    os.utime(root, (_MTIME, _MTIME))


def build_busybox_rootfs(dest: str, busybox: str = BUSYBOX_PATH) -> None:
    """Build (or confirm) a busybox rootfs directory at `dest`."""
    dest = os.path.abspath(dest)
    if not os.path.isfile(busybox):
        raise FileNotFoundError(f"static busybox not found at {busybox} (apt install busybox-static)")
    stamp = _stamp_text(busybox)
    if _read(os.path.join(dest, _STAMP)) == stamp:
        return
    parent = os.path.dirname(dest)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dest)}.tmp-", dir=parent)
    old: str | None = None
    try:
        _build(tmp, busybox, stamp)
        if os.path.lexists(dest):
            # Stale or foreign content: swap it out atomically, then delete it.
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(dest)}.old-", dir=parent)
            os.rmdir(old)
            try:
                os.rename(dest, old)
            except FileNotFoundError:
                old = None
        try:
            os.rename(tmp, dest)
        except OSError:
            # A concurrent builder won the race; accept its result if it is ours.
            if _read(os.path.join(dest, _STAMP)) != stamp:
                raise
    finally:
        if os.path.lexists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
