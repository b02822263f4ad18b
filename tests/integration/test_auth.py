"""Control-plane permissions: each role reaches only its subjects; clients cannot forge control messages."""

from __future__ import annotations

import shutil
import tempfile

import nats
import pytest
from nats.js.api import ConsumerConfig

from bus import codec
from bus import subjects as S
from bus.auth import AuthConfig, inbox_prefix
from bus.messages import HostStatus
from bus.natsd import NatsServer
from bus.runtime import connect
from bus.streams import ensure_all, ensure_kv
from tests.conftest import eventually


@pytest.fixture(scope="module")
def authed():
    d = tempfile.mkdtemp(prefix="dsec-auth-")
    auth = AuthConfig.load_or_create(f"{d}/auth.json")
    auth.issue_sandbox_credential("sb-mine")
    auth.issue_client_credential("alice")
    srv = NatsServer(f"{d}/nats", port=0, extra_config=auth.config_block())
    srv.start()
    yield srv, auth
    srv.stop()
    shutil.rmtree(d, ignore_errors=True)


async def _errors(url: str, **kw):
    errs: list[str] = []
    kw.setdefault("inbox_prefix", inbox_prefix(kw.get("user", "client")))  # the only inboxes each user may receive on

    async def on_err(e: Exception) -> None:
        errs.append(str(e))

    nc = await nats.connect(url, error_cb=on_err, **kw)
    return nc, errs


async def test_connection_without_credentials_is_refused(authed) -> None:
    srv, auth = authed
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(srv.url, max_reconnect_attempts=0, allow_reconnect=False, connect_timeout=2)
    # Positive control: the same server takes a named client.
    nc = await nats.connect(srv.url, user="cli-alice", password=auth.client_users["cli-alice"], inbox_prefix=inbox_prefix("cli-alice"))
    await nc.close()


async def test_client_cannot_forge_control_messages(authed) -> None:
    srv, auth = authed
    admin = await connect(auth.url_for("admin", srv.url))
    await ensure_all(admin.jetstream())
    kv = await ensure_kv(admin.jetstream(), S.KV_HOSTS)
    await kv.put("h1", codec.encode(HostStatus(host_id="h1", backend="container", at=0.0)))
    nc, errs = await _errors(srv.url, user="cli-alice", password=auth.client_users["cli-alice"])
    try:
        forged = (S.host_create("h1"), S.evt_sandbox("sb-x", "ready", "cli-alice"), f"$KV.{S.KV_IMAGES}.base", f"$KV.{S.KV_HOSTS}.h1", S.dlq("x"), S.REQ_CREATE)
        for subject in forged:
            await nc.publish(subject, b"forged")
        await nc.flush()
        await eventually(lambda: len(errs) >= len(forged), what="a permission violation per forged publish")
        assert all("permissions violation for publish" in e for e in errs)
        # Positive control: what a client needs still works.
        await nc.publish(S.req_create("cli-alice"), b"ok-to-ask")
        js = nc.jetstream()
        assert (await (await js.key_value(S.KV_HOSTS)).get("h1")).value
        # ... but it cannot consume the work queue (steal or drop create requests).
        # (the server drops the request: no reply, and the client is told of the violation)
        with pytest.raises(nats.errors.TimeoutError):
            await js.add_consumer(S.STREAM_REQ, ConsumerConfig(durable_name="thief"))
        await eventually(lambda: any('publish to "$js.api.consumer.' in e.lower() for e in errs), what="the consumer-create violation")
    finally:
        await nc.close()
        await admin.close()


async def test_sandbox_credential_reaches_only_its_own_subjects(authed) -> None:
    srv, auth = authed
    user, pw = auth.issue_sandbox_credential("sb-mine")
    got: list[str] = []
    admin = await connect(auth.url_for("admin", srv.url))

    async def on_msg(m) -> None:
        got.append(m.subject)

    sub = await admin.subscribe("dsec.sbx.>", cb=on_msg)
    await admin.flush()
    nc, errs = await _errors(srv.url, user=user, password=pw)
    try:
        await nc.publish(S.sbx("sb-mine", "exec"), b"x")
        await nc.publish(S.sbx("sb-other", "exec"), b"x")
        await nc.publish(S.REQ_CREATE, b"x")
        await nc.flush()
        await eventually(lambda: len(errs) >= 2 and got, what="one delivery and two violations")
        assert got == [S.sbx("sb-mine", "exec")]
        await nc.subscribe("dsec.evt.>")
        await nc.flush()
        await eventually(lambda: any("permissions violation for subscription" in e for e in errs), what="subscribe violation")
    finally:
        await sub.unsubscribe()
        await nc.close()
        await admin.close()


async def test_wrong_password_is_refused(authed) -> None:
    srv, _ = authed
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(srv.url, user="placement", password="nope", max_reconnect_attempts=0, allow_reconnect=False, connect_timeout=2)
