"""Named network namespaces: the libc calls (unshare, setns, bind mounts) the manager's worker
thread uses to make a netns and pin it at a path, and to let it go again."""

from __future__ import annotations

import ctypes
import errno
import os

import structlog

log = structlog.get_logger("dsec.hostagent.network")

__all__ = ["mountpoint", "bind_mount", "umount", "unshare_net", "setns_net", "writable_proc_sys"]

_CLONE_NEWNET = 0x40000000
_MS_BIND = 4096
_MS_REMOUNT = 32
_ST_RDONLY = 1
_ST_KEPT = 2 | 4 | 8  # nosuid, nodev, noexec: statvfs and mount(2) share these bits
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


def writable_proc_sys(path: str = "/proc/sys") -> bool:
    """Make ``path`` writable where it is mounted read-only (a container engine's default: Docker's
    /proc/sys), so that a new netns's own sysctls (``ping_group_range``, ``disable_ipv6``: per
    namespace) can be set; True when it is writable. A bind remount changes this mount only: the
    host agent's own mount namespace, in a container; on a machine it is writable already."""
    flags = os.statvfs(path).f_flag
    if not flags & _ST_RDONLY:
        return True
    if _libc.mount(None, path.encode(), None, ctypes.c_ulong(_MS_REMOUNT | _MS_BIND | (flags & _ST_KEPT)), None) != 0:
        log.warning("proc_sys_read_only", path=path, error=os.strerror(ctypes.get_errno()),
                    note="sandbox networks cannot be set up (run the host agent with CAP_SYS_ADMIN)")
        return False
    log.info("proc_sys_remounted_writable", path=path)
    return True
