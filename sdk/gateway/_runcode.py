"""``POST /run_code``: ByteDance SandboxFusion's API over FnCall, for the RL frameworks that speak it
(verl's reward path and sandbox tool, SkyRL, the ``sandbox-fusion`` client).

Those clients are given an endpoint URL and post to ``<endpoint>/run_code`` with no header of their
own, so the API key rides in the URL: a path segment (``<gateway>/k/<key>/run_code``) or user-info
(``http://dsec:<key>@<gateway>/run_code``, sent as basic auth; the password, or the user when the
password is empty); ``X-API-Key`` works too.

Request: ``code, language, compile_timeout, run_timeout, memory_limit_MB, stdin, files`` (path ->
base64), ``fetch_files``. Answer: ``status`` (Success | Failed | SandboxError), ``message``,
``compile_result`` / ``run_result`` (``status``: Finished | TimeLimitExceeded | Error,
``execution_time`` in seconds, ``return_code``, ``stdout``, ``stderr``), ``files`` (base64). Bad
input and service errors are ``SandboxError`` with a message, and the HTTP status of their code (400
for bad input, 401 for a wrong key, 503 for ``no_capacity``); a memory limit hit is an ``Error`` run
whose message says out of memory. Languages and the templates serving them: ``sdk._fncall.LANGUAGES``.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from typing import Any

from aiohttp import BasicAuth, web

from bus.errors import DsecError, InvalidArgument
from bus.messages import ExecResult, FnCallResult

from .._fncall import AsyncFnCall

class PayloadTooLarge(InvalidArgument):
    code = "payload_too_large"
    http_status = 413

QUEUE_S = 30.0  # how long a call may wait for a free pool member before SandboxError (no_capacity)
_LIMITS = {"compile_timeout": (0.001, 600.0), "run_timeout": (0.001, 600.0), "cell_timeout": (0.0, 600.0), "total_timeout": (0.001, 600.0)}


def _key(request: web.Request) -> str | None:
    key = request.match_info.get("key")
    if key:
        return key
    auth = request.headers.get("Authorization", "")
    if auth.startswith("Basic "):
        try:
            basic = BasicAuth.decode(auth)
        except ValueError:
            return None
        return basic.password or basic.login
    return None


async def read_call(gw: Any, request: web.Request) -> tuple[Any, dict[str, Any]]:
    """The caller's tenant (its key from the URL, basic auth or X-API-Key) and the JSON object it posted."""
    tenant = await gw.tenants.get(_key(request) or gw.api_key(request))
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise PayloadTooLarge(f"the request is too large: {exc.text}") from None
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise InvalidArgument("the body is not JSON") from None
    if not isinstance(body, dict):
        raise InvalidArgument("the body must be a JSON object")
    return tenant, body


def fetch_of(body: dict[str, Any]) -> list[str]:
    fetch = body.get("fetch_files") or []
    if not isinstance(fetch, list) or not all(isinstance(p, str) for p in fetch):
        raise InvalidArgument("fetch_files must be a list of paths")
    return fetch


def number(body: dict[str, Any], name: str, default: float) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise InvalidArgument(f"{name} must be a number, got {v!r}")
    lo, hi = _LIMITS[name]
    if not (lo <= v <= hi):
        raise InvalidArgument(f"{name} must be between {lo:g} and {hi:g} seconds, got {v!r}")
    return float(v)


def files_of(raw: Any) -> dict[str, bytes]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise InvalidArgument("files must be an object from path to base64 content")
    out: dict[str, bytes] = {}
    for path, b64 in raw.items():
        if b64 is None:
            continue
        if not isinstance(b64, str):
            raise InvalidArgument(f"files[{path!r}] must be a base64 string")
        try:
            out[path] = base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidArgument(f"files[{path!r}] is not valid base64") from None
    return out


def command(res: ExecResult | None, oom: bool) -> dict[str, Any] | None:
    if res is None:
        return None
    status = "TimeLimitExceeded" if res.timed_out else ("Error" if oom else "Finished")
    return {
        "status": status, "execution_time": round(res.duration_ms / 1000, 6), "return_code": res.exit_code,
        "stdout": res.stdout.decode("utf-8", "replace"), "stderr": res.stderr.decode("utf-8", "replace"),
    }


def answer(out: FnCallResult, memory_mb: int) -> dict[str, Any]:
    """SandboxFusion's ``RunCodeResponse`` of a call."""
    ok = out.run is not None and out.run.exit_code == 0 and not out.run.timed_out and not out.oom
    message = ""
    if out.oom:
        message = f"out of memory: the code went past its memory limit ({memory_mb or 'the pool default'} MB)"
    elif out.run is None and out.compile is not None:
        message = "compile timed out" if out.compile.timed_out else "compile failed"
    return {
        "status": "Success" if ok else "Failed", "message": message,
        "compile_result": command(out.compile, out.oom and out.run is None),
        "run_result": command(out.run, out.oom), "executor_pod_name": out.host_id,
        "files": {p: base64.b64encode(d).decode() for p, d in out.files.items()},
    }


def sandbox_error(status: int, code: str, message: str, **empty: Any) -> web.Response:
    """SandboxFusion's answer to a call that did not run (``empty``: the fields of the endpoint's own shape)."""
    body = {"status": "SandboxError", "message": message, "code": code, **(empty or {"compile_result": None, "run_result": None}), "files": {}}
    return web.json_response(body, status=status)


class RunCode:
    def __init__(self, gw: Any) -> None:
        self.gw = gw

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/run_code", self.run_code)
        app.router.add_post("/k/{key}/run_code", self.run_code)

    async def run_code(self, request: web.Request) -> web.Response:
        try:
            return web.json_response(await self._run(request))
        except DsecError as exc:
            return sandbox_error(exc.http_status, exc.code, exc.description)

    async def _run(self, request: web.Request) -> dict[str, Any]:
        tenant, body = await read_call(self.gw, request)
        code, lang = body.get("code"), body.get("language")
        if not isinstance(code, str) or not isinstance(lang, str):
            raise InvalidArgument("code and language are required strings")
        stdin = body.get("stdin") or ""
        if not isinstance(stdin, str):
            raise InvalidArgument("stdin must be a string")
        memory = body.get("memory_limit_MB", -1)
        if memory is None:
            memory = -1
        if isinstance(memory, bool) or not isinstance(memory, int):
            raise InvalidArgument(f"memory_limit_MB must be an integer, got {memory!r}")
        fn = AsyncFnCall(nc=tenant.nc, queue_timeout=QUEUE_S)
        template, req = fn.code_request(
            code, lang, files_of(body.get("files")), None, number(body, "run_timeout", 10.0),
            compile_timeout=number(body, "compile_timeout", 10.0), memory_mb=max(0, memory), stdin=stdin, fetch_files=fetch_of(body),
        )
        req.trusted = True  # a reward's code runs as a grader's trusted run (no agent-planted startup files)
        out = await fn.call(template, req)
        return answer(out, max(0, memory))


__all__ = ["PayloadTooLarge", "RunCode", "answer", "command", "fetch_of", "files_of", "number", "read_call", "sandbox_error"]
