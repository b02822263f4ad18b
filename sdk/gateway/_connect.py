"""The Connect protocol (connectrpc.com/docs/protocol) with the JSON codec, as envd speaks it.

Unary calls: ``POST /<package>.<Service>/<Method>`` with ``application/json`` both ways; an error is
an HTTP status plus ``{"code": "<connect code>", "message": ...}``. Server streams:
``application/connect+json``, every message in a 5-byte envelope (flags, big-endian length); the
last envelope has flag 0x02 and carries ``{}`` or ``{"error": {...}}``.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from aiohttp import web

from bus.errors import DsecError

END_STREAM = 0x02
COMPRESSED = 0x01
MAX_REQUEST_BYTES = 4 * 1024 * 1024  # an envd request is a small JSON document

# Connect code -> HTTP status of a unary error (the protocol's table).
HTTP_STATUS = {
    "canceled": 499, "unknown": 500, "invalid_argument": 400, "deadline_exceeded": 504, "not_found": 404,
    "already_exists": 409, "permission_denied": 403, "resource_exhausted": 429, "failed_precondition": 400,
    "aborted": 409, "out_of_range": 400, "unimplemented": 501, "internal": 500, "unavailable": 503,
    "data_loss": 500, "unauthenticated": 401,
}

# An error's HTTP status (declared by its class, bus.errors) -> the Connect code that means the same
# (the e2b SDK branches on NOT_FOUND, ALREADY_EXISTS, ...); any other status: "unknown".
_CODE_OF_STATUS = {
    400: "invalid_argument", 401: "unauthenticated", 403: "permission_denied", 404: "not_found", 409: "failed_precondition",
    413: "resource_exhausted", 429: "resource_exhausted", 501: "unimplemented", 503: "unavailable", 504: "deadline_exceeded",
}


class ConnectError(Exception):
    """An error to send the Connect way."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    @classmethod
    def of(cls, exc: BaseException) -> ConnectError:
        if isinstance(exc, ConnectError):
            return exc
        if isinstance(exc, DsecError):
            if exc.code == "sandbox_not_found":  # gone mid-stream: what the e2b SDK reads as SandboxNotRunning
                return cls("unavailable", f"The sandbox was not found: {exc.description}")
            return cls("internal" if exc.code == "internal" else _CODE_OF_STATUS.get(exc.http_status, "unknown"), exc.description)
        return cls("internal", f"{type(exc).__name__}: {exc}")

    def body(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


def envelope(doc: dict[str, Any], flags: int = 0) -> bytes:
    data = json.dumps(doc, separators=(",", ":")).encode()
    return struct.pack(">BI", flags, len(data)) + data


def unary_error(err: ConnectError) -> web.Response:
    return web.json_response(err.body(), status=HTTP_STATUS.get(err.code, 500))


async def read_request(request: web.Request) -> dict[str, Any]:
    """The request message of a unary or server-streaming call, as a JSON object."""
    ctype = request.content_type
    if request.content_length is not None and request.content_length > MAX_REQUEST_BYTES:
        raise ConnectError("resource_exhausted", f"request of {request.content_length} bytes is over the {MAX_REQUEST_BYTES} limit")
    raw = await request.content.read(MAX_REQUEST_BYTES + 6)
    if len(raw) > MAX_REQUEST_BYTES + 5:
        raise ConnectError("resource_exhausted", f"request is over the {MAX_REQUEST_BYTES} bytes limit")
    if ctype == "application/connect+json":
        if len(raw) < 5:
            raise ConnectError("invalid_argument", "streaming request without a 5-byte envelope")
        flags, n = struct.unpack(">BI", raw[:5])
        if flags & COMPRESSED:
            raise ConnectError("unimplemented", "compressed messages are not accepted (send identity)")
        raw = raw[5:5 + n]
    elif ctype != "application/json":
        raise ConnectError("invalid_argument", f"content type {ctype!r}: this server speaks the Connect protocol with the JSON codec")
    try:
        doc = json.loads(raw or b"{}")
    except ValueError as exc:
        raise ConnectError("invalid_argument", f"request is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ConnectError("invalid_argument", "request must be a JSON object")
    return doc


class ServerStream:
    """A server-streaming response: ``send`` messages, then ``close`` (optionally with an error)."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.resp = web.StreamResponse(status=200, headers={"Content-Type": "application/connect+json"})
        self.started = False
        self.closed = False

    async def start(self) -> None:
        if not self.started:
            self.started = True
            await self.resp.prepare(self.request)

    async def send(self, doc: dict[str, Any]) -> None:
        await self.start()
        await self.resp.write(envelope(doc))

    async def close(self, err: ConnectError | None = None) -> web.StreamResponse:
        if not self.closed:
            self.closed = True
            await self.start()
            await self.resp.write(envelope({"error": err.body()} if err else {}, END_STREAM))
            await self.resp.write_eof()
        return self.resp


__all__ = ["END_STREAM", "HTTP_STATUS", "ConnectError", "ServerStream", "envelope", "read_request", "unary_error"]
