"""E2B's control plane (api.e2b.dev) over dsec: create, list, get, kill, timeout, connect, metrics,
pause/resume, snapshots (``templateID`` of a create may name one) and fork.

A create's metadata may name the backend (``{"dsec.backend": "microvm"}``; default ``container``):
the sandbox then is a microVM (or a full VM), served by the same envd routes.

Paths, fields and statuses follow the e2b SDK's generated API client; errors are E2B's
``{"code": <http status>, "message": ...}``. Every route acts for the API key's tenant only.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qsl

from aiohttp import web

from bus.errors import CreateFailed, DsecError, InvalidArgument, SandboxNotFound, SandboxNotRunning
from bus.messages import SandboxRecord

from .._async import AsyncSandbox
from .._builder import template_manifest
from .._snapshots import SnapshotInfo
from .._startcmd import start_and_wait_ready
from ._network import allow_out
from ._tenants import Tenant

ENVD_VERSION = "0.6.4"  # the envd API level the gateway speaks (the e2b SDK gates features on it)
DEFAULT_TIMEOUT_S = 15  # E2B's default sandbox timeout
MAX_TIMEOUT_S = 30 * 86400
async def _kill_quietly(sb: AsyncSandbox) -> None:
    try:
        await sb.kill()
    except DsecError:
        pass  # gone already: nothing is left either way


_KV_KEY = re.compile(r"[-/_=.A-Za-z0-9]{1,255}")  # what a template's catalogue entry can be named
CREATE_TIMEOUT_S = 60.0
VM_CREATE_TIMEOUT_S = 300.0  # a VM boots its own kernel: seconds under KVM, minutes under TCG on a busy host
BACKEND_KEY = "dsec.backend"  # the create metadata entry that picks the backend
PROFILE_KEY = "dsec.profile"  # ... and the security profile (default: the gateway's e2b_profile)
PAGE_MAX = 1000
SNAPSHOT_PREFIX = "snap-"  # dsec's snapshot ids: a create whose templateID is one restores it

def http_status(exc: DsecError) -> int:
    """Each error class declares its status (bus.errors; the gateway's own Unauthenticated too)."""
    return exc.http_status


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


def flag(doc: dict[str, Any], name: str, default: bool) -> bool:
    v = doc.get(name, default)
    if not isinstance(v, bool):
        raise InvalidArgument(f"{name} must be true or false, got {v!r}")
    return v


def _next_token(key: tuple[float, str]) -> str:
    return base64.urlsafe_b64encode(json.dumps(list(key)).encode()).decode()


def page(request: web.Request, items: list[Any], key: Any) -> tuple[list[Any], dict[str, str]]:
    """One page of ``items`` (sorted by ``key``: (float, str)) after ``?nextToken=``, at most ``?limit=``;
    the headers carry the token of the next page when there is one."""
    raw_limit = request.query.get("limit", "100")
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= PAGE_MAX:
        raise InvalidArgument(f"limit must be 1..{PAGE_MAX}, got {raw_limit!r}")
    limit = int(raw_limit)
    token = request.query.get("nextToken")
    if token:
        try:
            after = json.loads(base64.urlsafe_b64decode(token.encode()))
            after_key = (float(after[0]), str(after[1]))
        except (ValueError, TypeError, IndexError):
            raise InvalidArgument("nextToken is not one this gateway gave out") from None
        items = [i for i in items if key(i) > after_key]
    headers = {"x-next-token": _next_token(key(items[limit - 1]))} if len(items) > limit else {}
    return items[:limit], headers


def _timeout(doc: dict[str, Any], default: int | None = DEFAULT_TIMEOUT_S) -> int:
    t = doc.get("timeout", default)
    if isinstance(t, bool) or not isinstance(t, int) or not 1 <= t <= MAX_TIMEOUT_S:
        raise InvalidArgument(f"timeout must be an integer number of seconds between 1 and {MAX_TIMEOUT_S}, got {t!r}")
    return t


class E2BApi:
    def __init__(self, gw: Any, resolve: Callable[[Tenant, str], Awaitable[str]] | None = None) -> None:
        self.gw = gw  # the Gateway (tenants, domain, envd token)
        self.resolve = resolve  # a create's templateID ``name:tag`` -> the template (the template API's builds)

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/sandboxes", self.create), web.post("/v2/sandboxes", self.create),
            web.get("/sandboxes", self.list_v1), web.get("/v2/sandboxes", self.list_v2),
            web.get("/sandboxes/{id}", self.get), web.delete("/sandboxes/{id}", self.kill),
            web.post("/sandboxes/{id}/timeout", self.set_timeout),
            web.post("/sandboxes/{id}/connect", self.connect), web.post("/v2/sandboxes/{id}/connect", self.connect),
            web.get("/sandboxes/{id}/metrics", self.metrics), web.put("/sandboxes/{id}/network", self.update_network),
            web.post("/sandboxes/{id}/pause", self.pause), web.post("/sandboxes/{id}/resume", self.resume),
            web.post("/sandboxes/{id}/snapshots", self.snapshot), web.post("/sandboxes/{id}/fork", self.fork),
            web.get("/snapshots", self.list_snapshots), web.delete("/templates/{id}", self.delete_snapshot),
        ]

    def _sandbox(self, rec: SandboxRecord, tenant: Tenant, api_key: str) -> dict[str, Any]:
        return {
            "templateID": rec.spec.template, "sandboxID": rec.spec.sandbox_id, "clientID": tenant.user,
            "envdVersion": ENVD_VERSION, "envdAccessToken": self.gw.envd_token(api_key, rec.spec.sandbox_id), "domain": self.gw.domain,
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
        snapshot = (await tenant.own_snapshot(template)).snapshot_id if template.startswith(SNAPSHOT_PREFIX) else None
        if ":" in template and snapshot is None:
            template = await self.resolve(tenant, template) if self.resolve else template.partition(":")[0]
        allow = allow_out(doc)
        metadata = _str_map(doc, "metadata")
        backend = metadata.get(BACKEND_KEY, "container")  # (validated with the rest of the spec)
        profile = metadata.get(PROFILE_KEY, self.gw.cfg.e2b_profile)
        sb = await tenant.create(
            template, timeout=_timeout(doc), metadata=metadata, envs=_str_map(doc, "envVars"), backend=backend,
            create_timeout=CREATE_TIMEOUT_S if backend == "container" else VM_CREATE_TIMEOUT_S, pool=self.gw.pool, snapshot=snapshot,
            network={"allow_out": allow} if allow else None, profile=profile,
        )
        if snapshot is None:
            await self._start(tenant, sb, template)
        rec = await tenant.own_record(sb.sandbox_id)
        return web.json_response(self._sandbox(rec, tenant, key), status=201)

    async def _start(self, tenant: Tenant, sb: AsyncSandbox, template: str) -> None:
        """The template's E2B start command, and its ready command until it succeeds, before the create
        is answered (``sdk._startcmd``: E2B snapshots them running; dsec starts them at each create).
        A sandbox that does not come up is removed: the create fails with ``create_failed``."""
        m = await template_manifest(tenant.nc.jetstream(), template) if _KV_KEY.fullmatch(template) else None
        d = m.defaults if m is not None else None
        if d is None or not d.start_cmd:
            return
        timeout = self.gw.cfg.template_ready_timeout_s
        try:
            res = await start_and_wait_ready(sb, d.start_cmd, d.ready_cmd, timeout_s=timeout, user=d.user or None, cwd=d.workdir or None)
        except BaseException:
            await _kill_quietly(sb)
            raise
        if not res.ready:
            await _kill_quietly(sb)
            raise CreateFailed(f"template {template!r}: {res.describe(d.start_cmd, d.ready_cmd, timeout)}", template=template)

    async def get(self, request: web.Request) -> web.Response:
        tenant, key = await self.gw.tenant(request)
        rec = await tenant.own_record(request.match_info["id"])
        d = self._listed(rec, tenant)
        d.update(envdAccessToken=self.gw.envd_token(key, rec.spec.sandbox_id), domain=self.gw.domain)
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
        recs, headers = page(request, await self._filtered(request, tenant), lambda r: (r.created_at, r.spec.sandbox_id))
        return web.json_response([self._listed(r, tenant) for r in recs], headers=headers)

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
        """Connect to a sandbox, resuming it when paused (201, as E2B; 200 when it was running); its
        timeout is extended to ``timeout`` from now when later."""
        tenant, key = await self.gw.tenant(request)
        doc = await json_object(request, required=False)
        rec = await tenant.own_record(request.match_info["id"])
        resumed = rec.state == "paused"
        if resumed:
            await (await tenant.sandbox(rec.spec.sandbox_id)).resume()
        await self._extend(tenant, rec, doc, resumed)
        return web.json_response(self._sandbox(rec, tenant, key), status=201 if resumed else 200)

    async def _extend(self, tenant: Tenant, rec: SandboxRecord, doc: dict[str, Any], resumed: bool) -> None:
        """Apply the body's ``timeout``: later only, unless just resumed. A resume without one restarts the
        sandbox's own timeout (the one it was created with), not E2B's 15 s default: a pause is no reason
        to shorten a sandbox's life."""
        if "timeout" not in doc and not resumed:
            return
        t = _timeout(doc, max(1, min(MAX_TIMEOUT_S, round(rec.spec.timeout_s))))
        sid = rec.spec.sandbox_id
        if resumed or time.time() + t > (await tenant.own_record(sid)).expires_at:
            await (await tenant.sandbox(sid)).set_timeout(t)

    async def pause(self, request: web.Request) -> web.Response:
        """Pause (204; 409 when already paused). ``memory`` (E2B's default true) freezes the sandbox in
        place, processes and all; ``memory: false`` keeps its files only and frees the host."""
        tenant, _ = await self.gw.tenant(request)
        doc = await json_object(request, required=False)
        memory = flag(doc, "memory", True)
        rec = await tenant.own_record(request.match_info["id"])
        if rec.state == "paused":
            raise SandboxNotRunning(f"sandbox {rec.spec.sandbox_id} is already paused", state="paused")
        await (await tenant.sandbox(rec.spec.sandbox_id)).pause(persist=not memory)
        return web.Response(status=204)

    async def resume(self, request: web.Request) -> web.Response:
        """Resume a paused sandbox (201 with the sandbox; 409 when it is running)."""
        tenant, key = await self.gw.tenant(request)
        doc = await json_object(request, required=False)
        rec = await tenant.own_record(request.match_info["id"])
        if rec.state != "paused":
            raise SandboxNotRunning(f"sandbox {rec.spec.sandbox_id} is not paused", state=rec.state)
        await (await tenant.sandbox(rec.spec.sandbox_id)).resume()
        await self._extend(tenant, rec, doc, True)
        return web.json_response(self._sandbox(rec, tenant, key), status=201)

    @staticmethod
    def _snapshot_info(info: SnapshotInfo) -> dict[str, Any]:
        return {"snapshotID": info.snapshot_id, "names": [info.name] if info.name else [info.snapshot_id]}

    async def snapshot(self, request: web.Request) -> web.Response:
        """Snapshot a running sandbox's files (201 ``{snapshotID, names}``); create from it with ``templateID``."""
        tenant, _ = await self.gw.tenant(request)
        doc = await json_object(request, required=False)
        name = doc.get("name")
        if name is not None and not isinstance(name, str):
            raise InvalidArgument(f"name must be a string, got {name!r}")
        flag(doc, "memory", False)  # a snapshot keeps the files; sandboxes created from it cold-boot
        sb = await tenant.sandbox(request.match_info["id"])
        return web.json_response(self._snapshot_info(await sb.create_snapshot(name or None)), status=201)

    async def list_snapshots(self, request: web.Request) -> web.Response:
        tenant, _ = await self.gw.tenant(request)
        sid, name = request.query.get("sandboxID"), request.query.get("name")
        infos = [i for i in await tenant.snapshots() if (not sid or i.sandbox_id == sid) and (not name or name in (i.name, i.snapshot_id))]
        infos, headers = page(request, infos, lambda i: (i.created_at, i.snapshot_id))
        return web.json_response([self._snapshot_info(i) for i in infos], headers=headers)

    async def delete_snapshot(self, request: web.Request) -> web.Response:
        tenant, _ = await self.gw.tenant(request)
        rec = await tenant.own_snapshot(request.match_info["id"])
        await AsyncSandbox.delete_snapshot(rec.snapshot_id, nats_url=tenant.url)
        return web.Response(status=204)

    async def fork(self, request: web.Request) -> web.Response:
        """Start ``count`` sandboxes from a snapshot of this one (201, one ``{sandbox}`` each); it keeps running."""
        tenant, key = await self.gw.tenant(request)
        doc = await json_object(request, required=False)
        count = doc.get("count", 1)
        sb = await tenant.sandbox(request.match_info["id"])
        forks = await tenant.fork(sb, count, timeout=_timeout(doc), create_timeout=CREATE_TIMEOUT_S, pool=self.gw.pool)
        recs = [await tenant.own_record(f.sandbox_id) for f in forks]
        return web.json_response([{"sandbox": self._sandbox(r, tenant, key)} for r in recs], status=201)

    async def update_network(self, request: web.Request) -> web.Response:
        """E2B's ``update_network``: the body replaces the sandbox's egress allowlist (see ``_network``).
        A sandbox created without an allowlist has no network of its own to open: ``not_supported``."""
        tenant, _ = await self.gw.tenant(request)
        sb = await tenant.sandbox(request.match_info["id"])
        allow = allow_out(await json_object(request), network_key=None)
        await sb.set_network({"allow_out": allow} if allow else None)
        return web.Response(status=204)

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


__all__ = ["ENVD_VERSION", "E2BApi", "e2b_error", "http_status", "iso", "flag", "json_object", "page"]
