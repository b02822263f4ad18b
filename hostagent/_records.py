"""What this host tells the cluster: sandbox records in KV (claimed with the bus runtime's one
compare-and-set claim), sandbox and host events, dead letters, re-placed work."""

from __future__ import annotations

import asyncio
import functools
import time

import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from bus import codec
from bus import subjects as S
from bus.errors import DsecError, InternalError
from bus.messages import SANDBOX_ENDED, HostEventKind, SandboxEventKind, SandboxRecord, SandboxSpec, SandboxState
from bus.runtime import KV, Claim, Events, Publisher, StoreError, dead_letter, publisher_for

from ._registry import LocalSandbox

log = structlog.get_logger("dsec.hostagent")

# Record states (bus.messages.SandboxRecord). A claim is a record in CLAIM_STATE; this host takes an id
# back whose record it wrote itself in one of OURS (an earlier delivery of the same work).
CLAIM_STATE: SandboxState = "creating"
OURS = ("placed", "creating", "running")


def resumes(cur: SandboxRecord, spec: SandboxSpec) -> bool:
    """True when ``spec`` is the resume of the persisted pause ``cur`` records, or the restore of a
    sandbox lost with its host (placement._hostloss), so it may take the id."""
    if cur.state == "lost" and cur.spec.restore_on_host_loss:
        return bool(spec.snapshot) and spec.generation > cur.spec.generation and spec.client == cur.spec.client
    return cur.state == "paused" and bool(cur.snapshot_id) and spec.snapshot == cur.snapshot_id and spec.generation > cur.spec.generation


def container_of(ls: LocalSandbox) -> str:
    """The container serving ``ls`` when it is not named after the sandbox (a warm one, a later
    generation's): guard finds the sandbox of a kernel record through it."""
    cid = ls.extra.get("cid")
    return cid if isinstance(cid, str) and cid != ls.spec.sandbox_id else ""


class Records:
    def __init__(self, host_id: str) -> None:
        self.host_id = host_id
        self.nc: NATS | None = None
        self.kv: KV[SandboxRecord] | None = None  # dsec_sandboxes
        self.publisher: Publisher | None = None
        self.events: Events | None = None

    async def start(self, nc: NATS, js: JetStreamContext) -> None:
        self.nc = nc
        self.publisher = await publisher_for(nc)  # one per connection: shared by simulated hosts
        self.events = Events(nc, self.publisher, host_id=self.host_id)
        self.kv = await KV.open(js, S.KV_SANDBOXES, codec.SANDBOX_RECORD)

    # --- records ---------------------------------------------------------------------------------
    def record_of(self, ls: LocalSandbox, state: SandboxState, *, end_reason: str = "") -> SandboxRecord:
        return SandboxRecord(
            spec=ls.spec, state=state, host_id=self.host_id, created_at=ls.spec.requested_at,
            ready_at=ls.started_at, expires_at=ls.expires_at,
            ended_at=time.time() if state in SANDBOX_ENDED else 0.0, end_reason=end_reason,
            container_id=container_of(ls),
        )

    async def record(self, ls: LocalSandbox, state: SandboxState, *, end_reason: str = "") -> None:
        """Store the sandbox's record (acked: raises InternalError when not stored)."""
        await self.put(self.record_of(ls, state, end_reason=end_reason))

    async def put(self, rec: SandboxRecord) -> None:
        assert self.kv is not None
        try:
            await self.kv.put(rec.spec.sandbox_id, rec)
        except (StoreError, asyncio.TimeoutError) as exc:
            raise InternalError(f"record of {rec.spec.sandbox_id} not stored: {exc}") from None

    async def failed(self, spec: SandboxSpec, err: DsecError) -> None:
        await self.put(SandboxRecord(spec=spec, state="failed", host_id=self.host_id, ended_at=time.time(), end_reason=err.code))

    async def release(self, sid: str) -> None:
        """Give a claim back (the id is free for another host)."""
        assert self.kv is not None
        await self.kv.delete(sid)

    async def claim(self, spec: SandboxSpec, rec: SandboxRecord | None = None) -> Claim:
        """Claim the sandbox id cluster-wide with ``rec`` (default: a claim record); False when another
        host owns it (``Claim.LOST``, falsy). A record this host wrote in one of ``OURS`` is ours
        (``Claim.MINE``, and is then overwritten with ``rec``); an unreadable one is treated as absent
        (the runtime's one rule)."""
        assert self.kv is not None
        if rec is None:
            rec = SandboxRecord(spec=spec, state=CLAIM_STATE, host_id=self.host_id, created_at=spec.requested_at)
        # A persisted pause's record is taken over by its resume (one generation up), on any host.
        got = await self.kv.claim(spec.sandbox_id, rec, mine=functools.partial(self._mine, rec=rec))
        if got is Claim.MINE and rec.state != CLAIM_STATE:
            await self.put(rec)
        return got

    async def claim_running(self, recs: list[SandboxRecord]) -> list[Claim | BaseException]:
        """``claim`` with each of ``recs`` (records of sandboxes this host just made), written as one
        atomic batch (each id's record created, or none: then one by one, pipelined); per record:
        claimed (``WON``; ``MINE``: over a record of this host's own, now stored), lost to another
        host (``LOST``), or what storing it raised."""
        assert self.kv is not None
        got = await self.kv.claim_atomic([(r.spec.sandbox_id, r) for r in recs], mine=self._mine)
        out: list[Claim | BaseException] = []
        for rec, g in zip(recs, got, strict=True):
            if g is Claim.MINE:
                try:
                    await self.put(rec)
                except InternalError as exc:
                    g = exc
            out.append(g)
        return out

    def _mine(self, cur: SandboxRecord, rec: SandboxRecord) -> bool:
        return cur.host_id == self.host_id and cur.state in OURS or resumes(cur, rec.spec)

    # --- events ------------------------------------------------------------------------------------
    async def event(
        self, spec: SandboxSpec, kind: SandboxEventKind, *, attempt: int = 0, err: DsecError | None = None,
        detail: dict[str, str] | None = None, acked: bool = True, reply: bool = True, host_id: str | None = None,
    ) -> None:
        """An acked sandbox event (de-duplicated per attempt; ready/failed also reach the creating
        client's inbox: bus.runtime.events); ``acked=False`` for audit events on hot paths."""
        assert self.events is not None
        try:
            await self.events.sandbox(spec, kind, attempt=attempt, err=err, detail=detail, acked=acked, reply=reply, host_id=host_id)
        except (StoreError, asyncio.TimeoutError) as exc:
            raise InternalError(f"{kind} event of {spec.sandbox_id} not stored: {exc}") from None

    async def ready_many(
        self, specs: list[SandboxSpec], attempt: int = 0, *, batch_id: str = "", detail: dict[str, str] | None = None, store: bool = True,
        host_id: str | None = None,
    ) -> None:
        """A hand-off's ready sandboxes: one event per tenant naming them (``store``), and the creating
        clients told in one message each (core: a client that misses it finds the record or the event)."""
        assert self.events is not None
        await self.events.ready_many(specs, attempt, batch_id=batch_id, detail=detail, store=store, host_id=host_id)

    async def host_event(self, kind: HostEventKind) -> None:
        assert self.events is not None
        await self.events.host(self.host_id, kind)

    async def dead_letter(self, msg: Msg, code: str, description: str = "") -> None:
        """Keep unusable work as evidence, then ack it (so it is not redelivered forever); not acked
        when the dead letter is not stored (redelivered)."""
        assert self.publisher is not None
        await dead_letter(self.publisher, msg, code, description)

    async def hand_on(self, subject: str, data: bytes, msg_id: str) -> None:
        """Work handed back to placement (a re-placement), de-duplicated by ``msg_id``."""
        assert self.publisher is not None
        await self.publisher.store(subject, data, {S.HDR_MSG_ID: msg_id})


__all__ = ["Records", "CLAIM_STATE", "OURS", "resumes"]
