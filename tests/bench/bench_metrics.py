#!/usr/bin/env python3
"""What metrics cost: the hot-path calls (counter inc, histogram observe with a label) in ns each, and a
scrape over the bus (scatter-gather on dsec.metrics.scrape) of N services on a real nats-server.

    python tests/bench/bench_metrics.py [--services 8] [--scrapes 50] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bus.metrics import Registry, merge  # noqa: E402
from bus.natsd import NatsServer  # noqa: E402
from bus.runtime import Service, connect, scrape_all  # noqa: E402


def hot_path(n: int = 200_000) -> dict[str, float]:
    reg = Registry({"service": "bench", "instance": "b"})
    c = reg.counter("dsec_bench_total", "x", ["result"])
    h = reg.histogram("dsec_bench_seconds", "x", ["op"])
    t0 = time.perf_counter_ns()
    for _ in range(n):
        c.inc(result="ready")
    inc_ns = (time.perf_counter_ns() - t0) / n
    t0 = time.perf_counter_ns()
    for i in range(n):
        h.observe((i % 1000) / 1000.0, op="exec")
    obs_ns = (time.perf_counter_ns() - t0) / n
    return {"counter_inc_ns": round(inc_ns, 1), "histogram_observe_ns": round(obs_ns, 1)}


class _Svc(Service):
    name = "bench"

    def __init__(self, url: str, i: int) -> None:
        super().__init__(url, grace_s=1)
        self.replica_id = f"b{i}"
        h = self.metrics.histogram("dsec_bench_op_seconds", "x", ["op"])
        for op in ("exec", "files", "info", "kill", "timeout"):
            for v in range(100):
                h.observe(v / 100, op=op)


async def scrape(services: int, scrapes: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="dsec-bench-metrics-") as d:
        srv = NatsServer(d, port=0)
        srv.start()
        svcs = [_Svc(srv.url, i) for i in range(services)]
        try:
            for s in svcs:
                await s.start()
            nc = await connect(srv.url)
            times, sizes = [], []
            for _ in range(scrapes):
                t0 = time.perf_counter()
                replies = await scrape_all(nc, quiet_s=0.05)
                times.append((time.perf_counter() - t0) * 1000)
                assert len(replies) == services, len(replies)
                sizes.append(len(merge(r.text for r in replies)))
            await nc.close()
        finally:
            for s in svcs:
                await s.shutdown()
            srv.stop()
    times.sort()
    return {"services": services, "scrape_ms_p50": round(statistics.median(times), 2), "scrape_ms_p99": round(times[int(len(times) * 0.99) - 1], 2),
            "merged_bytes": sizes[-1], "note": "each scrape waits quiet_s=50 ms after the last reply"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--services", type=int, default=8)
    ap.add_argument("--scrapes", type=int, default=50)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    out = {**hot_path(), **asyncio.run(scrape(a.services, a.scrapes))}
    print(json.dumps(out) if a.json else "\n".join(f"{k}: {v}" for k, v in out.items()))


if __name__ == "__main__":
    main()
