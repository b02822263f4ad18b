"""One credit-based pull consumer: it asks JetStream for exactly its free capacity, never more.

Capacity is reserved before the pull request goes out (``credits``: asked for, not yet delivered or
expired), as faststream's stream pull subscriber reserves its semaphore before ``fetch``: delivered
plus asked-for never exceeds ``capacity``, so a burst waits in the stream, not in this process.
Pull requests are long-lived (``expires_s``): one round trip per batch, none while idle but one per
``expires_s``. Messages go to a per-message ``handler`` (one task each) or, with ``on_batch``, every
message that arrived together goes to one call (so it can pipeline the hand-offs of a whole batch).

A handler that raises leaves its message un-acked: JetStream redelivers it after ``ack_wait``.
The handler owns ack/nak/in_progress.

Many consumers can share one ``PullInbox`` (one subscription for thousands of simulated hosts); a
delivered message is routed by the stream and consumer named in its ``$JS.ACK`` reply subject, a
status answer by the consumer's own inbox token.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import json
import time
from collections.abc import Awaitable, Callable

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from .. import log as _log
from .publisher import unsubscribe_quietly

logger = _log.get_logger("dsec.bus.consumer")

Handler = Callable[[Msg], Awaitable[None]]
BatchHandler = Callable[[list[Msg]], Awaitable[None]]

STATUS_BACKOFF_S = 0.5  # a pull refused with an unexpected status (409 ...) is asked again after this


def consumer_config(
    durable: str,
    filter_subject: str,
    *,
    ack_wait_s: float = 30.0,
    max_deliver: int = -1,
    max_ack_pending: int,
    deliver_policy: DeliverPolicy = DeliverPolicy.ALL,
    max_waiting: int = 512,
) -> ConsumerConfig:
    """A durable, explicitly acked pull consumer's configuration (the one shape dsec uses)."""
    return ConsumerConfig(
        durable_name=durable,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=deliver_policy,
        filter_subject=filter_subject,
        ack_wait=ack_wait_s,
        max_deliver=max_deliver,
        max_ack_pending=max_ack_pending,
        max_waiting=max_waiting,
    )


def deliveries(msg: Msg) -> int:
    """How many times JetStream delivered ``msg`` (1 for a message that is not a JetStream delivery),
    read straight from its ``$JS.ACK`` reply subject: nats-py's ``msg.metadata`` builds a whole
    metadata object (timestamps included) per message, a visible share of a hot handler."""
    t = (msg.reply or "").split(".")
    n = len(t)
    try:
        if n == 9 and t[0] == "$JS":
            return int(t[4])
        if n >= 11 and t[0] == "$JS":
            return int(t[6])
    except ValueError:
        pass
    return 1


def _route_of(reply: str) -> tuple[str, str] | None:
    """(stream, consumer) of a ``$JS.ACK`` reply subject: v1 has 9 tokens, v2 (with domain and
    account hash) 11 or 12 (ADR-15)."""
    t = reply.split(".")
    n = len(t)
    if n == 9:
        return t[2], t[3]
    if n >= 11:
        return t[4], t[5]
    return None


class PullInbox:
    """One subscription taking the pull answers of any number of consumers on a connection."""

    def __init__(self, nc: NATS, *, watchdog_s: float = 1.0) -> None:
        self.nc = nc
        self.prefix = nc.new_inbox()
        self.watchdog_s = watchdog_s
        self._tokens = itertools.count()
        self._by_token: dict[str, PullConsumer] = {}
        self._by_route: dict[tuple[str, str], PullConsumer] = {}
        self._sub: Subscription | None = None
        self._watchdog: asyncio.Task[None] | None = None

    async def start(self) -> "PullInbox":
        if self._sub is None:
            self._sub = await self.nc.subscribe(
                self.prefix + ".*", cb=self._on_msg, pending_msgs_limit=1_000_000, pending_bytes_limit=1024**3
            )
            self._watchdog = asyncio.create_task(self._watch(), name="pull-watchdog")
        return self

    def add(self, c: "PullConsumer") -> str:
        token = str(next(self._tokens))
        self._by_token[token] = c
        self._by_route[(c.stream, c.durable)] = c
        return f"{self.prefix}.{token}"

    def remove(self, c: "PullConsumer") -> None:
        self._by_token.pop(c.inbox[len(self.prefix) + 1:], None)
        if self._by_route.get((c.stream, c.durable)) is c:
            del self._by_route[(c.stream, c.durable)]

    @property
    def empty(self) -> bool:
        return not self._by_token

    async def _on_msg(self, msg: Msg) -> None:
        if msg.reply:  # a delivered message: its $JS.ACK reply names stream and consumer
            route = _route_of(msg.reply)
            c = self._by_route.get(route) if route else None
        else:  # a status answer to a pull request, on the consumer's own inbox
            c = self._by_token.get(msg.subject[len(self.prefix) + 1:])
        if c is not None:
            c._on_msg(msg)

    async def _watch(self) -> None:
        """Re-ask for consumers whose pull requests vanished unanswered (a reconnect, a server restart)."""
        while True:
            await asyncio.sleep(self.watchdog_s)  # watchdog period
            now = time.monotonic()
            for c in list(self._by_token.values()):
                if c.credits and now - c.last_pull > c.expires_s + 2.0:
                    c.credits = 0
                    c._maybe_pull()

    async def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        await unsubscribe_quietly(self._sub)
        self._sub = None


class _Held:
    """The messages of one running batch not settled yet (``PullConsumer.settled``)."""

    __slots__ = ("left",)

    def __init__(self, n: int) -> None:
        self.left = n


_held: contextvars.ContextVar[_Held | None] = contextvars.ContextVar("dsec_pull_batch", default=None)


class PullConsumer:
    """A durable pull consumer holding at most ``capacity`` messages (delivered or asked for)."""

    def __init__(
        self,
        nc: NATS,
        *,
        stream: str,
        config: ConsumerConfig,
        capacity: int,
        handler: Handler | None = None,
        on_batch: BatchHandler | None = None,
        expires_s: float = 5.0,
        min_pull: int | None = None,
        inbox: PullInbox | None = None,
        name: str = "",
    ) -> None:
        if (handler is None) == (on_batch is None):
            raise ValueError("give exactly one of handler (per message) or on_batch")
        self.nc = nc
        self.js = nc.jetstream()
        self.stream = stream
        self.config = config
        self.durable = config.durable_name or ""
        self.capacity = max(1, capacity)
        self.handler = handler
        self.on_batch = on_batch
        self.expires_s = expires_s
        self.name = name or self.durable
        # Ask again once this many slots are free (fewer, bigger pulls), or at once when none are pending.
        self.min_pull = max(1, min_pull if min_pull is not None else self.capacity // 4)
        self.inflight = 0  # delivered to us, not yet released by the handler
        self.credits = 0  # asked for, not yet delivered or expired
        self.last_pull = 0.0
        self.delivered = 0
        self._own_inbox = inbox is None
        self._mux = inbox
        self.inbox = ""
        self._next = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{self.durable}"
        self._buf: list[Msg] = []
        self._flush_scheduled = False
        self._retry_scheduled = False
        self._recreating = False
        self.recreated = 0  # times the consumer was made again
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = False

    async def start(self) -> None:
        try:
            await self.js.add_consumer(self.stream, self.config)
        except nats.errors.Error as exc:  # exists with another config (another replica made it): use it
            logger.info("consumer_exists", durable=self.durable, detail=str(exc))
            await self.js.consumer_info(self.stream, self.durable)
        if self._mux is None:
            self._mux = PullInbox(self.nc)
        await self._mux.start()
        self.inbox = self._mux.add(self)
        self._maybe_pull()

    # --- pulling ------------------------------------------------------------------------
    def _maybe_pull(self) -> None:
        if self._stopping:
            return
        free = self.capacity - self.inflight - self.credits
        if free <= 0 or (free < self.min_pull and self.credits > 0):
            return
        self.credits += free  # reserved before asking: never more delivered than there is room for
        self.last_pull = time.monotonic()
        req = json.dumps({"batch": free, "expires": int(self.expires_s * 1e9)}).encode()
        self._spawn(self.nc.publish(self._next, req, reply=self.inbox))

    def _retry_later(self) -> None:
        if self._retry_scheduled:
            return
        self._retry_scheduled = True

        def again() -> None:
            self._retry_scheduled = False
            self._maybe_pull()

        asyncio.get_running_loop().call_later(STATUS_BACKOFF_S, again)

    def _recreate(self) -> None:
        if self._recreating or self._stopping:
            return
        self._recreating = True

        async def again() -> None:
            try:
                await self.js.add_consumer(self.stream, self.config)
                self.recreated += 1
                logger.warning("consumer_recreated", consumer=self.name, stream=self.stream)
            except Exception as exc:  # noqa: BLE001 - the server is not back yet: the next status retries
                logger.info("consumer_recreate_failed", consumer=self.name, error=str(exc))
            finally:
                self._recreating = False
            self._retry_later()

        self._spawn(again())

    def _spawn(self, coro: Awaitable[None]) -> None:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def _on_msg(self, msg: Msg) -> None:
        hdrs = msg.headers
        if not msg.reply and hdrs and "Status" in hdrs:
            status = hdrs.get("Status")
            if status == "100":  # idle heartbeat
                return
            pending = hdrs.get("Nats-Pending-Messages")
            self.credits = max(0, self.credits - int(pending)) if pending is not None else 0
            if status in ("404", "408"):  # no messages / request expired: ask again
                self._maybe_pull()
            elif status == "503" or (status == "409" and "Deleted" in hdrs.get("Description", "")):
                # No consumer answers (it did not survive a server that lost its state), or it was
                # deleted: make it again, then ask; the stream still holds what was not acked.
                self._recreate()
            else:  # 409 (max waiting, ...): asking at once would spin
                logger.info("pull_status", consumer=self.name, status=status, description=hdrs.get("Description", ""))
                self._retry_later()
            return
        if self.credits:
            self.credits -= 1
        self.inflight += 1
        self.delivered += 1
        if self.handler is not None:
            self._spawn(self._run_one(msg))
            return
        self._buf.append(msg)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        batch, self._buf = self._buf, []
        if batch:
            self._spawn(self._run_batch(batch))

    async def _run_one(self, msg: Msg) -> None:
        assert self.handler is not None
        try:
            await self.handler(msg)
        except Exception as exc:  # noqa: BLE001 - leave un-acked: JetStream redelivers
            logger.exception("handler_failed", consumer=self.name, subject=msg.subject, error=str(exc))
        finally:
            self.inflight -= 1
            self._maybe_pull()

    async def _run_batch(self, batch: list[Msg]) -> None:
        assert self.on_batch is not None
        held = _Held(len(batch))
        token = _held.set(held)
        try:
            await self.on_batch(batch)
        except Exception as exc:  # noqa: BLE001 - leave un-acked messages to JetStream's redelivery
            logger.exception("batch_failed", consumer=self.name, error=str(exc))
        finally:
            _held.reset(token)
            self.inflight -= held.left
            self._maybe_pull()

    def settled(self, n: int = 1) -> None:
        """Called from an ``on_batch`` handler for messages of its batch it is done with (acked or
        nak'ed) before the whole batch is: their room is asked for again now, not once the slowest
        message of the batch is done (placement holds each request until its host answers)."""
        held = _held.get()
        if held is None:
            return
        k = min(n, held.left)
        held.left -= k
        self.inflight -= k
        if k:
            self._maybe_pull()

    # --- stopping ---------------------------------------------------------------------------
    async def stop_intake(self) -> None:
        """Ask for nothing more; what was asked for and still arrives is not handled (redelivered later)."""
        self._stopping = True
        if self._mux is not None:
            self._mux.remove(self)
            if self._own_inbox:
                await self._mux.stop()

    async def finish(self, grace_s: float) -> None:
        """Wait (up to ``grace_s``) for the handlers still running."""
        if self._buf:
            self._flush()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=grace_s)


__all__ = ["BatchHandler", "Handler", "PullConsumer", "PullInbox", "consumer_config", "deliveries"]
