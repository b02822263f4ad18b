"""Tenants on the bus: an API key (a NATS client identity) reaches only its own sandboxes.

A real stack with NATS authentication (``make_stack(auth=True)``, what ``dsec up`` runs) and two or
three tenants, each its own client credential (``bus.auth.client_permissions``). Every attack is
made as an attacker would: through the SDK with another tenant's credentials, with none, and with
raw nats-py publishes, subscriptions and JetStream API calls crafted by hand. Each refusal is
asserted precisely: the server's ``Permissions Violation`` for that subject, the ``Authorization
Violation`` of a connection without credentials, or the typed ``permission_denied`` the host agent
answers (with its ``control-plane`` guard violation event), and each has a positive control: the
owner can.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest

from bus import codec
from bus import subjects as S
from bus.auth import AuthConfig, with_credentials
from bus.errors import PermissionDenied, Unavailable
from bus.messages import CreateSandbox, ExecRequest, ExecResult
from bus.runtime import connect
from sdk import AsyncSandbox, build_spec
from sdk._admin import replay_events
from tests.conftest import eventually
from tests.security.conftest import SKIP_REASON, Principal, RedTeam, SecStack, Tenant, tenants

pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")


async def create_as(stack: SecStack, t: Tenant, **kw: Any) -> AsyncSandbox:
    kw.setdefault("sandbox_id", f"sb-{stack.uid}-{t.short}-{uuid.uuid4().hex[:6]}")
    sb = await AsyncSandbox.create(nats_url=t.url, **kw)
    stack.sandboxes.append(sb)
    return sb


async def violations(stack: SecStack, sid: str) -> list[dict[str, Any]]:
    """The control-plane violations about ``sid`` in the event stream (read as the operator)."""
    out = []
    async for ev in replay_events(stack.url_as("admin"), sandbox_id=sid, kinds=["control-plane"], idle_timeout=1.0):
        if ev["type"] == "GuardViolation":
            out.append(ev)
    return out


@pytest.fixture
async def stack(make_stack: Any) -> SecStack:
    return await make_stack(auth=True)


# ------------------------------------------------------------------------------------------ SDK
async def test_sdk_with_another_tenants_credentials_is_refused(stack: SecStack, redteam: RedTeam) -> None:
    """B and C hold A's sandbox id: every SDK route answers them permission_denied (the host agent's
    check, logged as a control-plane violation) and nothing runs; A reads its own secret."""
    a, b, c = await tenants(stack, "a", "b", "c")
    try:
        secret = uuid.uuid4().hex
        sa = await create_as(stack, a, envs={"A_TOKEN": secret})
        await sa.files.write("/tmp/secret", b"file-" + secret.encode())
        out = await sa.commands.run("cat /tmp/secret; echo; echo $A_TOKEN")
        assert out.stdout == f"file-{secret}\n{secret}\n"
        redteam.allowed("tenant a: exec + files in its own sandbox (envs and files)")
        sb_b = await create_as(stack, b)
        assert (await sb_b.commands.run("echo b")).stdout == "b\n"
        redteam.allowed("tenant b: its own sandbox")

        for t in (b, c):
            with pytest.raises(PermissionDenied):
                await AsyncSandbox.connect(sa.sandbox_id, nats_url=t.url)
            h = AsyncSandbox(sa.sandbox_id, await _sdk_nc(t))
            with pytest.raises(PermissionDenied):
                await h.commands.run("cat /tmp/secret; echo $A_TOKEN")
            with pytest.raises(PermissionDenied):
                await h.files.read("/tmp/secret")
            with pytest.raises(PermissionDenied):
                await h.set_timeout(5)
            with pytest.raises(PermissionDenied):
                await h.kill(timeout=5)
            redteam.blocked(f"{t.name}: connect, exec, files, timeout, kill on another tenant's sandbox through the SDK [permission_denied]")

        # Nothing ran: A's sandbox is alive with its timeout, and each refusal is on the record.
        assert sa.sandbox_id in stack.host.live
        assert (await sa.commands.run("echo $A_TOKEN")).stdout == f"{secret}\n"

        async def recorded() -> bool:
            return len(await violations(stack, sa.sandbox_id)) >= 10

        await eventually(recorded, timeout=15, what="a control-plane violation per refused op")
        vs = await violations(stack, sa.sandbox_id)
        assert {v["detail"]["tenant"] for v in vs} == {b.user, c.user}
        assert {v["detail"]["op"] for v in vs} >= {"info", "exec", "files", "timeout", "kill"}
        assert all(v["kind"] == "control-plane" and v["host_id"] == stack.host_id for v in vs)
    finally:
        for t in (a, b, c):
            await t.close()


async def _sdk_nc(t: Tenant) -> Any:
    import sdk._async

    return await sdk._async._nc(t.url)


async def test_no_credentials_no_access(stack: SecStack, redteam: RedTeam) -> None:
    """Nothing connects without credentials: the SDK, the CLI's library and raw nats-py are refused."""
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(stack.url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=3)
    redteam.blocked("no credentials: raw nats-py connect [Authorization Violation]")
    with pytest.raises(Unavailable, match="Authorization Violation"):
        await AsyncSandbox.create(nats_url=stack.url, create_timeout=10)
    redteam.blocked("no credentials: SDK create [unavailable: Authorization Violation]")
    # Positive control: a credential of the same server works.
    sb = await stack.create()
    assert (await sb.commands.run("echo ok")).stdout == "ok\n"
    redteam.allowed("client credential: SDK create + exec")


# ------------------------------------------------------------------------------------------ raw NATS
async def test_raw_nats_reaches_only_its_own_tenant(stack: SecStack, redteam: RedTeam) -> None:
    """Hand-crafted publishes, subscriptions and JetStream API calls at A's sandbox by B: each
    refused by nats-server for its subject; the same calls by A on its own prefix work."""
    a, b = await tenants(stack, "a", "b")
    try:
        sa = await create_as(stack, a, envs={"A_TOKEN": "s3cret"})
        aid = sa.sandbox_id
        exec_req = codec.encode(ExecRequest(cmd="echo $A_TOKEN"))
        # Ops on A's prefix.
        for op in ("exec", "files", "kill", "info", "port"):
            await b.denied_publish(redteam, S.sbx(aid, op, a.user), exec_req, f"{op} on A's sandbox under A's tenant")
        await b.denied_publish(redteam, S.sbx(aid, "exec", S.OPERATOR_TENANT), exec_req, "exec as the operator's tenant")
        # Creates as A (its sandbox would be A's, and A's quota) and through the services' subject.
        spec = codec.encode(CreateSandbox(spec=build_spec("base", sandbox_id=f"x-{stack.uid}", client=a.user)))
        await b.denied_publish(redteam, S.req_create(a.user), spec, "create in A's name")
        await b.denied_publish(redteam, S.req_create_batch(a.user), spec, "create a batch in A's name")
        await b.denied_publish(redteam, S.REQ_CREATE, spec, "create on the services' subject (spec.client taken as given)")
        # Events, records, inboxes.
        for subject, what in (
            (S.evt_tenant(a.user), "A's events"), (S.evt_sandbox_all(aid), "A's sandbox's events, any tenant token"),
            (S.EVT_SANDBOX_ALL, "every sandbox's events"), (S.EVT_ALL, "every event"), ("dsec.>", "everything"),
            ("_INBOX.>", "every inbox"), (f"_INBOX.u.{a.user}.>", "A's inboxes (create outcomes, exec output)"),
            (S.SBX_WILDCARD, "every sandbox op (to replay one)"), (f"$KV.{S.KV_SANDBOXES}.>", "record writes"),
        ):
            await b.denied_subscribe(redteam, subject, f"listen on {what}")
        evt_ready = S.evt_sandbox(aid, "ready", a.user)
        await b.denied_publish(redteam, f"$JS.API.DIRECT.GET.{S.STREAM_EVT}.{evt_ready}", b"", "read A's ready event (direct get)")
        await b.denied_publish(redteam, f"$JS.API.STREAM.MSG.GET.{S.STREAM_EVT}", json.dumps({"last_by_subj": evt_ready}).encode(), "read A's event (msg get)")
        await b.denied_publish(redteam, f"$JS.API.STREAM.INFO.{S.STREAM_EVT}", b'{"subjects_filter":">"}', "list every event subject (sandbox ids)")
        rec = f"$KV.{S.KV_SANDBOXES}.{aid}"
        await b.denied_publish(redteam, f"$JS.API.DIRECT.GET.KV_{S.KV_SANDBOXES}.{rec}", b"", "read A's record (its envs)")
        await b.denied_publish(redteam, f"$JS.API.STREAM.MSG.GET.KV_{S.KV_SANDBOXES}", json.dumps({"last_by_subj": rec}).encode(), "read A's record")
        await b.denied_publish(redteam, f"$JS.API.STREAM.INFO.KV_{S.KV_SANDBOXES}", b"", "sandbox records' stream info")
        consumer = json.dumps({"stream_name": S.STREAM_EVT, "config": {"filter_subject": S.evt_tenant(a.user), "deliver_subject": "_INBOX.u.x"}}).encode()
        await b.denied_publish(redteam, f"$JS.API.CONSUMER.CREATE.{S.STREAM_EVT}", consumer, "consumer on the event stream (filter in the body)")
        await b.denied_publish(
            redteam, f"$JS.API.CONSUMER.CREATE.{S.STREAM_EVT}.spy.{S.evt_tenant(a.user)}", consumer, "named consumer on A's events",
        )
        await b.denied_publish(redteam, f"$JS.API.CONSUMER.CREATE.{S.STREAM_EVT}.spy.{S.EVT_ALL}", consumer, "named consumer on every event")
        # A host batch's ready events name A's sandboxes (dsec.evt.ready.<tenant>.<host>): A's alone.
        a_ready = S.evt_ready_tenant(a.user)
        await b.denied_publish(redteam, f"$JS.API.CONSUMER.CREATE.{S.STREAM_EVT}.spy.{a_ready}", consumer, "named consumer on A's batch ready events")
        await b.denied_publish(redteam, f"$JS.API.DIRECT.GET.{S.STREAM_EVT}.{S.evt_ready(a.user, stack.host_id)}", b"", "read A's batch ready event")
        await b.denied_subscribe(redteam, a_ready, "listen on A's batch ready events")
        await b.denied_publish(redteam, f"$JS.API.CONSUMER.DURABLE.CREATE.{S.STREAM_EVT}.spy", consumer, "durable on the event stream")
        await b.denied_publish(redteam, f"$JS.API.CONSUMER.CREATE.KV_{S.KV_SANDBOXES}", b"{}", "consumer on the sandbox records")
        await b.denied_publish(redteam, f"$JS.API.CONSUMER.DELETE.{S.STREAM_EVT}.{S.GUARD_AUDIT_DURABLE}", b"", "delete guard's audit consumer")
        # Snapshots (their records hold the source's spec and envs; their chunks its files) and templates.
        snap_rec = f"$KV.{S.KV_SNAPSHOTS}.snap-{aid}"
        await b.denied_publish(redteam, f"$JS.API.DIRECT.GET.KV_{S.KV_SNAPSHOTS}.{snap_rec}", b"", "read a snapshot record (its spec's envs)")
        await b.denied_publish(redteam, f"$JS.API.CONSUMER.CREATE.KV_{S.KV_SNAPSHOTS}", b"{}", "list snapshot records")
        await b.denied_publish(redteam, f"$JS.API.STREAM.INFO.OBJ_{S.OBJ_CHUNKS}", b"", "snapshot chunks' stream info")
        await b.denied_publish(redteam, f"$JS.API.DIRECT.GET.OBJ_{S.OBJ_CHUNKS}.$O.{S.OBJ_CHUNKS}.M.x", b"", "read a chunk's metadata")
        await b.denied_publish(redteam, f"$JS.API.CONSUMER.CREATE.OBJ_{S.OBJ_CHUNKS}", b"{}", "read snapshot chunks (files)")
        await b.denied_subscribe(redteam, f"$O.{S.OBJ_CHUNKS}.>", "snapshot chunks as they are written")
        await b.denied_subscribe(redteam, "dsec.img.>", "answer image requests (impersonate the image service)")
        with pytest.raises(PermissionDenied):
            await AsyncSandbox.list_snapshots(nats_url=b.url)
        redteam.blocked("tenant b: list every snapshot through the SDK [permission_denied: records are not a client's]")
        # Still nothing reached A's sandbox, and B's raw connection was never closed for it.
        assert b.nc.is_connected and aid in stack.host.live

        # Positive controls: the same calls by A on its own prefix.
        got = codec.decode_reply((await a.nc.request(S.sbx(aid, "exec", a.user), exec_req, timeout=30)).data, ExecResult)
        assert got.stdout == b"s3cret\n"
        m = await a.nc.jetstream().get_last_msg(S.STREAM_EVT, evt_ready, direct=True)
        assert codec.EVENT.decode(m.data).sandbox_id == aid
        seen: list[str] = []
        # consumers filtered on its own prefixes: its sandboxes' events and its batch ready events
        async for ev in replay_events(a.url, idle_timeout=2.0):
            seen += ev.get("sandbox_ids") or [ev["sandbox_id"]]
        assert aid in seen
        redteam.allowed("tenant a: raw exec, direct get and filtered consumers on its own prefixes")
        assert a.no_violations(), a.errs
    finally:
        for t in (a, b):
            await t.close()


async def test_trajectory_log_is_read_by_its_tenant_only(stack: SecStack, redteam: RedTeam) -> None:
    """A sandbox's trajectory log (every exec's request and result: commands, envs, outputs) is kept
    under its owner's tenant (``dsec.traj.<tenant>.<id>``): B's direct gets, message gets, consumers
    and subscriptions on A's log are refused by nats-server for their subjects, and B's SDK reads
    find nothing; A reads and replays its own."""
    a, b = await tenants(stack, "a", "b")
    try:
        secret = uuid.uuid4().hex
        sa = await create_as(stack, a, envs={"A_TOKEN": secret})
        aid = sa.sandbox_id
        assert (await sa.commands.run("echo $A_TOKEN")).stdout == f"{secret}\n"
        own = S.traj(aid, a.user)
        # Raw JetStream API calls at A's log.
        await b.denied_publish(redteam, f"$JS.API.DIRECT.GET.{S.STREAM_TRAJ}.{own}", b"", "read A's log (direct get)")
        await b.denied_publish(redteam, f"$JS.API.DIRECT.GET.{S.STREAM_TRAJ}.{S.traj_any(aid)}", b"", "read A's sandbox's log, any tenant token")
        await b.denied_publish(redteam, f"$JS.API.STREAM.MSG.GET.{S.STREAM_TRAJ}", json.dumps({"last_by_subj": own}).encode(), "read A's log (msg get)")
        await b.denied_publish(redteam, f"$JS.API.STREAM.INFO.{S.STREAM_TRAJ}", b'{"subjects_filter":">"}', "list every log subject")
        consumer = json.dumps({"stream_name": S.STREAM_TRAJ, "config": {"filter_subject": own, "deliver_subject": "_INBOX.u.x"}}).encode()
        await b.denied_publish(redteam, f"$JS.API.CONSUMER.CREATE.{S.STREAM_TRAJ}", consumer, "consumer on the log stream (filter in the body)")
        await b.denied_publish(redteam, f"$JS.API.CONSUMER.CREATE.{S.STREAM_TRAJ}.spy.{own}", consumer, "named consumer on A's log")
        await b.denied_publish(redteam, f"$JS.API.CONSUMER.CREATE.{S.STREAM_TRAJ}.spy.{S.traj_any(aid)}", consumer, "named consumer, any tenant token")
        await b.denied_publish(redteam, f"$JS.API.CONSUMER.DURABLE.CREATE.{S.STREAM_TRAJ}.spy", consumer, "durable on the log stream")
        for subject, what in ((S.traj_tenant(a.user), "A's logs as they are written"), (f"{S.PREFIX}.traj.>", "every log")):
            await b.denied_subscribe(redteam, subject, f"listen on {what}")
        # Through the SDK, B reads under its own tenant: nothing of A's.
        hb = AsyncSandbox(aid, await _sdk_nc(b))
        assert await hb.trajectory() == []
        redteam.blocked("tenant b: sb.trajectory() of A's sandbox [its reads are under its own prefix: empty]")
        assert b.nc.is_connected

        # Positive controls: A reads its log (the secret is in it) and replays it.
        steps = await sa.trajectory()
        assert [(s.step, s.kind) for s in steps] == [(0, "ExecRequest")]
        assert isinstance(steps[0].result, ExecResult) and steps[0].result.stdout == f"{secret}\n".encode()
        m = await a.nc.jetstream().get_last_msg(S.STREAM_TRAJ, own, direct=True)
        assert m.subject == own
        again = await AsyncSandbox.connect(aid, nats_url=a.url, replay=True)
        assert (await again.commands.run("echo $A_TOKEN")).stdout == f"{secret}\n"
        assert again._traj.replayed == 1  # answered from the log, not run again
        redteam.allowed("tenant a: sb.trajectory(), a direct get of its log, connect(replay=True)")
        assert a.no_violations(), a.errs
    finally:
        for t in (a, b):
            await t.close()


async def test_create_is_bound_to_the_publishers_tenant(stack: SecStack, redteam: RedTeam) -> None:
    """A create whose spec names another tenant as its client is B's sandbox all the same (placement
    binds it to the tenant of the subject): A cannot reach it, B can."""
    a, b = await tenants(stack, "a", "b")
    try:
        sb = await create_as(stack, b, client=a.user)
        rec = await (await stack.nc.jetstream().key_value(S.KV_SANDBOXES)).get(sb.sandbox_id)
        assert codec.SANDBOX_RECORD.decode(rec.value).spec.client == b.user
        assert (await sb.commands.run("echo mine")).stdout == "mine\n"
        with pytest.raises(PermissionDenied):
            await AsyncSandbox.connect(sb.sandbox_id, nats_url=a.url)
        redteam.blocked("tenant b: create a sandbox in A's name (spec.client) [bound to b by placement]")
    finally:
        for t in (a, b):
            await t.close()


# ------------------------------------------------------------------------------------------ audit, operator
async def test_audit_replay_shows_a_tenant_only_its_sandboxes(stack: SecStack, redteam: RedTeam) -> None:
    a, b = await tenants(stack, "a", "b")
    try:
        sa, sb = await create_as(stack, a), await create_as(stack, b)
        await sa.commands.run("echo a-cmd")
        await sb.commands.run("echo b-secret-cmd")

        async def seen(url: str, **kw: Any) -> list[dict[str, Any]]:
            return [ev async for ev in replay_events(url, idle_timeout=2.0, **kw)]

        mine = await seen(a.url)
        assert {e["sandbox_id"] for e in mine} == {sa.sandbox_id}
        assert not [e for e in mine if "b-secret-cmd" in json.dumps(e.get("detail", {}))]
        assert await seen(a.url, sandbox_id=sb.sandbox_id) == []
        redteam.blocked("tenant a: audit replay of B's sandbox [its consumer sees its own prefix only]")
        # Positive control: the operator sees both, exec command lines included.
        every = await seen(stack.url_as("admin"))
        assert {sa.sandbox_id, sb.sandbox_id} <= {e["sandbox_id"] for e in every if e["type"] == "SandboxEvent"}
        assert any("b-secret-cmd" in e.get("detail", {}).get("cmd", "") for e in every)
        # The operator reaches a tenant's sandbox too (its tenant token is allowed by the host).
        assert (await AsyncSandbox(sa.sandbox_id, stack.nc).commands.run("echo op")).stdout == "op\n"
        redteam.allowed("operator: every tenant's events and sandboxes")
    finally:
        for t in (a, b):
            await t.close()


# ------------------------------------------------------------------------------------------ key lifecycle
async def test_revoked_key_stops_working_on_the_bus(stack: SecStack, redteam: RedTeam) -> None:
    """``dsec api-key revoke``: after the reload its live connection is dropped and a new one refused;
    its sandboxes keep running (or are killed on request); another key is untouched."""
    from sdk.gateway._keys import create_api_key, kill_tenant_sandboxes, parse_key, revoke_api_key

    auth_file = Path(stack.nats.data_dir) / "auth.json"
    stack.auth.save(auth_file)  # the stack's users (its client tenant) in the file `dsec api-key` edits

    def reload() -> None:
        stack.nats.reload(AuthConfig.load_or_create(auth_file).config_block())

    key, other = create_api_key(auth_file, "doomed"), create_api_key(auth_file, "kept")
    assert key.startswith("e2b_") and all(ch in "0123456789abcdef" for ch in key[4:])
    await asyncio.to_thread(reload)
    user, pw = parse_key(key)
    url = with_credentials(stack.url, user, pw)
    sb = await AsyncSandbox.create(nats_url=url, sandbox_id=f"sb-{stack.uid}-doomed")
    stack.sandboxes.append(sb)
    assert (await sb.commands.run("echo before")).stdout == "before\n"
    kept = await connect(with_credentials(stack.url, *parse_key(other)), name="kept", connect_attempts=2, connect_timeout_s=5)
    try:
        t0 = time.monotonic()
        assert revoke_api_key(auth_file, "doomed") == [user]
        await asyncio.to_thread(reload)
        await eventually(lambda: sb.nc.is_closed, timeout=10, what="the revoked key's connection dropped")
        assert time.monotonic() - t0 < 10
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=3)
        redteam.blocked("revoked key: its live connection dropped and a new one refused [Authorization Violation]")
        # Its sandbox kept running (the default); killing it is the operator's choice.
        assert sb.sandbox_id in stack.host.live
        assert kept.is_connected
        redteam.allowed("another key: untouched by the revocation")
        assert await kill_tenant_sandboxes(user, stack.url_as("admin")) == [sb.sandbox_id]
        await eventually(lambda: sb.sandbox_id not in stack.host.live, timeout=30, what="the revoked key's sandbox killed")
    finally:
        await kept.close()


# ------------------------------------------------------------------------------------------ quotas
async def test_tenants_and_services_cannot_raise_a_quota_or_forget_what_is_held(stack: SecStack, redteam: RedTeam) -> None:
    """A tenant's quotas (KV ``dsec_tenants``) are the operator's to write, what it holds (KV
    ``dsec_quota``) placement's: the tenant itself, and a host agent or placement credential, is
    refused by the server on every write path (put, the defaults, a purge); the quota holds. The
    operator's own write is the positive control: placement applies it."""
    from bus.messages import TenantLimits, TenantUsage
    from bus.runtime import KV
    from sdk.errors import QuotaExceeded

    a, b = await tenants(stack, "a", "b")
    hostagent = await Principal.open(stack.url_as("hostagent"), "hostagent")
    placement = await Principal.open(stack.url_as("placement"), "placement")
    limits: KV[TenantLimits] = await KV.bind(stack.nc.jetstream(), S.KV_TENANTS, codec.TENANT_LIMITS)
    try:
        await limits.put(a.user, TenantLimits(max_sandboxes=1))
        await eventually(lambda: a.user in stack.placement.quotas.limits, what="placement sees a's quota")
        raised = codec.encode(TenantLimits(max_sandboxes=1000))
        forgotten = codec.encode(TenantUsage(sandboxes={}))
        await a.denied_publish(redteam, f"$KV.{S.KV_TENANTS}.{a.user}", raised, "raise its own quota")
        await a.denied_publish(redteam, f"$KV.{S.KV_TENANTS}.{S.TENANT_DEFAULTS}", raised, "raise the default quotas")
        await a.denied_publish(redteam, f"$JS.API.STREAM.PURGE.KV_{S.KV_TENANTS}", b"{}", "purge every quota")
        await a.denied_publish(redteam, f"$KV.{S.KV_QUOTA}.{a.user}", forgotten, "forget the sandboxes it holds")
        await a.denied_publish(redteam, f"$JS.API.STREAM.PURGE.KV_{S.KV_QUOTA}", b"{}", "purge what every tenant holds")
        await hostagent.denied_publish(redteam, f"$KV.{S.KV_TENANTS}.{a.user}", raised, "(host agent credential) raise a tenant's quota")
        await hostagent.denied_publish(redteam, f"$KV.{S.KV_QUOTA}.{a.user}", forgotten, "(host agent credential) forget what a tenant holds")
        await placement.denied_publish(redteam, f"$KV.{S.KV_TENANTS}.{a.user}", raised, "(placement credential) raise a tenant's quota")
        assert await limits.get(a.user) == TenantLimits(max_sandboxes=1) and await limits.get(S.TENANT_DEFAULTS) is None

        first = await create_as(stack, a)
        with pytest.raises(QuotaExceeded) as ei:
            await create_as(stack, a)
        assert ei.value.code == "quota_exceeded" and ei.value.description == f"tenant {a.user} holds 1 of max 1 sandboxes"
        redteam.blocked(f"tenant a: a 2nd sandbox over its quota [quota_exceeded: {ei.value.description}]")
        await create_as(stack, b)
        await create_as(stack, b)
        redteam.allowed("tenant b (no quota): creates beside it")
        await limits.put(a.user, TenantLimits(max_sandboxes=2))
        await eventually(lambda: stack.placement.quotas.limits[a.user].max_sandboxes == 2, what="placement sees the operator's new quota")
        second = await create_as(stack, a)
        assert (await second.commands.run("echo two")).stdout == "two\n" and first.sandbox_id != second.sandbox_id
        redteam.allowed("operator: raises a's quota, and a creates within it")
    finally:
        for t in (a, b, hostagent, placement):
            await t.close()
