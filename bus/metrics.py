"""Prometheus metrics of every dsec process, without a client library.

A :class:`Registry` holds counters, gauges and histograms (each with optional labels) and renders them
as the Prometheus text exposition format 0.0.4. Gauges that mirror state (sandboxes per state, consumer
pending counts) are filled by *collectors*, callbacks run on each scrape, so nothing is kept in step on
the hot path. :func:`merge` joins several processes' texts into one exposition (the gateway's
``/metrics``). Serving them on the bus (``dsec.metrics.scrape``, ``dsec.metrics.<service>.<instance>``)
and over HTTP (``--metrics-port``) is the runtime's part: ``bus.runtime.metrics``.
"""

from __future__ import annotations

import bisect
import math
import os
import re
import resource
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

from . import log as _log

logger = _log.get_logger("dsec.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Seconds: from a 1 ms exec round trip to a minute-long cold create.
DEFAULT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*\Z")

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
        if len(kv) == len(self.label_names):
            try:
                return tuple([str(kv[n]) for n in self.label_names])
            except KeyError:
                pass
        raise ValueError(f"{self.name} takes labels {self.label_names}, got {tuple(kv)}")

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


_M = TypeVar("_M", bound=_Metric)


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
    return [f"{m.name}{_labels(const + tuple(zip(m.label_names, k, strict=True)))} {_fmt(c.value)}" for k, c in m._children.items()]


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
            base = const + tuple(zip(self.label_names, k, strict=True))
            acc = 0
            for b, c in zip(self.buckets, h.counts, strict=True):
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

    def _add(self, m: _M) -> _M:
        have = self._metrics.get(m.name)
        if have is not None:
            if type(have) is not type(m) or not isinstance(have, type(m)) or have.label_names != m.label_names:
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


def add_cli_flag(parser: Any) -> None:
    """``--metrics-port`` on a service's command line (default: $DSEC_METRICS_PORT, else none)."""
    env = os.environ.get("DSEC_METRICS_PORT")
    parser.add_argument(
        "--metrics-port", type=int, default=int(env) if env else None,
        help="also serve Prometheus metrics over HTTP on this port, on $DSEC_METRICS_HOST or 127.0.0.1 (0: any free port); "
             "always on the bus at dsec.metrics.<service>.<instance>",
    )


__all__ = [
    "CONTENT_TYPE",
    "Counter",
    "Gauge",
    "Histogram",
    "Registry",
    "machine_memory",
    "merge",
    "parse",
    "process_collector",
    "machine_collector",
    "add_cli_flag",
]
