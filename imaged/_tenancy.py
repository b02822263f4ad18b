"""Whose templates and snapshots a request may change: the image service's side of tenants.

A request that builds or removes a template, or removes a snapshot, names its tenant as the last
token of its subject (``bus.subjects.img_build`` and the like); nats-server lets a client credential
publish only its own, so the tenant here is the publisher's. The bare subjects are the services' and
the operator's (``OPERATOR_TENANT``), who may do everything.

Templates come in two kinds, told apart by ``TemplateManifest.owner``:

* **shared** (``owner == ""``): what the operator builds (``base``, templates from paths on this
  machine, ``dsec image build`` as the operator) and the pull cache of ``FROM <image>`` builds
  (``bus.subjects.pull_cache_template``: named by the image reference, so its content is the reference's whoever
  pulls it). Every tenant may start sandboxes from them; only the operator removes or rebuilds
  them (a tenant may refresh a pull-cache entry, which stays shared).
* **a tenant's own** (``owner == <tenant>``): built by the tenant (``dsec image build`` with its
  credential, a Dockerfile build, the gateway's E2B template API). Only that tenant (and the
  operator) rebuilds or removes it; another tenant's build of that name is ``template_taken``.

A tenant builds from a registry image, from a snapshot of its own or from a template it may use;
sources that are paths on this machine are the operator's (they would read the image service's
files). Removing another tenant's snapshot answers ``unknown_snapshot``, as one that does not
exist (snapshot records are private); another's template ``permission_denied`` (the catalogue of
templates is readable by every tenant, so there is no existence to hide: the gateway answers so too).
"""

from __future__ import annotations

import structlog
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError

from bus import codec
from bus import subjects as S
from bus.streams import ensure_kv
from bus.errors import BadRequest, PermissionDenied, TemplateTaken, UnknownSnapshot, UnknownTemplate
from bus.messages import BuildImage, SnapshotRecord, TemplateManifest

from ._manifests import get_manifest

log = structlog.get_logger("dsec.imaged")


def is_operator(tenant: str) -> bool:
    return tenant == S.OPERATOR_TENANT


def snapshot_owner(rec: SnapshotRecord) -> str:
    """The tenant whose sandbox the snapshot was taken of (hostagent._tenancy.check_restore agrees)."""
    return S.tenant(rec.spec.client) if rec.spec is not None else S.OPERATOR_TENANT


def check_snapshot(rec: SnapshotRecord | None, snapshot_id: str, tenant: str, op: str) -> SnapshotRecord:
    """``rec`` when ``tenant`` may use or remove it; UnknownSnapshot otherwise (missing or another's)."""
    if rec is not None and (is_operator(tenant) or snapshot_owner(rec) == tenant):
        return rec
    if rec is not None:
        log.warning("tenant_violation", snapshot_id=snapshot_id, tenant=tenant, op=op, owner=snapshot_owner(rec))
    raise UnknownSnapshot(f"no snapshot {snapshot_id!r}", snapshot_id=snapshot_id)


def may_use(m: TemplateManifest, tenant: str) -> bool:
    return is_operator(tenant) or not m.owner or m.owner == tenant


async def check_build(js: JetStreamContext, req: BuildImage, tenant: str) -> str:
    """The owner the built template gets, once ``tenant`` may build ``req``; raises otherwise."""
    pull_cache = bool(req.from_ref) and req.name == S.pull_cache_template(req.from_ref, req.platform)
    if is_operator(tenant):
        return "" if pull_cache else req.owner
    if req.base or req.workspace or req.toolkit:
        raise PermissionDenied("a template from paths on the image service's machine is the operator's to build: "
                               "build from an image, a snapshot or a template")
    if req.from_snapshot:
        kv = await ensure_kv(js, S.KV_SNAPSHOTS)
        try:
            rec: SnapshotRecord | None = codec.SNAPSHOT.decode((await kv.get(req.from_snapshot)).value or b"")
        except (KeyNotFoundError, BadRequest):
            rec = None
        check_snapshot(rec, req.from_snapshot, tenant, "build-from")
    if req.from_template:
        src = await get_manifest(js, req.from_template)
        if src is None or not may_use(src, tenant):
            if src is not None:
                log.warning("tenant_violation", template=req.from_template, tenant=tenant, op="build-from")
            raise UnknownTemplate(f"no template {req.from_template!r}", template=req.from_template)
    current = await get_manifest(js, req.name)
    if pull_cache:
        if current is not None and current.owner:  # a tenant's own template cannot take the cache's name from it
            raise TemplateTaken(f"the template name {req.name!r} is taken", template=req.name)
        return ""
    if current is not None and current.owner != tenant:
        log.warning("tenant_violation", template=req.name, tenant=tenant, op="build", owner=current.owner or "(shared)")
        raise TemplateTaken(f"the template name {req.name!r} is taken", template=req.name)
    return tenant


async def check_remove(js: JetStreamContext, name: str, tenant: str) -> None:
    """Raise unless ``tenant`` may remove template ``name`` (UnknownTemplate when there is none)."""
    if is_operator(tenant):
        return
    m = await get_manifest(js, name)
    if m is None:
        raise UnknownTemplate(f"no template {name!r}", template=name)
    if m.owner != tenant:
        log.warning("tenant_violation", template=name, tenant=tenant, op="remove", owner=m.owner or "(shared)")
        raise PermissionDenied(f"template {name!r} is not tenant {tenant}'s to remove")


__all__ = ["check_build", "check_remove", "check_snapshot", "is_operator", "may_use", "snapshot_owner"]
