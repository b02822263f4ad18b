"""WebSocket to a server inside a sandbox: the gateway ends the client's WebSocket (aiohttp) and
opens its own to the sandbox's server over a relayed port connection (``_ports.PortConnection``),
then passes messages both ways.

Ending it here, rather than passing bytes through after the handshake, keeps the relay on aiohttp's
public API and lets each side negotiate what it supports (the sandbox side: no extensions). The
upstream side is RFC 6455's client role: its frames are masked, the server's are not.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import os
import struct
from collections.abc import Awaitable, Callable
from aiohttp import WSCloseCode, WSMsgType, web

from ._ports import HOP, STRIP, PortConnection, bad_gateway, copy_response

WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
MAX_MESSAGE = 64 << 20  # bytes of one message (either way); a bigger one closes with 1009
HANDSHAKE_TIMEOUT_S = 30.0
# Headers that belong to one hop's handshake: each side makes its own.
_HANDSHAKE = {"sec-websocket-key", "sec-websocket-accept", "sec-websocket-extensions", "sec-websocket-version", "sec-websocket-protocol"}

OP_CONT, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
Send = Callable[[bytes], Awaitable[None]]


class FrameError(Exception):
    """The sandbox's server broke the WebSocket framing; ``code`` is the close code to send."""

    def __init__(self, why: str, code: int = WSCloseCode.PROTOCOL_ERROR) -> None:
        super().__init__(why)
        self.code = code


def is_upgrade(request: web.Request) -> bool:
    return request.headers.get("Upgrade", "").lower() == "websocket" and "upgrade" in request.headers.get("Connection", "").lower()


def accept_of(key: str) -> str:
    return base64.b64encode(hashlib.sha1(key.encode() + WS_GUID).digest()).decode()


def _mask(data: bytes, key: bytes) -> bytes:
    n = len(data)
    if not n:
        return data
    stream = (key * (n // 4 + 1))[:n]
    return (int.from_bytes(data, "big") ^ int.from_bytes(stream, "big")).to_bytes(n, "big")


def encode_frame(opcode: int, payload: bytes) -> bytes:
    """One final, masked frame (the client's role)."""
    n = len(payload)
    if n < 126:
        head = struct.pack("!BB", 0x80 | opcode, 0x80 | n)
    elif n < 1 << 16:
        head = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, n)
    else:
        head = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, n)
    key = os.urandom(4)
    return head + key + _mask(payload, key)


async def read_frame(reader: asyncio.StreamReader) -> tuple[bool, int, bytes]:
    """(fin, opcode, payload) of the server's next frame."""
    b0, b1 = await reader.readexactly(2)
    if b0 & 0x70:
        raise FrameError("reserved bits set (no extension was negotiated)")
    n = b1 & 0x7F
    if n == 126:
        (n,) = struct.unpack("!H", await reader.readexactly(2))
    elif n == 127:
        (n,) = struct.unpack("!Q", await reader.readexactly(8))
    if n > MAX_MESSAGE:
        raise FrameError(f"a frame of {n} bytes is over {MAX_MESSAGE}", WSCloseCode.MESSAGE_TOO_BIG)
    key = await reader.readexactly(4) if b1 & 0x80 else b""
    payload = await reader.readexactly(n)
    return bool(b0 & 0x80), b0 & 0x0F, _mask(payload, key) if key else payload


def _upgrade_head(request: web.Request, path: str, port: int, key: str) -> bytes:
    lines = [f"GET {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Upgrade: websocket", "Connection: Upgrade",
             "Sec-WebSocket-Version: 13", f"Sec-WebSocket-Key: {key}"]
    protocols = request.headers.get("Sec-WebSocket-Protocol")
    if protocols:
        lines.append(f"Sec-WebSocket-Protocol: {protocols}")
    for k, v in request.headers.items():
        lk = k.lower()
        if lk in HOP or lk in STRIP or lk in _HANDSHAKE or lk == "host":
            continue
        lines.append(f"{k}: {v}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _headers_of(head: bytes) -> tuple[int, dict[str, str]]:
    status_line, *lines = head.decode("latin-1").split("\r\n")
    parts = status_line.split(" ", 2)
    status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    headers = {}
    for ln in filter(None, lines):
        k, _, v = ln.partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, headers


async def relay_websocket(request: web.Request, pc: PortConnection, port: int, path: str) -> web.StreamResponse:
    """The client's WebSocket joined to one with the server on ``port`` (``pc`` is open to it). A
    server that does not switch protocols has its HTTP answer relayed as it is."""
    key = base64.b64encode(os.urandom(16)).decode()
    await pc.send(_upgrade_head(request, path, port, key))
    try:
        head = await asyncio.wait_for(pc.reader.readuntil(b"\r\n\r\n"), HANDSHAKE_TIMEOUT_S)
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError):
        return bad_gateway(port, pc.error or "did not answer the WebSocket handshake")
    status, headers = _headers_of(head)
    if status != 101:
        return await copy_response(request, pc, port, head)
    if headers.get("sec-websocket-accept") != accept_of(key):
        return bad_gateway(port, "answered the WebSocket handshake with a wrong Sec-WebSocket-Accept")
    chosen = headers.get("sec-websocket-protocol", "")
    ws = web.WebSocketResponse(protocols=(chosen,) if chosen else (), max_msg_size=MAX_MESSAGE, autoping=True)
    await ws.prepare(request)
    lock = asyncio.Lock()

    async def send(frame: bytes) -> None:
        async with lock:  # both ways write to the server (messages, pongs): a frame over PIECE goes in several sends
            await pc.send(frame)

    down = asyncio.ensure_future(_server_to_client(pc, ws, send))
    try:
        await _client_to_server(ws, send)
    finally:
        if not down.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(down), 5.0)  # the server's close answer
            down.cancel()
        await ws.close()
    return ws


async def _client_to_server(ws: web.WebSocketResponse, send: Send) -> None:
    async for msg in ws:
        if msg.type == WSMsgType.TEXT:
            await send(encode_frame(OP_TEXT, msg.data.encode()))
        elif msg.type == WSMsgType.BINARY:
            await send(encode_frame(OP_BINARY, msg.data))
        elif msg.type == WSMsgType.ERROR:
            break
    code = ws.close_code or WSCloseCode.OK
    with contextlib.suppress(Exception):  # the server may be gone already
        await send(encode_frame(OP_CLOSE, struct.pack("!H", code)))


async def _server_to_client(pc: PortConnection, ws: web.WebSocketResponse, send: Send) -> None:
    parts: list[bytes] = []
    kind = 0
    try:
        while True:
            fin, op, payload = await read_frame(pc.reader)
            if op == OP_PING:
                await send(encode_frame(OP_PONG, payload))
                continue
            if op == OP_PONG:
                continue
            if op == OP_CLOSE:
                code = struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else WSCloseCode.OK
                await ws.close(code=code, message=payload[2:])
                return
            if op in (OP_TEXT, OP_BINARY):
                if parts:
                    raise FrameError("a new message before the last one ended")
                kind = op
            elif op != OP_CONT or not parts:
                raise FrameError(f"unexpected opcode {op:#x}")
            parts.append(payload)
            if sum(map(len, parts)) > MAX_MESSAGE:
                raise FrameError(f"a message over {MAX_MESSAGE} bytes", WSCloseCode.MESSAGE_TOO_BIG)
            if fin:
                data = b"".join(parts)
                parts, done_kind, kind = [], kind, 0
                if done_kind == OP_TEXT:
                    await ws.send_str(data.decode("utf-8", "replace"))
                else:
                    await ws.send_bytes(data)
    except FrameError as exc:
        with contextlib.suppress(Exception):
            await send(encode_frame(OP_CLOSE, struct.pack("!H", exc.code)))
        await ws.close(code=exc.code, message=str(exc).encode()[:120])
    except (asyncio.IncompleteReadError, ConnectionError):
        await ws.close(code=WSCloseCode.GOING_AWAY, message=b"the sandbox's server went away")


__all__ = ["is_upgrade", "relay_websocket", "encode_frame", "read_frame", "accept_of", "FrameError"]
