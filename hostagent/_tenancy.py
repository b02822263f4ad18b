"""Defence in depth for tenants: an op reaches a sandbox only under its owner's tenant.

nats-server already keeps a client credential under its own tenant token (bus.auth); the host
agent serves each sandbox on every tenant's subject (``dsec.sbx.*.<id>.*``) and refuses here, with a
typed ``permission_denied`` and a ``control-plane`` guard violation event, any op whose tenant is
neither the sandbox's owner (``spec.client``), its ``delegate`` (the rollout workers on a job's
sandbox, bound by placement: bus.auth.bind_tenant) nor the operator's: it never runs. A restore from a
snapshot of another tenant's sandbox fails the same way (its files are that tenant's), and so does a
create from another tenant's private template (``bus.rules.template_refusal``; placement refuses it
first).
"""

from __future__ import annotations

import contextlib
import time

import structlog
from nats.aio.client import Client as NATS

from bus import codec
from bus import subjects as S
from bus.errors import PermissionDenied
from bus.messages import GuardViolation, SandboxSpec, SnapshotRecord
from bus.rules import template_refusal

from ._registry import LocalSandbox

log = structlog.get_logger("dsec.hostagent")


async def check_tenant(nc: NATS | None, host_id: str, ls: LocalSandbox | None, tenant: str, op: str) -> None:
    """Raise PermissionDenied (after recording the violation on ``nc``) unless ``tenant`` may run
    ``op`` on the sandbox ``ls``."""
    if ls is None:
        return  # not held here: the op's own lookup answers not-found
    sandbox_id = ls.spec.sandbox_id
    owner = S.tenant(ls.spec.client)
    if tenant in (owner, S.OPERATOR_TENANT) or (ls.spec.delegate and tenant == ls.spec.delegate):
        return  # (a delegate: the rollout workers, on the sandbox of a job they run; set by placement only)
    await _violation(nc, host_id, sandbox_id, tenant, op, f"{op} by another tenant refused")
    raise PermissionDenied(f"sandbox {sandbox_id} does not belong to tenant {tenant}")


async def check_template(nc: NATS | None, host_id: str, spec: SandboxSpec, owner: str) -> None:
    """Raise PermissionDenied (after recording the violation) when ``spec`` names another tenant's
    private template (``owner``: its manifest's). Placement refused it already; a hand-off that gets
    here anyway came from a stale placement view or past it, and never starts."""
    refused = template_refusal(spec.template, owner, spec.client)
    if refused is None:
        return
    await _violation(nc, host_id, spec.sandbox_id, S.tenant(spec.client), "create", f"create from tenant {owner}'s template {spec.template!r} refused",
                     template=spec.template, owner=owner)
    raise refused


async def _violation(nc: NATS | None, host_id: str, sandbox_id: str, tenant: str, op: str, what: str, **detail: str) -> None:
    log.warning("tenant_violation", sandbox_id=sandbox_id, tenant=tenant, op=op, **detail)
    v = GuardViolation(
        sandbox_id=sandbox_id, at=time.time(), kind="control-plane", what=what, action="record",
        host_id=host_id, detail={"tenant": tenant, "op": op, **detail},
    )
    if nc is not None:
        with contextlib.suppress(Exception):  # the refusal stands even when the event cannot be sent
            await nc.publish(S.EVT_GUARD_VIOLATION, codec.encode(v))


async def check_fn_call(nc: NATS | None, host_id: str, template: str, owner: str, tenant: str) -> None:
    """Raise PermissionDenied (after recording the violation) when ``tenant`` (the token in the
    call's subject, which nats-server holds a client credential to) calls the fn pool of another
    tenant's private template (``owner``: its manifest's). Shared templates' pools serve everyone."""
    refused = template_refusal(template, owner, tenant)
    if refused is None:
        return
    await _violation(nc, host_id, f"fn-{template}", S.tenant(tenant), "fn_call", f"fn call on tenant {owner}'s template {template!r} refused",
                     template=template, owner=owner)
    raise refused


def check_restore(snapshot: SnapshotRecord, spec: SandboxSpec) -> None:
    """A snapshot restores (and forks) only into a sandbox of the tenant whose sandbox it was taken
    of, or the operator's: its files are that tenant's."""
    owner = S.tenant(snapshot.spec.client) if snapshot.spec is not None else S.OPERATOR_TENANT
    if S.tenant(spec.client) not in (owner, S.OPERATOR_TENANT):
        log.warning("tenant_violation", sandbox_id=spec.sandbox_id, tenant=spec.client, op="restore", snapshot_id=snapshot.snapshot_id)
        raise PermissionDenied(f"snapshot {snapshot.snapshot_id} does not belong to tenant {S.tenant(spec.client)}")


__all__ = ["check_fn_call", "check_restore", "check_template", "check_tenant"]
