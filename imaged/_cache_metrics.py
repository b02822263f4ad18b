"""What a host's lazy loader reports to Prometheus (bus.metrics): its chunk cache and fetches, read
from the cache's own counters on each scrape."""

from __future__ import annotations

from typing import Any

from bus.metrics import Registry, process_collector

# counter name -> (attribute of ChunkCache.counters, help)
_COUNTERS = {
    "dsec_lazy_downloaded_bytes_total": ("downloaded_bytes", "Bytes fetched from the blob store"),
    "dsec_lazy_cache_written_bytes_total": ("cache_written_bytes", "Bytes written to the local chunk cache"),
    "dsec_lazy_evicted_bytes_total": ("evicted_bytes", "Bytes evicted from the local chunk cache"),
    "dsec_lazy_fetches_total": ("fetches", "Chunk fetches from the blob store"),
    "dsec_lazy_fetch_failures_total": ("fetch_failures", "Chunk fetches that failed after every attempt"),
    "dsec_lazy_corrupt_chunks_total": ("corrupt_chunks", "Fetched chunks whose digest did not match"),
    "dsec_lazy_reads_total": ("reads", "FUSE reads served"),
    "dsec_lazy_fetch_seconds_total": ("fetch_seconds", "Wall time spent in blob store fetches"),
    "dsec_lazy_read_seconds_total": ("read_seconds", "Wall time spent serving FUSE reads, fetches included"),
}


def cache_registry(cache: Any) -> Registry:
    reg = Registry()
    process_collector(reg)
    counters = {name: (attr, reg.counter(name, help)) for name, (attr, help) in _COUNTERS.items()}
    size = reg.gauge("dsec_lazy_cache_bytes", "Bytes of chunks in the local cache, and its limit", ["kind"])

    def fill() -> None:
        for attr, c in counters.values():
            c.labels().value = getattr(cache.counters, attr)
        size.set(cache.cache_bytes, kind="used")
        size.set(cache.max_bytes, kind="max")

    reg.collector(fill)
    return reg


__all__ = ["cache_registry"]
