"""The dashboard: one page (``/dashboard``) showing hosts, sandboxes, a live event feed and each host's
memory and CPU over time. No CDN, no build step: the page is inline HTML, CSS and JS drawing SVG.

- ``GET /dashboard/state``: hosts (from their heartbeats), running sandboxes, the recent events and each
  host's samples (taken every ``SAMPLE_S`` for ``HISTORY_S``, so a page opened late still has a history).
- ``GET /dashboard/events``: server-sent events, one per message on ``dsec.evt.>`` (the gateway
  subscribes once and fans out; a slow page loses its oldest events, never blocks the others).
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from bus import codec
from bus.errors import BadRequest, DsecError
from bus.messages import ReadyMany
from bus.log import get_logger
from bus.metrics import parse
from bus.runtime import scrape_all

from .._admin import cluster_status
from .._async import AsyncSandbox
from ._buslink import BusLink, link_of, operator_only

log = get_logger("dsec.gateway.dashboard")

SAMPLE_S = 2.0
HISTORY_S = 600.0
RECENT_EVENTS = 200
LISTENER_QUEUE = 500
EVENTS_SUBJECT = "dsec.evt.>"
MB = 1024 * 1024
PAGE = Path(__file__).with_name("dashboard.html")
APP_KEY = web.AppKey("dsec_dashboard", object)
# The reclaim service's per-sandbox gauges, as the fields of a sandbox's info they fill.
SANDBOX_MEMORY = {"dsec_reclaim_sandbox_resident_bytes": "mem_resident_bytes", "dsec_reclaim_sandbox_reclaimed_bytes": "mem_reclaimed_bytes",
                  "dsec_reclaim_sandbox_merged_bytes": "mem_merged_bytes"}


class Dashboard:
    def __init__(self, link: BusLink) -> None:
        self.link = link
        self.history: dict[str, collections.deque[list[float]]] = {}
        self.hosts: list[dict[str, Any]] = []
        self.sandbox_memory: dict[str, dict[str, int]] = {}
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT_EVENTS)
        self.listeners: set[asyncio.Queue[dict[str, Any]]] = set()
        self._sub: Any = None
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return self.link.url

    async def start(self, _app: web.Application | None = None) -> None:
        self._task = asyncio.create_task(self._sample_loop(), name="dashboard-sampler")

    async def stop(self, _app: web.Application | None = None) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - stopping
                pass
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # noqa: BLE001 - connection already closed
                pass
            self._sub = None

    # --- hosts over time --------------------------------------------------------------------
    async def _scrape(self) -> dict[str, int]:
        """Memory in use on each host's machine (its host agent's metrics; heartbeats carry only what
        sandboxes use); on the way, each sandbox's memory as its host's reclaim service last saw it."""
        replies = await scrape_all(await self.link.nc(), timeout=1.0, quiet_s=0.1)
        used: dict[str, int] = {}
        mem: dict[str, dict[str, int]] = {}
        for r in replies:
            if r.service == "hostagent":
                for name, labels, value in parse(r.text):
                    if name == "dsec_machine_memory_bytes" and labels.get("kind") == "used":
                        used[r.instance] = int(value // MB)
            elif r.service == "reclaim":
                for name, labels, value in parse(r.text):
                    kind = SANDBOX_MEMORY.get(name)
                    if kind and "sandbox" in labels:
                        mem.setdefault(labels["sandbox"], {})[kind] = int(value)
        self.sandbox_memory = mem
        return used

    async def sample(self) -> None:
        st = await cluster_status(self.url, timeout=3.0)
        machine = await self._scrape()
        now = time.time()
        self.hosts = st["hosts"]
        for h in self.hosts:
            h["machine_mem_used_mb"] = machine.get(h["host_id"])
            series = self.history.setdefault(h["host_id"], collections.deque(maxlen=int(HISTORY_S / SAMPLE_S)))
            series.append([round(now, 3), h["mem_resident_mb"], h["mem_alloc_mb"], h["mem_total_mb"], round(h["cpu_busy"], 3), h["cpu_total"],
                           h["machine_mem_used_mb"]])
        for gone in set(self.history) - {h["host_id"] for h in self.hosts}:
            del self.history[gone]

    async def _sample_loop(self) -> None:
        while True:
            try:
                await self._ensure_subscribed()
                await self.sample()
            except asyncio.CancelledError:
                raise
            except (DsecError, Exception) as exc:  # noqa: BLE001 - NATS away: the page shows the last state
                log.warning("dashboard_sample_failed", error=str(exc))
            await asyncio.sleep(SAMPLE_S)  # sampling period

    # --- events -----------------------------------------------------------------------------
    async def _ensure_subscribed(self) -> None:
        if self._sub is None:
            self._sub = await (await self.link.nc()).subscribe(EVENTS_SUBJECT, cb=self._on_event)

    async def _on_event(self, msg: Any) -> None:
        try:
            ev = codec.EVENT.decode(msg.data)
        except BadRequest:
            return
        d = msgspec.to_builtins(ev)
        d["type"] = type(ev).__name__
        d["subject"] = msg.subject
        if isinstance(ev, ReadyMany):  # a host batch's one ready event: shown as the ready of its members
            ids = ev.sandbox_ids
            d["kind"] = "ready"
            d["sandbox_id"] = ", ".join(ids[:3]) + (f" (+{len(ids) - 3})" if len(ids) > 3 else "")
        self.recent.append(d)
        for q in list(self.listeners):
            if q.full():
                q.get_nowait()  # a slow page loses its oldest event
            q.put_nowait(d)

    # --- handlers -----------------------------------------------------------------------------
    async def page(self, _request: web.Request) -> web.Response:
        return web.Response(text=PAGE.read_text(), content_type="text/html", charset="utf-8")

    async def state(self, _request: web.Request) -> web.Response:
        await self._ensure_subscribed()
        if not self.hosts:
            try:
                await self.sample()
            except DsecError as exc:
                raise web.HTTPServiceUnavailable(text=json.dumps({"code": exc.code, "message": exc.description}), content_type="application/json") from None
        try:
            sandboxes = [msgspec.to_builtins(s) for s in await AsyncSandbox.list(nats_url=self.url, state="running")]
        except DsecError as exc:
            raise web.HTTPServiceUnavailable(text=json.dumps({"code": exc.code, "message": exc.description}), content_type="application/json") from None
        except Exception:  # noqa: BLE001 - no sandbox bucket yet (a stack that never ran a host)
            sandboxes = []
        for sb in sandboxes:
            sb.update(self.sandbox_memory.get(sb["sandbox_id"], {}))
        return web.json_response({
            "at": time.time(),
            "hosts": self.hosts,
            "history": {h: list(s) for h, s in self.history.items()},
            "history_fields": ["at", "mem_resident_mb", "mem_alloc_mb", "mem_total_mb", "cpu_busy", "cpu_total", "machine_mem_used_mb"],
            "sandboxes": sorted(sandboxes, key=lambda s: -s.get("started_at", 0)),
            "events": list(self.recent)[-50:],
        })

    async def events(self, request: web.Request) -> web.StreamResponse:
        await self._ensure_subscribed()
        q: asyncio.Queue[dict[str, Any]] = asyncio.Queue(LISTENER_QUEUE)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        self.listeners.add(q)
        try:
            await resp.write(b": dsec events\n\n")
            while True:
                try:
                    d = await asyncio.wait_for(q.get(), 15.0)
                    await resp.write(b"data: " + json.dumps(d, separators=(",", ":")).encode() + b"\n\n")
                except asyncio.TimeoutError:
                    await resp.write(b": keep-alive\n\n")  # finds a page that went away
        except ConnectionError:  # the page went away
            pass
        finally:
            self.listeners.discard(q)
        return resp


def add_routes(app: web.Application, client: Any) -> Dashboard:
    """``client``: a NATS URL or the hosting gateway's client (see ``_buslink``)."""
    dash = Dashboard(link_of(app, client))
    app[APP_KEY] = dash
    app.on_startup.append(dash.start)
    app.on_shutdown.append(dash.stop)  # before the link closes (on_cleanup)
    app.router.add_get("/dashboard", operator_only(dash.page))
    app.router.add_get("/dashboard/state", operator_only(dash.state))
    app.router.add_get("/dashboard/events", operator_only(dash.events))
    return dash


__all__ = ["Dashboard", "add_routes"]
