"""What a tenant's templates hold in the blob store, bounded per tenant.

A template built for a client (the manifest's ``owner``: the gateway's template API and Dockerfile
builds) names layers, and those layers stay in the blob store as long as the template does, even
once the build's snapshots (charged to the tenant's snapshot quota while they exist) are removed.
A tenant's template bytes are the distinct layers of its templates that no template of another
owner (the base, a public template) also names; a build that would pass
``--template-max-bytes-per-tenant`` (env ``DSEC_TEMPLATE_MAX_BYTES_PER_TENANT``; 0: no limit) is
refused with ``quota_exceeded`` before its manifest is written. Rebuilding a template replaces
its own layers, so they are not counted twice.
"""

from __future__ import annotations

from nats.js import JetStreamContext

from bus.errors import QuotaExceeded
from bus.messages import TemplateManifest

from ._manifests import list_manifests

DEFAULT_TEMPLATE_MAX_BYTES_PER_TENANT = 64 << 30
LIMIT = "template_bytes_per_tenant"


def owned_bytes(manifests: list[TemplateManifest], owner: str, *, replacing: str = "") -> tuple[dict[str, int], set[str]]:
    """The layers (digest -> size) ``owner``'s templates hold on their own (but ``replacing``'s), and
    the digests other owners' templates name too."""
    shared = {lay.digest for m in manifests if m.owner != owner for lay in m.layers}
    mine = {lay.digest: lay.size for m in manifests if m.owner == owner and m.name != replacing for lay in m.layers if lay.digest not in shared}
    return mine, shared


async def check_template_quota(js: JetStreamContext, manifest: TemplateManifest, limit: int) -> None:
    """Raise ``quota_exceeded`` when writing ``manifest`` would take its owner past ``limit`` bytes."""
    if not manifest.owner or limit <= 0:
        return  # the operator's templates are the operator's business
    mine, shared = owned_bytes(await list_manifests(js), manifest.owner, replacing=manifest.name)
    used = sum(mine.values())
    wanted = sum({lay.digest: lay.size for lay in manifest.layers if lay.digest not in shared and lay.digest not in mine}.values())
    if used + wanted > limit:
        raise QuotaExceeded(
            f"template {manifest.name!r} would add {wanted} bytes to the {used} the templates of tenant {manifest.owner!r} hold: "
            f"that passes the per-tenant template limit of {limit} bytes (--template-max-bytes-per-tenant)",
            limit=LIMIT, max=str(limit), used=str(used), wanted=str(wanted),
        )


__all__ = ["DEFAULT_TEMPLATE_MAX_BYTES_PER_TENANT", "LIMIT", "check_template_quota", "owned_bytes"]
