"""A pull consumer that asks JetStream for exactly its free capacity and hands over whole batches.

Unlike a fetch loop it keeps long-lived pull requests open (one round trip per batch, none while idle
but one per ``expires_s``), never buffers more than ``capacity`` un-acked messages, and gives the
handler every message that arrived together so it can pipeline the hand-offs of a whole batch.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable

import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig

log = structlog.get_logger("dsec.placement")

BatchHandler = Callable[[list[Msg]], Awaitable[None]]


class BatchConsumer:
    def __init__(
        self,
        nc: NATS,
        js: JetStreamContext,
        *,
        stream: str,
        config: ConsumerConfig,
        capacity: int,
        on_batch: BatchHandler,
        expires_s: float = 5.0,
        name: str = "consumer",
    ) -> None:
        self.nc = nc
        self.js = js
        self.stream = stream
        self.config = config
        self.durable = config.durable_name or ""
        self.capacity = max(1, capacity)
        self.on_batch = on_batch
        self.expires_s = expires_s
        self.name = name
        self.inflight = 0  # delivered to us, not yet released
        self.credits = 0  # asked for, not yet delivered or expired
        self._last_pull = 0.0
        self._buf: list[Msg] = []
        self._flush_scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._sub = None
        self._inbox = ""
        self._watchdog: asyncio.Task[None] | None = None
        self._next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{self.durable}"
        self.min_pull = max(1, self.capacity // 4)

    async def start(self) -> None:
        try:
            await self.js.add_consumer(self.stream, self.config)
        except Exception as exc:  # noqa: BLE001 - exists with another config (another replica made it): use it
            log.info("consumer_exists", durable=self.durable, detail=str(exc))
            await self.js.consumer_info(self.stream, self.durable)
        self._inbox = self.nc.new_inbox()
        self._sub = await self.nc.subscribe(self._inbox, cb=self._on_msg)
        self._watchdog = asyncio.create_task(self._watch(), name=f"pull-watchdog:{self.name}")
        self._maybe_pull()

    # --- pulling ------------------------------------------------------------------------
    def _maybe_pull(self) -> None:
        if self._stopping:
            return
        free = self.capacity - self.inflight - self.credits
        if free <= 0 or (free < self.min_pull and self.credits > 0):
            return
        self.credits += free
        self._last_pull = time.monotonic()
        req = json.dumps({"batch": free, "expires": int(self.expires_s * 1e9)}).encode()
        t = asyncio.ensure_future(self.nc.publish(self._next_subject, req, reply=self._inbox))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _watch(self) -> None:
        """Re-ask when pull requests vanished without an answer (a reconnect, a server restart)."""
        while not self._stopping:
            await asyncio.sleep(1.0)  # watchdog period
            if self.credits and time.monotonic() - self._last_pull > self.expires_s + 2.0:
                self.credits = 0
                self._maybe_pull()

    async def _on_msg(self, msg: Msg) -> None:
        hdrs = msg.headers
        if hdrs and not msg.data and "Status" in hdrs:
            status = hdrs.get("Status")
            if status == "100":  # idle heartbeat
                return
            pending = hdrs.get("Nats-Pending-Messages")
            self.credits = max(0, self.credits - int(pending)) if pending is not None else 0
            if status not in ("404", "408"):
                log.info("pull_status", consumer=self.name, status=status, description=hdrs.get("Description", ""))
            self._maybe_pull()
            return
        if self.credits:
            self.credits -= 1
        self.inflight += 1
        self._buf.append(msg)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        batch, self._buf = self._buf, []
        if not batch:
            return
        t = asyncio.ensure_future(self._run(batch))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _run(self, batch: list[Msg]) -> None:
        try:
            await self.on_batch(batch)
        except Exception as exc:  # noqa: BLE001 - leave un-acked messages to JetStream's redelivery
            log.exception("batch_failed", consumer=self.name, error=str(exc))
        finally:
            self.inflight -= len(batch)
            self._maybe_pull()

    # --- stopping ---------------------------------------------------------------------------
    async def stop_intake(self) -> None:
        self._stopping = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # noqa: BLE001 - connection already closing
                pass
            self._sub = None

    async def finish(self, grace_s: float) -> None:
        if self._buf:
            self._flush()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=grace_s)
