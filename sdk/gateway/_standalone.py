"""A small aiohttp app serving ``/metrics`` and ``/dashboard`` (``python -m sdk.gateway._standalone``),
for a stack without the full gateway; the gateway serves the same routes through ``add_routes``."""

from __future__ import annotations

import argparse

from aiohttp import web

from bus import log as _log
from bus.runtime import nats_url

from . import _dashboard, _metrics


def make_app(url: str | None = None) -> web.Application:
    app = web.Application()
    _metrics.add_routes(app, nats_url(url))
    _dashboard.add_routes(app, nats_url(url))

    async def index(_request: web.Request) -> web.Response:
        raise web.HTTPFound("/dashboard")

    app.router.add_get("/", index)
    return app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m sdk.gateway._standalone", description=__doc__)
    ap.add_argument("--nats-url", default=None, help="default: $DSEC_NATS_URL or nats://127.0.0.1:4222")
    ap.add_argument("--http-host", default="127.0.0.1")
    ap.add_argument("--http-port", type=int, default=3000)
    args = ap.parse_args(argv)
    _log.configure()
    web.run_app(make_app(args.nats_url), host=args.http_host, port=args.http_port, print=lambda m: print(f"dsec gateway: {m}", flush=True))


if __name__ == "__main__":
    main()
