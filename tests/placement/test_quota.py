"""Tenant quotas at create time: real NATS, placement replicas and host agents on the sim backend.

Each tenant is a NATS user (the URL's user name: the SDK creates under ``dsec.req.<user>.create`` and
placement binds the spec to it); its limits are a record in KV ``dsec_tenants`` written as the
operator, as ``dsec api-key create --max-sandboxes N`` does. Every refusal is the typed
``QuotaExceeded`` (code ``quota_exceeded``) naming the limit, and each has a positive control: a
tenant without limits creating at the same time, the same tenant after a kill.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

from bus import codec
from bus import subjects as S
from bus.auth import AuthConfig, with_credentials
from bus.messages import SANDBOX_ENDED, TenantLimits
from bus.natsd import NatsServer
from bus.runtime import KV, connect
from placement import Placement
from sdk import AsyncSandbox
from sdk.errors import QuotaExceeded
from sdk.gateway._keys import parse_key
from tests.integration.conftest import PY, REPO, run_process, subprocess_env

from .conftest import eventually, seed
from .test_flows import agent


def tenant_url(url: str, tenant: str) -> str:
    # The tests' server has no authorization: any user name is accepted, and is the tenant.
    return with_credentials(url, tenant, "x")


async def set_limits(nc, tenant: str, *placements: Placement, **limits) -> None:
    """Write ``tenant``'s limits as the operator; wait until every replica has seen them."""
    kv = await KV.bind(nc.jetstream(), S.KV_TENANTS, codec.TENANT_LIMITS)
    lim = TenantLimits(**limits)
    await kv.put(tenant, lim)
    await eventually(lambda: all(p.quotas.limits.get(tenant) == lim for p in placements), what=f"limits of {tenant} seen by placement")


async def create(url: str, tenant: str, **kw) -> AsyncSandbox:
    return await create_at(tenant_url(url, tenant), **kw)


async def create_at(url: str, **kw) -> AsyncSandbox:
    kw.setdefault("create_timeout", 30)
    return await AsyncSandbox.create("base", backend="sim", nats_url=url, **kw)


async def held(nc, tenant: str) -> set[str]:
    """The sandbox ids ``tenant``'s quota record holds."""
    kv = await KV.bind(nc.jetstream(), S.KV_QUOTA, codec.TENANT_USAGE)
    usage = await kv.get(tenant)
    return set() if usage is None else set(usage.sandboxes)


async def live_of(nc, tenant: str) -> set[str]:
    """Every live sandbox of ``tenant`` by its records in KV ``dsec_sandboxes``."""
    kv = await KV.bind(nc.jetstream(), S.KV_SANDBOXES, codec.SANDBOX_RECORD)
    out = set()
    for k in await kv.keys():
        rec = await kv.get(k)
        if rec is not None and rec.spec.client == tenant and rec.state not in SANDBOX_ENDED:
            out.add(k)
    return out


def tenant_name(tag: str) -> str:
    return f"cli-{tag}{uuid.uuid4().hex[:6]}"


async def test_max_sandboxes_refuses_the_next_and_a_kill_frees_a_place(nats_srv, nc) -> None:
    url = nats_srv.url
    h = agent(url, "q1")
    pl = Placement(url, pending_delay_s=0.1, grace_s=2)
    await h.start()
    await pl.start()
    a, b = tenant_name("a"), tenant_name("b")
    try:
        await set_limits(nc, a, pl, max_sandboxes=3)
        mine = [await create(url, a) for _ in range(3)]
        assert {sb.sandbox_id for sb in mine} == await held(nc, a)

        # The 4th of A fails fast with the typed error naming the limit, while B (no limits) creates
        # five at the same moment.
        fourth = asyncio.ensure_future(create(url, a, sandbox_id=f"sb-{a}-4th"))
        theirs = await asyncio.gather(*(create(url, b) for _ in range(5)))
        with pytest.raises(QuotaExceeded) as ei:
            await fourth
        assert ei.value.code == "quota_exceeded"
        assert ei.value.description == f"tenant {a} holds 3 of max 3 sandboxes"
        assert pl.quotas.refused == 1  # dsec_placement_quota_refused
        assert len({sb.sandbox_id for sb in theirs}) == 5 and await held(nc, b) == set()  # B is not counted at all
        assert await live_of(nc, a) == {sb.sandbox_id for sb in mine}  # nothing started for the refused one

        # A kills one: its place is free for the next create.
        await mine[0].kill()
        again = await create(url, a)
        assert await held(nc, a) == {mine[1].sandbox_id, mine[2].sandbox_id, again.sandbox_id}
        with pytest.raises(QuotaExceeded):
            await create(url, a)
        for sb in [*mine[1:], again, *theirs]:
            await sb.kill()
    finally:
        await pl.shutdown()
        await h.shutdown()


async def test_a_batch_counts_each_member(nats_srv, nc) -> None:
    """A batched create (what a fork sends) is held member by member: a batch that passes the limit
    fails whole with the typed error, and its admitted members, killed by the SDK, free their places."""
    url = nats_srv.url
    h = agent(url, "qbatch")
    pl = Placement(url, pending_delay_s=0.1, grace_s=2)
    await h.start()
    await pl.start()
    a = tenant_name("batch")
    try:
        await set_limits(nc, a, pl, max_sandboxes=3)
        two = await AsyncSandbox.create_batch(2, "base", backend="sim", nats_url=tenant_url(url, a), create_timeout=30)
        with pytest.raises(QuotaExceeded) as ei:
            await AsyncSandbox.create_batch(2, "base", backend="sim", nats_url=tenant_url(url, a), create_timeout=30)
        assert ei.value.description == f"tenant {a} holds 3 of max 3 sandboxes"
        third = await create(url, a)  # the refused batch's admitted member was killed: its place is free
        assert await live_of(nc, a) == {*(sb.sandbox_id for sb in two), third.sandbox_id}
        for sb in [*two, third]:
            await sb.kill()
    finally:
        await pl.shutdown()
        await h.shutdown()


async def test_cpu_and_memory_limits(nats_srv, nc) -> None:
    url = nats_srv.url
    h = agent(url, "q2")
    pl = Placement(url, pending_delay_s=0.1, grace_s=2)
    await h.start()
    await pl.start()
    cpu_t, mem_t, free_t = tenant_name("cpu"), tenant_name("mem"), tenant_name("free")
    try:
        await set_limits(nc, cpu_t, pl, max_cpu=2.0)
        await set_limits(nc, mem_t, pl, max_memory_mb=512)
        c1 = await create(url, cpu_t, cpu=1.5, memory_mb=64)
        with pytest.raises(QuotaExceeded) as ei:
            await create(url, cpu_t, cpu=1.0, memory_mb=64, sandbox_id=f"sb-{cpu_t}-x")
        assert ei.value.code == "quota_exceeded"
        assert ei.value.description == f"tenant {cpu_t} holds 1.5 of max 2 cpu; sb-{cpu_t}-x asks for 1 more"
        c2 = await create(url, cpu_t, cpu=0.5, memory_mb=64)  # exactly up to the limit fits

        m1 = await create(url, mem_t, memory_mb=384, cpu=0.1)
        with pytest.raises(QuotaExceeded) as ei:
            await create(url, mem_t, memory_mb=256, cpu=0.1, sandbox_id=f"sb-{mem_t}-x")
        assert ei.value.description == f"tenant {mem_t} holds 384 of max 512 MB memory; sb-{mem_t}-x asks for 256 more"
        free = await create(url, free_t, cpu=4.0, memory_mb=4096)  # positive control: no limits
        await m1.kill()
        m2 = await create(url, mem_t, memory_mb=512, cpu=0.1)
        for sb in (c1, c2, m2, free):
            await sb.kill()
    finally:
        await pl.shutdown()
        await h.shutdown()


async def test_a_burst_on_two_replicas_admits_exactly_the_limit(nats_srv, nc) -> None:
    """20 concurrent creates against max 5, spread over two placement replicas sharing the consumer:
    exactly 5 sandboxes, 15 typed refusals; a tenant without limits bursting beside it gets all."""
    url = nats_srv.url
    hosts = [agent(url, f"qb{i}") for i in range(2)]
    pls = [Placement(url, pending_delay_s=0.1, grace_s=2, replica_id=f"quota-{i}", capacity=8) for i in range(2)]
    for x in [*hosts, *pls]:
        await x.start()
    a, b = tenant_name("burst"), tenant_name("ctl")
    try:
        await set_limits(nc, a, *pls, max_sandboxes=5)
        outs = await asyncio.gather(*(create(url, a, cpu=0.1, memory_mb=32) for _ in range(20)), return_exceptions=True)
        ok = [o for o in outs if isinstance(o, AsyncSandbox)]
        refused = [o for o in outs if isinstance(o, QuotaExceeded)]
        assert len(ok) == 5 and len(refused) == 15, outs
        assert all(e.description == f"tenant {a} holds 5 of max 5 sandboxes" for e in refused)
        assert await live_of(nc, a) == {sb.sandbox_id for sb in ok} == await held(nc, a)
        ctl = await asyncio.gather(*(create(url, b, cpu=0.1, memory_mb=32) for _ in range(20)))
        assert len(ctl) == 20
        for sb in [*ok, *ctl]:
            await sb.kill()
    finally:
        for x in [*pls, *hosts]:
            await x.shutdown()


async def test_redelivery_and_a_replica_restart_count_a_create_once(nats_srv, nc) -> None:
    """A create that waits (no host yet) is delivered again and again, and to a second replica after
    the first stopped: it holds one place, not one per delivery."""
    url = nats_srv.url
    a = tenant_name("redeliv")
    pl1 = Placement(url, pending_delay_s=0.05, grace_s=2, replica_id="quota-r1")
    await pl1.start()
    pl2 = None
    h = agent(url, "q3")
    try:
        await set_limits(nc, a, pl1, max_sandboxes=2)
        pending: list[str] = []
        first = asyncio.ensure_future(create(url, a, create_timeout=60, on_pending=pending.append, sandbox_id=f"sb-{a}-1"))

        async def redelivered(times: int) -> bool:
            info = await nc.jetstream().consumer_info(S.STREAM_REQ, S.PLACEMENT_DURABLE)
            return info.num_redelivered >= 1 and info.delivered.consumer_seq >= times

        await eventually(lambda: redelivered(5), timeout=20, what="the waiting create delivered 5 times")
        assert pending and await held(nc, a) == {f"sb-{a}-1"}
        await pl1.shutdown()
        pl2 = Placement(url, pending_delay_s=0.05, grace_s=2, replica_id="quota-r2")
        await pl2.start()
        await h.start()
        sb1 = await asyncio.wait_for(first, 30)
        sb2 = await create(url, a)
        assert await held(nc, a) == {sb1.sandbox_id, sb2.sandbox_id}
        with pytest.raises(QuotaExceeded) as ei:
            await create(url, a)
        assert ei.value.description == f"tenant {a} holds 2 of max 2 sandboxes"
        await sb1.kill()
        await sb2.kill()
    finally:
        if pl2 is not None:
            await pl2.shutdown()
        else:
            await pl1.shutdown()
        if h.nc is not None:
            await h.shutdown()


async def test_two_replicas_racing_on_one_tenant_never_over_admit(nats_srv, nc) -> None:
    """The quota records of two replicas (placement's own ``Quotas``, on the real KV), 40 creates
    of one tenant admitted at once, alternately by each: each replica's cached record goes stale
    under the other's writes; exactly the limit is held, and admitting the same ids again (a
    redelivery) changes nothing."""
    from placement._quota import Quotas
    from sdk import build_spec

    js = nc.jetstream()
    kv_sbx = await KV.bind(js, S.KV_SANDBOXES, codec.SANDBOX_RECORD)
    qs = [Quotas(), Quotas()]
    for q in qs:
        await q.start(js, kv_sbx)
    a = tenant_name("race")
    lim = TenantLimits(max_sandboxes=7, max_memory_mb=7 * 64)
    specs = [build_spec("base", sandbox_id=f"sb-{a}-{i}", memory_mb=64) for i in range(40)]
    outs = await asyncio.gather(*(qs[i % 2].admit(a, lim, [s]) for i, s in enumerate(specs)))
    admitted = {s.sandbox_id for s, out in zip(specs, outs, strict=True) if not out}
    assert len(admitted) == 7 and await held(nc, a) == admitted
    assert all(out[s.sandbox_id].description == f"tenant {a} holds 7 of max 7 sandboxes" for s, out in zip(specs, outs, strict=True) if out)
    again = await asyncio.gather(*(q.admit(a, lim, [s for s in specs if s.sandbox_id in admitted]) for q in qs))
    assert again == [{}, {}] and await held(nc, a) == admitted


# ------------------------------------------------------------------------------ the command line
@pytest.fixture
def authed():
    """NATS with the users and permissions `dsec up` configures (bus.auth), on a data dir of its own."""
    d = Path(tempfile.mkdtemp(prefix="dsec-quota-"))
    auth = AuthConfig.load_or_create(d / "auth.json")
    srv = NatsServer(d / "nats", port=0, extra_config=auth.config_block())
    srv.start()
    yield srv, auth, d
    srv.stop()
    shutil.rmtree(d, ignore_errors=True)


async def reload_users(srv: NatsServer, auth_file: Path, stop: asyncio.Event) -> None:
    """What `dsec up` does while it runs: the server loads the users `dsec api-key` writes."""
    seen = auth_file.stat().st_mtime_ns
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), 0.05)
        except asyncio.TimeoutError:
            pass
        now = auth_file.stat().st_mtime_ns
        if now != seen:
            seen = now
            await asyncio.to_thread(srv.reload, AuthConfig.load_or_create(auth_file).config_block())


async def test_api_key_quotas_from_the_command_line(authed) -> None:
    """`dsec api-key create NAME --max-sandboxes 2 ...` (a process of its own, as the operator): `ls`
    shows the quotas, placement (as its NATS role) enforces them on the key's creates, and `dsec
    api-key limits` changes them while it runs."""
    srv, auth, d = authed
    env = subprocess_env(auth.url_for("admin", srv.url), DSEC_CONTEXT=str(d / "no-context.json"))

    async def dsec(*args: str) -> tuple[int, str, str]:
        return await run_process(PY, "-m", "sdk.cli", "api-key", *args, "--data-dir", str(d), env=env, timeout=120, cwd=str(REPO))

    admin = await connect(auth.url_for("admin", srv.url), name="test-admin")
    await seed(admin.jetstream())
    await admin.close()
    stop = asyncio.Event()
    reloads = asyncio.ensure_future(reload_users(srv, d / "auth.json", stop))
    pl = Placement(auth.url_for("placement", srv.url), pending_delay_s=0.1, grace_s=2)
    h = agent(auth.url_for("hostagent", srv.url), "qcli")
    await pl.start()
    await h.start()
    try:
        rc, key, err = await dsec("create", "capped", "--max-sandboxes", "2", "--max-memory-mb", "1024")
        assert rc == 0, err
        rc, free_key, err = await dsec("create", "free")
        assert rc == 0, err
        user, password = parse_key(key.strip())
        rc, out, err = await dsec("ls", "--json")
        assert rc == 0, err
        keys = {k["name"]: k for k in json.loads(out)}
        assert keys["capped"]["user"] == user and keys["capped"]["limits"] == {"max_sandboxes": 2, "max_cpu": 0.0, "max_memory_mb": 1024}
        assert keys["free"]["limits"] is None
        rc, out, err = await dsec("ls")
        assert rc == 0 and "sandboxes<=2 memory_mb<=1024" in out and "defaults" in out, (out, err)
        await eventually(lambda: user in pl.quotas.limits, what="placement sees the key's quotas")

        url = with_credentials(srv.url, user, password)
        mine = [await create_at(url, memory_mb=64) for _ in range(2)]
        with pytest.raises(QuotaExceeded) as ei:
            await create_at(url, memory_mb=64)
        assert ei.value.code == "quota_exceeded" and ei.value.description == f"tenant {user} holds 2 of max 2 sandboxes"
        free = [await create_at(with_credentials(srv.url, *parse_key(free_key.strip())), memory_mb=64) for _ in range(3)]  # positive control
        # The HTTP gateway (E2B and /v1) answers the key with the error's status: 429, the limit named.
        from aiohttp.test_utils import TestClient, TestServer

        from sdk.gateway import GatewayConfig, make_app

        async with TestClient(TestServer(make_app(GatewayConfig(nats_url=srv.url)))) as http:
            r = await http.post("/sandboxes", json={"templateID": "base"}, headers={"X-API-Key": key.strip()})
            assert r.status == 429 and (await r.json())["message"] == f"tenant {user} holds 2 of max 2 sandboxes"
            r = await http.post("/v1/sandboxes", json={"template": "base"}, headers={"X-API-Key": key.strip()})
            assert r.status == 429 and (await r.json())["code"] == "quota_exceeded"

        rc, _, err = await dsec("limits", "capped", "--max-sandboxes", "3")
        assert rc == 0, err
        await eventually(lambda: pl.quotas.limits[user].max_sandboxes == 3, what="placement sees the raised quota")
        mine.append(await create_at(url, memory_mb=64))
        # Defaults reach the key without quotas of its own, not the capped one's.
        rc, _, err = await dsec("defaults", "--max-sandboxes", "3")
        assert rc == 0, err
        await eventually(lambda: S.TENANT_DEFAULTS in pl.quotas.limits, what="placement sees the defaults")
        with pytest.raises(QuotaExceeded) as ei:
            await create_at(with_credentials(srv.url, *parse_key(free_key.strip())), memory_mb=64)
        assert ei.value.description.endswith("holds 3 of max 3 sandboxes")
        for sb in [*mine, *free]:
            await sb.kill()
    finally:
        stop.set()
        await reloads
        await pl.shutdown()
        await h.shutdown()
        from sdk._async import close_connections

        await close_connections()  # the SDK's connections to this server, which the fixture stops
