"""Fork at clone speed on this host: a fork's snapshot is not packed before its children start.

While the source is frozen, the staged diff of its upper dir (``_upperdiff``: hard links into the
source's upper, which the source would go on changing in place) is copied to
``<data>/forks/<snapshot id>`` (``cp -a --reflink=auto``: a reflink where the file system has them,
else a copy; whiteouts, opaque dirs, xattrs, owners, modes, times and hard links kept), the source is
thawed, and the snapshot's record names that directory as its own layer (role ``fork``, kind
``dir``). Children on this host stack it read-only as an overlay lower dir: what they see is the
source's state at the fork, and each writes its own upper. The pack to the chunk store runs in the
background; once it is in, the record names the packed layer instead (and any parent's fork layer it
still named, once that parent's pack is in), so children on other hosts, which wait for it
(``wait_packed``), and every later restore use the lazy image path as before.

A fork directory is removed once its layer is packed and no sandbox on this host stacks it (nor is
being created over it): the children keep it, not the source, so the source may be killed while
they run. Who stacks what is kept in each child's ``LocalSandbox.extra`` (it survives a restart of
the host agent); ``recover`` packs what a restart interrupted and removes what nothing needs.

The children need not be cold containers: the container backend gives a restore a warm container of
its template and profile (``backends.container.warmroot``; its agent confines itself, Landlock
included, only once it has the restore's root); what this module keeps is the same either way (the
child stacks the fork directory by path).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

import msgspec
import structlog
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from bus import codec
from bus.errors import DsecError, SnapshotUnsupported, Unavailable
from bus.messages import LayerRef, PackedLayer, SnapshotRecord

from ._registry import LocalSandbox, Registry

log = structlog.get_logger("dsec.hostagent.forks")

ROLE = "fork"  # LayerRef.role of a fork's frozen upper: a directory on the host that took it, until packed
FORKS_DIR = "forks"
USES = "fork_layers"  # LocalSandbox.extra: the snapshot ids whose fork directories the sandbox stacks
PACK_ATTEMPTS = 5
WAIT_PACKED_S = 600.0  # a child on another host waits this long at most for the pack (a GiB on a busy host)


def is_fork_layer(ref: LayerRef) -> bool:
    return ref.role == ROLE and ref.kind == "dir"


def owner_of(ref: LayerRef) -> str:
    """The snapshot whose frozen upper a fork layer is (its directory's name)."""
    return os.path.basename(ref.path.rstrip("/")) if ref.path else ""


def copy_tree(src: str, dest: str) -> None:
    """``src`` copied to ``dest`` (which must not exist) with everything an overlay lower needs; a
    half-made copy is removed."""
    tmp = dest + ".part"
    shutil.rmtree(tmp, ignore_errors=True)
    r = subprocess.run(["cp", "-a", "--reflink=auto", "--", src, tmp], capture_output=True, text=True)
    if r.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OSError(f"cannot copy the fork's files: {r.stderr.strip()[-500:]}")
    os.replace(tmp, dest)


class LocalForks:
    def __init__(
        self, data_dir: str | os.PathLike[str], registry: Registry, creating: dict[str, "asyncio.Future[None]"],
        kv: Callable[[], Awaitable[KeyValue]], pack: Callable[[str], Awaitable[PackedLayer]],
        release_pins: Callable[[list[str]], Awaitable[None]],
    ) -> None:
        self.dir = Path(data_dir) / FORKS_DIR
        self.registry = registry
        self.creating = creating  # sandboxes being made now: a claim of one of them holds its fork dirs
        self._kv = kv
        self._pack = pack
        self._release_pins = release_pins
        self._claims: dict[str, set[str]] = {}  # sandbox id -> snapshot ids it is being created over
        self._tasks: dict[str, asyncio.Task[None]] = {}  # background packs, by snapshot id
        self._packed: dict[str, LayerRef] = {}  # snapshot id -> its packed layer (this run)
        self._sweep: asyncio.Task[list[str]] | None = None
        self._again = False
        self._reading: set[str] = set()  # restores reading their snapshot's record, not claimed yet
        self._deferred = False  # a sweep found one: the claim sweeps again
        registry.observers.append(self._observe)

    def path(self, snapshot_id: str) -> str:
        return str(self.dir / snapshot_id)

    def local(self, ref: LayerRef) -> bool:
        return is_fork_layer(ref) and os.path.isdir(ref.path) and os.path.dirname(os.path.realpath(ref.path)) == os.path.realpath(self.dir)

    # --- the fork ---------------------------------------------------------------------------------
    def freeze_copy(self, stage: str, snapshot_id: str) -> LayerRef:
        """The staged diff, copied (the source is frozen) to this snapshot's fork directory."""
        self.dir.mkdir(parents=True, exist_ok=True)
        dest = self.path(snapshot_id)
        copy_tree(stage, dest)
        # Not a content digest (the content is hashed when it is packed): unique per fork, in the
        # format every layer's digest has.
        digest = "sha256:" + hashlib.sha256(f"{ROLE}:{snapshot_id}".encode()).hexdigest()
        return LayerRef(role=ROLE, digest=digest, kind="dir", path=dest)

    def start_pack(self, snapshot_id: str) -> None:
        if snapshot_id in self._tasks:
            return
        task = asyncio.ensure_future(self._pack_later(snapshot_id))
        self._tasks[snapshot_id] = task
        task.add_done_callback(lambda t: self._tasks.pop(snapshot_id, None) if self._tasks.get(snapshot_id) is t else None)

    async def _pack_later(self, snapshot_id: str) -> None:
        """Pack the fork's directory (when it has one: a fork that changed nothing since its parent has
        none, but its record may still name the parent's), then settle its record."""
        t0 = time.perf_counter()
        delay = 0.5
        packed: PackedLayer | None = None
        if not os.path.isdir(self.path(snapshot_id)):
            try:
                await self._settle(snapshot_id, None)
            except (DsecError, OSError) as exc:
                log.warning("fork_record_not_updated", snapshot_id=snapshot_id, error=str(exc))
            return
        for attempt in range(1, PACK_ATTEMPTS + 1):
            try:
                packed = await self._pack(self.path(snapshot_id))
                break
            except (DsecError, OSError) as exc:
                log.warning("fork_pack_failed", snapshot_id=snapshot_id, attempt=attempt, error=str(exc))
                if attempt < PACK_ATTEMPTS:
                    await asyncio.sleep(delay)  # backoff: the lazy loader restarting, the store away
                    delay *= 4
        if packed is None:
            return  # its children here run on; recover() tries again at the next start
        self._packed[snapshot_id] = packed.ref
        try:
            await self._settle(snapshot_id, packed)
        except (DsecError, OSError) as exc:
            log.warning("fork_record_not_updated", snapshot_id=snapshot_id, error=str(exc))
            return
        await self._release_pins([packed.ref.digest])
        log.info("fork_packed", snapshot_id=snapshot_id, bytes_added=packed.uploaded_bytes, ms=round((time.perf_counter() - t0) * 1000, 1))
        self._tasks.pop(snapshot_id, None)  # done: the sweep below may take its copy (this task would hold it)
        self.sweep_soon()

    async def _settle(self, snapshot_id: str, packed: PackedLayer | None) -> None:
        """The record names the packed layer instead of the directory (and its parents' packed layers
        instead of theirs): every host can restore it now."""
        kv = await self._kv()
        while True:
            try:
                entry = await kv.get(snapshot_id)
            except KeyNotFoundError:
                return  # removed meanwhile: nothing names the layer
            if not entry.value:
                return
            rec: SnapshotRecord = codec.SNAPSHOT.decode(entry.value)
            layers = rec.layers
            if packed is not None:
                layers = [packed.ref if is_fork_layer(lay) and owner_of(lay) == snapshot_id else lay for lay in layers]
            layers = await self.resolve(layers)
            added = packed.uploaded_bytes if packed is not None else 0
            new = msgspec.structs.replace(rec, layers=layers, bytes_added=rec.bytes_added + added)
            try:
                await kv.update(snapshot_id, codec.encode(new), last=entry.revision)
                return
            except KeyWrongLastSequenceError:
                continue  # written meanwhile (its own parent settled?): again from the new revision

    async def resolve(self, layers: list[LayerRef], timeout: float = WAIT_PACKED_S) -> list[LayerRef]:
        """``layers`` with each fork layer of this host replaced by its packed layer, waiting for its
        background pack (a snapshot whose parent was a fork taken moments before)."""
        if not any(is_fork_layer(lay) for lay in layers):
            return layers
        out = []
        for lay in layers:
            out.append(await self._packed_ref(owner_of(lay), timeout) if is_fork_layer(lay) else lay)
        return out

    async def _packed_ref(self, owner: str, timeout: float) -> LayerRef:
        deadline = time.monotonic() + timeout
        delay = 0.02
        while True:
            ref = self._packed.get(owner)
            if ref is not None:
                return ref
            ref = await self._from_record(owner)
            if ref is not None:
                return ref
            if owner not in self._tasks and os.path.isdir(self.path(owner)):
                self.start_pack(owner)  # a restart lost its pack
            if time.monotonic() > deadline:
                raise Unavailable(f"the layer of fork snapshot {owner} was not packed within {timeout:g}s")
            await asyncio.sleep(delay)  # poll: the pack finishes in its own task
            delay = min(delay * 2, 0.5)

    async def _from_record(self, owner: str) -> LayerRef | None:
        kv = await self._kv()
        try:
            entry = await kv.get(owner)
        except KeyNotFoundError:
            raise SnapshotUnsupported(f"fork snapshot {owner} was removed before its layer was packed", snapshot_id=owner) from None
        if not entry.value:
            raise SnapshotUnsupported(f"fork snapshot {owner} was removed before its layer was packed", snapshot_id=owner)
        rec: SnapshotRecord = codec.SNAPSHOT.decode(entry.value)
        own = rec.layers[-1] if rec.layers else None
        return own if own is not None and not is_fork_layer(own) else None

    async def wait_packed(self, rec: SnapshotRecord, get: Callable[[str], Awaitable[SnapshotRecord]], deadline: float) -> SnapshotRecord:
        """The record once it names no other host's fork layer (a child placed away from its source)."""
        delay = 0.05
        while any(is_fork_layer(lay) and not self.local(lay) for lay in rec.layers):
            if time.time() > deadline:
                raise Unavailable(f"snapshot {rec.snapshot_id} is still being packed on host {rec.host_id or '?'}")
            await asyncio.sleep(delay)  # poll the record: its host rewrites it once the pack is in
            delay = min(delay * 2, 1.0)
            rec = await get(rec.snapshot_id)
        return rec

    # --- who stacks a fork directory -------------------------------------------------------------------
    def begin(self, sandbox_id: str) -> None:
        """A restore starts reading its snapshot's record: until it has claimed what that names, no
        fork directory is removed (the record it reads may name one a sweep is about to take)."""
        self._reading.add(sandbox_id)

    def claim(self, sandbox_id: str, layers: Iterable[LayerRef]) -> list[str]:
        """A create over ``layers`` begins: their fork directories stay (its ``LocalSandbox.extra`` holds
        them from ``hold`` on). Returns the snapshot ids claimed."""
        owners = sorted({owner_of(lay) for lay in layers if is_fork_layer(lay)})
        if owners:
            self._claims.setdefault(sandbox_id, set()).update(owners)
        self._reading.discard(sandbox_id)
        if self._deferred and not self._reading:
            self.sweep_soon()
        return owners

    def hold(self, ls: LocalSandbox) -> None:
        """The sandbox is up: what it stacks goes into its (persisted) extra."""
        owners = self._claims.get(ls.spec.sandbox_id)
        if owners:
            ls.extra = {**ls.extra, USES: sorted(owners)}

    def _observe(self, ls: LocalSandbox, sign: int) -> None:
        if sign < 0 and (ls.extra.get(USES) or ls.spec.sandbox_id in self._claims):
            self._claims.pop(ls.spec.sandbox_id, None)
            self.sweep_soon()

    def in_use(self) -> set[str] | None:
        """The snapshot ids whose fork directories something here stacks; None while a restore is
        still reading its record (anything may be in use)."""
        self._reading.intersection_update(self.creating)  # a create that failed before its claim
        if self._reading:
            self._deferred = True
            return None
        self._deferred = False
        used: set[str] = set()
        for sid, owners in list(self._claims.items()):
            if sid in self.creating or sid in self.registry.live:
                used.update(owners)
            else:
                del self._claims[sid]  # the create failed: nothing stacks these for it
        for ls in self.registry.live.values():
            used.update(ls.extra.get(USES) or ())
        return used

    def sweep_soon(self) -> None:
        self._again = True  # a sweep under way looks again before it ends
        if self._sweep is None or self._sweep.done():
            try:
                self._sweep = asyncio.get_running_loop().create_task(self.sweep())
            except RuntimeError:
                pass  # no loop (a registry used outside the service): the next sweep does it

    async def sweep(self) -> list[str]:
        """Remove the fork directories that are packed and that nothing here stacks. Returns them."""
        gone: list[str] = []
        self._again = True
        while self._again:
            self._again = False
            used = self.in_use()
            if used is None:
                break  # the restore's claim sweeps again
            for s in [s for s in list(self._packed) if s not in used and s not in self._tasks]:
                await asyncio.to_thread(shutil.rmtree, self.path(s), True)
                self._packed.pop(s, None)
                gone.append(s)
        if gone:
            log.info("fork_dirs_removed", snapshots=",".join(gone)[:500])
        return gone

    async def recover(self) -> None:
        """At start: a fork directory whose record still names it is packed again; one whose record is
        packed or removed goes once nothing stacks it; a half-made copy goes."""
        if not self.dir.is_dir():
            return
        for d in sorted(self.dir.iterdir()):
            if d.name.endswith(".part"):
                await asyncio.to_thread(shutil.rmtree, d, True)
                continue
            try:
                ref = await self._from_record(d.name)
            except SnapshotUnsupported:
                ref = None  # removed: nothing will pack it; it goes when unused
            if ref is None and await self._named(d.name):
                self.start_pack(d.name)
            else:
                self._packed[d.name] = ref or LayerRef(role=ROLE, digest="", kind="dir", path=str(d))
        await self.sweep()

    async def _named(self, snapshot_id: str) -> bool:
        kv = await self._kv()
        try:
            entry = await kv.get(snapshot_id)
        except KeyNotFoundError:
            return False
        return bool(entry.value)

    async def stop(self) -> None:
        """Background packs stop (``recover`` does them again); what is packed and unused goes now."""
        if self._sweep is not None:
            await asyncio.gather(self._sweep, return_exceptions=True)
        await self.sweep()
        for t in [*self._tasks.values(), *([self._sweep] if self._sweep else [])]:
            t.cancel()
        for t in [*self._tasks.values(), *([self._sweep] if self._sweep else [])]:
            try:
                await t
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - a pack cut short is done again at the next start
                pass


__all__ = ["LocalForks", "ROLE", "USES", "copy_tree", "is_fork_layer", "owner_of"]
