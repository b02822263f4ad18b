"""The asynchronous client: ``AsyncSandbox``."""

from __future__ import annotations

import asyncio
import functools
import contextlib
import inspect
import os
import random
import time
import uuid
from collections.abc import Callable
from typing import Any

import nats.errors
from nats.aio.client import Client as NATS

from bus import codec
from bus import subjects as S
from bus.auth import ROLLOUTS_ROLE
from bus.codec import decode_reply
from bus.errors import (
    BadRequest, DsecError, ErrorReply, InvalidArgument, KillPending, PermissionDenied, SandboxNotFound, SandboxTimeout, Unavailable, from_reply,
)
from bus.messages import (
    CreateBatch,
    CreateSandbox,
    Done,
    InfoRequest,
    KillRequest,
    MetricsRequest,
    NetworkSpec,
    ReadyMany,
    SandboxEvent,
    SandboxSpec,
    SetNetwork,
    SetTimeout,
)
from bus.messages import KILL_PENDING, SANDBOX_ENDED
from bus.messages import SandboxMetrics as WireMetrics
from bus.messages import SandboxInfo as WireInfo
from bus.rules import CREATE_TIMEOUT_S, validate_spec
from bus.runtime import KV, PubAck, StoreError, connect, nats_url, no_responders, publisher_for, release_publisher, subscribe_sync, tenant_of

from . import _display
from . import _snapshots as _snap
from . import _trajectory
from ._coalesce import CreateCoalescer
from ._commands import AsyncCommands
from ._display import AsyncInput
from ._files import AsyncFilesystem
from ._models import SandboxInfo, SandboxMetrics
from ._requests import release_requests, requests_for

_conns: dict[tuple[int, str], NATS] = {}
_connecting: dict[tuple[int, str], "asyncio.Task[NATS]"] = {}  # a first connect in progress, shared by its callers
BATCH_CHUNK = 1000  # specs per request message (well under any server's max_payload)


class _LeaseKeeper:
    """One client lease per process and NATS URL: a single KV key (the owner id) renewed in the background.

    Every sandbox created with ``lease=`` carries this owner; its host reaps it when the key stops changing
    for longer than the sandbox's lease (the trainer died). One write per ``ttl / 3`` however many
    sandboxes the client holds.
    """

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self.owner = f"lease-{uuid.uuid4().hex[:20]}"
        self.ttl = float("inf")
        self.kv: Any = None
        self.task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    async def ensure(self, ttl: float) -> str:
        if ttl < self.ttl:
            self.ttl = ttl
            self._wake.set()
        if self.kv is None:
            from bus.streams import ensure_kv

            self.kv = await ensure_kv(self.nc.jetstream(), S.KV_LEASES)
        if self.task is None or self.task.done():
            await self.renew()  # the key exists before any create names it
            self.task = asyncio.ensure_future(self._loop())
        return self.owner

    async def renew(self) -> None:
        from bus.messages import Lease

        await self.kv.put(self.owner, codec.encode(Lease(sandbox_id=self.owner, owner=self.owner, renewed_at=time.time(), ttl_s=self.ttl)))

    async def _loop(self) -> None:
        while not self.nc.is_closed:
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), max(0.2, self.ttl / 3))
            except asyncio.TimeoutError:
                pass
            try:
                await self.renew()
            except Exception:  # noqa: BLE001 - NATS away for a moment: the next round tries again
                pass

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()


_leases: dict[tuple[int, str], _LeaseKeeper] = {}


async def _lease_owner(nc: NATS, url: str | None, ttl: float) -> str:
    key = (id(asyncio.get_running_loop()), nats_url(url))
    keeper = _leases.get(key)
    if keeper is None or keeper.nc is not nc:
        if keeper is not None:
            keeper.stop()
        keeper = _leases[key] = _LeaseKeeper(nc)
    return await keeper.ensure(ttl)


async def _nc(url: str | None) -> NATS:
    """One connection per event loop and URL, shared by every sandbox object."""
    key = (id(asyncio.get_running_loop()), nats_url(url))
    nc = _conns.get(key)
    if nc is not None and not nc.is_closed:
        return nc
    # Concurrent first calls (a gather of creates) share one connect: each making its own left all
    # but the last open and unreachable, still reconnecting after the server had gone.
    task = _connecting.get(key)
    if task is None:
        task = _connecting[key] = asyncio.ensure_future(connect(url, name="dsec-sdk", connect_attempts=3, connect_timeout_s=5.0))

        def settle(t: "asyncio.Task[NATS]") -> None:
            if _connecting.get(key) is t:
                del _connecting[key]
            if not t.cancelled() and t.exception() is None:
                _conns[key] = t.result()

        task.add_done_callback(settle)
    # shield: one caller cancelled (its own timeout) must not cancel the connect the others wait on
    return await asyncio.shield(task)


_jsctx: dict[int, tuple[NATS, Any]] = {}


def _js(nc: NATS) -> Any:
    """One JetStream context per connection (making one per create shows up in profiles)."""
    entry = _jsctx.get(id(nc))
    if entry is None or entry[0] is not nc:
        entry = _jsctx[id(nc)] = (nc, nc.jetstream())
    return entry[1]


async def close_connections() -> None:
    loop_id = id(asyncio.get_running_loop())
    for task in [t for k, t in _connecting.items() if k[0] == loop_id]:  # a connect on its way is closed with the rest
        with contextlib.suppress(Exception):
            await asyncio.shield(task)
    for key in [k for k in _leases if k[0] == loop_id]:
        _leases.pop(key).stop()
    for key in [k for k in _conns if k[0] == loop_id]:
        nc = _conns.pop(key)
        _jsctx.pop(id(nc), None)
        _replies.pop(id(nc), None)
        _coalescers.pop(id(nc), None)
        await release_requests(nc)
        await release_publisher(nc)
        if not nc.is_closed:
            await nc.drain()


def _network_spec(network: dict[str, list[str]] | None) -> NetworkSpec | None:
    if network is None:
        return None
    if not isinstance(network, dict) or set(network) - {"allow_out"}:
        raise InvalidArgument(f"network must look like {{'allow_out': [...]}}, got {network!r}")
    allow = network.get("allow_out", [])
    if not isinstance(allow, list) or not all(isinstance(a, str) and a for a in allow):
        raise InvalidArgument(f"network['allow_out'] must be a list of CIDR, host:port or domain strings, got {allow!r}")
    return NetworkSpec(allow_out=list(allow))


def _check_positive(name: str, value: Any, *, lo: float, hi: float, integer: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        kind = "an integer" if integer else "a number"
        raise InvalidArgument(f"{name} must be {kind}, got {value!r}")
    if not (lo <= value <= hi):
        raise InvalidArgument(f"{name} must be between {lo:g} and {hi:g}, got {value!r}")


def build_spec(
    template: str = "base",
    *,
    backend: str = "container",
    cpu: float = 1.0,
    memory_mb: int = 512,
    disk_mb: int = 1024,
    timeout: float = 300,
    envs: dict[str, str] | None = None,
    metadata: dict[str, str] | None = None,
    network: dict[str, list[str]] | None = None,
    priority: str = "best-effort",
    pool: str = "default",
    profile: str = "default",
    lease: float | None = None,
    create_timeout: float = 120.0,
    sandbox_id: str | None = None,
    client: str = "",
    snapshot: str | None = None,
    restore_on_host_loss: bool = False,
) -> SandboxSpec:
    """Validate create arguments client-side (bus.rules, as placement does) so mistakes fail fast.

    ``restore_on_host_loss``: when the sandbox's host is declared down, start it again on another host
    from its latest snapshot (same id); else it just becomes ``lost``."""
    _check_positive("create_timeout", create_timeout, lo=CREATE_TIMEOUT_S[0], hi=CREATE_TIMEOUT_S[1])
    net = _network_spec(network)
    if lease is not None:
        _check_positive("lease", lease, lo=1, hi=86400)
    if snapshot is not None and (not isinstance(snapshot, str) or not S.valid_token(snapshot)):
        raise InvalidArgument(f"snapshot must be a snapshot id, got {snapshot!r}")
    now = time.time()
    spec = SandboxSpec(
        sandbox_id=sandbox_id or f"sb-{uuid.uuid4().hex[:20]}", template=template, backend=backend, cpu=cpu, memory_mb=memory_mb,
        disk_mb=disk_mb, timeout_s=timeout, envs=envs if envs is not None else {}, metadata=metadata if metadata is not None else {},
        priority=priority, pool=pool, profile=profile, network=net, lease_s=lease or 0.0, requested_at=now, create_deadline=now + create_timeout, client=client,
        snapshot=snapshot or "", restore_on_host_loss=bool(restore_on_host_loss),
    )
    validate_spec(spec)
    spec.cpu, spec.timeout_s, spec.lease_s = float(cpu), float(timeout), float(spec.lease_s)
    spec.envs, spec.metadata = dict(spec.envs), dict(spec.metadata)
    return spec


async def _snapshot_template(url: str | None, snapshot_id: str, template: str) -> str:
    """The template a snapshot restores onto, from its record; a client tenant may not read snapshot
    records (they hold their sandboxes' envs), so it names the template itself (fork does)."""
    nc = await _nc(url)
    if _snap.records_conn(nc) is None:
        return template
    return (await _snap.get_record(nc, snapshot_id)).template


class _Waiter:
    """Collects lifecycle events for a set of sandbox ids until each is ready or failed."""

    def __init__(self, ids: list[str]) -> None:
        self.pending_ids = set(ids)
        self.results: dict[str, SandboxEvent] = {}
        self.last: dict[str, SandboxEvent] = {}
        self.done = asyncio.Event()
        self.fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()  # done, awaitable without a task
        if not ids:
            self.done.set()
            self.fut.set_result(None)

    async def on_msg(self, msg: Any) -> None:
        self.feed(msg)

    def feed(self, msg: Any) -> SandboxEvent | None:
        try:
            ev = codec.EVENT.decode(msg.data)
        except BadRequest:
            return None
        if isinstance(ev, ReadyMany):  # a host batch's one event: ready for each member it names
            for member in _members_ready(ev):
                self.feed_event(member)
            return None
        if not isinstance(ev, SandboxEvent):
            return None
        return self.feed_event(ev)

    def feed_event(self, ev: SandboxEvent) -> SandboxEvent:
        self.last[ev.sandbox_id] = ev
        if ev.kind in ("ready", "failed") and ev.sandbox_id in self.pending_ids:
            self.pending_ids.discard(ev.sandbox_id)
            self.results[ev.sandbox_id] = ev
            if not self.pending_ids:
                self.done.set()
                if not self.fut.done():
                    self.fut.set_result(None)
        return ev


class _Replies:
    """One inbox per connection where hosts and placement tell this client the outcome of its creates.

    A create names it in ``spec.reply_to``; no subscription per create, and only the events a create
    waits for (ready, failed, pending) come back. They are core messages: should one be lost (a
    reconnect), the waiting create finds the outcome in the DSEC_EVT stream (``_Waiter`` re-checks).
    """

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self.subject = nc.new_inbox()
        self.waiters: dict[str, Callable[[SandboxEvent], None]] = {}
        self.sub: Any = None

    async def start(self) -> "_Replies":
        if self.sub is None:
            self.sub = await subscribe_sync(self.nc, self.subject, self._on)
        return self

    def _on(self, msg: Any) -> None:
        try:
            ev = codec.CREATE_REPLY.decode(msg.data)
        except BadRequest:
            return
        if isinstance(ev, SandboxEvent):
            fn = self.waiters.get(ev.sandbox_id)
            if fn is not None:
                fn(ev)
            return
        for member in _members_ready(ev):  # ReadyMany: a host's hand-off of several
            fn = self.waiters.get(member.sandbox_id)
            if fn is not None:
                fn(member)


def _members_ready(ev: ReadyMany, only: set[str] | None = None) -> list[SandboxEvent]:
    """A batch ready event as the ``ready`` of each member it names (of ``only``, when given)."""
    return [
        SandboxEvent(sandbox_id=sid, kind="ready", at=ev.at, host_id=ev.host_id, attempt=ev.attempt)
        for sid in ev.sandbox_ids if only is None or sid in only
    ]


_replies: dict[int, _Replies] = {}


# A request whose ack was lost with a NATS node (the stream's leader died, or the connection moved to
# another node of the seed list meanwhile), or that no stream took (a stream between leaders: an election takes seconds), is sent
# again until STORE_RIDE_THROUGH_S: its Nats-Msg-Id makes a copy the stream already holds harmless.
# Jittered, so that many clients do not come back together.
STORE_RIDE_THROUGH_S = 20.0
STORE_RETRY_S = (0.2, 1.0)


async def _store(nc: NATS, subject: str, data: bytes, headers: dict[str, str], timeout: float = 5.0) -> PubAck:
    """An acked JetStream publish of a request, with the control plane's failure as ``Unavailable``."""
    deadline = time.monotonic() + STORE_RIDE_THROUGH_S
    while True:
        fut = await (await publisher_for(nc)).publish(subject, data, headers)
        acked = await _wait_fut(fut, timeout)  # (asyncio.wait_for costs a create several microseconds more)
        last = time.monotonic() >= deadline
        try:
            if acked:
                return fut.result()
            if S.HDR_MSG_ID not in headers or last:
                raise Unavailable(f"the dsec control plane did not acknowledge the request within {timeout:g}s; is `dsec up` running?")
        except StoreError as exc:
            if not no_responders(exc) or last:
                raise Unavailable(f"the request was not stored ({exc}); is `dsec up` running?") from None
        except asyncio.TimeoutError as exc:
            raise Unavailable(f"the request was not stored ({exc}); is `dsec up` running?") from None
        await asyncio.sleep(random.uniform(*STORE_RETRY_S))  # back-off, jittered


async def _replies_for(nc: NATS) -> _Replies:
    r = _replies.get(id(nc))
    if r is None or r.nc is not nc:
        r = _replies[id(nc)] = _Replies(nc)
    return await r.start()


async def _outcome_in_stream(nc: NATS, spec: SandboxSpec, since: float = 0.0) -> SandboxEvent | None:
    """The sandbox's ready or failed event, read back from DSEC_EVT (the slow path); one from before
    ``since`` is an earlier generation's (a persisted pause resumed under the same id): not this one.
    A host announces ``ready`` without waiting for the stream's ack, after its record is stored: with
    no event in the stream, a running record is the outcome."""
    sid = spec.sandbox_id
    ev = await _outcome_in_events(_js(nc), sid, S.tenant(spec.client), since)
    if ev is not None:
        return ev
    try:
        rec = await _snap.sandbox_record(nc, sid)
    except Exception:  # noqa: BLE001 - the bucket is unreachable right now: look again later
        return None
    if rec is not None and rec.state in ("running", "paused") and rec.ready_at >= since:
        return SandboxEvent(sandbox_id=sid, kind="ready", at=rec.ready_at, host_id=rec.host_id, detail={"from": "record"})
    return None


async def _outcome_in_events(js: Any, sid: str, tenant: str, since: float) -> SandboxEvent | None:
    for kind in ("ready", "failed"):
        try:  # a direct get names the subject where the server can check it against the tenant's prefix
            m = await js.get_last_msg(S.STREAM_EVT, S.evt_sandbox(sid, kind, tenant), direct=True)
        except Exception:  # noqa: BLE001 - none yet (or the stream is unreachable right now)
            continue
        try:
            ev = codec.EVENT.decode(m.data)
        except BadRequest:
            continue
        if isinstance(ev, SandboxEvent) and ev.at >= since:
            return ev
    return None


INFO_TIMEOUT_S = 5.0  # a host answers info at once; past this the record answers (get_info)
RECHECK_AFTER_S = 3.0  # a create silent this long looks its outcome up in the stream (lost reply?)


async def _wait_fut(fut: asyncio.Future[Any], timeout: float) -> bool:
    """Wait for ``fut`` at most ``timeout`` seconds without cancelling it; True when it is done.
    (``asyncio.wait`` costs several times more, and this runs once per create.)"""
    if fut.done():
        return True
    loop = asyncio.get_running_loop()
    waker: asyncio.Future[None] = loop.create_future()

    def wake(_: Any = None) -> None:
        if not waker.done():
            waker.set_result(None)

    timer = loop.call_later(timeout, wake)
    fut.add_done_callback(wake)
    try:
        await waker
    finally:
        timer.cancel()
        fut.remove_done_callback(wake)
    return fut.done()


async def _wait_outcomes(
    waiter: _Waiter, nc: NATS, specs: dict[str, SandboxSpec], timeout: float, heard: dict[str, float], since: dict[str, float] | None = None
) -> None:
    """Wait until every id is ready or failed; raise TimeoutError after ``timeout``.

    Outcomes arrive on the reply inbox; an id not heard of for a while (a reply lost in a reconnect)
    is looked up in DSEC_EVT, at growing intervals so a long wait for capacity costs little.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    interval = RECHECK_AFTER_S
    while not waiter.done.is_set():
        left = deadline - loop.time()
        if left <= 0:
            raise asyncio.TimeoutError
        if await _wait_fut(waiter.fut, min(left, interval)):
            return
        now = time.monotonic()
        quiet = [sid for sid in list(waiter.pending_ids) if now - heard.get(sid, 0.0) >= interval][:256]
        for ev in await asyncio.gather(*(_outcome_in_stream(nc, specs[sid], (since or {}).get(sid, 0.0)) for sid in quiet)):
            if ev is not None:
                waiter.feed_event(ev)
        unseen = [sid for sid in quiet if sid in waiter.pending_ids]
        if unseen and _snap.records_conn(nc) is None:
            # A client tenant reads no records: a batch member's ready is in its host's batch event.
            for ev in await _outcomes_in_batches(nc, [specs[sid] for sid in unseen], since or {}):
                waiter.feed_event(ev)
        interval = min(interval * 2, 30.0)


async def _outcomes_in_batches(nc: NATS, specs: list[SandboxSpec], since: dict[str, float]) -> list[SandboxEvent]:
    """The ready of each of ``specs`` found in batch ready events (one scan per tenant, from the
    earliest request on); empty when the stream cannot be read now (looked up again later)."""
    from ._admin import ready_in_batches

    out: list[SandboxEvent] = []
    by_tenant: dict[str, list[SandboxSpec]] = {}
    for s in specs:
        by_tenant.setdefault(S.tenant(s.client), []).append(s)
    for tenant, ss in by_tenant.items():
        try:
            found = await ready_in_batches(nc, tenant, {s.sandbox_id for s in ss}, min(s.requested_at for s in ss) - 1.0, operator=False)
        except Exception:  # noqa: BLE001 - the stream is unreachable right now: look again later
            continue
        for s in ss:
            ev = found.get(s.sandbox_id)
            if ev is not None and ev.at >= since.get(s.sandbox_id, 0.0):
                out += _members_ready(ev, {s.sandbox_id})
    return out


async def _set_lease_owner(nc: NATS, url: str | None, specs: list[SandboxSpec]) -> None:
    """Sandboxes created with a lease carry this process's lease owner (renewed in the background)."""
    leased = [s for s in specs if s.lease_s > 0]
    if leased:
        owner = await _lease_owner(nc, url, min(s.lease_s for s in leased))
        for s in leased:
            s.owner = s.owner or owner


async def _send_creates(nc: NATS, specs: list[SandboxSpec], *, batch: bool) -> None:
    """Store the create requests on DSEC_REQ (a batch as messages of up to BATCH_CHUNK specs)."""
    tenant = tenant_of(nc)
    try:
        if batch:
            bid = specs[0].batch_id
            chunks = [specs[i:i + BATCH_CHUNK] for i in range(0, len(specs), BATCH_CHUNK)]
            await asyncio.gather(*(
                _store(nc, S.req_create_batch(tenant), codec.encode(CreateBatch(batch_id=f"{bid}-{n}", specs=c)), {S.HDR_MSG_ID: f"{bid}-{n}"})
                for n, c in enumerate(chunks)
            ))
        elif len(specs) == 1 and COALESCE:
            await _coalescer_for(nc).store(specs[0])
        else:
            for s in specs:
                await _store_specs(nc, [s], "")
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as exc:
        raise Unavailable(f"the dsec control plane did not accept the request ({type(exc).__name__}); is `dsec up` running?") from None


async def _store_specs(nc: NATS, specs: list[SandboxSpec], batch_id: str) -> None:
    """``specs`` stored as one request: a CreateSandbox for one (de-duplicated by its incarnation),
    else a CreateBatch (by ``batch_id``), split in two while it is bigger than the server takes."""
    tenant = tenant_of(nc)
    if len(specs) == 1:
        s = specs[0]
        await _store(nc, S.req_create(tenant), codec.encode(CreateSandbox(spec=s)), {S.HDR_MSG_ID: S.incarnation(s.sandbox_id, s.generation)})
        return
    data = codec.encode(CreateBatch(batch_id=batch_id, specs=specs, singles=True))
    if len(data) > nc.max_payload * 3 // 4:
        half = len(specs) // 2
        await asyncio.gather(_store_specs(nc, specs[:half], f"{batch_id}a"), _store_specs(nc, specs[half:], f"{batch_id}b"))
        return
    await _store(nc, S.req_create_batch(tenant), data, {S.HDR_MSG_ID: batch_id})


# Concurrent single creates of one connection share request messages (sdk/_coalesce.py); DSEC_COALESCE=0
# stores each alone (the benchmark compares the two).
COALESCE = os.environ.get("DSEC_COALESCE", "1") != "0"
_coalescers: dict[int, tuple[NATS, CreateCoalescer]] = {}


def _coalescer_for(nc: NATS) -> CreateCoalescer:
    got = _coalescers.get(id(nc))
    if got is None or got[0] is not nc:
        got = _coalescers[id(nc)] = (nc, CreateCoalescer(functools.partial(_store_specs, nc)))
    return got[1]


async def _give_up(nc: NATS, specs: list[SandboxSpec], waiter: _Waiter, create_timeout: float) -> None:
    """Kill whatever was not ready in time (a late create must not linger), then raise SandboxTimeout."""
    for s in specs:
        if s.sandbox_id not in waiter.results:
            await nc.publish(S.sbx(s.sandbox_id, "kill", tenant_of(nc)), codec.encode(KillRequest(reason="create-timeout")))
    last = {waiter.last[i].kind for i in waiter.pending_ids if i in waiter.last}
    why = "waiting for capacity (pending)" if "pending" in last else f"last state: {', '.join(sorted(last)) or 'no answer from placement'}"
    raise SandboxTimeout(f"{len(waiter.pending_ids)} of {len(specs)} sandbox(es) not ready within {create_timeout}s; {why}") from None


class AsyncSandbox:
    """A live sandbox. Create with ``await AsyncSandbox.create(...)``; ``async with`` kills it at the end."""

    def __init__(self, sandbox_id: str, nc: NATS, *, host_id: str = "", spec: SandboxSpec | None = None) -> None:
        self.sandbox_id = sandbox_id
        self.host_id = host_id
        self.spec = spec
        self._nc = nc
        self.commands = AsyncCommands(self)
        self.files = AsyncFilesystem(self)

    # Made on first use: a batch create makes thousands of handles that never exec or type.
    @functools.cached_property
    def input(self) -> "AsyncInput":
        """Keyboard and mouse of a sandbox with a screen (``backend="vm"``)."""
        return AsyncInput(self)

    @functools.cached_property
    def _traj(self) -> _trajectory.TrajClient:
        return _trajectory.TrajClient()

    def __repr__(self) -> str:
        return f"AsyncSandbox({self.sandbox_id!r}, host={self.host_id!r})"

    @property
    def tenant(self) -> str:
        """Whom this handle's ops speak for: its connection's tenant (the operator's reaches every sandbox)."""
        return tenant_of(self._nc)

    @property
    def nc(self) -> NATS:
        """The NATS connection this sandbox talks over (one per event loop and URL, shared)."""
        return self._nc

    # --- creation ------------------------------------------------------------------------
    @classmethod
    async def create(
        cls,
        template: str = "base",
        *,
        nats_url: str | None = None,
        create_timeout: float = 120.0,
        on_pending: Callable[[str], Any] | None = None,
        **kwargs: Any,
    ) -> "AsyncSandbox":
        """Create one sandbox and wait until it is ready (see ``build_spec`` for the arguments);
        ``snapshot=<id>`` restores a snapshot (on any host; its template is the snapshot's)."""
        if kwargs.get("snapshot"):
            template = await _snapshot_template(nats_url, kwargs["snapshot"], template)
        spec = build_spec(template, create_timeout=create_timeout, **kwargs)
        return (await cls._create_many([spec], nats_url, create_timeout, on_pending, batch=False))[0]

    @classmethod
    async def create_batch(
        cls,
        count: int,
        template: str = "base",
        *,
        nats_url: str | None = None,
        create_timeout: float = 120.0,
        sandbox_ids: list[str] | None = None,
        **kwargs: Any,
    ) -> list["AsyncSandbox"]:
        """Create ``count`` alike sandboxes with one request message (per 1,000); each gets its own events and record.

        ``sandbox_ids`` (optional, ``count`` of them) names the sandboxes instead of random ids.
        """
        _check_positive("count", count, lo=1, hi=100_000, integer=True)
        if sandbox_ids is not None and (len(sandbox_ids) != count or len(set(sandbox_ids)) != count):
            raise InvalidArgument(f"sandbox_ids must be {count} distinct ids")
        ids: list[str | None] = [None] * count if not sandbox_ids else [*sandbox_ids]
        if kwargs.get("snapshot"):
            template = await _snapshot_template(nats_url, kwargs["snapshot"], template)
        specs = [build_spec(template, create_timeout=create_timeout, sandbox_id=ids[i], **kwargs) for i in range(count)]
        batch_id = f"batch-{uuid.uuid4().hex[:16]}"
        for s in specs:
            s.batch_id = batch_id
        return await cls._create_many(specs, nats_url, create_timeout, None, batch=True)

    @classmethod
    async def _create_many(
        cls, specs: list[SandboxSpec], url: str | None, create_timeout: float, on_pending: Callable[[str], Any] | None, *, batch: bool,
        nc: NATS | None = None,
    ) -> list["AsyncSandbox"]:
        nc = nc or await _nc(url)
        tenant = tenant_of(nc)
        for s in specs:  # placement binds a client's creates to its tenant; the operator's (and the rollout workers') keep the client they name
            s.client = s.client if s.client and tenant in (S.OPERATOR_TENANT, ROLLOUTS_ROLE) else tenant
        waiter = _Waiter([s.sandbox_id for s in specs])
        pending_seen: set[str] = set()
        heard: dict[str, float] = {}

        def on_event(ev: SandboxEvent) -> None:
            if ev.sandbox_id not in waiter.pending_ids:
                return
            heard[ev.sandbox_id] = time.monotonic()
            waiter.feed_event(ev)
            if ev.kind == "pending" and ev.sandbox_id not in pending_seen:
                pending_seen.add(ev.sandbox_id)
                if on_pending is not None:
                    r = on_pending(ev.sandbox_id)
                    if inspect.isawaitable(r):
                        asyncio.ensure_future(r)

        replies = await _replies_for(nc)
        for s in specs:
            s.reply_to = replies.subject
            replies.waiters[s.sandbox_id] = on_event

        await _set_lease_owner(nc, url, specs)
        try:
            await _send_creates(nc, specs, batch=batch)
            try:
                since = {s.sandbox_id: s.requested_at for s in specs if s.generation}
                await _wait_outcomes(waiter, nc, {s.sandbox_id: s for s in specs}, create_timeout, heard, since)
            except asyncio.TimeoutError:
                await _give_up(nc, specs, waiter, create_timeout)
        finally:
            for s in specs:
                replies.waiters.pop(s.sandbox_id, None)
        failed = [waiter.results[s.sandbox_id] for s in specs if waiter.results[s.sandbox_id].kind == "failed"]
        out = [cls(s.sandbox_id, nc, host_id=waiter.results[s.sandbox_id].host_id, spec=s) for s in specs if waiter.results[s.sandbox_id].kind == "ready"]
        if failed:
            for sb in out:
                await sb.kill()
            ev = failed[0]
            raise from_reply(ErrorReply(code=ev.code or "create_failed", description=ev.description or "create failed", context={"sandbox_id": ev.sandbox_id}))
        return out

    @classmethod
    async def connect(
        cls, sandbox_id: str, *, nats_url: str | None = None, replay: bool = False, client_id: str | None = None, owner: str | None = None,
    ) -> "AsyncSandbox":
        """Talk to a running sandbox. ``replay``: start at step 0 of the trajectory log's last client
        (or ``client_id``): logged steps are answered from the log, not run again (sdk/_trajectory).
        ``owner``: the tenant whose log that is, when not the connection's (the rollout workers
        operate their jobs' sandboxes, which are the jobs' tenants')."""
        sb = await cls._connect(sandbox_id, nats_url)
        if replay or client_id is not None:
            log = await _trajectory.read_log(_js(sb._nc), sandbox_id, owner) if replay else []
            sb._traj.start_replay(log, client_id)
        return sb

    async def trajectory(self) -> list[_trajectory.TrajectoryStep]:
        """Every logged step of this sandbox, in the order its host answered them."""
        return await _trajectory.steps(_js(self._nc), self.sandbox_id, until=(self._traj.client_id, self._traj.answered))

    @classmethod
    async def _connect(cls, sandbox_id: str, nats_url: str | None) -> "AsyncSandbox":
        if not isinstance(sandbox_id, str) or not S.valid_token(sandbox_id):
            raise InvalidArgument(f"not a sandbox id: {sandbox_id!r}")
        nc = await _nc(nats_url)
        sb = cls(sandbox_id, nc)
        try:
            info = await sb.get_info()
        except SandboxNotFound:
            await _snap.resume(sb)  # a persisted pause comes back on any host (else: not found, as before)
            return sb
        sb.host_id = info.host_id
        if info.state == "paused":
            await _snap.resume(sb)
        return sb

    # --- snapshots ------------------------------------------------------------------------------
    async def create_snapshot(self, name: str | None = None, *, memory: bool = False, metadata: dict[str, str] | None = None) -> _snap.SnapshotInfo:
        """Snapshot the sandbox's files (what changed since its last snapshot, as a new layer); it keeps running."""
        return await _snap.create_snapshot(self, name, memory, metadata)

    async def fork(self, count: int, **create_kwargs: Any) -> list["AsyncSandbox"]:
        """Snapshot this sandbox and start ``count`` sandboxes from it (one batched create); this one keeps running.
        ``snapshot_metadata=`` goes on the snapshot; the rest are create arguments."""
        return await _snap.fork(self, count, create_kwargs)

    async def pause(self, persist: bool = False, *, memory: bool = False) -> _snap.SnapshotInfo | None:
        """Freeze the sandbox in place; with ``persist`` snapshot it (``memory``: its processes too) and
        free the host (returns the snapshot)."""
        return await _snap.pause(self, persist, memory)

    async def resume(self) -> "AsyncSandbox":
        await _snap.resume(self)
        return self

    @classmethod
    async def list_snapshots(cls, *, nats_url: str | None = None, sandbox_id: str | None = None) -> list[_snap.SnapshotInfo]:
        recs = await _snap.list_records(await _nc(nats_url))
        return [_snap.info_of(r) for r in recs if sandbox_id is None or r.sandbox_id == sandbox_id]

    @classmethod
    async def get_snapshot(cls, snapshot_id: str, *, nats_url: str | None = None) -> _snap.SnapshotInfo:
        return _snap.info_of(await _snap.get_record(await _nc(nats_url), snapshot_id))

    @classmethod
    async def delete_snapshot(cls, snapshot_id: str, *, nats_url: str | None = None) -> str:
        """Remove a snapshot nothing builds on, with the chunks only it used; ``snapshot_in_use`` otherwise."""
        return await _snap.remove(await _nc(nats_url), snapshot_id)

    @classmethod
    async def list(cls, *, nats_url: str | None = None, state: str | None = "running") -> list[SandboxInfo]:
        nc = await _nc(nats_url)
        reader = _snap.records_conn(nc)
        if reader is None:
            raise PermissionDenied("listing sandboxes reads every tenant's records: it takes the operator's credential")
        kv = await KV.bind(_js(reader), S.KV_SANDBOXES, codec.SANDBOX_RECORD)
        out: list[SandboxInfo] = []
        for k in await kv.keys():
            rec = await kv.get(k)  # missing (deleted meanwhile) or undecodable: skipped
            if rec is None:
                continue
            if state and rec.state != state:
                continue
            out.append(SandboxInfo(
                sandbox_id=rec.spec.sandbox_id, template=rec.spec.template, state=rec.state, host_id=rec.host_id,
                started_at=rec.ready_at, expires_at=rec.expires_at, metadata=rec.spec.metadata, cpu=rec.spec.cpu, memory_mb=rec.spec.memory_mb,
                cpu_class=rec.spec.priority,
            ))
        return out

    # --- requests -------------------------------------------------------------------------------
    async def _request(self, op: str, req: Any, result_type: Any, *, timeout: float = 30.0) -> Any:
        logged = self._traj.stamp(req)
        if logged is not None:
            return _trajectory.replayed(logged, result_type)
        try:
            msg = await (await requests_for(self._nc)).request(S.sbx(self.sandbox_id, op, self.tenant), codec.encode(req), timeout)
        except nats.errors.NoRespondersError:
            raise SandboxNotFound(f"sandbox {self.sandbox_id} is not running (killed, timed out, or never created)") from None
        except nats.errors.TimeoutError:
            raise SandboxTimeout(f"sandbox {self.sandbox_id} did not answer {op} within {timeout:g}s") from None
        except nats.errors.MaxPayloadError:
            raise InvalidArgument(
                f"the {op} request is larger than the NATS server's max_payload ({self._nc.max_payload} bytes): send less at once"
            ) from None
        if getattr(req, "step", -1) < 0:  # not a logged step
            return decode_reply(msg.data, result_type)
        try:
            out = decode_reply(msg.data, result_type)
        except DsecError as exc:
            _trajectory.note_reply(self._traj, req, exc)
            raise
        _trajectory.note_reply(self._traj, req)
        return out

    async def kill(self, *, timeout: float = 300.0) -> None:
        """Kill the sandbox and remove everything it had; killing a gone sandbox is fine.

        The host answers ``stopping`` while the teardown goes on (containerd busy): the kill is a
        durable intent there, and the request is repeated until it is done. Past ``timeout`` seconds
        it raises ``KillPending`` (the host still finishes it)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                done: Done = await self._request("kill", KillRequest(), Done, timeout=max(1.0, min(30.0, left)))
            except SandboxNotFound:
                return
            except SandboxTimeout:  # the host is too busy to answer in time: the intent may stand, ask again
                done = Done(detail=KILL_PENDING)
            if done.detail != KILL_PENDING:
                return
            if time.monotonic() >= deadline:
                raise KillPending(f"sandbox {self.sandbox_id} is still being stopped after {timeout:g}s; its host goes on with it")

    async def set_network(self, network: dict[str, Any] | None) -> None:
        """Replace the running sandbox's egress allowlist (``{"allow_out": [...]}``; None or an empty
        list: no egress). Only a sandbox created with a network has one to change (else NotSupported)."""
        await self._request("network", SetNetwork(network=_network_spec(network)), Done)

    async def set_timeout(self, timeout: float) -> None:
        _check_positive("timeout", timeout, lo=1, hi=30 * 86400)
        await self._request("timeout", SetTimeout(timeout_s=float(timeout)), Done)

    async def get_info(self) -> SandboxInfo:
        """What the sandbox's host says of it; when the host does not answer in time (a request lost
        while the sandbox's subject goes away: NATS can drop a request racing an unsubscribe), what its
        record says: an ended sandbox is not found, a live one is described from the record."""
        try:
            i: WireInfo = await self._request("info", InfoRequest(), WireInfo, timeout=INFO_TIMEOUT_S)
        except SandboxTimeout:
            return await self._info_from_record()
        return SandboxInfo(
            sandbox_id=i.sandbox_id, template=i.template, state=i.state, host_id=i.host_id,
            started_at=i.started_at, expires_at=i.expires_at, metadata=i.metadata, cpu_class=i.cpu_class,
            mem_resident_bytes=i.mem_resident_bytes, mem_reclaimed_bytes=i.mem_reclaimed_bytes, mem_merged_bytes=i.mem_merged_bytes,
        )

    async def _info_from_record(self) -> SandboxInfo:
        if _snap.records_conn(self._nc) is None:
            raise SandboxTimeout(f"sandbox {self.sandbox_id} did not answer info within {INFO_TIMEOUT_S:g}s")
        rec = await _snap.sandbox_record(self._nc, self.sandbox_id)
        if rec is None or rec.state in SANDBOX_ENDED:
            raise SandboxNotFound(f"sandbox {self.sandbox_id} {'has ended (' + rec.state + ')' if rec else 'does not exist'}")
        return SandboxInfo(
            sandbox_id=self.sandbox_id, template=rec.spec.template, state=rec.state, host_id=rec.host_id,
            started_at=rec.ready_at, expires_at=rec.expires_at, metadata=rec.spec.metadata,
        )

    async def screenshot(self) -> bytes:
        """The screen of a sandbox with one (``backend="vm"``) as PNG; others raise ``NotSupported``."""
        return await _display.screenshot(self)

    async def get_metrics(self) -> SandboxMetrics:
        """CPU and memory (from the sandbox's cgroups) and disk use right now."""
        m: WireMetrics = await self._request("metrics", MetricsRequest(), WireMetrics)
        return SandboxMetrics(
            timestamp=m.at, cpu_count=m.cpu_count, cpu_used_pct=m.cpu_used_pct, cpu_usage_s=m.cpu_usage_s,
            mem_used=m.mem_used_bytes, mem_total=m.mem_total_bytes, disk_used=m.disk_used_bytes, disk_total=m.disk_total_bytes,
        )

    async def is_running(self) -> bool:
        try:
            await self.get_info()
            return True
        except SandboxNotFound:
            return False

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.kill()


__all__ = ["AsyncSandbox", "AsyncCommands", "AsyncFilesystem", "build_spec", "close_connections"]
