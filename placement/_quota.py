"""Tenant quotas at create time, right across replicas, redeliveries and kills.

What a limited tenant holds is one record in KV ``dsec_quota``: a hold per sandbox id (its cpu and
memory), written with compare-and-set on the record's revision, so two replicas admitting the same
tenant's burst at once cannot both take its last place (the loser re-reads and decides again). A
hold is keyed by the sandbox id: a redelivered create (this replica or another died before its ack)
finds its hold and is not counted twice. A replica keeps the record it last wrote or read in memory
and writes on that revision: one round trip per batch and tenant, none to read; a stale copy only
costs a failed write and a read.

A hold is dropped when its sandbox no longer runs: the create failed here (``release``), or, when a
create would pass a limit, the tenant's holds are checked against the sandbox records first
(``reconcile``): ended or stopping (a kill), owned by another tenant, or no record at all after
``grace_s`` (a create that failed on a host, or whose replica died before it could release). So a
kill frees its place for the next create without any message to placement.

Tenants without limits (the operator, the services, every key without a record while no defaults
are set) cost a dict look-up per create: no KV round trip.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

import structlog
from nats.js import JetStreamContext

from bus import codec
from bus import subjects as S
from bus.errors import QuotaExceeded, Unavailable
from bus.messages import SANDBOX_ENDED, QuotaHold, SandboxRecord, SandboxSpec, TenantLimits, TenantUsage
from bus.quota import hold_of, limits_of, over_quota
from bus.runtime import KV, Versioned, Watch

log = structlog.get_logger("dsec.placement.quota")

CAS_ROUNDS = 16  # writers racing on one tenant's record: each round one of them wins
READS_AT_ONCE = 256  # record reads in flight while checking holds (a big tenant's thousands)
_FREED = frozenset((*SANDBOX_ENDED, "stopping"))  # stopping: a kill is under way, a durable intent


class Quotas:
    def __init__(self, grace_s: float = 60.0) -> None:
        self.grace_s = grace_s
        self.limits: dict[str, TenantLimits] = {}  # KV dsec_tenants, as the watch last saw it
        self._usage: dict[str, Versioned[TenantUsage]] = {}  # tenant -> its record as last written or read here
        self._locks: dict[str, asyncio.Lock] = {}
        self._kv: KV[TenantUsage] | None = None
        self._kv_sbx: KV[SandboxRecord] | None = None
        self.refused = 0

    async def start(self, js: JetStreamContext, kv_sbx: KV[SandboxRecord]) -> Watch[TenantLimits]:
        self._kv = await KV.open(js, S.KV_QUOTA, codec.TENANT_USAGE)
        self._kv_sbx = kv_sbx
        limits: KV[TenantLimits] = await KV.open(js, S.KV_TENANTS, codec.TENANT_LIMITS)
        return await limits.watch(self._on_limits, self._on_limits_gone)

    def _on_limits(self, key: str, lim: TenantLimits, _rev: int) -> None:
        self.limits[key] = lim

    def _on_limits_gone(self, key: str) -> None:
        self.limits.pop(key, None)

    def limits_for(self, tenant: str) -> TenantLimits | None:
        """The hot path's question: None (nothing to count) for almost every create."""
        return limits_of(tenant, self.limits) if self.limits else None

    def _lock(self, tenant: str) -> asyncio.Lock:
        lock = self._locks.get(tenant)
        if lock is None:
            lock = self._locks[tenant] = asyncio.Lock()
        return lock

    # --- admission ---------------------------------------------------------------------------
    async def admit(self, tenant: str, lim: TenantLimits, specs: list[SandboxSpec]) -> dict[str, QuotaExceeded]:
        """Hold ``tenant``'s quota for ``specs`` in order (one write for all); the refused, by sandbox
        id. Raises Unavailable when KV does not answer (the requests stay un-acked and come back)."""
        async with self._lock(tenant):
            reconciled = False
            for _ in range(CAS_ROUNDS):
                cur = self._usage.get(tenant) or await self._read(tenant)
                holds = dict(cur.value.sandboxes)
                now = time.time()
                refused: dict[str, QuotaExceeded] = {}
                for spec in specs:
                    err = over_quota(tenant, lim, holds, spec)
                    if err is None:
                        holds.setdefault(spec.sandbox_id, hold_of(spec, now))
                    else:
                        refused[spec.sandbox_id] = err
                if refused and not reconciled:
                    # What this replica knows may be stale (a kill, another replica's release): look again.
                    reconciled = True
                    await self._reconcile(tenant)
                    continue
                if len(holds) == len(cur.value.sandboxes):
                    self.refused += len(refused)
                    return refused  # nothing new to hold: every admitted one was held already
                rev = await self._write(tenant, holds, cur.revision)
                if rev is not None:
                    self.refused += len(refused)
                    return refused
            raise Unavailable(f"quota record of tenant {tenant} kept changing under {CAS_ROUNDS} writes")

    async def release(self, tenant: str, sandbox_ids: Iterable[str]) -> None:
        """Drop the holds of creates that failed here, unless a record shows the sandbox lives after all
        (a duplicate of a create that did happen)."""
        if self._kv is None:
            return
        async with self._lock(tenant):
            try:
                await self._drop(tenant, set(sandbox_ids), grace_s=0.0)
            except Exception as exc:  # noqa: BLE001 - the next reconcile drops it
                log.warning("quota_release_failed", tenant=tenant, error=repr(exc))

    async def _reconcile(self, tenant: str) -> None:
        self._usage.pop(tenant, None)
        cur = await self._read(tenant)
        await self._drop(tenant, set(cur.value.sandboxes), grace_s=self.grace_s)

    async def _drop(self, tenant: str, ids: set[str], *, grace_s: float) -> None:
        """Drop the holds among ``ids`` whose sandbox does not run (see the module's rule)."""
        assert self._kv_sbx is not None
        kv_sbx = self._kv_sbx
        for _ in range(CAS_ROUNDS):
            cur = self._usage.get(tenant) or await self._read(tenant)
            holds = cur.value.sandboxes
            ask = [sid for sid in ids if sid in holds]
            if not ask:
                return
            now = time.time()
            recs = await _records(kv_sbx, ask)
            gone = {
                sid for sid, rec in zip(ask, recs, strict=True)
                if (now - holds[sid].at > grace_s if rec is None else rec.state in _FREED or S.tenant(rec.spec.client) != tenant)
            }
            if not gone:
                return
            if await self._write(tenant, {k: v for k, v in holds.items() if k not in gone}, cur.revision) is not None:
                log.info("quota_released", tenant=tenant, sandboxes=len(gone))
                return
        raise Unavailable(f"quota record of tenant {tenant} kept changing under {CAS_ROUNDS} writes")

    # --- the record ------------------------------------------------------------------------------
    async def _read(self, tenant: str) -> Versioned[TenantUsage]:
        assert self._kv is not None
        cur = await self._kv.entry(tenant)
        if cur is None:
            cur = await self._seed(tenant, Versioned(TenantUsage(sandboxes={}), 0))
        self._usage[tenant] = cur
        return cur

    async def _seed(self, tenant: str, empty: Versioned[TenantUsage]) -> Versioned[TenantUsage]:
        """A tenant's first record: what it already runs (limits set after it made sandboxes), read
        from the sandbox records once. Written with ``last=0``: when another replica seeds first, its
        record is read instead."""
        assert self._kv is not None and self._kv_sbx is not None
        kv_sbx = self._kv_sbx
        recs = await _records(kv_sbx, await kv_sbx.keys())
        now = time.time()
        holds = {
            r.spec.sandbox_id: hold_of(r.spec, now)
            for r in recs if r is not None and S.tenant(r.spec.client) == tenant and r.state not in _FREED
        }
        rev = await self._kv.swap(tenant, TenantUsage(sandboxes=holds), last=0)
        if rev is None:
            return await self._kv.entry(tenant) or empty
        return Versioned(TenantUsage(sandboxes=holds), rev)

    async def _write(self, tenant: str, holds: dict[str, QuotaHold], last: int) -> int | None:
        """Compare-and-set on ``last``; the new revision (cached), or None (someone wrote first: the
        cached copy is dropped, the caller reads and decides again)."""
        assert self._kv is not None
        usage = TenantUsage(sandboxes=holds)
        rev = await self._kv.swap(tenant, usage, last=last)
        if rev is None:
            self._usage.pop(tenant, None)
            return None
        self._usage[tenant] = Versioned(usage, rev)
        return rev


async def _records(kv: KV[SandboxRecord], ids: list[str]) -> list[SandboxRecord | None]:
    out: list[SandboxRecord | None] = []
    for i in range(0, len(ids), READS_AT_ONCE):
        out += await asyncio.gather(*(kv.get(sid) for sid in ids[i:i + READS_AT_ONCE]))
    return out


__all__ = ["Quotas"]
