"""What a sandbox may make this host store, and how full the host's disk is.

Bounds on snapshots (persisted pauses and CRIU dumps are snapshots too), checked on the staged
directory BEFORE it is packed, so a refused snapshot writes nothing to the blob store:

* per sandbox: the bytes all of a sandbox's snapshots put into the blob store (``bytes_added`` of
  its records in KV ``dsec_snapshots``) plus what this one would add;
* per tenant (the spec's ``client``; ``''`` is the operator): the same over every sandbox of the tenant.

What a staged directory "would add" is an upper bound: the allocated bytes of its distinct regular
files (a hole costs nothing, as the packer keeps holes; repeats are deduplicated later, not here)
plus a block per other entry. Limits: ``HostAgentConfig.snapshot_max_bytes_per_sandbox`` /
``snapshot_max_bytes_per_tenant`` (flags ``--snapshot-max-bytes-per-sandbox`` / ``-per-tenant``, env
``DSEC_SNAPSHOT_MAX_BYTES_PER_SANDBOX`` / ``_PER_TENANT``; 0 means no limit).

A full disk: writes this host makes for a sandbox (a snapshot's staging and pack, a file upload)
first check for room (``ensure_room``: the bytes plus ``HostAgentConfig.write_reserve_mb``) and fail
with ``no_space`` before writing anything; an ENOSPC met on the
way is ``no_space`` too. The heartbeat carries the free space (``heartbeat_free_mb``), and placement
sends no creates to a host under its floor (placement's ``Policy.min_disk_free_mb``).
"""

from __future__ import annotations

import asyncio
import errno
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from nats.js.errors import KeyNotFoundError

from bus import codec
from bus import subjects as S
from bus.errors import BadRequest, NoSpace, QuotaExceeded
from bus.messages import SandboxSpec, SnapshotRecord
from bus.runtime import kv_erase, kv_keys
from bus.streams import ensure_kv

from ._config import HostAgentConfig

log = structlog.get_logger("dsec.hostagent.storage")
ENTRY_BYTES = 4096  # what a directory, link or device may cost a layer (an upper bound)
WRITE_RESERVE_MB = HostAgentConfig.write_reserve_mb


@dataclass(frozen=True)
class Limits:
    per_sandbox: int = HostAgentConfig.snapshot_max_bytes_per_sandbox  # 0: none
    per_tenant: int = HostAgentConfig.snapshot_max_bytes_per_tenant

    @classmethod
    def of(cls, config: HostAgentConfig) -> "Limits":
        return cls(config.snapshot_max_bytes_per_sandbox, config.snapshot_max_bytes_per_tenant)

    def named(self) -> dict[str, int]:
        """The limits by the names a ``quota_exceeded`` error gives them (the heartbeat's ``storage_limits``)."""
        return {"snapshot_bytes_per_sandbox": self.per_sandbox, "snapshot_bytes_per_tenant": self.per_tenant}


NO_CONFIG = Limits()  # the declared defaults


def staged_bytes(root: str) -> int:
    """An upper bound of what packing ``root`` adds to the blob store (see the module's doc)."""
    total = 0
    seen: set[int] = set()
    stack = [root]
    while stack:
        d = stack.pop()
        total += ENTRY_BYTES
        with os.scandir(d) as it:
            for e in it:
                st = e.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    stack.append(e.path)
                elif stat.S_ISREG(st.st_mode):
                    if st.st_ino not in seen:
                        seen.add(st.st_ino)
                        total += min(st.st_size, st.st_blocks * 512) + 256
                else:
                    total += 256
    return total


@dataclass
class Budget:
    """Room left for one snapshot of one sandbox; ``charge`` raises ``quota_exceeded`` when passed."""

    sandbox_id: str
    tenant: str
    sandbox_used: int
    tenant_used: int
    limits: Limits
    charged: int = 0
    memory_estimate: int = 0  # charged ahead for a CRIU dump (its anonymous memory), before anything is packed
    reserve_mb: int = WRITE_RESERVE_MB  # the data dir's free space a snapshot may not use

    def charge_dump(self, nbytes: int) -> None:
        """The dump's real size, beyond what was charged ahead for it."""
        self.charge(max(0, nbytes - self.memory_estimate), "memory dump")

    def charge(self, nbytes: int, what: str = "snapshot") -> None:
        lim = self.limits
        after = self.charged + nbytes
        if lim.per_sandbox and self.sandbox_used + after > lim.per_sandbox:
            raise QuotaExceeded(
                f"{what} of sandbox {self.sandbox_id} would store up to {after} bytes; with the {self.sandbox_used} its snapshots hold "
                f"that passes the per-sandbox snapshot limit of {lim.per_sandbox} bytes (--snapshot-max-bytes-per-sandbox)",
                limit="snapshot_bytes_per_sandbox", max=str(lim.per_sandbox), used=str(self.sandbox_used), wanted=str(after),
            )
        if lim.per_tenant and self.tenant_used + after > lim.per_tenant:
            raise QuotaExceeded(
                f"{what} of sandbox {self.sandbox_id} would store up to {after} bytes; with the {self.tenant_used} the snapshots of "
                f"tenant {self.tenant or '(operator)'!r} hold that passes the per-tenant snapshot limit of {lim.per_tenant} bytes "
                "(--snapshot-max-bytes-per-tenant)",
                limit="snapshot_bytes_per_tenant", max=str(lim.per_tenant), used=str(self.tenant_used), wanted=str(after),
            )
        self.charged = after


async def snapshot_records(js: Any, concurrency: int = 64) -> list[SnapshotRecord]:
    """Every snapshot record (read many at a time: this runs before each snapshot)."""
    kv = await ensure_kv(js, S.KV_SNAPSHOTS)
    sem = asyncio.Semaphore(concurrency)

    async def one(key: str) -> SnapshotRecord | None:
        async with sem:
            try:
                entry = await kv.get(key)
            except KeyNotFoundError:
                return None
        try:
            return codec.SNAPSHOT.decode(entry.value) if entry.value else None
        except BadRequest:
            return None

    return [r for r in await asyncio.gather(*(one(k) for k in await kv_keys(js, S.KV_SNAPSHOTS))) if r is not None]


def tenant_of(rec: SnapshotRecord) -> str:
    return rec.spec.client if rec.spec is not None else ""


async def snapshot_budget(
    js: Any, spec: SandboxSpec, data_dir: str | os.PathLike[str], limits: Limits, reserve_mb: int = WRITE_RESERVE_MB,
) -> Budget:
    """Before a snapshot stages anything: its budget, and ``no_space`` when the data dir is full."""
    ensure_room(data_dir, 0, "snapshot", reserve_mb)
    budget = await budget_for(js, spec, limits)
    budget.reserve_mb = reserve_mb
    return budget


async def admit(budget: Budget, data_dir: str | os.PathLike[str], stage: str | None, dumped: Any = None) -> None:
    """Charge what packing ``stage`` (and a CRIU dump of the sandbox ``dumped``, a Handle, estimated)
    will add, and check the data dir has room for it: ``quota_exceeded`` / ``no_space`` before
    anything is packed."""
    staged = await asyncio.to_thread(staged_bytes, stage) if stage else 0
    budget.memory_estimate = memory_estimate(dumped) if dumped is not None else 0
    budget.charge(staged + budget.memory_estimate)
    ensure_room(data_dir, staged + budget.memory_estimate, "snapshot", budget.reserve_mb)


async def budget_for(js: Any, spec: SandboxSpec, limits: Limits) -> Budget:
    """What the sandbox's and its tenant's snapshots hold now, against the limits in force."""
    recs = await snapshot_records(js)
    mine = sum(r.bytes_added for r in recs if r.sandbox_id == spec.sandbox_id)
    tenant = sum(r.bytes_added for r in recs if tenant_of(r) == spec.client)
    return Budget(spec.sandbox_id, spec.client, mine, tenant, limits)


async def release_pins(js: Any, digests: list[str]) -> None:
    """The snapshot record references these layers now: drop the pins their pack took against a
    collection running meanwhile (imaged._gc; pins left behind lapse after an hour)."""
    prefixes = tuple(f"pin.{d.removeprefix('sha256:')}." for d in digests)
    try:
        for k in await kv_keys(js, S.KV_GC):
            if k.startswith(prefixes):
                await kv_erase(js, S.KV_GC, k)  # no marker left (imaged._gc._erase)
    except Exception as exc:  # noqa: BLE001 - no bucket (no pins), NATS away: the pins lapse, the snapshot stands
        log.debug("pins_not_released", error=str(exc))


def memory_estimate(handle: Any) -> int:
    """What a CRIU dump of a container sandbox will hold, about: its anonymous memory (cgroups v1
    memory.stat); 0 for a sandbox without such a cgroup."""
    from .backends.container.cgroups import cgroup_path

    cgroup = cgroup_path(handle.extra.get("cid") or handle.sandbox_id)
    try:
        stat_text = Path("/sys/fs/cgroup/memory", cgroup.lstrip("/"), "memory.stat").read_text()
    except OSError:
        return 0
    for line in stat_text.splitlines():
        k, _, v = line.partition(" ")
        if k == "total_rss":
            return int(v)
    return 0


# --- free space ------------------------------------------------------------------------------------
def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """Bytes free for root in ``path``'s file system (None when it cannot be read)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bfree * st.f_frsize


def heartbeat_free_mb(path: str | os.PathLike[str]) -> int:
    """The heartbeat's ``disk_free_mb``: 0 when unknown (as older hosts), so a full disk says 1."""
    free = free_bytes(path)
    return 0 if free is None else max(1, free >> 20)


def usage_by_tenant(recs: list[SnapshotRecord], host_id: str | None = None) -> dict[str, int]:
    """Blob-store bytes the snapshots hold per tenant (``''`` the operator); only those taken on
    ``host_id`` when given (so the hosts' figures add up)."""
    out: dict[str, int] = {}
    for r in recs:
        if host_id is None or r.host_id == host_id:
            t = tenant_of(r)
            out[t] = out.get(t, 0) + r.bytes_added
    return out


METRICS_REFRESH_S = 30.0  # the snapshot figures are read from KV at most this often (every record is read)


def register_metrics(
    reg: Any, data_dir: str | os.PathLike[str], *, host_id: str = "", js: Callable[[], Any] | None = None, limits: Callable[[], Limits] | None = None,
) -> Callable[[], None]:
    """``dsec_host_disk_bytes{kind="free"|"total"}``: the data dir's file system, at each scrape; with
    ``js``, ``dsec_snapshot_bytes{tenant}`` (what the snapshots taken on this host hold) and
    ``dsec_storage_limit_bytes{limit}`` (the limits in force here, by the names quota_exceeded uses).
    Returns what to call when a snapshot was stored: the next scrape reads the figures again."""
    disk = reg.gauge("dsec_host_disk_bytes", "The data dir's file system: bytes free (for root) and in all", ["kind"])

    def fill() -> None:
        try:
            st = os.statvfs(data_dir)
        except OSError:
            return
        disk.set(st.f_bfree * st.f_frsize, kind="free")
        disk.set(st.f_blocks * st.f_frsize, kind="total")

    reg.collector(fill)
    last: list[float | None] = [None]  # when the snapshot figures were read (None: read them at the next scrape)

    def stale() -> None:
        last[0] = None

    if js is None:
        return stale
    snap = reg.gauge("dsec_snapshot_bytes", "Blob-store bytes of the snapshots taken on this host, by tenant ('' is the operator)", ["tenant"])
    lim = reg.gauge("dsec_storage_limit_bytes", "What a sandbox may make this host store, by limit (0: none)", ["limit"])

    async def fill_snapshots() -> None:
        for name, v in (limits() if limits is not None else NO_CONFIG).named().items():
            lim.set(v, limit=name)
        conn = js()
        read_at = last[0]
        if conn is None or (read_at is not None and time.monotonic() - read_at < METRICS_REFRESH_S):
            return
        try:
            by = usage_by_tenant(await snapshot_records(conn), host_id)
        except Exception as exc:  # noqa: BLE001 - NATS away: the last figures stand
            log.debug("snapshot_figures_failed", error=str(exc))
            return
        last[0] = time.monotonic()
        snap.clear()
        for tenant, nbytes in by.items():
            snap.set(nbytes, tenant=tenant)

    reg.collector(fill_snapshots)
    return stale


def ensure_room(path: str | os.PathLike[str], nbytes: int, what: str, reserve_mb: int = WRITE_RESERVE_MB) -> None:
    """Raise ``no_space`` unless ``nbytes`` plus a reserve (``HostAgentConfig.write_reserve_mb``) fit
    in ``path``'s file system: the write is refused before it starts, so nothing is left half-written,
    and the last blocks stay for the records and the journal."""
    free = free_bytes(path)
    need = nbytes + (reserve_mb << 20)
    if free is not None and free < need:
        raise NoSpace(f"{what}: the host's disk is full ({free >> 20} MiB free in {os.fspath(path)}, {need >> 20} MiB needed)",
                      free_bytes=str(free), needed_bytes=str(need))


def is_no_space(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def no_space(exc: OSError, what: str, path: str = "") -> NoSpace:
    """The typed error for a write that found the disk (or a quota) full."""
    return NoSpace(f"{what}: no space left on the host's disk{f' ({path})' if path else ''}: {exc.strerror}", **({"path": path} if path else {}))


__all__ = [
    "NO_CONFIG", "Budget", "Limits", "admit", "budget_for", "ensure_room", "free_bytes", "heartbeat_free_mb",
    "is_no_space", "memory_estimate", "no_space", "register_metrics", "release_pins", "snapshot_budget", "snapshot_records", "staged_bytes",
    "tenant_of", "usage_by_tenant",
]
