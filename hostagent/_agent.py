"""Host side of the in-sandbox agent: building its static binary and talking to it.

The wire protocol is documented at the top of ``agent/dsec-agent.c``. A call takes a connection
of its own (one request at a time on it), so one ``AgentClient`` can be shared by any number of
concurrent tasks; a connection that ended its request cleanly goes back to a small idle pool and
the next call reuses it (an agent of protocol 3 keeps it open), which spares the connect, accept
and peer check of every exec.
"""

from __future__ import annotations

import asyncio
import errno as _errno
import hashlib
import inspect
import math
import os
import posixpath
import shutil
import socket
import struct
import subprocess
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import cast

import msgspec

PROTOCOL_VERSION = 3
PROTOCOLS = (2, 3, 4)  # spoken with agents still running from before an upgrade; 3 keeps connections open; 4 trusted runs

AGENT_SOURCE = Path(__file__).with_name("agent") / "dsec-agent.c"

_READ_CHUNK = 4 << 20  # the agent caps one read at this
_WRITE_CHUNK = 4 << 20  # keeps each write frame under the agent's 8 MiB request limit
_MAX_REPLY = 256 << 20
_HEARTBEAT_S = 5.0  # the agent sends a frame at least this often during an exec
_EXEC_IDLE_S = 4 * _HEARTBEAT_S
_EXEC_GRACE_S = 30.0  # beyond the exec's own timeout, before we stop trusting the agent
_SUN_PATH_MAX = 107
_IDLE_MAX = 4  # idle connections kept per agent
_BUF_HIGH = 2 * (_READ_CHUNK + 4096)  # unread bytes at which a connection stops reading the socket

_KINDS = {0: "other", 1: "file", 2: "dir", 3: "symlink"}
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_ENTRY_TAIL = struct.Struct(">BQIq")  # kind, size, mode, mtime_ns

OnOutput = Callable[[int, bytes], Awaitable[None] | None]


class AgentError(Exception):
    """An operation failed inside the sandbox (``errno`` is a Linux errno, e.g. ENOENT)."""

    def __init__(self, errno: int, message: str) -> None:
        super().__init__(errno, message)
        self.errno = errno
        self.message = message

    def __str__(self) -> str:
        return f"[Errno {self.errno}] {self.message}"


class AgentUnavailable(AgentError):
    """The agent could not be reached, went away mid-call, or stopped answering."""


class AgentBuildError(RuntimeError):
    """The agent binary could not be built (no gcc, or the compile failed)."""


class ExecOutcome(msgspec.Struct):
    exit_code: int
    stdout: bytes  # at most ``cap`` bytes of it (the head) when a cap was given
    stderr: bytes
    timed_out: bool = False
    pid: int = 0
    signal: int = 0  # the signal that ended it (0: it exited)
    stdout_bytes: int = 0  # all the output, kept or not
    stderr_bytes: int = 0

    @property
    def stdout_truncated(self) -> bool:
        return self.stdout_bytes > len(self.stdout)

    @property
    def stderr_truncated(self) -> bool:
        return self.stderr_bytes > len(self.stderr)


class ProcEntry(msgspec.Struct):
    """A running command the agent started ('J')."""

    pid: int
    cmd: str
    cwd: str
    user: str
    background: bool
    stdin_open: bool
    attached: bool


# inotify masks of the watch frames ('F')
IN_MODIFY, IN_ATTRIB, IN_MOVED_FROM, IN_MOVED_TO = 0x2, 0x4, 0x40, 0x80
IN_CREATE, IN_DELETE, IN_DELETE_SELF, IN_MOVE_SELF = 0x100, 0x200, 0x400, 0x800
IN_Q_OVERFLOW, IN_ISDIR = 0x4000, 0x40000000


class AgentInfo(msgspec.Struct):
    """What a ping tells: the protocol and the confinement the agent applied to itself."""

    protocol: int
    landlock_abi: int = 0  # the kernel's Landlock ABI the agent used (0: Landlock not applied)
    landlock: bool = False  # filesystem rules enforced
    seccomp_log: bool = False  # the audited seccomp filter is installed
    audit_session: bool = False  # the sandbox has its own audit session id


class DirEntry(msgspec.Struct):
    name: str
    path: str
    type: str  # 'file' | 'dir' | 'symlink' | 'other'
    size: int
    mode: int  # permission bits only (0o7777)
    mtime: float
    uid: int = -1  # -1: not asked (the short listing), or an agent from before the long one
    gid: int = -1
    symlink_target: str = ""
    metadata: dict[str, str] = {}  # the user.e2b.<key> xattrs


def _parse_extra(body: bytes, pos: int, e: DirEntry) -> int:
    """The tail of a long entry ('l'/'s': owner, symlink target, metadata) into ``e``."""
    e.uid, e.gid, tlen = struct.unpack_from(">III", body, pos)
    pos += 12
    e.symlink_target = os.fsdecode(body[pos:pos + tlen])
    pos += tlen
    (n,) = _U32.unpack_from(body, pos)
    pos += 4
    meta = {}
    for _ in range(n):
        kv = []
        for _ in range(2):
            (ln,) = _U32.unpack_from(body, pos)
            kv.append(body[pos + 4:pos + 4 + ln].decode(errors="replace"))
            pos += 4 + ln
        meta[kv[0]] = kv[1]
    e.metadata = meta
    return pos


# ---------------------------------------------------------------------------------- build


def ensure_agent_binary(data_dir: str) -> str:
    """Path of the static agent binary for the current source, compiling it on first use.

    The binary lives alone in ``<data_dir>/bin/dsec-agent-<sha12>/`` so that directory can be
    bind-mounted read-only into sandboxes. The directory appears atomically (built under a temp
    name, then renamed), so concurrent callers never see a half-written binary.
    """
    source = AGENT_SOURCE.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:12]
    bin_root = Path(data_dir) / "bin"
    final_dir = bin_root / f"dsec-agent-{digest}"
    binary = final_dir / "dsec-agent"
    if os.access(binary, os.X_OK):
        return str(binary)
    gcc = shutil.which("gcc")
    if gcc is None:
        raise AgentBuildError(
            "gcc not found on PATH; it is needed to build the sandbox agent "
            "(install gcc and the static C library, e.g. apt-get install gcc libc6-dev)"
        )
    bin_root.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".dsec-agent-{digest}.", dir=bin_root))
    try:
        tmp_bin = tmp_dir / "dsec-agent"
        # Compile the exact bytes we hashed (from stdin), so name and contents can't disagree.
        proc = subprocess.run(
            [gcc, "-static", "-O2", "-Wall", "-x", "c", "-o", str(tmp_bin), "-"],
            input=source, capture_output=True,
        )
        if proc.returncode != 0 or not tmp_bin.exists():
            raise AgentBuildError(f"compiling dsec-agent failed:\n{proc.stderr.decode(errors='replace')}")
        os.chmod(tmp_bin, 0o755)
        os.chmod(tmp_dir, 0o755)
        try:
            os.rename(tmp_dir, final_dir)
        except OSError as e:
            if e.errno not in (_errno.EEXIST, _errno.ENOTEMPTY) or not os.access(binary, os.X_OK):
                raise
            # Another process finished the same build first; its copy is identical.
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return str(binary)


# ---------------------------------------------------------------------------------- wire


def peer_pid(sock: socket.socket) -> int:
    """Pid (in our pid namespace) of the process that created the listening end of ``sock``."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid: int = struct.unpack("3i", creds)[0]
    return pid


def _s(value: str | bytes) -> bytes:
    raw = value.encode("utf-8", "surrogateescape") if isinstance(value, str) else value  # os.fsencode, inline
    return _U32.pack(len(raw)) + raw


def _frame(kind: bytes, *parts: bytes | memoryview) -> bytes:
    body_len = 1 + sum(len(p) for p in parts)
    return b"".join((_U32.pack(body_len), kind, *parts))


class _Conn(asyncio.Protocol):
    """One connection to the agent: reply frames out of a buffer, no stream reader in between
    (the frames of a small exec arrive in one read and are taken without a wait each)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.eof = False
        self.error: BaseException | None = None
        self.idle = False  # in the pool: anything the agent sends now is unexpected
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a unix stream connection

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        # Whole frames piling up unread: a slow consumer of the output slows the agent, not our memory.
        if len(buf) > _BUF_HIGH and not self._paused and self.transport is not None and len(buf) >= 4 + _U32.unpack_from(buf)[0]:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self.error = exc
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    @property
    def reusable(self) -> bool:
        return not self.eof and not self.buf and self.transport is not None and not self.transport.is_closing()

    def write(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    async def hang_up(self, timeout_s: float) -> None:
        """Tell the agent we are done and wait until it has closed its end (its EOF reaches us)."""
        if self.transport is not None and not self.eof and not self.transport.is_closing():
            self.transport.write_eof()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            while not self.eof and loop.time() < deadline:
                self._waiter = loop.create_future()
                try:
                    await asyncio.wait_for(self._waiter, deadline - loop.time())
                except TimeoutError:
                    break
                finally:
                    self._waiter = None
        self.close()

    def buffered(self) -> tuple[int, bytes] | None:
        """The next reply frame if it has arrived whole, else None."""
        buf = self.buf
        if len(buf) < 4:
            self._resume()
            return None
        n = _U32.unpack_from(buf)[0]
        if n == 0 or n > _MAX_REPLY:
            raise AgentError(_errno.EPROTO, f"bad reply frame length {n}")
        if len(buf) < 4 + n:
            self._resume()  # one frame may be bigger than the pause mark (a long listing): it must come whole
            return None
        kind, body = buf[4], bytes(buf[5:4 + n])
        del buf[:4 + n]
        if len(buf) < _BUF_HIGH // 2:
            self._resume()
        return kind, body

    def _resume(self) -> None:
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()

    async def frame(self, deadline: float | None = None) -> tuple[int, bytes]:
        """The next frame; TimeoutError at loop time ``deadline`` (a plain timer on the wait: this
        is every exec's path, asyncio.timeout's task bookkeeping costs more than the wait)."""
        while True:
            got = self.buffered()
            if got is not None:
                return got
            if self.eof:
                raise asyncio.IncompleteReadError(bytes(self.buf), None)
            loop = asyncio.get_running_loop()
            w = self._waiter = loop.create_future()
            timer = loop.call_at(deadline, _expire, w) if deadline is not None else None
            try:
                await w
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()


def _expire(w: "asyncio.Future[None]") -> None:
    if not w.done():
        w.set_exception(TimeoutError())


async def _exec_frame(conn: _Conn, deadline: float) -> tuple[int, bytes]:
    """The next frame of an exec by ``deadline``: heartbeats bound the silence from a live agent, a
    frozen or dead one trips this. (A frame already here needs no timer: a small exec's come together.)"""
    try:
        return await conn.frame(deadline)
    except TimeoutError as e:
        raise AgentUnavailable(_errno.ETIMEDOUT, "agent stopped responding during exec") from e


def _raise_error(body: bytes) -> None:
    try:
        err = _U32.unpack_from(body)[0]
        (mlen,) = _U32.unpack_from(body, 4)
        msg = body[8:8 + mlen].decode(errors="replace")
    except struct.error:
        err, msg = _errno.EPROTO, "malformed error frame"
    raise AgentError(err, msg)


def _parse_entry(body: bytes, pos: int) -> tuple[bytes, str, int, int, float, int]:
    (nlen,) = _U32.unpack_from(body, pos)
    pos += 4
    name = body[pos:pos + nlen]
    pos += nlen
    kind, size, mode, mtime_ns = _ENTRY_TAIL.unpack_from(body, pos)
    return name, _KINDS.get(kind, "other"), size, mode, mtime_ns / 1e9, pos + _ENTRY_TAIL.size


def _unexpected(kind: int) -> AgentError:
    return AgentError(_errno.EPROTO, f"unexpected reply frame {chr(kind)!r}")


# ---------------------------------------------------------------------------------- client


class AgentClient:
    """Async client for one sandbox's agent socket.

    ``expected_pid``: the agent's pid as seen from here (e.g. the task pid containerd reports).
    When set, each connection's SO_PEERCRED pid must match, so a process inside the sandbox that
    replaced the socket file with its own listener is refused instead of trusted.
    """

    def __init__(
        self,
        socket_path: str,
        expected_pid: int | None = None,
        *,
        connect_timeout_s: float = 5.0,
        op_timeout_s: float = 60.0,
    ) -> None:
        self.socket_path = socket_path
        self.expected_pid = expected_pid
        self.connect_timeout_s = connect_timeout_s
        self.op_timeout_s = op_timeout_s
        self.keeps_connections = False  # learnt from the ping: the agent speaks protocol 3
        self.long_entries = True  # the agent knows 'l'/'s'/'a' (until one answers EPROTO: older agent)
        self._idle: list[_Conn] = []

    # -- connection ------------------------------------------------------------------

    async def _conn(self) -> _Conn:
        """An idle connection (checked at connect time, still open, nothing unread), else a new one."""
        while self._idle:
            c = self._idle.pop()
            c.idle = False
            if c.reusable:
                return c
            c.close()
        return await self._connect()

    def _release(self, c: _Conn, ok: bool) -> None:
        """``ok``: its request ended with the agent's whole answer read, so the next one may follow."""
        if ok and self.keeps_connections and c.reusable and len(self._idle) < _IDLE_MAX:
            c.idle = True
            self._idle.append(c)
        else:
            c.close()

    def close_idle(self) -> None:
        """Close the pooled connections (the sandbox is going away)."""
        idle, self._idle = self._idle, []
        for c in idle:
            c.close()

    async def hang_up_idle(self, timeout_s: float = 2.0) -> None:
        """Close the pooled connections and wait until the agent closed its ends too: before the
        sandbox is frozen, so a CRIU dump of it finds no socket to the outside (nor a frozen agent
        one it cannot close)."""
        idle, self._idle = self._idle, []
        await asyncio.gather(*(c.hang_up(timeout_s) for c in idle))

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.setblocking(False)
        dir_fd = -1
        try:
            addr = self.socket_path
            if len(os.fsencode(addr)) > _SUN_PATH_MAX:
                # Sandbox dirs can be deep; reach the socket through its directory's fd instead.
                head, tail = os.path.split(addr)
                dir_fd = os.open(head or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
                addr = f"/proc/self/fd/{dir_fd}/{tail}"
            async with asyncio.timeout(self.connect_timeout_s):
                await loop.sock_connect(sock, addr)
        except (OSError, TimeoutError) as e:
            sock.close()
            code = e.errno or _errno.ETIMEDOUT  # TimeoutError has none
            raise AgentUnavailable(code, f"cannot reach agent at {self.socket_path}: {e or 'timed out'}") from e
        finally:
            if dir_fd >= 0:
                os.close(dir_fd)
        if self.expected_pid is not None:
            try:
                pid = peer_pid(sock)
            except OSError as e:
                sock.close()
                raise AgentUnavailable(e.errno or _errno.EIO, f"SO_PEERCRED failed: {e}") from e
            if pid != self.expected_pid:
                sock.close()
                raise AgentError(
                    _errno.EPERM,
                    f"agent socket {self.socket_path} is served by pid {pid}, expected {self.expected_pid}",
                )
        try:
            _, conn = await loop.create_unix_connection(_Conn, sock=sock)
        except OSError as e:
            sock.close()
            raise AgentUnavailable(e.errno or _errno.EIO, f"cannot reach agent at {self.socket_path}: {e}") from e
        return conn

    async def _call(self, frame: bytes) -> tuple[int, bytes]:
        """One request, one reply frame; error frames are raised as AgentError."""
        conn = await self._conn()
        ok = False
        try:
            async with asyncio.timeout(self.op_timeout_s):
                conn.write(frame)
                kind, body = await conn.frame()
            ok = kind != ord("R")  # after an error the agent may close: a fresh connection for the next call
        except TimeoutError as e:
            raise AgentUnavailable(_errno.ETIMEDOUT, f"agent did not answer within {self.op_timeout_s}s") from e
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            raise AgentUnavailable(_errno.ECONNRESET, f"agent closed the connection: {e}") from e
        finally:
            self._release(conn, ok)
        if kind == ord("R"):
            _raise_error(body)
        return kind, body

    # -- operations ------------------------------------------------------------------

    async def ping(self) -> AgentInfo:
        return await self._info(b"P")

    async def confine(self) -> AgentInfo:
        """An agent started with ``--confine-on-claim`` (a warm container's) applies its confinement now
        (idempotent): what it applied, as ``ping`` tells it. It serves nothing else before."""
        return await self._info(b"c")

    async def _info(self, request: bytes) -> AgentInfo:
        kind, body = await self._call(_frame(request))
        if kind != ord("K"):
            raise _unexpected(kind)
        version = _U32.unpack_from(body)[0] if len(body) >= 4 else 0
        if version not in PROTOCOLS:
            raise AgentError(_errno.EPROTO, f"agent speaks protocol {version}, we speak {', '.join(map(str, PROTOCOLS))}")
        self.keeps_connections = version >= 3
        abi, flags = struct.unpack_from(">II", body, 4) if len(body) >= 12 else (0, 0)
        return AgentInfo(version, abi, bool(flags & 1), bool(flags & 2), bool(flags & 4))

    async def wait_ready(self, timeout_s: float = 10.0, interval_s: float = 0.005) -> AgentInfo:
        """Poll ``ping`` until the agent answers; AgentUnavailable after ``timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            try:
                return await self.ping()
            except AgentUnavailable as e:
                if loop.time() >= deadline:
                    raise AgentUnavailable(e.errno, f"agent not ready after {timeout_s}s: {e.message}") from e
            await asyncio.sleep(interval_s)

    async def peer_pid(self) -> int:
        """Pid of the process serving the socket right now (checked against expected_pid if set)."""
        conn = await self._connect()
        try:
            assert conn.transport is not None
            return peer_pid(conn.transport.get_extra_info("socket"))
        finally:
            conn.close()

    async def exec(
        self,
        cmd: str,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout_s: float | None = None,
        on_output: OnOutput | None = None,
        *,
        cap: int | None = None,
        background: bool = False,
        stdin: bool = False,
        user: str = "",
        on_start: Callable[[int], Awaitable[None] | None] | None = None,
        trusted: bool = False,
    ) -> ExecOutcome:
        """Run ``cmd`` with ``/bin/sh -c`` in its own session; output streams to ``on_output``.

        ``env`` is the complete environment (None/empty: PATH and HOME=/root). On timeout the
        whole process group is SIGKILLed and ``timed_out`` is set. Cancelling this coroutine
        kills the process group too, unless ``background``: then the command carries on and
        ``attach`` reaches it again. ``cap`` bounds what the outcome keeps of each stream (the
        first bytes; the totals are counted regardless). ``stdin`` gives it a pipe for
        ``send_stdin``; ``user`` runs it as that user of the sandbox. ``on_start`` hears the pid.
        A command that could not be started (missing cwd, no /bin/sh, unknown user: ESRCH)
        raises AgentError. ``trusted``: the agent's trusted run ('T', see the agent's protocol
        notes): ``env`` is then only what the caller adds to the agent's fixed set; ENOTSUP when the
        sandbox's system directories are writable, EPROTO from an agent that predates it.
        """
        timeout_ms = 0 if not timeout_s or timeout_s <= 0 else min(math.ceil(timeout_s * 1000), 0xFFFFFFFF)
        env_parts = []
        for key, value in (env or {}).items():
            if not key or "=" in key:
                raise ValueError(f"invalid environment variable name {key!r}")
            env_parts.append(_s(f"{key}={value}"))
        # Nobody reads the output or the pid as they come: the agent may send them with the exit.
        buffered = on_output is None and on_start is None and not background
        flags = (1 if background else 0) | (2 if stdin else 0) | (4 if buffered else 0)
        frame = _frame(
            b"T" if trusted else b"X", _U32.pack(timeout_ms), _s(cmd), _s(cwd or ""), _U32.pack(len(env_parts)), *env_parts,
            bytes((flags,)), _s(user),
        )
        loop = asyncio.get_running_loop()
        hard_deadline = loop.time() + timeout_ms / 1000 + _EXEC_GRACE_S if timeout_ms else math.inf
        return await self._stream(frame, on_output, cap, on_start, hard_deadline)

    async def attach(
        self, pid: int, on_output: OnOutput | None = None, *, cap: int | None = None,
        on_start: Callable[[int], Awaitable[None] | None] | None = None,
    ) -> ExecOutcome:
        """Receive a background command's output from now on, and its end; ESRCH: no such
        command (never started here, or ended long ago), EBUSY: another client is attached."""
        return await self._stream(_frame(b"A", _U32.pack(pid)), on_output, cap, on_start, math.inf)

    async def _stream(
        self, frame: bytes, on_output: OnOutput | None, cap: int | None,
        on_start: Callable[[int], Awaitable[None] | None] | None, hard_deadline: float,
    ) -> ExecOutcome:
        loop = asyncio.get_running_loop()
        kept: dict[int, list[bytes]] = {1: [], 2: []}
        room = {1: math.inf if cap is None else cap, 2: math.inf if cap is None else cap}
        total = {1: 0, 2: 0}
        pid = 0
        conn = await self._conn()
        ok = False
        try:
            conn.write(frame)
            while True:
                kind, body = conn.buffered() or await _exec_frame(conn, min(loop.time() + _EXEC_IDLE_S, hard_deadline))
                if kind == ord("O"):
                    stream, data = body[0], body[1:]
                    if stream not in total:
                        raise AgentError(_errno.EPROTO, f"output frame of unknown stream {stream}")
                    total[stream] += len(data)
                    if room[stream] > 0:
                        piece = data if len(data) <= room[stream] else data[:int(room[stream])]
                        kept[stream].append(piece)
                        room[stream] -= len(piece)
                    if on_output is not None:
                        res = on_output(stream, data)
                        if inspect.isawaitable(res):
                            await res
                elif kind == ord("i"):
                    (pid,) = _U32.unpack_from(body)
                    if on_start is not None:
                        res = on_start(pid)
                        if inspect.isawaitable(res):
                            await res
                elif kind == ord("E"):
                    code, timed_out, sig = struct.unpack(">iBB", body[:6])
                    ok = True
                    return ExecOutcome(
                        code, b"".join(kept[1]), b"".join(kept[2]), bool(timed_out), pid, sig, total[1], total[2],
                    )
                elif kind == ord("R"):
                    _raise_error(body)
                elif kind != ord("H"):
                    raise _unexpected(kind)
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            raise AgentUnavailable(_errno.ECONNRESET, f"agent connection lost during exec: {e}") from e
        finally:
            # Not ok (cancelled, timed out, broken): closing it is what stops a foreground command.
            self._release(conn, ok)

    async def send_stdin(self, pid: int, data: bytes = b"", close: bool = False) -> None:
        """Queue ``data`` for the command's stdin pipe (``close``: then close it). While the agent
        holds 8 MiB the command has not read yet (EAGAIN: nothing was queued), this waits and
        retries, up to ``op_timeout_s``: a slow reader slows the writer."""
        view = memoryview(data).cast("B")
        loop = asyncio.get_running_loop()
        pos = 0
        while True:
            chunk = view[pos:pos + _WRITE_CHUNK]
            last = pos + len(chunk) >= len(view)
            frame = _frame(b"I", _U32.pack(pid), bytes((1 if close and last else 0,)), chunk)
            deadline = loop.time() + self.op_timeout_s
            delay = 0.005
            while True:
                try:
                    kind, _ = await self._call(frame)
                    break
                except AgentError as e:
                    if e.errno != _errno.EAGAIN or loop.time() + delay > deadline:
                        raise
                await asyncio.sleep(delay)  # back-off while the command catches up on its input
                delay = min(delay * 2, 0.2)
            if kind != ord("K"):
                raise _unexpected(kind)
            pos += len(chunk)
            if last:
                return

    async def signal(self, pid: int, signo: int) -> None:
        """Send ``signo`` to the process group of a command the agent started (ESRCH: none)."""
        kind, _ = await self._call(_frame(b"U", _U32.pack(pid), _U32.pack(signo)))
        if kind != ord("K"):
            raise _unexpected(kind)

    async def processes(self) -> list[ProcEntry]:
        """The commands the agent runs right now."""
        kind, body = await self._call(_frame(b"J"))
        if kind != ord("j"):
            raise _unexpected(kind)
        (count,) = _U32.unpack_from(body)
        pos = 4
        out = []
        for _ in range(count):
            pid, flags = struct.unpack_from(">IB", body, pos)
            pos += 5
            strs = []
            for _ in range(3):
                (n,) = _U32.unpack_from(body, pos)
                strs.append(os.fsdecode(body[pos + 4:pos + 4 + n]))
                pos += 4 + n
            out.append(ProcEntry(pid, strs[0], strs[1], strs[2], bool(flags & 1), bool(flags & 2), bool(flags & 4)))
        return out

    async def mkdir(self, path: str, mode: int = 0o755) -> bool:
        """Create ``path`` and its parents; False when it already was a directory."""
        kind, body = await self._call(_frame(b"C", _U32.pack(mode & 0o7777), _s(path)))
        if kind != ord("B") or len(body) != 1:
            raise _unexpected(kind)
        return body[0] == 1

    async def rename(self, path: str, new_path: str) -> None:
        kind, _ = await self._call(_frame(b"V", _s(path), _s(new_path)))
        if kind != ord("K"):
            raise _unexpected(kind)

    async def watch(
        self, path: str, on_event: Callable[[int, str], Awaitable[None] | None], *, recursive: bool = False,
        on_start: Callable[[], None] | None = None,
    ) -> None:
        """Report changes beneath directory ``path`` as (inotify mask, name relative to it) until
        cancelled (which ends the watch in the agent too)."""
        conn = await self._connect()
        try:
            conn.write(_frame(b"Y", bytes((int(recursive),)), _s(path)))
            async with asyncio.timeout(self.op_timeout_s):
                kind, body = await conn.frame()
            if kind == ord("R"):
                _raise_error(body)
            if kind != ord("w"):
                raise _unexpected(kind)
            if on_start is not None:
                on_start()
            while True:
                kind, body = await conn.frame()
                if kind != ord("F"):
                    raise _unexpected(kind)
                mask, nlen = struct.unpack_from(">II", body)
                res = on_event(mask, os.fsdecode(body[8:8 + nlen]))
                if inspect.isawaitable(res):
                    await res
        except TimeoutError as e:
            raise AgentUnavailable(_errno.ETIMEDOUT, f"agent did not answer within {self.op_timeout_s}s") from e
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            raise AgentUnavailable(_errno.ECONNRESET, f"agent connection lost during watch: {e}") from e
        finally:
            conn.close()  # a watch ends with its connection

    async def write_file(
        self, path: str, data: bytes, offset: int = 0, truncate: bool = True, mode: int = 0o644, *,
        owner: tuple[int, int] | None = None, metadata: dict[str, str] | None = None,
    ) -> int:
        """Write ``data`` at ``offset`` (creating parent dirs); returns the file's size afterwards.

        ``mode`` applies only when the file is created. ``truncate`` empties an existing file first.
        ``owner`` (uid, gid) and ``metadata`` (replacing the file's user.e2b.* xattrs) are set with the
        first chunk, before its data. An agent from before them writes the data only: ``long_entries``
        is False afterwards, which tells the caller they were not applied.
        """
        if offset < 0:
            raise ValueError("offset must be >= 0")
        attrs = (owner is not None or metadata is not None) and self.long_entries
        view = memoryview(data).cast("B")
        pos = 0
        size = 0
        while True:
            chunk = view[pos:pos + _WRITE_CHUNK]
            flags = 1 if truncate and pos == 0 else 0
            if attrs and pos == 0:
                meta = metadata or {}
                flags |= (2 if owner is not None else 0) | (4 if metadata is not None else 0)
                uid, gid = owner or (0, 0)
                pairs = b"".join(_s(k) + _s(v) for k, v in meta.items())
                head = (_U64.pack(offset + pos) + bytes((flags,)) + _U32.pack(mode & 0o7777) + _U32.pack(uid) + _U32.pack(gid)
                        + _U32.pack(len(meta)) + pairs + _s(path))
                try:
                    kind, body = await self._long_call(_frame(b"a", head, chunk))
                except AgentError:
                    if self.long_entries:
                        raise
                    attrs = False
                    continue  # an older agent: this chunk again, plainly
            else:
                head = _U64.pack(offset + pos) + bytes((flags,)) + _U32.pack(mode & 0o7777) + _s(path)
                kind, body = await self._call(_frame(b"W", head, chunk))
            if kind != ord("Z"):
                raise _unexpected(kind)
            size = int(_U64.unpack_from(body)[0])
            pos += len(chunk)
            if pos >= len(view):
                return size

    async def _long_call(self, frame: bytes) -> tuple[int, bytes]:
        """A call of an op newer than protocol 3 ('a', 'l', 's'); an older agent's EPROTO is remembered."""
        try:
            return await self._call(frame)
        except AgentError as e:
            if e.errno == _errno.EPROTO and "unknown request type" in e.message:
                self.long_entries = False
            raise

    async def read_file(self, path: str, offset: int = 0, length: int = -1) -> tuple[bytes, int]:
        """``length`` bytes (all to EOF if -1) from ``offset``; returns (data, file size)."""
        if offset < 0:
            raise ValueError("offset must be >= 0")
        chunks: list[bytes] = []
        pos = offset
        remaining = None if length < 0 else length
        while True:
            want = _READ_CHUNK if remaining is None else min(remaining, _READ_CHUNK)
            kind, body = await self._call(_frame(b"G", _U64.pack(pos), _U64.pack(want), _s(path)))
            if kind != ord("D"):
                raise _unexpected(kind)
            total = _U64.unpack_from(body)[0]
            data = body[8:]
            chunks.append(data)
            pos += len(data)
            if remaining is not None:
                remaining -= len(data)
            # A short chunk means EOF; don't trust the size alone (procfs files report 0).
            if len(data) < want or remaining == 0:
                return b"".join(chunks), total

    async def list_dir(self, path: str, *, long: bool = False) -> list[DirEntry]:
        """Entries of directory ``path`` sorted by name; symlinks are reported, not followed.
        ``long``: with owner, symlink target and metadata (when the agent knows how)."""
        long = long and self.long_entries
        try:
            kind, body = await (self._long_call(_frame(b"l", _s(path))) if long else self._call(_frame(b"L", _s(path))))
        except AgentError:
            if long and not self.long_entries:
                return await self.list_dir(path)
            raise
        if kind != (ord("t") if long else ord("T")):
            raise _unexpected(kind)
        (count,) = _U32.unpack_from(body)
        pos = 4
        entries = []
        for _ in range(count):
            raw, etype, size, mode, mtime, pos = _parse_entry(body, pos)
            name = os.fsdecode(raw)
            e = DirEntry(name, posixpath.join(path, name), etype, size, mode, mtime)
            if long:
                pos = _parse_extra(body, pos, e)
            entries.append(e)
        entries.sort(key=lambda e: e.name)
        return entries

    async def stat(self, path: str, follow_symlinks: bool = True, *, long: bool = False) -> DirEntry:
        long = long and self.long_entries
        frame = _frame(b"s" if long else b"S", bytes((int(follow_symlinks),)), _s(path))
        try:
            kind, body = await (self._long_call(frame) if long else self._call(frame))
        except AgentError:
            if long and not self.long_entries:
                return await self.stat(path, follow_symlinks)
            raise
        if kind != (ord("n") if long else ord("N")):
            raise _unexpected(kind)
        _, etype, size, mode, mtime, pos = _parse_entry(body, 0)
        e = DirEntry(posixpath.basename(path.rstrip("/")) or "/", path, etype, size, mode, mtime)
        if long:
            _parse_extra(body, pos, e)
        return e

    async def exists(self, path: str) -> bool:
        """True if ``path`` names anything, including a dangling symlink."""
        kind, body = await self._call(_frame(b"Q", _s(path)))
        if kind != ord("B") or len(body) != 1:
            raise _unexpected(kind)
        return body[0] == 1

    async def remove(self, path: str) -> None:
        """Remove a file, symlink or (recursively) a directory; ENOENT if it does not exist."""
        kind, _ = await self._call(_frame(b"M", _s(path)))
        if kind != ord("K"):
            raise _unexpected(kind)


__all__ = [
    "AGENT_SOURCE",
    "PROTOCOL_VERSION",
    "AgentBuildError",
    "AgentClient",
    "AgentError",
    "AgentInfo",
    "AgentUnavailable",
    "DirEntry",
    "ExecOutcome",
    "ProcEntry",
    "ensure_agent_binary",
    "peer_pid",
]
