"""envd's ``process.Process`` service on the bus: Start, Connect, List, SendSignal (and friends).

A command is one streamed exec (``dsec.sbx.<id>.exec`` with ``stream_to``): its output chunks
become ``data`` events as they arrive. The in-sandbox agent runs it in its own session, and the
line it runs first reports the session's pid, so the ``start`` event carries the real pid and a
signal goes to the whole process group. The gateway keeps the commands it started (per sandbox)
for List and Connect; one that outlives the HTTP stream that started it keeps running.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
from aiohttp import web

from bus import codec
from bus.errors import DsecError, InvalidArgument
from bus.messages import ExecRequest, ExecResult

from .._async import AsyncSandbox
from ._connect import ConnectError, ServerStream
from ._users import Users, resolve, user_of

log = structlog.get_logger("dsec.gateway.process")

PID_MARK = b"\x1edsecpid "
NO_LIMIT_S = 30 * 86400.0  # a command without a deadline (E2B timeout=0)
CHUNK_GRACE_S = 5.0  # how long output published before the reply may still trail it
KEEPALIVE_HEADER = "Keepalive-Ping-Interval"
KEEPALIVE_S = 50.0
SIGNALS = {"SIGNAL_SIGKILL": 9, "SIGNAL_SIGTERM": 15, 9: 9, 15: 15}


Queue = asyncio.Queue  # of envd events (dicts), None at the end


@dataclass
class Proc:
    sandbox_id: str
    pid: int
    config: dict[str, Any]
    tag: str = ""
    listeners: set[asyncio.Queue[dict[str, Any] | None]] = field(default_factory=set)
    end: dict[str, Any] | None = None
    error: ConnectError | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    def emit(self, event: dict[str, Any] | None) -> None:
        for q in self.listeners:
            q.put_nowait(event)

    def info(self) -> dict[str, Any]:
        d: dict[str, Any] = {"config": self.config, "pid": self.pid}
        if self.tag:
            d["tag"] = self.tag
        return d


def _split_pid(head: bytes) -> tuple[int, bytes]:
    """The pid the command's first line reports, and the output after it (all of it when unmarked)."""
    line, _, rest = head.partition(b"\n")
    if line.startswith(PID_MARK) and line[len(PID_MARK):].isdigit():
        return int(line[len(PID_MARK):]), rest
    return 0, head


def _end(exit_code: int) -> dict[str, Any]:
    status = {137: "signal: killed", 143: "signal: terminated"}.get(exit_code, f"exit status {exit_code}")
    return {"exitCode": exit_code, "exited": True, "status": status}


def _data(stream: int, data: bytes) -> dict[str, Any]:
    return {"event": {"data": {"stdout" if stream == 1 else "stderr": base64.b64encode(data).decode()}}}


class _Output:
    """The ExecChunks of one command: the pid line first (it makes the Proc), then data events."""

    def __init__(self, begin: Callable[[int], Proc]) -> None:
        self._begin = begin
        self.proc: Proc | None = None
        self.head: bytes | None = b""  # stderr before the pid line
        self.pending: list[dict[str, Any]] = []  # stdout before the pid line (none, normally)
        self.received = 0
        self.expected = -1
        self.all_in = asyncio.Event()

    def begin_with(self, pid: int) -> Proc:
        self.proc = self._begin(pid)
        for ev in self.pending:
            self.proc.emit(ev)
        return self.proc

    async def on_msg(self, msg: Any) -> None:
        try:
            ch = codec.EXEC_CHUNK.decode(msg.data)
        except DsecError:
            return
        self.received += 1
        data = ch.data
        if self.proc is None and ch.stream == 2 and self.head is not None:
            self.head += data
            if b"\n" not in self.head:
                return
            pid, data = _split_pid(self.head)
            self.head = None
            self.begin_with(pid)
        if data:
            ev = _data(ch.stream, data)
            if self.proc is None:
                self.pending.append(ev)
            else:
                self.proc.emit(ev)
        if 0 <= self.expected <= self.received:
            self.all_in.set()

    async def drain(self, chunks: int) -> None:
        """Output published before the reply may still trail it: wait (bounded) for all of it."""
        if chunks > self.received:
            self.expected = chunks
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.all_in.wait(), CHUNK_GRACE_S)


class Processes:
    def __init__(self, users: Users) -> None:
        self.users = users
        self.procs: dict[str, dict[int, Proc]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def _table(self, sid: str) -> dict[int, Proc]:
        return self.procs.setdefault(sid, {})

    def find(self, sid: str, selector: Any) -> Proc:
        if not isinstance(selector, dict) or not ("pid" in selector or "tag" in selector):
            raise InvalidArgument("process selector must name a pid or a tag")
        for p in self._table(sid).values():
            if ("pid" in selector and str(p.pid) == str(selector["pid"])) or ("tag" in selector and p.tag and p.tag == selector["tag"]):
                return p
        raise ConnectError("not_found", f"process {selector} not found")

    # --- Start ----------------------------------------------------------------------------------------
    async def start(self, request: web.Request, sb: AsyncSandbox, body: dict[str, Any]) -> web.StreamResponse:
        cfg = body.get("process")
        if not isinstance(cfg, dict) or not isinstance(cfg.get("cmd"), str) or not cfg["cmd"]:
            raise ConnectError("invalid_argument", "process.cmd is required")
        args = cfg.get("args") or []
        envs = cfg.get("envs") or {}
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ConnectError("invalid_argument", "process.args must be a list of strings")
        if not isinstance(envs, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in envs.items()):
            raise ConnectError("invalid_argument", "process.envs must map strings to strings")
        if body.get("pty"):
            raise ConnectError("unimplemented", "PTY sessions are not supported by dsec's gateway yet")
        acct = await self.users.account(sb, user_of(request.headers.get("Authorization")))
        line = await self.users.command(sb, acct, cfg["cmd"], args)
        cwd = resolve(cfg["cwd"], acct.home) if cfg.get("cwd") else acct.home
        env = {"HOME": acct.home, "USER": acct.name, "LOGNAME": acct.name, **envs}
        timeout_ms = request.headers.get("Connect-Timeout-Ms", "")
        timeout_s = int(timeout_ms) / 1000 if timeout_ms.isdigit() and int(timeout_ms) > 0 else 0.0
        req = ExecRequest(cmd=f"printf '\\036dsecpid %s\\n' $$ >&2; exec {line}", envs=env, cwd=cwd, timeout_s=timeout_s)
        stream = ServerStream(request)
        q: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        started: asyncio.Future[Proc] = asyncio.get_running_loop().create_future()
        # The command outlives this HTTP stream (a client may go and Connect later): its own task.
        task = asyncio.create_task(self._run(sb, req, cfg, str(body.get("tag") or ""), q, started))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        try:
            proc = await asyncio.shield(started)
        except ConnectError as err:
            return await stream.close(err)
        return await self._pump(stream, proc, q, first={"event": {"start": {"pid": proc.pid}}})

    async def _pump(self, stream: ServerStream, proc: Proc, q: Queue, *, first: dict[str, Any]) -> web.StreamResponse:
        """Copy a process's events to one HTTP stream; a client that goes away only stops listening.
        Quiet stretches get keepalive events at the interval the client asked for."""
        ping = stream.request.headers.get(KEEPALIVE_HEADER, "")
        every = max(1.0, float(ping)) if ping.isdigit() else KEEPALIVE_S
        try:
            await stream.send(first)
            while True:
                try:
                    ev = await asyncio.wait_for(q.get(), every)
                except TimeoutError:
                    await stream.send({"event": {"keepalive": {}}})
                    continue
                if ev is None:
                    break
                await stream.send(ev)
            return await stream.close(proc.error)
        except (ConnectionResetError, asyncio.CancelledError):
            log.info("process_stream_left", sandbox_id=proc.sandbox_id, pid=proc.pid)
            raise
        finally:
            proc.listeners.discard(q)

    async def _run(self, sb: AsyncSandbox, req: ExecRequest, cfg: dict[str, Any], tag: str, q: Queue, started: asyncio.Future[Proc]) -> None:
        def begin(pid: int) -> Proc:
            proc = Proc(sandbox_id=sb.sandbox_id, pid=pid, config=cfg, tag=tag)
            proc.listeners.add(q)
            self._table(sb.sandbox_id)[pid] = proc
            if not started.done():
                started.set_result(proc)
            return proc

        out = _Output(begin)
        req.stream_to = sb._nc.new_inbox()
        sub = await sb._nc.subscribe(req.stream_to, cb=out.on_msg)
        try:
            res: ExecResult = await sb._request("exec", req, ExecResult, timeout=(req.timeout_s or NO_LIMIT_S) + 10)
            await out.drain(res.chunks)
            proc = out.proc or out.begin_with(0)
            if res.timed_out:
                proc.error = ConnectError("deadline_exceeded", f"command ran past its {req.timeout_s:g}s timeout and was killed")
            else:
                proc.end = _end(res.exit_code)
                proc.emit({"event": {"end": proc.end}})
        except Exception as exc:  # noqa: BLE001 - every stream ends with an answer
            err = ConnectError.of(exc)
            if out.proc is None:
                if not started.done():
                    started.set_exception(err)
                return
            out.proc.error = err
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            if out.proc is not None:
                out.proc.done.set()
                out.proc.emit(None)
                self._table(sb.sandbox_id).pop(out.proc.pid, None)

    # --- Connect, List, SendSignal -----------------------------------------------------------------------
    async def connect(self, request: web.Request, sid: str, body: dict[str, Any]) -> web.StreamResponse:
        proc = self.find(sid, body.get("process"))
        q: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        proc.listeners.add(q)
        if proc.done.is_set():
            q.put_nowait(None)
        return await self._pump(ServerStream(request), proc, q, first={"event": {"start": {"pid": proc.pid}}})

    def list(self, sid: str) -> dict[str, Any]:
        return {"processes": [p.info() for p in self._table(sid).values()]}

    async def signal(self, sb: AsyncSandbox, body: dict[str, Any]) -> dict[str, Any]:
        proc = self.find(sb.sandbox_id, body.get("process"))
        sig = SIGNALS.get(body.get("signal"))  # type: ignore[arg-type]
        if sig is None:
            raise ConnectError("invalid_argument", f"signal {body.get('signal')!r}: one of SIGNAL_SIGKILL, SIGNAL_SIGTERM")
        if proc.pid <= 1:
            raise ConnectError("failed_precondition", "the process's pid is not known")
        # The command leads its own session (the agent starts it so): signal the whole group.
        await sb._request("exec", ExecRequest(cmd=f"kill -{sig} -- -{proc.pid}", timeout_s=10), ExecResult, timeout=20)
        return {}


__all__ = ["Proc", "Processes"]
