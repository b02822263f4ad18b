"""Pipelined acknowledged JetStream publishes, with the stream's answer decoded into a ``PubAck``.

``js.publish`` makes a request per write (a timer and an inbox token from ``os.urandom``), and
``js.publish_async`` never resolves its future when the stream answers with an error
(nats-io/nats.py#985: ``APIError.from_error`` raises inside the reply handler, the future is left
pending forever). Here every write gets a future resolved from one shared reply subscription per
connection: with the decoded ``PubAck``, a ``StoreError``, or a timeout (swept once a second).
At most ``max_inflight`` writes wait for their answer; the next ``publish`` waits for a free slot.

``fire`` is a core publish (no ack round trip on a hot path) that a stream still records and
de-duplicates by its ``Nats-Msg-Id``. A core publish in flight when the connection drops is lost,
and so is one that reaches a restarted server before it has loaded its streams again: each is
remembered for ``REFIRE_WINDOW_S`` and, after a reconnect, stored again, acked (the stream drops the
copies it already holds).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.protocol.command import sub_cmd

from .. import subjects as S
from ..streams import default_replicas

DEFAULT_MAX_INFLIGHT = 8192
REFIRE_WINDOW_S = 10.0  # a core publish older than this before a disconnect was surely delivered
REFIRE_ATTEMPTS = 30  # stores again after a reconnect: each attempt waits 0.25-2 s (jittered) on a failure
# A write that no stream answered (503 "no responders") is tried again a few times: in a cluster that
# is a stream between leaders (a node lost, an election under way), seconds at most. Bounded so that a
# subject no stream takes still fails, within ~3 s; jittered so that many writers do not come back together.
STORE_RETRY_ATTEMPTS = 5
FIRE_ACK_TIMEOUT_S = 5.0  # an acked fire not answered within this is stored again (see ``fire``)
STORE_RETRY_BASE_S = 0.1
STORE_RETRY_CAP_S = 1.6
ERR_WRONG_LAST_SEQUENCE = 10071  # JetStream: "wrong last sequence" (a KV create/update lost its race)
# Atomic batch publish (nats-server 2.12+, a stream with allow_atomic): headers, and the server's
# default largest batch.
HDR_BATCH_ID = "Nats-Batch-Id"
HDR_BATCH_SEQUENCE = "Nats-Batch-Sequence"
HDR_BATCH_COMMIT = "Nats-Batch-Commit"
ATOMIC_BATCH_MAX = 1000


class PubAck(msgspec.Struct):
    """What the stream answers for a stored message (``duplicate``: de-duplicated by ``Nats-Msg-Id``)."""

    stream: str
    seq: int
    duplicate: bool = False
    domain: str = ""


class _ApiError(msgspec.Struct):
    code: int = 0
    err_code: int = 0
    description: str = ""


class _Answer(msgspec.Struct):
    stream: str = ""
    seq: int = 0
    duplicate: bool = False
    domain: str = ""
    error: _ApiError | None = None


_answer = msgspec.json.Decoder(_Answer)


class StoreError(Exception):
    """The stream refused the write, or no stream took it (``status`` 503: no responders)."""

    def __init__(self, description: str, *, status: int = 0, err_code: int = 0) -> None:
        super().__init__(description)
        self.description = description
        self.status = status
        self.err_code = err_code


ERR_JS_UNAVAILABLE = 10008  # JetStream: "JetStream system temporarily unavailable" (a cluster between meta leaders)


def no_responders(exc: StoreError) -> bool:
    """Nothing stored: no stream (or no stream leader, in a cluster) took the write; safe to send again."""
    return exc.status == 503 and exc.err_code in (0, ERR_JS_UNAVAILABLE)


def decode_puback(data: bytes) -> PubAck:
    """The stream's JSON answer as a ``PubAck``; an error answer raises ``StoreError``."""
    try:
        a = _answer.decode(data)
    except msgspec.DecodeError as exc:
        raise StoreError(f"undecodable JetStream answer: {data[:200]!r} ({exc})") from None
    if a.error is not None:
        raise StoreError(a.error.description or "stream error", status=a.error.code, err_code=a.error.err_code)
    return PubAck(stream=a.stream, seq=a.seq, duplicate=a.duplicate, domain=a.domain)


class _Sink:
    """Takes every message of a subscription made with ``future=``: no task per subscription.

    nats-py runs one task (and an asyncio.Queue) per callback subscription (nats-io/nats.py#58); a
    subscription made with ``future=`` gets each message handed over synchronously (``set_result``),
    which this object turns into a plain call. Thousands of subscriptions (one per sandbox) then cost
    no tasks at all. The callback must not block: it schedules its work.
    """

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[Msg], None]) -> None:
        self.fn = fn

    def cancelled(self) -> bool:
        return False

    def done(self) -> bool:
        return False

    def set_result(self, msg: Msg) -> None:
        self.fn(msg)


_NO_QUEUE: "asyncio.Queue[Msg]" = asyncio.Queue()  # never put to: a sink's messages are handed over, not queued


class _SinkSubscription(Subscription):
    """A ``Subscription`` whose messages go to a ``_Sink``: without the pending queue nats-py makes
    for every subscription (an ``asyncio.Queue`` each, a tenth of a host's work per sandbox in a
    batch of creates), which a sink never uses. The fields are those ``Subscription.__init__`` sets
    (nats-py 2.x); ``test_runtime_publisher`` runs messages and unsubscribes through one."""

    def __init__(self, conn: NATS, sid: int, subject: str, queue: str, sink: _Sink) -> None:
        self._conn = conn
        self._id = sid
        self._subject = subject
        self._queue = queue
        self._max_msgs = 0
        self._received = 0
        self._cb = None
        self._future = sink  # type: ignore[assignment]  # a Future stand-in: nats-py hands it each message (set_result)
        self._closed = False
        self._pending_msgs_limit = 0
        self._pending_bytes_limit = 0
        self._pending_queue = _NO_QUEUE
        self._pending_next_msgs_calls = {}
        self._pending_size = 0
        self._wait_for_msgs_task = None
        self._message_iterator = None
        self._jsi = None


async def subscribe_sync(nc: NATS, subject: str, fn: Callable[[Msg], None], *, queue: str = "") -> Subscription:
    """Subscribe ``fn`` (a plain function, called in the reading task: schedule, don't block) to ``subject``.

    What ``nc.subscribe`` does, but the SUB kicks the flusher only when no flush is queued yet:
    nats-py queues one flush per subscribe (as per publish before it learnt not to; see
    nats-io/nats.py#257), so a host making one subscription per sandbox during a burst paid an extra
    socket write for each. The SUB still leaves before anything published after it on the connection.
    """
    if not subject or " " in subject or "\t" in subject or "\n" in subject or "\r" in subject:
        raise nats.errors.BadSubjectError
    if queue and (" " in queue or "\t" in queue or "\n" in queue or "\r" in queue):
        raise nats.errors.BadSubjectError
    if nc.is_closed:
        raise nats.errors.ConnectionClosedError
    if nc.is_draining:
        raise nats.errors.ConnectionDrainingError
    nc._sid += 1
    sub = _SinkSubscription(nc, nc._sid, subject, queue, _Sink(fn))
    nc._subs[nc._sid] = sub
    await nc._send_command(sub_cmd(subject, queue, nc._sid))
    if nc._flush_queue is not None and nc._flush_queue.empty():
        await nc._flush_pending()
    return sub


async def unsubscribe_quietly(sub: Subscription | None) -> None:
    """Unsubscribe, if subscribed; a connection that is closing anyway is not an error."""
    if sub is None:
        return
    try:
        await sub.unsubscribe()
    except Exception:  # noqa: BLE001 - connection closing
        pass


async def unsubscribe_answering(sub: Subscription | None, *, timeout_s: int = 2) -> None:
    """Unsubscribe only after what the server routed to ``sub`` before its UNSUB has come in and been
    handed over: nats-py's ``unsubscribe`` forgets the subscription at once and drops such messages
    unseen, so a request racing the end of a served subject (a sandbox being torn down) would wait its
    whole timeout for an answer nobody sends. A PING/PONG after the UNSUB brings them all. (The server
    itself can still drop a request it matched while the UNSUB was being processed: a requester needs
    its own way out, as ``AsyncSandbox.get_info`` reads the record.)"""
    if sub is None:
        return
    nc = sub._conn
    if nc.is_closed or nc.is_draining or sub._closed:
        return
    try:
        await nc._send_unsubscribe(sub._id)
        await nc.flush(timeout=timeout_s)
    except Exception:  # noqa: BLE001 - connection closing or slow: what is left is dropped, as before
        pass
    finally:
        sub._closed = True
        nc._remove_sub(sub._id)


class Publisher:
    """Acked writes to JetStream on one connection, pipelined; one per connection (``publisher_for``)."""

    def __init__(self, nc: NATS, *, timeout_s: float = 30.0, max_inflight: int = DEFAULT_MAX_INFLIGHT, acked_fires: bool | None = None) -> None:
        self.nc = nc
        # On replicated streams a core publish can also be lost without the connection dropping: the
        # node it reached stays up while the stream's leader is lost and a new one is elected. There
        # ``fire`` waits for no ack but takes one (a callback, not a round trip on the caller's path).
        self.acked_fires = default_replicas() > 1 if acked_fires is None else acked_fires
        self.timeout_s = timeout_s
        self.max_inflight = max(1, max_inflight)
        self.prefix = ""
        self._n = itertools.count()
        self._futs: dict[str, tuple[asyncio.Future[PubAck], float]] = {}
        self._slot_waiters: deque[asyncio.Future[None]] = deque()
        self._sub: Subscription | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._fired: deque[tuple[float, str, bytes, dict[str, str]]] = deque()
        self._reconnects = 0
        self._refire: asyncio.Task[None] | None = None

    @property
    def inflight(self) -> int:
        return len(self._futs)

    async def start(self) -> "Publisher":
        if self._sub is None:
            self.prefix = self.nc.new_inbox() + "."
            self._reconnects = int(self.nc.stats.get("reconnects", 0))
            self._sub = await subscribe_sync(self.nc, self.prefix + "*", self._on_reply)
            self._sweeper = asyncio.ensure_future(self._sweep())
        return self

    def _on_reply(self, msg: Msg) -> None:
        entry = self._futs.pop(msg.subject[len(self.prefix):], None)
        if entry is None:
            return
        self._free_slot()
        fut = entry[0]
        if fut.done():
            return
        if not msg.data:  # a status without a body: 503 no responders (no stream on that subject)
            status = msg.headers.get("Status", "") if msg.headers else ""
            fut.set_exception(StoreError(f"no stream answered (status {status or '?'})", status=int(status) if status.isdigit() else 0))
            return
        try:
            fut.set_result(decode_puback(msg.data))
        except StoreError as exc:
            fut.set_exception(exc)

    def _free_slot(self) -> None:
        while self._slot_waiters:
            w = self._slot_waiters.popleft()
            if not w.done():
                w.set_result(None)
                return

    async def publish(
        self, subject: str, data: bytes, headers: dict[str, str] | None = None, *, timeout_s: float | None = None,
    ) -> "asyncio.Future[PubAck]":
        """Send one write; the returned future holds its ``PubAck`` (or ``StoreError`` / ``TimeoutError``
        after ``timeout_s``, default the publisher's)."""
        if self._sub is None:
            await self.start()
        while len(self._futs) >= self.max_inflight:
            w: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._slot_waiters.append(w)
            await w
        token = str(next(self._n))
        fut: asyncio.Future[PubAck] = asyncio.get_running_loop().create_future()
        self._futs[token] = (fut, time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s))
        try:
            await self.nc.publish(subject, data, reply=self.prefix + token, headers=headers)
        except BaseException:
            self._futs.pop(token, None)
            self._free_slot()
            raise
        return fut

    async def publish_atomic(self, items: list[tuple[str, bytes, dict[str, str] | None]]) -> "asyncio.Future[PubAck]":
        """An atomic batch (JetStream's atomic batch publish: the stream, made with ``allow_atomic``,
        stores every one of ``items`` or none; at most ``ATOMIC_BATCH_MAX``): each goes out as a core
        publish carrying the batch's id and its place, the last one with the commit, whose answer is
        the future's ``PubAck`` (``seq``: the last one's) or ``StoreError`` (nothing stored: a member's
        expected sequence did not hold, the stream does not allow it, too many batches in flight)."""
        if not 0 < len(items) <= ATOMIC_BATCH_MAX:
            raise ValueError(f"an atomic batch holds 1 to {ATOMIC_BATCH_MAX} messages, not {len(items)}")
        if self._sub is None:
            await self.start()
        bid = uuid.uuid4().hex
        last = len(items)
        for i, (subject, data, headers) in enumerate(items, 1):
            hdr = {**(headers or {}), HDR_BATCH_ID: bid, HDR_BATCH_SEQUENCE: str(i)}
            if i == last:
                hdr[HDR_BATCH_COMMIT] = "1"
                return await self.publish(subject, data, hdr)
            await self.nc.publish(subject, data, headers=hdr)
        raise AssertionError("unreachable")

    async def store(self, subject: str, data: bytes, headers: dict[str, str] | None = None) -> PubAck:
        """One acked write, awaited; tried again while no stream answers (``STORE_RETRY_*``)."""
        for attempt in range(STORE_RETRY_ATTEMPTS + 1):
            try:
                return await (await self.publish(subject, data, headers))
            except StoreError as exc:
                if not no_responders(exc) or attempt == STORE_RETRY_ATTEMPTS:
                    raise
            await asyncio.sleep(random.uniform(0.5, 1.0) * min(STORE_RETRY_CAP_S, STORE_RETRY_BASE_S * 2**attempt))
        raise AssertionError("unreachable")

    async def fire(self, subject: str, data: bytes, headers: dict[str, str] | None = None) -> None:
        """A core publish to a stream's subject; with a ``Nats-Msg-Id`` it is stored again (acked)
        after a reconnect, in case this one was lost with the connection (see the module note)."""
        if self._sub is None:
            await self.start()
        if self.acked_fires and headers and S.HDR_MSG_ID in headers:
            # Not answered soon (its node lost, the stream electing a leader): stored again (de-duplicated
            # by its msg-id) rather than after the whole publish timeout, so it lands soon after the election.
            fut = await self.publish(subject, data, headers, timeout_s=min(self.timeout_s, FIRE_ACK_TIMEOUT_S))
            fut.add_done_callback(lambda f: self._fire_answered(f, subject, data, headers))
            return
        await self.nc.publish(subject, data, headers=headers)
        if headers and S.HDR_MSG_ID in headers:
            self._fired.append((time.monotonic(), subject, data, headers))

    def _fire_answered(self, fut: "asyncio.Future[PubAck]", subject: str, data: bytes, headers: dict[str, str]) -> None:
        """A replicated stream's answer to a fired publish: one it did not store (no leader while the
        node that led it was lost, an election, a timeout) is stored again, acked, until it is."""
        if not fut.cancelled() and fut.exception() is None:
            return
        if self.nc.is_closed:
            return
        self._fired.append((time.monotonic(), subject, data, headers))
        if self._refire is None or self._refire.done():
            self._refire = asyncio.ensure_future(self._refire_lost())

    async def _refire_lost(self) -> None:
        """Store again, acked, every remembered core publish; retried while the server loads its
        streams. Those fired while this runs may have met a server without its streams too: one more
        round takes them once a round has gone through."""
        log = logging.getLogger("dsec.bus.publisher")
        rounds_ok = 0
        attempt = 0
        while self._fired and rounds_ok < 2 and attempt < REFIRE_ATTEMPTS and not self.nc.is_closed:
            batch = list(self._fired)
            self._fired.clear()
            futs = [await self.publish(subj, data, hdr) for _, subj, data, hdr in batch]
            outs = await asyncio.gather(*futs, return_exceptions=True)
            failed = [b for b, o in zip(batch, outs, strict=True) if isinstance(o, BaseException)]
            if not failed:
                rounds_ok += 1
                continue
            attempt += 1
            self._fired.extendleft(reversed(failed))
            await asyncio.sleep(random.uniform(0.25, min(2.0, 0.25 * 2**attempt)))
        if self._fired and rounds_ok < 2:
            log.warning("core publishes not stored again after a reconnect: %d (%d attempts)", len(self._fired), attempt)

    def _watch_reconnects(self, now: float) -> None:
        reconnects = int(self.nc.stats.get("reconnects", 0))
        if reconnects != self._reconnects:
            self._reconnects = reconnects
            if self._refire is None or self._refire.done():
                self._refire = asyncio.ensure_future(self._refire_lost())
            return
        if self.nc.is_connected and (self._refire is None or self._refire.done()):
            cut = now - REFIRE_WINDOW_S
            fired = self._fired
            while fired and fired[0][0] < cut:
                fired.popleft()

    async def _sweep(self) -> None:
        while not self.nc.is_closed:  # a connection closed without release_publisher() ends it too
            await asyncio.sleep(1.0)  # timeout sweep period
            now = time.monotonic()
            self._watch_reconnects(now)
            late = [t for t, (f, dl) in self._futs.items() if dl < now or f.done()]
            for t in late:
                f, _ = self._futs.pop(t)
                self._free_slot()
                if not f.done():
                    f.set_exception(asyncio.TimeoutError(f"no answer from JetStream within {self.timeout_s}s"))

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self._refire is not None:
            self._refire.cancel()
            self._refire = None
        self._fired.clear()
        for f, _ in self._futs.values():
            if not f.done():
                f.cancel()
        self._futs.clear()
        while self._slot_waiters:
            w = self._slot_waiters.popleft()
            if not w.done():
                w.cancel()
        await unsubscribe_quietly(self._sub)
        self._sub = None


_shared: dict[int, Publisher] = {}


async def publisher_for(nc: NATS) -> Publisher:
    """The connection's one publisher (many simulated hosts share a connection, and so its publisher)."""
    p = _shared.get(id(nc))
    if p is None or p.nc is not nc:
        p = _shared[id(nc)] = Publisher(nc)
    return await p.start()


async def release_publisher(nc: NATS) -> None:
    """Stop and forget the publisher of a connection that is being closed."""
    p = _shared.pop(id(nc), None)
    if p is not None:
        await p.stop()


def nc_of(js: Any) -> NATS:
    """The connection under a JetStream context (nats-py keeps it private)."""
    nc: NATS = js._nc
    return nc


__all__ = [
    "PubAck", "Publisher", "StoreError", "decode_puback", "no_responders", "nc_of", "publisher_for", "release_publisher", "subscribe_sync",
    "ERR_WRONG_LAST_SEQUENCE", "ATOMIC_BATCH_MAX",
]
