"""Hosts that disappear: heartbeats stop, and after a grace period the cluster decides for them.

Placement's table already stops sending work to a host whose heartbeat is older than
``STALE_AFTER_S``; this decides what becomes of the sandboxes it held. A host silent for longer than
``grace_s`` (by the heartbeat's own time and by when this replica last saw one) is marked ``down``
in KV ``dsec_hosts`` with a compare-and-set on the revision this replica saw, so of several replicas
(or a host beating again meanwhile) one wins and the host's ``down`` event is written once. Then
every record naming the host in a live state becomes ``lost`` -- each with a compare-and-set, so a
sandbox is declared lost, announced and restored exactly once however many replicas sweep -- and a
sandbox that asked for it (``SandboxSpec.restore_on_host_loss``) is created again elsewhere from its
last snapshot, as the same id one generation up (the persisted-pause resume's way of taking a record
over). A persisted pause needs nothing: its state is already in the blob store, and its resume runs
on any host.

The host, when it comes back, finds the records changed behind it and removes those sandboxes
locally without writing anything (hostagent._reconcile: fencing): nothing runs twice.

Cost: a scan of the sandbox records per host lost (and of the snapshot records when some lost
sandbox asked to be restored): O(cluster) once per loss, off the create path.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import structlog
from msgspec import structs

from bus import codec
from bus import subjects as S
from bus.errors import HostUnreachable
from bus.messages import CreateSandbox, HostStatus, SandboxRecord, SandboxSpec, SnapshotRecord
from bus.runtime import KV, Events

from ._table import HostTable

log = structlog.get_logger("dsec.placement")

_LIVE = ("creating", "placed", "running", "paused", "stopping")
_SCAN_CONCURRENCY = 64


def lost_on_host(rec: SandboxRecord, host_id: str) -> bool:
    """True when ``rec`` is a sandbox that died with ``host_id`` (a persisted pause lives on in its snapshot)."""
    if rec.host_id != host_id or rec.state not in _LIVE:
        return False
    return not (rec.state == "paused" and rec.snapshot_id)


def restore_spec(spec: SandboxSpec, snap: SnapshotRecord, now: float) -> SandboxSpec:
    """The spec that starts a lost sandbox again from ``snap``: the same id, one generation up (so its
    new host may take the ``lost`` record over, and JetStream's de-duplication tells it apart)."""
    return structs.replace(
        spec, snapshot=snap.snapshot_id, template=snap.template, generation=spec.generation + 1, requested_at=now,
        create_deadline=0.0, reply_to="", batch_id="",
    )


class HostLoss:
    """One placement replica's watch over host liveness (``check`` runs every ``grace_s / 4``)."""

    def __init__(
        self, table: HostTable, kv_hosts: KV[HostStatus], kv_sbx: KV[SandboxRecord], kv_snaps: KV[SnapshotRecord], events: Events,
        store: Callable[[str, bytes, dict[str, str]], Awaitable[None]], *, grace_s: float, replica_id: str,
    ) -> None:
        self.table = table
        self.kv_hosts = kv_hosts
        self.kv_sbx = kv_sbx
        self.kv_snaps = kv_snaps
        self.events = events
        self.store = store  # an acked publish, awaited (the restores, on DSEC_REQ)
        self.grace_s = grace_s
        self.replica_id = replica_id
        self.revisions: dict[str, int] = {}  # host -> the revision of its KV entry this replica last saw
        self.swept: dict[str, float] = {}  # host -> the heartbeat time its loss was handled for (once per silence)
        self.lost = 0
        self.restored = 0

    def seen(self, host_id: str, st: HostStatus, rev: int) -> None:
        self.revisions[host_id] = rev
        if st.state != "down" or st.at > self.swept.get(host_id, st.at):
            self.swept.pop(host_id, None)  # beating again: a later silence is a new loss

    def silent(self, now: float) -> list[str]:
        """Hosts silent past the grace period whose loss this replica has not handled yet."""
        out = []
        for hid, e in self.table.hosts.items():
            if hid in self.swept:
                continue
            if now - e.seen_at > self.grace_s and now - e.status.at > self.grace_s:
                out.append(hid)
        return out

    async def loop(self, stopping: asyncio.Event) -> None:
        period = max(0.2, self.grace_s / 4)
        while not stopping.is_set():
            try:
                await asyncio.wait_for(stopping.wait(), period)
                return
            except asyncio.TimeoutError:
                pass
            try:
                await self.check(time.time())
            except Exception as exc:  # noqa: BLE001 - NATS away: the next period tries again
                log.warning("host_loss_check_failed", error=f"{type(exc).__name__}: {exc}")

    async def check(self, now: float) -> list[str]:
        """Handle every host silent past the grace period: marked down, then one scan of the records for all."""
        ages: dict[str, float] = {}
        for hid in self.silent(now):
            e = self.table.hosts.get(hid)
            if e is not None and await self.mark_down(hid, e.status, now):
                ages[hid] = now - e.status.at
        if ages:
            await self.sweep(ages)
        return sorted(ages)

    async def mark_down(self, host_id: str, st: HostStatus, now: float) -> bool:
        """Mark the host down in KV (once, cluster-wide: compare-and-set); False when it beat again meanwhile."""
        age = now - st.at
        if st.state != "down":
            down = structs.replace(st, state="down")
            rev = self.revisions.get(host_id)
            if rev is not None and await self.kv_hosts.update(host_id, down, last=rev):
                log.warning("host_down", host_id=host_id, silent_s=round(age, 1), by=self.replica_id)
                await self.events.host(host_id, "down", {"by": self.replica_id, "reason": f"no heartbeat for {age:.0f}s"})
            else:
                cur = await self.kv_hosts.get(host_id)
                if cur is not None and cur.at > st.at:
                    return False  # it beat again meanwhile: not lost
        self.swept[host_id] = st.at
        return True

    async def sweep(self, ages: dict[str, float]) -> int:
        """Every live record naming a host of ``ages`` becomes ``lost`` (compare-and-set: once, whoever sweeps)."""
        sem = asyncio.Semaphore(_SCAN_CONCURRENCY)
        restore: list[SandboxSpec] = []
        n = 0

        async def one(sid: str) -> None:
            nonlocal n
            async with sem:
                e = await self.kv_sbx.entry(sid)
                if e is None or e.value.host_id not in ages or not lost_on_host(e.value, e.value.host_id):
                    return
                rec = e.value
                host_id = rec.host_id
                rec.state, rec.ended_at, rec.end_reason = "lost", time.time(), f"host {host_id} down"
                if not await self.kv_sbx.update(sid, rec, last=e.revision):
                    return  # another replica declared it, or the record moved on
                n += 1
                want = rec.spec.restore_on_host_loss
                err = HostUnreachable(f"host {host_id} stopped heartbeating {ages[host_id]:.0f}s ago; its sandboxes are lost")
                await self.events.sandbox(rec.spec, "lost", host_id=host_id, err=err, reply=False, detail={"restore": "asked"} if want else None)
                if want:
                    restore.append(rec.spec)

        await asyncio.gather(*(one(k) for k in await self.kv_sbx.keys()))
        self.lost += n
        if n:
            log.warning("sandboxes_lost", hosts=sorted(ages), count=n, restoring=len(restore))
        if restore:
            await self._restore(restore)
        return n

    async def _restore(self, specs: list[SandboxSpec]) -> None:
        """Create each again from its latest snapshot; one without a snapshot stays lost (its event says so)."""
        wanted = {s.sandbox_id for s in specs}
        latest: dict[str, SnapshotRecord] = {}
        for key in await self.kv_snaps.keys():
            snap = await self.kv_snaps.get(key)
            if snap is None or snap.sandbox_id not in wanted:
                continue
            cur = latest.get(snap.sandbox_id)
            if cur is None or snap.created_at > cur.created_at:
                latest[snap.sandbox_id] = snap
        now = time.time()
        for spec in specs:
            snap = latest.get(spec.sandbox_id)
            if snap is None:
                log.warning("restore_without_snapshot", sandbox_id=spec.sandbox_id)  # it stays lost, as its event said
                continue
            new = restore_spec(spec, snap, now)
            # De-duplicated by incarnation: a second sweep's copy of this restore is dropped by the stream.
            await self.store(S.REQ_CREATE, codec.encode(CreateSandbox(spec=new)), {S.HDR_MSG_ID: S.incarnation(new.sandbox_id, new.generation)})
            self.restored += 1
            log.warning("restoring", sandbox_id=spec.sandbox_id, snapshot=snap.snapshot_id, generation=new.generation)


__all__ = ["HostLoss", "lost_on_host", "restore_spec"]
