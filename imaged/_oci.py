"""Templates from images in a registry: each OCI layer becomes one EROFS layer in the chunk store,
and the image config (env, workdir, user, entrypoint, cmd) becomes the template's defaults.

A converted layer is keyed by its OCI digest (``oci/<hex>`` in the blob store names the EROFS
layer), so a layer two images share is fetched from the registry and stored once: the second pull
finds the record and does not download the blob at all. Each OCI layer is applied alone onto an
empty tree, its whiteouts turned into overlayfs whiteouts, so the host agent's overlay of the
layers shows exactly what the image shows.
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Awaitable, Callable
from typing import Any

from msgspec import structs

from bus.errors import ImageError
from bus.messages import ImageDefaults, LayerRef, TemplateManifest

from ._build import BuildResult, ImageBuilder, LayerBuild
from ._gc import guard_reuse
from ._manifests import check_name, get_manifest, publish_event, put_manifest
from ._quota import check_pull, check_template_quota
from ._registry import ImageRef, Manifest, Registry, parse_ref
from ._sources import apply_tar
from ._store import chunk_key, layer_key

_SUPPORTED = ("tar", "tar+gzip", "tar.gzip")  # zstd is not read by the extractor


def oci_key(oci_digest: str) -> str:
    return f"oci/{oci_digest.split(':', 1)[-1]}"


@dataclass
class PulledImage:
    ref: ImageRef
    manifest: Manifest
    layers: list[LayerBuild]
    fetched: list[str]  # OCI digests downloaded by this pull (the others were converted before)

    @property
    def pinned(self) -> str:
        return f"{self.ref.registry}/{self.ref.repository}@{self.manifest.digest}"


def image_defaults(config: dict[str, Any], source: str) -> ImageDefaults:
    """The template defaults an image config asks for (``config.config`` of the OCI image spec)."""
    c = config.get("config") or {}
    env: dict[str, str] = {}
    for item in c.get("Env") or []:
        if isinstance(item, str) and "=" in item:
            k, _, v = item.partition("=")
            env[k] = v
    return ImageDefaults(
        env=env,
        workdir=str(c.get("WorkingDir") or ""),
        user=str(c.get("User") or ""),
        entrypoint=[str(x) for x in c.get("Entrypoint") or []],
        cmd=[str(x) for x in c.get("Cmd") or []],
        source=source,
    )


def _check_media_type(desc: dict[str, Any], ref: ImageRef) -> None:
    mt = str(desc.get("mediaType") or "")
    if "nondistributable" in mt or "foreign" in mt:
        raise ImageError(f"{ref}: foreign layer {desc.get('digest')} is not supported", ref=str(ref))
    if not any(mt.endswith(s) for s in _SUPPORTED):
        raise ImageError(f"{ref}: layer {desc.get('digest')} has an unsupported media type {mt!r}", ref=str(ref))


async def _known_layer(builder: ImageBuilder, oci_digest: str) -> LayerRef | None:
    """The EROFS layer an OCI layer was converted to before, if its record and layer are still stored."""
    try:
        erofs = (await builder.store.get(oci_key(oci_digest))).decode()
    except ImageError:  # BlobNotFound
        return None
    ref = await builder.store.get_layer(erofs)
    if ref is None or ref.digest != erofs:
        return None
    if builder.js is not None:
        # Reused without an upload: pinned against a collection first, then checked whole (a collection
        # that ran before the pin may have taken a chunk: then the layer is converted again).
        keys = [layer_key(erofs), *(chunk_key(c) for c in ref.chunks)]
        await guard_reuse(builder.js, erofs, keys)
        if not all([await builder.store.exists(k) for k in keys]):
            return None
    return ref


async def _convert(builder: ImageBuilder, reg: Registry, ref: ImageRef, desc: dict[str, Any]) -> LayerBuild:
    digest = str(desc["digest"])
    work = Path(tempfile.mkdtemp(prefix="oci-", dir=builder.tmp_dir))
    try:
        blob = work / "layer.tar"
        size = int(desc.get("size") or 0)
        builder.progress(f"pull {digest[7:19]}", 0, size)
        got = await reg.fetch_blob(ref, digest, blob)
        builder.progress(f"pull {digest[7:19]}", got, got)
        tree = work / "rootfs"
        tree.mkdir(mode=0o755)
        await asyncio.to_thread(apply_tar, blob, tree, overlay_whiteouts=True)
        blob.unlink()
        lb = await builder.pack_dir(tree, role="base")
    finally:
        await asyncio.to_thread(shutil.rmtree, work, True)
    # the record last: it says "converted and fully uploaded"
    await builder.store.put(oci_key(digest), lb.ref.digest.encode())
    lb.source = digest
    return lb


async def pull_image(
    builder: ImageBuilder, image: str, *, platform: str = "", registry: Registry | None = None,
    before_fetch: Callable[[int], Awaitable[None]] | None = None,
) -> PulledImage:
    """Resolve ``image`` in its registry (or its mirror) and make sure every layer is converted and stored.
    ``before_fetch`` is told the registry's sizes of the layers to fetch (the quota's first look) and may raise."""
    ref = parse_ref(image)
    async with registry or Registry() as reg:
        manifest = await reg.manifest(ref, platform)
        layers: list[LayerBuild] = []
        fetched: list[str] = []
        knowns = [await _known_layer(builder, desc["digest"]) for desc in manifest.layers]
        if before_fetch is not None:
            await before_fetch(sum(int(d.get("size", 0)) for d, k in zip(manifest.layers, knowns, strict=True) if k is None))
        for desc, known in zip(manifest.layers, knowns, strict=True):
            _check_media_type(desc, ref)
            if known is not None:
                local = builder.blob_path(known.digest)
                known = structs.replace(known, role="base", path=str(local) if local.is_file() else "")
                layers.append(LayerBuild(ref=known, source=desc["digest"]))
                continue
            layers.append(await _convert(builder, reg, ref, desc))
            fetched.append(desc["digest"])
    return PulledImage(ref=ref, manifest=manifest, layers=layers, fetched=fetched)


async def build_from_image(
    builder: ImageBuilder, name: str, image: str, *, platform: str = "", description: str = "", registry: Registry | None = None,
    owner: str = "", charge: str = "", max_bytes_per_tenant: int = 0,
) -> tuple[BuildResult, PulledImage]:
    """Template ``name`` = the layers of ``image`` (lowest first, all ``base``) + its config as defaults.
    ``charge``: the tenant that asked for the pull (named in ``pulled_by``; its template bytes are
    checked against ``max_bytes_per_tenant`` before a layer is fetched and before the manifest is
    written: imaged._quota)."""
    check_name(name)
    js = builder.js
    if js is None:
        raise ImageError("building a template needs NATS (the manifest lives in KV)")
    t0 = time.monotonic()

    async def before_fetch(nbytes: int) -> None:
        await check_pull(js, name, charge, nbytes, max_bytes_per_tenant)

    pulled = await pull_image(builder, image, platform=platform, registry=registry, before_fetch=before_fetch if charge else None)
    if not pulled.layers:
        raise ImageError(f"{pulled.ref} has no layers", ref=str(pulled.ref))
    before = await get_manifest(js, name)
    pulled_by = set(before.pulled_by) if before is not None and before.owner == owner else set()  # charges stay while the entry does
    manifest = TemplateManifest(
        name=name,
        layers=[lb.ref for lb in pulled.layers],
        created_at=time.time(),
        description=description or str(pulled.ref),
        defaults=image_defaults(pulled.manifest.config, pulled.pinned),
        owner=owner,
        pulled_by=sorted(pulled_by | ({charge} if charge else set())),
    )
    if charge:
        await check_template_quota(js, manifest, max_bytes_per_tenant, tenant=charge)
    await put_manifest(js, manifest)
    result = BuildResult(manifest=manifest, layers=pulled.layers, seconds=time.monotonic() - t0)
    await publish_event(
        builder.js, name, "built", image=pulled.pinned, fetched=str(len(pulled.fetched)), uploaded_bytes=str(result.uploaded_bytes),
        layers=hashlib.sha256(",".join(lb.ref.digest for lb in pulled.layers).encode()).hexdigest()[:16],
    )
    return result, pulled
