"""Sandbox ports: TCP connections to servers inside a sandbox, relayed over NATS (``dsec.sbx.<id>.port``).

The host agent opens the connection itself, from a short-lived thread that enters the sandbox's
network namespace only to create and connect the socket, so the sandbox needs no route in or out:
its network stays closed and only holders of the sandbox's subjects (the gateway, for its key)
reach the port. Bytes from the server go to the opener's inbox as ``PortData`` in order; bytes
for it come as ``PortSend`` requests, answered once written (that is the flow control).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import socket
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from bus import codec
from bus import subjects as S
from bus.errors import BadRequest, InvalidArgument, NotSupported, PortClosed
from bus.messages import Done, PortData, PortOpen, PortOpened, PortSend

from ._backend import Handle

log = structlog.get_logger("dsec.hostagent.ports")

CLONE_NEWNET = 0x40000000
READ_SIZE = 256 * 1024  # under NATS's max payload with room for the envelope
MAX_CONNS_PER_SANDBOX = 256
CONNECT_TIMEOUT_S = 5.0
IDLE_S = 600.0  # a relayed connection nobody used for this long is closed

_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def connect_in_netns(pid: int, port: int) -> socket.socket:
    """A TCP socket connected to 127.0.0.1:port in the network namespace of process ``pid``.

    setns(2) moves only the calling thread, so a fresh thread does it and dies afterwards: no pool
    thread is ever left in a sandbox's namespace, even if switching back failed."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            target = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            out["err"] = exc
            return
        try:
            _setns(target)
            out["sock"] = socket.create_connection(("127.0.0.1", port), timeout=CONNECT_TIMEOUT_S)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            out["err"] = exc
        finally:
            os.close(target)

    t = threading.Thread(target=run, name=f"netns-connect-{pid}", daemon=True)
    t.start()
    t.join()
    if "err" in out:
        raise out["err"]
    s: socket.socket = out["sock"]
    s.setblocking(False)
    return s


@dataclass
class _Conn:
    sandbox_id: str
    to: str
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    pump: asyncio.Task[None] | None = None
    used: float = field(default_factory=lambda: asyncio.get_running_loop().time())


class PortRelay:
    def __init__(self, nc_of: Callable[[], Any]) -> None:
        self._nc_of = nc_of  # the host agent's connection (made after this)
        self.conns: dict[str, _Conn] = {}

    async def handle(self, handle: Handle, req: Any) -> Any:
        match req:
            case PortOpen(port=port, to=to):
                return await self._open(handle, port, to)
            case PortSend(conn=cid, data=data, eof=eof, close=close):
                c = self.conns.get(cid)
                if c is None or c.sandbox_id != handle.sandbox_id:
                    raise InvalidArgument(f"no open port connection {cid!r} in sandbox {handle.sandbox_id}")
                c.used = asyncio.get_running_loop().time()
                if close:
                    await self._close(cid)
                    return Done(detail="closed")
                try:
                    if data:
                        c.writer.write(data)
                        await c.writer.drain()
                    if eof and c.writer.can_write_eof():
                        c.writer.write_eof()
                except (ConnectionError, OSError) as exc:
                    await self._close(cid)
                    raise PortClosed(f"the sandbox's server closed the connection: {exc}") from None
                return Done()
        raise BadRequest(f"unsupported port operation {type(req).__name__}")

    async def _open(self, handle: Handle, port: int, to: str) -> PortOpened:
        if not 1 <= port <= 65535:
            raise InvalidArgument(f"port must be 1..65535, got {port}")
        if not S.valid_inbox(to):
            raise BadRequest(f"to must be an _INBOX subject, got {to!r}")  # never publish on control subjects for a client
        if not handle.pid:
            raise NotSupported("this sandbox's backend has no network namespace to reach ports in")
        if sum(1 for c in self.conns.values() if c.sandbox_id == handle.sandbox_id) >= MAX_CONNS_PER_SANDBOX:
            raise InvalidArgument(f"sandbox {handle.sandbox_id} already has {MAX_CONNS_PER_SANDBOX} open port connections")
        try:
            sock = await asyncio.to_thread(connect_in_netns, handle.pid, port)
        except ConnectionRefusedError:
            raise PortClosed(f"nothing listens on port {port} in sandbox {handle.sandbox_id}") from None
        except (TimeoutError, OSError) as exc:
            raise PortClosed(f"cannot connect to port {port} in sandbox {handle.sandbox_id}: {exc}") from None
        reader, writer = await asyncio.open_connection(sock=sock, limit=READ_SIZE)
        cid = uuid.uuid4().hex
        c = self.conns[cid] = _Conn(sandbox_id=handle.sandbox_id, to=to, reader=reader, writer=writer)
        c.pump = asyncio.create_task(self._pump(cid, c))
        return PortOpened(conn=cid)

    async def _pump(self, cid: str, c: _Conn) -> None:
        """The server's bytes to the opener, then its EOF. The connection stays writable after the
        server's EOF (a half close) until the opener closes it or it idles out."""
        seq = 0
        error = ""
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    data = await asyncio.wait_for(c.reader.read(READ_SIZE), IDLE_S)
                except TimeoutError:
                    if loop.time() - c.used >= IDLE_S:
                        error = "idle"
                        break
                    continue
                if not data:
                    break
                c.used = loop.time()
                await self._nc_of().publish(c.to, codec.encode(PortData(conn=cid, seq=seq, data=data)))
                seq += 1
        except (ConnectionError, OSError) as exc:
            error = str(exc)
        with contextlib.suppress(Exception):
            await self._nc_of().publish(c.to, codec.encode(PortData(conn=cid, seq=seq, eof=True, error=error)))
        while not error and self.conns.get(cid) is c and (left := c.used + IDLE_S - loop.time()) > 0:
            await asyncio.sleep(left)  # until the opener closes it or it idles out
        if self.conns.get(cid) is c:
            self.conns.pop(cid, None)
            c.writer.close()

    async def _close(self, cid: str) -> None:
        c = self.conns.pop(cid, None)
        if c is None:
            return
        c.writer.close()
        if c.pump is not None:
            c.pump.cancel()

    async def drop(self, sandbox_id: str) -> None:
        """Close every relayed connection of a sandbox going away."""
        for cid in [k for k, c in self.conns.items() if c.sandbox_id == sandbox_id]:
            await self._close(cid)


__all__ = ["PortRelay", "connect_in_netns"]
