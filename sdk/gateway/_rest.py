"""dsec's own REST API (``/v1/...``), described by the OpenAPI document at ``/openapi.json``.

Errors are ``{"code": "<dsec error code>", "message": ...}`` with the HTTP status of the code.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from aiohttp import web

from bus.errors import InvalidArgument
from bus.messages import BACKENDS

from .._async import AsyncSandbox, build_spec
from .._snapshots import info_of
from ..errors import CommandExitError
from ._e2b import flag, json_object
from ._filesystem import PayloadTooLarge

def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


_ERR = _ref("Error")
_SNAP_REF = _ref("Snapshot")
_SANDBOXES = {"type": "array", "items": _ref("Sandbox")}
_BINARY = {"type": "string", "format": "binary"}
_ID = [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}]
_PATH = [*_ID, {"name": "path", "in": "query", "required": True, "schema": {"type": "string"}}]


def _op(summary: str, ok: dict[str, Any], *, body: dict[str, Any] | None = None, params: list[Any] | None = None, raw_body: bool = False) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "security": [{"apiKey": []}], "responses": {
        **ok, "400": {"description": "bad input", "content": {"application/json": {"schema": _ERR}}},
        "401": {"description": "missing or wrong API key", "content": {"application/json": {"schema": _ERR}}},
        "404": {"description": "no such sandbox for this key", "content": {"application/json": {"schema": _ERR}}},
    }}
    if params:
        op["parameters"] = params
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    if raw_body:
        op["requestBody"] = {"required": True, "content": {"application/octet-stream": {"schema": _BINARY}}}
    return op


def _json(desc: str, schema: dict[str, Any], status: str = "200") -> dict[str, Any]:
    return {status: {"description": desc, "content": {"application/json": {"schema": schema}}}}


OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {
        "title": "dsec gateway", "version": "1",
        "description": "dsec's REST API. The same gateway also serves the E2B API (/sandboxes, /v2/sandboxes) and envd.",
    },
    "components": {
        "securitySchemes": {"apiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key"}},
        "schemas": {
            "Error": {"type": "object", "required": ["code", "message"], "properties": {"code": {"type": "string"}, "message": {"type": "string"}}},
            "NewSandbox": {"type": "object", "properties": {
                "template": {"type": "string", "default": "base"}, "cpu": {"type": "number", "default": 1},
                "backend": {"type": "string", "default": "container", "enum": list(BACKENDS),
                            "description": "microvm: its own kernel; vm: a full VM with a screen (screenshot, input)"},
                "create_timeout": {"type": "number", "description": "seconds to wait for it to be ready (a VM boots its own kernel)"},
                "memory_mb": {"type": "integer", "default": 512}, "disk_mb": {"type": "integer", "default": 1024},
                "timeout": {"type": "number", "default": 300}, "envs": {"type": "object", "additionalProperties": {"type": "string"}},
                "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                "snapshot": {"type": "string", "description": "a snapshot id of this key's: restore it (the template is the snapshot's)"},
            }},
            "Sandbox": {"type": "object", "properties": {
                "sandbox_id": {"type": "string"}, "template": {"type": "string"}, "state": {"type": "string"}, "host_id": {"type": "string"},
                "started_at": {"type": "number"}, "expires_at": {"type": "number"},
                "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
            }},
            "Exec": {"type": "object", "required": ["cmd"], "properties": {
                "cmd": {"type": "string"}, "envs": {"type": "object", "additionalProperties": {"type": "string"}},
                "cwd": {"type": "string"}, "timeout": {"type": "number", "default": 60},
                "trusted": {"type": "boolean", "default": False, "description": "a grader's run the sandbox's processes cannot hijack "
                            "(fresh HOME, system PATH, only these envs, no startup files; see commands.run(trusted=True))"},
            }},
            "Snapshot": {"type": "object", "properties": {
                "snapshot_id": {"type": "string"}, "parent_id": {"type": "string"}, "sandbox_id": {"type": "string"},
                "template": {"type": "string"}, "created_at": {"type": "number"}, "bytes_added": {"type": "integer"},
                "memory": {"type": "boolean"}, "name": {"type": "string"}, "host_id": {"type": "string"}, "layers": {"type": "integer"},
                "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
            }},
            "NewSnapshot": {"type": "object", "properties": {
                "name": {"type": "string"}, "memory": {"type": "boolean", "default": False, "description": "the processes too (CRIU)"},
                "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
            }},
            "Pause": {"type": "object", "properties": {
                "persist": {"type": "boolean", "default": False, "description": "snapshot it and free the host (else: frozen in place)"},
                "memory": {"type": "boolean", "default": False, "description": "with persist: the processes too (CRIU)"},
            }},
            "Paused": {"type": "object", "properties": {"sandbox_id": {"type": "string"}, "snapshot": {"oneOf": [_SNAP_REF, {"type": "null"}]}}},
            "Fork": {"type": "object", "properties": {
                "count": {"type": "integer", "default": 1}, "timeout": {"type": "number", "default": 300},
                "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
            }},
            "Input": {"type": "object", "required": ["action"], "properties": {
                "action": {"type": "string", "enum": ["type", "key", "click"]}, "text": {"type": "string", "description": "type: what to type"},
                "key": {"type": "string", "description": "key: a name, modifiers joined with + (enter, ctrl+c)"},
                "x": {"type": "integer"}, "y": {"type": "integer"}, "button": {"type": "string", "enum": ["left", "right", "middle"], "default": "left"},
            }},
            "ExecResult": {"type": "object", "properties": {"stdout": {"type": "string"}, "stderr": {"type": "string"}, "exit_code": {"type": "integer"}}},
            "Entry": {"type": "object", "properties": {
                "name": {"type": "string"}, "path": {"type": "string"}, "type": {"type": "string"}, "size": {"type": "integer"},
                "mode": {"type": "integer"}, "mtime": {"type": "number"},
            }},
        },
    },
    "paths": {
        "/v1/sandboxes": {
            "post": _op("create a sandbox and wait until it runs", _json("created", _ref("Sandbox"), "201"), body=_ref("NewSandbox")),
            "get": _op("this key's live sandboxes (running and paused)", _json("sandboxes", _SANDBOXES)),
        },
        "/v1/sandboxes/{id}": {
            "get": _op("one sandbox", _json("the sandbox", {"$ref": "#/components/schemas/Sandbox"}), params=_ID),
            "delete": _op("kill a sandbox", {"204": {"description": "killed"}}, params=_ID),
        },
        "/v1/sandboxes/{id}/pause": {
            "post": _op("pause: frozen in place, or persisted as a snapshot (the host freed); pausing a paused one is a no-op",
                        _json("paused", _ref("Paused")), params=_ID, body=_ref("Pause")),
        },
        "/v1/sandboxes/{id}/resume": {
            "post": _op("resume a paused sandbox (a persisted one starts again from its snapshot, on any host)", _json("running", _ref("Sandbox")),
                        params=_ID),
        },
        "/v1/sandboxes/{id}/snapshots": {
            "post": _op("snapshot a running sandbox (it keeps running)", _json("the snapshot", _SNAP_REF, "201"), params=_ID, body=_ref("NewSnapshot")),
        },
        "/v1/sandboxes/{id}/fork": {
            "post": _op("start count sandboxes from a snapshot of this one", _json("the forks", _SANDBOXES, "201"), params=_ID, body=_ref("Fork")),
        },
        "/v1/snapshots": {
            "get": _op("this key's snapshots (?sandbox_id= filters)", _json("snapshots", {"type": "array", "items": _SNAP_REF})),
        },
        "/v1/snapshots/{id}": {
            "get": _op("one snapshot", _json("the snapshot", _SNAP_REF), params=_ID),
            "delete": _op("remove a snapshot nothing builds on (409 snapshot_in_use otherwise)", {"204": {"description": "removed"}}, params=_ID),
        },
        "/v1/sandboxes/{id}/exec": {
            "post": _op("run a command (/bin/sh -c) and wait for it", _json("its output", _ref("ExecResult")), params=_ID, body=_ref("Exec")),
        },
        "/v1/sandboxes/{id}/files": {
            "get": _op("read a file", {"200": {"description": "its bytes", "content": {"application/octet-stream": {"schema": _BINARY}}}}, params=_PATH),
            "put": _op("write a file", _json("written", {"type": "object", "properties": {"path": {"type": "string"}, "size": {"type": "integer"}}}),
                       params=_PATH, raw_body=True),
            "delete": _op("remove a file or directory", {"204": {"description": "removed"}}, params=_PATH),
        },
        "/v1/sandboxes/{id}/screenshot": {
            "get": _op("the screen of a sandbox with one (backend vm)", {"200": {"description": "PNG", "content": {"image/png": {"schema": _BINARY}}}},
                       params=_ID),
        },
        "/v1/sandboxes/{id}/input": {
            "post": _op("type, press a key or click on the screen of a sandbox with one (backend vm)", {"204": {"description": "sent"}},
                        params=_ID, body=_ref("Input")),
        },
        "/v1/sandboxes/{id}/files/list": {
            "get": _op("list a directory", _json("entries", {"type": "array", "items": {"$ref": "#/components/schemas/Entry"}}), params=_PATH),
        },
    },
}


def _info(sb_info: Any) -> dict[str, Any]:
    return {
        "sandbox_id": sb_info.sandbox_id, "template": sb_info.template, "state": sb_info.state, "host_id": sb_info.host_id,
        "started_at": sb_info.started_at, "expires_at": sb_info.expires_at, "metadata": sb_info.metadata,
    }


def _fields(doc: dict[str, Any], allowed: set[str]) -> None:
    if set(doc) - allowed:
        raise InvalidArgument(f"unknown fields {sorted(set(doc) - allowed)}; allowed: {sorted(allowed)}")


def _str(doc: dict[str, Any], name: str) -> str:
    v = doc.get(name)
    if not isinstance(v, str) or not v:
        raise InvalidArgument(f"{name} must be a non-empty string")
    return v


async def _openapi(_request: web.Request) -> web.Response:
    return web.json_response(OPENAPI)


class RestApi:
    def __init__(self, gw: Any) -> None:
        self.gw = gw

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/openapi.json", _openapi)
        app.router.add_post("/v1/sandboxes", self.create)
        app.router.add_get("/v1/sandboxes", self.list)
        app.router.add_get("/v1/sandboxes/{id}", self.get)
        app.router.add_delete("/v1/sandboxes/{id}", self.kill)
        app.router.add_post("/v1/sandboxes/{id}/pause", self.pause)
        app.router.add_post("/v1/sandboxes/{id}/resume", self.resume)
        app.router.add_post("/v1/sandboxes/{id}/snapshots", self.snapshot)
        app.router.add_post("/v1/sandboxes/{id}/fork", self.fork)
        app.router.add_get("/v1/snapshots", self.list_snapshots)
        app.router.add_get("/v1/snapshots/{id}", self.get_snapshot)
        app.router.add_delete("/v1/snapshots/{id}", self.delete_snapshot)
        app.router.add_post("/v1/sandboxes/{id}/exec", self.exec)
        app.router.add_get("/v1/sandboxes/{id}/files", self.read)
        app.router.add_put("/v1/sandboxes/{id}/files", self.write)
        app.router.add_delete("/v1/sandboxes/{id}/files", self.remove)
        app.router.add_get("/v1/sandboxes/{id}/files/list", self.listdir)
        app.router.add_get("/v1/sandboxes/{id}/screenshot", self.screenshot)
        app.router.add_post("/v1/sandboxes/{id}/input", self.input)

    async def _sb(self, request: web.Request) -> Any:
        tenant, _ = await self.gw.tenant(request)
        return await tenant.sandbox(request.match_info["id"])

    @staticmethod
    def _path(request: web.Request) -> str:
        p = request.query.get("path", "")
        if not p.startswith("/"):
            raise InvalidArgument("?path= must be an absolute path")
        return p

    async def create(self, request: web.Request) -> web.Response:
        tenant, _ = await self.gw.tenant(request)
        doc = await json_object(request, required=False)
        _fields(doc, {"template", "backend", "cpu", "memory_mb", "disk_mb", "timeout", "create_timeout", "envs", "metadata", "snapshot"})
        template = doc.pop("template", "base")
        if doc.get("snapshot") is not None:
            doc["snapshot"] = (await tenant.own_snapshot(doc["snapshot"])).snapshot_id
        build_spec(template, **doc)  # validates every argument before anything is sent
        sb = await tenant.create(template, pool=self.gw.pool, **doc)
        return web.json_response(_info(await sb.get_info()), status=201)

    async def list(self, request: web.Request) -> web.Response:
        tenant, _ = await self.gw.tenant(request)
        return web.json_response([
            {"sandbox_id": r.spec.sandbox_id, "template": r.spec.template, "state": r.state, "host_id": r.host_id,
             "started_at": r.ready_at, "expires_at": r.expires_at, "metadata": r.spec.metadata}
            for r in await tenant.records()
        ])

    async def get(self, request: web.Request) -> web.Response:
        return web.json_response(_info(await (await self._sb(request)).get_info()))

    async def kill(self, request: web.Request) -> web.Response:
        sb = await self._sb(request)
        await sb.kill()
        self.gw.forget(sb.sandbox_id)
        return web.Response(status=204)

    async def pause(self, request: web.Request) -> web.Response:
        sb = await self._sb(request)
        doc = await json_object(request, required=False)
        _fields(doc, {"persist", "memory"})
        snap = await sb.pause(flag(doc, "persist", False), memory=flag(doc, "memory", False))
        return web.json_response({"sandbox_id": sb.sandbox_id, "snapshot": None if snap is None else dataclasses.asdict(snap)})

    async def resume(self, request: web.Request) -> web.Response:
        sb = await (await self._sb(request)).resume()
        return web.json_response(_info(await sb.get_info()))

    async def snapshot(self, request: web.Request) -> web.Response:
        sb = await self._sb(request)
        doc = await json_object(request, required=False)
        _fields(doc, {"name", "memory", "metadata"})
        snap = await sb.create_snapshot(doc.get("name"), memory=flag(doc, "memory", False), metadata=doc.get("metadata"))
        return web.json_response(dataclasses.asdict(snap), status=201)

    async def fork(self, request: web.Request) -> web.Response:
        tenant, _ = await self.gw.tenant(request)
        sb = await tenant.sandbox(request.match_info["id"])
        doc = await json_object(request, required=False)
        _fields(doc, {"count", "timeout", "metadata"})
        forks = await tenant.fork(sb, doc.get("count", 1), timeout=doc.get("timeout", 300), metadata=doc.get("metadata"), pool=self.gw.pool)
        return web.json_response([_info(await f.get_info()) for f in forks], status=201)

    async def list_snapshots(self, request: web.Request) -> web.Response:
        tenant, _ = await self.gw.tenant(request)
        sid = request.query.get("sandbox_id")
        return web.json_response([dataclasses.asdict(i) for i in await tenant.snapshots() if not sid or i.sandbox_id == sid])

    async def get_snapshot(self, request: web.Request) -> web.Response:
        tenant, _ = await self.gw.tenant(request)
        return web.json_response(dataclasses.asdict(info_of(await tenant.own_snapshot(request.match_info["id"]))))

    async def delete_snapshot(self, request: web.Request) -> web.Response:
        tenant, _ = await self.gw.tenant(request)
        rec = await tenant.own_snapshot(request.match_info["id"])
        await AsyncSandbox.delete_snapshot(rec.snapshot_id, nats_url=tenant.url)
        return web.Response(status=204)

    async def exec(self, request: web.Request) -> web.Response:
        sb = await self._sb(request)
        doc = await json_object(request)
        _fields(doc, {"cmd", "envs", "cwd", "timeout", "trusted"})
        try:
            r = await sb.commands.run(
                doc.get("cmd"), envs=doc.get("envs"), cwd=doc.get("cwd"), timeout=doc.get("timeout", 60), trusted=doc.get("trusted", False),
            )
        except CommandExitError as exc:
            r = exc.result
        return web.json_response({"stdout": r.stdout, "stderr": r.stderr, "exit_code": r.exit_code})

    async def read(self, request: web.Request) -> web.Response:
        sb = await self._sb(request)
        return web.Response(body=await sb.files.read(self._path(request), format="bytes"), content_type="application/octet-stream")

    async def write(self, request: web.Request) -> web.Response:
        sb = await self._sb(request)
        path = self._path(request)
        limit = self.gw.cfg.max_upload
        if request.content_length is not None and request.content_length > limit:
            raise PayloadTooLarge(limit)
        data = await request.content.read(limit + 1)
        if len(data) > limit:
            raise PayloadTooLarge(limit)
        w = await sb.files.write(path, data)
        return web.json_response({"path": w.path, "size": w.size})

    async def remove(self, request: web.Request) -> web.Response:
        sb = await self._sb(request)
        await sb.files.remove(self._path(request))
        return web.Response(status=204)

    async def screenshot(self, request: web.Request) -> web.Response:
        sb = await self._sb(request)
        return web.Response(body=await sb.screenshot(), content_type="image/png")

    async def input(self, request: web.Request) -> web.Response:
        sb = await self._sb(request)
        doc = await json_object(request)
        _fields(doc, {"action", "text", "key", "x", "y", "button"})
        match doc.get("action"):
            case "type":
                await sb.input.type(_str(doc, "text"))
            case "key":
                await sb.input.key(_str(doc, "key"))
            case "click":
                x, y, button = doc.get("x"), doc.get("y"), doc.get("button", "left")
                if not isinstance(x, int) or not isinstance(y, int) or button not in ("left", "right", "middle"):
                    raise InvalidArgument("click needs integer x and y, and button left, right or middle")
                await sb.input.click(x, y, button)
            case other:
                raise InvalidArgument(f"action must be type, key or click; got {other!r}")
        return web.Response(status=204)

    async def listdir(self, request: web.Request) -> web.Response:
        sb = await self._sb(request)
        return web.json_response([e.__dict__ for e in await sb.files.list(self._path(request))])


__all__ = ["OPENAPI", "RestApi"]
