"""The gateway's /metrics (every service's metrics merged over the bus) and its dashboard page, loaded
in headless Chromium: it shows a sandbox created during the test and the live event feed."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from bus.metrics import parse
from tests.conftest import eventually, needs

from .conftest import Stack, needs_stack

pytestmark = [pytest.mark.containerd, needs_stack]

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# Without the background-networking flags Chromium keeps dialling out, and this machine refuses it
# (Playwright adds --headless and its own throw-away --user-data-dir).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]


@contextlib.asynccontextmanager
async def gateway(stack: Stack) -> AsyncIterator[str]:
    from sdk.gateway import GatewayConfig, make_app

    runner = web.AppRunner(make_app(GatewayConfig(nats_url=stack.url)))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_gateway_metrics_are_every_service_merged(stack: Stack) -> None:
    async with stack.sandbox(memory_mb=64) as sb, gateway(stack) as base, aiohttp.ClientSession() as http:
        await sb.commands.run("true")
        async with http.get(f"{base}/metrics") as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = await r.text()
        lines = text.splitlines()
        types = [ln.split()[2] for ln in lines if ln.startswith("# TYPE ")]
        assert len(types) == len(set(types)), "each family once"
        samples = parse(text)
        services = {lab.get("service") for _, lab, _ in samples}
        assert {"hostagent", "placement", "gateway"} <= services, services
        assert any(n == "dsec_sandbox_op_seconds_count" and lab.get("op") == "exec" and v >= 1 for n, lab, v in samples)
        assert any(n == "dsec_scrape_processes" and v >= 3 for n, _, v in samples)  # the host agent and two placement replicas at least
        async with http.get(f"{base}/metrics", params={"service": "hostagent"}) as r:
            only = {lab.get("service") for _, lab, _ in parse(await r.text())}
        assert only == {"hostagent", "gateway"}


@needs(None if os.path.exists(CHROMIUM) else "chromium not installed (bash compose/dev.sh install)")
async def test_dashboard_shows_a_new_sandbox_and_live_events_in_chromium(stack: Stack) -> None:
    from playwright.async_api import async_playwright

    shot = Path(os.environ.get("DSEC_ARTIFACTS_DIR") or tempfile.gettempdir()) / "dsec-dashboard.png"
    async with gateway(stack) as base, stack.sandbox(memory_mb=96, metadata={"who": "dashboard-test"}) as sb, async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = await browser.new_page(viewport={"width": 1400, "height": 900})
            await page.goto(f"{base}/dashboard")
            await page.wait_for_selector(f"#sandboxes td:text-is('{sb.sandbox_id}')", timeout=15_000)
            await page.wait_for_selector(f"#hosts td:text-is('{stack.host_id}')", timeout=15_000)
            await page.wait_for_selector("#conn.on", timeout=15_000)
            await sb.commands.run("echo from-the-dashboard-test")  # an exec event, pushed to the page live
            await page.wait_for_selector(f"#events div.k-exec:has-text('{sb.sandbox_id}')", timeout=15_000)

            async def charted() -> bool:  # heartbeats sampled: the host's chart has its lines
                return await page.locator(f".chart[data-host='{stack.host_id}'] svg polyline").count() >= 3  # machine, sandboxes, cpu

            await eventually(charted, timeout=20, what="the host's memory and CPU chart drawn")
            assert await page.title() == "dsec dashboard"
            assert int(await page.text_content("#n-sbx") or 0) >= 1

            async def sampled() -> bool:  # a few samples, so the screenshot shows lines over time
                state = await page.evaluate("fetch('/dashboard/state').then(r => r.json())")
                return len(state["history"].get(stack.host_id, [])) >= 3

            await eventually(sampled, timeout=20, what="three samples of the host")
            await page.evaluate("refresh()")
            await page.screenshot(path=str(shot), full_page=True)
            print(f"dashboard screenshot: {shot}")
        finally:
            await browser.close()
    assert shot.stat().st_size > 10_000


async def test_routes_take_the_hosting_gateways_client(stack: Stack) -> None:
    """The full gateway hands its own object (its config carries the NATS URL); a client with a live
    connection (``nc``) is used as it is."""
    from types import SimpleNamespace

    from bus.runtime import connect
    from sdk.gateway import _metrics

    nc = await connect(stack.url)
    try:
        for client in (SimpleNamespace(cfg=SimpleNamespace(nats_url=stack.url)), SimpleNamespace(nc=nc)):
            app = web.Application()
            _metrics.add_routes(app, client)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            try:
                async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics") as r:
                    assert r.status == 200
                    assert "hostagent" in {lab.get("service") for _, lab, _ in parse(await r.text())}
            finally:
                await runner.cleanup()
        assert nc.is_connected  # the client's own connection is not the routes' to close
    finally:
        await nc.close()
