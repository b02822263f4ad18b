"""OpenEnv on dsec: a container provider for OpenEnv's clients (``openenv-core``) that runs the
environment server in a dsec sandbox and hands the client a base URL on the gateway.

    provider = OpenEnvProvider("http://gateway:8080", api_key)
    env = await GenericEnvClient.from_docker_image("my-env-template", provider=provider)

``start_container(image)`` creates a sandbox of template ``image`` through the gateway's REST API
and starts the server in it: ``cmd=`` (given to the provider or the call), else what the
environment's ``openenv.yaml`` names (its ``app``, served by uvicorn from the file's directory, as
OpenEnv's own Daytona provider does). The base URL it returns is the gateway's path route to the
sandbox's port (``/v1/sandboxes/<id>/ports/<port>``) with the API key as the URL's password: the
client's ``/ws`` WebSocket and HTTP calls (``/health``, ``/reset``, ...) go through the gateway,
the sandbox keeps its network closed. Only the gateway's address and a key are needed, no NATS.

The methods are synchronous, as OpenEnv calls them (also from inside its event loop). Errors the
gateway reports are raised as their typed dsec errors; a server that never answers ``/health`` is
a ``TimeoutError`` carrying the tail of its log.
"""

from __future__ import annotations

import os
import shlex
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit

import httpx

from bus.errors import ErrorReply, InvalidArgument, from_reply

if TYPE_CHECKING:  # checked as a plain class, with or without openenv-core installed
    _Base = object
else:
    try:  # usable without openenv-core; with it, one of its ContainerProviders
        from openenv.core.containers.runtime import ContainerProvider as _Base
    except ImportError:
        _Base = object

SERVER_LOG = "/tmp/openenv-server.log"
OPENENV_YAML = ("/app/env/openenv.yaml", "/app/openenv.yaml")  # OpenEnv's layouts, newest first
READY_POLL_S = 0.25


class OpenEnvProvider(_Base):
    """OpenEnv's ``ContainerProvider`` on dsec (one environment per provider, as OpenEnv's are)."""

    def __init__(
        self, gateway_url: str | None = None, api_key: str | None = None, *, cmd: str | None = None, memory_mb: int | None = None,
        cpu: float | None = None, timeout: float = 3600.0, metadata: dict[str, str] | None = None, request_timeout: float = 120.0,
        ready_timeout: float = 120.0,
    ) -> None:
        self.gateway_url = (gateway_url or os.environ.get("DSEC_GATEWAY_URL") or os.environ.get("E2B_API_URL") or "").rstrip("/")
        self.api_key = api_key or os.environ.get("DSEC_API_KEY") or os.environ.get("E2B_API_KEY") or ""
        if not self.gateway_url.startswith(("http://", "https://")):
            raise InvalidArgument(f"gateway_url must be the gateway's http(s) URL (or $DSEC_GATEWAY_URL), got {self.gateway_url!r}")
        if not self.api_key:
            raise InvalidArgument("an API key is needed (api_key= or $DSEC_API_KEY)")
        self.cmd = cmd
        self.ready_timeout = ready_timeout  # OpenEnv's clients call wait_for_ready(url) without one: a Python server's imports take a while
        self.create: dict[str, Any] = {"timeout": timeout}
        if memory_mb is not None:
            self.create["memory_mb"] = memory_mb
        if cpu is not None:
            self.create["cpu"] = cpu
        self.metadata = dict(metadata or {})
        self.sandbox_id: str | None = None
        self.port = 8000
        self._http = httpx.Client(base_url=self.gateway_url, headers={"X-API-Key": self.api_key}, timeout=request_timeout)

    # --- OpenEnv's ContainerProvider ------------------------------------------------------------------
    def start_container(self, image: str, port: int | None = None, env_vars: dict[str, str] | None = None, **kwargs: Any) -> str:
        """A sandbox of template ``image`` running the environment server on ``port`` (8000); its base URL."""
        unknown = set(kwargs) - {"cmd"}
        if unknown:
            raise InvalidArgument(f"unsupported options for the dsec provider: {', '.join(sorted(unknown))}")
        if self.sandbox_id is not None:
            raise InvalidArgument(f"this provider already runs sandbox {self.sandbox_id}: stop_container() first")
        self.port = 8000 if port is None else port
        if not 1 <= self.port <= 65535:
            raise InvalidArgument(f"port must be 1..65535, got {self.port}")
        body = {**self.create, "template": image, "envs": dict(env_vars or {}), "metadata": {**self.metadata, "openenv": image}}
        self.sandbox_id = self._call("POST", "/v1/sandboxes", json=body)["sandbox_id"]
        try:
            cmd = kwargs.get("cmd") or self.cmd or self._discover_cmd()
            # In a session of its own, output to a file: the exec returns at once and the server outlives it.
            started = self._exec(f"setsid sh -c {shlex.quote(cmd)} > {SERVER_LOG} 2>&1 < /dev/null &", env_vars)
            if started["exit_code"] != 0:
                raise InvalidArgument(f"the environment server did not start: {started['stderr'][-2000:]}")
        except BaseException:
            self.stop_container()
            raise
        return self.base_url

    def wait_for_ready(self, base_url: str, timeout_s: float | None = None) -> None:
        """Until the server answers ``GET /health`` with 200 (a ``TimeoutError`` with its log after
        ``timeout_s``, default the provider's ``ready_timeout``)."""
        timeout_s = self.ready_timeout if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=10.0) as c:
            while True:
                try:
                    if c.get(f"{base_url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass  # the gateway or sandbox not answering yet: asked again
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"the environment server in sandbox {self.sandbox_id} did not answer /health within {timeout_s:g}s; "
                                       f"its log ends: {self.server_log()[-2000:]!r}")
                time.sleep(READY_POLL_S)  # poll interval while the server starts

    def stop_container(self) -> None:
        """Kill the sandbox (one already gone is fine)."""
        sid, self.sandbox_id = self.sandbox_id, None
        if sid is None:
            return
        r = self._http.delete(f"/v1/sandboxes/{sid}")
        if r.status_code not in (204, 404):
            _raise(r)

    # --- dsec's extras --------------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        """The environment's URL on the gateway, the key in it (what OpenEnv's clients take)."""
        if self.sandbox_id is None:
            raise InvalidArgument("no environment is running: start_container() first")
        u = urlsplit(self.gateway_url)
        return f"{u.scheme}://dsec:{quote(self.api_key, safe='')}@{u.netloc}{u.path}/v1/sandboxes/{self.sandbox_id}/ports/{self.port}"

    def server_log(self) -> str:
        """What the environment server printed (empty when there is nothing to read)."""
        if self.sandbox_id is None:
            return ""
        r = self._http.get(f"/v1/sandboxes/{self.sandbox_id}/files", params={"path": SERVER_LOG})
        return r.content.decode("utf-8", "replace") if r.status_code == 200 else ""

    def close(self) -> None:
        self.stop_container()
        self._http.close()

    # --- inside ------------------------------------------------------------------------------------------
    def _discover_cmd(self) -> str:
        """OpenEnv's convention: ``openenv.yaml`` names the app; uvicorn serves it from the file's directory."""
        for path in OPENENV_YAML:
            r = self._http.get(f"/v1/sandboxes/{self.sandbox_id}/files", params={"path": path})
            if r.status_code != 200:
                continue
            app = _app_of(r.text)
            if app is None:
                raise InvalidArgument(f"{path} in template names no app: pass cmd=")
            root = path.rsplit("/", 1)[0]
            return f"cd {shlex.quote(root)} && exec python3 -m uvicorn {shlex.quote(app)} --host 0.0.0.0 --port {self.port}"
        raise InvalidArgument(f"the template has no openenv.yaml ({' or '.join(OPENENV_YAML)}): pass cmd=")

    def _exec(self, cmd: str, env_vars: dict[str, str] | None) -> dict[str, Any]:
        return self._call("POST", f"/v1/sandboxes/{self.sandbox_id}/exec", json={"cmd": cmd, "envs": dict(env_vars or {}), "timeout": 60})

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        r = self._http.request(method, path, **kw)
        if r.status_code >= 400:
            _raise(r)
        return r.json()


def _app_of(yaml_text: str) -> str | None:
    """The ``app:`` of an openenv.yaml (a top-level scalar; read without a YAML library)."""
    for line in yaml_text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key == "app":
            value = value.split(" #", 1)[0].strip().strip("'\"")
            return value or None
    return None


def _raise(r: httpx.Response) -> None:
    try:
        doc = r.json()
        code, message = str(doc["code"]), str(doc["message"])
    except (ValueError, KeyError, TypeError):
        code, message = "unavailable" if r.status_code >= 500 else "bad_request", f"HTTP {r.status_code}: {r.text[:500]}"
    raise from_reply(ErrorReply(code=code, description=message))


__all__ = ["OpenEnvProvider"]
