"""Tenant quotas, the rule: which limits count against a tenant, and whether what it holds admits one
more sandbox. Placement applies it at create time (``placement._quota``: holds kept in KV
``dsec_quota`` with compare-and-set); the operator writes the limits (KV ``dsec_tenants``, ``dsec
api-key create --max-sandboxes N ...``)."""

from __future__ import annotations

from collections.abc import Mapping

from . import subjects as S
from .auth import SERVICE_ROLES
from .errors import QuotaExceeded
from .messages import QuotaHold, SandboxSpec, TenantLimits

# Sums of floats (cpu) drift by a few ulps: a tenant at exactly its limit is within it.
_EPS = 1e-9


def unlimited(lim: TenantLimits) -> bool:
    return lim.max_sandboxes <= 0 and lim.max_cpu <= 0 and lim.max_memory_mb <= 0


def limits_of(tenant: str, records: Mapping[str, TenantLimits]) -> TenantLimits | None:
    """The limits of ``tenant``'s creates, None when it has none: its own record, else the defaults
    (``_default``), which never apply to the operator and the services (their record alone does)."""
    lim = records.get(tenant)
    if lim is None and tenant not in SERVICE_ROLES:
        lim = records.get(S.TENANT_DEFAULTS)
    return None if lim is None or unlimited(lim) else lim


def held(holds: Mapping[str, QuotaHold]) -> tuple[int, float, int]:
    """Sandboxes, cpu and memory (MB) a tenant holds."""
    cpu = 0.0
    mem = 0
    for h in holds.values():
        cpu += h.cpu
        mem += h.memory_mb
    return len(holds), cpu, mem


def over_quota(tenant: str, lim: TenantLimits, holds: Mapping[str, QuotaHold], spec: SandboxSpec) -> QuotaExceeded | None:
    """The refusal naming the limit ``spec`` would pass, None when it fits (or is already held)."""
    if spec.sandbox_id in holds:
        return None
    n, cpu, mem = held(holds)
    ctx = {"tenant": tenant, "sandbox_id": spec.sandbox_id}
    if lim.max_sandboxes > 0 and n + 1 > lim.max_sandboxes:
        return QuotaExceeded(f"tenant {tenant} holds {n} of max {lim.max_sandboxes} sandboxes", limit="max_sandboxes", held=n, max=lim.max_sandboxes, **ctx)
    if lim.max_cpu > 0 and cpu + spec.cpu > lim.max_cpu + _EPS:
        return QuotaExceeded(
            f"tenant {tenant} holds {cpu:g} of max {lim.max_cpu:g} cpu; {spec.sandbox_id} asks for {spec.cpu:g} more",
            limit="max_cpu", held=cpu, max=lim.max_cpu, **ctx,
        )
    if lim.max_memory_mb > 0 and mem + spec.memory_mb > lim.max_memory_mb:
        return QuotaExceeded(
            f"tenant {tenant} holds {mem} of max {lim.max_memory_mb} MB memory; {spec.sandbox_id} asks for {spec.memory_mb} more",
            limit="max_memory_mb", held=mem, max=lim.max_memory_mb, **ctx,
        )
    return None


def hold_of(spec: SandboxSpec, at: float) -> QuotaHold:
    return QuotaHold(cpu=max(spec.cpu, 0.0), memory_mb=max(spec.memory_mb, 0), at=at)


__all__ = ["held", "hold_of", "limits_of", "over_quota", "unlimited"]
