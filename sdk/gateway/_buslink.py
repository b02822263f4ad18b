"""The NATS connection the metrics and dashboard routes use, whatever gateway hosts them.

``client`` is what the hosting app hands ``add_routes``: a NATS URL, or an object with a connected
``nc``, a ``nats_url``, or a ``cfg.nats_url`` (the gateway's config). Without a usable ``nc`` the
routes open one connection of their own on first use, closed with the app.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from bus.errors import DsecError
from bus.runtime import connect, nats_url


class BusLink:
    def __init__(self, client: Any) -> None:
        self.client = client
        self._own: Any = None
        self._lock = asyncio.Lock()

    @property
    def url(self) -> str:
        c = self.client
        if isinstance(c, str):
            return nats_url(c)
        return nats_url(getattr(c, "nats_url", None) or getattr(getattr(c, "cfg", None), "nats_url", None))

    async def nc(self) -> Any:
        have = getattr(self.client, "nc", None)
        if have is not None and have.is_connected:
            return have
        async with self._lock:
            if self._own is None or self._own.is_closed:
                try:
                    self._own = await connect(self.url, name="dsec-gateway-metrics", connect_attempts=2, connect_timeout_s=5.0)
                except DsecError as exc:
                    raise web.HTTPServiceUnavailable(text=f"the gateway cannot reach NATS: {exc.description}\n") from None
        return self._own

    async def close(self, _app: web.Application | None = None) -> None:
        if self._own is not None and not self._own.is_closed:
            await self._own.drain()
        self._own = None


LINK_KEY = web.AppKey("dsec_bus_link", BusLink)
ENV_PUBLIC = "DSEC_MONITOR_PUBLIC"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def operator_only(handler: Handler) -> Handler:
    """The operator's view (every tenant's sandboxes, the whole control plane): answered on loopback
    only, unless $DSEC_MONITOR_PUBLIC=1 (the compose stack, whose published port is on 127.0.0.1)."""

    async def guarded(request: web.Request) -> web.StreamResponse:
        if os.environ.get(ENV_PUBLIC) != "1":
            try:
                local = ipaddress.ip_address(request.remote or "").is_loopback
            except ValueError:
                local = False
            if not local:
                raise web.HTTPForbidden(reason=f"{request.path} is served to this machine only (set {ENV_PUBLIC}=1 to serve it to any address)")
        return await handler(request)

    return guarded


def link_of(app: web.Application, client: Any) -> BusLink:
    """One link per app, shared by the routes that need it."""
    link = app.get(LINK_KEY)
    if link is None:
        link = app[LINK_KEY] = BusLink(client)
        app.on_cleanup.append(link.close)
    return link


__all__ = ["BusLink", "link_of", "operator_only"]
