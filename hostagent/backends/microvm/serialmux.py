"""The host end of a microVM's agent link: QEMU's virtio-serial chardev socket (one byte stream)
split into the connections ``AgentClient`` makes to a unix socket of its own in the VM's dir, so the
agent protocol and its client stay the same as a container's. Frames and the reset handshake are
described with ``vm_mux`` in ``agent/dsec-agent.c``."""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct

LINK = 0xFFFFFFFF
CHUNK = 65536
_HDR = struct.Struct(">II")


class SerialMux:
    def __init__(self, chardev: str, listen: str) -> None:
        self.chardev = chardev
        self.listen = listen
        self.ready = asyncio.Event()
        self.closed = asyncio.Event()
        self._w: asyncio.StreamWriter | None = None
        self._server: asyncio.AbstractServer | None = None
        self._pump: asyncio.Task[None] | None = None
        self._chans: dict[int, asyncio.StreamWriter] = {}
        self._next = 1
        self._nonce = os.urandom(8)

    async def start(self, connect_timeout_s: float = 10.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + connect_timeout_s
        while True:  # QEMU creates the socket as it starts
            try:
                r, self._w = await asyncio.open_unix_connection(self.chardev)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if loop.time() >= deadline:
                    raise
                await asyncio.sleep(0.02)  # poll interval while QEMU comes up
        self._w.write(_HDR.pack(LINK, 8) + self._nonce)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.listen)
        self._server = await asyncio.start_unix_server(self._client, path=self.listen)
        os.chmod(self.listen, 0o600)
        self._pump = asyncio.create_task(self._read(r))

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):  # QEMU gone: the link's reset is no news
                await self._pump
        self._drop_all()
        if self._w is not None:
            self._w.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.listen)

    def _drop_all(self) -> None:
        for w in self._chans.values():
            w.close()
        self._chans.clear()
        self.closed.set()

    async def _read(self, r: asyncio.StreamReader) -> None:
        marker = _HDR.pack(LINK, 16) + b"DSECMUX1" + self._nonce
        buf = b""
        try:
            while marker not in buf:  # whatever precedes the answer to our reset is an earlier host's
                data = await r.read(CHUNK)
                if not data:
                    return
                buf = (buf + data)[-(CHUNK + len(marker)):]
            rest = buf.split(marker, 1)[1]
            self.ready.set()
            pending = bytearray(rest)
            while True:
                while len(pending) >= 8:
                    ch, n = _HDR.unpack_from(pending)
                    if len(pending) < 8 + n:
                        break
                    data = bytes(pending[8:8 + n])
                    del pending[:8 + n]
                    await self._deliver(ch, data)
                more = await r.read(CHUNK)
                if not more:
                    return
                pending += more
        finally:
            self._drop_all()

    async def _deliver(self, ch: int, data: bytes) -> None:
        w = self._chans.get(ch)
        if w is None or ch == LINK:
            return
        if not data:
            self._chans.pop(ch, None)
            w.close()
            return
        w.write(data)
        try:
            await w.drain()
        except ConnectionError:
            self._chans.pop(ch, None)
            self._send(ch, b"")

    def _send(self, ch: int, data: bytes) -> None:
        if self._w is not None and not self._w.is_closing():
            self._w.write(_HDR.pack(ch, len(data)) + data)

    async def _client(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        if self.closed.is_set():
            w.close()
            return
        ch = self._next
        self._next = self._next % (LINK - 1) + 1
        self._chans[ch] = w
        try:
            while True:
                data = await r.read(CHUNK)
                if ch not in self._chans:  # the agent closed its end
                    break
                self._send(ch, data)
                if not data:
                    break
                assert self._w is not None
                await self._w.drain()
        except ConnectionError:
            self._send(ch, b"")
        finally:
            if self._chans.pop(ch, None) is not None:
                w.close()


__all__ = ["SerialMux"]
