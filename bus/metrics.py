"""Prometheus metrics of every dsec process, without a client library.

A :class:`Registry` holds counters, gauges and histograms (each with optional labels) and renders them
as the Prometheus text exposition format 0.0.4. Gauges that mirror state (sandboxes per state, consumer
pending counts) are filled by *collectors*, callbacks run on each scrape, so nothing is kept in step on
the hot path. A service answers scrapes on the bus (:func:`expose`: ``dsec.metrics.scrape`` for a
scatter-gather, ``dsec.metrics.<service>.<instance>`` for one process) and, with ``--metrics-port``, over
HTTP; :func:`merge` joins several processes' texts into one exposition (the gateway's ``/metrics``).
"""

from __future__ import annotations

import asyncio
import bisect
import math
import os
import re
import resource
import socket
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from . import log as _log
from . import subjects as S
from .codec import Decoder, encode
from .messages import MetricsReply, MetricsRequest

logger = _log.get_logger("dsec.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Seconds: from a 1 ms exec round trip to a minute-long cold create.
DEFAULT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

Collector = Callable[[], Awaitable[None] | None]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if v == int(v) and abs(v) < 1e15:
        return str(int(v))
    return repr(float(v))


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in pairs)
    return "{" + inner + "}" if inner else ""


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, labels: Sequence[str]) -> None:
        if not _NAME.match(name):
            raise ValueError(f"bad metric name {name!r}")
        for lab in labels:
            if not _LABEL.match(lab) or lab.startswith("__"):
                raise ValueError(f"bad label name {lab!r}")
        self.name = name
        self.help = help
        self.label_names = tuple(labels)
        self._children: dict[tuple[str, ...], Any] = {}

    def _key(self, kv: dict[str, Any]) -> tuple[str, ...]:
        if set(kv) != set(self.label_names):
            raise ValueError(f"{self.name} takes labels {self.label_names}, got {tuple(kv)}")
        return tuple(str(kv[n]) for n in self.label_names)

    def labels(self, **kv: Any) -> Any:
        key = self._key(kv)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._new_child()
        return child

    def clear(self) -> None:
        """Forget every label set (a collector re-filling a gauge from current state calls this first)."""
        self._children.clear()

    def _only(self) -> Any:
        if self.label_names:
            raise ValueError(f"{self.name} has labels {self.label_names}: use .labels(...)")
        return self.labels()

    def _new_child(self) -> Any:
        raise NotImplementedError

    def samples(self, const: tuple[tuple[str, str], ...]) -> list[str]:
        raise NotImplementedError


class _Value:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()) -> None:
        if not name.endswith("_total"):
            raise ValueError(f"counter {name!r} must end in _total")
        super().__init__(name, help, labels)

    def _new_child(self) -> _Value:
        return _Value()

    def inc(self, n: float = 1.0, **kv: Any) -> None:
        if n < 0:
            raise ValueError("a counter only goes up")
        (self.labels(**kv) if kv else self._only()).value += n

    def samples(self, const: tuple[tuple[str, str], ...]) -> list[str]:
        return _value_samples(self, const)


def _value_samples(m: _Metric, const: tuple[tuple[str, str], ...]) -> list[str]:
    return [f"{m.name}{_labels(const + tuple(zip(m.label_names, k)))} {_fmt(c.value)}" for k, c in m._children.items()]


class Gauge(_Metric):
    kind = "gauge"

    def _new_child(self) -> _Value:
        return _Value()

    def set(self, v: float, **kv: Any) -> None:
        (self.labels(**kv) if kv else self._only()).value = float(v)

    def inc(self, n: float = 1.0, **kv: Any) -> None:
        (self.labels(**kv) if kv else self._only()).value += n

    def dec(self, n: float = 1.0, **kv: Any) -> None:
        self.inc(-n, **kv)

    def samples(self, const: tuple[tuple[str, str], ...]) -> list[str]:
        return _value_samples(self, const)


class _Hist:
    __slots__ = ("counts", "sum", "count")

    def __init__(self, n: int) -> None:
        self.counts = [0] * n
        self.sum = 0.0
        self.count = 0


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help: str, labels: Sequence[str] = (), buckets: Sequence[float] = DEFAULT_BUCKETS) -> None:
        if "le" in labels:
            raise ValueError("'le' is the histogram's own label")
        super().__init__(name, help, labels)
        self.buckets = tuple(sorted(float(b) for b in buckets if not math.isinf(b)))

    def _new_child(self) -> _Hist:
        return _Hist(len(self.buckets))

    def observe(self, v: float, **kv: Any) -> None:
        h: _Hist = self.labels(**kv) if kv else self._only()
        i = bisect.bisect_left(self.buckets, v)
        if i < len(h.counts):
            h.counts[i] += 1
        h.sum += v
        h.count += 1

    def samples(self, const: tuple[tuple[str, str], ...]) -> list[str]:
        out = []
        for k, h in self._children.items():
            base = const + tuple(zip(self.label_names, k))
            acc = 0
            for b, c in zip(self.buckets, h.counts):
                acc += c
                out.append(f"{self.name}_bucket{_labels(base + (('le', _fmt(b)),))} {acc}")
            out.append(f"{self.name}_bucket{_labels(base + (('le', '+Inf'),))} {h.count}")
            out.append(f"{self.name}_sum{_labels(base)} {_fmt(h.sum)}")
            out.append(f"{self.name}_count{_labels(base)} {h.count}")
        return out


class Registry:
    """The metrics of one process. ``const_labels`` (service, instance) go on every sample, so texts of
    many processes merge into one exposition without clashes."""

    def __init__(self, const_labels: dict[str, str] | None = None) -> None:
        self.const_labels = dict(const_labels or {})
        self._metrics: dict[str, _Metric] = {}
        self._collectors: list[Collector] = []

    def _add(self, m: _Metric) -> Any:
        have = self._metrics.get(m.name)
        if have is not None:
            if type(have) is not type(m) or have.label_names != m.label_names:
                raise ValueError(f"metric {m.name} already registered differently")
            return have  # the same metric asked for twice (two objects of one service): shared
        self._metrics[m.name] = m
        return m

    def counter(self, name: str, help: str, labels: Sequence[str] = ()) -> Counter:
        return self._add(Counter(name, help, labels))

    def gauge(self, name: str, help: str, labels: Sequence[str] = ()) -> Gauge:
        return self._add(Gauge(name, help, labels))

    def histogram(self, name: str, help: str, labels: Sequence[str] = (), buckets: Sequence[float] = DEFAULT_BUCKETS) -> Histogram:
        return self._add(Histogram(name, help, labels, buckets))

    def collector(self, fn: Collector) -> Collector:
        """Run ``fn`` (sync or async) before each render; it sets gauges from current state."""
        self._collectors.append(fn)
        return fn

    async def collect(self) -> None:
        for fn in self._collectors:
            try:
                r = fn()
                if r is not None:
                    await r
            except Exception as exc:  # noqa: BLE001 - one failing probe must not blank the whole scrape
                logger.warning("collector_failed", collector=getattr(fn, "__qualname__", repr(fn)), error=str(exc))

    def render(self) -> str:
        const = tuple(self.const_labels.items())
        lines: list[str] = []
        for m in self._metrics.values():
            lines.append(f"# HELP {m.name} {m.help.replace(chr(92), chr(92) * 2).replace(chr(10), chr(92) + 'n')}")
            lines.append(f"# TYPE {m.name} {m.kind}")
            lines.extend(m.samples(const))
        return "\n".join(lines) + "\n"

    async def scrape(self) -> str:
        await self.collect()
        return self.render()


# --- several processes' texts as one exposition ----------------------------------------
def merge(texts: Iterable[str]) -> str:
    """One exposition from many: each family's HELP/TYPE once, its samples from every text together
    (the format requires a family's samples in one group)."""
    families: dict[str, list[str]] = {}
    heads: dict[str, list[str]] = {}
    for text in texts:
        current = ""
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                current = line.split(" ", 3)[2]
                h = heads.setdefault(current, [])
                if not any(x.startswith(line[:7]) for x in h):
                    h.append(line)
                families.setdefault(current, [])
            elif line.startswith("#"):
                continue
            else:
                name = re.split(r"[{ ]", line, maxsplit=1)[0]
                fam = current if current and (name == current or name.startswith(current + "_")) else name
                families.setdefault(fam, []).append(line)
    out: list[str] = []
    for fam, samples in families.items():
        out.extend(heads.get(fam, []))
        out.extend(samples)
    return "\n".join(out) + "\n"


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Samples of an exposition as (name, labels, value): for tests and the dashboard's charts."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = {k: v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\") for k, v in _PAIR.findall(m.group(2) or "")}
        out.append((m.group(1), labels, float(m.group(3))))
    return out


# --- what every process reports ------------------------------------------------------
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def process_collector(reg: Registry) -> None:
    """CPU seconds, resident memory and start time of this process (the standard ``process_*`` names)."""
    cpu = reg.counter("process_cpu_seconds_total", "User and system CPU time of this process")
    rss = reg.gauge("process_resident_memory_bytes", "Resident memory of this process")
    start = reg.gauge("process_start_time_seconds", "Start of this process, unix seconds")
    started = time.time() - time.monotonic() + _proc_start_monotonic()

    def fill() -> None:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        cpu._only().value = ru.ru_utime + ru.ru_stime
        try:
            with open("/proc/self/statm") as f:
                rss.set(int(f.read().split()[1]) * _PAGE)
        except OSError:
            rss.set(ru.ru_maxrss * 1024)
        start.set(started)

    reg.collector(fill)


def _proc_start_monotonic() -> float:
    """This process's start on the monotonic clock (from /proc: the boot-relative start tick)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        return ticks / _TICK
    except (OSError, ValueError, IndexError):
        return time.monotonic()


def machine_memory() -> dict[str, int]:
    """Total and available memory of the whole machine, from /proc/meminfo."""
    vals: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, _, rest = line.partition(":")
            if k in ("MemTotal", "MemAvailable"):
                vals[k] = int(rest.split()[0]) * 1024
    return {"total": vals.get("MemTotal", 0), "available": vals.get("MemAvailable", 0)}


def machine_collector(reg: Registry) -> None:
    """Memory of the machine (the host agent's heartbeat has only what its sandboxes use)."""
    mem = reg.gauge("dsec_machine_memory_bytes", "Memory of the machine this process runs on", ["kind"])

    def fill() -> None:
        m = machine_memory()
        mem.set(m["total"], kind="total")
        mem.set(m["available"], kind="available")
        mem.set(m["total"] - m["available"], kind="used")

    reg.collector(fill)


def consumer_collector(reg: Registry, js: Callable[[], Any], consumers: Callable[[], Iterable[tuple[str, str]]]) -> None:
    """Pending counts of durable consumers, from JetStream consumer info, on each scrape. ``js()`` and
    ``consumers()`` (the (stream, durable) pairs) are read then: a service connects and starts its
    workers after registering this."""
    pending = reg.gauge("dsec_consumer_pending_messages", "Messages in the stream not yet delivered to this consumer", ["stream", "consumer"])
    ack_pending = reg.gauge("dsec_consumer_ack_pending_messages", "Messages delivered and not yet acked", ["stream", "consumer"])
    redelivered = reg.gauge("dsec_consumer_redelivered_messages", "Messages delivered more than once and not yet acked", ["stream", "consumer"])

    async def fill() -> None:
        for stream, durable in list(dict.fromkeys(consumers())):
            try:
                info = await js().consumer_info(stream, durable, timeout=2.0)
            except Exception as exc:  # noqa: BLE001 - a consumer gone or JetStream slow: leave it out this time
                logger.debug("consumer_info_failed", stream=stream, consumer=durable, error=str(exc))
                for g in (pending, ack_pending, redelivered):
                    g._children.pop((stream, durable), None)
                continue
            pending.set(info.num_pending or 0, stream=stream, consumer=durable)
            ack_pending.set(info.num_ack_pending or 0, stream=stream, consumer=durable)
            redelivered.set(info.num_redelivered or 0, stream=stream, consumer=durable)

    reg.collector(fill)


def stream_collector(reg: Registry, js: Callable[[], Any], streams: Sequence[str]) -> None:
    """Messages and bytes held by each stream (``js()`` read on each scrape)."""
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


# --- serving ---------------------------------------------------------------------------
SCRAPE_REQUEST = Decoder(MetricsRequest)
SCRAPE_REPLY = Decoder(MetricsReply)


class Exposition:
    """One process's registry served on the bus and, optionally, on an HTTP port."""

    def __init__(self, registry: Registry, service: str, instance: str) -> None:
        self.registry = registry
        self.service = service
        self.instance = instance
        self._subs: list[Any] = []
        self._server: asyncio.base_events.Server | None = None
        self.port = 0

    async def _reply(self) -> bytes:
        return encode(MetricsReply(service=self.service, instance=self.instance, text=await self.registry.scrape(), at=time.time()))

    async def _on_request(self, msg: Any) -> None:
        if not msg.reply or not S.valid_inbox(msg.reply):
            return  # replies go to inboxes only (bus.auth): never publish where a requester names
        try:
            await msg.respond(await self._reply())
        except Exception as exc:  # noqa: BLE001 - the scraper sees the missing reply
            logger.warning("metrics_reply_failed", error=str(exc))

    async def start(self, nc: Any, *, http_port: int | None = None, http_host: str = "0.0.0.0") -> None:
        for subject in (S.METRICS_SCRAPE, S.metrics(self.service, self.instance)):
            self._subs.append(await nc.subscribe(subject, cb=self._on_request))
        if http_port is not None:
            self._server = await asyncio.start_server(self._on_http, http_host, http_port)
            self.port = self._server.sockets[0].getsockname()[1]
            logger.info("metrics_http", port=self.port, service=self.service)

    async def stop(self) -> None:
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - connection already closed
                pass
        self._subs.clear()
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


async def scrape_all(nc: Any, *, timeout: float = 2.0, quiet_s: float = 0.25) -> list[MetricsReply]:
    """Ask every process on the bus for its metrics (scatter-gather on ``dsec.metrics.scrape``).

    Replies are gathered until ``quiet_s`` passes with none new after the first, or ``timeout``.
    """
    inbox = nc.new_inbox()
    got: list[MetricsReply] = []
    arrived = asyncio.Event()

    async def on(msg: Any) -> None:
        try:
            got.append(SCRAPE_REPLY.decode(msg.data))
        except Exception:  # noqa: BLE001 - a malformed reply is left out
            return
        arrived.set()

    sub = await nc.subscribe(inbox, cb=on)
    try:
        await nc.publish(S.METRICS_SCRAPE, encode(MetricsRequest()), reply=inbox)
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


_BAD_TOKEN = re.compile(r"[^A-Za-z0-9_-]")


def instance_of(service: Any) -> str:
    """The subject token naming one process: its host id or replica id, else hostname-pid."""
    raw = getattr(service, "host_id", None) or getattr(service, "replica_id", None) or f"{socket.gethostname()}-{os.getpid()}"
    return _BAD_TOKEN.sub("-", str(raw))[:128]


async def expose(service: Any) -> Exposition:
    """Serve a Service's registry (``service.metrics``) on the bus, and on ``service.metrics_port`` if set;
    with what every service reports: process usage and its pull workers' consumer pending counts."""
    reg: Registry = service.metrics
    instance = instance_of(service)
    reg.const_labels = {"service": service.name, "instance": instance, **reg.const_labels}
    process_collector(reg)
    inflight = reg.gauge("dsec_worker_inflight", "Messages a pull worker is handling now", ["consumer"])
    reg.collector(lambda: [inflight.set(w.inflight, consumer=w.durable) for w in service.workers] and None)
    consumer_collector(reg, lambda: service.js, lambda: [(w.stream, w.durable) for w in service.workers])
    ex = Exposition(reg, service.name, instance)
    await ex.start(service.nc, http_port=getattr(service, "metrics_port", None))
    return ex


def add_cli_flag(parser: Any) -> None:
    """``--metrics-port`` on a service's command line (default: $DSEC_METRICS_PORT, else none)."""
    env = os.environ.get("DSEC_METRICS_PORT")
    parser.add_argument(
        "--metrics-port", type=int, default=int(env) if env else None,
        help="also serve Prometheus metrics over HTTP on this port (0: any free port); always on the bus at dsec.metrics.<service>.<instance>",
    )


__all__ = [
    "CONTENT_TYPE",
    "Counter",
    "Gauge",
    "Histogram",
    "Registry",
    "Exposition",
    "machine_memory",
    "merge",
    "parse",
    "scrape_all",
    "process_collector",
    "machine_collector",
    "consumer_collector",
    "stream_collector",
    "add_cli_flag",
    "expose",
    "instance_of",
]
