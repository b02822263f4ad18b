"""OpenEnv on dsec: the unmodified ``openenv-core`` client (``GenericEnvClient.from_docker_image``)
with dsec's provider runs an OpenEnv environment server in a sandbox and talks to it through the
gateway's port route, its ``/ws`` WebSocket included, under ``dsec up`` (the ``gw`` stack of
test_gateway).

The environment's image is a template of two directory layers: the Debian Python rootfs (as
test_snapshots builds it) and a layer with the environment (``/app/env``, OpenEnv's layout, its
``openenv.yaml`` naming the app) and the packages its server imports, copied from this interpreter
(the same ``openenv-core`` the client is).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from bus import codec
from bus import subjects as S
from bus.messages import ImageDefaults, LayerRef, TemplateManifest
from bus.streams import ensure_kv

from tests.conftest import needs

from .conftest import needs_stack
from .test_gateway import Gw, gw, http  # noqa: F401 - gw: the module's stack (a fixture)

try:
    import openenv
except ImportError:  # the dev extra not installed: the module fails with the reason (tests.conftest.needs)
    openenv = None

pytestmark = [pytest.mark.containerd, needs_stack, needs(None if openenv is not None else "needs openenv-core (the dev extra)")]

PY_ROOT_CACHE = "/var/tmp/dsec-snap-py"  # test_snapshots' Debian rootfs with python3, built once and kept
SITE = "/opt/openenv/site"

ENV_APP = '''"""A counting environment: each step appends its text to a file of the machine it runs on."""
import os

from openenv.core.env_server import Environment, create_app
from openenv.core.env_server.types import Action, Observation, State

STEPS = "/tmp/openenv-steps"


class CountAction(Action):
    text: str


class CountObservation(Observation):
    echoed: str = ""
    count: int = 0
    tag: str = ""


class CountEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(episode_id=None, step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs):
        self._state = State(episode_id=episode_id or "ep", step_count=0)
        return CountObservation(tag=os.environ.get("ENV_TAG", ""))

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        with open(STEPS, "a") as f:
            f.write(action.text[:40] + "\\n")
        n = self._state.step_count
        return CountObservation(echoed=action.text, count=n, done=n >= 3, reward=float(len(action.text)))

    @property
    def state(self):
        return self._state


app = create_app(CountEnv, CountAction, CountObservation, env_name="count_env")
'''
OPENENV_YAML = "spec_version: 1\nname: count_env\ntype: space\nruntime: fastapi\napp: server.app:app  # served by uvicorn\nport: 8000\n"

# Imports the app and what uvicorn loads to serve it (HTTP and WebSocket protocols): every module
# file then in sys.modules, as JSON. Without gradio: OpenEnv imports its web UI only when it is there.
TRACE = """
import json, sys
sys.modules["gradio"] = None
sys.path.insert(0, sys.argv[1])
import uvicorn
from server.app import app
uvicorn.Config(app, http="auto", ws="auto", lifespan="on").load()
print(json.dumps(sorted({m.__file__ for m in list(sys.modules.values()) if getattr(m, "__file__", None)})))
"""


def _site_dirs() -> list[str]:
    return sorted({p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)}, key=len, reverse=True)


def build_env_layer(dest: Path) -> None:
    """``dest``: /app/env (the environment) and SITE (the site-packages entries its server imports,
    with their dist-info: some read their own version)."""
    env_dir = dest / "app" / "env"
    (env_dir / "server").mkdir(parents=True)
    (env_dir / "server" / "__init__.py").write_text("")
    (env_dir / "server" / "app.py").write_text(ENV_APP)
    (env_dir / "openenv.yaml").write_text(OPENENV_YAML)
    out = subprocess.run([sys.executable, "-c", TRACE, str(env_dir)], capture_output=True, text=True, timeout=300, check=True).stdout
    files = json.loads(out.strip().splitlines()[-1])
    site = dest / SITE.lstrip("/")
    site.mkdir(parents=True)
    tops: set[tuple[str, str]] = set()
    for f in files:
        for d in _site_dirs():
            if f.startswith(d + "/"):
                tops.add((d, f[len(d) + 1:].split("/", 1)[0]))
                break
    from importlib.metadata import packages_distributions

    dists = packages_distributions()
    for d, top in sorted(tops):
        src = os.path.join(d, top)
        if os.path.isdir(src):
            shutil.copytree(src, site / top, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, site / top)
        if os.path.isdir(src + ".libs"):  # the shared libraries a wheel's extensions link (auditwheel)
            shutil.copytree(src + ".libs", site / (top + ".libs"), dirs_exist_ok=True)
        for dist in dists.get(top.removesuffix(".py").split(".")[0], []):
            norm = dist.replace("-", "_").lower()
            for info in Path(d).glob("*.dist-info"):
                if info.name.lower().startswith(norm + "-") and not (site / info.name).exists():
                    shutil.copytree(info, site / info.name)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def env_template(gw: Gw) -> AsyncIterator[str]:  # noqa: F811 - the imported fixture
    from bus.auth import AuthConfig
    from bus.runtime import connect
    from imaged._debootstrap import python_rootfs

    root = await python_rootfs(PY_ROOT_CACHE)
    layer = Path(tempfile.mkdtemp(prefix="dsec-openenv-layer-", dir="/tmp"))
    nc = await connect(AuthConfig.load_or_create(gw.data / "auth.json").url_for("admin", gw.nats_url))
    name = f"openenv-count-{layer.name[-6:]}"
    try:
        await asyncio.to_thread(build_env_layer, layer)
        kv = await ensure_kv(nc.jetstream(), S.KV_IMAGES)
        await kv.put(name, codec.encode(TemplateManifest(name=name, created_at=time.time(), layers=[
            LayerRef(role="base", digest="sha256:" + hashlib.sha256(str(root).encode()).hexdigest(), kind="dir", path=str(root)),
            LayerRef(role="base", digest="sha256:" + hashlib.sha256(str(layer).encode()).hexdigest(), kind="dir", path=str(layer)),
        ], defaults=ImageDefaults(env={"PYTHONPATH": SITE}))))  # what the environment's Dockerfile ENV would say
        yield name
        await kv.delete(name)
    finally:
        await nc.close()
        shutil.rmtree(layer, ignore_errors=True)


def _provider(stack: Gw) -> Any:
    from sdk import OpenEnvProvider

    return OpenEnvProvider(stack.url, stack.key_a, memory_mb=512, ready_timeout=180)


async def test_openenv_client_runs_an_environment_in_a_sandbox_over_the_gateway(gw: Gw, env_template: str) -> None:  # noqa: F811
    from openenv.core import GenericEnvClient
    from openenv.core.containers.runtime import ContainerProvider

    provider = _provider(gw)
    assert isinstance(provider, ContainerProvider)  # one of OpenEnv's providers
    env = await GenericEnvClient.from_docker_image(env_template, provider=provider, env_vars={"ENV_TAG": "t-1"})
    sid = provider.sandbox_id
    assert sid is not None
    async with env:
        first = await env.reset()
        assert first.observation["tag"] == "t-1" and first.observation["count"] == 0  # env_vars reached the server
        r = await env.step({"text": "hello"})
        assert (r.observation["echoed"], r.observation["count"], r.reward, r.done) == ("hello", 1, 5.0, False)
        # A message over 256 KiB each way (a frame with a 64-bit length, relayed in several pieces).
        big = "y" * 300_000
        r = await env.step({"text": big})
        assert r.observation["echoed"] == big and r.reward == 300_000.0
        r = await env.step({"text": "last"})
        assert r.done and r.observation["count"] == 3
        assert (await env.state())["step_count"] == 3
        # The steps ran in the sandbox: its file says so (read through the gateway's REST API).
        st, body, _ = await asyncio.to_thread(http, gw, "GET", f"/v1/sandboxes/{sid}/files?path=/tmp/openenv-steps")
        assert st == 200 and body == b"hello\n" + b"y" * 40 + b"\nlast\n", (st, body[:200])
        # Plain HTTP through the same base URL (the key as the URL's password): OpenEnv's /health and /schema.
        import httpx

        async with httpx.AsyncClient(timeout=30) as c:
            assert (await c.get(provider.base_url + "/health")).json()["status"] == "healthy"
            assert "action" in (await c.get(provider.base_url + "/schema")).json()
    # Closing the client stopped the sandbox.
    st, doc, _ = await asyncio.to_thread(http, gw, "GET", f"/v1/sandboxes/{sid}")
    assert st == 404, (st, doc)
    assert provider.sandbox_id is None


async def test_the_environment_is_reachable_with_its_key_only(gw: Gw, env_template: str) -> None:  # noqa: F811
    from urllib.parse import urlsplit

    from openenv.core import GenericEnvClient
    from websockets.exceptions import InvalidStatus

    provider = _provider(gw)
    url = await asyncio.to_thread(provider.start_container, env_template)
    try:
        await asyncio.to_thread(provider.wait_for_ready, url)
        u = urlsplit(url)
        bare = f"{u.scheme}://{u.hostname}:{u.port}{u.path}"
        other = f"{u.scheme}://dsec:{gw.key_b}@{u.hostname}:{u.port}{u.path}"
        for base, status in ((bare, 401), (other, 404)):  # no key; another tenant's key (its sandbox does not exist for it)
            client = GenericEnvClient(base_url=base)
            with pytest.raises(ConnectionError) as exc:
                await client.connect()
            cause = exc.value.__cause__
            assert isinstance(cause, InvalidStatus) and cause.response.status_code == status, repr(cause)
        # A WebSocket the server refuses: its own answer comes back (no switch of protocols).
        from websockets.asyncio.client import connect as ws_connect

        ws_url = "ws" + url[len("http"):]
        with pytest.raises(InvalidStatus) as refused:
            await ws_connect(ws_url + "/no-such-socket", open_timeout=30)
        assert refused.value.response.status_code == 403, refused.value  # Starlette's refusal of an unknown WebSocket route
        # Positive control: the same URL with its key.
        async with GenericEnvClient(base_url=url) as env:
            assert (await env.reset()).observation["count"] == 0
    finally:
        await asyncio.to_thread(provider.close)


async def test_provider_refusals_are_typed_and_leave_no_sandbox(gw: Gw, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    from sdk import OpenEnvProvider
    from sdk.errors import InvalidArgument, UnknownTemplate

    provider = _provider(gw)
    with pytest.raises(UnknownTemplate):
        await asyncio.to_thread(provider.start_container, "no-such-template")
    assert provider.sandbox_id is None
    # A template without an openenv.yaml and no cmd=: refused, its sandbox killed.
    before = {d["sandbox_id"] for d in (await asyncio.to_thread(http, gw, "GET", "/v1/sandboxes"))[1]}
    with pytest.raises(InvalidArgument, match="openenv.yaml"):
        await asyncio.to_thread(provider.start_container, "base")
    assert provider.sandbox_id is None
    after = {d["sandbox_id"] for d in (await asyncio.to_thread(http, gw, "GET", "/v1/sandboxes"))[1]}
    assert after <= before
    with pytest.raises(InvalidArgument, match="unsupported options"):
        await asyncio.to_thread(provider.start_container, "base", replicas=2)
    for name in ("DSEC_API_KEY", "E2B_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(InvalidArgument, match="API key"):
        OpenEnvProvider(gw.url, "")
    with pytest.raises(InvalidArgument, match="gateway_url"):
        OpenEnvProvider("gateway:8080", gw.key_a)
    # A server that never answers: a TimeoutError that carries its log.
    url = await asyncio.to_thread(provider.start_container, "base", cmd="echo no server here; exit 1")
    try:
        with pytest.raises(TimeoutError, match="no server here"):
            await asyncio.to_thread(provider.wait_for_ready, url, 3.0)
    finally:
        await asyncio.to_thread(provider.close)
