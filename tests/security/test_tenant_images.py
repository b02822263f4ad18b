"""Tenants on the image service: a tenant removes only its own snapshots and templates, and builds
only over its own names, from sources it may use.

A real stack with NATS authentication and the image service running as its role (``imaged``),
two tenants each its own client credential. Requests that change templates or snapshots carry the
tenant in their subject (``dsec.img.build.<tenant>`` ...), so nats-server refuses B's request in A's
name or on the operator's bare subject (``Permissions Violation``); under its own name the image
service refuses it typed: another's snapshot is ``unknown_snapshot`` (as one that does not exist),
another's (or a shared) template ``permission_denied`` to remove and ``template_taken`` to build
over. Each has a positive control by the owner, and the operator may do everything.

Snapshot records are written here as a host agent writes them when A's sandbox is snapshotted
(their layers empty: what is checked is whose they are, not their files).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from bus import codec
from bus import subjects as S
from bus.errors import DsecError
from bus.messages import BuildImage, Done, ImageBuilt, RemoveImage, RemoveSnapshot, SnapshotRecord, TemplateManifest
from bus.runtime import KV
from sdk import build_spec
from tests.security.conftest import SKIP_REASON, RedTeam, SecStack, Tenant, tenants

pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")


@pytest.fixture
async def stack(make_stack: Any) -> SecStack:
    return await make_stack(auth=True)


@pytest_asyncio.fixture
async def imaged(stack: SecStack) -> AsyncIterator[Any]:
    from imaged._service import ImagedService

    svc = ImagedService(stack.url_as("imaged"), data_dir=stack.data_dir / "imaged", ensure_base=False, gc_interval_s=0)
    await svc.start()
    try:
        yield svc
    finally:
        await svc.shutdown()


async def _ask(nc: Any, subject: str, req: Any, reply: Any) -> Any:
    return codec.decode_reply((await nc.request(subject, codec.encode(req), timeout=60)).data, reply)


async def _refused(nc: Any, subject: str, req: Any, code: str) -> None:
    """The image service answers ``req`` with the typed error ``code`` (and keeps serving)."""
    with pytest.raises(DsecError) as exc:
        await _ask(nc, subject, req, Done if not isinstance(req, BuildImage) else ImageBuilt)
    assert exc.value.code == code, exc.value


async def _snapshot_of(stack: SecStack, t: Tenant, name: str) -> str:
    """A's snapshot record, as its host agent writes it."""
    sid = f"snap-{stack.uid}-{name}"
    spec = build_spec("base", sandbox_id=f"sb-{stack.uid}-{name}", client=t.user)
    rec = SnapshotRecord(snapshot_id=sid, sandbox_id=spec.sandbox_id, template="base", created_at=time.time(), spec=spec)
    await (await KV.open(stack.nc.jetstream(), S.KV_SNAPSHOTS, SnapshotRecord)).put(sid, rec)
    return sid


async def _snapshot_exists(stack: SecStack, sid: str) -> bool:
    return await (await KV.open(stack.nc.jetstream(), S.KV_SNAPSHOTS, SnapshotRecord)).get(sid) is not None


async def _manifest(stack: SecStack, name: str) -> TemplateManifest | None:
    return await (await KV.open(stack.nc.jetstream(), S.KV_IMAGES, codec.TEMPLATE)).get(name)


async def test_a_tenant_removes_only_its_own_snapshots(stack: SecStack, imaged: Any, redteam: RedTeam) -> None:
    a, b = await tenants(stack, "a", "b")
    try:
        snap = await _snapshot_of(stack, a, "a1")
        req = RemoveSnapshot(snapshot_id=snap)
        await _refused(b.nc, S.snap_remove(b.user), req, "unknown_snapshot")
        redteam.blocked("tenant b: remove A's snapshot under its own tenant [unknown_snapshot]")
        await _refused(b.nc, S.img_build(b.user), BuildImage(name=f"steal-{stack.uid}", base="", from_snapshot=snap), "unknown_snapshot")
        assert await _manifest(stack, f"steal-{stack.uid}") is None
        redteam.blocked("tenant b: a template of A's snapshot (its files) [unknown_snapshot]")
        await b.denied_publish(redteam, S.snap_remove(a.user), codec.encode(req), "remove A's snapshot in A's name")
        await b.denied_publish(redteam, S.SNAP_REMOVE, codec.encode(req), "remove A's snapshot on the operator's subject")
        assert await _snapshot_exists(stack, snap)

        # Positive controls: A builds a template of it and removes it; the operator removes any.
        built = await _ask(a.nc, S.img_build(a.user), BuildImage(name=f"mine-{stack.uid}", base="", from_snapshot=snap), ImageBuilt)
        assert built.manifest.owner == a.user
        await _ask(a.nc, S.img_remove(a.user), RemoveImage(name=f"mine-{stack.uid}"), Done)
        await _ask(a.nc, S.snap_remove(a.user), req, Done)
        assert not await _snapshot_exists(stack, snap)
        redteam.allowed("tenant a: a template of its own snapshot; remove its snapshot")
        other = await _snapshot_of(stack, b, "b1")
        await _ask(stack.nc, S.SNAP_REMOVE, RemoveSnapshot(snapshot_id=other), Done)
        assert not await _snapshot_exists(stack, other)
        redteam.allowed("operator: remove a tenant's snapshot")
        assert a.no_violations(), a.errs
    finally:
        for t in (a, b):
            await t.close()


async def test_a_tenant_builds_and_removes_only_its_own_templates(stack: SecStack, imaged: Any, redteam: RedTeam) -> None:
    """``base`` is shared (the operator's); A's template is A's. B can neither build over nor remove
    either, nor build from A's template or from paths on the image service's machine."""
    a, b = await tenants(stack, "a", "b")
    try:
        name = f"t-a-{stack.uid}"
        built = await _ask(a.nc, S.img_build(a.user), BuildImage(name=name, base="", from_template="base", owner=b.user), ImageBuilt)
        assert built.manifest.owner == a.user  # the subject's tenant, whatever the request says
        again = await _ask(a.nc, S.img_build(a.user), BuildImage(name=name, base="", from_template="base", description="v2"), ImageBuilt)
        assert again.manifest.description == "v2"
        redteam.allowed("tenant a: build and rebuild its own template")

        for target in (name, "base"):
            await _refused(b.nc, S.img_build(b.user), BuildImage(name=target, base="", from_template="base"), "template_taken")
            await _refused(b.nc, S.img_remove(b.user), RemoveImage(name=target), "permission_denied")
        assert (await _manifest(stack, name)).owner == a.user and (await _manifest(stack, "base")).owner == ""
        redteam.blocked("tenant b: build over / remove A's template and the shared base [template_taken / permission_denied]")
        await _refused(b.nc, S.img_build(b.user), BuildImage(name=f"t-b-{stack.uid}", base="", from_template=name), "unknown_template")
        redteam.blocked("tenant b: a template of A's template [unknown_template]")
        await _refused(b.nc, S.img_build(b.user), BuildImage(name=f"t-b-{stack.uid}", base="/etc"), "permission_denied")
        redteam.blocked("tenant b: a template of a path on the image service's machine [permission_denied]")
        await _refused(b.nc, S.img_remove(b.user), RemoveImage(name=f"none-{stack.uid}"), "unknown_template")
        await b.denied_publish(redteam, S.img_build(a.user), codec.encode(BuildImage(name=name, base="")), "build in A's name")
        await b.denied_publish(redteam, S.img_remove(a.user), codec.encode(RemoveImage(name=name)), "remove in A's name")
        await b.denied_publish(redteam, S.IMG_BUILD, codec.encode(BuildImage(name="base", base="/")), "build on the operator's subject")
        await b.denied_publish(redteam, S.IMG_REMOVE, codec.encode(RemoveImage(name="base")), "remove on the operator's subject")
        assert await _manifest(stack, name) is not None and await _manifest(stack, "base") is not None

        # Positive controls: B's own template; A removes its own; the operator removes B's.
        mine = await _ask(b.nc, S.img_build(b.user), BuildImage(name=f"t-b-{stack.uid}", base="", from_template="base"), ImageBuilt)
        assert mine.manifest.owner == b.user
        await _ask(a.nc, S.img_remove(a.user), RemoveImage(name=name), Done)
        assert await _manifest(stack, name) is None
        await _ask(stack.nc, S.IMG_REMOVE, RemoveImage(name=f"t-b-{stack.uid}"), Done)
        assert await _manifest(stack, f"t-b-{stack.uid}") is None
        redteam.allowed("tenant b: its own template; tenant a: remove its own; operator: remove a tenant's")
        assert a.no_violations(), a.errs
    finally:
        for t in (a, b):
            await t.close()
