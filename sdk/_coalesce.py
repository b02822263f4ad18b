"""Concurrent single creates on one connection share request messages.

A create stores one request on ``DSEC_REQ``; on a replicated cluster storing it, acking it and
removing it are each a Raft round, which bounds single creates per second. A client that makes many
creates at once (a rollout worker filling its group, the gateway serving many callers) stores them
as it goes: while ``MAX_IN_FLIGHT`` stores of one connection wait for their acks, the creates that
come meanwhile queue and go together as one ``CreateBatch`` when a store returns. A create with
nothing in flight is stored alone at once, as before, so coalescing adds no wait, and every create
keeps its own id, events, outcome and error. (Kafka's producer batches the same way, by in-flight
requests, with ``linger.ms`` 0.)
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable

from bus.messages import SandboxSpec

MAX_IN_FLIGHT = 2  # stores of one connection's single creates in flight before the next ones queue
MAX_SPECS = 256  # specs per coalesced request (its bytes are checked too: Store splits what is too big)

# store(specs, batch_id): the specs stored as ONE request (a CreateSandbox for one, else a CreateBatch)
Store = Callable[[list[SandboxSpec], str], Awaitable[None]]


class CreateCoalescer:
    """One per connection: ``store(spec)`` returns once the request naming ``spec`` is stored."""

    __slots__ = ("_store", "_in_flight", "_queue", "_tasks", "stored", "messages")

    def __init__(self, store: Store) -> None:
        self._store = store
        self._in_flight = 0
        self._queue: list[tuple[SandboxSpec, asyncio.Future[None]]] = []
        self._tasks: set[asyncio.Task[None]] = set()  # the loop holds tasks weakly: a queued store must not vanish
        self.stored = 0  # creates stored, and the request messages they took (benchmarks print both)
        self.messages = 0

    async def store(self, spec: SandboxSpec) -> None:
        if self._in_flight < MAX_IN_FLIGHT and not self._queue:
            self._in_flight += 1
            try:
                await self._send([spec])
            finally:
                self._done()
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (spec, fut)
        self._queue.append(entry)
        try:
            await fut
        except asyncio.CancelledError:
            if entry in self._queue:  # not taken yet: it is never stored
                self._queue.remove(entry)
            raise

    async def _send(self, specs: list[SandboxSpec]) -> None:
        await self._store(specs, "" if len(specs) == 1 else f"cb-{uuid.uuid4().hex[:20]}")
        self.stored += len(specs)
        self.messages += 1

    def _done(self) -> None:
        self._in_flight -= 1
        if self._queue and self._in_flight < MAX_IN_FLIGHT:
            take, self._queue = self._queue[:MAX_SPECS], self._queue[MAX_SPECS:]
            self._in_flight += 1
            t = asyncio.ensure_future(self._send_queued(take))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    async def _send_queued(self, take: list[tuple[SandboxSpec, asyncio.Future[None]]]) -> None:
        try:
            await self._send([s for s, _ in take])
        except BaseException as exc:  # noqa: BLE001 - every waiter of the message gets its error
            for _, fut in take:
                if not fut.done():
                    fut.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
        else:
            for _, fut in take:
                if not fut.done():
                    fut.set_result(None)
        finally:
            self._done()


__all__ = ["CreateCoalescer", "MAX_IN_FLIGHT", "MAX_SPECS"]
