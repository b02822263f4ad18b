"""A tenant's templates are bounded in the blob store (``imaged._quota``): a template made from a
snapshot (how Dockerfile and E2B template builds end) that would take its owner past
``template_max_bytes_per_tenant`` is refused, typed, before its manifest is written; layers shared
with other owners' templates (the base) and a template's own earlier layers are not counted."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from bus import codec
from bus import subjects as S
from bus.errors import QuotaExceeded
from bus.messages import LayerRef, SandboxSpec, SnapshotRecord, TemplateManifest
from bus.streams import ensure_kv
from imaged._compose import compose_template
from imaged._manifests import delete_manifest, get_manifest, put_manifest

MB = 1_000_000


def _layer(size: int, role: str = "toolkit") -> LayerRef:
    return LayerRef(role=role, digest=f"sha256:{uuid.uuid4().hex}{uuid.uuid4().hex}", size=size, kind="erofs")


async def _snapshot(js: Any, base: str, *layers: LayerRef) -> str:
    sid = f"snap-{uuid.uuid4().hex[:12]}"
    rec = SnapshotRecord(snapshot_id=sid, sandbox_id="sb-x", template=base, created_at=time.time(), layers=list(layers),
                         spec=SandboxSpec(sandbox_id="sb-x", template=base))
    await (await ensure_kv(js, S.KV_SNAPSHOTS)).put(sid, codec.encode(rec))
    return sid


async def test_template_bytes_per_tenant_refused_before_the_manifest(js: Any) -> None:
    tag = uuid.uuid4().hex[:6]
    base = f"base-q-{tag}"
    await put_manifest(js, TemplateManifest(name=base, layers=[_layer(50 * MB, "base")]))  # the operator's: not charged
    a, b = _layer(3 * MB), _layer(3 * MB)
    s1, s2 = await _snapshot(js, base, a), await _snapshot(js, base, a, b)
    limit = 5 * MB

    async def build(name: str, snap: str, owner: str = "alice") -> TemplateManifest:
        return (await compose_template(js, name, snapshot=snap, owner=owner, max_bytes_per_owner=limit)).manifest

    # Positive control: 3 MB of alice's 5 (the base's 50 MB are the operator's).
    t1 = await build(f"t1-{tag}", s1)
    assert [lay.digest for lay in t1.layers][-1] == a.digest
    # The same layer again is not charged twice.
    await build(f"t1b-{tag}", s1)
    # a and b: 6 MB of 5, refused with the limit named, and no manifest written.
    with pytest.raises(QuotaExceeded, match=r"per-tenant template limit of 5000000 bytes") as ei:
        await build(f"t2-{tag}", s2)
    assert ei.value.code == "quota_exceeded" and ei.value.context["limit"] == "template_bytes_per_tenant"
    assert ei.value.context["used"] == str(3 * MB) and ei.value.context["wanted"] == str(3 * MB)
    assert await get_manifest(js, f"t2-{tag}") is None
    # Another tenant is not charged for alice's templates.
    await build(f"tb-{tag}", await _snapshot(js, base, _layer(4 * MB)), owner="bob")
    # The operator's builds are not bounded here.
    await compose_template(js, f"to-{tag}", snapshot=await _snapshot(js, base, _layer(10 * MB)), max_bytes_per_owner=limit)
    # A rebuild of a template replaces its own layers: 4.5 MB fit in place of t1's 3 (t1b gone), not beside them.
    assert await delete_manifest(js, f"t1b-{tag}")
    s5 = await _snapshot(js, base, _layer(4_500_000))
    with pytest.raises(QuotaExceeded):
        await build(f"t4-{tag}", s5)
    t1 = await build(f"t1-{tag}", s5)
    assert t1.layers[-1].size == 4_500_000


async def test_the_image_service_answers_a_build_over_the_limit_with_quota_exceeded(nats_server: Any, nc: Any, js: Any, tmp_path: Any) -> None:
    from bus.messages import BuildImage, ImageBuilt
    from imaged._service import ImagedService

    tag = uuid.uuid4().hex[:6]
    base = f"base-q-{tag}"
    await put_manifest(js, TemplateManifest(name=base, layers=[_layer(50 * MB, "base")]))
    svc = ImagedService(nats_server.url, data_dir=tmp_path, ensure_base=False, gc_interval_s=0, template_max_bytes_per_tenant=5 * MB)
    await svc.start()
    try:
        async def build(name: str, size: int) -> Any:
            req = BuildImage(name=name, base="", from_snapshot=await _snapshot(js, base, _layer(size)), owner="carol")
            return codec.decode_reply((await nc.request(S.IMG_BUILD, codec.encode(req), timeout=30)).data, ImageBuilt)

        assert (await build(f"c1-{tag}", 4 * MB)).manifest.owner == "carol"  # just under
        with pytest.raises(QuotaExceeded, match="template_bytes_per_tenant|per-tenant template limit"):
            await build(f"c2-{tag}", 2 * MB)
        assert await get_manifest(js, f"c2-{tag}") is None
        assert (await build(f"c3-{tag}", 1 * MB)).manifest.name == f"c3-{tag}"  # the service runs on; exactly at the limit
    finally:
        await svc.shutdown()
