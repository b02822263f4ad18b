"""envd's ``process.Process`` service on the sandbox's own process ops (``dsec.sbx.<id>.exec`` and ``.proc``).

Start is a background exec: the agent starts the command (its own session, as the requested user),
answers with its pid, and streams its output as numbered ``ExecChunk``s to our inbox, the final
``ExecResult`` last. Connect re-attaches a new inbox to a running command; List, SendSignal,
SendInput and CloseStdin are the ``Proc*`` ops. A command outlives the HTTP stream that started it
(the stream leaving only detaches its inbox), as with E2B.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
from typing import Any

import structlog
from aiohttp import web

from bus import codec
from bus.errors import DsecError, InvalidArgument
from bus.messages import (
    Done, ExecChunk, ExecRequest, ExecResult, ProcConnect, ProcDisconnect, ProcessList, ProcessStarted, ProcInput, ProcList, ProcSignal,
)

from .._async import AsyncSandbox
from ._connect import ConnectError, ServerStream
from ._users import Users, resolve, user_of

log = structlog.get_logger("dsec.gateway.process")

KEEPALIVE_HEADER = "Keepalive-Ping-Interval"
KEEPALIVE_S = 50.0
SIGNALS = {"SIGNAL_SIGKILL": 9, "SIGNAL_SIGTERM": 15}


def _end(res: ExecResult) -> dict[str, Any]:
    status = f"exit status {res.exit_code}"
    if res.signal:
        status = {9: "signal: killed", 15: "signal: terminated"}.get(res.signal, f"signal: {res.signal}")
    return {"exitCode": res.exit_code, "exited": True, "status": status}


class _Inbox:
    """One stream_to inbox: ExecChunks in order, then the ExecResult."""

    def __init__(self, sb: AsyncSandbox) -> None:
        self.sb = sb
        self.inbox = sb.nc.new_inbox()
        self.q: asyncio.Queue[ExecChunk | ExecResult] = asyncio.Queue()
        self.sub: Any = None

    async def __aenter__(self) -> "_Inbox":
        async def on(msg: Any) -> None:
            with contextlib.suppress(DsecError):
                self.q.put_nowait(codec.EXEC_STREAM.decode(msg.data))

        self.sub = await self.sb.nc.subscribe(self.inbox, cb=on)
        return self

    async def __aexit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            await self.sub.unsubscribe()


def _selector(body: dict[str, Any]) -> tuple[int, str]:
    sel = body.get("process")
    if not isinstance(sel, dict) or not ("pid" in sel or "tag" in sel):
        raise InvalidArgument("process selector must name a pid or a tag")
    try:
        return int(sel.get("pid") or 0), str(sel.get("tag") or "")
    except (TypeError, ValueError):
        raise InvalidArgument(f"process pid must be an integer, got {sel.get('pid')!r}") from None


class Processes:
    def __init__(self, users: Users) -> None:
        self.users = users

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
        line = await self.users.command(sb, cfg["cmd"], args)
        timeout_ms = request.headers.get("Connect-Timeout-Ms", "")
        req = ExecRequest(
            cmd=line, envs={"HOME": acct.home, "USER": acct.name, "LOGNAME": acct.name, **envs},
            cwd=resolve(cfg["cwd"], acct.home) if cfg.get("cwd") else acct.home,
            timeout_s=int(timeout_ms) / 1000 if timeout_ms.isdigit() else 0.0, background=True,
            user=acct.name if acct.uid != 0 else "", stdin=bool(body.get("stdin")), tag=str(body.get("tag") or ""),
        )
        async with _Inbox(sb) as ib:
            req.stream_to = ib.inbox
            started: ProcessStarted = await sb._request("exec", req, ProcessStarted)
            return await self._pump(ServerStream(request), sb, ib, started.pid)

    async def connect(self, request: web.Request, sb: AsyncSandbox, body: dict[str, Any]) -> web.StreamResponse:
        pid, tag = _selector(body)
        async with _Inbox(sb) as ib:
            started: ProcessStarted = await sb._request("proc", ProcConnect(pid=pid, tag=tag, stream_to=ib.inbox), ProcessStarted)
            return await self._pump(ServerStream(request), sb, ib, started.pid)

    async def _pump(self, stream: ServerStream, sb: AsyncSandbox, ib: _Inbox, pid: int) -> web.StreamResponse:
        """The command's events to one HTTP stream; quiet stretches get keepalives. A client that
        goes away detaches the inbox; the command runs on."""
        ping = stream.request.headers.get(KEEPALIVE_HEADER, "")
        every = max(1.0, float(ping)) if ping.isdigit() else KEEPALIVE_S
        try:
            await stream.send({"event": {"start": {"pid": pid}}})
            while True:
                try:
                    m = await asyncio.wait_for(ib.q.get(), every)
                except TimeoutError:
                    await stream.send({"event": {"keepalive": {}}})
                    continue
                if isinstance(m, ExecChunk):
                    await stream.send({"event": {"data": {"stdout" if m.stream == 1 else "stderr": base64.b64encode(m.data).decode()}}})
                    continue
                if m.timed_out:
                    return await stream.close(ConnectError("deadline_exceeded", "the command ran past its timeout and was killed"))
                await stream.send({"event": {"end": _end(m)}})
                return await stream.close()
        except (ConnectionResetError, asyncio.CancelledError):
            log.info("process_stream_left", sandbox_id=sb.sandbox_id, pid=pid)
            with contextlib.suppress(Exception):
                await sb._request("proc", ProcDisconnect(pid=pid, stream_to=ib.inbox), Done, timeout=5)
            raise

    async def unary(self, method: str, sb: AsyncSandbox, body: dict[str, Any]) -> dict[str, Any]:
        if method not in ("List", "SendSignal", "SendInput", "CloseStdin"):
            raise ConnectError("unimplemented", f"process.Process/{method} is not implemented by dsec's gateway yet")
        if method == "List":
            res: ProcessList = await sb._request("proc", ProcList(), ProcessList)
            return {"processes": [
                {"config": {"cmd": p.cmd, "envs": p.envs, "cwd": p.cwd}, "pid": p.pid, **({"tag": p.tag} if p.tag else {})} for p in res.processes
            ]}
        pid, tag = _selector(body)
        if method == "SendSignal":
            sig = SIGNALS.get(str(body.get("signal")))
            if sig is None:
                raise ConnectError("invalid_argument", f"signal {body.get('signal')!r}: one of {', '.join(SIGNALS)}")
            await sb._request("proc", ProcSignal(pid=pid, tag=tag, signal=sig), Done)
            return {}
        if method == "SendInput":
            inp = body.get("input") or {}
            raw = inp.get("stdin", inp.get("pty", "")) if isinstance(inp, dict) else ""
            if not isinstance(raw, str):
                raise ConnectError("invalid_argument", "input.stdin must be base64")
            try:
                data = base64.b64decode(raw, validate=True)
            except (binascii.Error, TypeError):
                raise ConnectError("invalid_argument", "input.stdin must be base64") from None
            await sb._request("proc", ProcInput(pid=pid, tag=tag, data=data), Done)
            return {}
        await sb._request("proc", ProcInput(pid=pid, tag=tag, close=True), Done)  # CloseStdin
        return {}


__all__ = ["Processes"]
