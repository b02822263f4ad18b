"""Command output of any size, background processes, file watches and sandbox metrics: the host
side of the sandbox ops that stream to a client's inbox (see ``bus.messages.ExecRequest``).

Everything streamed is numbered per inbox and flow-controlled: every ``ACK_EVERY_BYTES`` a message
is marked ``ack``; the client answers it with a ``StreamAck`` and at most ``ACK_WINDOW`` marks may
be unanswered, so a slow client slows the command (the agent stops reading its pipes) instead of
NATS dropping output, and a client that went away is given up on after ``ACK_TIMEOUT_S``.
Replies are checked against the server's payload limit (``encode_reply``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import structlog
from msgspec import Struct
from nats.aio.client import Client as NATS

from bus import codec
from bus import subjects as S
from bus.errors import (
    BadRequest,
    DsecError,
    FileNotFound,
    InvalidArgument,
    ProcessNotFound,
    ReplyTooLarge,
)
from bus.messages import (
    Done,
    ExecChunk,
    ExecRequest,
    ExecResult,
    FileUnwatch,
    FileWatch,
    FsEvent,
    ProcConnect,
    ProcDisconnect,
    ProcessInfo,
    ProcessList,
    ProcessStarted,
    ProcInput,
    ProcList,
    ProcSignal,
    SandboxEvent,
    SandboxMetrics,
    StreamAck,
    WatchStarted,
)

from ._agent import (
    IN_ATTRIB,
    IN_CREATE,
    IN_DELETE,
    IN_DELETE_SELF,
    IN_ISDIR,
    IN_MODIFY,
    IN_MOVE_SELF,
    IN_MOVED_FROM,
    IN_MOVED_TO,
    IN_Q_OVERFLOW,
    AgentClient,
    AgentError,
    ExecOutcome,
)
from ._agent_errors import agent_errors
from ._backend import Backend, Capabilities, Handle

log = structlog.get_logger("dsec.hostagent.execio")

DEFAULT_OUTPUT_CAP = 8 << 20  # bytes of each stream an ExecResult keeps (DSEC_EXEC_OUTPUT_CAP overrides)
ACK_EVERY_BYTES = 1 << 20
ACK_WINDOW = 4
ACK_TIMEOUT_S = 10.0
KEEPALIVE_S = 10.0  # a watch with nothing to report still asks for an ack this often
ENDED_KEEP = 64  # ended background processes remembered per sandbox, for a late connect
REPLY_MARGIN = 4096  # room for the reply's own fields beside the output it carries


def output_cap_from_env() -> int:
    raw = os.environ.get("DSEC_EXEC_OUTPUT_CAP", "")
    return int(raw) if raw.isdigit() else DEFAULT_OUTPUT_CAP


# ---------------------------------------------------------------------------------- replies
def fit_output(res: ExecResult, budget: int) -> None:
    """Cut the output an ExecResult carries to ``budget`` bytes together (the heads are kept; the
    ``*_truncated`` flags say so). Fair split: a stream smaller than half keeps all of it."""
    out, err = len(res.stdout), len(res.stderr)
    budget = max(0, budget)
    if out + err > budget:
        half = budget // 2
        if out <= half:
            res.stderr = res.stderr[:budget - out]
        elif err <= half:
            res.stdout = res.stdout[:budget - err]
        else:
            res.stdout, res.stderr = res.stdout[:half], res.stderr[:budget - half]
    res.stdout_bytes = max(res.stdout_bytes, out)
    res.stderr_bytes = max(res.stderr_bytes, err)
    res.stdout_truncated = res.stdout_bytes > len(res.stdout)
    res.stderr_truncated = res.stderr_bytes > len(res.stderr)


def encode_reply(result: Any, limit: int) -> bytes:
    """The reply's bytes, within ``limit`` (the server's max_payload): command output is cut to fit;
    anything else too large becomes a ``reply_too_large`` error the caller receives."""
    if isinstance(result, ExecResult):
        fit_output(result, limit - REPLY_MARGIN)
    data = codec.encode(result)
    if len(data) > limit:
        err = ReplyTooLarge(
            f"the answer ({type(result).__name__}, {len(data)} bytes) exceeds the NATS server's max_payload of {limit} bytes; "
            "read big files in ranges (FileRead offset/length, as files.read does), list smaller directories, "
            "or stream command output (stream_to / on_stdout)",
            size=len(data), limit=limit,
        )
        data = codec.encode(err.to_reply())
    return data


def result_of(out: ExecOutcome) -> ExecResult:
    return ExecResult(
        exit_code=out.exit_code, stdout=out.stdout, stderr=out.stderr, timed_out=out.timed_out, pid=out.pid,
        signal=out.signal, stdout_bytes=out.stdout_bytes, stderr_bytes=out.stderr_bytes,
        stdout_truncated=out.stdout_truncated, stderr_truncated=out.stderr_truncated,
    )


# ---------------------------------------------------------------------------------- streams
class ClientStream:
    """Numbered messages to one client inbox, with the ack window described above when the
    client answers acks (``acks``; else nothing is marked or waited for)."""

    def __init__(self, nc: NATS, inbox: str, acks: bool = True) -> None:
        self.nc = nc
        self.inbox = inbox
        self.acks = acks
        self.seq = 0
        self.acked = -1
        self.dead = False
        self.last_sent = time.monotonic()
        self._since_mark = 0
        self._marks: deque[int] = deque()
        self._ev = asyncio.Event()

    async def send(self, make: Callable[[int, bool], Struct], nbytes: int, *, force_ack: bool = False) -> bool:
        """Publish ``make(seq, ack)``; False once the client is given up on."""
        if self.dead:
            return False
        self._since_mark += nbytes
        ack = self.acks and (force_ack or self._since_mark >= ACK_EVERY_BYTES)
        seq = self.seq
        self.seq += 1
        try:
            await self.nc.publish(self.inbox, codec.encode(make(seq, ack)))
        except Exception as exc:  # noqa: BLE001 - connection trouble: stop streaming, keep the command
            log.warning("stream_publish_failed", inbox=self.inbox, error=str(exc))
            self.dead = True
            return False
        self.last_sent = time.monotonic()
        if ack:
            self._since_mark = 0
            self._marks.append(seq)
            if force_ack:
                await self._wait(seq)
            elif len(self._marks) > ACK_WINDOW:
                await self._wait(self._marks[0])
        return not self.dead

    async def _wait(self, seq: int) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ACK_TIMEOUT_S
        while self.acked < seq and not self.dead:
            self._ev.clear()
            left = deadline - loop.time()
            if left <= 0:
                log.info("stream_client_gone", inbox=self.inbox, seq=seq)
                self.dead = True
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ev.wait(), left)

    def ack(self, seq: int) -> None:
        if seq > self.acked:
            self.acked = seq
            while self._marks and self._marks[0] <= seq:
                self._marks.popleft()
            self._ev.set()

    async def end(self, final: Struct) -> None:
        """The stream's last message (not flow-controlled: nothing follows it)."""
        if self.dead:
            return
        with contextlib.suppress(Exception):
            await self.nc.publish(self.inbox, codec.encode(final))


def _check_inbox(subject: str, what: str = "stream_to") -> None:
    if not S.valid_inbox(subject):
        # Output goes only to a reply inbox: never let a client make us publish on control subjects.
        raise BadRequest(f"{what} must be an _INBOX subject, got {subject!r}")


# ---------------------------------------------------------------------------------- processes
@dataclass
class BgProc:
    """A background process of one sandbox, as this host knows it."""

    pid: int
    info: ProcessInfo
    streams: list[ClientStream] = field(default_factory=list)
    result: ExecResult | None = None
    task: asyncio.Task[Any] | None = None

    async def fanout(self, stream: int, data: bytes) -> None:
        for st in list(self.streams):
            ok = await st.send(lambda seq, ack: ExecChunk(seq=seq, stream=stream, data=data, pid=self.pid, ack=ack), len(data))
            if not ok and st in self.streams:
                self.streams.remove(st)


class _ClientGone(Exception):
    """The client of a stream stopped answering its acks."""


class _Watch:
    """One FileWatch: the agent's inotify events as numbered FsEvents, a keepalive that needs an
    ack at least every KEEPALIVE_S (a client that stopped answering ends the watch), an end event."""

    def __init__(self, sid: str, wid: str, op: FileWatch, client: AgentClient, stream: ClientStream) -> None:
        self.sid = sid
        self.wid = wid
        self.op = op
        self.client = client
        self.stream = stream
        self.root = op.path.rstrip("/") or "/"
        self.started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.task: asyncio.Task[Any] | None = None
        self._beat: asyncio.Task[Any] | None = None

    async def _on_event(self, mask: int, name: str) -> None:
        for kind in _fs_kinds(mask):
            path = f"{self.root.rstrip('/')}/{name}" if name else self.root
            ev = FsEvent(seq=0, watch_id=self.wid, kind=kind, name=name, path=path, is_dir=bool(mask & IN_ISDIR))

            def make(seq: int, ack: bool, ev: FsEvent = ev) -> FsEvent:
                ev.seq, ev.ack = seq, ack
                return ev

            if not await self.stream.send(make, 64 + len(name)):
                raise _ClientGone

    async def _keepalive(self) -> None:
        while True:
            await asyncio.sleep(KEEPALIVE_S / 2)  # the beat's period, not synchronisation
            if time.monotonic() - self.stream.last_sent >= KEEPALIVE_S:
                beat = await self.stream.send(lambda seq, ack: FsEvent(seq=seq, watch_id=self.wid, kind="keepalive", ack=ack), 0, force_ack=True)
                if not beat and self.task is not None:
                    self.task.cancel()  # nobody answers: end the watch
                    return

    def _on_start(self) -> None:
        self.started.set_result(None)
        self._beat = asyncio.ensure_future(self._keepalive())

    async def run(self, ended: Callable[[], None]) -> None:
        try:
            with agent_errors(self.sid, path=self.op.path):
                await self.client.watch(self.op.path, self._on_event, recursive=self.op.recursive, on_start=self._on_start)
        except DsecError as exc:
            if not self.started.done():
                self.started.set_exception(exc)
                return
            log.info("watch_ended", sandbox_id=self.sid, watch_id=self.wid, error=str(exc))
        except _ClientGone:
            pass
        except asyncio.CancelledError:
            await self._end(ended)
            raise
        await self._end(ended)

    async def _end(self, ended: Callable[[], None]) -> None:
        if self._beat is not None:
            self._beat.cancel()
        ended()
        await self.stream.end(FsEvent(seq=self.stream.seq, watch_id=self.wid, kind="end"))


def _fs_kinds(mask: int) -> list[str]:
    kinds = []
    if mask & (IN_CREATE | IN_MOVED_TO):
        kinds.append("create")
    if mask & IN_MODIFY:
        kinds.append("write")
    if mask & (IN_DELETE | IN_DELETE_SELF):
        kinds.append("remove")
    if mask & (IN_MOVED_FROM | IN_MOVE_SELF):
        kinds.append("rename")
    if mask & IN_ATTRIB:
        kinds.append("chmod")
    if mask & IN_Q_OVERFLOW:
        kinds.append("overflow")  # the kernel's queue overflowed: events were lost
    return kinds


class ExecIO:
    """Exec, background processes and watches of every sandbox on this host."""

    def __init__(
        self, backend: Backend, caps: Capabilities, nc: Callable[[], NATS | None], host_id: str, *, output_cap: int | None = None,
    ) -> None:
        self.backend = backend
        self.caps = caps
        self._nc = nc
        self.host_id = host_id
        self.output_cap = output_cap_from_env() if output_cap is None else output_cap
        self._streams: dict[tuple[str, str], ClientStream] = {}  # (sandbox, inbox) -> stream, for acks
        self._procs: dict[str, dict[int, BgProc]] = {}
        self._watches: dict[str, dict[str, _Watch]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def nc(self) -> NATS:
        nc = self._nc()
        assert nc is not None
        return nc

    def _agent(self, handle: Handle) -> AgentClient:
        return self.caps.need_agents().agent_client(handle)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        t: asyncio.Task[Any] = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    def _stream(self, sid: str, inbox: str, acks: bool) -> ClientStream:
        st = self._streams.get((sid, inbox))
        if st is None or st.dead:
            st = self._streams[(sid, inbox)] = ClientStream(self.nc, inbox, acks)
        return st

    def _drop_stream(self, sid: str, st: ClientStream) -> None:
        if self._streams.get((sid, st.inbox)) is st:
            del self._streams[(sid, st.inbox)]

    def ack(self, sid: str, a: StreamAck) -> None:
        st = self._streams.get((sid, a.stream_id))
        if st is not None:
            st.ack(a.seq)

    def forget(self, sid: str) -> None:
        """The sandbox is gone: its background processes end (clients hear it), its watches stop."""
        for p in self._procs.pop(sid, {}).values():
            if p.task is not None and p.result is None:
                p.task.cancel()
                streams, p.streams = p.streams, []
                end = ExecResult(exit_code=128 + 9, signal=9, pid=p.pid)
                for st in streams:
                    self._spawn(st.end(msgspec.structs.replace(end, chunks=st.seq)))
        for w in self._watches.pop(sid, {}).values():
            if w.task is not None:
                w.task.cancel()
        for key in [k for k in self._streams if k[0] == sid]:
            del self._streams[key]

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    # --- exec ------------------------------------------------------------------------------
    async def exec(self, handle: Handle, base_envs: dict[str, str], req: ExecRequest) -> ExecResult | ProcessStarted:
        if req.stream_to:
            _check_inbox(req.stream_to)
        if req.output_cap < 0:
            req.output_cap = self.output_cap
        if base_envs and not req.trusted:  # a trusted run inherits none of the sandbox's variables
            req.envs = {**base_envs, **req.envs}
        if req.background:
            return await self._start_background(handle, req)
        st = self._stream(handle.sandbox_id, req.stream_to, req.acks) if req.stream_to else None
        on_output = None
        if st is not None:

            async def on_output(stream: int, data: bytes) -> None:
                await st.send(lambda seq, ack: ExecChunk(seq=seq, stream=stream, data=data, ack=ack), len(data))

        t0 = time.perf_counter()
        try:
            res: ExecResult = await self.backend.exec(handle, req, on_output)
        finally:
            if st is not None:
                self._drop_stream(handle.sandbox_id, st)
        res.chunks = st.seq if st is not None else 0
        res.duration_ms = (time.perf_counter() - t0) * 1000
        fit_output(res, self.nc.max_payload - REPLY_MARGIN)  # whichever endpoint sends it, it fits
        await self._event(handle.sandbox_id, req, res)
        return res

    async def _event(self, sid: str, req: ExecRequest, res: ExecResult) -> None:
        # Audit trail without an ack round trip on the exec path: a core publish the stream still captures.
        ev = SandboxEvent(
            sandbox_id=sid, kind="exec", at=time.time(), host_id=self.host_id,
            detail={
                "cmd": req.cmd[:1024], "exit_code": str(res.exit_code), "timed_out": str(res.timed_out).lower(),
                **({"background": "true", "pid": str(res.pid)} if req.background else {}),
            },
        )
        with contextlib.suppress(Exception):
            await self.nc.publish(S.evt_sandbox(sid, "exec"), codec.encode(ev))

    async def _start_background(self, handle: Handle, req: ExecRequest) -> ProcessStarted:
        self._agent(handle)  # NotSupported before anything starts
        sid = handle.sandbox_id
        started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        info = ProcessInfo(pid=0, cmd=req.cmd, tag=req.tag, cwd=req.cwd, user=req.user, envs=dict(req.envs), started_at=time.time(), stdin=req.stdin)
        proc = BgProc(pid=0, info=info)
        if req.stream_to:
            proc.streams.append(self._stream(sid, req.stream_to, req.acks))
        req.output_cap = 0  # the client has every byte from the stream; the end message carries the totals

        def on_start(pid: int) -> None:
            proc.pid = info.pid = pid
            self._procs.setdefault(sid, {})[pid] = proc
            started.set_result(pid)

        async def run() -> ExecResult:
            return await self.backend.exec(handle, req, proc.fanout, on_start=on_start)

        proc.task = self._spawn(self._run(sid, proc, run(), started, req))
        pid = await started
        return ProcessStarted(pid=pid, tag=req.tag)

    async def _run(self, sid: str, proc: BgProc, work: Any, started: asyncio.Future[int], req: ExecRequest | None) -> None:
        try:
            res = await work
        except asyncio.CancelledError:
            raise  # host agent stopping (the process runs on; a later connect adopts it) or sandbox gone
        except Exception as exc:  # noqa: BLE001 - the start failed (typed), or the agent went away
            if not started.done():
                started.set_exception(exc)
            else:
                log.warning("background_process_lost", sandbox_id=sid, pid=proc.pid, error=str(exc))
            res = ExecResult(exit_code=-1, pid=proc.pid)
        if not started.done():
            return
        res.pid = proc.pid
        proc.result = res
        for st in proc.streams:
            res.chunks = st.seq
            await st.end(res)
            self._drop_stream(sid, st)
        proc.streams.clear()
        if req is not None:
            await self._event(sid, req, res)
        table = self._procs.get(sid, {})
        ended = [p for p in table.values() if p.result is not None]
        for old in ended[:-ENDED_KEEP]:
            table.pop(old.pid, None)

    def _find(self, sid: str, pid: int, tag: str) -> BgProc | None:
        table = self._procs.get(sid, {})
        if pid:
            return table.get(pid)
        if tag:
            hits = [p for p in table.values() if p.info.tag == tag]
            running = [p for p in hits if p.result is None]
            found = running or hits
            return found[-1] if found else None
        raise InvalidArgument("name the process by pid or tag")

    async def _adopt(self, handle: Handle, pid: int) -> BgProc | None:
        """A process the agent runs that this host has no record of (the host agent restarted):
        attach to it, so its output and end reach clients again."""
        client = self._agent(handle)
        sid = handle.sandbox_id
        started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        proc = BgProc(pid=pid, info=ProcessInfo(pid=pid, cmd=""))
        try:
            entry = next((e for e in await client.processes() if e.pid == pid), None)
        except AgentError:
            entry = None
        if entry is not None:
            proc.info = ProcessInfo(pid=pid, cmd=entry.cmd, cwd=entry.cwd, user=entry.user, stdin=entry.stdin_open)

        def on_start(_: int) -> None:
            self._procs.setdefault(sid, {})[pid] = proc
            started.set_result(pid)

        async def run() -> ExecResult:
            with agent_errors(sid, pid):
                return result_of(await client.attach(pid, proc.fanout, cap=0, on_start=on_start))

        proc.task = self._spawn(self._run(sid, proc, run(), started, None))
        try:
            await started
        except ProcessNotFound:
            return None
        return proc

    async def proc(self, handle: Handle, op: Any) -> Any:
        sid = handle.sandbox_id
        client = self._agent(handle)
        match op:
            case ProcList():
                with agent_errors(sid):
                    entries = await client.processes()
                known = self._procs.get(sid, {})
                out = []
                for e in entries:
                    p = known.get(e.pid)
                    base = p.info if p is not None else ProcessInfo(pid=e.pid, cmd=e.cmd, cwd=e.cwd, user=e.user)
                    out.append(msgspec.structs.replace(base, stdin=e.stdin_open))
                return ProcessList(processes=out)
            case ProcSignal(signal=sig):
                if not 0 <= sig <= 64:
                    raise InvalidArgument(f"signal must be 0..64, got {sig}")
                pid = self._pid(sid, op.pid, op.tag)
                with agent_errors(sid, pid):
                    await client.signal(pid, sig)
                return Done()
            case ProcInput(data=data, close=close):
                pid = self._pid(sid, op.pid, op.tag)
                with agent_errors(sid, pid):
                    await client.send_stdin(pid, data, close)
                return Done()
            case ProcConnect(stream_to=inbox):
                _check_inbox(inbox)
                p = self._find(sid, op.pid, op.tag)
                if p is None and op.pid:
                    p = await self._adopt(handle, op.pid)
                if p is None:
                    raise ProcessNotFound(f"no process {op.pid or op.tag!r} in sandbox {sid}", pid=op.pid, tag=op.tag)
                if p.result is not None:
                    await self.nc.publish(inbox, codec.encode(msgspec.structs.replace(p.result, chunks=0)))
                else:
                    p.streams.append(self._stream(sid, inbox, op.acks))
                return ProcessStarted(pid=p.pid, tag=p.info.tag)
            case ProcDisconnect(stream_to=inbox):
                p = self._find(sid, op.pid, op.tag)
                if p is not None:
                    for st in [s for s in p.streams if s.inbox == inbox]:
                        p.streams.remove(st)
                        self._drop_stream(sid, st)
                return Done()
        raise BadRequest(f"unsupported process operation {type(op).__name__}")

    def _pid(self, sid: str, pid: int, tag: str) -> int:
        if pid:
            return pid
        p = self._find(sid, 0, tag)
        if p is None or p.result is not None:
            raise ProcessNotFound(f"no running process tagged {tag!r} in sandbox {sid}", tag=tag)
        return p.pid

    # --- watches -------------------------------------------------------------------------------
    async def watch(self, handle: Handle, op: FileWatch | FileUnwatch) -> Any:
        sid = handle.sandbox_id
        if isinstance(op, FileUnwatch):
            w = self._watches.get(sid, {}).pop(op.watch_id, None)
            if w is None:
                raise FileNotFound(f"no watch {op.watch_id!r} in sandbox {sid}")
            if w.task is not None:
                w.task.cancel()
            return Done()
        _check_inbox(op.stream_to)
        if not op.path.startswith("/"):
            raise InvalidArgument(f"path must be absolute, got {op.path!r}")
        w = _Watch(sid, uuid.uuid4().hex[:16], op, self._agent(handle), ClientStream(self.nc, op.stream_to))
        self._streams[(sid, op.stream_to)] = w.stream
        table = self._watches.setdefault(sid, {})
        table[w.wid] = w

        def ended() -> None:
            table.pop(w.wid, None)
            self._drop_stream(sid, w.stream)

        w.task = self._spawn(w.run(ended))
        try:
            await w.started
        except BaseException:
            ended()
            raise
        return WatchStarted(watch_id=w.wid)

    # --- metrics ---------------------------------------------------------------------------
    async def metrics(self, handle: Handle) -> SandboxMetrics:
        return await self.caps.need_meter().metrics(handle)


__all__ = ["ExecIO", "ClientStream", "encode_reply", "fit_output", "result_of", "agent_errors", "DEFAULT_OUTPUT_CAP"]
