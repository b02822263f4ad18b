"""The gateway's aiohttp application: one address for E2B's control plane, envd, sandbox ports and
dsec's own REST API.

A request is for a sandbox when it names one: the ``E2b-Sandbox-Id`` / ``E2b-Sandbox-Port`` headers
(what the e2b SDK sends when ``E2B_SANDBOX_URL`` points here) or a ``<port>-<id>.<domain>`` host
name, or a ``/v1/sandboxes/<id>/ports/<port>/`` path prefix (for clients that only take a base
URL; their key may then come as HTTP Basic auth's password). Port 49983 is envd (Connect RPCs, ``/files``, ``/health``); any other port is relayed to a
server inside the sandbox. Everything else is the control plane. Other modules add routes with
``add_routes(app)`` style functions (see ``make_app(extensions=...)``).
"""

from __future__ import annotations

import asyncio
import base64
import os
import re
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import structlog
from aiohttp import web

from bus.auth import ENV_MONITOR_URL
from bus.errors import DsecError, InvalidArgument, SandboxNotFound
from bus.runtime import nats_url

from . import _dashboard, _metrics, _model
from ._config import GatewayConfig
from ._connect import ConnectError, ServerStream, read_request, unary_error
from ._e2b import e2b_error, http_status
from ._filesystem import Filesystem, PayloadTooLarge
from ._ports import Ports
from ._process import Processes
from ._rest import RestApi
from ._runcode import RunCode
from ._runjupyter import RunJupyter
from ._signing import Signer, key_of_token
from ._templates import TemplateApi
from ._tenants import Tenant, Tenants
from ._users import Users

log = structlog.get_logger("dsec.gateway")

ENVD_PORT = 49983
HDR_SANDBOX_ID = "E2b-Sandbox-Id"
HDR_SANDBOX_PORT = "E2b-Sandbox-Port"
STREAMING = ("Start", "Connect", "WatchDir")  # server-streaming envd methods
KEY_HEADERS = ("X-API-Key", "X-Access-Token", "e2b-traffic-access-token")
_HOST = re.compile(r"^(\d{1,5})-([A-Za-z0-9_-]{1,128})\.")


class Gateway:
    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        self.nats_url = nats_url(cfg.nats_url)
        self.domain = cfg.sandbox_domain
        self.pool = cfg.pool
        self.tenants = Tenants(self.nats_url, records_url=os.environ.get(ENV_MONITOR_URL))
        self.users = Users()
        self.processes = Processes(self.users)
        self.files = Filesystem(self.users, cfg.max_upload)
        self.ports = Ports()
        self.signer = Signer()

    @staticmethod
    def api_key(request: web.Request) -> str | None:
        for h in KEY_HEADERS:
            v = request.headers.get(h)
            if v:
                return key_of_token(v)
        auth = request.headers.get("Authorization", "")
        if auth.startswith("Basic "):  # a key in a URL's user info (http://dsec:KEY@gateway/...): any user name
            try:
                return base64.b64decode(auth[6:], validate=True).decode().partition(":")[2] or None
            except (ValueError, UnicodeDecodeError):
                return None
        return auth[7:] if auth.startswith("Bearer ") else None

    async def tenant(self, request: web.Request) -> tuple[Tenant, str]:
        key = self.api_key(request)
        return await self.tenants.get(key), key or ""

    def envd_token(self, api_key: str, sid: str) -> str:
        """What the e2b SDK sends back as ``X-Access-Token`` on envd calls and signs file URLs with:
        the key and a tag binding it to the sandbox (``_signing``), so envd calls are the key's calls."""
        return self.signer.token(api_key, sid)

    def forget(self, sid: str) -> None:
        self.users.forget(sid)
        self.signer.forget(sid)
        for p in [p for p in self.processes.ptys if p[0] == sid]:
            self.processes.ptys.pop(p, None)
        for wid in [k for k, w in self.files.watchers.items() if w.sandbox_id == sid]:
            asyncio.ensure_future(self.files.watchers.pop(wid).handle._close_sub())

    # --- envd -------------------------------------------------------------------------------------------
    async def envd(self, request: web.Request, sid: str) -> web.StreamResponse:
        path = request.path
        is_rpc = path.startswith(("/process.Process/", "/filesystem.Filesystem/"))
        try:
            key = ""
            if path == "/files" and "signature" in request.query and self.api_key(request) is None:
                tenant = await self.tenants.get(self.signer.check(sid, request.method, dict(request.query)))
            else:
                tenant, key = await self.tenant(request)
            sb = await tenant.sandbox(sid)  # the key owns it (else not found): its signed URLs are checked with this key
            if key:
                self.signer.remember(sid, key)
            if path == "/health":
                if (await sb.get_info()).state == "paused":  # answered by its host agent
                    return sandbox_gone(sid)  # a paused sandbox does not run: E2B's is_running() is False
                return web.Response(status=204)
            if path == "/files":
                return await self._files(request, sb)
            if not is_rpc or request.method != "POST":
                return web.json_response({"code": 404, "message": f"envd has no route {request.method} {path}"}, status=404)
            return await self._rpc(request, sb, path)
        except PayloadTooLarge as exc:
            return web.json_response({"code": 413, "message": str(exc)}, status=413)
        except SandboxNotFound:
            return sandbox_gone(sid)
        except (ConnectError, DsecError) as exc:
            err = ConnectError.of(exc)
            if is_rpc and path.rsplit("/", 1)[-1] in STREAMING:
                return await ServerStream(request).close(err)  # a stream's error is its end message (HTTP 200)
            if is_rpc:
                return unary_error(err)
            status = http_status(exc) if isinstance(exc, DsecError) else 400
            return web.json_response({"code": status, "message": err.message}, status=status)

    async def _files(self, request: web.Request, sb: Any) -> web.StreamResponse:
        if request.method == "GET":
            return await self.files.download(request, sb)
        if request.method == "POST":
            return web.json_response(await self.files.upload(request, sb))
        return web.json_response({"code": 405, "message": f"{request.method} /files is not allowed"}, status=405)

    async def _rpc(self, request: web.Request, sb: Any, path: str) -> web.StreamResponse:
        service, _, method = path[1:].partition("/")
        body = await read_request(request)
        if service == "filesystem.Filesystem":
            if method == "WatchDir":
                return await self.files.watch(request, sb, body)
            return web.json_response(await self.files.unary(method, request, sb, body))
        if method == "Start":
            return await self.processes.start(request, sb, body)
        if method == "Connect":
            return await self.processes.connect(request, sb, body)
        return web.json_response(await self.processes.unary(method, sb, body))

    async def port_path(self, request: web.Request) -> web.StreamResponse:
        """``/v1/sandboxes/<id>/ports/<port>/<rest>``: ``/<rest>`` (with the query) to the sandbox's server."""
        sid, port = request.match_info["id"], request.match_info["port"]
        tenant, _ = await self.tenant(request)
        sb = await tenant.sandbox(sid)
        prefix = f"/v1/sandboxes/{sid}/ports/{port}"
        rest = request.raw_path[len(prefix):] if request.raw_path.startswith(prefix) else "/" + request.match_info["rest"]
        return await self.ports.relay(request, sb, int(port), rest if rest.startswith("/") else "/" + rest)

    # --- routing ------------------------------------------------------------------------------------------
    def sandbox_target(self, request: web.Request) -> tuple[str, int] | None:
        sid = request.headers.get(HDR_SANDBOX_ID)
        if sid:
            port = request.headers.get(HDR_SANDBOX_PORT, str(ENVD_PORT))
            if not port.isdigit():
                raise InvalidArgument(f"{HDR_SANDBOX_PORT} must be a port number, got {port!r}")
            return sid, int(port)
        m = _HOST.match(request.host or "")
        if m:
            return m.group(2), int(m.group(1))
        return None

    @web.middleware
    async def middleware(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        try:
            target = self.sandbox_target(request)
            if target is not None:
                sid, port = target
                if port == ENVD_PORT:
                    return await self.envd(request, sid)
                tenant, _ = await self.tenant(request)
                try:
                    sb = await tenant.sandbox(sid)
                except SandboxNotFound:
                    return sandbox_gone(sid)
                return await self.ports.relay(request, sb, port)
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            msg = f"no route {request.method} {request.path}" if exc.status in (404, 405) else exc.reason
            return _error(request, exc.status, "not_found" if exc.status == 404 else "bad_request", msg)
        except PayloadTooLarge as exc:
            return _error(request, 413, "payload_too_large", str(exc))
        except DsecError as exc:
            return _error(request, http_status(exc), exc.code, exc.description)


def sandbox_gone(sid: str) -> web.Response:
    """What E2B's proxy answers for a sandbox it does not know (killed, timed out, never there, or
    another key's): 502 "... was not found", which the e2b SDK raises as SandboxNotRunning."""
    return web.json_response({"code": 502, "message": f"The sandbox {sid} was not found", "sandboxId": sid}, status=502)


GATEWAY_KEY = web.AppKey("gateway", Gateway)


def _error(request: web.Request, status: int, code: str, message: str) -> web.Response:
    """dsec's REST API says its stable code; the E2B API its HTTP status (as E2B does)."""
    if request.path.startswith("/v1/"):
        return web.json_response({"code": code, "message": message}, status=status)
    return e2b_error(status, message)


def _monitor(app: web.Application) -> None:
    """/metrics and /dashboard: the operator's read-only view, on a NATS identity of its own (``dsec up``
    hands the monitor's URL; without one, the gateway's)."""
    client = os.environ.get(ENV_MONITOR_URL) or app[GATEWAY_KEY].nats_url
    _metrics.add_routes(app, client)
    _dashboard.add_routes(app, client)


# Modules that add routes (metrics, dashboard, ...): each a function taking the app; the Gateway
# (tenants, config) is ``app[GATEWAY_KEY]``. ``python -m sdk.gateway`` serves these.
EXTENSIONS: list[Callable[[web.Application], Any]] = [_monitor, _model.add_routes]


async def _health(_request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


def make_app(cfg: GatewayConfig, extensions: Iterable[Callable[[web.Application], Any]] | None = None) -> web.Application:
    """The gateway app; each extension (default: EXTENSIONS) is a function that adds its routes to the app."""
    gw = Gateway(cfg)
    app = web.Application(middlewares=[gw.middleware], client_max_size=4 * 1024 * 1024)
    app[GATEWAY_KEY] = gw
    templates = TemplateApi(gw)
    app.router.add_routes(templates.routes())  # first: its DELETE /templates/{id} hands snapshots to E2BApi
    app.router.add_routes(templates.e2b.routes())
    RestApi(gw).add_routes(app)
    RunCode(gw).add_routes(app)  # SandboxFusion's POST /run_code over FnCall
    RunJupyter(gw).add_routes(app)  # and its POST /run_jupyter
    app.router.add_get("/health", _health)
    app.router.add_route("*", r"/v1/sandboxes/{id}/ports/{port:\d{1,5}}{rest:(/.*)?}", gw.port_path)
    for ext in EXTENSIONS if extensions is None else extensions:
        ext(app)
    return app


__all__ = ["ENVD_PORT", "GATEWAY_KEY", "Gateway", "GatewayConfig", "make_app"]
