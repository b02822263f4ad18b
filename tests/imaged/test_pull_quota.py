"""Registry pulls are charged to the tenant that asked (imaged._quota): a ``FROM <image>`` pull into the
shared pull cache, or ``dsec image build --from REF`` under a tenant's subject, counts the pulled
image's layers against that tenant's template bytes, once per layer; the blob store holds each layer
once whoever pulled it. A pull that would pass the limit is ``quota_exceeded`` naming it: before any
layer is fetched when the registry's sizes already say so, else before the manifest is written.

A real registry (Debian's docker-registry, tests/registry.py), the image service on the session's
NATS, requests on ``dsec.img.build.<tenant>`` as the SDK's Dockerfile builder and the CLI send them.
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import time
from pathlib import Path
from typing import Any

import nats.errors
import pytest

from bus import codec
from bus import subjects as S
from bus.errors import QuotaExceeded
from bus.messages import BuildImage, ImageBuilt, TemplateManifest
from imaged._manifests import get_manifest, list_manifests
from imaged._quota import LIMIT, owned_bytes
from tests import registry as R
from tests.conftest import needs

from .conftest import needs_erofs

pytestmark = [needs_erofs, needs(R.missing())]


@pytest.fixture(scope="module")
def registry():
    reg = R.LocalRegistry().start()
    yield reg
    reg.close()


@pytest.fixture(scope="module")
def images(registry, tmp_path_factory):
    """Three images over one busybox layer, each with a top layer of its own (``three``'s is big)."""
    d = tmp_path_factory.mktemp("oci")
    shared = R.busybox_layer()
    tops = {
        "one": R.tar_layer({"srv": ("dir",), "srv/one.txt": b"one\n"}),
        "two": R.tar_layer({"srv": ("dir",), "srv/two.txt": b"two\n"}),
        "three": R.tar_layer({"srv": ("dir",), "srv/three.bin": hashlib.sha256(b"3").digest() * 40_000}),
    }
    for name, top in tops.items():
        registry.push(R.oci_layout(d / name, [shared, top]), f"quota/{name}", "v1")
    return {name: "sha256:" + hashlib.sha256(gzip.compress(top, mtime=0)).hexdigest() for name, top in tops.items()}


async def _build(nc: Any, subject: str, req: BuildImage) -> TemplateManifest:
    deadline = time.monotonic() + 10
    while True:  # start() flushes its subscriptions; still, wait (bounded) for the responder to show
        try:
            r = await nc.request(subject, codec.encode(req), timeout=120)
            break
        except nats.errors.NoRespondersError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)  # poll interval
    return codec.decode_reply(r.data, ImageBuilt).manifest


def _pull(ref: str) -> BuildImage:
    """What a Dockerfile's ``FROM <ref>`` asks (sdk._builder): the shared pull cache entry of ``ref``."""
    return BuildImage(name=S.pull_cache_template(ref), base="", from_ref=ref, description=ref)


async def _charged(js: Any, tenant: str) -> int:
    return sum(owned_bytes(await list_manifests(js), tenant)[0].values())


async def test_pulls_are_charged_to_the_tenant_that_asked(nc, js, tmp_path: Path, uid: str, registry, images, nats_server) -> None:
    from imaged._service import ImagedService

    a, b = f"cli-a{uid}", f"cli-b{uid}"
    one, two, three = (f"{registry.host}/quota/{n}:v1" for n in ("one", "two", "three"))
    svc = ImagedService(nats_server.url, data_dir=tmp_path / "svc", ensure_base=False, gc_interval_s=0, template_max_bytes_per_tenant=0)
    await svc.start()
    try:
        # The operator's pull fills the cache and charges nobody; it tells the layers' sizes.
        m_two = await _build(nc, S.IMG_BUILD, _pull(two))
        assert m_two.owner == "" and m_two.pulled_by == []
        shared, two_top = m_two.layers[0].size, m_two.layers[1].size
        assert await _charged(js, a) == 0

        svc.template_max_bytes_per_tenant = 1 << 30  # bounded now; room for what follows
        # A's FROM one: charged the whole image (the shared cache's layers too).
        m_one = await _build(nc, S.img_build(a), _pull(one))
        assert m_one.owner == "" and m_one.pulled_by == [a]
        used_a = shared + m_one.layers[1].size
        assert await _charged(js, a) == used_a
        # Again, and as a template of A's own (--from): the same layers, not charged twice.
        await _build(nc, S.img_build(a), _pull(one))
        own = await _build(nc, S.img_build(a), BuildImage(name=f"a-own-{uid}", base="", from_ref=one))
        assert own.owner == a and own.pulled_by == [a] and [lay.digest for lay in own.layers] == [lay.digest for lay in m_one.layers]
        assert await _charged(js, a) == used_a
        # B pulls the same image: charged to B as well; the registry served each blob once, and both
        # tenants' templates name the same stored layers.
        gets = registry.blob_gets(images["one"])
        m_one_b = await _build(nc, S.img_build(b), _pull(one))
        assert m_one_b.pulled_by == [a, b] and m_one_b.layers == m_one.layers
        assert registry.blob_gets(images["one"]) == gets == 1
        assert await _charged(js, b) == used_a and await _charged(js, a) == used_a

        # A's FROM two: only two's top layer is new to A (the busybox layer is charged already).
        svc.template_max_bytes_per_tenant = used_a + two_top - 1  # one byte short: refused before the manifest
        with pytest.raises(QuotaExceeded) as exc:
            await _build(nc, S.img_build(a), _pull(two))
        err = exc.value
        assert err.code == "quota_exceeded" and err.context["limit"] == LIMIT == "template_bytes_per_tenant", err
        assert err.context["used"] == str(used_a) and err.context["wanted"] == str(two_top), err.context
        assert (await get_manifest(js, m_two.name)).pulled_by == []  # type: ignore[union-attr]
        assert await _charged(js, a) == used_a
        svc.template_max_bytes_per_tenant = used_a + two_top  # just enough: positive control
        assert (await _build(nc, S.img_build(a), _pull(two))).pulled_by == [a]
        assert await _charged(js, a) == used_a + two_top

        # Three's big top layer, never fetched: the registry's size alone refuses it, and nothing is downloaded.
        with pytest.raises(QuotaExceeded) as exc:
            await _build(nc, S.img_build(a), _pull(three))
        assert exc.value.context["limit"] == LIMIT and "pulling" in exc.value.description
        assert registry.blob_gets(images["three"]) == 0
        assert await get_manifest(js, S.pull_cache_template(three)) is None
        # Positive control: the operator (not bounded) pulls it; B (under its limit) is then refused after the pull, typed.
        await _build(nc, S.IMG_BUILD, _pull(three))
        assert registry.blob_gets(images["three"]) == 1
        svc.template_max_bytes_per_tenant = used_a + 1
        with pytest.raises(QuotaExceeded) as exc:
            await _build(nc, S.img_build(b), _pull(three))
        assert exc.value.context["limit"] == LIMIT
        assert (await get_manifest(js, S.pull_cache_template(three))).pulled_by == []  # type: ignore[union-attr]
        assert await _charged(js, b) == used_a
    finally:
        await svc.shutdown()
