"""E2B's template API over dsec: what the unmodified e2b SDK's ``Template.build(...)`` (and
``from_image``, ``from_template``, ``from_dockerfile``, ``run_cmd``, ``copy``, ``set_envs``,
``set_workdir``, ``set_user``), ``Template.exists`` / ``alias_exists`` and ``get_build_status`` call,
plus list and delete.

A build is ``POST /v3/templates`` (name -> ids), one ``GET /templates/{id}/files/{hash}`` per COPY
(the SDK uploads the tar of its sources with ``PUT`` to the URL answered, unless ``present``), then
``POST /v2/templates/{id}/builds/{buildID}`` with the steps; the SDK polls
``GET .../status?logsOffset=N``. The gateway runs the steps with ``sdk._builder`` as the key's client
(build sandboxes, a snapshot per step, the step cache), and imaged writes the template, owned by that
client: the template ID is the name, so ``Sandbox.create(name)`` starts from it.

Builds live in the gateway's memory (a gateway restart forgets builds in flight; their templates are
not written). Uploaded files are kept by content hash under ``$DSEC_DATA_DIR/gateway/template-files``
(a temp dir without one), per client, at most ``--template-files-max-mb`` per client: an upload that
would pass it first drops the client's files no build used for ``UPLOAD_TTL_S`` (the SDK uploads
what is not ``present`` again), else is refused with ``quota_exceeded`` (before anything is written
when the request says its length). A full disk is ``no_space``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import errno
import hashlib
import os
import re
import secrets
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats.errors
import structlog
from aiohttp import web
from nats.js.errors import NoKeysError

from bus import codec
from bus import subjects as S
from bus.errors import DsecError, InvalidArgument, NoSpace, PermissionDenied, QuotaExceeded, TemplateTaken, Unavailable, UnknownTemplate
from bus.messages import Done, RemoveImage, TemplateManifest
from bus.runtime import tenant_of
from bus.streams import ensure_kv

from .._builder import TemplateBuilder, tar_context, template_manifest
from .._dockerfile import Step
from ._e2b import ENVD_VERSION, E2BApi, SNAPSHOT_PREFIX, iso, json_object
from ._tenants import Tenant

log = structlog.get_logger("dsec.gateway.templates")

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")
_HASH = re.compile(r"^[A-Za-z0-9_-]{8,128}$")
UPLOAD_TTL_S = 3600.0
BUILD_KEEP_S = 86400.0
LOG_PAGE = 100  # entries one status call returns at most (as E2B)


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat().replace("+00:00", "Z")


@dataclass
class Build:
    build_id: str
    template_id: str
    owner: str
    tag: str = "default"
    cpu: int = 2
    memory_mb: int = 1024
    status: str = "waiting"  # waiting -> building -> ready | error (E2B's words)
    entries: list[dict[str, Any]] = field(default_factory=list)
    reason: dict[str, Any] | None = None
    created_at: float = field(default_factory=time.time)
    task: asyncio.Task[None] | None = None

    def log(self, message: str, level: str = "info") -> None:
        self.entries.append({"timestamp": _now(), "level": level, "message": message})


def _template_name(doc: dict[str, Any]) -> tuple[str, str]:
    raw = doc.get("name") or doc.get("alias")
    if not isinstance(raw, str) or not raw:
        raise InvalidArgument("name is required")
    name, _, tag = raw.partition(":")
    if not _NAME.match(name):
        raise InvalidArgument(f"bad template name {name!r}: letters, digits, '-' and '_' (max 128)")
    return name, tag or "default"


def _positive(doc: dict[str, Any], key: str, default: int, hi: int) -> int:
    v = doc.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
        raise InvalidArgument(f"{key} must be an integer between 1 and {hi}, got {v!r}")
    return v


def _start_ready(doc: dict[str, Any]) -> tuple[str | None, str | None]:
    """A build's ``startCmd``/``readyCmd`` (None: the base template's); a ready command alone is refused."""
    start, ready = doc.get("startCmd"), doc.get("readyCmd")
    for key, v in (("startCmd", start), ("readyCmd", ready)):
        if v is not None and (not isinstance(v, str) or len(v) > 65536 or "\0" in v):
            raise InvalidArgument(f"{key} must be a command line (a string without NUL, at most 64 KiB)")
    if ready and not start:
        raise InvalidArgument("readyCmd needs a startCmd")
    return (start, ready) if start else (None, None)


def _touch(path: Path) -> bool:
    """Mark a COPY source as used now (what ``_room_for`` drops last); False when it is not there."""
    try:
        os.utime(path)
        return True
    except FileNotFoundError:
        return False


def _room_for(path: Path, nbytes: int, limit: int, owner: str) -> int:
    """Bytes the upload to ``path`` may take within its client's ``limit`` (the files beside it, less
    the one it replaces); the client's files no build used for UPLOAD_TTL_S are dropped, oldest
    first, while ``nbytes`` does not fit. ``quota_exceeded`` when it cannot."""
    files = []
    for p in path.parent.iterdir():
        if p.name.startswith(".") or p == path:
            continue  # uploads in flight; the file this one replaces
        with contextlib.suppress(FileNotFoundError):
            st = p.stat()
            files.append((st.st_mtime, st.st_blocks * 512, p))
    used = sum(b for _, b, _ in files)
    cutoff = time.time() - UPLOAD_TTL_S
    for mtime, b, p in sorted(files):
        if used + nbytes <= limit or mtime > cutoff:
            break
        p.unlink(missing_ok=True)
        used -= b
    if used + nbytes > limit:
        raise _over(owner, limit, used, nbytes)
    return limit - used


def _over(owner: str, limit: int, used: int, wanted: int) -> QuotaExceeded:
    return QuotaExceeded(
        f"template files: {wanted} bytes more with the {used} the build sources of client {owner!r} hold pass the per-tenant limit "
        f"of {limit} bytes (--template-files-max-mb)", limit="template_files_bytes_per_tenant", max=str(limit), used=str(used), wanted=str(wanted),
    )


class TemplateApi:
    def __init__(self, gw: Any) -> None:
        self.gw = gw
        self.e2b = E2BApi(gw, resolve=self.resolve_ref)  # a create may name a template by name:tag or name:buildID
        self.builds: dict[str, Build] = {}
        self.uploads: dict[str, tuple[str, Path, float]] = {}  # token -> (owner, file, expires)
        base = os.environ.get("DSEC_DATA_DIR")
        self.files_dir = Path(base) / "gateway" / "template-files" if base else Path(tempfile.mkdtemp(prefix="dsec-gw-files-"))

    def routes(self) -> list[web.RouteDef]:
        # registered before E2BApi's: DELETE /templates/{id} is a template here, a snapshot (snap-...) there
        return [
            web.post("/v3/templates", self.request_build), web.post("/v2/templates", self.request_build),
            web.get("/templates/aliases/{alias}", self.alias),
            web.get("/templates/{id}/tags", self.tags),
            web.get("/templates/{id}/files/{hash}", self.file_link),
            web.put("/templates/uploads/{token}", self.upload),
            web.post("/v2/templates/{id}/builds/{build}", self.start_build),
            web.get("/templates/{id}/builds/{build}/status", self.status),
            web.get("/templates", self.list_templates), web.delete("/templates/{id}", self.delete),
        ]

    # --- the catalogue -------------------------------------------------------------------------
    async def _manifest(self, tenant: Tenant, name: str) -> TemplateManifest | None:
        if not _NAME.match(name):
            return None
        return await template_manifest(tenant.nc.jetstream(), name)

    async def _manifests(self, tenant: Tenant) -> list[TemplateManifest]:
        kv = await ensure_kv(tenant.nc.jetstream(), S.KV_IMAGES)
        try:
            keys = await kv.keys()
        except NoKeysError:
            return []
        out = []
        for k in keys:
            m = await self._manifest(tenant, k)
            if m is not None:
                out.append(m)
        return out

    def _owned_build(self, tenant: Tenant, template_id: str, build_id: str | None = None) -> Build:
        for b in self.builds.values():
            # a named build in any state; without a name, the one in flight (uploads belong to it)
            wanted = b.build_id == build_id if build_id is not None else b.status in ("waiting", "building")
            if b.template_id == template_id and b.owner == tenant.user and wanted:
                return b
        raise UnknownTemplate(f"no build {build_id or ''} of template {template_id!r} for this key", template=template_id)

    # --- routes -----------------------------------------------------------------------------------
    async def request_build(self, request: web.Request) -> web.Response:
        tenant, _ = await self.gw.tenant(request)
        doc = await json_object(request)
        name, tag = _template_name(doc)
        m = await self._manifest(tenant, name)
        if m is not None and m.owner != tenant.user:
            raise TemplateTaken(f"the template name {name!r} is taken", template=name)
        if any(b.template_id == name and b.status in ("waiting", "building") and b.owner != tenant.user for b in self.builds.values()):
            raise TemplateTaken(f"the template name {name!r} is being built by another client", template=name)
        for old in [k for k, x in self.builds.items() if x.status in ("ready", "error") and x.created_at < time.time() - BUILD_KEEP_S]:
            del self.builds[old]  # a finished build's status is kept a day (E2B keeps it longer; nothing needs it here)
        b = Build(build_id=str(uuid.uuid4()), template_id=name, owner=tenant.user, tag=tag,
                  cpu=_positive(doc, "cpuCount", 2, 64), memory_mb=_positive(doc, "memoryMB", 1024, 1 << 20))
        self.builds[b.build_id] = b
        return web.json_response({"templateID": name, "buildID": b.build_id, "public": False, "names": [name], "tags": [tag],
                                  "aliases": [name]}, status=202)

    async def alias(self, request: web.Request) -> web.Response:
        tenant, _ = await self.gw.tenant(request)
        name = request.match_info["alias"]
        m = await self._manifest(tenant, name)
        if m is None:
            raise UnknownTemplate(f"no template {name!r}", template=name)
        if m.owner and m.owner != tenant.user:
            raise PermissionDenied(f"template {name!r} belongs to another client")
        return web.json_response({"templateID": name, "public": not m.owner})

    def _builds_of(self, tenant: Tenant, name: str) -> list[Build]:
        return sorted((b for b in self.builds.values() if b.template_id == name and b.owner == tenant.user), key=lambda b: b.created_at)

    async def tags(self, request: web.Request) -> web.Response:
        """A template's tags, each the build it names: the last build of each tag this gateway ran that is
        ready or still running (E2B tags a build when it starts; a failed one tags nothing here, as it
        makes no template). A template built before the gateway last started has no tags: its builds
        were in memory. A name this key cannot see is 404, as E2B."""
        tenant, _ = await self.gw.tenant(request)
        name = request.match_info["id"]
        m = await self._manifest(tenant, name)
        builds = [b for b in self._builds_of(tenant, name) if b.status != "error"]
        if (m is None or m.owner != tenant.user) and not builds:
            raise UnknownTemplate(f"no template {name!r}", template=name)
        last = {b.tag: b for b in builds}
        return web.json_response([{"tag": t, "buildID": b.build_id, "createdAt": iso(b.created_at)} for t, b in last.items()])

    async def resolve_ref(self, tenant: Tenant, ref: str) -> str:
        """A create's ``name:tag`` or ``name:buildID`` -> the template to start (dsec keeps one build per
        name: its last). A named build that is not ready is E2B's 404 ``tag ... does not exist``."""
        name, _, suffix = ref.partition(":")
        if not suffix:
            return name
        named = [b for b in self._builds_of(tenant, name) if suffix in (b.tag, b.build_id)]
        if named and named[-1].status != "ready":
            raise UnknownTemplate(f"tag '{suffix}' does not exist for template '{name}' (its build is {named[-1].status})", template=name)
        current = [b for b in self._builds_of(tenant, name) if b.status == "ready"]
        if named and current and current[-1] is not named[-1]:
            raise UnknownTemplate(f"tag '{suffix}' of template '{name}' names a build a later one replaced", template=name)
        return name

    def _file(self, owner: str, files_hash: str) -> Path:
        return self.files_dir / hashlib.sha256(owner.encode()).hexdigest()[:16] / files_hash

    async def file_link(self, request: web.Request) -> web.Response:
        tenant, _ = await self.gw.tenant(request)
        self._owned_build(tenant, request.match_info["id"])
        files_hash = request.match_info["hash"]
        if not _HASH.match(files_hash):
            raise InvalidArgument(f"bad files hash {files_hash!r}")
        path = self._file(tenant.user, files_hash)
        now = time.monotonic()
        for t, (_, _, exp) in list(self.uploads.items()):
            if exp < now:
                del self.uploads[t]
        token = secrets.token_urlsafe(32)
        self.uploads[token] = (tenant.user, path, now + UPLOAD_TTL_S)
        url = f"{request.scheme}://{request.host}/templates/uploads/{token}"
        return web.json_response({"present": path.is_file(), "url": url}, status=201)

    async def upload(self, request: web.Request) -> web.Response:
        """The SDK's PUT of a COPY's sources (a tar, maybe gzip): the URL's one-use token is the credential."""
        entry = self.uploads.pop(request.match_info["token"], None)
        if entry is None or entry[2] < time.monotonic():
            raise PermissionDenied("the upload link is unknown or expired")
        owner, path, _ = entry
        path.parent.mkdir(parents=True, exist_ok=True)
        limit = self.gw.cfg.template_files_max
        room = await asyncio.to_thread(_room_for, path, request.content_length or 0, limit, owner) if limit else 0
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
        size = 0
        try:
            with open(tmp, "wb") as f:
                async for chunk in request.content.iter_chunked(1 << 20):
                    size += len(chunk)
                    if size > self.gw.cfg.max_upload:
                        raise InvalidArgument(f"the upload is larger than {self.gw.cfg.max_upload} bytes")
                    if limit and size > room:
                        raise _over(owner, limit, limit - room, size)
                    f.write(chunk)
            os.replace(tmp, path)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise NoSpace(f"template files: no space left on the gateway's disk ({exc.strerror})") from None
            raise
        finally:
            tmp.unlink(missing_ok=True)
        return web.Response(status=200)

    async def start_build(self, request: web.Request) -> web.Response:
        tenant, _ = await self.gw.tenant(request)
        b = self._owned_build(tenant, request.match_info["id"], request.match_info["build"])
        if b.status != "waiting":
            raise InvalidArgument(f"build {b.build_id} was started already ({b.status})")
        doc = await json_object(request)
        steps, hashes = self._steps(doc, b)
        start, ready = _start_ready(doc)
        missing = [h for h in hashes if not _touch(self._file(tenant.user, h))]
        if missing:
            raise InvalidArgument(f"files of COPY steps were not uploaded: {', '.join(missing)}")
        b.status = "building"
        b.task = asyncio.create_task(self._run(b, tenant, steps, hashes, force=bool(doc.get("force")), start=start, ready=ready))
        return web.Response(status=202)

    def _steps(self, doc: dict[str, Any], b: Build) -> tuple[list[Step], list[str]]:
        """E2B's steps -> the builder's; the COPY steps' files hashes."""
        image, template = doc.get("fromImage"), doc.get("fromTemplate")
        if bool(image) == bool(template) or not isinstance(image or template, str):
            raise InvalidArgument("give one of fromImage and fromTemplate")
        if doc.get("fromImageRegistry"):
            b.log("registry credentials in the request are not used: imaged pulls with its own (DSEC_REGISTRY_AUTH_FILE)", "warn")
        steps = [Step("FROM", [image] if image else [f"template:{template}"])]
        hashes: list[str] = []
        raw = doc.get("steps") or []
        if not isinstance(raw, list):
            raise InvalidArgument("steps must be a list")
        for n, s in enumerate(raw, 1):
            if not isinstance(s, dict) or not isinstance(s.get("args"), list) or not all(isinstance(a, str) for a in s["args"]):
                raise InvalidArgument(f"step {n} must be an object with type and args (strings)")
            kind, args = s.get("type"), list(s["args"])
            flags = {"force": "1"} if s.get("force") else {}
            if kind == "RUN" and args:
                if len(args) > 1 and args[1]:
                    flags["user"] = args[1]
                steps.append(Step("RUN", [args[0]], flags=flags))
            elif kind == "COPY" and len(args) >= 2:
                h = s.get("filesHash")
                if not isinstance(h, str) or not _HASH.match(h):
                    raise InvalidArgument(f"step {n}: COPY needs its filesHash")
                hashes.append(h)
                if len(args) > 2 and args[2]:
                    flags["chown"] = args[2]
                if len(args) > 3 and args[3]:
                    flags["chmod"] = args[3]
                steps.append(Step("COPY", [args[0], args[1]], flags=flags))
            elif kind == "ENV" and args and len(args) % 2 == 0:
                steps.append(Step("ENV", args, flags=flags))
            elif kind in ("WORKDIR", "USER") and len(args) == 1 and args[0]:
                steps.append(Step(kind, args, flags=flags))
            else:
                raise InvalidArgument(f"step {n}: unsupported step {kind!r} with {len(args)} argument(s)")
        start = doc.get("startCmd")
        if isinstance(start, str) and start:
            steps.append(Step("CMD", [start]))
        return steps, hashes

    async def _run(self, b: Build, tenant: Tenant, steps: list[Step], hashes: list[str], *, force: bool, start: str | None = None,
                   ready: str | None = None) -> None:
        ctx = Path(tempfile.mkdtemp(prefix="dsec-gw-ctx-"))
        try:
            for h in dict.fromkeys(hashes):  # the SDK tars each COPY's sources relative to one context: they merge
                await asyncio.to_thread(tar_context, self._file(tenant.user, h).read_bytes(), ctx)
            builder = TemplateBuilder(nats_url=tenant.url, on_log=b.log, pool=self.gw.pool, client=tenant.user, cpu=float(b.cpu),
                                      memory_mb=b.memory_mb, no_cache=force, ready_timeout=self.gw.cfg.template_ready_timeout_s)
            await builder.build(b.template_id, steps, ctx, owner=tenant.user, description=f"e2b template {b.template_id}:{b.tag}",
                                start_cmd=start, ready_cmd=ready)
            b.status = "ready"
        except DsecError as exc:
            step = exc.context.get("step")
            b.log(exc.description, "error")
            # E2B numbers the steps from 0 (the base): the builder from 1 (FROM)
            b.reason = {"message": exc.description, "step": str(int(step) - 1) if isinstance(step, int) else "base"}
            b.status = "error"
        except Exception as exc:  # noqa: BLE001 - a build's failure is its status, never the gateway's
            log.exception("template_build_failed", template=b.template_id, build=b.build_id)
            b.log(f"internal error: {exc!r}", "error")
            b.reason = {"message": f"internal error: {exc!r}", "step": "finalize"}
            b.status = "error"
        finally:
            await asyncio.to_thread(shutil.rmtree, ctx, True)

    async def status(self, request: web.Request) -> web.Response:
        tenant, _ = await self.gw.tenant(request)
        b = self._owned_build(tenant, request.match_info["id"], request.match_info["build"])
        q = request.query
        offset = int(q["logsOffset"]) if q.get("logsOffset", "").isdigit() else 0
        limit = min(int(q["limit"]), LOG_PAGE) if q.get("limit", "").isdigit() else LOG_PAGE
        entries = b.entries[offset:offset + limit]
        body: dict[str, Any] = {"templateID": b.template_id, "buildID": b.build_id, "status": b.status,
                                "logs": [e["message"] for e in entries], "logEntries": entries}
        if b.reason is not None:
            body["reason"] = {**b.reason, "logEntries": [e for e in b.entries if e["level"] == "error"][-20:]}
        return web.json_response(body)

    async def list_templates(self, request: web.Request) -> web.Response:
        tenant, _ = await self.gw.tenant(request)
        out = []
        for m in await self._manifests(tenant):
            if m.owner != tenant.user:
                continue
            builds = [b for b in self.builds.values() if b.template_id == m.name and b.owner == tenant.user]
            last = max(builds, key=lambda b: b.created_at) if builds else None
            out.append({
                "templateID": m.name, "buildID": last.build_id if last else "", "cpuCount": last.cpu if last else 2,
                "memoryMB": last.memory_mb if last else 1024, "diskSizeMB": sum(lay.size for lay in m.layers) >> 20, "public": False,
                "aliases": [m.name], "names": [m.name], "createdAt": iso(m.created_at), "updatedAt": iso(m.created_at), "createdBy": None,
                "lastSpawnedAt": None, "spawnCount": 0, "buildCount": len(builds), "envdVersion": ENVD_VERSION, "buildStatus": "ready",
            })
        return web.json_response(out)

    async def delete(self, request: web.Request) -> web.Response:
        tid = request.match_info["id"]
        if tid.startswith(SNAPSHOT_PREFIX):
            return await self.e2b.delete_snapshot(request)
        tenant, _ = await self.gw.tenant(request)
        m = await self._manifest(tenant, tid)
        if m is None:
            raise UnknownTemplate(f"no template {tid!r}", template=tid)
        if m.owner != tenant.user:
            raise PermissionDenied(f"template {tid!r} is not this key's")
        try:
            msg = await tenant.nc.request(S.img_remove(tenant_of(tenant.nc)), codec.encode(RemoveImage(name=tid)), timeout=60)
        except nats.errors.NoRespondersError:
            raise Unavailable("the image service does not answer") from None
        codec.decode_reply(msg.data, Done)
        return web.Response(status=204)


def add_routes(app: web.Application, gw: Any) -> None:
    app.router.add_routes(TemplateApi(gw).routes())


__all__ = ["TemplateApi", "add_routes"]
