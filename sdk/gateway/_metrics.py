"""``GET /metrics``: the Prometheus metrics of every dsec process, gathered over the bus.

The gateway asks on ``dsec.metrics.scrape`` (every service answers, bus.metrics) and merges the texts
into one exposition, each sample labelled with the service and instance that reported it; its own
process metrics and how many processes answered are added. ``?service=NAME`` keeps only that service.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from bus.metrics import CONTENT_TYPE, Registry, merge, process_collector
from bus.runtime import scrape_all

from ._buslink import link_of, operator_only

APP_KEY = web.AppKey("dsec_metrics", Registry)


def add_routes(app: web.Application, client: Any) -> None:
    """``client``: a NATS URL or the hosting gateway's client (see ``_buslink``)."""
    link = link_of(app, client)
    own = Registry({"service": "gateway", "instance": "gateway"})
    process_collector(own)
    answered = own.gauge("dsec_scrape_processes", "Processes that answered the gateway's last scrape over the bus")
    took = own.gauge("dsec_scrape_seconds", "Time the gateway's last scrape over the bus took")
    app[APP_KEY] = own

    async def metrics(request: web.Request) -> web.Response:
        t0 = time.perf_counter()
        replies = await scrape_all(await link.nc())
        only = request.query.get("service")
        if only:
            replies = [r for r in replies if r.service == only]
        answered.set(len(replies))
        took.set(time.perf_counter() - t0)
        text = merge([r.text for r in replies] + [await own.scrape()])
        return web.Response(body=text.encode(), headers={"Content-Type": CONTENT_TYPE})

    app.router.add_get("/metrics", operator_only(metrics))


__all__ = ["add_routes"]
