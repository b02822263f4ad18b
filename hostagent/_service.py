"""The host agent: admits work placed on this host, runs sandboxes through a backend, serves their ops."""

from __future__ import annotations

import asyncio
import heapq
import os
import socket
import time
from pathlib import Path
from typing import Any

import msgspec
import structlog
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from bus import codec
from bus import subjects as S
from bus.errors import (
    BadRequest,
    CreateFailed,
    DsecError,
    HostRejected,
    InternalError,
    SandboxNotFound,
    SandboxNotRunning,
    SandboxTimeout,
    UnknownTemplate,
)
from bus.messages import (
    CreateSandbox,
    Done,
    ExecRequest,
    ExecResult,
    FileUnwatch,
    FileWatch,
    HostEvent,
    HostStatus,
    InfoRequest,
    KillRequest,
    PauseRequest,
    ResumeRequest,
    SnapshotRequest,
    LayerRef,
    MetricsRequest,
    PlaceBatch,
    PlaceSandbox,
    ProcessStarted,
    ProcConnect,
    ProcDisconnect,
    ProcInput,
    ProcList,
    ProcSignal,
    SandboxEvent,
    SandboxInfo,
    SandboxRecord,
    SandboxSpec,
    SetTimeout,
    StreamAck,
)
from bus.rules import Allocation, Capacity, refusal
from bus.runtime import Publisher, Service, StoreError, error_of, publisher_for, subscribe_sync
from bus.sign import ERR_BAD_SIGNATURE, verify
from bus.streams import StreamOptions, ensure_all, ensure_kv

from ._backend import Backend, Handle
from ._execio import ExecIO, encode_reply
from ._profiles import ProfileCache
from ._snapshots import Snapshots, resumes

log = structlog.get_logger("dsec.hostagent")

_state_json = msgspec.json.Encoder()
LAYERS_TTL_S = 10.0


class LocalSandbox(msgspec.Struct, kw_only=True):
    """What this host keeps on disk about one sandbox, to recover after a crash."""

    spec: SandboxSpec
    pid: int = 0
    extra: dict[str, Any] = {}
    started_at: float = 0.0
    expires_at: float = 0.0
    state: str = "running"


_state_dec = msgspec.json.Decoder(LocalSandbox)


class HostAgent(Service):
    name = "hostagent"

    def __init__(
        self,
        backend: Backend,
        *,
        nats_url: str | None = None,
        host_id: str | None = None,
        data_dir: str = "/var/lib/dsec",
        concurrency: int = 8,
        heartbeat_s: float = 2.0,
        pool: str = "default",
        cpu_overcommit: float = 50.0,
        mem_overcommit: float = 1.0,
        max_sandboxes: int = 0,
        persist_state: bool = True,
        destroy_on_shutdown: bool = False,
        stream_options: StreamOptions = StreamOptions(),
        connection: Any = None,
        grace_s: float = 10.0,
        control_key: bytes | None = None,
    ) -> None:
        super().__init__(nats_url, grace_s=grace_s)
        self.backend = backend
        self.control_key = control_key  # with a key, only work placement signed runs (bus.sign)
        self.host_id = host_id or socket.gethostname().split(".")[0].replace("_", "-")
        if not S.valid_token(self.host_id):
            raise ValueError(f"host id {self.host_id!r} must be 1-128 of [A-Za-z0-9_-]")
        self.data_dir = Path(data_dir)
        self.state_dir = self.data_dir / "hosts" / self.host_id / "sandboxes"
        self.concurrency = concurrency
        self.heartbeat_s = heartbeat_s
        self.pool = pool
        self.cpu_overcommit = cpu_overcommit
        self.mem_overcommit = mem_overcommit
        self.max_sandboxes = max_sandboxes
        self.persist_state = persist_state
        self.destroy_on_shutdown = destroy_on_shutdown
        self.stream_options = stream_options
        self._shared_nc = connection
        self.live: dict[str, LocalSandbox] = {}
        self.handles: dict[str, Handle] = {}
        self._subs: dict[str, Subscription] = {}
        self._creating: dict[str, asyncio.Future[None]] = {}
        self._ops: set[asyncio.Task[Any]] = set()
        self._kv_hosts: KeyValue | None = None
        self._kv_sbx: KeyValue | None = None
        self._kv_images: KeyValue | None = None
        self._layers_cache: dict[str, list[LayerRef]] = {}
        self._layers_at: dict[str, float] = {}
        self.created = 0
        # Running sums of what live sandboxes requested: admission and heartbeats are O(1), not O(live).
        self._alloc_cpu = 0.0
        self._alloc_ls_cpu = 0.0
        self._alloc_mem = 0
        self._alloc_disk = 0
        self._deadlines: list[tuple[float, str]] = []  # heap of (expires_at, sandbox id); stale entries skipped
        self._leased: dict[str, set[str]] = {}  # lease key (owner or sandbox id) -> leased sandboxes here
        self._lease_seen: dict[str, tuple[int, float]] = {}  # lease key -> (KV revision, local time it changed)
        self._lease_checked = 0.0
        self._lease_min = float("inf")  # shortest lease among leased sandboxes here (sets the check period)
        self._kv_leases: KeyValue | None = None
        self.profiles: ProfileCache | None = None  # guard's security profiles (backends that enforce them)
        self._working: dict[str, list[Any]] = {}  # sandbox id -> [host message, last in-progress] while creating
        self._stop_fut: asyncio.Future[Any] | None = None
        self._acks: Publisher | None = None
        self.snapshots = Snapshots(self)
        self.execio = ExecIO(backend, lambda: self.nc, self.host_id)  # exec streaming, background processes, watches

    # --- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        if self._shared_nc is None:
            await super().start()
            return
        # Many simulated hosts can share one connection in scale runs.
        self.nc = self._shared_nc
        self.js = self.nc.jetstream()
        await self.setup()

    async def setup(self) -> None:
        assert self.js is not None
        if self._shared_nc is None:  # many sim hosts on one connection: their runner set streams up once
            await ensure_all(self.js, self.stream_options)
        assert self.nc is not None
        self._acks = await publisher_for(self.nc)
        self._kv_hosts = await ensure_kv(self.js, S.KV_HOSTS)
        self._kv_sbx = await ensure_kv(self.js, S.KV_SANDBOXES)
        self._kv_images = await ensure_kv(self.js, S.KV_IMAGES)
        if getattr(self.backend, "enforces_profiles", False):
            # guard's profiles, watched in KV; built-in copies until guard has written them
            self.profiles = ProfileCache()
            await self.profiles.start(self.js)
        if self.persist_state:
            self.state_dir.mkdir(parents=True, exist_ok=True)
        await self.backend.start()
        await self._recover()
        await self._heartbeat()
        self.spawn(self._heartbeat_loop(), name="heartbeat")
        self.spawn(self._reaper_loop(), name="reaper")
        await self.add_worker(
            stream=S.STREAM_HOST,
            durable=S.host_durable(self.host_id),
            filter_subject=S.host_all(self.host_id),
            handler=self.handle,
            capacity=self.concurrency,
            ack_wait_s=60.0,
            max_ack_pending=self.concurrency,  # a burst waits in the stream, not in this process
            name=f"host-{self.host_id}",
        )
        await self._event_host("up")

    async def teardown(self) -> None:
        for t in list(self._ops):
            t.cancel()
        await self.execio.stop()
        for sub in list(self._subs.values()):
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001
                pass
        self._subs.clear()
        if self.destroy_on_shutdown:
            for sid in list(self.live):
                await self._destroy(sid, "host-shutdown", publish=True)
        try:
            if self._kv_hosts is not None:
                st = self._status()
                st.state = "down"
                await self._kv_hosts.put(self.host_id, codec.encode(st))
            await self._event_host("down")
        except Exception:  # noqa: BLE001 - NATS may already be gone
            pass
        if self.profiles is not None:
            await self.profiles.stop()
        await self.backend.stop()
        if self._acks is not None and self._shared_nc is None:
            await self._acks.stop()
        if self._shared_nc is not None:
            self.nc = None  # not ours to drain

    # --- state --------------------------------------------------------------------------
    def _state_path(self, sid: str) -> Path:
        return self.state_dir / f"{sid}.json"

    def _save(self, ls: LocalSandbox) -> None:
        if not self.persist_state:
            return
        p = self._state_path(ls.spec.sandbox_id)
        tmp = p.with_suffix(".tmp")
        tmp.write_bytes(_state_json.encode(ls))
        os.replace(tmp, p)

    def _forget(self, sid: str) -> None:
        if self.persist_state:
            try:
                self._state_path(sid).unlink()
            except FileNotFoundError:
                pass

    async def _recover(self) -> None:
        """Rebuild the live table from local state and what the backend still runs."""
        if not self.persist_state:
            return
        known: dict[str, LocalSandbox] = {}
        for p in self.state_dir.glob("*.json"):
            try:
                ls = _state_dec.decode(p.read_bytes())
            except (msgspec.DecodeError, OSError):
                log.warning("bad_state_file", path=str(p))
                p.unlink(missing_ok=True)
                continue
            known[ls.spec.sandbox_id] = ls
        handles = {sid: Handle(sid, ls.pid, dict(ls.extra)) for sid, ls in known.items()}
        alive = await self.backend.recover(handles)
        for sid, ls in known.items():
            if sid in alive:
                h = alive[sid]
                ls.pid = h.pid
                self.live[sid] = ls
                self._track(ls, 1)
                self.handles[sid] = h
                await self._serve_ops(sid)
                await self._event(ls.spec, "recovered")
                log.info("recovered", sandbox_id=sid, pid=h.pid)
            else:
                await self.backend.destroy(sid)
                self._forget(sid)
                await self._event(ls.spec, "killed", err=InternalError("sandbox was lost while the host agent was down"))
                await self._record(ls, "killed", end_reason="lost")

    # --- heartbeats -----------------------------------------------------------------------
    def _status(self) -> HostStatus:
        cap = self.backend.capacity()
        cpu, mem, disk = self._alloc_cpu, self._alloc_mem, self._alloc_disk
        return HostStatus(
            host_id=self.host_id,
            backend=self.backend.name,
            at=time.time(),
            pool=self.pool,
            cpu_total=float(cap["cpu_total"]),
            mem_total_mb=int(cap["mem_total_mb"]),
            disk_total_mb=int(cap["disk_total_mb"]),
            cpu_alloc=cpu,
            mem_alloc_mb=int(mem),
            mem_resident_mb=self._resident_mb,
            disk_alloc_mb=int(disk),
            cpu_busy=self._cpu_busy,
            sandboxes=len(self.live),
            max_sandboxes=self.max_sandboxes,
            concurrency=self.concurrency,
            layers=self._cached_layers(),
            cpu_overcommit=self.cpu_overcommit,
            mem_overcommit=self.mem_overcommit,
            cpu_alloc_ls=self._alloc_ls_cpu,
        )

    def _track(self, ls: LocalSandbox, sign: int) -> None:
        """Count a sandbox in (+1) or out (-1) of this host's allocation, deadlines and leases."""
        spec = ls.spec
        self._alloc_cpu += sign * spec.cpu
        self._alloc_mem += sign * spec.memory_mb
        self._alloc_disk += sign * spec.disk_mb
        if spec.priority == "latency-sensitive":
            self._alloc_ls_cpu += sign * spec.cpu
        if not self.live:
            self._alloc_cpu = self._alloc_ls_cpu = 0.0
            self._alloc_mem = self._alloc_disk = 0
        if spec.lease_s > 0:
            key = spec.owner or spec.sandbox_id
            if sign > 0:
                self._leased.setdefault(key, set()).add(spec.sandbox_id)
                self._lease_min = min(self._lease_min, spec.lease_s)
            else:
                ids = self._leased.get(key)
                if ids is not None:
                    ids.discard(spec.sandbox_id)
                    if not ids:
                        del self._leased[key]
                        self._lease_seen.pop(key, None)
                        if not self._leased:
                            self._lease_min = float("inf")
        if sign > 0 and ls.expires_at:
            heapq.heappush(self._deadlines, (ls.expires_at, spec.sandbox_id))

    _resident_mb = 0
    _cpu_busy = 0.0

    def _cached_layers(self) -> list[str]:
        cached = getattr(self.backend, "cached_layers", None)
        return list(cached()) if cached else []

    async def _heartbeat(self) -> None:
        if self._kv_hosts is None:
            return
        try:
            u = await self.backend.usage()
            self._resident_mb, self._cpu_busy = u.mem_resident_mb, u.cpu_busy
        except Exception as exc:  # noqa: BLE001 - a usage probe failure must not stop heartbeats
            log.warning("usage_failed", error=str(exc))
        await self._kv_hosts.put(self.host_id, codec.encode(self._status()))

    async def _pause(self, seconds: float) -> bool:
        """Wait ``seconds`` or until shutdown; True when stopping. One shared stop future, no task per call
        (``wait_for(event.wait())`` made a task each time: 1,600 simulated hosts made thousands a second)."""
        if self._stop_fut is None:
            self._stop_fut = asyncio.ensure_future(self._stopped.wait())
        await asyncio.wait((self._stop_fut,), timeout=seconds)
        return self._stopped.is_set()

    async def _heartbeat_loop(self) -> None:
        while not self._stopped.is_set():
            if await self._pause(self.heartbeat_s):
                return
            try:
                await self._heartbeat()
            except Exception as exc:  # noqa: BLE001
                log.warning("heartbeat_failed", error=str(exc))

    async def _reaper_loop(self) -> None:
        """Kill sandboxes past their timeout."""
        while not self._stopped.is_set():
            if await self._pause(0.5):
                return
            if self._working:
                await self._keep_in_progress(time.monotonic())
            now = time.time()
            dl = self._deadlines
            while dl and dl[0][0] <= now:
                at, sid = heapq.heappop(dl)
                ls = self.live.get(sid)
                if ls is None or ls.expires_at != at or sid in self._creating:
                    continue  # gone, or its timeout was changed (a newer entry is in the heap)
                log.info("sandbox_timeout", sandbox_id=sid)
                try:
                    await self._destroy(sid, "timeout", publish=True)
                except Exception as exc:  # noqa: BLE001
                    log.warning("reap_failed", sandbox_id=sid, error=str(exc))
            if self._leased:
                try:
                    await self._reap_leases(now)
                except Exception as exc:  # noqa: BLE001 - KV unavailable: try again next round
                    log.warning("lease_check_failed", error=str(exc))

    async def _reap_leases(self, now: float) -> None:
        """Kill sandboxes whose client lease was not renewed within their ``lease_s`` (the trainer died).

        One KV read per lease key (an owner's key covers all its sandboxes) every quarter of the shortest
        lease here; a renewal is seen as a change of the key's revision, so host and client clocks never meet.
        """
        if now - self._lease_checked < max(0.25, self._lease_min / 4):
            return
        self._lease_checked = now
        if self._kv_leases is None:
            assert self.js is not None
            self._kv_leases = await ensure_kv(self.js, S.KV_LEASES)
        for key, ids in list(self._leased.items()):
            try:
                rev = (await self._kv_leases.get(key)).revision
            except KeyNotFoundError:
                rev = 0
            seen = self._lease_seen.get(key)
            if seen is None or seen[0] != rev:
                seen = self._lease_seen[key] = (rev, now)
            for sid in list(ids):
                ls = self.live.get(sid)
                if ls is None or sid in self._creating:
                    continue
                if now - max(seen[1], ls.started_at) > ls.spec.lease_s:
                    log.info("lease_expired", sandbox_id=sid, lease_key=key)
                    try:
                        await self._destroy(sid, "lease-expired", publish=True)
                    except Exception as exc:  # noqa: BLE001
                        log.warning("reap_failed", sandbox_id=sid, error=str(exc))

    # --- events and records -------------------------------------------------------------
    async def _event(self, spec: SandboxSpec, kind: str, *, attempt: int = 0, err: DsecError | None = None, detail: dict[str, str] | None = None) -> None:
        assert self.js is not None
        ev = SandboxEvent(
            sandbox_id=spec.sandbox_id, kind=kind, at=time.time(), host_id=self.host_id, attempt=attempt,
            code=err.code if err else "", description=err.description if err else "", detail=detail or {},
        )
        hdr = {S.HDR_MSG_ID: f"{S.incarnation(spec.sandbox_id, spec.generation)}:{kind}:{attempt}"} if kind in ("ready", "failed", "killed", "rejected") else None
        data = codec.encode(ev)
        await self.js.publish(S.evt_sandbox(spec.sandbox_id, kind), data, headers=hdr)
        if kind in ("ready", "failed") and spec.reply_to and self.nc is not None and S.valid_inbox(spec.reply_to):
            await self.nc.publish(spec.reply_to, data)  # the creating client hears it without a subscription of its own

    async def _event_host(self, kind: str) -> None:
        assert self.js is not None
        await self.js.publish(S.evt_host(self.host_id, kind), codec.encode(HostEvent(host_id=self.host_id, kind=kind, at=time.time())))

    async def _record(self, ls: LocalSandbox, state: str, *, end_reason: str = "") -> None:
        if self._kv_sbx is None:
            return
        rec = SandboxRecord(
            spec=ls.spec, state=state, host_id=self.host_id, created_at=ls.spec.requested_at,
            ready_at=ls.started_at, expires_at=ls.expires_at,
            ended_at=time.time() if state in ("killed", "failed") else 0.0, end_reason=end_reason,
        )
        await self._kv_sbx.put(ls.spec.sandbox_id, codec.encode(rec))

    async def _claim(self, spec: SandboxSpec) -> bool:
        """Claim the sandbox id cluster-wide; False when another host already owns it."""
        assert self._kv_sbx is not None
        rec = SandboxRecord(spec=spec, state="placed", host_id=self.host_id, created_at=spec.requested_at)
        try:
            await self._kv_sbx.create(spec.sandbox_id, codec.encode(rec))
            return True
        except KeyWrongLastSequenceError:
            pass
        try:
            entry = await self._kv_sbx.get(spec.sandbox_id)
        except KeyNotFoundError:
            return True
        try:
            cur = codec.SANDBOX_RECORD.decode(entry.value)
        except BadRequest:
            return True
        if resumes(cur, spec):  # a persisted pause resumed: take the id over (unless another host just did)
            try:
                await self._kv_sbx.update(spec.sandbox_id, codec.encode(rec), last=entry.revision)
                return True
            except KeyWrongLastSequenceError:
                return False
        return cur.host_id == self.host_id and cur.state in ("placed", "running")

    # --- create ---------------------------------------------------------------------------------
    async def handle(self, msg: Msg) -> None:
        if not verify(self.control_key, msg.subject, msg.data, msg.headers):
            # Acked, so it is not redelivered forever; kept in the dead-letter stream as evidence.
            assert self.js is not None
            log.warning("unsigned_work_refused", subject=msg.subject, code=ERR_BAD_SIGNATURE)
            await self.js.publish(S.dlq(msg.subject), msg.data, headers={S.HDR_ERROR_CODE: ERR_BAD_SIGNATURE, "Dsec-Origin": msg.subject})
            await msg.ack()
            return
        try:
            work = codec.HOST.decode(msg.data)
        except BadRequest as exc:
            assert self.js is not None
            log.warning("dead_letter", subject=msg.subject, error=str(exc))
            await self.js.publish(S.dlq(msg.subject), msg.data, headers={S.HDR_ERROR_CODE: exc.code, "Dsec-Origin": msg.subject})
            await msg.ack()
            return
        match work:
            case PlaceSandbox():
                # First hand-off of a first attempt: JetStream's de-duplication of <id>:<attempt> already
                # guarantees no other host got this id, so the KV claim round trip is skipped. Redeliveries
                # and re-placements (attempt > 0) claim, as every batch member does.
                # A hand-off placed longer ago than half the window may be a replay JetStream no longer
                # de-duplicates: it claims too.
                first = work.attempt == 0 and not work.claim and (msg.metadata.num_delivered if msg.metadata else 1) == 1 and self._fresh(work.placed_at)
                await self._create_one(work.spec, work.attempt, work.exclude_hosts, msg, claim=not first)
                await msg.ack()
            case PlaceBatch():
                await self._create_batch(work, msg)
                await msg.ack()

    def _fresh(self, placed_at: float) -> bool:
        return abs(time.time() - placed_at) < self.stream_options.dedup_window_s / 2

    def _admits(self, spec: SandboxSpec) -> str:
        """Empty when the sandbox fits on this host now, else why not (the one rule: bus.rules)."""
        cap = self.backend.capacity()
        return refusal(
            Capacity(
                cap["cpu_total"], cap["mem_total_mb"], cap["disk_total_mb"],
                cpu_overcommit=self.cpu_overcommit, mem_overcommit=self.mem_overcommit, max_sandboxes=self.max_sandboxes,
            ),
            Allocation(self._alloc_cpu, self._alloc_ls_cpu, self._alloc_mem, self._alloc_disk, len(self.live)),
            spec,
        )

    async def _layers(self, template: str) -> list[LayerRef]:
        assert self._kv_images is not None
        try:
            entry = await self._kv_images.get(template)
        except KeyNotFoundError:
            raise UnknownTemplate(f"unknown template {template!r}", template=template) from None
        layers = codec.TEMPLATE.decode(entry.value).layers
        self._layers_cache[template] = layers  # a create reads KV at most once per LAYERS_TTL_S per template
        self._layers_at[template] = time.monotonic()
        return layers

    async def _create_one(self, spec: SandboxSpec, attempt: int, excluded: list[str], msg: Msg | None, *, claim: bool = True, held: bool = False) -> None:
        # (no structlog context binding here: it costs more than the rest of a simulated create;
        # the log lines of this path name the sandbox themselves)
        sid = spec.sandbox_id
        if sid in self.live:
            await self._event(spec, "ready", attempt=attempt)  # redelivery: say it again
            return
        if sid in self._creating:
            await self._creating[sid]
            return
        if spec.create_deadline and time.time() > spec.create_deadline:
            # The client gave up (and its kill found nothing): a late or replayed hand-off starts nothing.
            if held and self._kv_sbx is not None:
                await self._kv_sbx.delete(sid)
            log.info("create_expired", sandbox_id=sid)
            await self._event(spec, "failed", attempt=attempt, err=SandboxTimeout(f"create request for {sid} expired before the host started it"))
            return
        why = self._admits(spec)
        if why:
            if held and self._kv_sbx is not None:  # give back the batch's claim so another host can take it
                await self._kv_sbx.delete(sid)
            await self._reject(spec, attempt, excluded, why)
            return
        if claim and not await self._claim(spec):
            log.info("duplicate_create_dropped", sandbox_id=sid)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._creating[sid] = fut
        try:
            await self._do_create(spec, attempt, msg, claimed=claim or held)
        finally:
            self._creating.pop(sid, None)
            fut.set_result(None)

    async def _create_batch(self, work: PlaceBatch, msg: Msg) -> None:
        """Every member of a batch is claimed (another host may hold a re-placed copy); the claims go out
        pipelined, one round trip for the whole batch, then each member is created as a single one."""
        assert self.js is not None
        if not (work.claim or work.attempt or (msg.metadata.num_delivered if msg.metadata else 1) > 1) and self._fresh(work.placed_at):
            # First hand-off of a first-time batch: create first, then claim with the record itself
            # (see _do_create); a copy handed to another host after a placement crash loses that race.
            await asyncio.gather(*(self._create_one(s, work.attempt, [], msg, claim=False) for s in work.specs))
            return
        todo = [s for s in work.specs if s.sandbox_id not in self.live and s.sandbox_id not in self._creating and not self._admits(s)]
        claimed: set[str] = set()
        if todo:
            assert self._acks is not None
            acks = self._acks

            async def claim(s: SandboxSpec) -> bool:
                rec = SandboxRecord(spec=s, state="placed", host_id=self.host_id, created_at=s.requested_at)
                try:  # a KV create: stored only if the key has no value yet
                    await acks.store(f"$KV.{S.KV_SANDBOXES}.{s.sandbox_id}", codec.encode(rec), {"Nats-Expected-Last-Subject-Sequence": "0"})
                    return True
                except Exception:  # noqa: BLE001 - taken or no answer: the one-by-one path below claims again
                    return False

            for s, ok in zip(todo, await asyncio.gather(*(claim(s) for s in todo)), strict=True):
                if ok:
                    claimed.add(s.sandbox_id)
        # Members not claimed above (taken already, or admission said no) take the one-by-one path,
        # which re-checks the claim and rejects or re-places as a single create would.
        await asyncio.gather(*(
            self._create_one(s, work.attempt, [], msg, claim=s.sandbox_id not in claimed, held=s.sandbox_id in claimed) for s in work.specs
        ))

    async def _reject(self, spec: SandboxSpec, attempt: int, excluded: list[str], why: str) -> None:
        assert self.js is not None
        err = HostRejected(f"host {self.host_id} is full: {why}", host_id=self.host_id)
        again = CreateSandbox(spec=spec, attempt=attempt + 1, exclude_hosts=[*excluded, self.host_id], last_error=err.description)
        await self.js.publish(S.REQ_CREATE, codec.encode(again), headers={S.HDR_MSG_ID: f"{S.incarnation(spec.sandbox_id, spec.generation)}:{attempt + 1}"})
        await self._event(spec, "rejected", attempt=attempt, err=err)
        log.info("rejected", sandbox_id=spec.sandbox_id, reason=why)

    async def _do_create(self, spec: SandboxSpec, attempt: int, msg: Msg | None, *, claimed: bool = True) -> None:
        """Create, then store the record and announce ``ready``.

        ``claimed``: this host already holds the id's claim (a KV create before creating). Otherwise the
        record itself is the claim, written with a KV create once the sandbox exists: if another host's
        record is there first, this copy is destroyed silently and the other host's stands.
        """
        t0 = time.perf_counter()
        if msg is not None:  # the reaper loop tells JetStream a slow create is still in progress
            self._working[spec.sandbox_id] = [msg, time.monotonic()]
        try:
            layers = self._layers_cache.get(spec.template)
            if layers is None or time.monotonic() - self._layers_at.get(spec.template, 0.0) > LAYERS_TTL_S:
                layers = await self._layers(spec.template)
            memory = None
            if spec.snapshot:
                layers, memory = await self.snapshots.restore_plan(spec, layers)
            if memory is not None:
                handle = await self.backend.create(spec, layers, security=self.profiles.enforcement(spec.profile) if self.profiles else None, memory=memory)  # type: ignore[call-arg]
            elif self.profiles is not None:
                handle = await self.backend.create(spec, layers, security=self.profiles.enforcement(spec.profile))  # type: ignore[call-arg]
            else:
                handle = await self.backend.create(spec, layers)
        except DsecError as exc:
            await self.backend.destroy(spec.sandbox_id)
            await self._fail(spec, attempt, exc)
            return
        except Exception as exc:  # noqa: BLE001 - report, clean up, keep serving
            log.exception("create_failed", sandbox_id=spec.sandbox_id)
            await self.backend.destroy(spec.sandbox_id)
            await self._fail(spec, attempt, CreateFailed(f"{type(exc).__name__}: {exc}"))
            return
        finally:
            self._working.pop(spec.sandbox_id, None)
        now = time.time()
        ls = LocalSandbox(spec=spec, pid=handle.pid, extra=handle.extra, started_at=now, expires_at=now + spec.timeout_s)
        self.live[spec.sandbox_id] = ls
        self._track(ls, 1)
        self.handles[spec.sandbox_id] = handle
        self._save(ls)
        await self._serve_ops(spec.sandbox_id)
        assert self.js is not None
        rec = codec.encode(SandboxRecord(
            spec=spec, state="running", host_id=self.host_id, created_at=spec.requested_at, ready_at=ls.started_at, expires_at=ls.expires_at,
        ))
        if claimed:
            await self._store(f"$KV.{S.KV_SANDBOXES}.{spec.sandbox_id}", rec)
        elif not await self._claim_record(spec.sandbox_id, rec):
            await self._destroy(spec.sandbox_id, "duplicate", publish=False)
            log.info("duplicate_create_dropped", sandbox_id=spec.sandbox_id)
            return
        if spec.snapshot:
            await self.snapshots.restored(ls)
        ev = SandboxEvent(
            sandbox_id=spec.sandbox_id, kind="ready", at=time.time(), host_id=self.host_id, attempt=attempt,
            detail={"create_ms": f"{(time.perf_counter() - t0) * 1000:.1f}"},
        )
        data = codec.encode(ev)
        await self._store(S.evt_sandbox(spec.sandbox_id, "ready"), data, {S.HDR_MSG_ID: f"{S.incarnation(spec.sandbox_id, spec.generation)}:ready:{attempt}"})
        if spec.reply_to and self.nc is not None and S.valid_inbox(spec.reply_to):
            await self.nc.publish(spec.reply_to, data)  # the creating client hears it without a subscription of its own
        self.created += 1
        log.info("sandbox_ready", sandbox_id=spec.sandbox_id, ms=round((time.perf_counter() - t0) * 1000, 1), template=spec.template)

    async def _store(self, subject: str, data: bytes, headers: dict[str, str] | None = None) -> None:
        """An acked JetStream write (raises when not stored: the work stays un-acked and is redelivered)."""
        assert self._acks is not None
        try:
            await self._acks.store(subject, data, headers)
        except (StoreError, asyncio.TimeoutError) as exc:
            raise InternalError(f"not stored on {subject}: {exc}") from None

    async def _claim_record(self, sid: str, rec: bytes) -> bool:
        """Write the record only if the id has none (a KV create); False when another host owns the id."""
        assert self._acks is not None and self._kv_sbx is not None
        try:
            await self._acks.store(f"$KV.{S.KV_SANDBOXES}.{sid}", rec, {"Nats-Expected-Last-Subject-Sequence": "0"})
            return True
        except StoreError:
            pass
        try:
            await self._kv_sbx.create(sid, rec)  # handles a deleted key's tombstone
            return True
        except KeyWrongLastSequenceError:
            pass
        try:
            cur = codec.SANDBOX_RECORD.decode((await self._kv_sbx.get(sid)).value)
        except (KeyNotFoundError, BadRequest):
            return False
        if cur.host_id == self.host_id and cur.state in ("placed", "running") or resumes(cur, codec.SANDBOX_RECORD.decode(rec).spec):
            await self._kv_sbx.put(sid, rec)  # ours (an earlier delivery of the same work), or a persisted pause resumed
            return True
        return False

    async def _keep_in_progress(self, now: float) -> None:
        """Every 15 s (well inside ack_wait) a create still running says so, so it is not redelivered."""
        for w in list(self._working.values()):
            if now - w[1] >= 15.0:
                w[1] = now
                try:
                    await w[0].in_progress()
                except Exception:  # noqa: BLE001
                    pass

    async def _fail(self, spec: SandboxSpec, attempt: int, err: DsecError) -> None:
        log.warning("create_failed", sandbox_id=spec.sandbox_id, code=err.code, reason=err.description)
        await self._event(spec, "failed", attempt=attempt, err=err)
        if self._kv_sbx is not None:
            rec = SandboxRecord(spec=spec, state="failed", host_id=self.host_id, ended_at=time.time(), end_reason=err.code)
            await self._kv_sbx.put(spec.sandbox_id, codec.encode(rec))

    # --- destroy ----------------------------------------------------------------------------
    async def _destroy(self, sid: str, reason: str, *, publish: bool) -> None:
        ls = self.live.pop(sid, None)
        if ls is not None:
            self._track(ls, -1)
        self.handles.pop(sid, None)
        self.execio.forget(sid)
        sub = self._subs.pop(sid, None)
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001
                pass
        await self.backend.destroy(sid)
        self._forget(sid)
        if ls is not None and publish:
            await self._record(ls, "killed", end_reason=reason)
            if reason == "timeout":
                await self._event(ls.spec, "timeout")
            await self._event(ls.spec, "killed", detail={"reason": reason})

    # --- per-sandbox ops (core request/reply) ---------------------------------------------
    async def _serve_ops(self, sid: str) -> None:
        assert self.nc is not None
        if sid in self._subs:
            return
        self._subs[sid] = await subscribe_sync(self.nc, S.sbx_all(sid), self._on_op_now)

    async def _on_op(self, msg: Msg) -> None:
        self._on_op_now(msg)

    def _on_op_now(self, msg: Msg) -> None:
        # Ops of one sandbox run concurrently: a long exec must not hold up a file read.
        t = asyncio.create_task(self._op(msg))
        self._ops.add(t)
        t.add_done_callback(self._ops.discard)

    async def _op(self, msg: Msg) -> None:
        if S.is_stream_delivery(msg.reply):
            # A push consumer anyone may create can deliver stored bytes here, past the publish
            # permissions on dsec.sbx.<id>.*, under the stored message's own subject (a KV key like
            # "<id>.kill" makes it look like an op); a real request's reply is an inbox. Not answered:
            # the reply would ack the attacker's consumer.
            log.warning("stream_delivered_op_refused", subject=msg.subject)
            return
        parts = msg.subject.split(".")
        if len(parts) != 4:
            return
        sid, op = parts[2], parts[3]
        structlog.contextvars.bind_contextvars(sandbox_id=sid, subject=msg.subject)
        t0 = time.perf_counter()
        code = "ok"
        try:
            dec = codec.SBX_REQUEST_DECODERS.get(op)
            if dec is None:
                raise BadRequest(f"unknown operation {op!r}; one of {', '.join(S.SBX_OPS)}")
            req = dec.decode(msg.data)
            result = await self._dispatch(sid, req)
        except DsecError as exc:
            code = exc.code
            result = exc.to_reply()
        except Exception as exc:  # noqa: BLE001 - every request gets an answer
            log.exception("op_failed")
            result = error_of(exc)
            code = result.code
        finally:
            structlog.contextvars.unbind_contextvars("sandbox_id", "subject")
        if msg.reply:
            try:
                # Within the server's payload limit: output cut to fit, anything else a typed error.
                await msg.respond(encode_reply(result, self.nc.max_payload if self.nc is not None else 1 << 20))
            except Exception as exc:  # noqa: BLE001
                log.warning("reply_failed", sandbox_id=sid, error=str(exc))
        log.debug("op", sandbox_id=sid, op=op, code=code, ms=round((time.perf_counter() - t0) * 1000, 2))

    async def _dispatch(self, sid: str, req: Any) -> Any:
        handle = self.handles.get(sid)
        ls = self.live.get(sid)
        if handle is None or ls is None:
            raise SandboxNotFound(f"sandbox {sid} is not running on this host")
        if ls.state == "paused" and not isinstance(req, (InfoRequest, KillRequest, SetTimeout, PauseRequest, ResumeRequest)):
            raise SandboxNotRunning(f"sandbox {sid} is paused: resume it first", state="paused")
        match req:
            case ExecRequest():
                return await self._exec(handle, ls, req)
            case SnapshotRequest():
                return await self.snapshots.snapshot(ls, handle, req)
            case PauseRequest():
                return await self.snapshots.pause(ls, handle, req)
            case ResumeRequest():
                return await self.snapshots.resume(ls, handle)
            case StreamAck():
                self.execio.ack(sid, req)
                return Done()
            case ProcList() | ProcSignal() | ProcInput() | ProcConnect() | ProcDisconnect():
                return await self.execio.proc(handle, req)
            case FileWatch() | FileUnwatch():
                return await self.execio.watch(handle, req)
            case MetricsRequest():
                return await self.execio.metrics(handle)
            case KillRequest(reason=reason):
                await self._destroy(sid, reason or "user", publish=True)
                return Done(detail="killed")
            case SetTimeout(timeout_s=t):
                if t <= 0:
                    raise BadRequest("timeout must be > 0 seconds")
                ls.expires_at = time.time() + t
                heapq.heappush(self._deadlines, (ls.expires_at, sid))
                self._save(ls)
                await self._record(ls, "running")
                return Done()
            case InfoRequest():
                return SandboxInfo(
                    sandbox_id=sid, state=ls.state, host_id=self.host_id, template=ls.spec.template,
                    started_at=ls.started_at, expires_at=ls.expires_at, metadata=ls.spec.metadata, pid=handle.pid,
                )
            case _:
                return await self.backend.files(handle, req)

    async def _exec(self, handle: Handle, ls: LocalSandbox, req: ExecRequest) -> ExecResult | ProcessStarted:
        return await self.execio.exec(handle, ls.spec.envs, req)


__all__ = ["HostAgent", "LocalSandbox"]
