"""The filesystem and IPC side of resetting a reused fn pool member, run as a helper process of
its own (``python -I -S nsreset.py``, started by ``fnreset``): one JSON request a line on stdin, one
answer a line on stdout.

Why a process of its own: entering a container's mount namespace (``setns(CLONE_NEWNS)``) is refused
to a multi-threaded process, and the host agent has threads. The helper is single-threaded, imports
nothing heavy (it starts once per host), and goes back to the host's namespaces after every request.

What one request does, in this order (the member serves nothing meanwhile):

* every process of the member's cgroup but its agent (PID 1) killed: the cgroup is frozen first, so
  nothing forks while the list is read (a fork bomb, a daemon that double-forked into a session of
  its own: a process cannot leave its cgroup), then thawed, and the helper waits until only the
  agent is left;

then, in the member's mount and IPC namespaces:

* every writable path of the member's profile (``/tmp``, ``/workspace``, ``/dev/shm``, ...) is
  emptied and refilled from a copy of its template content taken before the member's first call
  (kept on a tmpfs at ``/.dsec/fn``); the directory itself gets its mode, owner, extended attributes
  and times back. The profile's Landlock makes every other path read-only, so these are the only
  places a call can leave files. The work goes through the member's own mounts (its overlay, the
  ``/dev/shm`` tmpfs), never behind an overlay's back, and the directories stay the very inodes the
  member's Landlock rules were given (a fresh mount on top would hide them: Landlock ignores rules on
  a covered mount point);
* SysV shared memory, semaphores and message queues, and POSIX message queues, are removed;

and last the cgroup's memory high-water marks and fail counts and its CPU time go back to zero (the
OOM kill count cannot: the answer carries it, the caller keeps it as a baseline).

No binary of the member's is ever run (a call may have replaced any file it could write), and no
path a call could have changed is followed: every step below the writable directories works on
file descriptors, without following symbolic links.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import signal
import stat
import sys
import time
from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x2, 0x4, 0x8
IPC_RMID = 0
ROOT = "/.dsec/fn"  # a tmpfs in the member's mount namespace: the template content of its writable paths
MQ = f"{ROOT}/mq"  # and an mqueue mount
CGROUPS = "/sys/fs/cgroup"  # (v1)
KILL_TIMEOUT_S = 10.0

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _mount(src: str, target: str, fstype: str, flags: int, data: str) -> None:
    _check(_libc.mount(src.encode(), target.encode(), fstype.encode(), ctypes.c_ulong(flags), data.encode()), f"mount {fstype} on {target}")


def _setns(fd: int, kind: int) -> None:
    _check(_libc.setns(fd, kind), "setns")


def _ipc_ids(name: str) -> list[int]:
    """The ids in /proc/sysvipc/<name> (of the IPC namespace we are in)."""
    try:
        with open(f"/proc/sysvipc/{name}") as f:
            lines = f.read().splitlines()[1:]
    except FileNotFoundError:
        return []
    return [int(ln.split()[1]) for ln in lines if ln.strip()]


def _clear_ipc() -> int:
    n = 0
    for i in _ipc_ids("shm"):
        n += _libc.shmctl(i, IPC_RMID, None) == 0
    for i in _ipc_ids("sem"):
        n += _libc.semctl(i, 0, IPC_RMID) == 0
    for i in _ipc_ids("msg"):
        n += _libc.msgctl(i, IPC_RMID, None) == 0
    # POSIX message queues: through the mqueue mount of our own made at the first reset (it shows the
    # IPC namespace it was made in, the member's)
    mq = _open_dir(MQ)
    try:
        for name in os.listdir(mq):
            os.unlink(name, dir_fd=mq)
            n += 1
    finally:
        os.close(mq)
    return n


def _cgroup_file(hierarchy: str, cgroup: str, name: str) -> str:
    return f"{CGROUPS}/{hierarchy}/{cgroup.strip('/')}/{name}"


def _procs(cgroup: str) -> set[int]:
    return {int(x) for x in _read(_cgroup_file("freezer", cgroup, "cgroup.procs")).split()}


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, value: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(value)
    except FileNotFoundError:
        pass  # (a counter this kernel does not keep)


def _until(what: str, done: Any, timeout_s: float = KILL_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    delay = 0.0002
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout_s:g}s")
        time.sleep(delay)  # poll: cgroup v1 notifies no one of either
        delay = min(delay * 2, 0.02)


def kill_others(cgroup: str, keep: int) -> int:
    """Every process of ``cgroup`` but ``keep`` killed; how many, once only ``keep`` is left."""
    if not _procs(cgroup) - {keep}:
        return 0  # the common case (the call's command ended, nothing left behind): no freeze
    state = _cgroup_file("freezer", cgroup, "freezer.state")
    _write(state, "FROZEN")
    try:
        _until("the freeze", lambda: _read(state).strip() == "FROZEN")
        others = _procs(cgroup) - {keep}
        for pid in others:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    finally:
        _write(state, "THAWED")
    _until("every process but the agent gone", lambda: not _procs(cgroup) - {keep})
    return len(others)


def reset_counters(cgroup: str) -> int:
    """The memory high-water marks and fail counts and the CPU time back to zero; the OOM kill count."""
    for name in ("memory.max_usage_in_bytes", "memory.memsw.max_usage_in_bytes", "memory.failcnt", "memory.memsw.failcnt",
                 "memory.kmem.max_usage_in_bytes", "memory.kmem.failcnt"):
        _write(_cgroup_file("memory", cgroup, name), "0")
    _write(_cgroup_file("cpuacct", cgroup, "cpuacct.usage"), "0")
    for ln in _read(_cgroup_file("memory", cgroup, "memory.oom_control")).splitlines():
        key, _, n = ln.partition(" ")
        if key == "oom_kill":
            return int(n)
    return 0


def _open_dir(path: str, dir_fd: int | None = None) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)


def _attrs(name: str, st: os.stat_result, dir_fd: int) -> None:
    os.chown(name, st.st_uid, st.st_gid, dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISLNK(st.st_mode):
        os.chmod(name, stat.S_IMODE(st.st_mode), dir_fd=dir_fd)
    os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=dir_fd, follow_symlinks=False)


def _copy(src_fd: int, dst_fd: int) -> None:
    """The tree under ``src_fd`` into the (empty) directory ``dst_fd``: directories, regular files
    and symbolic links, with their modes, owners and times (nothing else is template content)."""
    for name in os.listdir(src_fd):
        st = os.stat(name, dir_fd=src_fd, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(name, dir_fd=src_fd), name, dir_fd=dst_fd)
        elif stat.S_ISDIR(st.st_mode):
            os.mkdir(name, 0o700, dir_fd=dst_fd)
            s, d = _open_dir(name, src_fd), _open_dir(name, dst_fd)
            try:
                _copy(s, d)
            finally:
                os.close(s)
                os.close(d)
        elif stat.S_ISREG(st.st_mode):
            s = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=src_fd)
            d = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dst_fd)
            try:
                while os.sendfile(d, s, None, 1 << 20):
                    pass
            finally:
                os.close(s)
                os.close(d)
        else:
            continue
        _attrs(name, st, dst_fd)


def _clear(fd: int) -> int:
    """Everything under the directory ``fd`` removed (without following links); how many entries."""
    names = os.listdir(fd)
    for name in names:
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(name, dir_fd=fd)
        else:
            os.unlink(name, dir_fd=fd)
    return len(names)


def _restore_dir(fd: int, snap: int) -> None:
    """The directory's own mode, owner, extended attributes and times, as in ``snap``."""
    st = os.fstat(snap)
    os.fchown(fd, st.st_uid, st.st_gid)
    os.fchmod(fd, stat.S_IMODE(st.st_mode))
    keep = set(os.listxattr(snap))
    for x in os.listxattr(fd):
        if x not in keep:
            os.removexattr(fd, x)
    for x in keep:
        os.setxattr(fd, x, os.getxattr(snap, x))
    os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))


def reset(paths: list[str], size_mb: int, first: bool) -> tuple[list[str], int]:
    """In the member's namespaces: ``paths`` back to their template content (the first time: that
    content copied aside), IPC objects gone. The paths covered (the first time, those that are
    directories: a path that is not there cannot be made, its parent being read-only) and the number
    of entries and IPC objects removed."""
    removed = 0
    if first:
        paths = [p for p in paths if os.path.isdir(p) and not os.path.islink(p)]
        os.makedirs(ROOT, 0o700, exist_ok=True)
        _mount("tmpfs", ROOT, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, f"size={size_mb}m,mode=0700")
        os.mkdir(MQ, 0o700)
        _mount("mqueue", MQ, "mqueue", MS_NOSUID | MS_NODEV | MS_NOEXEC, "")
    for i, p in enumerate(paths):
        fd = _open_dir(p)
        try:
            if first:
                os.mkdir(f"{ROOT}/{i}", 0o700)
                snap = _open_dir(f"{ROOT}/{i}")
                try:
                    _copy(fd, snap)
                    _restore_dir(snap, fd)
                finally:
                    os.close(snap)
                continue
            snap = _open_dir(f"{ROOT}/{i}")
            try:
                removed += _clear(fd)
                _copy(snap, fd)
                _restore_dir(fd, snap)
            finally:
                os.close(snap)
        finally:
            os.close(fd)
    return paths, removed + _clear_ipc()


def serve(inp: Any, out: Any) -> None:
    host_mnt = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    host_ipc = os.open("/proc/self/ns/ipc", os.O_RDONLY | os.O_CLOEXEC)
    host_ino = os.fstat(host_mnt).st_ino
    for line in inp:
        answer: dict[str, Any]
        fds: list[int] = []
        try:
            req = json.loads(line)
            paths = [os.path.normpath(p) for p in req["paths"]]
            if any(not p.startswith("/") or p == "/" or "\0" in p for p in paths):
                raise ValueError(f"bad paths {paths!r}")
            cgroup = str(req["cgroup"])
            if not re.fullmatch(r"/?[A-Za-z0-9_.-]+(/[A-Za-z0-9_-][A-Za-z0-9_.-]*)*", cgroup) or ".." in cgroup.split("/"):
                raise ValueError(f"bad cgroup {cgroup!r}")
            t0 = time.perf_counter()
            pid = int(req["pid"])
            killed = 0 if req["first"] else kill_others(cgroup, pid)
            fds = [os.open(f"/proc/{pid}/ns/{ns}", os.O_RDONLY | os.O_CLOEXEC) for ns in ("mnt", "ipc")]
            ino = os.fstat(fds[0]).st_ino
            # A pid reused by a process outside the member would have other namespaces: the host's
            # own, or another's. Never reset those.
            if ino == host_ino or ino != int(req["mnt_ino"]):
                raise ValueError(f"pid {pid} is not in the member's mount namespace")
            _setns(fds[0], CLONE_NEWNS)
            try:
                _setns(fds[1], CLONE_NEWIPC)
                done, removed = reset(paths, int(req["size_mb"]), bool(req["first"]))
            finally:
                _setns(host_mnt, CLONE_NEWNS)
                _setns(host_ipc, CLONE_NEWIPC)
            oom = reset_counters(cgroup)
            answer = {"ok": True, "paths": done, "killed": killed, "removed": removed, "oom_kills": oom, "ms": (time.perf_counter() - t0) * 1000}
        except Exception as exc:  # noqa: BLE001 - the host agent retires the member and hears why
            answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            for fd in fds:
                os.close(fd)
        out.write(json.dumps(answer) + "\n")
        out.flush()


if __name__ == "__main__":
    serve(sys.stdin, sys.stdout)
