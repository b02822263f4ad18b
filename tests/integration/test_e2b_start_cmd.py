"""E2B's start and ready commands (``Template().set_start_cmd(cmd, ready_cmd)``) through the
unmodified e2b SDK against the gateway under ``dsec up`` (the ``gw`` stack of test_gateway, whose
``DSEC_TEMPLATE_READY_TIMEOUT_S`` is 30).

dsec has no running-state snapshot on this path (``sdk._startcmd``): the build checks that the ready
command succeeds after the start command, and every create runs both again and is answered only
once the ready command has succeeded. So a sandbox answers on the start command's port as soon as
``Sandbox.create`` returns; a ready command that never succeeds fails the build with the command,
the time it was given and the start command's output, and leaves no template and no sandbox.
"""

# ruff: noqa: F811 - the parameters named gw are the stack fixture imported from test_gateway
from __future__ import annotations

import asyncio
import urllib.parse
import uuid

import pytest

from .test_gateway import Gw, gw, http  # noqa: F401 - gw is the module's stack fixture

START = "mkdir -p /tmp/www && echo served-from-the-start-command > /tmp/www/index.html && exec httpd -f -p 8080 -h /tmp/www"
READY = "wget -q -O /dev/null http://127.0.0.1:8080/index.html"  # the base template is busybox: wget, not curl or ss


def _build_sandboxes(gw: Gw) -> list[str]:
    q = urllib.parse.quote("dsec.build=1")
    status, body, _ = http(gw, "GET", f"/v2/sandboxes?metadata={q}")
    assert status == 200, body
    return [s["sandboxID"] for s in body]


def _server_runs_at_create(gw: Gw) -> None:
    from e2b import Sandbox, Template

    name = f"e2bstart-{uuid.uuid4().hex[:8]}"
    logs: list = []
    info = Template.build(Template().from_template("base").set_start_cmd(START, READY), name, on_build_logs=logs.append, **gw.sdk())
    messages = [str(getattr(e, "message", "")) for e in logs]
    assert any(m.startswith("  ready after") for m in messages), messages
    assert Template.get_build_status(info, **gw.sdk()).status.value == "ready"
    for _ in range(2):  # each sandbox has its own server, running when the create returns
        sb = Sandbox.create(name, timeout=120, **gw.sdk())
        try:
            # One request, no retry: the server is up before the create was answered.
            status, body, _ = http(gw, "GET", "/index.html", None, {"Host": sb.get_host(8080)})
            assert (status, body) == (200, b"served-from-the-start-command\n")
            assert sb.commands.run("pidof httpd").stdout.strip().isdigit()  # one server, started by the create
        finally:
            sb.kill()
    assert _build_sandboxes(gw) == []


async def test_start_cmd_server_answers_as_soon_as_the_sandbox_is_created(gw: Gw) -> None:
    await asyncio.to_thread(_server_runs_at_create, gw)


def _ready_never_succeeds(gw: Gw) -> None:
    from e2b import BuildException, Template

    name = f"e2bnever-{uuid.uuid4().hex[:8]}"
    t = Template().from_template("base").set_start_cmd("echo start-cmd-said-this; exec sleep 1000", "test -f /tmp/never")
    with pytest.raises(BuildException) as exc:
        Template.build(t, name, **gw.sdk())
    text = str(exc.value)
    assert "the ready command `test -f /tmp/never` did not succeed within 30s" in text, text
    assert "last exit code 1" in text and "the start command `echo start-cmd-said-this; exec sleep 1000` still running" in text, text
    assert "start-cmd-said-this" in text, text
    assert not Template.exists(name, **gw.sdk()) and not Template.alias_exists(name, **gw.sdk())
    assert http(gw, "GET", f"/templates/aliases/{name}")[0] == 404
    assert _build_sandboxes(gw) == []  # the check's sandbox is gone
    # A ready command alone is refused before anything runs.
    with pytest.raises(BuildException) as exc2:
        Template.build(Template().from_template("base").set_ready_cmd("true"), f"{name}-r", **gw.sdk())
    assert "readyCmd needs a startCmd" in str(exc2.value), str(exc2.value)


async def test_ready_cmd_that_never_succeeds_fails_the_build_and_leaves_nothing(gw: Gw) -> None:
    await asyncio.to_thread(_ready_never_succeeds, gw)


def _create_not_ready(gw: Gw, name: str) -> None:
    from e2b import Sandbox, SandboxException

    with pytest.raises(SandboxException) as exc:
        Sandbox.create(name, timeout=120, **{**gw.sdk(), "request_timeout": 240})
    text = str(exc.value)
    assert text.startswith("500:") and f"template '{name}': the ready command `exit 7` did not succeed within 30s" in text, text
    assert "last exit code 7" in text and "the start command `exec sleep 1000` still running" in text, text
    status, body, _ = http(gw, "GET", "/v2/sandboxes")
    assert status == 200 and [s["sandboxID"] for s in body if s["templateID"] == name] == []  # the sandbox was removed


async def test_create_whose_ready_cmd_fails_is_refused_and_the_sandbox_removed(gw: Gw) -> None:
    from bus import codec
    from bus import subjects as S
    from bus.messages import BuildImage, ImageBuilt, ImageDefaults
    from bus.runtime import connect, tenant_of
    from sdk.gateway._keys import parse_key
    from sdk.gateway._tenants import url_with_user

    # A template whose ready command cannot succeed at create (a build would have refused it: this
    # one is written to the catalogue as its owner, with those defaults).
    user, password = parse_key(gw.key_a)
    nc = await connect(url_with_user(gw.nats_url, user, password), name="test-start-cmd")
    name = f"e2bnotready-{uuid.uuid4().hex[:8]}"
    try:
        req = BuildImage(name=name, base="", from_template="base", owner=user,
                         defaults=ImageDefaults(start_cmd="exec sleep 1000", ready_cmd="exit 7"))
        msg = await nc.request(S.img_build(tenant_of(nc)), codec.encode(req), timeout=300)
        codec.decode_reply(msg.data, ImageBuilt)
        await asyncio.to_thread(_create_not_ready, gw, name)
    finally:
        await nc.close()
