"""A small aiohttp app serving ``/metrics`` and ``/dashboard`` (``python -m sdk.gateway._app``), until
the full gateway serves the same routes with ``add_routes(app, client)``."""

from __future__ import annotations

import argparse

from aiohttp import web

from bus import log as _log
from bus.runtime import connect, nats_url

from . import _dashboard, _metrics


class Client:
    """What the routes take: the NATS URL, and a connection of the gateway's own once the app started."""

    def __init__(self, url: str | None = None) -> None:
        self.nats_url = nats_url(url)
        self.nc = None

    async def connect(self, _app: web.Application) -> None:
        self.nc = await connect(self.nats_url, name="dsec-gateway")

    async def close(self, _app: web.Application) -> None:
        if self.nc is not None and not self.nc.is_closed:
            await self.nc.drain()


def make_app(client: Client) -> web.Application:
    app = web.Application()
    app.on_startup.append(client.connect)  # before the routes' own start-up hooks
    _metrics.add_routes(app, client)
    _dashboard.add_routes(app, client)
    app.on_cleanup.append(client.close)

    async def index(_request: web.Request) -> web.Response:
        raise web.HTTPFound("/dashboard")

    app.router.add_get("/", index)
    return app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m sdk.gateway._app", description=__doc__)
    ap.add_argument("--nats-url", default=None, help="default: $DSEC_NATS_URL or nats://127.0.0.1:4222")
    ap.add_argument("--http-host", default="127.0.0.1")
    ap.add_argument("--http-port", type=int, default=3000)
    args = ap.parse_args(argv)
    _log.configure()
    web.run_app(make_app(Client(args.nats_url)), host=args.http_host, port=args.http_port, print=lambda m: print(f"dsec gateway: {m}", flush=True))


if __name__ == "__main__":
    main()
