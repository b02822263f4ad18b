"""Pipelined acknowledged JetStream publishes: one reply subscription, no task, timer or random token per write.

``js.publish`` makes a request per write (a timer and an inbox token from ``os.urandom``);
``js.publish_async`` never resolves its future when the stream answers with an error (nats-py 2.16).
Here every write gets a future resolved from one shared reply subscription, with the stream's
answer, an error, or a timeout (swept once a second).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

from nats.aio.client import Client as NATS


class StoreError(Exception):
    """The stream refused the write (its JSON error answer is the message)."""


class Sink:
    """Takes every message of a subscription made with ``future=``: no task per subscription.

    nats-py runs one task per callback subscription; one made with ``future=`` gets its messages
    handed over synchronously (``set_result``), which this object turns into a plain call.
    """

    __slots__ = ("fn",)

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def cancelled(self) -> bool:
        return False

    def done(self) -> bool:
        return False

    def set_result(self, msg: Any) -> None:
        self.fn(msg)


class JsAcks:
    def __init__(self, nc: NATS, *, timeout_s: float = 30.0) -> None:
        self.nc = nc
        self.timeout_s = timeout_s
        self.prefix = ""
        self._n = itertools.count()
        self._futs: dict[str, tuple[asyncio.Future[bytes], float]] = {}
        self._sub: Any = None
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self) -> "JsAcks":
        if self._sub is None:
            self.prefix = self.nc.new_inbox() + "."
            self._sub = await self.nc.subscribe(self.prefix + "*", future=Sink(self._on_reply))  # type: ignore[arg-type]
            self._sweeper = asyncio.ensure_future(self._sweep())
        return self

    def _on_reply(self, msg: Any) -> None:
        entry = self._futs.pop(msg.subject[len(self.prefix):], None)
        if entry is None or entry[0].done():
            return
        fut = entry[0]
        if not msg.data:  # a status without a body: 503 no responders (no stream on that subject)
            fut.set_exception(StoreError(f"no stream answered (status {msg.headers.get('Status') if msg.headers else '?'})"))
        elif msg.data.startswith(b'{"error"') or b'"error":{' in msg.data:
            fut.set_exception(StoreError(msg.data.decode(errors="replace")[:300]))
        else:
            fut.set_result(msg.data)

    async def publish(self, subject: str, data: bytes, headers: dict[str, str] | None = None) -> "asyncio.Future[bytes]":
        """Send one write; the returned future holds the stream's answer (raw PubAck JSON)."""
        token = str(next(self._n))
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._futs[token] = (fut, time.monotonic() + self.timeout_s)
        try:
            await self.nc.publish(subject, data, reply=self.prefix + token, headers=headers)
        except BaseException:
            self._futs.pop(token, None)
            raise
        return fut

    async def store(self, subject: str, data: bytes, headers: dict[str, str] | None = None) -> bytes:
        """One acked write, awaited."""
        return await (await self.publish(subject, data, headers))

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(1.0)  # timeout sweep period
            now = time.monotonic()
            late = [t for t, (f, dl) in self._futs.items() if dl < now or f.done()]
            for t in late:
                f, _ = self._futs.pop(t)
                if not f.done():
                    f.set_exception(asyncio.TimeoutError(f"no answer from JetStream within {self.timeout_s}s"))

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for f, _ in self._futs.values():
            if not f.done():
                f.cancel()
        self._futs.clear()
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # noqa: BLE001 - connection closing
                pass
            self._sub = None


_shared: dict[int, JsAcks] = {}


async def acks_for(nc: NATS) -> JsAcks:
    """One pipeline per connection (many simulated hosts share a connection)."""
    a = _shared.get(id(nc))
    if a is None or a.nc is not nc:
        a = _shared[id(nc)] = JsAcks(nc)
    return await a.start()


async def release_acks(nc: NATS) -> None:
    """Stop and forget the pipeline of a connection that is being closed."""
    a = _shared.pop(id(nc), None)
    if a is not None:
        await a.stop()


__all__ = ["JsAcks", "Sink", "StoreError", "acks_for", "release_acks"]
