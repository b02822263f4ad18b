"""Core requests to live sandboxes (``dsec.sbx.<id>.<op>``), many at once on one connection.

nats-py's ``request`` hands each reply through its inbox subscription's queue and task, then
``asyncio.wait_for``, and draws random bytes per request; an RL step is an exec, so that is paid
on every step. Here one wildcard reply subscription per connection (``subscribe_sync``: no task)
resolves the request's future directly, a counter names each request, and the timeout is a timer.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bus.runtime import subscribe_sync, unsubscribe_quietly

NO_RESPONDERS = "503"


class Requests:
    """Requests of one connection, answered through ``<inbox>.<n>``."""

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self.prefix = ""
        self._n = itertools.count()
        self._futs: dict[str, asyncio.Future[Msg]] = {}
        self._sub: Any = None

    async def start(self) -> "Requests":
        if self._sub is None:
            self.prefix = self.nc.new_inbox() + "."
            self._sub = await subscribe_sync(self.nc, self.prefix + "*", self._on)
        return self

    def _on(self, msg: Msg) -> None:
        fut = self._futs.pop(msg.subject[len(self.prefix):], None)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    async def request(self, subject: str, data: bytes, timeout: float) -> Msg:
        """The reply, as ``nc.request`` gives it: ``nats.errors.TimeoutError`` past ``timeout``,
        ``NoRespondersError`` when nobody serves the subject, ``MaxPayloadError`` for a request too big."""
        token = str(next(self._n))
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Msg] = loop.create_future()
        self._futs[token] = fut
        timer = loop.call_later(timeout, _expire, fut)  # a plain timer: no task bookkeeping per request
        try:
            await self.nc.publish(subject, data, reply=self.prefix + token)
            msg = await fut
        finally:
            timer.cancel()
            self._futs.pop(token, None)
        if not msg.data and msg.headers and msg.headers.get("Status") == NO_RESPONDERS:
            raise nats.errors.NoRespondersError
        return msg

    async def stop(self) -> None:
        for f in self._futs.values():
            if not f.done():
                f.cancel()
        self._futs.clear()
        sub, self._sub = self._sub, None
        await unsubscribe_quietly(sub)


def _expire(fut: "asyncio.Future[Msg]") -> None:
    if not fut.done():
        fut.set_exception(nats.errors.TimeoutError())


_shared: dict[int, Requests] = {}


async def requests_for(nc: NATS) -> Requests:
    """The connection's one ``Requests`` (every sandbox object on it shares the reply subscription)."""
    r = _shared.get(id(nc))
    if r is None or r.nc is not nc:
        r = _shared[id(nc)] = Requests(nc)
    return await r.start()


async def release_requests(nc: NATS) -> None:
    r = _shared.pop(id(nc), None)
    if r is not None:
        await r.stop()


__all__ = ["Requests", "requests_for", "release_requests"]
