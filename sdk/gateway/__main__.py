"""``python -m sdk.gateway [--http-port 3000]``: the gateway in the foreground until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import signal

import structlog
from aiohttp import web

from bus.log import configure as configure_logging
from bus.runtime import nats_url

from .._async import close_connections
from ._app import GatewayConfig, make_app

log = structlog.get_logger("dsec.gateway")


async def serve(args: argparse.Namespace) -> None:
    cfg = GatewayConfig(
        nats_url=nats_url(args.nats_url), domain=args.domain or f"localhost:{args.http_port}", pool=args.pool,
        max_upload=args.max_upload_mb * 1024 * 1024,
    )
    runner = web.AppRunner(make_app(cfg), handle_signals=False, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.http_port)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for s in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(s, stop.set)
    log.info("gateway_listening", url=f"http://{args.host}:{args.http_port}", domain=cfg.domain)
    print(f"gateway listening on http://{args.host}:{args.http_port}", flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await close_connections()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m sdk.gateway", description=__doc__)
    ap.add_argument("--http-port", type=int, default=3000)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--nats-url", default=None, help="default: $DSEC_NATS_URL (no credentials: each API key is its own NATS user)")
    ap.add_argument("--domain", default=None, help="sandbox host names are <port>-<id>.<domain> (default localhost:<http-port>)")
    ap.add_argument("--pool", default="default", help="the placement pool sandboxes are created in")
    ap.add_argument("--max-upload-mb", type=int, default=1024)
    args = ap.parse_args(argv)
    configure_logging()
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
