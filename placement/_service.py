"""The placement service: replicas share one durable pull consumer on ``dsec.req.>``."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import time
import uuid
from typing import Any

import structlog
from nats.aio.msg import Msg

from bus import codec
from bus import subjects as S
from bus.errors import BadRequest, DsecError, InvalidArgument, NoCapacity, SandboxTimeout, UnknownTemplate
from bus.messages import CreateBatch, CreateSandbox, HostStatus, PlaceBatch, PlaceSandbox, SandboxRecord, SandboxSpec, TemplateManifest
from bus.rules import validate_spec
from bus.runtime import KV, Events, PubAck, PullConsumer, Publisher, Service, Watch, dead_letter
from bus.sign import sign_headers
from bus.streams import StreamOptions, ensure_all

from ._table import HostTable, Policy

log = structlog.get_logger("dsec.placement")

MAX_ATTEMPTS = 5


class Placement(Service):
    """Chooses a host for each create request and hands it to that host's work subject.

    Hot path, per batch of messages JetStream delivered together: decode, choose (O(k)), reserve, then
    publish every hand-off without waiting in between, wait for all their acks at once, and only then
    ack the requests. A hand-off carries ``Nats-Msg-Id = <sandbox>:<attempt>`` so a request redelivered
    after a replica died is de-duplicated by JetStream instead of being placed twice; batches are
    guarded by the host agent's claim of each id.
    """

    name = "placement"

    def __init__(
        self,
        nats_url: str | None = None,
        *,
        replica_id: str | None = None,
        capacity: int = 256,
        policy: Policy = Policy(),
        pending_delay_s: float = 0.5,
        max_attempts: int = MAX_ATTEMPTS,
        stream_options: StreamOptions = StreamOptions(),
        ack_wait_s: float = 10.0,
        handoff_timeout_s: float = 10.0,
        grace_s: float = 10.0,
        control_key: bytes | None = None,
    ) -> None:
        super().__init__(nats_url, grace_s=grace_s)
        self.control_key = control_key  # signs every hand-off to a host (bus.sign); None: unsigned (dev)
        self.replica_id = replica_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.capacity = capacity
        self.table = HostTable(policy)
        self.pending_delay_s = pending_delay_s
        self.max_attempts = max_attempts
        self.stream_options = stream_options
        self.ack_wait_s = ack_wait_s
        self.handoff_timeout_s = handoff_timeout_s
        self.templates: dict[str, TemplateManifest] = {}
        self._template_layers: dict[str, frozenset[str]] = {}
        self.placed = 0
        self.consumer: PullConsumer | None = None
        self.acks: Publisher | None = None
        self.events: Events | None = None
        self._watches: list[Watch[Any]] = []
        self._kv_images: KV[TemplateManifest] | None = None
        self._kv_sbx: KV[SandboxRecord] | None = None

    async def setup(self) -> None:
        assert self.js is not None and self.nc is not None and self.publisher is not None
        await ensure_all(self.js, self.stream_options)
        self.acks = self.publisher
        self.events = Events(self.nc, self.publisher)
        kv_hosts: KV[HostStatus] = await KV.open(self.js, S.KV_HOSTS, codec.HOST_STATUS)
        self._kv_images = await KV.open(self.js, S.KV_IMAGES, codec.TEMPLATE)
        self._kv_sbx = await KV.open(self.js, S.KV_SANDBOXES, codec.SANDBOX_RECORD)
        self._watches = [
            await kv_hosts.watch(self._on_host, self.table.remove),
            await self._kv_images.watch(self._on_template, self._on_template_gone),
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

    # --- watches -------------------------------------------------------------------
    def _on_host(self, key: str, st: HostStatus, _rev: int) -> None:
        self.table.update(st)

    def _on_template(self, key: str, t: TemplateManifest, _rev: int) -> None:
        self.templates[key] = t
        self._template_layers[key] = frozenset(layer.digest for layer in t.layers)

    def _on_template_gone(self, key: str) -> None:
        self.templates.pop(key, None)
        self._template_layers.pop(key, None)

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
        return await self.events.sandbox(spec, "failed", attempt=attempt, err=err, wait=False)  # type: ignore[return-value]

    async def _note(self, spec: SandboxSpec, kind: str, *, attempt: int = 0, host_id: str = "", err: DsecError | None = None) -> None:
        """An informational event (requested, placed, pending): no ack round trip."""
        assert self.events is not None
        await self.events.sandbox(spec, kind, attempt=attempt, host_id=host_id, err=err, acked=False)

    # --- the handler -------------------------------------------------------------------
    async def handle(self, msg: Msg) -> None:
        """Handle one request message (tests and tools; the consumer hands over whole batches)."""
        await self.handle_batch([msg])

    async def handle_batch(self, msgs: list[Msg]) -> None:
        assert self.acks is not None
        acks = self.acks
        now = time.time()
        # (msg, future, host or "", spec or None, attempt)
        outs: list[tuple[Msg, asyncio.Future, str, SandboxSpec | None, int]] = []
        # First-time single creates that arrived together are grouped by host: runs of ``per_host`` go to
        # the same host (chosen as for any create) in one hand-off, so a host gets one message for several
        # creates. A group is a batch to the host: it claims each id with its record, so a copy re-placed
        # after this replica died cannot be created twice.
        groups: dict[str, list[tuple[Msg, SandboxSpec]]] = {}
        per_host = max(1, -(-len(msgs) // max(1, self.table.policy.batch_hosts)))
        cur: str | None = None
        run = 0
        for msg in msgs:
            try:
                req = codec.REQ.decode(msg.data)
            except BadRequest as exc:
                await self.dead_letter(msg, exc)
                continue
            bad = next((s.sandbox_id for s in (req.specs if type(req) is CreateBatch else [req.spec]) if not S.valid_token(s.sandbox_id)), None)
            if bad is not None:
                # No event subject can name it (a dot or wildcard would reach other sandboxes' subjects).
                await self.dead_letter(msg, InvalidArgument(f"sandbox_id {bad!r} must be 1-128 of [A-Za-z0-9_-]"))
                continue
            if type(req) is CreateBatch:
                await self.place_batch(msg, req)
                continue
            spec = req.spec
            if req.attempt == 0 and (msg.metadata.num_delivered if msg.metadata else 1) == 1:
                await self._note(spec, "requested")  # where a sandbox's audit trail starts
            err, layers = await self._precheck(spec, now)
            if err is None and req.attempt >= self.max_attempts:
                err = NoCapacity(f"no host accepted {spec.sandbox_id} after {req.attempt} attempts: {req.last_error}")
            if err is not None:
                log.info("create_refused", sandbox_id=spec.sandbox_id, code=err.code, reason=err.description)
                outs.append((msg, await self._failed(spec, err, req.attempt), "", None, req.attempt))
                continue
            fresh = self._fresh(spec, now)
            first = fresh and req.attempt == 0 and not req.exclude_hosts and (msg.metadata.num_delivered if msg.metadata else 1) == 1
            if first and cur is not None and run < per_host:
                e = self.table.hosts.get(cur)
                if e is not None and e.status.backend == spec.backend and e.status.pool == spec.pool and not self.table.why_not(e, spec):
                    run += 1
                    self.table.reserve(cur, spec, now)
                    groups[cur].append((msg, spec))
                    continue
            host = self.table.choose(spec, set(req.exclude_hosts) if req.exclude_hosts else frozenset(), layers, now)
            if host is not None and first:
                cur, run = host, 1
                self.table.reserve(host, spec, now)
                groups.setdefault(host, []).append((msg, spec))
                continue
            if host is None and req.exclude_hosts:
                host = self.table.choose(spec, frozenset(), layers, now)  # every host was tried once; try again
            if host is None:
                await self.pending(msg, spec, req.attempt)
                continue
            self.table.reserve(host, spec, now)
            place = PlaceSandbox(
                spec=spec, host_id=host, attempt=req.attempt, exclude_hosts=req.exclude_hosts,
                placed_by=self.replica_id, placed_at=now, claim=not fresh or (msg.metadata.num_delivered if msg.metadata else 1) > 1,
            )
            fut = await self._handoff(acks, host, codec.encode(place), {S.HDR_MSG_ID: f"{S.incarnation(spec.sandbox_id, spec.generation)}:{req.attempt}"})
            outs.append((msg, fut, host, spec, req.attempt))
        for host, members in groups.items():
            if len(members) == 1:
                msg, spec = members[0]
                place = PlaceSandbox(spec=spec, host_id=host, placed_by=self.replica_id, placed_at=now)
                fut = await self._handoff(acks, host, codec.encode(place), {S.HDR_MSG_ID: f"{S.incarnation(spec.sandbox_id, spec.generation)}:0"})
            else:
                ids = ",".join(sp.sandbox_id for _, sp in members)
                digest = hashlib.blake2b(ids.encode(), digest_size=8).hexdigest()
                pb = PlaceBatch(batch_id=f"g-{digest}", host_id=host, specs=[sp for _, sp in members], placed_by=self.replica_id, placed_at=now)
                fut = await self._handoff(acks, host, codec.encode(pb), {S.HDR_MSG_ID: f"g-{host}:{digest}"})
            for msg, spec in members:
                outs.append((msg, fut, host, spec, 0))
        if not outs:
            return
        futs = [o[1] for o in outs]
        _, not_done = await asyncio.wait(futs, timeout=self.handoff_timeout_s)
        for f in not_done:
            f.cancel()
        for msg, fut, host, spec, attempt in outs:
            if fut.cancelled() or fut.exception() is not None:
                # The hand-off may or may not be stored: redeliver; its Nats-Msg-Id makes a re-send harmless.
                if host and spec is not None:
                    self.table.release(host, spec.sandbox_id)
                log.warning("handoff_failed", error=repr(None if fut.cancelled() else fut.exception()))
                await msg.nak()
                continue
            if host and spec is not None:
                if fut.result().duplicate:
                    # An earlier delivery of this request already handed it off (maybe elsewhere).
                    self.table.release(host, spec.sandbox_id)
                else:
                    await self._note(spec, "placed", attempt=attempt, host_id=host)
                    self.placed += 1
            await msg.ack()

    async def _handoff(self, acks: Publisher, host: str, data: bytes, headers: dict[str, str]) -> asyncio.Future:
        subject = S.host_create(host)
        return await acks.publish(subject, data, sign_headers(self.control_key, subject, data, headers))

    async def teardown(self) -> None:
        for w in self._watches:
            await w.stop()

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
        layers = await self._layers_of(spec.template)
        if layers is None:
            return UnknownTemplate(f"unknown template {spec.template!r}; see `dsec image ls`", template=spec.template), frozenset()
        return None, layers

    def _fresh(self, spec: SandboxSpec, now: float) -> bool:
        """True while JetStream's de-duplication of the request still covers it (asked for within half
        the window). An older first delivery may be a replay published after the window closed (or a
        made-up timestamp): its host claims the id in KV before starting anything, so a killed sandbox
        is never started again. SDK deadlines can outlast the window (create_timeout up to a day)."""
        return abs(now - spec.requested_at) < self.stream_options.dedup_window_s / 2

    async def pending(self, msg: Msg, spec: SandboxSpec, attempt: int) -> None:
        """No host fits: the request waits in the stream (NAK with delay); clients see ``pending``."""
        delivered = msg.metadata.num_delivered if msg.metadata else 1
        if delivered == 1 or delivered % 20 == 0:
            await self._note(spec, "pending", attempt=attempt, err=NoCapacity("no host has room; waiting"))
        await msg.nak(delay=min(self.pending_delay_s * (1 + delivered // 10), 5.0))

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
        """
        assert self.acks is not None
        acks = self.acks
        now = time.time()
        specs = req.specs
        delivered = msg.metadata.num_delivered if msg.metadata else 1
        if delivered > 1:
            done = await self._already_claimed(specs)
            specs = [s for s in specs if s.sandbox_id not in done]
        by_host: dict[str, list[SandboxSpec]] = {}
        leftovers: list[SandboxSpec] = []
        futs: list[asyncio.Future] = []
        # Members go to the same host in runs of ``per_host`` while it fits: a batch of B lands on about
        # ``batch_hosts`` hosts (each run's host is chosen as a single create's would be), so hosts get
        # fewer, bigger hand-offs and placement probes once per run, not once per member.
        per_host = max(1, -(-len(specs) // max(1, self.table.policy.batch_hosts)))
        cur: str | None = None
        run = 0
        for spec in specs:
            if delivered == 1 and req.attempt == 0:
                await self._note(spec, "requested")
            err, layers = await self._precheck(spec, now)
            if err is not None:
                futs.append(await self._failed(spec, err))
                continue
            host = None
            if cur is not None and run < per_host:
                e = self.table.hosts.get(cur)
                if e is not None and e.status.backend == spec.backend and e.status.pool == spec.pool and not self.table.why_not(e, spec):
                    host = cur
            if host is None:
                host = self.table.choose(spec, frozenset(), layers, now)
                cur, run = host, 0
            if host is None:
                leftovers.append(spec)
                continue
            run += 1
            self.table.reserve(host, spec, now)
            by_host.setdefault(host, []).append(spec)
        for host, hspecs in by_host.items():
            stale = not all(self._fresh(s, now) for s in hspecs)
            pb = PlaceBatch(
                batch_id=req.batch_id, host_id=host, specs=hspecs, attempt=req.attempt,
                placed_by=self.replica_id, placed_at=now, claim=delivered > 1 or stale,
            )
            digest = hashlib.blake2b(",".join(s.sandbox_id for s in hspecs).encode(), digest_size=8).hexdigest()
            futs.append(await self._handoff(acks, host, codec.encode(pb), {S.HDR_MSG_ID: f"{req.batch_id}:{host}:{digest}"}))
        for spec in leftovers:
            # Single requests can wait in the stream individually; dedup keeps redeliveries single.
            futs.append(await acks.publish(S.REQ_CREATE, codec.encode(CreateSandbox(spec=spec)), {S.HDR_MSG_ID: S.incarnation(spec.sandbox_id, spec.generation)}))
        if futs:
            _, not_done = await asyncio.wait(futs, timeout=self.handoff_timeout_s)
            for f in not_done:
                f.cancel()
            if any(f.cancelled() or f.exception() is not None for f in futs):
                for host, hspecs in by_host.items():
                    for s in hspecs:
                        self.table.release(host, s.sandbox_id)
                log.warning("batch_handoff_failed", batch_id=req.batch_id)
                await msg.nak()
                return
        for host, hspecs in by_host.items():
            for spec in hspecs:
                await self._note(spec, "placed", host_id=host)
        self.placed += sum(len(v) for v in by_host.values())
        await msg.ack()


__all__ = ["Placement", "HostTable", "Policy"]
