"""Intake: the handler of the host's hand-offs (bus.runtime.handoff: placement holds the request until
this answers). Admits work placed on this host (one create or a batch), claims ids, creates through the
backend, records and announces ``ready``; rejects what does not fit."""

from __future__ import annotations

import asyncio
import time
from typing import Any
import structlog
from nats.aio.msg import Msg

from bus import codec
from bus import subjects as S
from bus.errors import (
    BadRequest,
    CreateFailed,
    DsecError,
    HostRejected,
    InternalError,
    PermissionDenied,
    SandboxTimeout,
    UnknownTemplate,
    UnsupportedBackend,
)
from bus.messages import CreateSandbox, LayerRef, PlaceBatch, PlaceSandbox, SandboxRecord, SandboxSpec
from bus.messages import ImageDefaults, TemplateManifest
from bus.rules import Allocation, Capacity, refusal
from bus.runtime import KV, Claim, LookupFailed, ReadyScan, find_ready_many, own_ready_since
from bus.sign import ERR_BAD_SIGNATURE, verify

from ._backend import Backend, Capabilities
from ._config import HostAgentConfig
from ._metrics import HostMetrics
from ._ops import OpsEndpoint
from ._profiles import ProfileCache
from ._reaper import Reaper
from ._records import Records
from ._registry import LocalSandbox, Registry
from ._snapshots import Snapshots
from ._tenancy import check_template

log = structlog.get_logger("dsec.hostagent")

LAYERS_TTL_S = 10.0
# Ids announced in a batch ready event, remembered (the latest this many) so a redelivered hand-off
# that finds one here does not say it again in an event of its own, which the stream could not
# de-duplicate against the batch's.
ANNOUNCED_KEPT = 65536
# A duplicate create dropped for another host's running record made less than this long ago: that
# host's batch event naming it (or its own) is looked for until then before ``ready`` is said from
# the record (the maker died before announcing it).
DROPPED_WAIT_S = 45.0  # past a stream leader's election and the maker's storing again of what it fired meanwhile (bus.runtime.publisher)
DROPPED_MAX_S = 120.0  # while the stream does not answer at all
DROPPED_POLL_S = 0.5


class Intake:
    def __init__(
        self, config: HostAgentConfig, backend: Backend, caps: Capabilities, profiles: ProfileCache | None, registry: Registry, records: Records,
        reaper: Reaper, ops: OpsEndpoint, snapshots: Snapshots, m: HostMetrics, creating: dict[str, asyncio.Future[None]],
        dedup_window_s: float,
    ) -> None:
        self.config = config
        self.host_id = config.host_id
        self.backend = backend
        self.caps = caps
        self.backends = frozenset([backend.name])  # what this host runs; a hand-off for another is refused
        self.profiles = profiles
        self.registry = registry
        self.records = records
        self.reaper = reaper
        self.ops = ops
        self.snapshots = snapshots
        self.m = m
        self.dedup_window_s = dedup_window_s
        self.creating = creating
        self.created = 0
        self.announced: dict[str, None] = {}  # insertion-ordered: ANNOUNCED_KEPT
        self._later: set[asyncio.Task[None]] = set()  # duplicates' ready said from the record, once its maker had its chance
        self.kv_images: KV[TemplateManifest] | None = None
        self._layers_cache: dict[str, list[LayerRef]] = {}
        self._owners: dict[str, str] = {}  # a template's owner tenant ("": shared), read with its layers
        self._defaults: dict[str, ImageDefaults] = {}  # a template's image defaults (OCI config, Dockerfile ENV/WORKDIR/USER)
        self._layers_at: dict[str, float] = {}
        self._layers_reads: dict[str, asyncio.Task[list[LayerRef]]] = {}
        # Admitted, being made by the backend, not in the registry yet: counted by admission too, or
        # creates that wait on the backend together would all be admitted against the same free room.
        self.pending = Allocation()

    async def stop(self) -> None:
        """Stop saying duplicates' ready from their records (a host going away)."""
        for t in list(self._later):
            t.cancel()
        if self._later:
            await asyncio.wait(set(self._later), timeout=5.0)

    # --- the consumer's handler --------------------------------------------------------------
    async def handle(self, msg: Msg) -> None:
        """One hand-off; returning means whatever it led to is durable (the inbox then answers done)."""
        if not verify(self.config.control_key, msg.subject, msg.data, msg.headers):
            # Kept in the dead-letter stream as evidence; refused to whoever asked.
            log.warning("unsigned_work_refused", subject=msg.subject, code=ERR_BAD_SIGNATURE)
            await self.records.dead_letter(msg, ERR_BAD_SIGNATURE, "host work without a valid placement signature")
            raise PermissionDenied("host work without a valid placement signature")
        try:
            work = codec.HOST.decode(msg.data)
        except BadRequest as exc:
            await self.records.dead_letter(msg, exc.code, exc.description)
            raise
        match work:
            case PlaceSandbox():
                self._runs(work.spec)
                # First hand-off of a first attempt: no claim before creating; the record, written with a
                # KV create once the sandbox exists, is the claim (a copy of the id handed to another host
                # after a placement replica died loses that race and is removed). Redeliveries and
                # re-placements (attempt > 0) claim first, as every batch member does; so does a hand-off
                # placed longer ago than half the dedup window (it may be a replay).
                first = work.attempt == 0 and not work.claim and self._fresh(work.placed_at)
                await self.create_one(work.spec, work.attempt, work.exclude_hosts, claim=not first, placed=(work.placed_by, work.placed_at))
            case PlaceBatch():
                for s in work.specs:
                    self._runs(s)
                await self.create_batch(work)

    def _runs(self, spec: SandboxSpec) -> None:
        """Refuse (typed) a hand-off for a backend this host does not run: placement routes it elsewhere."""
        if spec.backend not in self.backends:
            raise UnsupportedBackend(
                f"host {self.host_id} runs no {spec.backend!r} backend (it runs {', '.join(sorted(self.backends))})",
                backend=spec.backend, host_id=self.host_id, available=",".join(sorted(self.backends)),
            )

    def _fresh(self, placed_at: float) -> bool:
        return abs(time.time() - placed_at) < self.dedup_window_s / 2

    # --- admission ---------------------------------------------------------------------------------
    def admits(self, spec: SandboxSpec) -> str:
        """Empty when the sandbox fits on this host now, else why not (the one rule: bus.rules)."""
        cfg = self.config
        cap = self.backend.capacity()
        return refusal(
            Capacity(
                cap.cpu_total, cap.mem_total_mb, cap.disk_total_mb,
                cpu_overcommit=cfg.cpu_overcommit, mem_overcommit=cfg.mem_overcommit, max_sandboxes=cfg.max_sandboxes,
            ),
            self.registry.alloc.plus(self.pending),
            spec,
        )

    def _hold(self, spec: SandboxSpec, sign: int) -> None:
        self.pending.add(spec, sign)
        if not self.pending.sandboxes:
            self.pending = Allocation()  # no float drift

    async def layers(self, template: str) -> list[LayerRef]:
        """The template's layers from KV, one read at a time per template: a batch whose members all
        find the cached layers stale reads them once, not once each."""
        task = self._layers_reads.get(template)
        if task is None:
            task = self._layers_reads[template] = asyncio.ensure_future(self._read_layers(template))

            def done(t: "asyncio.Task[list[LayerRef]]", template: str = template) -> None:
                if self._layers_reads.get(template) is t:
                    del self._layers_reads[template]
                if not t.cancelled():
                    t.exception()  # retrieved here too: every waiter may have gone

            task.add_done_callback(done)
        return await asyncio.shield(task)

    def owner(self, template: str) -> str | None:
        """The owner tenant of ``template`` ("": shared) as its layers were last read; None: not read yet."""
        return self._owners.get(template)

    async def _read_layers(self, template: str) -> list[LayerRef]:
        assert self.kv_images is not None
        manifest = await self.kv_images.get(template)
        if manifest is None:
            raise UnknownTemplate(f"unknown template {template!r}", template=template)
        layers = manifest.layers
        self._owners[template] = manifest.owner
        if manifest.defaults is not None:
            self._defaults[template] = manifest.defaults
        else:
            self._defaults.pop(template, None)
        self._layers_cache[template] = layers  # a create reads KV at most once per LAYERS_TTL_S per template
        self._layers_at[template] = time.monotonic()
        return layers

    # --- create ------------------------------------------------------------------------------------
    async def create_one(
        self, spec: SandboxSpec, attempt: int, excluded: list[str], *, claim: bool = True, held: bool = False,
        placed: tuple[str, float] = ("", 0.0), ready: list[SandboxSpec] | None = None, again: bool = False,
    ) -> None:
        """``held``: the caller claimed the id (``again``: over a record of this host's own, so the
        sandbox may have been announced before)."""
        # (no structlog context binding here: it costs more than the rest of a simulated create;
        # the log lines of this path name the sandbox themselves)
        sid = spec.sandbox_id
        ls = self.registry.get(sid)
        if ls is not None:
            if ls.state != "running":
                log.info("create_of_stopping_sandbox_dropped", sandbox_id=sid)
            elif await self.records.claim(spec, self.records.record_of(ls, "running")):
                # Redelivery: say it again, its record first. The delivery that created it may have failed
                # to store the record (the server went away between create and record): the sandbox is held
                # here, but nothing else knows it exists. One announced in a batch event is only told
                # its creating client again (an event of its own would be a second one in the stream).
                if sid in self.announced or await self._in_batch_event(spec, self.host_id, min(spec.requested_at, ls.started_at)):
                    await self.records.ready_many([spec], attempt, store=False)
                else:
                    await self.records.event(spec, "ready", attempt=attempt)
            else:  # that earlier delivery never claimed the id, and another host has it now
                self.reaper.begin(sid, "duplicate")
                await self._dropped(spec, attempt)
            return
        if sid in self.creating:
            await self.creating[sid]
            return
        if spec.create_deadline and time.time() > spec.create_deadline:
            # The client gave up (and its kill found nothing): a late or replayed hand-off starts nothing.
            if held:
                await self.records.release(sid)
            log.info("create_expired", sandbox_id=sid)
            await self.records.event(spec, "failed", attempt=attempt, err=SandboxTimeout(f"create request for {sid} expired before the host started it"))
            return
        why = self.admits(spec)
        if why:
            if held:  # give back the batch's claim so another host can take it
                await self.records.release(sid)
            await self._reject(spec, attempt, excluded, why)
            return
        if claim:
            got = await self.records.claim(spec)
            if not got:
                await self._dropped(spec, attempt)
                return
            again = got is Claim.MINE
            other = self.creating.get(sid)
            if other is not None or sid in self.registry:
                # Another hand-off of this id (a grouped one, and the re-placed copy of its redelivered
                # request) began creating it here while the claim was out: that one makes it.
                if other is not None:
                    await other
                return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.creating[sid] = fut
        try:
            await self._do_create(spec, attempt, claimed=claim or held, placed=placed, ready=ready, again=again)
        finally:
            self.creating.pop(sid, None)
            fut.set_result(None)

    async def create_batch(self, work: PlaceBatch) -> None:
        """Every member of a batch is claimed (another host may hold a re-placed copy); the claims go out
        pipelined, then each member is created as a single one."""
        if not (work.claim or work.attempt) and self._fresh(work.placed_at):
            await self._create_fresh(work)
            return
        reg = self.registry
        todo = [s for s in work.specs if s.sandbox_id not in reg and s.sandbox_id not in self.creating and not self.admits(s)]
        claimed: set[str] = set()
        ours: set[str] = set()  # claimed over a record of this host's own
        if todo:
            oks = await asyncio.gather(*(self.records.claim(s) for s in todo), return_exceptions=True)
            for s, ok in zip(todo, oks, strict=True):
                if ok is Claim.WON or ok is Claim.MINE:
                    claimed.add(s.sandbox_id)
                if ok is Claim.MINE:
                    ours.add(s.sandbox_id)
        # Members not claimed above (taken already, or admission said no) take the one-by-one path,
        # which re-checks the claim and rejects or re-places as a single create would.
        done: list[SandboxSpec] = []
        t0 = time.perf_counter()
        outcomes = await asyncio.gather(*(
            self.create_one(
                s, work.attempt, [], claim=s.sandbox_id not in claimed, held=s.sandbox_id in claimed, placed=(work.placed_by, work.placed_at), ready=done,
                again=s.sandbox_id in ours,
            )
            for s in work.specs
        ), return_exceptions=True)
        await self._ready_many(work, done, t0)
        _raise_first(outcomes)

    async def _create_fresh(self, work: PlaceBatch) -> None:
        """First hand-off of a first-time batch, as one piece of work: create first, then claim with the
        records themselves (as a single first create does, see _do_create: a copy handed to another host
        after a placement crash loses that race), all written pipelined. Members are admitted in turn,
        each counted before the next; made together; then every record goes out at once, then the ready
        events and one reply per creating client. A member with anything unusual about it (here or
        being made already, a duplicate in the batch, a restore, expired, not admitted) takes the
        one-by-one path alongside."""
        reg = self.registry
        placed = (work.placed_by, work.placed_at)
        now = time.time()
        t0 = time.perf_counter()
        group: list[SandboxSpec] = []
        alone: list[SandboxSpec] = []
        mine: dict[str, asyncio.Future[None]] = {}  # this call's entries in ``creating``
        loop = asyncio.get_running_loop()
        for s in work.specs:
            sid = s.sandbox_id
            if sid in reg or sid in self.creating or s.snapshot or (s.create_deadline and now > s.create_deadline) or self.admits(s):
                alone.append(s)
                continue
            self._hold(s, 1)
            self.creating[sid] = mine[sid] = loop.create_future()
            group.append(s)
        held = {s.sandbox_id for s in group}  # each leaves as the backend starts on it (_make)
        ready: list[SandboxSpec] = []
        try:
            outcomes = await asyncio.gather(
                self._create_group(group, held, mine, work.attempt, placed, ready),
                *(self.create_one(s, work.attempt, [], claim=False, placed=placed, ready=ready) for s in alone),
                return_exceptions=True,
            )
        finally:
            for s in group:
                if s.sandbox_id in held:  # cancelled before the backend saw it
                    held.discard(s.sandbox_id)
                    self._hold(s, -1)
            self._settle(mine)
        await self._ready_many(work, ready, t0)
        _raise_first(outcomes)

    async def _ready_many(self, work: PlaceBatch, ready: list[SandboxSpec], t0: float) -> None:
        """One event per tenant names the hand-off's ready members (their records are stored)."""
        if not ready:
            return
        detail = {"create_ms": f"{(time.perf_counter() - t0) * 1000:.1f}"}
        if work.placed_by:
            detail["placed_by"] = work.placed_by
            detail["placed_ms"] = f"{max(0.0, work.placed_at - min(s.requested_at for s in ready)) * 1000:.1f}"
        await self.records.ready_many(ready, work.attempt, batch_id=work.batch_id, detail=detail)

    async def _create_group(
        self, group: list[SandboxSpec], held: set[str], mine: dict[str, "asyncio.Future[None]"], attempt: int,
        placed: tuple[str, float], ready: list[SandboxSpec],
    ) -> None:
        """``_create_fresh``'s admitted members (counted in ``pending`` while ``held``, and in ``creating``)."""
        t0 = time.perf_counter()
        failed: BaseException | None = None
        try:
            made = await asyncio.gather(*(self._make(s, attempt, held=held) for s in group))
            live = [ls for ls in made if ls is not None]
            for ls in live:
                await self.ops.serve(ls.spec.sandbox_id)
            got = await self.records.claim_running([self.records.record_of(ls, "running") for ls in live])
            announced: list[SandboxSpec] = []
            for ls, g in zip(live, got, strict=True):
                if g is Claim.WON or g is Claim.MINE:
                    await self._announce(ls, attempt, t0, placed, ready, counted=True, again=g is Claim.MINE)
                    announced.append(ls.spec)
                elif g is Claim.LOST:
                    self.reaper.begin(ls.spec.sandbox_id, "duplicate")
                    await self._dropped(ls.spec, attempt)
                elif failed is None:  # the sandbox is held here without its record: a redelivery stores it
                    failed = g if isinstance(g, DsecError) else InternalError(f"record of {ls.spec.sandbox_id} not stored: {g}")
            self.m.ready_many(announced, time.perf_counter() - t0)
        finally:
            self._settle(mine)  # a copy of a member waiting on it (the one-by-one path) goes on now
        if failed is not None:
            raise failed

    def _settle(self, mine: dict[str, "asyncio.Future[None]"]) -> None:
        """Take this call's entries out of ``creating`` (idempotent), waking whoever waits on them."""
        for sid, fut in mine.items():
            if self.creating.get(sid) is fut:
                del self.creating[sid]
            if not fut.done():
                fut.set_result(None)

    async def _dropped(self, spec: SandboxSpec, attempt: int) -> None:
        """This copy of a create lost the id's claim to another host's record. When that record says the
        sandbox runs, its ``ready`` is said again from the record, for that host (acked; the stream drops
        it as a duplicate when the first one got through): the host that made it may have stored the
        record and then died before its own ready event left, and its hand-off was placed again here."""
        log.info("duplicate_create_dropped", sandbox_id=spec.sandbox_id)
        assert self.records.kv is not None
        rec = await self.records.kv.get(spec.sandbox_id)
        if rec is None or rec.host_id == self.host_id or rec.state not in ("running", "paused"):
            return
        if rec.spec.generation != spec.generation:
            return  # another incarnation of the id (a resumed pause): not this create's outcome
        assert self.records.nc is not None
        scan = ReadyScan(self.records.nc, S.tenant(spec.client), rec.host_id, spec.sandbox_id, rec.ready_at - 1.0)
        said = await self._said(spec, rec, scan)
        if said:
            # That host announced it (a batch event, or its own): told again to its creating client only.
            await self.records.ready_many([spec], attempt, store=False, host_id=rec.host_id)
            return
        if said is False and time.time() - rec.ready_at >= DROPPED_WAIT_S:
            await self._say_from_record(spec, rec, attempt)
            return
        # A record made moments ago (or the stream not answering): its host may still be announcing the
        # rest of its batch (with this one in the same event, which may wait on this host's own batch:
        # not waited for here, or two hosts dropping each other's copies would wait on each other), or
        # storing again what it fired while the stream was away. Looked for in the background until it
        # would have been out; then said from the record (the maker died).
        task = asyncio.ensure_future(self._said_later(spec, rec, attempt, scan))
        self._later.add(task)
        task.add_done_callback(self._later.discard)

    async def _said(self, spec: SandboxSpec, rec: SandboxRecord, scan: ReadyScan) -> bool | None:
        """Whether the record's host announced the sandbox, in a batch event (``scan`` goes on where it
        stopped) or one of its own (None: unknown, the stream did not answer)."""
        assert self.records.nc is not None
        try:
            return await scan.look() is not None or await own_ready_since(self.records.nc, S.tenant(spec.client), spec.sandbox_id, rec.ready_at - 1.0)
        except LookupFailed:
            return None

    async def _said_later(self, spec: SandboxSpec, rec: SandboxRecord, attempt: int, scan: ReadyScan) -> None:
        deadline = time.monotonic() + max(0.0, rec.ready_at + DROPPED_WAIT_S - time.time())
        give_up = time.monotonic() + DROPPED_MAX_S
        try:
            while True:
                await asyncio.sleep(DROPPED_POLL_S)  # the next look (bounded by the deadlines)
                said = await self._said(spec, rec, scan)
                if said:
                    await self.records.ready_many([spec], attempt, store=False, host_id=rec.host_id)
                    return
                now = time.monotonic()
                if (said is False and now >= deadline) or now >= give_up:
                    break
            await self._say_from_record(spec, rec, attempt, again=True)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - NATS away: the record stays the fact clients read
            log.warning("ready_from_record_failed", sandbox_id=spec.sandbox_id, error=repr(exc))

    async def _say_from_record(self, spec: SandboxSpec, rec: SandboxRecord, attempt: int, *, again: bool = False) -> None:
        """``ready``, for the record's host, from the record (``again``: read once more first: it may
        have changed meanwhile, its host declared down, say)."""
        if again:
            assert self.records.kv is not None
            now = await self.records.kv.get(spec.sandbox_id)
            if now is None or now.host_id != rec.host_id or now.state not in ("running", "paused") or now.spec.generation != spec.generation:
                return
        await self.records.event(spec, "ready", attempt=attempt, host_id=rec.host_id, detail={"from": "record", "seen_by": self.host_id})

    def _remember(self, sid: str) -> None:
        """``sid`` is announced in a batch event (the latest ``ANNOUNCED_KEPT`` are kept)."""
        self.announced[sid] = None
        if len(self.announced) > ANNOUNCED_KEPT:
            del self.announced[next(iter(self.announced))]

    async def _in_batch_event(self, spec: SandboxSpec, host_id: str, ready_at: float) -> bool:
        """Whether ``host_id`` announced the sandbox in a batch ready event (looked up in the stream:
        a host that restarted, or another host, does not remember it); not known (the stream does not
        answer): False, so it is said again (twice rather than never)."""
        assert self.records.nc is not None
        try:
            return await find_ready_many(self.records.nc, S.tenant(spec.client), host_id, spec.sandbox_id, ready_at - 1.0) is not None
        except LookupFailed:
            return False

    async def _reject(self, spec: SandboxSpec, attempt: int, excluded: list[str], why: str) -> None:
        err = HostRejected(f"host {self.host_id} is full: {why}", host_id=self.host_id)
        again = CreateSandbox(spec=spec, attempt=attempt + 1, exclude_hosts=[*excluded, self.host_id], last_error=err.description)
        await self.records.hand_on(S.REQ_CREATE, codec.encode(again), f"{S.incarnation(spec.sandbox_id, spec.generation)}:{attempt + 1}")
        await self.records.event(spec, "rejected", attempt=attempt, err=err)
        self.m.creates.inc(result="rejected")
        log.info("rejected", sandbox_id=spec.sandbox_id, reason=why)

    async def _do_create(
        self, spec: SandboxSpec, attempt: int, *, claimed: bool = True, placed: tuple[str, float] = ("", 0.0),
        ready: list[SandboxSpec] | None = None, again: bool = False,
    ) -> None:
        """Create, then store the record and announce ``ready``.

        ``claimed``: this host already holds the id's claim (a KV create before creating; ``again``: over
        a record of its own, so the sandbox may have been announced before). Otherwise the
        record itself is the claim, written with a KV create once the sandbox exists: if another host's
        record is there first, this copy is removed silently and the other host's stands.
        ``ready``: the caller tells the creating client (``Records.ready_many``); the sandbox joins it.
        """
        t0 = time.perf_counter()
        ls = await self._make(spec, attempt)
        if ls is None:
            return
        await self.ops.serve(spec.sandbox_id)
        if claimed:
            await self.records.record(ls, "running")
        else:
            got = await self.records.claim(spec, self.records.record_of(ls, "running"))
            if not got:
                self.reaper.begin(spec.sandbox_id, "duplicate")
                await self._dropped(spec, attempt)
                return
            again = got is Claim.MINE  # made again over this host's own record (it lost the sandbox)
        await self._announce(ls, attempt, t0, placed, ready, again=again)

    async def _make(self, spec: SandboxSpec, attempt: int, *, held: set[str] | None = None) -> LocalSandbox | None:
        """The sandbox, made by the backend and held in the registry; None when it could not be made
        (reported as failed, and cleaned up). An id in ``held`` is counted in ``pending`` already (by
        the caller, who learns here that it is this one's to give back now)."""
        backend = self.backend
        if held is not None and spec.sandbox_id in held:
            held.discard(spec.sandbox_id)
        else:
            self._hold(spec, 1)
        try:
            layers = self._layers_cache.get(spec.template)
            if layers is None or time.monotonic() - self._layers_at.get(spec.template, 0.0) > LAYERS_TTL_S:
                layers = await self.layers(spec.template)
            await check_template(self.records.nc, self.host_id, spec, self._owners.get(spec.template, ""))
            memory = None
            if spec.snapshot:  # a restore: the snapshot's layers over the template's (and its CRIU dump)
                layers, memory = await self.snapshots.restore_plan(spec, layers)
            if memory is not None:
                self.caps.need_checkpointer()  # a memory snapshot restores only where processes can be
            security = self.profiles.enforcement(spec.profile) if self.profiles is not None else None
            defaults = self._defaults.get(spec.template)
            if defaults is not None and defaults.env:  # the image's ENV, under what the create asked for
                spec.envs = {**defaults.env, **spec.envs}
            handle = await backend.create(spec, layers, security=security, memory=memory)
        except DsecError as exc:
            self._hold(spec, -1)
            await backend.destroy(spec.sandbox_id)
            await self._fail(spec, attempt, exc)
            return None
        except Exception as exc:  # noqa: BLE001 - report, clean up, keep serving
            self._hold(spec, -1)
            log.exception("create_failed", sandbox_id=spec.sandbox_id)
            await backend.destroy(spec.sandbox_id)
            await self._fail(spec, attempt, CreateFailed(f"{type(exc).__name__}: {exc}"))
            return None
        except BaseException:
            self._hold(spec, -1)
            raise
        # from pending to the registry in one step: admission never counts it twice, or not at all
        self._hold(spec, -1)
        now = time.time()
        ls = LocalSandbox(spec=spec, pid=handle.pid, extra=handle.extra, started_at=now, expires_at=now + spec.timeout_s)
        defaults = self._defaults.get(spec.template)
        if defaults is not None and (defaults.workdir or defaults.user):  # an exec that names neither runs with these
            ls.extra = {**ls.extra, "image_workdir": defaults.workdir, "image_user": defaults.user}
        self.registry.add(ls, handle)
        self.registry.save(ls)
        return ls

    async def _announce(
        self, ls: LocalSandbox, attempt: int, t0: float, placed: tuple[str, float], ready: list[SandboxSpec] | None,
        *, counted: bool = False, again: bool = False,
    ) -> None:
        """Its record is stored: say ``ready`` (not acked: the record is the durable fact, and a client
        that misses this reads it). It also says who placed the sandbox and when: placement writes no
        event of its own. A member of a host batch (``ready``) joins the batch's one event instead,
        unless (``again``: it may have been made and announced before) a batch event names it already."""
        spec = ls.spec
        if spec.snapshot:
            await self.snapshots.restored(ls)
        detail = {"create_ms": f"{(time.perf_counter() - t0) * 1000:.1f}"}
        if placed[0]:
            detail["placed_by"] = placed[0]
            detail["placed_ms"] = f"{max(0.0, placed[1] - spec.requested_at) * 1000:.1f}"
        if again and await self._in_batch_event(spec, self.host_id, spec.requested_at):
            # Made again under its own record (this host lost it in a restart): its batch event stands,
            # which the stream cannot de-duplicate another against; its creating client is told.
            self._remember(spec.sandbox_id)
            await self.records.ready_many([spec], attempt, store=False)
        elif ready is None:
            await self.records.event(spec, "ready", attempt=attempt, detail=detail, acked=False)
        else:  # a member of a host batch: the caller announces the batch in one event (Records.ready_many)
            ready.append(spec)
            self._remember(spec.sandbox_id)
        self.created += 1
        if not counted:  # else the caller counts its batch at once
            self.m.ready(spec, time.perf_counter() - t0)
        log.info("sandbox_ready", sandbox_id=spec.sandbox_id, ms=round((time.perf_counter() - t0) * 1000, 1), template=spec.template)

    async def _fail(self, spec: SandboxSpec, attempt: int, err: DsecError) -> None:
        log.warning("create_failed", sandbox_id=spec.sandbox_id, code=err.code, reason=err.description)
        self.m.creates.inc(result="failed")
        await self.records.event(spec, "failed", attempt=attempt, err=err)
        await self.records.failed(spec, err)


def _raise_first(outcomes: list[Any]) -> None:
    """Members' work not done: the hand-off is redelivered (each member claimed then)."""
    for o in outcomes:
        if isinstance(o, BaseException):
            raise o


__all__ = ["Intake", "LAYERS_TTL_S"]
