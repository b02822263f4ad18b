"""One tenant per API key: its own NATS connection (as the key's user) and only its own sandboxes.

A sandbox belongs to the key whose NATS user is in its spec's ``client`` (set at create); the
record in KV ``dsec_sandboxes`` says so, and the gateway answers every other key as if the
sandbox did not exist (404, as E2B does).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from nats.aio.client import Client as NATS
from nats.js.errors import NotFoundError

from bus import codec
from bus import subjects as S
from bus.errors import DsecError, SandboxNotFound, Unavailable, UnknownSnapshot
from bus.messages import SandboxRecord, SnapshotRecord
from bus.runtime import KV, connect

from .._async import AsyncSandbox, _conns
from .._snapshots import SnapshotInfo, get_record, info_of, list_records
from ._keys import BadKey, key_digest, parse_key

LIVE_STATES = ("placed", "running", "paused")
OWNER_CACHE = 10_000  # sandbox ids whose owner a tenant remembers (ownership never changes)


class Unauthenticated(DsecError):
    code = "unauthenticated"
    http_status = 401


def url_with_user(base_url: str, user: str, password: str) -> str:
    parts = urlsplit(base_url.split(",")[0])
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{parts.hostname}:{parts.port or 4222}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


@dataclass
class Tenant:
    user: str  # the key's NATS user: the ``client`` of its sandboxes
    url: str  # the NATS URL with the key's credentials
    nc: NATS
    owned: dict[str, bool] = field(default_factory=dict)
    kv: KV[SandboxRecord] | None = None

    async def _kv(self) -> KV[SandboxRecord] | None:
        if self.kv is None:
            try:
                self.kv = await KV.bind(self.nc.jetstream(), S.KV_SANDBOXES, codec.SANDBOX_RECORD)
            except NotFoundError:
                return None  # no sandbox was ever created on this NATS
        return self.kv

    async def record(self, sid: str) -> SandboxRecord | None:
        kv = await self._kv() if S.valid_token(sid) else None
        return None if kv is None else await kv.get(sid)

    async def own_record(self, sid: str) -> SandboxRecord:
        """The record of ``sid`` if this key created it and it lives; else SandboxNotFound."""
        rec = await self.record(sid)
        if rec is None or rec.spec.client != self.user or rec.state not in LIVE_STATES:
            raise SandboxNotFound(f"sandbox {sid} not found")
        self._remember(sid)
        return rec

    async def sandbox(self, sid: str) -> AsyncSandbox:
        """A handle on ``sid`` for ops (exec, files, kill...); SandboxNotFound unless this key owns it."""
        if not self.owned.get(sid):
            await self.own_record(sid)
        return AsyncSandbox(sid, self.nc)

    def _remember(self, sid: str) -> None:
        if len(self.owned) >= OWNER_CACHE:
            self.owned.pop(next(iter(self.owned)))
        self.owned[sid] = True

    async def create(self, template: str, **kw: Any) -> AsyncSandbox:
        sb = await AsyncSandbox.create(template, nats_url=self.url, client=self.user, **kw)
        self._remember(sb.sandbox_id)
        return sb

    async def fork(self, sb: AsyncSandbox, count: int, **kw: Any) -> list[AsyncSandbox]:
        forks = await sb.fork(count, nats_url=self.url, client=self.user, **kw)
        for f in forks:
            self._remember(f.sandbox_id)
        return forks

    def _owns_snapshot(self, rec: SnapshotRecord) -> bool:
        return rec.spec is not None and rec.spec.client == self.user

    async def own_snapshot(self, snapshot_id: str) -> SnapshotRecord:
        """The record of a snapshot taken of one of this key's sandboxes; else UnknownSnapshot."""
        try:
            rec = await get_record(self.nc, snapshot_id)
        except UnknownSnapshot:
            rec = None
        if rec is None or not self._owns_snapshot(rec):
            raise UnknownSnapshot(f"snapshot {snapshot_id} not found", snapshot_id=snapshot_id)
        return rec

    async def snapshots(self) -> list[SnapshotInfo]:
        """This key's snapshots, oldest first."""
        return [info_of(r) for r in await list_records(self.nc) if self._owns_snapshot(r)]

    async def records(self) -> list[SandboxRecord]:
        """Every live sandbox of this key."""
        kv = await self._kv()
        if kv is None:
            return []
        got = await asyncio.gather(*(kv.get(k) for k in await kv.keys()))  # None: deleted since the listing
        return [r for r in got if r is not None and r.spec.client == self.user and r.state in LIVE_STATES]


class Tenants:
    """Keys to tenants; a key NATS refuses is Unauthenticated (401), NATS away is Unavailable (503)."""

    def __init__(self, nats_url: str) -> None:
        self.nats_url = nats_url
        self._by_digest: dict[str, Tenant] = {}
        self._refused: dict[str, float] = {}  # digest -> when NATS refused it (no reconnect storm per request)
        self._lock = asyncio.Lock()

    async def get(self, key: str | None) -> Tenant:
        if not key:
            raise Unauthenticated("missing API key: send it in the X-API-Key header (see `dsec api-key create`)")
        try:
            user, password = parse_key(key)
        except BadKey as exc:
            raise Unauthenticated(str(exc)) from None
        digest = key_digest(key)
        t = self._by_digest.get(digest)
        if t is not None and not t.nc.is_closed:
            return t
        if time.monotonic() - self._refused.get(digest, -1e9) < 2.0:
            raise Unauthenticated("invalid API key")
        async with self._lock:
            t = self._by_digest.get(digest)
            if t is not None and not t.nc.is_closed:
                return t
            url = url_with_user(self.nats_url, user, password)
            try:
                nc = await _nc_checked(url)
            except Unauthenticated:
                self._refused[digest] = time.monotonic()
                if len(self._refused) > 10_000:
                    self._refused.clear()
                raise
            t = self._by_digest[digest] = Tenant(user=user, url=url, nc=nc)
            return t


async def _nc_checked(url: str) -> NATS:
    """The key's connection, registered as the SDK's shared one for its URL (creates reuse it).
    One attempt: a refused key is an answer, not a reason to retry. Messages never carry the URL
    (it holds the key's password)."""
    try:
        nc = await connect(url, name="dsec-gateway", connect_attempts=1, connect_timeout_s=5.0)
    except Unavailable as exc:
        if "authorization" in str(exc).lower():
            raise Unauthenticated("invalid API key") from None
        raise Unavailable("the dsec control plane (NATS) is not reachable from the gateway") from None
    _conns[(id(asyncio.get_running_loop()), url)] = nc
    return nc


__all__ = ["LIVE_STATES", "Tenant", "Tenants", "Unauthenticated", "url_with_user"]
