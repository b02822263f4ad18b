"""Tenants and FnCall pools: the pool of a tenant's private template serves that tenant and the
operator only (issue 18's gap in issue 19's pools).

A real stack with NATS authentication, two tenants, and a host agent keeping fn pools of the shared
``base`` and of A's private template (``TemplateManifest.owner`` is A; base's layers). A call names
its caller's tenant in its subject (``dsec.fn.<tenant>.<template>.call``):

* nats-server refuses B a call published under A's tenant or the operator's (its permission
  violation for exactly that subject);
* the host agent refuses B's call under B's own tenant on A's pool, through the SDK and as a raw
  nats-py request, with a typed ``permission_denied`` and a ``control-plane`` violation; the pool
  runs nothing of B's.

Positive controls: A (the owner) and the operator call A's pool, raw and through the SDK; B calls
the shared ``base`` pool.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from bus import codec
from bus import subjects as S
from bus.codec import decode_reply
from bus.errors import PermissionDenied
from bus.messages import FnCallRequest, FnCallResult, TemplateManifest
from bus.runtime import KV
from sdk import AsyncFnCall
from tests.conftest import eventually
from tests.security.conftest import SKIP_REASON, RedTeam, SecStack, tenants
from tests.security.test_tenants import violations

pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")

PRIVATE = f"fnpriv{uuid.uuid4().hex[:8]}"  # A's template: named before the stack starts (its host agent keeps a pool of it)


@pytest.fixture
async def stack(make_stack: Any) -> SecStack:
    return await make_stack(auth=True, fn_pools=f"base=1,{PRIVATE}=1")


async def _raw_call(nc: Any, template: str, tenant: str, cmd: str) -> FnCallResult:
    """A call as a hand-written nats-py request (``decode_reply`` raises the host's typed error)."""
    msg = await nc.request(S.fn_call(template, tenant), codec.encode(FnCallRequest(cmd=cmd, timeout_s=30, queue_s=60)), timeout=120)
    out: FnCallResult = decode_reply(msg.data, FnCallResult)
    return out


async def test_a_private_templates_pool_serves_its_owner_and_the_operator_only(stack: SecStack, redteam: RedTeam) -> None:
    a, b = await tenants(stack, "a", "b")
    try:
        kv: KV[TemplateManifest] = await KV.open(stack.nc.jetstream(), S.KV_IMAGES, codec.TEMPLATE)
        base = await kv.get("base")
        assert base is not None
        await kv.put(PRIVATE, TemplateManifest(name=PRIVATE, layers=base.layers, created_at=time.time(), owner=a.user))
        pools = stack.host.fncalls.pools
        # (members of the private pool failed to start until its manifest was there: the pool retries)
        await eventually(lambda: pools[PRIVATE].idle and pools["base"].idle, timeout=180, what="both fn pools to have a member")

        # Positive controls first: the owner, raw and through the SDK; the operator; B on the shared pool.
        r = await _raw_call(a.nc, PRIVATE, a.user, "echo a-raw")
        assert r.run is not None and r.run.stdout == b"a-raw\n", r
        ra = await AsyncFnCall(nats_url=a.url, queue_timeout=60).run("echo a", template=PRIVATE)
        assert (ra.stdout, ra.exit_code) == ("a\n", 0), ra
        rop = await AsyncFnCall(nats_url=stack.url_as("admin"), queue_timeout=60).run("echo op", template=PRIVATE)
        assert (rop.stdout, rop.exit_code) == ("op\n", 0), rop
        rb = await AsyncFnCall(nats_url=b.url, queue_timeout=60).run("echo b", template="base")
        assert (rb.stdout, rb.exit_code) == ("b\n", 0), rb
        r = await _raw_call(b.nc, "base", b.user, "echo b-raw")
        assert r.run is not None and r.run.stdout == b"b-raw\n", r
        redteam.allowed("tenant a and the operator: calls of A's private pool; tenant b: calls of the shared base pool")

        served = pools[PRIVATE].served
        # SDK: B's call of A's pool is refused by the host, typed.
        with pytest.raises(PermissionDenied) as exc:
            await AsyncFnCall(nats_url=b.url, queue_timeout=60).run("echo stolen", template=PRIVATE)
        assert exc.value.code == "permission_denied" and PRIVATE in exc.value.description, exc.value
        redteam.blocked("tenant b: SDK call of A's private template's pool [permission_denied, host agent]")

        # Raw nats-py under B's own tenant: the same refusal.
        with pytest.raises(PermissionDenied) as exc:
            await _raw_call(b.nc, PRIVATE, b.user, "echo stolen-raw")
        assert exc.value.code == "permission_denied", exc.value
        redteam.blocked("tenant b: raw fn call request of A's private pool under B's tenant [permission_denied, host agent]")

        async def logged() -> bool:
            vs = await violations(stack, f"fn-{PRIVATE}")
            return sum(1 for v in vs if v["detail"].get("tenant") == b.user and v["detail"].get("op") == "fn_call") >= 2

        await eventually(logged, timeout=20, what="the host agent's control-plane violations for B's calls")

        # Raw nats-py under A's tenant, the operator's, or every tenant's: the server refuses the publish.
        req = codec.encode(FnCallRequest(cmd="echo stolen", timeout_s=30, queue_s=60))
        await b.denied_publish(redteam, S.fn_call(PRIVATE, a.user), req, "fn call of A's pool in A's name")
        await b.denied_publish(redteam, S.fn_call(PRIVATE, S.OPERATOR_TENANT), req, "fn call of A's pool as the operator's tenant")
        await b.denied_publish(redteam, S.fn_call("base", a.user), req, "fn call of the shared pool in A's name")
        # Nothing of B's ran in A's pool (the refusals came before a member was taken).
        assert pools[PRIVATE].served == served, (pools[PRIVATE].served, served)
        assert a.no_violations(), a.errs
    finally:
        for t in (a, b):
            await t.close()
