"""What a tenant's templates hold in the blob store, bounded per tenant.

A template built for a client (the manifest's ``owner``: the gateway's template API and Dockerfile
builds) names layers, and those layers stay in the blob store as long as the template does, even
once the build's snapshots (charged to the tenant's snapshot quota while they exist) are removed.
A tenant's template bytes are the distinct layers of its templates that no template of another
owner (the base, a public template) also names, plus every layer of the images it pulled from a
registry (``FROM <image>``, ``dsec image build --from REF``: the manifest's ``pulled_by`` names it):
a pull fills the shared cache for the tenant that asked, so it is charged to that tenant however
many others pulled (and are charged for) the same image; the blob store still holds each layer
once, and a layer already charged to the tenant is not charged again. A build or pull that would
pass ``--template-max-bytes-per-tenant`` (env ``DSEC_TEMPLATE_MAX_BYTES_PER_TENANT``; 0: no limit)
is refused with ``quota_exceeded`` before its manifest is written (a pull, as far as it can be
known, before any layer is fetched: ``check_pull``). Rebuilding a template replaces its own layers,
so they are not counted twice.
"""

from __future__ import annotations

from nats.js import JetStreamContext

from bus.errors import QuotaExceeded
from bus.messages import TemplateManifest

from ._manifests import list_manifests

DEFAULT_TEMPLATE_MAX_BYTES_PER_TENANT = 64 << 30
LIMIT = "template_bytes_per_tenant"


def owned_bytes(manifests: list[TemplateManifest], owner: str, *, replacing: str = "") -> tuple[dict[str, int], set[str]]:
    """The layers (digest -> size) charged to ``owner`` (its templates' own, and those of the images it
    pulled; but ``replacing``'s), and the digests other owners' templates name too."""
    shared = {lay.digest for m in manifests if m.owner != owner and owner not in m.pulled_by for lay in m.layers}
    mine = {lay.digest: lay.size for m in manifests if m.owner == owner and m.name != replacing for lay in m.layers if lay.digest not in shared}
    mine.update((lay.digest, lay.size) for m in manifests if owner in m.pulled_by and m.name != replacing for lay in m.layers)
    return mine, shared


def _refusal(what: str, tenant: str, used: int, wanted: int, limit: int) -> QuotaExceeded:
    return QuotaExceeded(
        f"{what} would add {wanted} bytes to the {used} the templates of tenant {tenant!r} hold: "
        f"that passes the per-tenant template limit of {limit} bytes (--template-max-bytes-per-tenant)",
        limit=LIMIT, max=str(limit), used=str(used), wanted=str(wanted),
    )


async def check_template_quota(js: JetStreamContext, manifest: TemplateManifest, limit: int, *, tenant: str = "") -> None:
    """Raise ``quota_exceeded`` when writing ``manifest`` would take ``tenant`` (its owner by default;
    the pulling tenant of a shared pull cache entry) past ``limit`` bytes."""
    tenant = tenant or manifest.owner
    if not tenant or limit <= 0:
        return  # the operator's templates are the operator's business
    mine, shared = owned_bytes(await list_manifests(js), tenant, replacing=manifest.name)
    used = sum(mine.values())
    pulled = tenant in manifest.pulled_by  # every layer of a pulled image is charged, shared or not
    wanted = sum({lay.digest: lay.size for lay in manifest.layers if lay.digest not in mine and (pulled or lay.digest not in shared)}.values())
    if used + wanted > limit:
        raise _refusal(f"template {manifest.name!r}", tenant, used, wanted, limit)


async def check_pull(js: JetStreamContext, name: str, tenant: str, fetch_bytes: int, limit: int) -> None:
    """Before fetching: raise ``quota_exceeded`` when the ``fetch_bytes`` (the registry's sizes of the
    layers not stored yet: compressed, so fewer than they will take) would already take ``tenant``
    past ``limit``; ``check_template_quota`` counts the stored layers once they are known."""
    if not tenant or limit <= 0:
        return
    mine, _ = owned_bytes(await list_manifests(js), tenant, replacing=name)
    used = sum(mine.values())
    if used + fetch_bytes > limit:
        raise _refusal(f"pulling into template {name!r}", tenant, used, fetch_bytes, limit)


__all__ = ["DEFAULT_TEMPLATE_MAX_BYTES_PER_TENANT", "LIMIT", "check_pull", "check_template_quota", "owned_bytes"]
