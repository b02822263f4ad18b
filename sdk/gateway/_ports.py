"""Sandbox ports (``sb.get_host(port)``): HTTP to a server inside the sandbox, through the bus.

The gateway never touches the sandbox's network: it asks the sandbox's host agent to open a TCP
connection inside the sandbox (``dsec.sbx.<id>.port``) and relays bytes over NATS. Each HTTP
request is one connection (``Connection: close``); the response is parsed just enough to stream it
back (status, headers, a Content-Length, chunked or until-close body). A WebSocket upgrade is
joined to one with the server (``_websocket``). A client that cannot send headers (OpenEnv's, whose
base URL is all it takes) names the sandbox and port in the path, ``/v1/sandboxes/<id>/ports/<port>/...``,
and its key as the URL's password (HTTP Basic).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from aiohttp import web

from bus import codec
from bus.errors import DsecError, PortClosed
from bus.messages import Done, PortData, PortOpen, PortOpened, PortSend

from .._async import AsyncSandbox

PIECE = 256 * 1024
MAX_HEAD = 64 * 1024
MAX_BUFFERED_BODY = 64 * 1024 * 1024  # a request body without Content-Length is read whole, up to this
HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "content-length"}
STRIP = {"x-api-key", "x-access-token", "e2b-traffic-access-token", "e2b-sandbox-id", "e2b-sandbox-port", "authorization"}


class PortConnection:
    """One relayed TCP connection: ``send`` bytes, read the server's from ``reader``."""

    def __init__(self, sb: AsyncSandbox) -> None:
        self.sb = sb
        self.reader = asyncio.StreamReader(limit=MAX_HEAD)
        self.conn = ""
        self.sub: Any = None
        self._next = 0
        self._early: dict[int, PortData] = {}
        self.error = ""

    def _on(self, d: PortData) -> None:
        # Core NATS keeps one publisher's order, but reorder anyway: seq is the contract.
        self._early[d.seq] = d
        while self._next in self._early:
            m = self._early.pop(self._next)
            self._next += 1
            if m.data:
                self.reader.feed_data(m.data)
            if m.eof:
                self.error = m.error
                self.reader.feed_eof()

    async def open(self, port: int) -> None:
        nc = self.sb.nc
        inbox = nc.new_inbox()

        async def cb(msg: Any) -> None:
            try:
                self._on(codec.PORT_DATA.decode(msg.data))
            except DsecError:
                pass

        self.sub = await nc.subscribe(inbox, cb=cb)
        try:
            self.conn = (await self.sb._request("port", PortOpen(port=port, to=inbox), PortOpened)).conn
        except BaseException:
            await self.sub.unsubscribe()
            raise

    async def send(self, data: bytes = b"", *, eof: bool = False) -> None:
        for i in range(0, max(len(data), 1), PIECE):
            await self.sb._request("port", PortSend(conn=self.conn, data=data[i:i + PIECE], eof=eof and i + PIECE >= len(data)), Done)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            if self.conn:
                await self.sb._request("port", PortSend(conn=self.conn, close=True), Done, timeout=5)
        with contextlib.suppress(Exception):
            if self.sub is not None:
                await self.sub.unsubscribe()


def _request_head(request: web.Request, port: int, path: str, body_len: int | None) -> bytes:
    lines = [f"{request.method} {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Connection: close"]
    for k, v in request.headers.items():
        lk = k.lower()
        if lk in HOP or lk in STRIP or lk == "host":
            continue
        lines.append(f"{k}: {v}")
    if body_len is not None:
        lines.append(f"Content-Length: {body_len}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def _copy_chunked(reader: asyncio.StreamReader, resp: web.StreamResponse) -> None:
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            with contextlib.suppress(asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                while (await reader.readuntil(b"\r\n")) != b"\r\n":
                    pass  # trailers
            return
        left = size
        while left:
            piece = await reader.read(min(left, PIECE))
            if not piece:
                raise asyncio.IncompleteReadError(b"", left)
            await resp.write(piece)
            left -= len(piece)
        await reader.readexactly(2)


def bad_gateway(port: int, why: str) -> web.Response:
    return web.json_response({"code": 502, "message": f"the server on port {port} {why}"}, status=502)


async def _send_request(pc: PortConnection, request: web.Request, port: int, path: str) -> web.Response | None:
    """The request, head and body, to the sandbox's server; a response when it cannot be sent."""
    if request.content_length is not None:
        await pc.send(_request_head(request, port, path, request.content_length))
        while chunk := await request.content.read(PIECE):
            await pc.send(chunk)
    elif request.body_exists:
        body = await request.content.read(MAX_BUFFERED_BODY + 1)
        if len(body) > MAX_BUFFERED_BODY:
            return web.json_response({"code": 413, "message": "request body without Content-Length is over 64 MiB"}, status=413)
        await pc.send(_request_head(request, port, path, len(body)) + body)
    else:
        await pc.send(_request_head(request, port, path, None))
    return None


def _response_head(head: bytes) -> tuple[web.StreamResponse, int | None, bool] | None:
    """(response with status and end-to-end headers, Content-Length, chunked) of an HTTP/1.x head."""
    status_line, *hdr_lines = head.decode("latin-1").split("\r\n")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[1].isdigit():
        return None
    resp = web.StreamResponse(status=int(parts[1]), reason=parts[2] if len(parts) > 2 else None)
    length: int | None = None
    chunked = False
    for ln in filter(None, hdr_lines):
        k, _, v = ln.partition(":")
        lk, v = k.strip().lower(), v.strip()
        if lk == "content-length" and v.isdigit():
            length = int(v)
        elif lk == "transfer-encoding" and "chunked" in v.lower():
            chunked = True
        if lk not in HOP:
            resp.headers.add(k.strip(), v)
    return resp, length, chunked


async def _copy_body(reader: asyncio.StreamReader, resp: web.StreamResponse, length: int | None) -> None:
    left = length
    while left is None or left > 0:
        piece = await reader.read(PIECE if left is None else min(PIECE, left))
        if not piece:
            break
        await resp.write(piece)
        if left is not None:
            left -= len(piece)


async def copy_response(request: web.Request, pc: PortConnection, port: int, head: bytes) -> web.StreamResponse:
    """The server's response whose head is ``head``, its body streamed from ``pc``."""
    parsed = _response_head(head)
    if parsed is None:
        return bad_gateway(port, "did not answer HTTP")
    resp, length, chunked = parsed
    if length is not None and not chunked:
        resp.content_length = length
    await resp.prepare(request)
    if chunked:
        await _copy_chunked(pc.reader, resp)
    else:
        await _copy_body(pc.reader, resp, length)
    await resp.write_eof()
    return resp


class Ports:
    async def relay(self, request: web.Request, sb: AsyncSandbox, port: int, path: str | None = None) -> web.StreamResponse:
        """``request`` to the server on ``port`` in ``sb``, as ``path`` (default: the request's own)."""
        from ._websocket import is_upgrade, relay_websocket  # it builds on this module's connection

        if not 1 <= port <= 65535:
            return web.json_response({"code": 400, "message": f"port must be 1..65535, got {port}"}, status=400)
        path = path or request.raw_path
        pc = PortConnection(sb)
        try:
            await pc.open(port)
        except PortClosed as exc:  # E2B's proxy words it "port is not open"
            msg = f"The sandbox is running but port is not open ({exc.description})"
            return web.json_response({"code": 502, "message": msg, "sandboxId": sb.sandbox_id, "port": port}, status=502)
        try:
            if is_upgrade(request):
                return await relay_websocket(request, pc, port, path)
            refused = await _send_request(pc, request, port, path)
            if refused is not None:
                return refused
            try:
                head = await pc.reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                return bad_gateway(port, pc.error or "closed the connection without an HTTP response")
            return await copy_response(request, pc, port, head)
        finally:
            await pc.close()
