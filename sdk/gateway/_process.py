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
from bus import subjects as S
from bus.errors import DsecError, InvalidArgument
from bus.messages import (
    Done, ExecChunk, ExecRequest, ExecResult, ProcConnect, ProcDisconnect, ProcessList, ProcessStarted, ProcInput, ProcList, ProcSignal,
)

from bus.runtime import KV

from .._async import AsyncSandbox
from ._connect import ConnectError, ServerStream
from ._tenants import LIVE_STATES
from ._users import Users, resolve, user_of

log = structlog.get_logger("dsec.gateway.process")

KEEPALIVE_HEADER = "Keepalive-Ping-Interval"
KEEPALIVE_S = 50.0
SIGNALS = {"SIGNAL_SIGKILL": 9, "SIGNAL_SIGTERM": 15}
# The in-sandbox agent (hostagent mounts its directory at /.dsec/bin) doubles as the PTY relay.
PTY_RELAY = "/.dsec/bin/dsec-agent"


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


async def _sandbox_ended(sb: AsyncSandbox) -> bool:
    """Whether the sandbox's record says it ended (killed, timed out, lost) or is ending."""
    try:
        kv = await KV.bind(sb.nc.jetstream(), S.KV_SANDBOXES, codec.SANDBOX_RECORD)
        rec = await kv.get(sb.sandbox_id)
    except Exception:  # noqa: BLE001 - unknown: report the command's own end
        return False
    return rec is None or rec.state not in LIVE_STATES


def _pty_size(pty: Any) -> tuple[int, int]:
    size = pty.get("size") if isinstance(pty, dict) else None
    size = size if isinstance(size, dict) else {}
    rows, cols = size.get("rows", 24), size.get("cols", 80)
    if not all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 65535 for v in (rows, cols)):
        raise ConnectError("invalid_argument", f"pty.size rows and cols must be 1..65535, got {size!r}")
    return rows, cols


class Processes:
    def __init__(self, users: Users) -> None:
        self.users = users
        # (sandbox, pid) of the running PTY sessions -> the user they run as: their output is "pty", and
        # only that user (or ptrace-capable root, which a sandbox's root is not) may reach their pty
        self.ptys: dict[tuple[str, int], str] = {}

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
        acct = await self.users.account(sb, user_of(request.headers.get("Authorization")))
        line = await self.users.command(sb, cfg["cmd"], args)
        pty = body.get("pty")
        if pty is not None:
            rows, cols = _pty_size(pty)
            line = f"exec {PTY_RELAY} --pty {rows} {cols} {line}"
        timeout_ms = request.headers.get("Connect-Timeout-Ms", "")
        req = ExecRequest(
            cmd=line, envs={"HOME": acct.home, "USER": acct.name, "LOGNAME": acct.name, **envs},
            cwd=resolve(cfg["cwd"], acct.home) if cfg.get("cwd") else acct.home,
            timeout_s=int(timeout_ms) / 1000 if timeout_ms.isdigit() else 0.0, background=True,
            user=acct.name if acct.uid != 0 else "", stdin=bool(body.get("stdin")) or pty is not None, tag=str(body.get("tag") or ""),
        )
        async with _Inbox(sb) as ib:
            req.stream_to = ib.inbox
            started: ProcessStarted = await sb._request("exec", req, ProcessStarted)
            if pty is not None:
                self.ptys[(sb.sandbox_id, started.pid)] = req.user
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
        out = "pty" if (sb.sandbox_id, pid) in self.ptys else "stdout"
        try:
            await stream.send({"event": {"start": {"pid": pid}}})
            while True:
                try:
                    m = await asyncio.wait_for(ib.q.get(), every)
                except TimeoutError:
                    await stream.send({"event": {"keepalive": {}}})
                    continue
                if isinstance(m, ExecChunk):
                    await stream.send({"event": {"data": {out if m.stream == 1 else "stderr": base64.b64encode(m.data).decode()}}})
                    continue
                if m.timed_out:
                    return await stream.close(ConnectError("deadline_exceeded", "the command ran past its timeout and was killed"))
                if (m.signal == 9 or m.exit_code < 0) and await _sandbox_ended(sb):
                    # As envd's stream when its sandbox goes: the SDK's health probe then names the cause.
                    return await stream.close(ConnectError("unavailable", f"the connection to sandbox {sb.sandbox_id} ended before the stream completed"))
                self.ptys.pop((sb.sandbox_id, pid), None)
                await stream.send({"event": {"end": _end(m)}})
                return await stream.close()
        except (ConnectionResetError, asyncio.CancelledError):
            log.info("process_stream_left", sandbox_id=sb.sandbox_id, pid=pid)
            with contextlib.suppress(Exception):
                await sb._request("proc", ProcDisconnect(pid=pid, stream_to=ib.inbox), Done, timeout=5)
            raise

    async def _resize(self, sb: AsyncSandbox, pid: int, tag: str, pty: Any) -> dict[str, Any]:
        """Update: a PTY session's new size (the relay's command sees SIGWINCH)."""
        if pty is None:
            return {}  # nothing to change
        rows, cols = _pty_size(pty)
        if not pid:
            listed: ProcessList = await sb._request("proc", ProcList(), ProcessList)
            pid = next((p.pid for p in listed.processes if p.tag == tag), 0)
        if (sb.sandbox_id, pid) not in self.ptys:
            raise ConnectError("not_found", f"process {pid or tag!r} is not a PTY session of this gateway")
        user = self.ptys[(sb.sandbox_id, pid)]
        resize = ExecRequest(cmd=f"{PTY_RELAY} --pty-resize {pid} {rows} {cols}", timeout_s=10, user=user)
        res: ExecResult = await sb._request("exec", resize, ExecResult, timeout=20)
        if res.exit_code != 0:
            raise ConnectError("not_found", f"process {pid}: {res.stderr.decode(errors='replace').strip()}")
        return {}

    async def unary(self, method: str, sb: AsyncSandbox, body: dict[str, Any]) -> dict[str, Any]:
        if method not in ("List", "SendSignal", "SendInput", "CloseStdin", "Update"):
            raise ConnectError("unimplemented", f"process.Process/{method} is not implemented by dsec's gateway yet")
        if method == "List":
            res: ProcessList = await sb._request("proc", ProcList(), ProcessList)
            return {"processes": [
                {"config": {"cmd": p.cmd, "envs": p.envs, "cwd": p.cwd}, "pid": p.pid, **({"tag": p.tag} if p.tag else {})} for p in res.processes
            ]}
        pid, tag = _selector(body)
        if method == "Update":
            return await self._resize(sb, pid, tag, body.get("pty"))
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
