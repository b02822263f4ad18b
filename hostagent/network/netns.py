"""Named network namespaces: the libc calls (unshare, setns, bind mounts) the manager's worker
thread uses to make a netns and pin it at a path, and to let it go again."""

from __future__ import annotations

import ctypes
import errno
import os

import structlog

log = structlog.get_logger("dsec.hostagent.network")

__all__ = ["mountpoint", "bind_mount", "umount", "unshare_net", "setns_net"]

_CLONE_NEWNET = 0x40000000
_MS_BIND = 4096
_MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)


def mountpoint(path: str) -> None:
    """The empty file a netns is bind-mounted on; a leftover mount there (of a crashed create) goes first."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0)
    except FileExistsError:
        umount(path)
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0)
    os.close(fd)


def bind_mount(src: str, path: str) -> None:
    if _libc.mount(src.encode(), path.encode(), None, _MS_BIND, None) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"bind-mount netns at {path}: {os.strerror(e)}")


def umount(path: str) -> None:
    """Detach the netns mount at ``path`` (if any) and remove the file; the kernel destroys the
    netns once nothing else holds it."""
    if _libc.umount2(path.encode(), _MNT_DETACH) != 0:
        e = ctypes.get_errno()
        if e not in (errno.EINVAL, errno.ENOENT):
            log.warning("netns_umount_failed", path=path, error=os.strerror(e))
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def unshare_net() -> None:
    """Move the calling thread into a new, empty netns."""
    if _libc.unshare(_CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), f"unshare(CLONE_NEWNET): {os.strerror(ctypes.get_errno())}")


def setns_net(fd: int) -> int:
    """Move the calling thread into the netns ``fd``; 0, or the errno."""
    return 0 if _libc.setns(fd, _CLONE_NEWNET) == 0 else ctypes.get_errno()
