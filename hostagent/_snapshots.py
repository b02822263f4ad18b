"""Snapshot, fork, pause and resume of the sandboxes on this host (the ``snapshot``, ``pause`` and
``resume`` ops), and what a create from a snapshot stacks (``restore_layers``).

A snapshot is a record in KV ``dsec_snapshots`` naming the layers a restore stacks over its template
(the parent's chain, then the layer of what changed since); the layer comes from this host's lazy
loader (``dsec.imaged.<host>.pack``), which packs a staged diff of the upper dir (``_upperdiff``) into
the blob store. Nothing is visible until the record is written: a snapshot that fails on the way
(a blob-store failure, say) leaves no record and the sandbox runs on.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import nats.errors
import structlog
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from bus import codec
from bus import subjects as S
from bus.errors import (
    InvalidArgument,
    SandboxNotRunning,
    SnapshotUnsupported,
    Unavailable,
    UnknownSnapshot,
)
from bus.messages import (
    SnapshotEventKind,
    MAX_FORK_COUNT,
    Done,
    LayerRef,
    PackDirectory,
    PackedLayer,
    PauseRequest,
    SandboxRecord,
    SandboxSpec,
    SnapshotEvent,
    SnapshotRecord,
    SnapshotRequest,
)
from bus.streams import ensure_kv

from . import _storage as storage
from . import _upperdiff as snap
from ._backend import Capabilities, Handle
from ._forks import LocalForks, is_fork_layer
from ._profiles import ProfileCache
from ._records import Records, resumes
from ._registry import LocalSandbox, Registry
from ._rootfs import RootfsLayout
from ._tenancy import check_restore

log = structlog.get_logger("dsec.hostagent.snapshots")

PACK_TIMEOUT_S = 600.0  # mkfs and upload of a large diff (a GiB) on a busy host
MAX_CHAIN = 40  # snapshot layers under one sandbox: overlay's mount options must fit in a page
LAST = "last_snapshot"  # LocalSandbox.extra: the parent of the sandbox's next snapshot


def new_snapshot_id() -> str:
    return f"snap-{uuid.uuid4().hex[:20]}"


def dedup_layers(layers: list[LayerRef]) -> list[LayerRef]:
    """``layers`` (lowest first) with each digest kept at its topmost place only. Two snapshots with
    the same changes pack to the same layer, and overlayfs refuses a lower dir twice (ELOOP); the lower
    copy changes nothing: everything it holds, the upper copy holds over it."""
    seen: set[str] = set()
    out: list[LayerRef] = []
    for lay in reversed(layers):
        if lay.digest in seen:
            continue
        seen.add(lay.digest)
        out.append(lay)
    return out[::-1]


class Snapshots:
    def __init__(
        self, host_id: str, data_dir: str | os.PathLike[str], caps: Capabilities, registry: Registry, records: Records,
        kill: Callable[[str, str], Awaitable[bool]], profiles: ProfileCache | None, nc: Callable[[], NATS | None],
        js: Callable[[], JetStreamContext | None], creating: dict[str, "asyncio.Future[None]"] | None = None, *,
        limits: storage.Limits = storage.NO_CONFIG, reserve_mb: int = storage.WRITE_RESERVE_MB,
    ) -> None:
        self.host_id = host_id
        self.limits = limits  # what a sandbox's and a tenant's snapshots may store (HostAgentConfig)
        self.reserve_mb = reserve_mb
        self.stored: Callable[[str, int], None] = lambda sandbox_id, nbytes: None  # told what each snapshot stored (the disk watch)
        self.data_dir = data_dir
        self.caps = caps  # the backend's abilities: freezing, checkpoints
        self.registry = registry
        self.records = records
        self._kill = kill  # the reaper's kill (a persisted pause ends the sandbox here)
        self.profiles = profiles
        self._nc = nc
        self._js = js
        self._kv: KeyValue | None = None
        self._locks: dict[str, asyncio.Lock] = {}
        # a fork's children on this host stack its frozen upper; the pack follows in the background
        self.forks = LocalForks(data_dir, registry, creating if creating is not None else {}, self.kv, self._pack, self._release_pins)

    async def _release_pins(self, digests: list[str]) -> None:
        await storage.release_pins(self._js(), digests)

    async def kv(self) -> KeyValue:
        if self._kv is None:
            js = self._js()
            assert js is not None
            self._kv = await ensure_kv(js, S.KV_SNAPSHOTS)
        return self._kv

    async def get(self, snapshot_id: str) -> SnapshotRecord:
        if not snapshot_id or not S.valid_token(snapshot_id):
            raise UnknownSnapshot(f"not a snapshot id: {snapshot_id!r}", snapshot_id=snapshot_id)
        try:
            entry = await (await self.kv()).get(snapshot_id)
        except KeyNotFoundError:
            raise UnknownSnapshot(f"unknown snapshot {snapshot_id!r}", snapshot_id=snapshot_id) from None
        if not entry.value:
            raise UnknownSnapshot(f"unknown snapshot {snapshot_id!r} (removed)", snapshot_id=snapshot_id)
        rec: SnapshotRecord = codec.SNAPSHOT.decode(entry.value)
        return rec

    # --- restore -----------------------------------------------------------------------------------
    async def restore_plan(self, spec: SandboxSpec, template_layers: list[LayerRef]) -> tuple[list[LayerRef], LayerRef | None]:
        """A create from ``spec.snapshot``: the template's layers, then the snapshot's chain; and the
        layer of its CRIU dump when it has memory (the processes are restored from it)."""
        self.forks.begin(spec.sandbox_id)  # no fork copy goes from here to the claim (the record may name one)
        claimed: list[LayerRef] = []
        try:
            rec = await self.get(spec.snapshot)
            check_restore(rec, spec)
            if rec.template != spec.template:
                raise InvalidArgument(f"snapshot {rec.snapshot_id} is of template {rec.template!r}, not {spec.template!r}")
            # A fork taken on another host moments ago: its children here take the packed layer.
            rec = await self.forks.wait_packed(rec, self.get, spec.create_deadline or time.time() + PACK_TIMEOUT_S)
            claimed = rec.layers
        finally:
            self.forks.claim(spec.sandbox_id, claimed)
        # A layer's path is where the host that packed it keeps the blob. It is used only under this
        # host's own data dir, where a blobs/<digest> file can only be that very blob; anywhere else
        # the layer comes through the lazy loader, fetched as it is read.
        mine = os.path.join(os.path.realpath(self.data_dir), "")
        own = [lay if lay.path and os.path.realpath(lay.path).startswith(mine) else msgspec.structs.replace(lay, path="") for lay in rec.layers]
        return dedup_layers([*template_layers, *own]), rec.memory_layer

    async def restored(self, ls: "LocalSandbox") -> None:
        """A sandbox created from a snapshot is up: it is the parent of its own first snapshot."""
        spec = ls.spec
        ls.extra[LAST] = spec.snapshot
        self.forks.hold(ls)
        self.registry.save(ls)
        await self._event(spec.snapshot, "restored", sandbox_id=spec.sandbox_id, detail={"generation": str(spec.generation)}, fire=True)

    # --- ops --------------------------------------------------------------------------------------
    def _container(self, handle: "Handle") -> tuple["Handle", str]:
        """What is frozen (the sandbox, through the backend's freezer) and its scratch dir."""
        return handle, self.caps.need_freezer().scratch_dir(handle)

    async def _freeze(self, handle: "Handle", cgroup: "Handle") -> None:
        freezer = self.caps.need_freezer()
        await freezer.before_freeze(handle)  # its idle agent connections closed first
        await freezer.freeze(cgroup)

    async def snapshot(self, ls: "LocalSandbox", handle: "Handle", req: SnapshotRequest) -> SnapshotRecord:
        # A frozen pause is forked as it is, still frozen (E2B's users fork paused sandboxes without resuming them).
        if ls.state != "running" and not (ls.state == "paused" and req.fork_ids):
            raise SandboxNotRunning(f"sandbox {ls.spec.sandbox_id} is {ls.state}: only a running sandbox can be snapshotted", state=ls.state)
        if len(req.fork_ids) > MAX_FORK_COUNT:
            raise InvalidArgument(f"fork count {len(req.fork_ids)} is over the maximum of {MAX_FORK_COUNT}")
        if req.memory:
            self._memory_supported(ls)
        lock = self._locks.setdefault(ls.spec.sandbox_id, asyncio.Lock())
        async with lock:  # one at a time per sandbox: each diffs against the one before
            rec = await self._take(ls, handle, req)
        if req.fork_ids:
            await self._event(rec.snapshot_id, "forked", sandbox_id=ls.spec.sandbox_id, parent_id=rec.parent_id, metadata=rec.metadata,
                              detail={"count": str(len(req.fork_ids)), "sandboxes": ",".join(req.fork_ids)[:4000]}, fire=True)
        return rec

    def _memory_supported(self, ls: "LocalSandbox") -> None:
        """Raise ``snapshot_unsupported`` for what CRIU cannot checkpoint and restore faithfully here."""
        self.caps.need_checkpointer()  # before anything is frozen: a backend that dumps no processes
        if not self.caps.enforces_profiles:
            return  # not CRIU: a VM's hypervisor saves its memory, and no profile's Landlock confines that
        if ls.extra.get("warm_root"):
            # runc hands CRIU the container's configured root, not the one the warm restore pivoted to
            raise SnapshotUnsupported(
                f"sandbox {ls.spec.sandbox_id} was started in a warm container given its snapshot's root, which CRIU cannot "
                "checkpoint: its files can be snapshotted, not its memory (start it with the host's warm pool off to dump it)",
            )
        if not shutil.which("criu", path=os.environ.get("PATH", "") + ":/usr/local/sbin:/usr/sbin"):
            raise SnapshotUnsupported("memory snapshots need CRIU on the host (criu >= 3.19 on this kernel: 3.17 cannot read its vDSO layout)")
        prof = self.profiles.get(ls.spec.profile or "default") if self.profiles is not None else None
        if prof is not None and prof.fs.landlock:
            # CRIU knows nothing of Landlock: a restored process would run unconfined, and its parasite
            # cannot even reach CRIU from inside a domain that scopes abstract unix sockets (EPERM).
            raise SnapshotUnsupported(
                f"profile {prof.name!r} confines the sandbox with Landlock, which CRIU cannot checkpoint or restore: "
                "memory snapshots need a profile with fs.landlock = false", profile=prof.name,
            )
        if ls.spec.network is not None and ls.spec.network.allow_out:
            raise SnapshotUnsupported("memory snapshots of a sandbox with network egress (a host-made veth) are not supported")

    async def _take(self, ls: "LocalSandbox", handle: "Handle", req: SnapshotRequest) -> SnapshotRecord:
        sid = ls.spec.sandbox_id
        snap_id = req.snapshot_id or new_snapshot_id()
        if not S.valid_token(snap_id):
            raise InvalidArgument(f"snapshot_id must be 1-128 of [A-Za-z0-9_-], got {snap_id!r}")
        try:
            done = await self.get(snap_id)
        except UnknownSnapshot:
            done = None
        if done is not None:
            if done.sandbox_id != sid:
                raise InvalidArgument(f"snapshot id {snap_id} is taken by sandbox {done.sandbox_id}")
            return done  # a retried request: it is there already
        cgroup, sdir = self._container(handle)
        parent_id = ls.extra.get(LAST) or ls.spec.snapshot
        chain = (await self.get(parent_id)).layers if parent_id else []
        # A fork's children on this host start over a copy of its frozen upper; the pack follows.
        fast = bool(req.fork_ids) and not req.memory
        if not fast:  # a snapshot (or a persisted pause) is durable and host-independent once answered
            chain = await self.forks.resolve(chain)
        if len(chain) >= MAX_CHAIN:
            raise SnapshotUnsupported(f"sandbox {sid} sits on a chain of {len(chain)} snapshots, the most one sandbox can stack")
        upper = RootfsLayout(sdir).upper
        stage = os.path.join(sdir, snap.STAGE_NAME)
        # quota_exceeded / no_space before anything is staged
        budget = await storage.snapshot_budget(self._js(), ls.spec, self.data_dir, self.limits, self.reserve_mb)
        t0 = time.perf_counter()
        await asyncio.to_thread(snap.remove_stage, stage)  # a crash's leftover
        already = self.caps.need_freezer().frozen(cgroup)  # a frozen pause stays frozen
        if not already:
            await self._freeze(handle, cgroup)
        t_frozen = time.perf_counter()
        local: LayerRef | None = None  # the fork's frozen upper, removed again if the snapshot fails
        try:
            try:
                prev = await asyncio.to_thread(snap.load_index, sdir)
                diff = await asyncio.to_thread(snap.stage_diff, upper, stage, prev)
                await storage.admit(budget, self.data_dir, stage if diff.entries else None, handle if req.memory else None)  # ... nor packed
                local = await asyncio.to_thread(self.forks.freeze_copy, stage, snap_id) if fast and diff.entries else None
                packed = await self._pack(stage) if diff.entries and not fast else None
                await asyncio.to_thread(snap.remove_stage, stage)
                index = await asyncio.to_thread(snap.walk, upper)  # after the stage is gone: unlinking moved ctimes
                memory = await self._dump_memory(handle, snap_id, budget) if req.memory else None  # still frozen: files and memory of one moment
            except OSError as exc:
                if storage.is_no_space(exc):
                    raise storage.no_space(exc, "snapshot") from None
                raise
            finally:
                await asyncio.to_thread(snap.remove_stage, stage)
                if not already:
                    await self.caps.need_freezer().thaw(cgroup)
            frozen_ms = (time.perf_counter() - t_frozen) * 1000
            own = packed.ref if packed is not None else local
            layers = [*chain, own] if own is not None else list(chain)
            added = (packed.uploaded_bytes if packed else 0) + (memory.uploaded_bytes if memory else 0)
            rec = SnapshotRecord(
                snapshot_id=snap_id, sandbox_id=sid, template=ls.spec.template, created_at=time.time(), parent_id=parent_id,
                name=req.name, host_id=self.host_id, layers=layers, bytes_added=added,
                memory=memory is not None, memory_layer=memory.ref if memory else None, metadata=dict(req.metadata), spec=ls.spec,
            )
            try:
                await (await self.kv()).create(snap_id, codec.encode(rec))
            except KeyWrongLastSequenceError:
                raise InvalidArgument(f"snapshot id {snap_id} is taken") from None
        except BaseException:
            if local is not None:
                await asyncio.to_thread(shutil.rmtree, local.path, True)
            raise
        if local is not None or any(is_fork_layer(lay) for lay in chain):
            self.forks.start_pack(snap_id)  # ... and the record names packed layers only once it is in
        await storage.release_pins(self._js(), [p.ref.digest for p in (packed, memory) if p is not None])
        self.stored(sid, added)
        # Only now is the index the base of the next diff: a snapshot that failed above diffs again in full.
        await asyncio.to_thread(snap.save_index, sdir, index)
        ls.extra[LAST] = snap_id
        self.registry.save(ls)
        await self._event(snap_id, "created", sandbox_id=sid, parent_id=parent_id, metadata=rec.metadata, detail={
            "bytes_added": str(rec.bytes_added), "layer": own.digest if own else "", "local": "true" if local else "", "entries": str(diff.entries),
            "whiteouts": str(diff.whiteouts), "frozen_ms": f"{frozen_ms:.1f}", "ms": f"{(time.perf_counter() - t0) * 1000:.1f}",
        })
        log.info("snapshot_created", sandbox_id=sid, snapshot_id=snap_id, entries=diff.entries, bytes_added=rec.bytes_added, frozen_ms=round(frozen_ms, 1))
        return rec

    async def _dump_memory(self, handle: "Handle", snap_id: str, budget: storage.Budget | None = None) -> PackedLayer:
        """CRIU's dump of the (frozen) sandbox, packed as a layer like the files."""
        checkpointer = self.caps.need_checkpointer()
        root = os.path.join(self.data_dir, "criu", snap_id)
        img, work = os.path.join(root, "img"), os.path.join(root, "work")
        try:
            os.makedirs(img)
            os.makedirs(work)
            await checkpointer.checkpoint(handle, img, work)
            if budget is not None:
                budget.charge_dump(await asyncio.to_thread(storage.staged_bytes, img))
            return await self._pack(img, role="memory")
        finally:
            await asyncio.to_thread(shutil.rmtree, root, True)

    async def _pack(self, stage: str, role: str = "snapshot") -> PackedLayer:
        nc = self._nc()
        assert nc is not None
        try:
            msg = await nc.request(S.host_pack(self.host_id), codec.encode(PackDirectory(path=stage, role=role)), timeout=PACK_TIMEOUT_S)
        except nats.errors.NoRespondersError:
            raise Unavailable(f"no lazy loader answers on host {self.host_id}: snapshots need it to pack layers") from None
        except nats.errors.TimeoutError:
            raise Unavailable(f"the lazy loader on host {self.host_id} did not pack the snapshot within {PACK_TIMEOUT_S:g}s") from None
        return codec.decode_reply(msg.data, PackedLayer)

    async def pause(self, ls: "LocalSandbox", handle: "Handle", req: PauseRequest) -> Any:
        sid = ls.spec.sandbox_id
        cgroup, _ = self._container(handle)
        if req.persist:
            if ls.state not in ("running", "paused"):
                raise SandboxNotRunning(f"sandbox {sid} is {ls.state}", state=ls.state)
            lock = self._locks.setdefault(sid, asyncio.Lock())
            async with lock:
                was = ls.state
                ls.state = "running"  # a frozen pause may persist too: _take keeps it frozen throughout
                try:
                    if req.memory:
                        self._memory_supported(ls)
                    rec = await self._take(
                        ls, handle, SnapshotRequest(snapshot_id=req.snapshot_id, name="pause", memory=req.memory, metadata={"pause": "persist"}),
                    )
                except BaseException:
                    ls.state = was
                    raise
            if not await self._kill(sid, "paused"):
                raise SnapshotUnsupported(f"sandbox {sid} was snapshotted ({rec.snapshot_id}) but its teardown is still pending", snapshot_id=rec.snapshot_id)
            self._locks.pop(sid, None)
            paused = SandboxRecord(
                spec=ls.spec, state="paused", host_id="", created_at=ls.spec.requested_at, ready_at=ls.started_at,
                expires_at=0.0, snapshot_id=rec.snapshot_id,
            )
            await self.records.put(paused)
            await self.records.event(ls.spec, "paused", detail={"snapshot_id": rec.snapshot_id, "persist": "true"})
            return rec
        if ls.state == "paused":
            return Done(detail="paused")
        if ls.state != "running":
            raise SandboxNotRunning(f"sandbox {sid} is {ls.state}", state=ls.state)
        await self._freeze(handle, cgroup)
        ls.state = "paused"
        ls.extra["paused"] = handle.extra["paused"] = True  # a restarted host agent keeps it frozen
        self.registry.save(ls)
        await self.records.record(ls, "paused")
        await self.records.event(ls.spec, "paused", detail={"persist": "false"})
        return Done(detail="paused")

    async def resume(self, ls: "LocalSandbox", handle: "Handle") -> Done:
        if ls.state == "running":
            return Done(detail="running")
        if ls.state != "paused":
            raise SandboxNotRunning(f"sandbox {ls.spec.sandbox_id} is {ls.state}", state=ls.state)
        cgroup, _ = self._container(handle)
        await self.caps.need_freezer().thaw(cgroup)
        ls.state = "running"
        ls.extra.pop("paused", None)
        handle.extra.pop("paused", None)
        self.registry.save(ls)
        await self.records.record(ls, "running")
        await self.records.event(ls.spec, "resumed")
        return Done(detail="running")

    # --- events -------------------------------------------------------------------------------------
    async def _event(self, snapshot_id: str, kind: SnapshotEventKind, *, sandbox_id: str = "", parent_id: str = "", metadata: dict[str, str] | None = None,
                     detail: dict[str, str] | None = None, fire: bool = False) -> None:
        """``fire``: not acked (a fork's events, on the path of its children's start); stored again after
        a reconnect that may have lost it, the stream dropping a copy it holds (``Publisher.fire``)."""
        ev = SnapshotEvent(snapshot_id=snapshot_id, kind=kind, at=time.time(), sandbox_id=sandbox_id, parent_id=parent_id,
                           host_id=self.host_id, metadata=metadata or {}, detail=detail or {})
        try:
            assert self.records.publisher is not None
            if fire:
                await self.records.publisher.fire(S.evt_snapshot(snapshot_id, kind), codec.encode(ev),
                                                  headers={S.HDR_MSG_ID: f"snap.{snapshot_id}.{kind}.{sandbox_id}.{ev.detail.get('generation', '')}"})
                return
            await self.records.publisher.store(S.evt_snapshot(snapshot_id, kind), codec.encode(ev))
        except Exception as exc:  # noqa: BLE001 - StoreError, timeout  # the snapshot stands; its provenance event is what is missing
            log.warning("snapshot_event_not_stored", snapshot_id=snapshot_id, kind=kind, error=str(exc))


__all__ = ["Snapshots", "new_snapshot_id", "resumes"]
