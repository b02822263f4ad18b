"""A read-only FUSE server that speaks the kernel protocol on ``/dev/fuse`` itself, on asyncio.

Why not libfuse (pyfuse3): a FUSE connection lives as long as *some* process holds its ``/dev/fuse``
file, and a restarted daemon can only continue a live connection if it can serve requests without a
second ``FUSE_INIT`` (the kernel sends that once, at mount). libfuse rejects every request that
arrives before an INIT, so it cannot take over; this module can. Together with a holder process
that keeps a copy of the file (``FuseMount``) and ``FUSE_NOTIFY_RESEND`` (Linux 6.9+, which puts
the requests a dead daemon had read but not answered back in the queue), a daemon can be killed at
any point and its successor finishes every read in flight: EROFS mounts on the FUSE files, and the
sandboxes on them, never notice.

Only what a file system of immutable files needs is implemented; everything that would write gets
``EROFS``, everything else ``ENOSYS`` (so the kernel stops asking).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import errno
import fcntl
import json
import logging
import os
import select
import signal
import stat
import struct
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("dsec.imaged.fuse")

ROOT_INODE = 1

# opcodes (include/uapi/linux/fuse.h)
LOOKUP, FORGET, GETATTR, SETATTR, READLINK = 1, 2, 3, 4, 5
OPEN, READ, WRITE, STATFS, RELEASE = 14, 15, 16, 17, 18
GETXATTR, LISTXATTR, FLUSH, INIT, OPENDIR, READDIR, RELEASEDIR = 22, 23, 25, 26, 27, 28, 29
ACCESS, CREATE, INTERRUPT, DESTROY, BATCH_FORGET = 34, 35, 36, 38, 42
_WRITES = {SETATTR, 6, 8, 9, 10, 11, 12, 13, WRITE, 20, 21, 24, 30, 32, 33, CREATE, 43, 45, 47, 51}

NOTIFY_RESEND = 7
FOPEN_KEEP_CACHE = 1 << 1
FOPEN_NOFLUSH = 1 << 5
FUSE_ASYNC_READ = 1 << 0
FUSE_PARALLEL_DIROPS = 1 << 18
FUSE_MAX_PAGES = 1 << 22

_IN_HDR = struct.Struct("<IIQQIIIHH")  # len opcode unique nodeid uid gid pid total_extlen padding
_OUT_HDR = struct.Struct("<IiQ")  # len error unique
_ATTR = struct.Struct("<QQQQQQIIIIIIIIII")
_ENTRY_HEAD = struct.Struct("<QQQQII")  # nodeid generation entry_valid attr_valid *_nsec
_ATTR_OUT_HEAD = struct.Struct("<QII")
_READ_IN = struct.Struct("<QQII")  # fh offset size read_flags (rest unused)
_OPEN_OUT = struct.Struct("<QIi")
_KSTATFS = struct.Struct("<QQQQQIIII24x")
_DIRENT = struct.Struct("<QQII")
_INIT_IN = struct.Struct("<IIII")
_INIT_OUT = struct.Struct("<IIIIHHIIHHI28x")  # ... max_pages map_alignment flags2, padded to 64 bytes

_MINOR = 31  # enough for max_pages (28); nothing newer is needed by a read-only file system
_MAX_PAGES = 256  # 1 MiB reads: fewer round trips for EROFS' readahead
_BUF = (_MAX_PAGES + 2) * 4096  # must hold the largest request the kernel may send (a WRITE we refuse)


class FuseError(Exception):
    """Raised by an operation: the request is answered with ``-errno``."""

    def __init__(self, err: int) -> None:
        super().__init__(os.strerror(err))
        self.errno = err


@dataclass(frozen=True, slots=True)
class Attr:
    ino: int
    size: int
    is_dir: bool = False
    mtime_ns: int = 0


class Operations(Protocol):
    """What the file system provides; every method may raise ``FuseError``."""

    async def lookup(self, parent: int, name: bytes) -> Attr: ...
    async def getattr(self, ino: int) -> Attr: ...
    async def open(self, ino: int, flags: int) -> int: ...
    async def read(self, fh: int, offset: int, size: int) -> bytes: ...
    def readdir(self, ino: int) -> list[tuple[bytes, Attr]]: ...
    def statfs(self) -> tuple[int, int]: ...  # (total bytes, files)


def _attr_bytes(a: Attr) -> bytes:
    mode = (stat.S_IFDIR | 0o555) if a.is_dir else (stat.S_IFREG | 0o444)
    s, ns = divmod(a.mtime_ns, 1_000_000_000)
    return _ATTR.pack(
        a.ino, a.size, (a.size + 511) // 512, s, s, s, ns, ns, ns, mode, 2 if a.is_dir else 1, 0, 0, 0, 4096, 0
    )


class Session:
    """Serves one FUSE connection from ``fd`` until it is unmounted or ``stop()`` is called.

    ``initialized`` says the connection already went through INIT with an earlier daemon (a
    takeover): requests are served at once, and the ones that daemon left unanswered are resent.
    """

    def __init__(self, fd: int, ops: Operations, *, initialized: bool = False, ttl_s: float = 3600.0) -> None:
        self.fd = fd
        self.ops = ops
        self.initialized = initialized
        self.ttl_s = ttl_s
        self._tasks: set[asyncio.Task[None]] = set()
        self._done: asyncio.Future[str] | None = None
        self.requests = 0

    async def serve(self) -> str:
        """Run until unmounted (``"unmounted"``) or stopped (``"stopped"``); in-flight work is finished."""
        loop = asyncio.get_running_loop()
        self._done = loop.create_future()
        os.set_blocking(self.fd, False)
        loop.add_reader(self.fd, self._readable)
        if self.initialized:
            self._notify(NOTIFY_RESEND)
        try:
            return await self._done
        finally:
            loop.remove_reader(self.fd)

    def stop(self) -> None:
        """Stop reading new requests (what the kernel queues waits for the next daemon)."""
        if self._done is not None and not self._done.done():
            self._done.set_result("stopped")

    async def drain(self, timeout_s: float) -> int:
        """Let requests already read finish (bounded); returns how many were still running."""
        pending = [t for t in self._tasks if not t.done()]
        if pending:
            _, still = await asyncio.wait(pending, timeout=timeout_s)
            return len(still)
        return 0

    # --- the wire ---------------------------------------------------------------------------------
    def _notify(self, code: int) -> None:
        try:
            os.write(self.fd, _OUT_HDR.pack(_OUT_HDR.size, code, 0))
        except OSError as exc:
            log.warning("fuse notify %d failed: %s", code, exc)

    def _reply(self, unique: int, payload: bytes = b"", err: int = 0) -> None:
        hdr = _OUT_HDR.pack(_OUT_HDR.size + (0 if err else len(payload)), -err, unique)
        try:
            os.write(self.fd, hdr if err else hdr + payload)
        except OSError as exc:
            # ENOENT: the request was interrupted or aborted meanwhile; nobody waits for the answer
            if exc.errno != errno.ENOENT:
                log.warning("fuse reply failed: %s", exc)

    def _readable(self) -> None:
        for _ in range(64):  # bounded, so a request storm cannot starve the rest of the loop
            try:
                buf = os.read(self.fd, _BUF)
            except BlockingIOError:
                return
            except InterruptedError:
                continue
            except OSError as exc:
                if exc.errno == errno.ENOENT:  # the request was interrupted before we got it
                    continue
                if exc.errno == errno.ENODEV:  # unmounted (or the connection aborted)
                    if self._done is not None and not self._done.done():
                        self._done.set_result("unmounted")
                    return
                raise
            self.requests += 1
            self._dispatch(buf)

    def _dispatch(self, buf: bytes) -> None:
        _, opcode, unique, nodeid, *_ = _IN_HDR.unpack_from(buf)
        body = memoryview(buf)[_IN_HDR.size :]
        if opcode in (FORGET, BATCH_FORGET):
            return  # inode numbers are derived from digests: nothing to forget
        if opcode == INIT:
            self._init(unique, bytes(body))
            return
        if opcode == INTERRUPT:
            self._reply(unique, err=errno.ENOSYS)  # reads finish quickly; stop sending interrupts
            return
        if opcode in _WRITES:
            self._reply(unique, err=errno.EROFS)
            return
        handler = self._handlers.get(opcode)
        if handler is None:
            self._reply(unique, err=errno.ENOSYS)
            return
        t = asyncio.get_running_loop().create_task(self._run(handler, unique, nodeid, bytes(body)))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _run(self, handler: Callable[[Session, int, bytes], Awaitable[bytes]], unique: int, nodeid: int, body: bytes) -> None:
        try:
            self._reply(unique, await handler(self, nodeid, body))
        except FuseError as exc:
            self._reply(unique, err=exc.errno)
        except Exception as exc:  # noqa: BLE001 - one bad request never takes the daemon down
            log.exception("fuse request failed: %s", exc)
            self._reply(unique, err=errno.EIO)

    def _init(self, unique: int, body: bytes) -> None:
        major, minor, max_readahead, flags = _INIT_IN.unpack_from(body)
        if major != 7:
            self._reply(unique, err=errno.EPROTO)
            return
        want = flags & (FUSE_ASYNC_READ | FUSE_PARALLEL_DIROPS | FUSE_MAX_PAGES)
        self._reply(
            unique,
            _INIT_OUT.pack(7, min(minor, _MINOR), max_readahead, want, 64, 48, 4096, 1, _MAX_PAGES, 0, 0),
        )
        self.initialized = True

    # --- operations -----------------------------------------------------------------------------
    def _entry(self, a: Attr) -> bytes:
        s, ns = divmod(int(self.ttl_s * 1e9), 1_000_000_000)
        return _ENTRY_HEAD.pack(a.ino, 0, s, s, ns, ns) + _attr_bytes(a)

    async def _lookup(self, nodeid: int, body: bytes) -> bytes:
        return self._entry(await self.ops.lookup(nodeid, body.split(b"\0", 1)[0]))

    async def _getattr(self, nodeid: int, body: bytes) -> bytes:
        a = await self.ops.getattr(nodeid)
        s, ns = divmod(int(self.ttl_s * 1e9), 1_000_000_000)
        return _ATTR_OUT_HEAD.pack(s, ns, 0) + _attr_bytes(a)

    async def _open(self, nodeid: int, body: bytes) -> bytes:
        (flags,) = struct.unpack_from("<I", body)
        fh = await self.ops.open(nodeid, flags)
        return _OPEN_OUT.pack(fh, FOPEN_KEEP_CACHE | FOPEN_NOFLUSH, 0)

    async def _read(self, nodeid: int, body: bytes) -> bytes:
        fh, offset, size, _ = _READ_IN.unpack_from(body)
        return await self.ops.read(fh, offset, size)

    async def _empty(self, nodeid: int, body: bytes) -> bytes:
        return b""

    async def _opendir(self, nodeid: int, body: bytes) -> bytes:
        if nodeid != ROOT_INODE:
            raise FuseError(errno.ENOTDIR)
        return _OPEN_OUT.pack(0, 0, 0)

    async def _readdir(self, nodeid: int, body: bytes) -> bytes:
        _, offset, size, _ = _READ_IN.unpack_from(body)
        root = Attr(ROOT_INODE, 0, is_dir=True)
        entries = [(b".", root), (b"..", root), *self.ops.readdir(nodeid)]
        out = bytearray()
        for i in range(offset, len(entries)):
            name, a = entries[i]
            rec = _DIRENT.pack(a.ino, i + 1, len(name), 4 if a.is_dir else 8) + name
            rec += b"\0" * (-len(rec) % 8)
            if len(out) + len(rec) > size:
                break
            out += rec
        return bytes(out)

    async def _statfs(self, nodeid: int, body: bytes) -> bytes:
        total, files = self.ops.statfs()
        blocks = (total + 4095) // 4096
        return _KSTATFS.pack(blocks, 0, 0, files, 0, 4096, 255, 4096, 0)

    async def _access(self, nodeid: int, body: bytes) -> bytes:
        (mask,) = struct.unpack_from("<I", body)
        if mask & os.W_OK:
            raise FuseError(errno.EACCES)
        return b""

    async def _nodata(self, nodeid: int, body: bytes) -> bytes:
        raise FuseError(errno.ENOSYS)

    _handlers: dict[int, Callable[[Session, int, bytes], Awaitable[bytes]]] = {
        LOOKUP: _lookup,
        GETATTR: _getattr,
        OPEN: _open,
        READ: _read,
        RELEASE: _empty,
        FLUSH: _empty,
        OPENDIR: _opendir,
        READDIR: _readdir,
        RELEASEDIR: _empty,
        STATFS: _statfs,
        ACCESS: _access,
        DESTROY: _empty,
        GETXATTR: _nodata,
        LISTXATTR: _nodata,
    }


# --- the mount and its holder ------------------------------------------------------------------
_libc: Any = None
MS_RDONLY, MS_NOSUID, MS_NODEV = 1, 2, 4
MNT_DETACH = 2
_SYS_PIDFD_GETFD = 438  # the same number on every architecture (generic syscall table)


def _c() -> Any:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return _libc


def umount2(path: str, flags: int = 0) -> int:
    """umount2(2) straight from libc (no stat() that a dead FUSE would hang); 0 or an errno."""
    if _c().umount2(os.fsencode(path), flags) != 0:
        return ctypes.get_errno()
    return 0


def _mountinfo_at(path: str) -> list[tuple[str, str]]:
    """(major:minor, fs type) of every mount exactly at ``path``; never stat()s it, which a FUSE
    mount without a daemon would hang."""
    real = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(path))), os.path.basename(path))
    out = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 4 and parts[4].encode().decode("unicode_escape") == real:
                    out.append((parts[2], parts[parts.index("-") + 1]))
    except OSError:
        pass
    return out


def mounts_at(path: str) -> list[str]:
    """File system types mounted exactly at ``path`` (from /proc/self/mountinfo)."""
    return [kind for _, kind in _mountinfo_at(path)]


def _fuse_dev_at(path: str) -> str | None:
    devs = [dev for dev, kind in _mountinfo_at(path) if kind.startswith("fuse")]
    return devs[-1] if devs else None


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


def _connection_alive(fd: int) -> bool:
    p = select.poll()
    p.register(fd, 0)  # no events asked: only POLLERR (connection aborted) can come back
    return not any(ev & (select.POLLERR | select.POLLNVAL) for _, ev in p.poll(0))


class FuseMount:
    """A FUSE mount at ``mountpoint`` whose ``/dev/fuse`` file is also held by a tiny holder process,
    so the connection (and everything mounted on its files) outlives the daemon.

    ``state_path`` records the holder (pid, start time, fd number) and the mount's device number;
    the next daemon takes the file back with ``pidfd_getfd(2)``.
    """

    def __init__(self, mountpoint: str, state_path: str | os.PathLike[str], *, fsname: str = "dsec-lazy", subtype: str = "dsec") -> None:
        self.mountpoint = os.path.abspath(mountpoint)
        self.state_path = Path(state_path)
        self.fsname = fsname
        self.subtype = subtype
        self.fd = -1
        self.taken_over = False
        self.holder_pid = 0
        self._holder: subprocess.Popen[bytes] | None = None

    # --- start ------------------------------------------------------------------------------------
    def open(self) -> int:
        """Take over the live connection a previous daemon left, else mount afresh; returns the fd."""
        fd = self._take_over()
        if fd is not None:
            self.fd, self.taken_over = fd, True
            return fd
        self._clear_stale()
        self.fd = self._mount()
        self._spawn_holder()
        return self.fd

    def _read_state(self) -> dict[str, Any]:
        try:
            d = json.loads(self.state_path.read_text())
            return d if isinstance(d, dict) else {}
        except (OSError, ValueError):
            return {}

    def _take_over(self) -> int | None:
        st = self._read_state()
        pid, fdno = int(st.get("holder_pid") or 0), int(st.get("fd", -1))
        if not pid:
            return None
        alive = _start_time(pid) == st.get("holder_start")
        usable = alive and st.get("mount") == self.mountpoint and _fuse_dev_at(self.mountpoint) == st.get("dev")
        fd = None
        if usable:
            try:
                pidfd = os.pidfd_open(pid)
                try:
                    got = _c().syscall(_SYS_PIDFD_GETFD, pidfd, fdno, 0)
                    if got < 0:
                        raise OSError(ctypes.get_errno(), "pidfd_getfd")
                    fd = int(got)
                finally:
                    os.close(pidfd)
            except OSError as exc:
                log.warning("cannot take the FUSE connection from holder %d: %s", pid, exc)
            if fd is not None and not _connection_alive(fd):
                os.close(fd)
                fd = None
        if fd is None:
            if alive:
                self._kill(pid)
            return None
        self.holder_pid = pid
        log.info("took over the live FUSE connection at %s (holder pid %d)", self.mountpoint, pid)
        return fd

    def _clear_stale(self) -> None:
        for _ in range(8):
            kinds = mounts_at(self.mountpoint)
            if not kinds:
                return
            if not any(k.startswith("fuse") for k in kinds):
                raise RuntimeError(f"{self.mountpoint} has a non-FUSE mount ({kinds}); refusing to mount over it")
            log.warning("detaching a stale FUSE mount at %s", self.mountpoint)
            umount2(self.mountpoint, MNT_DETACH)

    def _mount(self) -> int:
        os.makedirs(self.mountpoint, exist_ok=True)
        fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        data = f"fd={fd},rootmode={stat.S_IFDIR:o},user_id=0,group_id=0,allow_other"
        rc = _c().mount(
            self.fsname.encode(), os.fsencode(self.mountpoint), f"fuse.{self.subtype}".encode(),
            MS_RDONLY | MS_NOSUID | MS_NODEV, data.encode(),
        )
        if rc != 0:
            err = ctypes.get_errno()
            os.close(fd)
            raise OSError(err, f"mount fuse at {self.mountpoint}: {os.strerror(err)}")
        return fd

    def _spawn_holder(self) -> None:
        # The holder only keeps the file open; `sleep` is the smallest process that does nothing.
        # Its own session: a Ctrl-C meant for the daemon's terminal does not reach it.
        self._holder = subprocess.Popen(
            [f"dsec-fuse-holder:{self.mountpoint}", "infinity"],
            executable="/bin/sleep",
            pass_fds=(self.fd,),
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.holder_pid = self._holder.pid
        start = _start_time(self.holder_pid)  # Popen returns after the exec: the process exists
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({
            "mount": self.mountpoint, "dev": _fuse_dev_at(self.mountpoint),
            "holder_pid": self.holder_pid, "holder_start": start, "fd": self.fd,
        }))
        os.replace(tmp, self.state_path)

    # --- stop -----------------------------------------------------------------------------------
    def close(self) -> str:
        """Unmount unless something still uses the file system (then keep the holder, so the next
        daemon takes over); returns ``"unmounted"`` or ``"kept"``."""
        err = umount2(self.mountpoint)
        if err in (0, errno.EINVAL, errno.ENOENT):
            self._kill(self.holder_pid)
            self.state_path.unlink(missing_ok=True)
            outcome = "unmounted"
        else:
            log.warning("%s is still in use (%s): keeping the connection for the next daemon", self.mountpoint, os.strerror(err))
            outcome = "kept"
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        return outcome

    def _kill(self, pid: int) -> None:
        if not pid:
            return
        if self._holder is not None and self._holder.pid == pid:
            self._holder.kill()
            self._holder.wait(10)
            self._holder = None
            return
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def holder_of(state_path: str | os.PathLike[str]) -> int:
    """The live holder's pid recorded in ``state_path`` (0 when none): for clean-up by tests and tools."""
    try:
        st = json.loads(Path(state_path).read_text())
        pid = int(st.get("holder_pid") or 0)
    except (OSError, ValueError, AttributeError, TypeError):
        return 0
    return pid if pid and _start_time(pid) == st.get("holder_start") else 0


def lock_exclusive(path: str | os.PathLike[str]) -> int:
    """Hold an exclusive lock on ``path`` for the life of the process: two daemons reading one FUSE
    connection would split its requests. Raises ``BlockingIOError`` when another daemon holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise
    return fd
