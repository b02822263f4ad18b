"""Giving a warm container (started over its template's layers, never used) the root of a restore: a
helper process of its own (``python -I -S warmroot.py``, started through ``fnreset.NsResetters``), one
JSON request a line on stdin, one answer a line on stdout.

Why: a restore (a fork's child) stacks the snapshot's layers over the template's. A cold container for
it costs a scratch disk, runc and the agent's start; a warm one of the template has all of that done
already, and only its root is wrong. The helper

* makes the new overlay (the restore's lowers, a fresh upper and work dir on the container's scratch
  disk) as a detached mount in the host's mount namespace (``fsopen``/``fsmount``: the lower paths are
  host paths, and nothing is ever mounted on the host, so a helper that dies leaves no mount);
* enters the container's mount namespace, attaches the new root under ``/.dsec/run`` (the container's
  own bind of its host run dir), moves every other mount of the old root (``/proc``, ``/dev``, ``/sys``,
  the agent's binary, each with what is mounted under it) into the new root, binds ``/.dsec/run`` (not
  recursively: the new root sits under it), and ``pivot_root``\\ s: every process of the namespace whose
  root or working directory was the old root (the agent, alone in the container) now has the new one;
* detaches the old root from the container's namespace; the caller removes what its upper held;
* makes the profile's read-only binds of the image's directories (``rebind``: /usr, /etc, ...) again,
  over the new root's own, as runc made them at the start (a recursive bind of the path onto itself,
  then read-only, resolved in the new root). The old ones (binds of the old root: mounts of its file
  system) are not moved: they would show the template's directories, not the restore's.

Nothing of the old root stays reachable in the container: its only process is its agent, which served
nothing (it answers nothing but its confine before it is claimed; a container running anything else is
refused), and the old root is gone from its namespace (containerd's own mount of it on the host goes
when the container is removed). Why a process of its own: ``setns(CLONE_NEWNS)`` is refused to a
multi-threaded process. The agent applies its Landlock rules after this, when the caller sends its
confine (the rules bind to the inodes of the root they are resolved in).
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

CLONE_NEWNS = 0x00020000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC = 1, 2, 4, 8, 0x20, 0x1000, 0x2000, 0x4000
MNT_DETACH = 2
ENOENT = 2
SYS_PIVOT_ROOT, SYS_MOVE_MOUNT, SYS_FSOPEN, SYS_FSCONFIG, SYS_FSMOUNT = 155, 429, 430, 431, 432  # x86_64
FSCONFIG_SET_STRING, FSCONFIG_CMD_CREATE = 1, 6
FSOPEN_CLOEXEC = FSMOUNT_CLOEXEC = 1
MOVE_MOUNT_F_EMPTY_PATH = 0x4
AT_FDCWD = -100
HELPER = Path(__file__)
RUN = "/.dsec/run"
STAGE_NAME = ".newroot"
STAGE = f"{RUN}/{STAGE_NAME}"  # where the new root is attached in the container before the pivot
WARM_OLD = ".warm-old"  # in the scratch dir: the old root's upper and work dir, removed after the swap
CGROUPS = "/sys/fs/cgroup"  # (v1)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _check(rc: int, what: str) -> int:
    if rc < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
    return rc


def _sys(nr: int, *args: Any, what: str) -> int:
    return _check(_libc.syscall(ctypes.c_long(nr), *args), what)


def _mount(src: str, target: str, flags: int) -> None:
    _check(_libc.mount(src.encode(), target.encode(), None, ctypes.c_ulong(flags), None), f"mount {src} on {target}")


def overlay(lowers: list[str], upper: str, work: str) -> int:
    """A detached overlay mount (its fd): made in the caller's mount namespace, attached nowhere."""
    fs = _sys(SYS_FSOPEN, b"overlay", ctypes.c_uint(FSOPEN_CLOEXEC), what="fsopen overlay")
    try:
        # One lower per "lowerdir+" (a string parameter holds at most 256 bytes), top-most first.
        for key, value in [("source", "overlay"), *(("lowerdir+", p) for p in lowers), ("upperdir", upper), ("workdir", work), ("index", "off")]:
            _sys(SYS_FSCONFIG, ctypes.c_int(fs), ctypes.c_uint(FSCONFIG_SET_STRING), key.encode(), value.encode(), ctypes.c_int(0),
                 what=f"overlay {key}={value}")
        _sys(SYS_FSCONFIG, ctypes.c_int(fs), ctypes.c_uint(FSCONFIG_CMD_CREATE), None, None, ctypes.c_int(0), what="overlay create")
        return _sys(SYS_FSMOUNT, ctypes.c_int(fs), ctypes.c_uint(FSMOUNT_CLOEXEC), ctypes.c_uint(0), what="fsmount overlay")
    finally:
        os.close(fs)


def top_mounts(pid: int) -> list[tuple[str, bool, bool]]:
    """The mounts right under the process's root (mount point, whether it is a directory, and whether
    it is of the root's own file system: a bind of one of its directories), in the order they were
    made; read through the host's /proc."""
    with open(f"/proc/{pid}/mountinfo") as f:
        rows = [ln.split() for ln in f.read().splitlines() if ln]
    root = next(r for r in rows if r[4] == "/")
    out = []
    for r in rows:
        if r[1] == root[0] and r[4] != "/":
            mp = r[4].encode().decode("unicode_escape")  # mountinfo escapes spaces and the like as \040
            out.append((mp, os.path.isdir(f"/proc/{pid}/root{mp}"), r[2] == root[2]))
    return out


def resolved(pid: int, path: str) -> str:
    """``path`` in the process's root with its symbolic links followed (where runc's bind of it landed:
    /bin -> usr/bin in a merged-/usr image); a few links at most."""
    for _ in range(8):
        full = f"/proc/{pid}/root{path}"
        if not os.path.islink(full):
            break
        target = os.readlink(full)
        path = os.path.normpath(target if target.startswith("/") else os.path.join(os.path.dirname(path), target))
    return path


def old_binds(pid: int, mounts: list[tuple[str, bool, bool]], rebind: list[str]) -> set[str]:
    """The top mounts that are binds of the old root's directories, each one of ``rebind`` (made again in
    the new root); ValueError for one that is not (it would be lost, not remade)."""
    binds = {mp for mp, _, own in mounts if own}
    expected = {p for r in rebind for p in (r, resolved(pid, r))}
    stray = sorted(binds - expected)
    if stray:
        raise ValueError(f"the container has binds of its old root the profile does not name: {', '.join(stray)}")
    return binds


def readonly_bind(path: str) -> None:
    """runc's read-only path, in the caller's root: a recursive bind of ``path`` onto itself, remounted
    read-only with its nosuid/nodev/noexec kept; a path the root lacks is skipped (as runc does)."""
    if _libc.mount(path.encode(), path.encode(), None, ctypes.c_ulong(MS_BIND | MS_REC), None) < 0:
        e = ctypes.get_errno()
        if e == ENOENT:
            return
        raise OSError(e, f"bind {path}: {os.strerror(e)}")
    keep = os.statvfs(path).f_flag & (MS_NOSUID | MS_NODEV | MS_NOEXEC)  # ST_* flags are the MS_* values
    _mount(path, path, MS_BIND | MS_REMOUNT | MS_RDONLY | keep)


def fresh_upper(layout: Any, old: str) -> None:
    """Host side, before the swap: the container's (``RootfsLayout``) upper and work dir set aside in
    ``old``, empty ones made in their place, and the stage the new root is attached at."""
    os.mkdir(old, 0o700)
    os.rename(layout.upper, os.path.join(old, "upper"))
    os.rename(layout.work, os.path.join(old, "work"))
    layout.create()
    os.mkdir(os.path.join(layout.run, STAGE_NAME), 0o700)


def _ensure(path: str, is_dir: bool) -> None:
    """A mount point in the new root (in its upper, as runc makes one in a cold container's). The new
    root holds what the forked sandbox wrote: a symbolic link on the way is refused (a mount moved
    through one would land elsewhere)."""
    if os.path.islink(path):
        raise ValueError(f"mount point {path[len(STAGE):]!r} of the restore's root is a symbolic link")
    if os.path.lexists(path):
        return
    _ensure(os.path.dirname(path), True)
    if is_dir:
        os.mkdir(path, 0o755)
    else:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644))


def swap_root(mfd: int, mounts: list[tuple[str, bool]], rebind: list[str] | None = None) -> None:
    """In the container's mount namespace: ``mfd`` becomes its root, with the old root's mounts
    (``mounts``: those to move) and the read-only binds ``rebind`` made again in it."""
    _sys(SYS_MOVE_MOUNT, ctypes.c_int(mfd), b"", ctypes.c_int(AT_FDCWD), STAGE.encode(), ctypes.c_uint(MOVE_MOUNT_F_EMPTY_PATH),
         what="attach the new root")
    for mp, is_dir in mounts:
        target = STAGE + mp
        for up in range(mp.count("/") - 1, 0, -1):  # its parents first (``_ensure`` checks only what it creates)
            _ensure(STAGE + mp.rsplit("/", up)[0], True)
        _ensure(target, is_dir)
        # /.dsec/run holds the new root itself: bound without what is under it; every other mount
        # moves with its own submounts (/proc's masked and read-only paths, /dev/pts, ...).
        _mount(mp, target, MS_BIND if mp == RUN else MS_MOVE)
    os.chdir(STAGE)
    _sys(SYS_PIVOT_ROOT, b".", b".", what="pivot_root")  # the old root now sits on top of the new one ...
    _check(_libc.umount2(b".", ctypes.c_int(MNT_DETACH)), "detach the old root")  # ... and goes
    os.chdir("/")
    for path in rebind or []:  # resolved in the new root (this process's root now), as runc resolves them in its
        readonly_bind(path)


def _procs(cgroup: str) -> set[int]:
    with open(f"{CGROUPS}/freezer/{cgroup.strip('/')}/cgroup.procs") as f:
        return {int(x) for x in f.read().split()}


def serve(inp: Any, out: Any) -> None:
    host_mnt = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    host_ino = os.fstat(host_mnt).st_ino
    for line in inp:
        answer: dict[str, Any]
        fds: list[int] = []
        try:
            req = json.loads(line)
            t0 = time.perf_counter()
            pid, cgroup = int(req["pid"]), str(req["cgroup"])
            if not re.fullmatch(r"/?[A-Za-z0-9_.-]+(/[A-Za-z0-9_-][A-Za-z0-9_.-]*)*", cgroup) or ".." in cgroup.split("/"):
                raise ValueError(f"bad cgroup {cgroup!r}")
            lowers, upper, work = [str(p) for p in req["lowers"]], str(req["upper"]), str(req["work"])
            if any(not p.startswith("/") or "\0" in p or ":" in p or "," in p for p in [*lowers, upper, work]):
                raise ValueError("bad overlay paths")
            rebind = [str(p) for p in req.get("rebind", [])]
            if any(not p.startswith("/") or "\0" in p or os.path.normpath(p) != p or p == "/" or p.split("/")[1] in ("proc", "sys", "dev", ".dsec")
                   for p in rebind):
                raise ValueError("bad read-only paths")
            fds.append(os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC))
            # A pid reused by a process outside the container has another cgroup, or the host's namespace.
            procs = _procs(cgroup)
            if pid not in procs or os.fstat(fds[0]).st_ino == host_ino:
                raise ValueError(f"pid {pid} is not the container's")
            if procs != {pid}:  # a process but the agent would carry the old state into the restore
                raise ValueError(f"the container runs {len(procs) - 1} process(es) besides its agent")
            mounts = top_mounts(pid)
            binds = old_binds(pid, mounts, rebind)
            moves = [(mp, is_dir) for mp, is_dir, _ in mounts if mp not in binds]
            fds.append(overlay(lowers, upper, work))
            _check(_libc.setns(fds[0], CLONE_NEWNS), "setns")
            try:
                swap_root(fds[1], moves, rebind)
            finally:
                _check(_libc.setns(host_mnt, CLONE_NEWNS), "setns")
            answer = {"ok": True, "mounts": [m for m, _ in moves], "rebound": rebind, "ms": (time.perf_counter() - t0) * 1000}
        except Exception as exc:  # noqa: BLE001 - the caller removes the container and starts a cold one
            answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            for fd in fds:
                os.close(fd)
        out.write(json.dumps(answer) + "\n")
        out.flush()


if __name__ == "__main__":
    serve(sys.stdin, sys.stdout)
