"""Hand-offs: work given to one named taker over a core subject, answered on the reply subject once
whatever it led to is durable. The work itself stays durable where it came from: the giver holds the
JetStream message that asked for it, un-acked, until the answer comes, and lets it be redelivered if
none does.

Why not a stream per taker's work: a work-queue stream shared by every host checks each other
consumer for interest on every ack (nats-server ``stream.ackMsg`` -> ``checkForInterest``: half the
server's CPU with 1,600 hosts), a file-backed consumer rewrites its state file ten times a second, and
a stream per host is empty most of the time (the file store drops and makes a block file each time).
A hand-off costs one core message each way and nothing while idle.

The taker (``HandoffInbox``) answers ``done``, ``refused`` (with a code) or, for work still going on
after ``progress_s``, ``working`` every ``progress_s``. The giver (``Handoffs``) resolves the
hand-off's future on ``done``, fails it with ``HostUnreachable`` when nobody subscribes to the subject
(the server's no-responders status) or when the taker is silent for ``silence_s``, and with the
refusal's code otherwise. A refused or failed hand-off may still have been (partly) carried out:
taking the same work twice must be harmless (dsec's host agents claim ids in KV).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from .. import log as _log
from ..codec import HANDOFF_REPLY, encode
from ..errors import BadRequest, DsecError, ErrorReply, HostUnreachable, from_reply
from ..messages import HandoffReply
from ..subjects import is_stream_delivery
from .publisher import subscribe_sync, unsubscribe_quietly

logger = _log.get_logger("dsec.bus.handoff")

_DONE = encode(HandoffReply(state="done"))
_WORKING = encode(HandoffReply(state="working"))
SILENCE_S = 10.0  # a taker says "working" every PROGRESS_S well within this
PROGRESS_S = 3.0


class _Pending:
    __slots__ = ("fut", "deadline", "subject")

    def __init__(self, fut: asyncio.Future[None], deadline: float, subject: str) -> None:
        self.fut = fut
        self.deadline = deadline
        self.subject = subject


class Handoffs:
    """The giving side: ``await send(subject, data, headers)`` returns a future of the answer."""

    def __init__(self, nc: NATS, *, silence_s: float = SILENCE_S) -> None:
        self.nc = nc
        self.silence_s = silence_s
        self.prefix = ""
        self._n = itertools.count()
        self._pending: dict[str, _Pending] = {}
        self._sub: Subscription | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self.sent = 0
        self.failed = 0

    @property
    def inflight(self) -> int:
        return len(self._pending)

    async def start(self) -> "Handoffs":
        if self._sub is None:
            self.prefix = self.nc.new_inbox() + "."
            self._sub = await subscribe_sync(self.nc, self.prefix + "*", self._on_reply)
            self._sweeper = asyncio.ensure_future(self._sweep())
        return self

    async def send(self, subject: str, data: bytes, headers: dict[str, str] | None = None) -> asyncio.Future[None]:
        token = str(next(self._n))
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending[token] = _Pending(fut, time.monotonic() + self.silence_s, subject)
        self.sent += 1
        try:
            await self.nc.publish(subject, data, reply=self.prefix + token, headers=headers)
        except Exception as exc:  # noqa: BLE001 - the connection refused it: the caller sees it now
            self._fail(token, HostUnreachable(f"hand-off on {subject} not sent: {type(exc).__name__}: {exc}"))
        return fut

    def _on_reply(self, msg: Msg) -> None:
        token = msg.subject[len(self.prefix):]
        p = self._pending.get(token)
        if p is None:
            return  # answered already, or given up on
        hdrs = msg.headers
        if hdrs and hdrs.get("Status") == "503":
            self._fail(token, HostUnreachable(f"nobody takes work on {p.subject}"))
            return
        try:
            rep = HANDOFF_REPLY.decode(msg.data)
        except BadRequest as exc:
            self._fail(token, exc)
            return
        if rep.state == "working":
            p.deadline = time.monotonic() + self.silence_s
        elif rep.state == "done":
            del self._pending[token]
            if not p.fut.done():
                p.fut.set_result(None)
        else:
            self._fail(token, from_reply(ErrorReply(code=rep.code or "internal", description=rep.description or "hand-off refused")))

    def _fail(self, token: str, err: DsecError) -> None:
        p = self._pending.pop(token, None)
        if p is not None and not p.fut.done():
            self.failed += 1
            p.fut.set_exception(err)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(1.0)  # deadline granularity
            now = time.monotonic()
            for token in [t for t, p in self._pending.items() if p.deadline < now or p.fut.cancelled()]:
                p = self._pending[token]
                self._fail(token, HostUnreachable(f"no answer to a hand-off on {p.subject} for {self.silence_s:g}s"))

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        await unsubscribe_quietly(self._sub)
        self._sub = None
        for token in list(self._pending):
            self._fail(token, HostUnreachable("stopping: hand-off not answered"))


class HandoffInbox:
    """The taking side: ``handler(msg)`` for each hand-off on ``subject``, at most ``capacity`` at once,
    answered ``done`` when it returns, ``refused`` with its error when it raises.

    Stopping takes nothing more and refuses what waits for a slot (``refuse_code``), so its giver
    re-places it at once; what runs gets ``grace_s`` to finish (``finish``), as a pull consumer's work.
    """

    def __init__(
        self, nc: NATS, subject: str, handler: Callable[[Msg], Awaitable[None]], *, capacity: int, name: str = "",
        progress_s: float = PROGRESS_S, refuse_code: str = "unavailable",
    ) -> None:
        self.nc = nc
        self.subject = subject
        self.handler = handler
        self.capacity = max(1, capacity)
        self.name = name or subject
        self.progress_s = progress_s
        self.refuse_code = refuse_code
        self._slots = asyncio.Semaphore(self.capacity)
        self._taken: dict[int, tuple[Msg, float]] = {}  # waiting for a slot or running: told "working"
        self._tasks: set[asyncio.Task[None]] = set()
        self._sub: Subscription | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._stopping = False
        self.taken = 0
        self.stream_deliveries = 0

    @property
    def inflight(self) -> int:
        return len(self._tasks)

    async def start(self) -> None:
        self._sub = await subscribe_sync(self.nc, self.subject, self._on_msg)
        self._ticker = asyncio.ensure_future(self._tick())

    def _on_msg(self, msg: Msg) -> None:
        if is_stream_delivery(msg.reply):
            # A hand-off is a core message; a JetStream delivery onto this subject is someone's push
            # consumer aimed at it (bus.sign): never taken, never answered (its reply would ack it).
            self.stream_deliveries += 1
            logger.warning("stream_delivered_handoff_refused", taker=self.name, subject=msg.subject)
            return
        t = asyncio.get_running_loop().create_task(self._take(msg))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _take(self, msg: Msg) -> None:
        key = id(msg)
        self._taken[key] = (msg, time.monotonic())
        try:
            await self._run(msg)
        finally:
            self._taken.pop(key, None)

    async def _run(self, msg: Msg) -> None:
        async with self._slots:
            if self._stopping:
                await self._answer(msg, encode(HandoffReply(state="refused", code=self.refuse_code, description=f"{self.name} is stopping")))
                return
            self.taken += 1
            try:
                await self.handler(msg)
            except DsecError as exc:
                await self._answer(msg, encode(HandoffReply(state="refused", code=exc.code, description=exc.description)))
                return
            except Exception as exc:  # noqa: BLE001 - answer (the giver re-places it), keep taking work
                logger.exception("handoff_failed", taker=self.name, subject=msg.subject)
                await self._answer(msg, encode(HandoffReply(state="refused", code="internal", description=f"{type(exc).__name__}: {exc}")))
                return
            await self._answer(msg, _DONE)

    async def _answer(self, msg: Msg, data: bytes) -> None:
        if not msg.reply:
            return
        try:
            await self.nc.publish(msg.reply, data)
        except Exception as exc:  # noqa: BLE001 - the giver's deadline covers a lost answer
            logger.warning("handoff_answer_lost", taker=self.name, error=str(exc))

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.progress_s)  # progress period
            now = time.monotonic()
            for msg, since in list(self._taken.values()):
                if now - since >= self.progress_s:
                    await self._answer(msg, _WORKING)

    async def stop_intake(self) -> None:
        self._stopping = True
        await unsubscribe_quietly(self._sub)
        self._sub = None

    async def finish(self, grace_s: float) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=grace_s)
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None


__all__ = ["HandoffInbox", "Handoffs", "PROGRESS_S", "SILENCE_S"]
