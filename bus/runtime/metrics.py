"""A service's Prometheus metrics (bus.metrics) on the bus and over HTTP, and what every service reports.

Every ``Service`` answers ``dsec.metrics.scrape`` (a scatter-gather: every process replies) and
``dsec.metrics.<service>.<instance>`` (one process) with a ``ScrapeReply`` holding its Prometheus text;
with ``metrics_port`` set it also serves ``GET /metrics`` over HTTP. Added to every registry: process
CPU and memory, the in-flight count and JetStream pending counts of each pull consumer it runs, and
the stats of its request/reply endpoints.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from .. import log as _log
from .. import subjects as S
from ..codec import Decoder, decode_reply, encode
from ..messages import ScrapeReply, ScrapeRequest
from ..metrics import CONTENT_TYPE, Registry, process_collector
from .consumer import PullConsumer
from .endpoint import Endpoint

logger = _log.get_logger("dsec.bus.metrics")

SCRAPE_REQUEST = Decoder(ScrapeRequest)
SCRAPE_REPLY = Decoder(ScrapeReply)
_BAD_TOKEN = re.compile(r"[^A-Za-z0-9_-]")


def instance_of(service: Any) -> str:
    """The subject token naming one process: its host id or replica id, else hostname-pid."""
    raw = getattr(service, "host_id", None) or getattr(service, "replica_id", None) or f"{socket.gethostname()}-{os.getpid()}"
    return _BAD_TOKEN.sub("-", str(raw))[:128]


def consumer_collector(reg: Registry, js: Callable[[], Any], consumers: Callable[[], Iterable[tuple[str, str]]]) -> None:
    """Pending counts of durable consumers, from JetStream consumer info, on each scrape. ``js()`` and
    ``consumers()`` (the (stream, durable) pairs) are read then: a service connects and starts its
    consumers after registering this."""
    pending = reg.gauge("dsec_consumer_pending_messages", "Messages in the stream not yet delivered to this consumer", ["stream", "consumer"])
    ack_pending = reg.gauge("dsec_consumer_ack_pending_messages", "Messages delivered and not yet acked", ["stream", "consumer"])
    redelivered = reg.gauge("dsec_consumer_redelivered_messages", "Messages delivered more than once and not yet acked", ["stream", "consumer"])

    async def fill() -> None:
        for g in (pending, ack_pending, redelivered):
            g.clear()
        for stream, durable in dict.fromkeys(consumers()):
            try:
                info = await js().consumer_info(stream, durable, timeout=2.0)
            except Exception as exc:  # noqa: BLE001 - a consumer gone or JetStream slow: left out this time
                logger.debug("consumer_info_failed", stream=stream, consumer=durable, error=str(exc))
                continue
            pending.set(info.num_pending or 0, stream=stream, consumer=durable)
            ack_pending.set(info.num_ack_pending or 0, stream=stream, consumer=durable)
            redelivered.set(info.num_redelivered or 0, stream=stream, consumer=durable)

    reg.collector(fill)


def stream_collector(reg: Registry, js: Callable[[], Any], streams: Sequence[str]) -> None:
    """Messages, bytes and consumers of each stream (``js()`` read on each scrape)."""
    msgs = reg.gauge("dsec_stream_messages", "Messages held by the stream", ["stream"])
    size = reg.gauge("dsec_stream_bytes", "Bytes held by the stream", ["stream"])
    consumers = reg.gauge("dsec_stream_consumers", "Consumers of the stream", ["stream"])

    async def fill() -> None:
        for name in streams:
            try:
                info = await js().stream_info(name)
            except Exception:  # noqa: BLE001 - not created yet
                continue
            msgs.set(info.state.messages, stream=name)
            size.set(info.state.bytes, stream=name)
            consumers.set(info.state.consumer_count, stream=name)

    reg.collector(fill)


def endpoint_collector(reg: Registry, endpoints: Callable[[], Iterable[Endpoint]]) -> None:
    """An Endpoint's own stats (bus.runtime.endpoint) as counters."""
    requests = reg.counter("dsec_endpoint_requests_total", "Requests a request/reply endpoint handled", ["endpoint"])
    errors = reg.counter("dsec_endpoint_errors_total", "Requests answered with an error (or not answerable)", ["endpoint"])
    busy = reg.counter("dsec_endpoint_processing_seconds_total", "Time spent handling the endpoint's requests", ["endpoint"])

    def fill() -> None:
        for ep in endpoints():
            st = ep.stats
            requests.labels(endpoint=st.name).value = st.num_requests
            errors.labels(endpoint=st.name).value = st.num_errors
            busy.labels(endpoint=st.name).value = st.processing_time_ns / 1e9

    reg.collector(fill)


def _endpoints_of(service: Any) -> list[Endpoint]:
    """The endpoints a service holds as attributes (alone, or in a list or dict)."""
    out: list[Endpoint] = []
    for v in list(vars(service).values()):
        items = v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else (v,)
        out.extend(x for x in items if isinstance(x, Endpoint))
    return out


class Exposition:
    """One process's registry answered on the bus and, optionally, on an HTTP port."""

    def __init__(self, registry: Registry, service: str, instance: str) -> None:
        self.registry = registry
        self.service = service
        self.instance = instance
        self.endpoint: Endpoint | None = None
        self._server: asyncio.base_events.Server | None = None
        self.port = 0

    async def _answer(self, _msg: Msg, _req: ScrapeRequest) -> ScrapeReply:
        return ScrapeReply(service=self.service, instance=self.instance, text=await self.registry.scrape(), at=time.time())

    async def start(self, nc: NATS, *, http_port: int | None = None, http_host: str | None = None) -> None:
        """Answer on the bus; with ``http_port``, also on HTTP at ``http_host`` (default $DSEC_METRICS_HOST,
        else 127.0.0.1: a scraper on another machine needs it set to an address it can reach)."""
        self.endpoint = Endpoint(nc, "metrics", self._answer, decoder=SCRAPE_REQUEST)
        await self.endpoint.serve(S.METRICS_SCRAPE)
        await self.endpoint.serve(S.metrics(self.service, self.instance))
        if http_port is not None:
            host = http_host or os.environ.get("DSEC_METRICS_HOST") or "127.0.0.1"
            self._server = await asyncio.start_server(self._on_http, host, http_port)
            self.port = self._server.sockets[0].getsockname()[1]
            logger.info("metrics_http", port=self.port, service=self.service)

    async def stop(self) -> None:
        if self.endpoint is not None:
            await self.endpoint.stop()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _on_http(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Just enough HTTP/1.1 for a Prometheus scraper: GET /metrics, then close."""
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10.0)
            parts = head.split(b"\r\n", 1)[0].split()
            if len(parts) < 2 or parts[0] not in (b"GET", b"HEAD"):
                status, body, ctype = "405 Method Not Allowed", b"only GET\n", "text/plain"
            elif parts[1].split(b"?")[0] != b"/metrics":
                status, body, ctype = "404 Not Found", b"see /metrics\n", "text/plain"
            else:
                status, body, ctype = "200 OK", (await self.registry.scrape()).encode(), CONTENT_TYPE
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode())
            if parts and parts[0] != b"HEAD":
                writer.write(body)
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()


async def expose(service: Any) -> Exposition:
    """Serve a Service's registry (``service.metrics``) on the bus, and on ``service.metrics_port`` if
    set, with what every service reports added to it."""
    reg: Registry = service.metrics
    instance = instance_of(service)
    reg.const_labels = {"service": service.name, "instance": instance, **reg.const_labels}
    process_collector(reg)
    inflight = reg.gauge("dsec_consumer_inflight_messages", "Messages a pull consumer of this process is handling now", ["consumer"])

    handoffs = reg.gauge("dsec_handoffs_inflight", "Hand-offs this process has taken and not answered yet (waiting or running)", ["inbox"])

    def fill_inflight() -> None:
        for w in service.workers:
            if isinstance(w, PullConsumer):
                inflight.set(w.inflight, consumer=w.durable)
            else:
                handoffs.set(w.inflight, inbox=w.name)

    reg.collector(fill_inflight)
    consumer_collector(reg, lambda: service.js, lambda: [(w.stream, w.durable) for w in service.workers if isinstance(w, PullConsumer)])
    endpoint_collector(reg, lambda: [*_endpoints_of(service), *([ex.endpoint] if ex.endpoint else [])])
    ex = Exposition(reg, service.name, instance)
    await ex.start(service.nc, http_port=service.metrics_port)
    return ex


async def scrape_all(nc: NATS, *, timeout: float = 2.0, quiet_s: float = 0.25) -> list[ScrapeReply]:
    """Ask every process on the bus for its metrics (scatter-gather on ``dsec.metrics.scrape``).

    Replies are gathered until ``quiet_s`` passes with none new after the first, or ``timeout``.
    """
    inbox = nc.new_inbox()
    got: list[ScrapeReply] = []
    arrived = asyncio.Event()

    async def on(msg: Msg) -> None:
        try:
            reply = SCRAPE_REPLY.decode(msg.data)
        except Exception:  # noqa: BLE001 - a malformed (or error) reply is left out
            return
        if isinstance(reply, ScrapeReply):
            got.append(reply)
            arrived.set()

    sub = await nc.subscribe(inbox, cb=on)
    try:
        await nc.publish(S.METRICS_SCRAPE, encode(ScrapeRequest()), reply=inbox)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            arrived.clear()
            try:
                await asyncio.wait_for(arrived.wait(), left if not got else min(left, quiet_s))
            except asyncio.TimeoutError:
                if got:
                    break
    finally:
        await sub.unsubscribe()
    return sorted(got, key=lambda r: (r.service, r.instance))


async def scrape_one(nc: NATS, service: str, instance: str, *, timeout: float = 5.0) -> ScrapeReply:
    """One process's metrics, on ``dsec.metrics.<service>.<instance>``."""
    msg = await nc.request(S.metrics(service, instance), encode(ScrapeRequest()), timeout=timeout)
    return decode_reply(msg.data, ScrapeReply)


__all__ = [
    "Exposition",
    "consumer_collector",
    "endpoint_collector",
    "expose",
    "instance_of",
    "scrape_all",
    "scrape_one",
    "stream_collector",
]
