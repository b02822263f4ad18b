"""E2B's control plane (api.e2b.dev) over dsec: create, list, get, kill, timeout, connect, metrics.

Paths, fields and statuses follow the e2b SDK's generated API client; errors are E2B's
``{"code": <http status>, "message": ...}``. Every route acts for the API key's tenant only.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import time
from typing import Any
from urllib.parse import parse_qsl

from aiohttp import web

from bus.errors import DsecError, InvalidArgument, NotSupported, SandboxNotFound
from bus.messages import SandboxRecord

from ._tenants import Tenant

ENVD_VERSION = "0.6.4"  # the envd API level the gateway speaks (the e2b SDK gates features on it)
DEFAULT_TIMEOUT_S = 15  # E2B's default sandbox timeout
MAX_TIMEOUT_S = 30 * 86400
CREATE_TIMEOUT_S = 60.0
PAGE_MAX = 1000

STATUS = {
    "sandbox_not_found": 404, "file_not_found": 404, "unknown_template": 404, "not_found": 404,
    "invalid_argument": 400, "bad_request": 400, "unauthenticated": 401, "permission_denied": 403,
    "payload_too_large": 413, "no_capacity": 503, "unavailable": 503, "timeout": 504, "not_supported": 501,
    "create_failed": 500, "host_rejected": 500,
}


def http_status(exc: DsecError) -> int:
    return STATUS.get(exc.code, 500)


def e2b_error(status: int, message: str) -> web.Response:
    return web.json_response({"code": status, "message": message}, status=status)


def iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t or time.time(), dt.UTC).isoformat().replace("+00:00", "Z")


def e2b_state(rec: SandboxRecord) -> str:
    return "paused" if rec.state == "paused" else "running"


async def json_object(request: web.Request, *, required: bool = True) -> dict[str, Any]:
    """The request body as a JSON object; InvalidArgument (400) when it is not one."""
    raw = await request.read()
    if not raw:
        if required:
            raise InvalidArgument("request body must be a JSON object")
        return {}
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise InvalidArgument(f"request body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidArgument("request body must be a JSON object")
    return doc


def _str_map(doc: dict[str, Any], name: str) -> dict[str, str]:
    v = doc.get(name) or {}
    if not isinstance(v, dict) or not all(isinstance(k, str) and isinstance(x, str) for k, x in v.items()):
        raise InvalidArgument(f"{name} must be an object of strings")
    return v


def _timeout(doc: dict[str, Any], default: int | None = DEFAULT_TIMEOUT_S) -> int:
    t = doc.get("timeout", default)
    if isinstance(t, bool) or not isinstance(t, int) or not 1 <= t <= MAX_TIMEOUT_S:
        raise InvalidArgument(f"timeout must be an integer number of seconds between 1 and {MAX_TIMEOUT_S}, got {t!r}")
    return t


class E2BApi:
    def __init__(self, gw: Any) -> None:
        self.gw = gw  # the Gateway (tenants, domain, envd token)

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/sandboxes", self.create), web.post("/v2/sandboxes", self.create),
            web.get("/sandboxes", self.list_v1), web.get("/v2/sandboxes", self.list_v2),
            web.get("/sandboxes/{id}", self.get), web.delete("/sandboxes/{id}", self.kill),
            web.post("/sandboxes/{id}/timeout", self.set_timeout),
            web.post("/sandboxes/{id}/connect", self.connect), web.post("/v2/sandboxes/{id}/connect", self.connect),
            web.get("/sandboxes/{id}/metrics", self.metrics),
            web.post("/sandboxes/{id}/pause", self.unsupported), web.post("/sandboxes/{id}/resume", self.unsupported),
            web.post("/sandboxes/{id}/snapshots", self.unsupported), web.post("/sandboxes/{id}/fork", self.unsupported),
        ]

    def _sandbox(self, rec: SandboxRecord, tenant: Tenant, api_key: str) -> dict[str, Any]:
        return {
            "templateID": rec.spec.template, "sandboxID": rec.spec.sandbox_id, "clientID": tenant.user,
            "envdVersion": ENVD_VERSION, "envdAccessToken": self.gw.envd_token(api_key), "domain": self.gw.domain,
            "alias": rec.spec.template,
        }

    def _listed(self, rec: SandboxRecord, tenant: Tenant) -> dict[str, Any]:
        return {
            "templateID": rec.spec.template, "sandboxID": rec.spec.sandbox_id, "clientID": tenant.user, "alias": rec.spec.template,
            "startedAt": iso(rec.ready_at or rec.created_at), "endAt": iso(rec.expires_at), "cpuCount": max(1, round(rec.spec.cpu)),
            "memoryMB": rec.spec.memory_mb, "diskSizeMB": rec.spec.disk_mb, "state": e2b_state(rec), "envdVersion": ENVD_VERSION,
            "metadata": rec.spec.metadata,
        }

    async def create(self, request: web.Request) -> web.Response:
        tenant, key = await self.gw.tenant(request)
        doc = await json_object(request)
        template = doc.get("templateID")
        if not isinstance(template, str) or not template:
            raise InvalidArgument("templateID is required")
        sb = await tenant.create(
            template, timeout=_timeout(doc), metadata=_str_map(doc, "metadata"), envs=_str_map(doc, "envVars"),
            create_timeout=CREATE_TIMEOUT_S, pool=self.gw.pool,
        )
        rec = await tenant.own_record(sb.sandbox_id)
        return web.json_response(self._sandbox(rec, tenant, key), status=201)

    async def get(self, request: web.Request) -> web.Response:
        tenant, key = await self.gw.tenant(request)
        rec = await tenant.own_record(request.match_info["id"])
        d = self._listed(rec, tenant)
        d.update(envdAccessToken=self.gw.envd_token(key), domain=self.gw.domain)
        return web.json_response(d)

    async def _filtered(self, request: web.Request, tenant: Tenant) -> list[SandboxRecord]:
        q = request.query
        states = {s for s in q.get("state", "").split(",") if s}
        if states - {"running", "paused"}:
            raise InvalidArgument(f"state must be running and/or paused, got {q.get('state')!r}")
        meta = dict(parse_qsl(q.get("metadata", ""), keep_blank_values=True))
        recs = await tenant.records()
        return sorted(
            (r for r in recs if (not states or e2b_state(r) in states) and all(r.spec.metadata.get(k) == v for k, v in meta.items())),
            key=lambda r: (r.created_at, r.spec.sandbox_id),
        )

    async def list_v1(self, request: web.Request) -> web.Response:
        tenant, _ = await self.gw.tenant(request)
        return web.json_response([self._listed(r, tenant) for r in await self._filtered(request, tenant)])

    async def list_v2(self, request: web.Request) -> web.Response:
        tenant, _ = await self.gw.tenant(request)
        raw_limit = request.query.get("limit", "100")
        if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= PAGE_MAX:
            raise InvalidArgument(f"limit must be 1..{PAGE_MAX}, got {raw_limit!r}")
        limit = int(raw_limit)
        recs = await self._filtered(request, tenant)
        token = request.query.get("nextToken")
        if token:
            try:
                after = json.loads(base64.urlsafe_b64decode(token.encode()))
                after_key = (float(after[0]), str(after[1]))
            except (ValueError, TypeError, IndexError):
                raise InvalidArgument("nextToken is not one this gateway gave out") from None
            recs = [r for r in recs if (r.created_at, r.spec.sandbox_id) > after_key]
        page = recs[:limit]
        headers = {}
        if len(recs) > limit:
            last = page[-1]
            headers["x-next-token"] = base64.urlsafe_b64encode(json.dumps([last.created_at, last.spec.sandbox_id]).encode()).decode()
        return web.json_response([self._listed(r, tenant) for r in page], headers=headers)

    async def kill(self, request: web.Request) -> web.Response:
        tenant, _ = await self.gw.tenant(request)
        sb = await tenant.sandbox(request.match_info["id"])
        await sb.kill()
        self.gw.forget(sb.sandbox_id)
        return web.Response(status=204)

    async def set_timeout(self, request: web.Request) -> web.Response:
        tenant, _ = await self.gw.tenant(request)
        sb = await tenant.sandbox(request.match_info["id"])
        await sb.set_timeout(_timeout(await json_object(request), None))
        return web.Response(status=204)

    async def connect(self, request: web.Request) -> web.Response:
        """Connect to a running sandbox; its timeout is extended to ``timeout`` from now when later."""
        tenant, key = await self.gw.tenant(request)
        doc = await json_object(request, required=False)
        rec = await tenant.own_record(request.match_info["id"])
        if "timeout" in doc:
            t = _timeout(doc, None)
            if time.time() + t > rec.expires_at:
                await (await tenant.sandbox(rec.spec.sandbox_id)).set_timeout(t)
        return web.json_response(self._sandbox(rec, tenant, key), status=200)

    async def metrics(self, request: web.Request) -> web.Response:
        tenant, _ = await self.gw.tenant(request)
        rec = await tenant.own_record(request.match_info["id"])
        sb = await tenant.sandbox(rec.spec.sandbox_id)
        now = time.time()
        m = {
            "timestamp": iso(now), "timestampUnix": int(now), "cpuCount": max(1, round(rec.spec.cpu)), "cpuUsedPct": 0.0,
            "memUsed": 0, "memTotal": rec.spec.memory_mb * 1024 * 1024, "memCache": 0, "diskUsed": 0, "diskTotal": rec.spec.disk_mb * 1024 * 1024,
        }
        get_metrics = getattr(sb, "get_metrics", None)  # the SDK's own figures, where it has them
        if get_metrics is not None:
            try:
                got = await get_metrics()
            except SandboxNotFound:
                raise
            except DsecError:
                got = None
            for name, key in (("cpu_used_pct", "cpuUsedPct"), ("mem_used", "memUsed"), ("disk_used", "diskUsed"), ("mem_cache", "memCache"),
                              ("mem_total", "memTotal"), ("disk_total", "diskTotal")):
                if got is not None and hasattr(got, name):
                    m[key] = getattr(got, name)
        return web.json_response([m])

    async def unsupported(self, request: web.Request) -> web.Response:
        tenant, _ = await self.gw.tenant(request)
        await tenant.own_record(request.match_info["id"])
        raise NotSupported(f"{request.path.rsplit('/', 1)[-1]} is not supported by this dsec gateway yet")


__all__ = ["ENVD_VERSION", "E2BApi", "e2b_error", "http_status", "iso", "json_object"]
