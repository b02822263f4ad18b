"""Events on DSEC_EVT, in one place: the sandbox event's msg-id and the fan-out to the creating client.

Rules:

* an acked sandbox event whose kind happens once per attempt (``ONCE_PER_ATTEMPT``) carries
  ``Nats-Msg-Id = <sandbox_id>:<kind>:<attempt>``: a redelivered piece of work that says it again
  is de-duplicated by the stream;
* an informational event (``acked=False``: exec, ...) is a core publish the stream still records,
  without an ack round trip on the hot path; so is a create's ``ready``, whose durable twin is the
  sandbox record the host stored (acked) just before: a client that misses the event reads the record;
* the members of a host batch (one hand-off) are announced in ONE event per tenant, ``ReadyMany`` on
  ``dsec.evt.ready.<tenant>.<host>`` (``ready_many``), not one ``ready`` each: a replicated stream
  stores one message for the batch. Its msg-id names its host, attempt and members. A sandbox
  announced there is never announced again in an event of its own (the stream could not
  de-duplicate the two): a host that says ``ready`` again looks the batch event up first
  (``find_ready_many``);
* the events a create waits for (``REPLY_KINDS``) are also sent to the spec's ``reply_to`` inbox,
  so the creating client hears them without a subscription of its own (it finds them in the stream
  if that core message is lost). Only ``_INBOX.`` subjects: a client must not make us publish on
  control subjects.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import json
import time
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from .. import log as _log
from .. import subjects as S
from ..codec import encode
from ..errors import DsecError
from ..messages import HostEvent, HostEventKind, ReadyMany, SandboxEvent, SandboxEventKind, SandboxSpec
from .publisher import PubAck, Publisher, nc_of

logger = _log.get_logger("dsec.bus.events")

REPLY_KINDS: frozenset[SandboxEventKind] = frozenset({"ready", "failed", "pending"})
ONCE_PER_ATTEMPT: frozenset[SandboxEventKind] = frozenset({"ready", "failed", "killed", "rejected", "timeout"})


def event_msg_id(sandbox_id: str, kind: str, attempt: int = 0) -> str:
    return f"{sandbox_id}:{kind}:{attempt}"


def ready_many_msg_id(host_id: str, sandbox_ids: list[str], attempt: int = 0) -> str:
    """De-duplication id of a batch ready event: its host, attempt and members (a digest)."""
    digest = hashlib.blake2b(",".join(sandbox_ids).encode(), digest_size=12).hexdigest()
    return f"ready:{host_id}:{attempt}:{digest}"


def sandbox_event(
    sandbox_id: str, kind: SandboxEventKind, *, attempt: int = 0, host_id: str = "", err: DsecError | None = None, detail: dict[str, str] | None = None
) -> SandboxEvent:
    return SandboxEvent(
        sandbox_id=sandbox_id, kind=kind, at=time.time(), host_id=host_id, attempt=attempt,
        code=err.code if err else "", description=err.description if err else "", detail=detail or {},
    )


class Events:
    """Emits events for one service (``host_id`` fills the events of a host agent)."""

    def __init__(self, nc: NATS, publisher: Publisher, *, host_id: str = "") -> None:
        self.nc = nc
        self.publisher = publisher
        self.host_id = host_id

    async def sandbox(
        self,
        spec: SandboxSpec,
        kind: SandboxEventKind,
        *,
        attempt: int = 0,
        host_id: str | None = None,
        err: DsecError | None = None,
        detail: dict[str, str] | None = None,
        acked: bool = True,
        wait: bool = True,
        reply: bool = True,
    ) -> "PubAck | asyncio.Future[PubAck] | None":
        """Emit one sandbox event (see the module rules). ``wait=False``: return the ack's future
        (pipelined); ``acked=False``: a core publish, returns None; ``reply=False``: not to the
        creating client (its caller tells it with ``ready_many``)."""
        ev = sandbox_event(spec.sandbox_id, kind, attempt=attempt, host_id=self.host_id if host_id is None else host_id, err=err, detail=detail)
        data = encode(ev)
        subject = S.evt_sandbox(spec.sandbox_id, kind, S.tenant(spec.client))
        fut: asyncio.Future[PubAck] | None = None
        hdr = {S.HDR_MSG_ID: event_msg_id(S.incarnation(spec.sandbox_id, spec.generation), kind, attempt)} if kind in ONCE_PER_ATTEMPT else None
        if acked:
            fut = await self.publisher.publish(subject, data, hdr)
        else:  # the stream still de-duplicates a core publish by its msg-id (stored again after a reconnect)
            await self.publisher.fire(subject, data, hdr)
        if reply and kind in REPLY_KINDS and spec.reply_to and S.valid_inbox(spec.reply_to):
            await self.nc.publish(spec.reply_to, data)  # the waiting client hears it now (the stream keeps it)
        if fut is None or not wait:
            return fut
        return await fut

    async def ready_many(
        self, specs: list[SandboxSpec], attempt: int = 0, *, batch_id: str = "", detail: dict[str, str] | None = None, store: bool = True,
        host_id: str | None = None,
    ) -> None:
        """A host batch's ready sandboxes: one event per tenant in DSEC_EVT naming its members (with
        ``store``; fired like a single ``ready``: the members' records are the durable fact, stored
        before), then each creating client told in one message per inbox which of its sandboxes are ready."""
        if not specs:
            return
        now = time.time()
        host = self.host_id if host_id is None else host_id
        if store:
            by_tenant: dict[str, list[str]] = {}
            for s in specs:
                by_tenant.setdefault(S.tenant(s.client), []).append(s.sandbox_id)
            for tenant, ids in by_tenant.items():
                ev = ReadyMany(sandbox_ids=ids, host_id=host, at=now, attempt=attempt, batch_id=batch_id, detail=detail or {})
                # The same announcement made again (a redelivered hand-off) is stored once.
                await self.publisher.fire(S.evt_ready(tenant, host), encode(ev), {S.HDR_MSG_ID: ready_many_msg_id(host, ids, attempt)})
        by_inbox: dict[str, list[str]] = {}
        for s in specs:
            if s.reply_to:
                by_inbox.setdefault(s.reply_to, []).append(s.sandbox_id)
        for inbox, ids in by_inbox.items():
            if S.valid_inbox(inbox):
                await self.nc.publish(inbox, encode(ReadyMany(sandbox_ids=ids, host_id=host, at=now, attempt=attempt, batch_id=batch_id)))

    async def host(self, host_id: str, kind: HostEventKind, detail: dict[str, str] | None = None) -> PubAck:
        return await self.publisher.store(S.evt_host(host_id, kind), encode(HostEvent(host_id=host_id, kind=kind, at=time.time(), detail=detail or {})))


class LookupFailed(Exception):
    """The event stream did not answer a look-up (no leader for a moment, a timeout): whether the
    event is there is unknown."""


class ReadyScan:
    """Looks for the batch ready event of ``host_id`` naming ``sandbox_id`` among those the host stored
    for ``tenant`` from ``since`` on (direct gets, next by subject), reading each once: a ``look()``
    goes on from where the last one stopped (an event fired before a stream's election can be stored
    again after many later ones)."""

    def __init__(self, nc: NATS, tenant: str, host_id: str, sandbox_id: str, since: float, *, timeout_s: float = 2.0) -> None:
        self.nc = nc
        self.sandbox_id = sandbox_id
        self.subject = S.evt_ready(tenant, host_id)
        self.timeout_s = timeout_s
        start = dt.datetime.fromtimestamp(max(0.0, since), dt.timezone.utc).isoformat()
        self._req: dict[str, Any] = {"start_time": start, "next_by_subj": self.subject}

    async def look(self, limit: int = 256) -> ReadyMany | None:
        """The event, if stored by now (at most ``limit`` more read); ``LookupFailed`` when the stream does not answer."""
        for _ in range(limit):
            hdr, data = await _direct_get(self.nc, f"$JS.API.DIRECT.GET.{S.STREAM_EVT}", json.dumps(self._req).encode(), self.timeout_s)
            if hdr is None:
                return None
            self._req = {"seq": int(hdr["Nats-Sequence"]) + 1, "next_by_subj": self.subject}
            try:
                ev = READY_MANY.decode(data)
            except msgspec.DecodeError:
                continue
            if self.sandbox_id in ev.sandbox_ids:
                return ev
        return None


async def find_ready_many(nc: NATS, tenant: str, host_id: str, sandbox_id: str, since: float, *, limit: int = 256, timeout_s: float = 2.0) -> ReadyMany | None:
    """The batch ready event of ``host_id`` that names ``sandbox_id``, among the first ``limit`` that
    host stored for ``tenant`` from ``since`` on; None when there is none; ``LookupFailed`` when the
    stream does not answer."""
    return await ReadyScan(nc, tenant, host_id, sandbox_id, since, timeout_s=timeout_s).look(limit)


async def _direct_get(nc: NATS, api: str, body: bytes, timeout_s: float) -> tuple[dict[str, str] | None, bytes]:
    """A direct get's headers and message; (None, b"") when there is no such message (404);
    ``LookupFailed`` when the stream does not answer."""
    try:
        m = await nc.request(api, body, timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001 - no responders (no leader), a timeout
        raise LookupFailed(repr(exc)) from None
    hdr = m.headers or {}
    if hdr.get("Nats-Sequence", "").isdigit():
        return hdr, m.data
    if hdr.get("Status", "") == "404":
        return None, b""
    raise LookupFailed(f"direct get answered {hdr.get('Status', '?')} {hdr.get('Description', '')}")


READY_MANY = msgspec.msgpack.Decoder(ReadyMany)
_SANDBOX_EVENT = msgspec.msgpack.Decoder(SandboxEvent)


async def own_ready_since(nc: NATS, tenant: str, sandbox_id: str, since: float, *, timeout_s: float = 2.0) -> bool:
    """Whether the sandbox's own ``ready`` event (on its subject) was stored at ``since`` or later (a
    direct get of the subject's last message); ``LookupFailed`` when the stream does not answer."""
    hdr, data = await _direct_get(nc, f"$JS.API.DIRECT.GET.{S.STREAM_EVT}.{S.evt_sandbox(sandbox_id, 'ready', tenant)}", b"", timeout_s)
    if hdr is None:
        return False
    try:
        return _SANDBOX_EVENT.decode(data).at >= since
    except msgspec.DecodeError:
        return False


async def best_effort_event(js: JetStreamContext, subject: str, ev: Any, *, timeout_s: float = 2.0) -> None:
    """An event that must never fail the work: acked when a stream takes it in time, else a core
    publish (no DSEC_EVT yet, or NATS away for a moment); errors are logged, never raised."""
    data = encode(ev)
    try:
        await js.publish(subject, data, timeout=timeout_s)
        return
    except Exception as exc:  # noqa: BLE001 - fall back to a core publish
        logger.debug("event_not_acked", subject=subject, error=str(exc))
    try:
        await nc_of(js).publish(subject, data)
    except Exception as exc:  # noqa: BLE001
        logger.warning("event_lost", subject=subject, error=str(exc))


__all__ = [
    "Events", "best_effort_event", "ONCE_PER_ATTEMPT", "REPLY_KINDS", "LookupFailed", "ReadyScan", "event_msg_id", "find_ready_many",
    "own_ready_since", "ready_many_msg_id", "sandbox_event",
]
