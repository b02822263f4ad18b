"""The service lifecycle: connect, set up, serve until SIGTERM/SIGINT, then stop intake, finish
in-flight work within a grace period, tear down and drain NATS."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy

from .. import log as _log
from ..metrics import Registry
from .connection import connect
from .consumer import BatchHandler, Handler, PullConsumer, consumer_config
from .handoff import HandoffInbox
from .metrics import Exposition, expose
from .publisher import Publisher, publisher_for, release_publisher


class Service:
    """Base of every dsec service: ``run()``, idempotent ``shutdown()``, ``async with``."""

    name = "service"

    def __init__(self, nats_url: str | None = None, *, grace_s: float = 10.0) -> None:
        self.nats_url = nats_url
        self.grace_s = grace_s
        self.nc: NATS | None = None
        self.js: JetStreamContext | None = None
        self.workers: list[PullConsumer | HandoffInbox] = []
        self.publisher: Publisher | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stopped = asyncio.Event()
        self._sleepers: set[asyncio.Future[None]] = set()  # pause()s, woken by shutdown
        self._shutdown_started = False
        self._shutdown_done = asyncio.Event()
        self.log = _log.get_logger(f"dsec.{self.name}")
        # Prometheus metrics (bus.metrics), answered on dsec.metrics.<service>.<instance> once started,
        # and over HTTP on metrics_port when set (bus.runtime.metrics).
        self.metrics = Registry()
        self.metrics_port: int | None = None
        self._exposition: Exposition | None = None

    async def pause(self, seconds: float) -> bool:
        """Wait ``seconds`` or until shutdown; True when stopping. A timer and a future, nothing else:
        periodic loops call this (1,600 simulated hosts in one process, several times a second each),
        and ``asyncio.wait``/``wait_for`` on the stop event cost several times more per call."""
        if self._stopped.is_set():
            return True
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        timer = loop.call_later(seconds, _wake, fut)
        self._sleepers.add(fut)
        try:
            await fut
        finally:
            timer.cancel()
            self._sleepers.discard(fut)
        return self._stopped.is_set()

    # subclasses override these two
    async def setup(self) -> None:
        """Subscribe, start workers; called once connected."""

    async def teardown(self) -> None:
        """Release resources after intake stopped and in-flight work finished."""

    async def start(self) -> None:
        _log.configure()
        self.nc = await connect(self.nats_url, name=self.name)
        self.js = self.nc.jetstream()
        self.publisher = await publisher_for(self.nc)
        await self.setup()
        self._exposition = await expose(self)
        await self.nc.flush()  # subscriptions are live on the server when start() returns

    def spawn(self, coro: Awaitable[Any], *, name: str | None = None) -> asyncio.Task[Any]:
        """Run background work that shutdown() waits for (or cancels after the grace period)."""
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def add_worker(
        self,
        *,
        stream: str,
        durable: str,
        filter_subject: str,
        capacity: int,
        handler: Handler | None = None,
        on_batch: BatchHandler | None = None,
        ack_wait_s: float = 30.0,
        max_deliver: int = -1,
        max_ack_pending: int | None = None,
        deliver_policy: DeliverPolicy = DeliverPolicy.ALL,
        config: ConsumerConfig | None = None,
        **kwargs: Any,
    ) -> PullConsumer:
        """Start a durable pull consumer that shutdown() stops (intake first, then in-flight work).
        ``kwargs`` go to ``PullConsumer`` (expires_s, min_pull, inbox, name)."""
        assert self.nc is not None
        cfg = config or consumer_config(
            durable, filter_subject, ack_wait_s=ack_wait_s, max_deliver=max_deliver,
            max_ack_pending=max_ack_pending or max(1, capacity), deliver_policy=deliver_policy,
        )
        w = PullConsumer(self.nc, stream=stream, config=cfg, capacity=capacity, handler=handler, on_batch=on_batch, **kwargs)
        await w.start()
        self.workers.append(w)
        return w

    async def add_inbox(self, subject: str, handler: Callable[[Msg], Awaitable[None]], *, capacity: int, name: str = "") -> HandoffInbox:
        """Take hand-offs on ``subject`` (bus.runtime.handoff); shutdown() stops it as it stops workers."""
        assert self.nc is not None
        inbox = HandoffInbox(self.nc, subject, handler, capacity=capacity, name=name)
        await inbox.start()
        self.workers.append(inbox)
        return inbox

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
        for f in list(self._sleepers):
            if not f.done():
                f.set_result(None)
        try:
            for w in self.workers:
                await w.stop_intake()
            for w in self.workers:
                await w.finish(self.grace_s)
            if self._tasks:
                _, pending = await asyncio.wait(set(self._tasks), timeout=self.grace_s)
                for t in pending:
                    t.cancel()
            if self._exposition is not None:
                await self._exposition.stop()
            await self.teardown()
            if self.nc is not None and not self.nc.is_closed:
                await release_publisher(self.nc)
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


def _wake(fut: "asyncio.Future[None]") -> None:
    if not fut.done():
        fut.set_result(None)


__all__ = ["Service"]
