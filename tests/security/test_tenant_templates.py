"""Tenants and templates: a tenant's private template starts sandboxes for that tenant only.

A real stack with NATS authentication and two tenants. A's template (``TemplateManifest.owner`` is
A, as the image service writes it for a build with A's credential) names the same layers as the
shared ``base``. B names it in a create: through the SDK, and with a raw nats-py create request
crafted by hand. Placement refuses it before placing (``permission_denied``, told B's inbox); a
hand-off that reaches the host agent anyway (signed as placement signs, sent past placement) is
refused there too, logged as a ``control-plane`` violation, and never starts. Positive controls: A
creates from its template, the operator does too, and B creates from the shared ``base``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from bus import codec
from bus import subjects as S
from bus.errors import PermissionDenied
from bus.messages import CreateSandbox, PlaceSandbox, SandboxEvent, TemplateManifest
from bus.runtime import KV
from bus.sign import sign_headers
from sdk import AsyncSandbox, build_spec
from tests.conftest import eventually
from tests.security.conftest import SKIP_REASON, RedTeam, SecStack, Tenant, tenants
from tests.security.test_tenants import create_as, violations

pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")


@pytest.fixture
async def stack(make_stack: Any) -> SecStack:
    return await make_stack(auth=True)


async def private_template(stack: SecStack, owner: Tenant) -> str:
    """A template of ``owner``'s (base's layers), seen by placement."""
    kv: KV[TemplateManifest] = await KV.open(stack.nc.jetstream(), S.KV_IMAGES, codec.TEMPLATE)
    base = await kv.get("base")
    assert base is not None
    name = f"priv-{owner.short}-{stack.uid}"
    await kv.put(name, TemplateManifest(name=name, layers=base.layers, created_at=time.time(), owner=owner.user))
    await eventually(lambda: stack.placement.templates.get(name) is not None, timeout=15, what="placement to see the template")
    return name


async def _replies(t: Tenant) -> tuple[str, list[SandboxEvent]]:
    """An inbox of ``t``'s where its creates' outcomes arrive."""
    got: list[SandboxEvent] = []

    async def cb(m: Any) -> None:
        e = codec.CREATE_REPLY.decode(m.data)
        if isinstance(e, SandboxEvent):
            got.append(e)

    inbox = t.nc.new_inbox()
    await t.nc.subscribe(inbox, cb=cb)
    await t.nc.flush()
    return inbox, got


async def test_a_private_template_is_refused_to_another_tenant(stack: SecStack, redteam: RedTeam) -> None:
    a, b = await tenants(stack, "a", "b")
    try:
        name = await private_template(stack, a)

        # SDK: B's create naming A's template fails typed, from placement.
        sid = f"sb-{stack.uid}-b-{uuid.uuid4().hex[:6]}"
        with pytest.raises(PermissionDenied) as exc:
            await create_as(stack, b, template=name, sandbox_id=sid, create_timeout=60)
        assert exc.value.code == "permission_denied" and name in exc.value.description, exc.value
        assert sid not in stack.host.live and sid not in stack.host.handles
        redteam.blocked("tenant b: SDK create from A's private template [permission_denied, placement]")

        # Raw nats-py: a create request crafted by hand under B's own subject.
        inbox, got = await _replies(b)
        raw = build_spec(name, sandbox_id=f"sb-{stack.uid}-raw-{uuid.uuid4().hex[:6]}", client=a.user)
        raw.reply_to = inbox
        await b.nc.jetstream().publish(S.req_create(b.user), codec.encode(CreateSandbox(spec=raw)), headers={S.HDR_MSG_ID: raw.sandbox_id})
        await eventually(lambda: any(e.sandbox_id == raw.sandbox_id for e in got), timeout=30, what="placement's answer")
        e = next(e for e in got if e.sandbox_id == raw.sandbox_id)
        assert e.kind == "failed" and e.code == "permission_denied" and not e.host_id, e
        assert raw.sandbox_id not in stack.host.handles
        redteam.blocked("tenant b: raw create request from A's private template (spec naming A as client) [permission_denied, placement]")
        await b.denied_publish(redteam, S.req_create(a.user), codec.encode(CreateSandbox(spec=raw)), "create from A's template in A's name")

        # Past placement: a hand-off signed as placement signs it reaches the host agent, which refuses it too.
        late = build_spec(name, sandbox_id=f"sb-{stack.uid}-ho-{uuid.uuid4().hex[:6]}", client=b.user)
        data = codec.encode(PlaceSandbox(spec=late, host_id=stack.host_id, placed_by="test", placed_at=time.time()))
        hdr = sign_headers(stack.control_key, S.host_create(stack.host_id), data)
        answer = await stack.nc.request(S.host_create(stack.host_id), data, headers=hdr, timeout=60)
        assert codec.HANDOFF_REPLY.decode(answer.data).state == "done"  # taken: its outcome (failed) is stored
        assert late.sandbox_id not in stack.host.handles

        async def refused_at_host() -> bool:
            vs = await violations(stack, late.sandbox_id)
            return any(v["detail"].get("template") == name and v["detail"]["tenant"] == b.user for v in vs)

        await eventually(refused_at_host, timeout=20, what="the host agent's control-plane violation")
        records = await KV.open(stack.nc.jetstream(), S.KV_SANDBOXES, codec.SANDBOX_RECORD)
        rec = await records.get(late.sandbox_id)
        assert rec is None or (rec.end_reason == "permission_denied" and not rec.ready_at), rec  # the failure's record: it never ran
        redteam.blocked("hand-off past placement from A's private template for B [permission_denied at the host, violation logged]")

        # Positive controls: A (the owner) and the operator create from it; B from the shared base.
        sa = await create_as(stack, a, template=name)
        assert (await sa.commands.run("echo a")).stdout == "a\n"
        op = await AsyncSandbox.create(name, sandbox_id=f"sb-{stack.uid}-op-{uuid.uuid4().hex[:6]}", nats_url=stack.url_as("admin"))
        stack.sandboxes.append(op)
        assert (await op.commands.run("echo op")).stdout == "op\n"
        sb = await create_as(stack, b, template="base")
        assert (await sb.commands.run("echo b")).stdout == "b\n"
        redteam.allowed("tenant a and the operator: create from A's template; tenant b: create from the shared base")
        assert a.no_violations(), a.errs
    finally:
        for t in (a, b):
            await t.close()

