"""What this host tells the cluster: sandbox records in KV (with the one claim rule), sandbox and host
events, dead letters. Every NATS write of the host agent goes through here, so the bus runtime layer
replaces this module's insides and nothing else."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from bus import codec
from bus import subjects as S
from bus.acks import JsAcks, StoreError, acks_for
from bus.errors import BadRequest, DsecError, InternalError
from bus.messages import SANDBOX_ENDED, HostEvent, SandboxEvent, SandboxRecord, SandboxSpec
from bus.streams import ensure_kv

from ._registry import LocalSandbox

log = structlog.get_logger("dsec.hostagent")

# Record states (bus.messages.SandboxRecord). A claim is a record in CLAIM_STATE; this host may take
# over an id whose record it wrote itself in one of OURS (an earlier delivery of the same work).
CLAIM_STATE = "creating"
OURS = ("placed", "creating", "running")
# Events a client or placement waits for: de-duplicated per sandbox, kind and attempt.
_DEDUP_KINDS = ("ready", "failed", "killed", "rejected", "lost")
# nats-py mechanics the bus runtime layer will own: a KV key's stream subject, and JetStream's
# expected-sequence header (sequence 0: stored only if the key never had a value).
_HDR_EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"


def _kv_subject(sid: str) -> str:
    return f"$KV.{S.KV_SANDBOXES}.{sid}"


class Records:
    def __init__(self, host_id: str) -> None:
        self.host_id = host_id
        self.nc: NATS | None = None
        self.js: JetStreamContext | None = None
        self.kv: KeyValue | None = None  # dsec_sandboxes
        self._acks: JsAcks | None = None

    async def start(self, nc: NATS, js: JetStreamContext) -> None:
        self.nc, self.js = nc, js
        self._acks = await acks_for(nc)
        self.kv = await ensure_kv(js, S.KV_SANDBOXES)

    async def stop(self, *, shared: bool) -> None:
        if self._acks is not None and not shared:  # a shared connection's pipeline is its owner's
            await self._acks.stop()

    # --- records ---------------------------------------------------------------------------------
    def record_of(self, ls: LocalSandbox, state: str, *, end_reason: str = "") -> SandboxRecord:
        return SandboxRecord(
            spec=ls.spec, state=state, host_id=self.host_id, created_at=ls.spec.requested_at,
            ready_at=ls.started_at, expires_at=ls.expires_at,
            ended_at=time.time() if state in SANDBOX_ENDED else 0.0, end_reason=end_reason,
        )

    async def record(self, ls: LocalSandbox, state: str, *, end_reason: str = "") -> None:
        """Store the sandbox's record (acked: raises InternalError when not stored)."""
        await self.store(_kv_subject(ls.spec.sandbox_id), codec.encode(self.record_of(ls, state, end_reason=end_reason)))

    async def failed(self, spec: SandboxSpec, err: DsecError) -> None:
        if self.kv is not None:
            rec = SandboxRecord(spec=spec, state="failed", host_id=self.host_id, ended_at=time.time(), end_reason=err.code)
            await self.kv.put(spec.sandbox_id, codec.encode(rec))

    async def get(self, sid: str) -> SandboxRecord | None:
        """The stored record; None when there is none or it cannot be read."""
        assert self.kv is not None
        try:
            return codec.SANDBOX_RECORD.decode((await self.kv.get(sid)).value)
        except (KeyNotFoundError, BadRequest):
            return None

    async def release(self, sid: str) -> None:
        """Give a claim back (the id is free for another host)."""
        if self.kv is not None:
            await self.kv.delete(sid)

    async def claim(self, spec: SandboxSpec, rec: bytes | None = None) -> bool:
        """Claim the sandbox id cluster-wide with ``rec`` (default: a claim record); False when
        another host owns it.

        The one rule: a missing record is free (a KV create); a record this host wrote in one of
        ``OURS`` is ours again; an unreadable record is free too (nobody can own an id through a
        record no one can read). Every take-over is a compare-and-set on the revision seen, so two
        hosts never both win.
        """
        assert self.kv is not None and self._acks is not None
        sid = spec.sandbox_id
        if rec is None:
            rec = codec.encode(SandboxRecord(spec=spec, state=CLAIM_STATE, host_id=self.host_id, created_at=spec.requested_at))
        try:  # a KV create, pipelined: stored only if the key never had a value
            await self._acks.store(_kv_subject(sid), rec, {_HDR_EXPECTED_LAST_SUBJECT_SEQ: "0"})
            return True
        except (StoreError, asyncio.TimeoutError):
            pass
        try:
            await self.kv.create(sid, rec)  # also takes a deleted key's tombstone
            return True
        except KeyWrongLastSequenceError:
            pass
        try:
            entry = await self.kv.get(sid)
        except KeyNotFoundError:  # deleted in between (a claim given back): free again
            try:
                await self.kv.create(sid, rec)
                return True
            except KeyWrongLastSequenceError:
                return False
        try:
            cur = codec.SANDBOX_RECORD.decode(entry.value)
            mine = cur.host_id == self.host_id and cur.state in OURS
        except BadRequest:
            mine = True
        if not mine:
            return False
        try:
            await self.kv.update(sid, rec, last=entry.revision)
            return True
        except KeyWrongLastSequenceError:
            return False

    # --- events ------------------------------------------------------------------------------------
    async def event(
        self, spec: SandboxSpec, kind: str, *, attempt: int = 0, err: DsecError | None = None, detail: dict[str, str] | None = None,
    ) -> None:
        await self.sandbox_event(SandboxEvent(
            sandbox_id=spec.sandbox_id, kind=kind, at=time.time(), host_id=self.host_id, attempt=attempt,
            code=err.code if err else "", description=err.description if err else "", detail=detail or {},
        ), reply_to=spec.reply_to)

    async def sandbox_event(self, ev: SandboxEvent, *, reply_to: str = "", acked: bool = True) -> None:
        """Publish ``ev`` on its subject (acked, de-duplicated for the kinds clients wait for), and to
        the creating client's inbox for ``ready``/``failed``: it hears without a subscription of its own.
        ``acked=False``: a core publish the stream still captures (audit events on hot paths)."""
        assert self.nc is not None
        data = codec.encode(ev)
        subject = S.evt_sandbox(ev.sandbox_id, ev.kind)
        if not acked:
            await self.nc.publish(subject, data)
        else:
            hdr = {S.HDR_MSG_ID: f"{ev.sandbox_id}:{ev.kind}:{ev.attempt}"} if ev.kind in _DEDUP_KINDS else None
            await self.store(subject, data, hdr)
        if ev.kind in ("ready", "failed") and reply_to and S.valid_inbox(reply_to):
            await self.nc.publish(reply_to, data)

    async def host_event(self, kind: str) -> None:
        assert self.js is not None
        await self.js.publish(S.evt_host(self.host_id, kind), codec.encode(HostEvent(host_id=self.host_id, kind=kind, at=time.time())))

    async def dead_letter(self, msg: Msg, code: str) -> None:
        """Keep unusable work as evidence (the caller acks it, so it is not redelivered forever)."""
        assert self.js is not None
        await self.js.publish(S.dlq(msg.subject), msg.data, headers={S.HDR_ERROR_CODE: code, "Dsec-Origin": msg.subject})

    async def store(self, subject: str, data: bytes, headers: dict[str, str] | None = None) -> None:
        """An acked JetStream write (raises when not stored: the work stays un-acked and is redelivered)."""
        assert self._acks is not None
        try:
            await self._acks.store(subject, data, headers)
        except (StoreError, asyncio.TimeoutError) as exc:
            raise InternalError(f"not stored on {subject}: {exc}") from None

    async def publish(self, subject: str, data: bytes, headers: dict[str, str] | None = None) -> None:
        """A JetStream publish for work handed on (re-placements)."""
        assert self.js is not None
        await self.js.publish(subject, data, headers=headers)

    async def core(self, subject: str, data: bytes) -> Any:
        assert self.nc is not None
        await self.nc.publish(subject, data)


__all__ = ["Records", "CLAIM_STATE", "OURS"]
