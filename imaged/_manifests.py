"""Template manifests in KV ``dsec_images`` (key = template name) and layer look-ups."""

from __future__ import annotations

import re
import time
from typing import Any

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from bus import codec
from bus import subjects as S
from bus.errors import BadRequest, BlobStoreUnavailable, ImageError, InvalidArgument, UnknownTemplate
from bus.messages import ImageEvent, ImageEventKind, LayerRef, TemplateManifest
from bus.runtime import best_effort_event, kv_keys
from bus.streams import ensure_kv

from ._store import BlobStore
from ._util import digest_hex, full_digest

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,128}\Z")
ROLES = ("base", "workspace", "toolkit")


def check_name(name: str) -> str:
    """Template names are subject tokens (events are published under them) and KV keys."""
    if not _NAME.match(name or ""):
        raise InvalidArgument(f"bad template name {name!r}: use letters, digits, '-' and '_' (max 128)")
    return name


async def images_kv(js: JetStreamContext) -> KeyValue:
    return await ensure_kv(js, S.KV_IMAGES)


async def get_manifest(js: JetStreamContext, name: str) -> TemplateManifest | None:
    kv = await images_kv(js)
    try:
        entry = await kv.get(check_name(name))
    except KeyNotFoundError:
        return None
    if not entry.value:
        return None
    try:
        m: TemplateManifest = codec.TEMPLATE.decode(entry.value)
        return m
    except BadRequest:
        return None


async def require_manifest(js: JetStreamContext, name: str) -> TemplateManifest:
    m = await get_manifest(js, name)
    if m is None:
        raise UnknownTemplate(f"no template named {name!r}", template=name)
    return m


async def put_manifest(js: JetStreamContext, manifest: TemplateManifest) -> None:
    check_name(manifest.name)
    for layer in manifest.layers:
        if layer.role not in ROLES:
            raise InvalidArgument(f"bad layer role {layer.role!r}")
        full_digest(layer.digest)
    kv = await images_kv(js)
    await kv.put(manifest.name, codec.encode(manifest))


async def list_manifests(js: JetStreamContext) -> list[TemplateManifest]:
    await images_kv(js)
    out = []
    for k in await kv_keys(js, S.KV_IMAGES):
        m = await get_manifest(js, k)
        if m is not None:
            out.append(m)
    return out


async def delete_manifest(js: JetStreamContext, name: str) -> bool:
    kv = await images_kv(js)
    if await get_manifest(js, name) is None:
        return False
    await kv.delete(check_name(name))
    return True


async def find_layer(js: JetStreamContext | None, store: BlobStore | None, digest: str) -> tuple[LayerRef | None, list[str]]:
    """The layer's metadata (chunk list) by digest: the store's layer record first, else a scan of the
    manifests. Returns (layer or None, names of templates seen using it - only filled by the scan)."""
    hexd = digest_hex(digest)
    away: BlobStoreUnavailable | None = None
    if store is not None:
        try:
            ref = await store.get_layer(hexd)
        except BlobStoreUnavailable as exc:  # a template's layer is in its manifest too
            ref, away = None, exc
        if ref is not None:
            return ref, []
    if js is None:
        if away is not None:
            raise away
        return None, []
    found: LayerRef | None = None
    users: list[str] = []
    for m in await list_manifests(js):
        for layer in m.layers:
            if digest_hex(layer.digest) == hexd:
                users.append(m.name)
                if found is None and layer.chunks:
                    found = layer
    if found is None and away is not None:
        raise away  # not "no such layer": the store that may hold its record is away
    return found, users


async def publish_event(js: JetStreamContext | None, name: str, kind: ImageEventKind, **detail: str) -> None:
    """Publish an ImageEvent on dsec.evt.image.<name>.<kind> (best effort: events never fail the work)."""
    if js is None:
        return
    ev = ImageEvent(name=name, kind=kind, at=time.time(), detail={k: str(v) for k, v in detail.items()})
    await best_effort_event(js, S.evt_image(name, kind), ev)


def layer_summary(layer: LayerRef) -> dict[str, Any]:
    return {"role": layer.role, "digest": layer.digest, "size": layer.size}


def manifest_size(m: TemplateManifest) -> int:
    return sum(layer.size for layer in m.layers)


__all__ = [
    "ROLES",
    "check_name",
    "get_manifest",
    "require_manifest",
    "put_manifest",
    "list_manifests",
    "delete_manifest",
    "find_layer",
    "publish_event",
    "ImageError",
]
