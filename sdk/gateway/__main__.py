"""``python -m sdk.gateway [--http-port 3000]``: the gateway in the foreground until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import signal

import structlog
from aiohttp import web

from bus.config import from_args, parser
from bus.log import configure as configure_logging

from .._async import close_connections
from ._app import make_app
from ._config import GatewayConfig

log = structlog.get_logger("dsec.gateway")


async def serve(cfg: GatewayConfig) -> None:
    runner = web.AppRunner(make_app(cfg), handle_signals=False, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.http_port)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for s in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(s, stop.set)
    log.info("gateway_listening", url=f"http://{cfg.host}:{cfg.http_port}", domain=cfg.sandbox_domain)
    print(f"gateway listening on http://{cfg.host}:{cfg.http_port}", flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await close_connections()


def main(argv: list[str] | None = None) -> None:
    cfg = from_args(GatewayConfig, parser("python -m sdk.gateway", __doc__, GatewayConfig).parse_args(argv))
    configure_logging()
    asyncio.run(serve(cfg))


if __name__ == "__main__":
    main()
