"""The service runtime: connect with bounded reconnects, pull workers that fetch only free capacity,
SIGTERM -> stop intake, finish in-flight work within a grace period, then drain NATS."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote, urlsplit

import nats
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from . import log as _log
from .auth import ANONYMOUS_USER, inbox_prefix, load_client_context
from .codec import encode
from .errors import DsecError, ErrorReply, InternalError, Unavailable
from .subjects import valid_token

DEFAULT_URL = "nats://127.0.0.1:4222"

logger = _log.get_logger("dsec.bus")


def nats_url(url: str | None = None) -> str:
    """``url``, else $DSEC_NATS_URL, else the client context `dsec up` wrote (bus.auth), else the default."""
    if url or os.environ.get("DSEC_NATS_URL"):
        return url or os.environ["DSEC_NATS_URL"]
    ctx = load_client_context()
    return ctx.url if ctx else DEFAULT_URL


async def connect(
    url: str | None = None,
    *,
    name: str = "dsec",
    connect_attempts: int = 20,
    connect_timeout_s: float = 30.0,
    max_reconnect_attempts: int = 120,
    user_credentials: str | None = None,
    **kwargs: Any,
) -> NATS:
    """Connect to NATS, retrying the first connect a bounded number of times (in attempts and time)."""
    servers = nats_url(url).split(",")
    user = kwargs.get("user") or urlsplit(servers[0]).username
    user = unquote(user) if user else ANONYMOUS_USER
    if valid_token(user):  # each user may only receive under its own prefix (bus.auth): replies must come back there
        kwargs.setdefault("inbox_prefix", inbox_prefix(user))
    if user_credentials is None:
        user_credentials = os.environ.get("DSEC_NATS_CREDS") or None
    kwargs.setdefault("error_cb", _log_nats_error)
    deadline = time.monotonic() + connect_timeout_s
    delay = 0.05
    last: Exception | None = None
    for _ in range(connect_attempts):
        # nats-py retries a first connect max_reconnect_attempts times by itself: bound it by our deadline.
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        nc = NATS()
        try:
            await asyncio.wait_for(
                nc.connect(
                    servers=servers,
                    name=name,
                    connect_timeout=2,
                    allow_reconnect=True,
                    max_reconnect_attempts=max_reconnect_attempts,
                    reconnect_time_wait=0.5,
                    user_credentials=user_credentials,
                    **kwargs,
                ),
                remaining,
            )
            return nc
        except (nats.errors.NoServersError, OSError, asyncio.TimeoutError, nats.errors.Error) as exc:
            last = exc if not isinstance(exc, asyncio.TimeoutError) else nc.last_error or exc
            try:
                await nc.close()
            except Exception:  # noqa: BLE001 - never connected
                pass
            if time.monotonic() + delay > deadline:
                break
            await asyncio.sleep(delay)  # retry back-off
            delay = min(delay * 2, 1.0)
    raise Unavailable(f"cannot reach NATS at {','.join(servers)}: {last or 'timed out'}")


async def _log_nats_error(exc: Exception) -> None:
    """One line per connection error (nats-py's default prints a whole traceback for each retry)."""
    logging.getLogger("dsec.nats").warning("nats: %s: %s", type(exc).__name__, exc)


def reply_bytes(result: Any) -> bytes:
    return encode(result)


async def respond(msg: Msg, result: Any) -> None:
    """Reply to a core request with a result Struct or a DsecError."""
    if not msg.reply:
        return
    if isinstance(result, DsecError):
        result = result.to_reply()
    await msg.respond(encode(result))


def error_of(exc: BaseException) -> ErrorReply:
    if isinstance(exc, DsecError):
        return exc.to_reply()
    return InternalError(f"{type(exc).__name__}: {exc}").to_reply()


Handler = Callable[[Msg], Awaitable[None]]


class PullWorker:
    """Fetch from a durable pull consumer only as many messages as there are free slots.

    The handler owns ack/nak: a handler that raises leaves the message un-acked, so JetStream
    redelivers it after ``ack_wait``.
    """

    def __init__(
        self,
        js: JetStreamContext,
        *,
        stream: str,
        durable: str,
        filter_subject: str,
        handler: Handler,
        capacity: int,
        ack_wait_s: float = 30.0,
        max_deliver: int = -1,
        fetch_timeout_s: float = 1.0,
        max_ack_pending: int | None = None,
        name: str = "worker",
    ) -> None:
        self.js = js
        self.stream = stream
        self.durable = durable
        self.filter_subject = filter_subject
        self.handler = handler
        self.capacity = max(1, capacity)
        self.ack_wait_s = ack_wait_s
        self.max_deliver = max_deliver
        self.fetch_timeout_s = fetch_timeout_s
        self.name = name
        self.max_ack_pending = max_ack_pending or self.capacity
        self._inflight: set[asyncio.Task[None]] = set()
        self._slot_freed = asyncio.Event()
        self._stopping = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._sub: JetStreamContext.PullSubscription | None = None

    def consumer_config(self) -> ConsumerConfig:
        return ConsumerConfig(
            durable_name=self.durable,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            filter_subject=self.filter_subject,
            ack_wait=self.ack_wait_s,
            max_deliver=self.max_deliver,
            max_ack_pending=self.max_ack_pending,
            max_waiting=512,
        )

    async def start(self) -> None:
        self._sub = await self.js.pull_subscribe(
            self.filter_subject, durable=self.durable, stream=self.stream, config=self.consumer_config()
        )
        self._loop_task = asyncio.create_task(self._loop(), name=f"pull:{self.name}")

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    async def _loop(self) -> None:
        assert self._sub is not None
        while not self._stopping.is_set():
            free = self.capacity - len(self._inflight)
            if free <= 0:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            try:
                msgs = await self._sub.fetch(batch=free, timeout=self.fetch_timeout_s)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                continue
            except (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError):
                return
            except Exception as exc:  # noqa: BLE001 - a fetch failure must not kill the worker
                if self._stopping.is_set():
                    return
                logger.warning("fetch_failed", worker=self.name, error=str(exc))
                await asyncio.sleep(0.2)  # back-off before the next fetch
                continue
            for m in msgs:
                t = asyncio.create_task(self._run(m))
                self._inflight.add(t)
                t.add_done_callback(self._done)

    def _done(self, t: asyncio.Task[None]) -> None:
        self._inflight.discard(t)
        self._slot_freed.set()

    async def _run(self, m: Msg) -> None:
        try:
            await self.handler(m)
        except Exception as exc:  # noqa: BLE001 - leave un-acked: JetStream redelivers
            logger.exception("handler_failed", worker=self.name, subject=m.subject, error=str(exc))

    async def stop_intake(self) -> None:
        self._stopping.set()
        self._slot_freed.set()
        if self._loop_task:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass

    async def finish(self, grace_s: float) -> None:
        if self._inflight:
            await asyncio.wait(set(self._inflight), timeout=grace_s)
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # noqa: BLE001 - already closed
                pass


class Service:
    """Base of every dsec service: ``run()``, idempotent ``shutdown()``, ``async with``."""

    name = "service"

    def __init__(self, nats_url: str | None = None, *, grace_s: float = 10.0) -> None:
        self.nats_url = nats_url
        self.grace_s = grace_s
        self.nc: NATS | None = None
        self.js: JetStreamContext | None = None
        self.workers: list[PullWorker] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stopped = asyncio.Event()
        self._shutdown_started = False
        self._shutdown_done = asyncio.Event()
        self.log = _log.get_logger(f"dsec.{self.name}")

    # subclasses override these two
    async def setup(self) -> None:
        """Subscribe, start workers; called once connected."""

    async def teardown(self) -> None:
        """Release resources after intake stopped and in-flight work finished."""

    async def start(self) -> None:
        _log.configure()
        self.nc = await connect(self.nats_url, name=self.name)
        self.js = self.nc.jetstream()
        await self.setup()
        await self.nc.flush()  # subscriptions are live on the server when start() returns

    def spawn(self, coro: Awaitable[Any], *, name: str | None = None) -> asyncio.Task[Any]:
        """Run background work that shutdown() waits for (or cancels after the grace period)."""
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def add_worker(self, **kwargs: Any) -> PullWorker:
        assert self.js is not None
        w = PullWorker(self.js, **kwargs)
        await w.start()
        self.workers.append(w)
        return w

    async def run(self) -> None:
        """Start, serve until SIGTERM/SIGINT or shutdown(), then stop cleanly."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, lambda: asyncio.ensure_future(self.shutdown()))
            except (NotImplementedError, RuntimeError):
                pass
        try:
            await self.start()
        except BaseException:
            # A half-started service still releases what it took (processes, mounts) before failing.
            await self.shutdown()
            raise
        self.log.info("service_started", service=self.name)
        await self._stopped.wait()
        await self._shutdown_done.wait()

    async def shutdown(self) -> None:
        if self._shutdown_started:
            await self._shutdown_done.wait()
            return
        self._shutdown_started = True
        self._stopped.set()
        try:
            for w in self.workers:
                await w.stop_intake()
            for w in self.workers:
                await w.finish(self.grace_s)
            if self._tasks:
                _, pending = await asyncio.wait(set(self._tasks), timeout=self.grace_s)
                for t in pending:
                    t.cancel()
            await self.teardown()
            if self.nc is not None and not self.nc.is_closed:
                try:
                    await self.nc.drain()
                except Exception:  # noqa: BLE001 - closing anyway
                    await self.nc.close()
        finally:
            self._shutdown_done.set()
            self.log.info("service_stopped", service=self.name)

    async def __aenter__(self) -> "Service":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()


def now() -> float:
    return time.time()
