"""The placement service: replicas share one durable pull consumer on ``dsec.req.>``."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import replace
from typing import Any

import structlog
from nats.aio.msg import Msg

from bus import codec
from bus import subjects as S
from bus.auth import bind_tenant
from bus.errors import (
    BadRequest, DsecError, HostUnreachable, InvalidArgument, NoCapacity, QuotaExceeded, SandboxTimeout, Unavailable, UnknownTemplate, UnsupportedBackend,
)
from bus.messages import (
    CreateBatch, CreateSandbox, HostStatus, PlaceBatch, PlaceSandbox, SandboxEventKind, SandboxRecord, SandboxSpec, SnapshotRecord, TemplateManifest,
)
from bus.rules import template_refusal, validate_spec
from bus.runtime import KV, Events, Handoffs, PubAck, PullConsumer, Publisher, Service, Watch, dead_letter, deliveries
from bus.sign import sign_headers
from bus.streams import ensure_all

from ._config import PlacementConfig
from ._hostloss import HostLoss
from ._metrics import PlacementMetrics
from ._quota import Quotas
from ._table import HostTable, Policy

log = structlog.get_logger("dsec.placement")


class Placement(Service):
    """Chooses a host for each create request and hands it to that host's work subject.

    Hot path, per batch of messages JetStream delivered together: decode, choose (O(k)), reserve, then
    hand every create to its host (a core message, bus.runtime.handoff) without waiting in between,
    wait for the hosts' answers, and only then ack the requests: a request is never written twice, it
    stays un-acked in DSEC_REQ until its host says the outcome is durable. No answer (the host died,
    went silent, or nobody takes its work) or a refusal: the request is redelivered and placed again,
    as a redelivery, whose host claims the id in KV first (a first hand-off's record is its claim), so
    a create that did happen on the first host is not made twice.
    """

    name = "placement"

    def __init__(self, nats_url: str | None = None, *, config: PlacementConfig | None = None, **settings: Any) -> None:
        """``config`` as ``python -m placement`` builds it from its flags; ``settings`` replace single
        fields of it (``Placement(url, pending_delay_s=0.1)``: tests and tools)."""
        cfg = replace(config or PlacementConfig(), **settings)
        if nats_url is not None:
            cfg = replace(cfg, nats_url=nats_url)
        super().__init__(cfg.nats_url, grace_s=cfg.grace_s)
        self.config = cfg
        self.control_key = cfg.control_key
        self.replica_id = cfg.replica_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.capacity = cfg.capacity
        self.table = HostTable(cfg.placement_policy())
        self.pending_delay_s = cfg.pending_delay_s
        self.max_attempts = cfg.max_attempts
        self.stream_options = cfg.streams()
        self.ack_wait_s = cfg.ack_wait_s
        self.handoff_timeout_s = cfg.handoff_timeout_s
        self.templates: dict[str, TemplateManifest] = {}
        self._template_layers: dict[str, frozenset[str]] = {}
        self._template_owners: dict[str, str] = {}  # template -> its owner tenant ("": shared)
        self.placed = 0
        self.consumer: PullConsumer | None = None
        self.acks: Publisher | None = None
        self.handoffs: Handoffs | None = None
        self.events: Events | None = None
        self._watches: list[Watch[Any]] = []
        self._hosts_watch: Watch[HostStatus] | None = None
        self._kv_images: KV[TemplateManifest] | None = None
        self._kv_sbx: KV[SandboxRecord] | None = None
        self.quotas = Quotas(grace_s=cfg.quota_grace_s)
        self.hostloss: HostLoss | None = None
        self.m = PlacementMetrics(self)

    async def setup(self) -> None:
        assert self.js is not None and self.nc is not None and self.publisher is not None
        await ensure_all(self.js, self.stream_options)
        self.acks = self.publisher
        self.handoffs = await Handoffs(self.nc, silence_s=self.handoff_timeout_s).start()
        self.events = Events(self.nc, self.publisher)
        kv_hosts: KV[HostStatus] = await KV.open(self.js, S.KV_HOSTS, codec.HOST_STATUS)
        self._kv_images = await KV.open(self.js, S.KV_IMAGES, codec.TEMPLATE)
        self._kv_sbx = await KV.open(self.js, S.KV_SANDBOXES, codec.SANDBOX_RECORD)
        kv_snaps: KV[SnapshotRecord] = await KV.open(self.js, S.KV_SNAPSHOTS, codec.SNAPSHOT)
        self.hostloss = HostLoss(
            self.table, kv_hosts, self._kv_sbx, kv_snaps, self.events, self._store,
            grace_s=self.config.host_down_s, replica_id=self.replica_id,
        )
        self._hosts_watch = await kv_hosts.watch(self._on_host, self.table.remove)
        self._watches = [
            self._hosts_watch, await self._kv_images.watch(self._on_template, self._on_template_gone), await self.quotas.start(self.js, self._kv_sbx),
        ]
        try:  # start taking work once the host table holds what KV holds (else every early request waits)
            await asyncio.wait_for(asyncio.gather(*(w.synced.wait() for w in self._watches)), 10.0)
        except asyncio.TimeoutError:
            log.warning("initial_watch_slow")
        self.consumer = await self.add_worker(
            stream=S.STREAM_REQ,
            durable=S.PLACEMENT_DURABLE,
            filter_subject=f"{S.PREFIX}.req.>",
            capacity=self.capacity,
            on_batch=self.handle_batch,
            ack_wait_s=self.ack_wait_s,
            max_ack_pending=max(self.capacity * 16, 4096),  # shared by every replica
            name=f"placement-{self.replica_id}",
        )
        self.spawn(self.hostloss.loop(self._stopped), name="host-loss")

    # --- watches -------------------------------------------------------------------
    def _on_host(self, key: str, st: HostStatus, rev: int) -> None:
        self.table.update(st)
        if self.hostloss is not None:
            self.hostloss.seen(key, st, rev)

    def _on_template(self, key: str, t: TemplateManifest, _rev: int) -> None:
        self.templates[key] = t
        self._template_layers[key] = frozenset(layer.digest for layer in t.layers)
        self._template_owners[key] = t.owner

    def _on_template_gone(self, key: str) -> None:
        self.templates.pop(key, None)
        self._template_layers.pop(key, None)
        self._template_owners.pop(key, None)

    async def template(self, name: str) -> TemplateManifest | None:
        t = self.templates.get(name)
        if t is not None or self._kv_images is None:
            return t
        # Missing or broken (logged, counted): an unknown template, not a request redelivered forever.
        return await self._kv_images.get(name)

    async def _layers_of(self, name: str) -> frozenset[str] | None:
        layers = self._template_layers.get(name)
        if layers is not None:
            return layers
        t = await self.template(name)  # not seen by the watch yet: ask KV
        return None if t is None else frozenset(layer.digest for layer in t.layers)

    # --- events ---------------------------------------------------------------------
    async def _failed(self, spec: SandboxSpec, err: DsecError, attempt: int = 0) -> asyncio.Future[PubAck]:
        """A ``failed`` event that must not be lost: its ack is awaited with the batch's hand-offs."""
        assert self.events is not None
        self.m.event(spec, "failed")
        fut = await self.events.sandbox(spec, "failed", attempt=attempt, err=err, wait=False)
        assert isinstance(fut, asyncio.Future)  # acked, not waited for: the ack's future
        return fut

    async def _note(self, spec: SandboxSpec, kind: SandboxEventKind, *, attempt: int = 0, host_id: str = "", err: DsecError | None = None) -> None:
        """An informational event (pending): no ack round trip. Requested and placed are not events of their
        own: the request is in DSEC_REQ and the hand-off names its placer and time, which the host's
        ``ready`` event carries (``placed_by``, ``placed_ms``); two stream writes fewer per create."""
        assert self.events is not None
        self.m.event(spec, kind)
        await self.events.sandbox(spec, kind, attempt=attempt, host_id=host_id, err=err, acked=False)

    # --- the handler -------------------------------------------------------------------
    async def handle(self, msg: Msg) -> None:
        """Handle one request message (tests and tools; the consumer hands over whole batches)."""
        await self.handle_batch([msg])

    async def handle_batch(self, msgs: list[Msg]) -> None:
        now, t0 = time.time(), time.monotonic()
        outs: list[_Out] = []
        # First-time single creates that arrived together are grouped by host: runs of them go to the
        # same host (chosen as for any create) in one hand-off, so a host gets one message for several
        # creates. A group is a batch to the host: it claims each id with its record, so a copy re-placed
        # after this replica died cannot be created twice.
        runs = _Runs(self.table, len(msgs), self.table.policy.coalesce)
        groups: dict[str, list[tuple[Msg, SandboxSpec]]] = {}
        batches: list[asyncio.Task[None]] = []  # each held until its hosts answer, beside the singles
        reqs: list[tuple[Msg, CreateSandbox | CreateBatch]] = []
        for msg in msgs:
            req = await self._decode(msg)
            if req is not None:
                reqs.append((msg, req))
            else:
                self._settled()  # dead-lettered
        quota = await self._admit([r.spec for _, r in reqs if isinstance(r, CreateSandbox)])
        for msg, req in reqs:
            if isinstance(req, CreateBatch):
                batches.append(asyncio.ensure_future(self.place_batch(msg, req)))
            else:
                await self._place_one(msg, req, now, runs, groups, outs, quota)
        await self._hand_off_groups(groups, now, outs)
        self.m.decided(t0, sum(1 for o in outs if o[2]))
        if outs:
            await self._settle(outs)
        if batches:
            await asyncio.gather(*batches)

    def _settled(self) -> None:
        """One request of the running batch is acked or nak'ed: its room in the consumer is free again."""
        if self.consumer is not None:
            self.consumer.settled()

    async def _decode(self, msg: Msg) -> CreateSandbox | CreateBatch | None:
        """The request, or None when it was dead-lettered (malformed, or an id no subject can name)."""
        try:
            req: CreateSandbox | CreateBatch = codec.REQ.decode(msg.data)
        except BadRequest as exc:
            await self.dead_letter(msg, exc)
            return None
        bad = next((s.sandbox_id for s in (req.specs if isinstance(req, CreateBatch) else [req.spec]) if not S.valid_token(s.sandbox_id)), None)
        if bad is not None:
            # No event subject can name it (a dot or wildcard would reach other sandboxes' subjects).
            await self.dead_letter(msg, InvalidArgument(f"sandbox_id {bad!r} must be 1-128 of [A-Za-z0-9_-]"))
            return None
        bind_tenant(msg.subject, req.specs if isinstance(req, CreateBatch) else [req.spec])
        return req

    async def _place_one(
        self, msg: Msg, req: CreateSandbox, now: float, runs: "_Runs", groups: dict[str, list[tuple[Msg, SandboxSpec]]], outs: "list[_Out]",
        quota: "dict[str, DsecError]",
    ) -> None:
        spec = req.spec
        delivered = deliveries(msg)
        if req.attempt == 0 and delivered == 1:
            self.m.event(spec, "requested")
        err = quota.get(spec.sandbox_id)
        if isinstance(err, Unavailable):  # the quota record could not be written: this create comes back
            await msg.nak(delay=self.pending_delay_s)
            self._settled()
            return
        layers: frozenset[str] = frozenset()
        if err is None:
            err, layers = await self._precheck(spec, now)
        if err is None and req.attempt >= self.max_attempts:
            err = NoCapacity(f"no host accepted {spec.sandbox_id} after {req.attempt} attempts: {req.last_error}")
        if err is not None:
            log.info("create_refused", sandbox_id=spec.sandbox_id, code=err.code, reason=err.description)
            if not isinstance(err, QuotaExceeded):
                await self._unhold([spec])
            outs.append((msg, await self._failed(spec, err, req.attempt), "", None))
            return
        fresh = self._fresh(spec, now)
        first = fresh and req.attempt == 0 and not req.exclude_hosts and delivered == 1
        host = runs.extend(spec) if first else None
        if host is None:
            host = self._choose(spec, req.exclude_hosts, layers, now)
            if host is not None and first:
                runs.begin(host)
        if host is None:
            await self.pending(msg, spec, req.attempt)
            return
        self.table.reserve(host, spec, now)
        if first:
            groups.setdefault(host, []).append((msg, spec))
            return
        place = PlaceSandbox(
            spec=spec, host_id=host, attempt=req.attempt, exclude_hosts=req.exclude_hosts,
            placed_by=self.replica_id, placed_at=now, claim=not fresh or delivered > 1,
        )
        outs.append((msg, await self._handoff(host, codec.encode(place)), host, spec))

    # --- tenant quotas ------------------------------------------------------------------
    def _limited(self, specs: list[SandboxSpec]) -> dict[str, list[SandboxSpec]]:
        """``specs`` of tenants with limits, by tenant (a dict look-up each; nothing while no tenant has any)."""
        q = self.quotas
        out: dict[str, list[SandboxSpec]] = {}
        if not q.limits:
            return out
        for s in specs:
            t = s.client or S.OPERATOR_TENANT
            if S.valid_token(t) and q.limits_for(t) is not None:
                out.setdefault(t, []).append(s)
        return out

    async def _admit(self, specs: list[SandboxSpec]) -> dict[str, DsecError]:
        """Hold the quotas of limited tenants' ``specs``: the refused by sandbox id (QuotaExceeded),
        and Unavailable for those whose tenant's record could not be written (they come back)."""
        by_tenant = self._limited(specs)
        out: dict[str, DsecError] = {}

        async def one(tenant: str, ss: list[SandboxSpec]) -> None:
            lim = self.quotas.limits_for(tenant)
            if lim is None:
                return
            try:
                out.update(await self.quotas.admit(tenant, lim, ss))
            except Exception as exc:  # noqa: BLE001 - KV away or contended: the requests are redelivered
                log.warning("quota_unavailable", tenant=tenant, error=repr(exc))
                out.update((s.sandbox_id, Unavailable(f"quota of tenant {tenant}: {exc!r}")) for s in ss)

        if by_tenant:
            await asyncio.gather(*(one(t, ss) for t, ss in by_tenant.items()))
        return out

    async def _unhold(self, specs: list[SandboxSpec]) -> None:
        """Free the quota held for creates that failed here."""
        for tenant, ss in self._limited(specs).items():
            await self.quotas.release(tenant, [s.sandbox_id for s in ss])

    def _choose(self, spec: SandboxSpec, excluded: list[str], layers: frozenset[str], now: float) -> str | None:
        host = self.table.choose(spec, set(excluded) if excluded else frozenset(), layers, now)
        if host is None and excluded:
            host = self.table.choose(spec, frozenset(), layers, now)  # every host was tried once; try again
        return host

    async def _hand_off_groups(self, groups: dict[str, list[tuple[Msg, SandboxSpec]]], now: float, outs: "list[_Out]") -> None:
        for host, members in groups.items():
            if len(members) == 1:
                spec = members[0][1]
                place = PlaceSandbox(spec=spec, host_id=host, placed_by=self.replica_id, placed_at=now)
                fut = await self._handoff(host, codec.encode(place))
            else:
                ids = ",".join(sp.sandbox_id for _, sp in members)
                digest = hashlib.blake2b(ids.encode(), digest_size=8).hexdigest()
                pb = PlaceBatch(batch_id=f"g-{digest}", host_id=host, specs=[sp for _, sp in members], placed_by=self.replica_id, placed_at=now)
                fut = await self._handoff(host, codec.encode(pb))
            for msg, spec in members:
                outs.append((msg, fut, host, spec))

    async def _settle(self, outs: "list[_Out]") -> None:
        """Ack (or nak) each request as its hand-off is answered (or its failed event stored)."""
        by_fut: dict[asyncio.Future[Any], list[_Out]] = {}
        for o in outs:
            by_fut.setdefault(o[1], []).append(o)

        async def settle(fut: asyncio.Future[Any]) -> None:
            for msg, _, host, spec in by_fut.pop(fut):
                err = fut.exception()
                if err is not None:
                    self._handoff_failed(host, spec, err)
                    await msg.nak()
                else:
                    if spec is not None:
                        self.m.event(spec, "placed")
                        self.placed += 1
                    await msg.ack()
                self._settled()

        await self._hold(list(by_fut), lambda: [o[0] for os in by_fut.values() for o in os], settle)

    async def _hold(
        self, futs: list[asyncio.Future[Any]], msgs: Callable[[], Iterable[Msg]], on_done: Callable[[asyncio.Future[Any]], Awaitable[None]] | None = None,
    ) -> None:
        """Wait until every future is done (each has a deadline of its own: the hand-off's silence, the
        publish's timeout), handing each to ``on_done`` as it is; while hosts work, the requests still
        waiting (``msgs()``) stay held (``in_progress``), not redelivered."""
        pending = set(futs)
        tick = max(0.5, self.ack_wait_s / 3)
        deadline = time.monotonic() + tick
        while pending:
            done, pending = await asyncio.wait(pending, timeout=max(0.0, deadline - time.monotonic()), return_when=asyncio.FIRST_COMPLETED)
            if on_done is not None:
                for f in done:
                    await on_done(f)
            if pending and time.monotonic() >= deadline:
                deadline = time.monotonic() + tick
                for m in msgs():
                    try:
                        await m.in_progress()
                    except Exception:  # noqa: BLE001 - not held any more: JetStream redelivers it
                        pass

    def _handoff_failed(self, host: str, spec: SandboxSpec | None, err: BaseException) -> None:
        """Undo the reservation; a host nobody answers for leaves the table until its next heartbeat."""
        if spec is not None:
            self.table.release(host, spec.sandbox_id)
        if isinstance(err, HostUnreachable) and host:
            self.table.remove(host)
        log.warning("handoff_failed", host_id=host, error=repr(err))

    async def _handoff(self, host: str, data: bytes) -> asyncio.Future[Any]:
        assert self.handoffs is not None
        subject = S.host_create(host)
        return await self.handoffs.send(subject, data, sign_headers(self.control_key, subject, data))

    async def _store(self, subject: str, data: bytes, headers: dict[str, str]) -> None:
        assert self.publisher is not None
        await (await self.publisher.publish(subject, data, headers))

    async def teardown(self) -> None:
        for w in self._watches:
            await w.stop()
        if self.handoffs is not None:
            await self.handoffs.stop()

    async def dead_letter(self, msg: Msg, exc: DsecError) -> None:
        """Malformed work is kept (not dropped) on the DLQ stream with the reason, then acked."""
        assert self.publisher is not None
        await dead_letter(self.publisher, msg, exc.code, exc.description)

    async def _precheck(self, spec: SandboxSpec, now: float | None = None) -> tuple[DsecError | None, frozenset[str]]:
        try:
            validate_spec(spec)
        except DsecError as exc:
            return exc, frozenset()
        if spec.create_deadline and (now or time.time()) > spec.create_deadline:
            return SandboxTimeout(f"create request for {spec.sandbox_id} expired before a host was found"), frozenset()
        unsupported = self._unsupported(spec, now)
        if unsupported is not None:
            return unsupported, frozenset()
        layers = await self._layers_of(spec.template)
        if layers is None:
            return UnknownTemplate(f"unknown template {spec.template!r}; see `dsec image ls`", template=spec.template), frozenset()
        owner = self._template_owners.get(spec.template)
        if owner is None:  # not seen by the watch yet: _layers_of found it in KV
            t = await self.template(spec.template)
            owner = t.owner if t is not None else ""
        refused = template_refusal(spec.template, owner, spec.client)
        if refused is not None:
            log.warning("tenant_violation", sandbox_id=spec.sandbox_id, tenant=spec.client, op="create", template=spec.template, owner=owner)
            return refused, frozenset()
        return None, layers

    def _unsupported(self, spec: SandboxSpec, now: float | None) -> UnsupportedBackend | None:
        """The refusal of a backend no live host runs: waiting would not help (pending until the deadline).

        Only once this replica's table holds what KV holds (a replica that just started has not seen every
        heartbeat yet) and some host is live: with none at all, the cluster itself is away and the request
        waits for it as any other does."""
        if self.table.runs(spec.backend, now):
            return None
        if self._hosts_watch is None or not self._hosts_watch.synced.is_set() or not self.table.any_live(now):
            return None
        available = self.table.available_backends(now)
        return UnsupportedBackend(
            f"no host runs backend {spec.backend!r}; available: {', '.join(available)}", backend=spec.backend, available=",".join(available),
        )

    def _fresh(self, spec: SandboxSpec, now: float) -> bool:
        """True while JetStream's de-duplication of the request still covers it (asked for within half
        the window). An older first delivery may be a replay published after the window closed (or a
        made-up timestamp): its host claims the id in KV before starting anything, so a killed sandbox
        is never started again. SDK deadlines can outlast the window (create_timeout up to a day)."""
        return abs(now - spec.requested_at) < self.stream_options.dedup_window_s / 2

    async def pending(self, msg: Msg, spec: SandboxSpec, attempt: int) -> None:
        """No host fits: the request waits in the stream (NAK with delay); clients see ``pending``."""
        delivered = deliveries(msg)
        if delivered == 1 or delivered % 20 == 0:
            await self._note(spec, "pending", attempt=attempt, err=NoCapacity("no host has room; waiting"))
        await msg.nak(delay=min(self.pending_delay_s * (1 + delivered // 10), 5.0))
        self._settled()

    async def _already_claimed(self, specs: list[SandboxSpec]) -> set[str]:
        """Ids some host already claimed (a redelivered batch must not hand them off again)."""
        if self._kv_sbx is None:
            return set()
        kv = self._kv_sbx

        async def one(sid: str) -> str | None:
            return sid if await kv.exists(sid) else None

        found = await asyncio.gather(*(one(s.sandbox_id) for s in specs), return_exceptions=True)
        return {f for f in found if isinstance(f, str)}

    async def place_batch(self, msg: Msg, req: CreateBatch) -> None:
        """A batch lands on as few messages as hosts chosen; specs that fit nowhere go back as single requests.

        A redelivered batch (the replica died between hand-off and ack) skips the ids a host already
        claimed; for the rest, the host agents' claim of each id keeps a second host from creating it.
        Members go to the same host in runs while it fits (``_Runs``): hosts get fewer, bigger
        hand-offs and placement probes once per run, not once per member.
        """
        assert self.acks is not None
        now, t0 = time.time(), time.monotonic()
        specs = req.specs
        delivered = deliveries(msg)
        if delivered > 1:
            done = await self._already_claimed(specs)
            specs = [s for s in specs if s.sandbox_id not in done]
        by_host: dict[str, list[SandboxSpec]] = {}
        leftovers: list[SandboxSpec] = []
        handed: dict[str, asyncio.Future[Any]] = {}
        futs: list[asyncio.Future[Any]] = []
        runs = _Runs(self.table, len(specs), self.table.policy.coalesce if req.singles else 1)
        if delivered == 1 and req.attempt == 0:
            self.m.events_of(specs, "requested")
        quota = await self._admit(specs)
        if any(isinstance(e, Unavailable) for e in quota.values()):
            await msg.nak(delay=self.pending_delay_s)  # the quota record could not be written: the batch comes back
            self._settled()
            return
        failed: list[SandboxSpec] = []
        for spec in specs:
            err = quota.get(spec.sandbox_id)
            layers: frozenset[str] = frozenset()
            if err is None:
                err, layers = await self._precheck(spec, now)
                if err is not None:
                    failed.append(spec)
            if err is not None:
                futs.append(await self._failed(spec, err))
                continue
            host = runs.extend(spec)
            if host is None:
                host = self.table.choose(spec, frozenset(), layers, now)
                if host is None:
                    leftovers.append(spec)
                    continue
                runs.begin(host)
            self.table.reserve(host, spec, now)
            by_host.setdefault(host, []).append(spec)
        for host, hspecs in by_host.items():
            stale = not all(self._fresh(s, now) for s in hspecs)
            pb = PlaceBatch(
                batch_id=req.batch_id, host_id=host, specs=hspecs, attempt=req.attempt,
                placed_by=self.replica_id, placed_at=now, claim=delivered > 1 or stale,
            )
            handed[host] = await self._handoff(host, codec.encode(pb))
        self.m.decided(t0, sum(len(v) for v in by_host.values()))
        if failed:
            await self._unhold(failed)
        for spec in leftovers:
            # Single requests can wait in the stream individually; dedup keeps redeliveries single.
            hdr = {S.HDR_MSG_ID: S.incarnation(spec.sandbox_id, spec.generation)}
            futs.append(await self.acks.publish(S.REQ_CREATE, codec.encode(CreateSandbox(spec=spec)), hdr))
        await self._settle_batch(msg, req, by_host, handed, futs)

    async def _settle_batch(
        self, msg: Msg, req: CreateBatch, by_host: dict[str, list[SandboxSpec]], handed: dict[str, asyncio.Future[Any]], futs: list[asyncio.Future[Any]],
    ) -> None:
        """All answered and stored: ack the batch and say placed; anything unanswered or refused: undo
        and redeliver (placed again as a redelivery: members a host already claimed are skipped)."""
        every = [*handed.values(), *futs]
        if every:
            await self._hold(every, lambda: [msg])
            if any(f.exception() is not None for f in every):
                for host, hspecs in by_host.items():
                    for s in hspecs:
                        self.table.release(host, s.sandbox_id)
                for host, f in handed.items():
                    exc = f.exception()
                    if exc is not None:
                        self._handoff_failed(host, None, exc)
                log.warning("batch_handoff_failed", batch_id=req.batch_id)
                await msg.nak()
                self._settled()
                return
        for hspecs in by_host.values():
            self.m.events_of(hspecs, "placed")
        self.placed += sum(len(v) for v in by_host.values())
        await msg.ack()
        self._settled()


# (request, its hand-off's or failed event's ack, host or "", spec or None for a failed event)
_Out = tuple[Msg, asyncio.Future[Any], str, SandboxSpec | None]


class _Runs:
    """Consecutive creates go to the same host in runs of ``per_host`` while they fit there: ``count``
    creates land on about ``policy.batch_hosts`` hosts (runs of ``at_least``: fewer), each run's host
    chosen as a single create's is."""

    __slots__ = ("table", "per_host", "cur", "n")

    def __init__(self, table: HostTable, count: int, at_least: int = 1) -> None:
        self.table = table
        self.per_host = max(1, at_least, -(-count // max(1, table.policy.batch_hosts)))
        self.cur: str | None = None
        self.n = 0

    def extend(self, spec: SandboxSpec) -> str | None:
        """The current run's host when ``spec`` still fits there (counted in the run), else None."""
        cur = self.cur
        if cur is None or self.n >= self.per_host:
            return None
        e = self.table.hosts.get(cur)
        if e is None or e.status.pool != spec.pool or self.table.why_not(e, spec):
            return None
        self.n += 1
        return cur

    def begin(self, host: str) -> None:
        self.cur, self.n = host, 1

__all__ = ["Placement", "HostTable", "Policy"]
