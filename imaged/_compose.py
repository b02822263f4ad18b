"""Templates made of layers that exist already: a snapshot's file layers over its template's (how a
Dockerfile build ends: each step is a snapshot of the build sandbox), or another template's layers
with new defaults. No layer is built or uploaded; the manifest only names them."""

from __future__ import annotations

import time

from msgspec import structs
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError

from bus import codec
from bus import subjects as S
from bus.errors import BadRequest, InvalidArgument, UnknownSnapshot
from bus.messages import ImageDefaults, TemplateManifest
from bus.streams import ensure_kv

from ._build import BuildResult, LayerBuild
from ._manifests import check_name, publish_event, put_manifest, require_manifest
from ._quota import check_template_quota


async def compose_template(
    js: JetStreamContext, name: str, *, snapshot: str = "", template: str = "", defaults: ImageDefaults | None = None, description: str = "",
    owner: str = "", max_bytes_per_owner: int = 0,
) -> BuildResult:
    """Template ``name`` = ``template``'s layers (or the snapshot's template's, then the snapshot's chain);
    ``quota_exceeded`` when ``owner``'s templates would hold more than ``max_bytes_per_owner`` (``_quota``)."""
    check_name(name)
    if bool(snapshot) == bool(template):
        raise InvalidArgument("give one of from_snapshot and from_template")
    t0 = time.monotonic()
    extra = []
    if snapshot:
        kv = await ensure_kv(js, S.KV_SNAPSHOTS)
        try:
            rec = codec.SNAPSHOT.decode((await kv.get(snapshot)).value or b"")
        except (KeyNotFoundError, BadRequest):
            raise UnknownSnapshot(f"no snapshot {snapshot!r}", snapshot_id=snapshot) from None
        template = rec.template
        # files only: a template starts processes afresh, so a memory dump has no place in it
        extra = [structs.replace(lay, role="toolkit") for lay in rec.layers]
    base = await require_manifest(js, template)
    manifest = TemplateManifest(
        name=name, layers=[*base.layers, *extra], created_at=time.time(), description=description,
        defaults=defaults if defaults is not None else base.defaults, owner=owner,
    )
    await check_template_quota(js, manifest, max_bytes_per_owner)
    await put_manifest(js, manifest)
    await publish_event(js, name, "built", template=template, snapshot=snapshot, layers=str(len(manifest.layers)))
    return BuildResult(manifest=manifest, layers=[LayerBuild(ref=lay, source=snapshot or template) for lay in manifest.layers],
                       seconds=time.monotonic() - t0)
