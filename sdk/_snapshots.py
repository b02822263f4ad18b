"""Snapshots, fork, pause and resume for ``AsyncSandbox`` (the host does the work; this is the client side)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import nats.errors
from nats.js.errors import KeyNotFoundError

from bus import codec
from bus import subjects as S
from bus.codec import decode_reply
from bus.errors import BadRequest, InvalidArgument, PermissionDenied, SandboxNotFound, SandboxTimeout, UnknownSnapshot, Unavailable
from bus.messages import MAX_FORK_COUNT, Done, PauseRequest, RemoveSnapshot, ResumeRequest, SnapshotRecord, SnapshotRequest
from bus.runtime import KV, kv_keys, reads_records, tenant_of
from bus.streams import ensure_kv

if TYPE_CHECKING:
    from ._async import AsyncSandbox

SNAPSHOT_TIMEOUT_S = 600.0  # a GiB of changes is packed and uploaded before the reply


@dataclass
class SnapshotInfo:
    snapshot_id: str
    parent_id: str
    sandbox_id: str
    template: str
    created_at: float
    bytes_added: int
    memory: bool
    name: str = ""
    host_id: str = ""
    layers: int = 0  # snapshot layers a restore stacks over the template
    metadata: dict[str, str] = field(default_factory=dict)


def info_of(rec: SnapshotRecord) -> SnapshotInfo:
    return SnapshotInfo(
        snapshot_id=rec.snapshot_id, parent_id=rec.parent_id, sandbox_id=rec.sandbox_id, template=rec.template, created_at=rec.created_at,
        bytes_added=rec.bytes_added, memory=rec.memory, name=rec.name, host_id=rec.host_id, layers=len(rec.layers), metadata=dict(rec.metadata),
    )


def _check_meta(metadata: Any) -> dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise InvalidArgument(f"metadata must be a dict of str to str, got {metadata!r}")
    return dict(metadata)


async def get_record(nc: Any, snapshot_id: str) -> SnapshotRecord:
    if not isinstance(snapshot_id, str) or not S.valid_token(snapshot_id):
        raise UnknownSnapshot(f"not a snapshot id: {snapshot_id!r}", snapshot_id=str(snapshot_id))
    kv = await ensure_kv(_snapshot_reader(nc).jetstream(), S.KV_SNAPSHOTS)
    try:
        entry = await kv.get(snapshot_id)
    except KeyNotFoundError:
        raise UnknownSnapshot(f"unknown snapshot {snapshot_id!r}", snapshot_id=snapshot_id) from None
    if not entry.value:
        raise UnknownSnapshot(f"unknown snapshot {snapshot_id!r} (removed)", snapshot_id=snapshot_id)
    rec: SnapshotRecord = codec.SNAPSHOT.decode(entry.value)
    return rec


async def list_records(nc: Any) -> list[SnapshotRecord]:
    js = _snapshot_reader(nc).jetstream()
    kv = await ensure_kv(js, S.KV_SNAPSHOTS)
    out = []
    for key in await kv_keys(js, S.KV_SNAPSHOTS):
        try:
            entry = await kv.get(key)
            if entry.value:
                out.append(codec.SNAPSHOT.decode(entry.value))
        except (KeyNotFoundError, BadRequest):
            continue
    return sorted(out, key=lambda r: r.created_at)


async def remove(nc: Any, snapshot_id: str, timeout: float = 60.0) -> str:
    try:
        msg = await nc.request(S.snap_remove(tenant_of(nc)), codec.encode(RemoveSnapshot(snapshot_id=snapshot_id)), timeout=timeout)
    except nats.errors.NoRespondersError:
        raise Unavailable("the image service does not answer (is `dsec up` running?)") from None
    except nats.errors.TimeoutError:
        raise SandboxTimeout(f"removing snapshot {snapshot_id} took over {timeout:g}s") from None
    return decode_reply(msg.data, Done).detail


async def create_snapshot(sb: "AsyncSandbox", name: str | None, memory: bool, metadata: dict[str, str] | None, *,
                          fork_ids: list[str] | None = None, timeout: float = SNAPSHOT_TIMEOUT_S) -> SnapshotInfo:
    if name is not None and not isinstance(name, str):
        raise InvalidArgument(f"name must be a string, got {name!r}")
    req = SnapshotRequest(snapshot_id=f"snap-{uuid.uuid4().hex[:20]}", name=name or "", memory=bool(memory), metadata=_check_meta(metadata),
                          fork_ids=list(fork_ids or []))
    return info_of(await sb._request("snapshot", req, SnapshotRecord, timeout=timeout))


def _check_fork_count(count: Any) -> None:
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_FORK_COUNT:
        raise InvalidArgument(f"fork count must be an integer between 1 and {MAX_FORK_COUNT}, got {count!r}")


async def fork(sb: "AsyncSandbox", count: int, kwargs: dict[str, Any]) -> list["AsyncSandbox"]:
    _check_fork_count(count)
    metadata = _check_meta(kwargs.pop("snapshot_metadata", None))
    memory = bool(kwargs.pop("memory", False))
    ids = kwargs.pop("sandbox_ids", None) or [f"sb-{uuid.uuid4().hex[:20]}" for _ in range(count)]
    spec = sb.spec
    try:  # a running or frozen-paused source: its host snapshots it (a paused one stays paused)
        info = await create_snapshot(sb, None, memory, {**metadata, "fork": str(count)}, fork_ids=ids)
        template, snapshot_id = info.template, info.snapshot_id
    except SandboxNotFound:
        # A persisted pause runs nowhere: its snapshot is the state to fork, and it stays paused.
        rec = await sandbox_record(sb.nc, sb.sandbox_id)
        if rec is None or rec.state != "paused" or not rec.snapshot_id:
            raise
        if memory:
            raise InvalidArgument(f"sandbox {sb.sandbox_id} is paused on disk: its forks start from the files it was paused with") from None
        template, snapshot_id, spec = rec.spec.template, rec.snapshot_id, spec or rec.spec
    if spec is not None:  # the forks take the source's shape unless told otherwise
        for key, value in (("cpu", spec.cpu), ("memory_mb", spec.memory_mb), ("disk_mb", spec.disk_mb), ("pool", spec.pool), ("profile", spec.profile)):
            kwargs.setdefault(key, value)
        if spec.network is not None:  # and its egress allowlist: a child is not cut off (nor widened) by being a child
            kwargs.setdefault("network", {"allow_out": list(spec.network.allow_out)})
    return await type(sb).create_batch(count, template, snapshot=snapshot_id, sandbox_ids=ids, **kwargs)


async def pause(sb: "AsyncSandbox", persist: bool, memory: bool = False) -> SnapshotInfo | None:
    if memory and not persist:
        raise InvalidArgument("memory=True goes with persist=True (a frozen pause keeps the processes as they are)")
    req = PauseRequest(persist=bool(persist), memory=bool(memory), snapshot_id=f"snap-{uuid.uuid4().hex[:20]}" if persist else "")
    res = await sb._request("pause", req,
                            SnapshotRecord | Done, timeout=SNAPSHOT_TIMEOUT_S)
    return info_of(res) if isinstance(res, SnapshotRecord) else None


async def resume(sb: "AsyncSandbox", *, create_timeout: float = 120.0) -> None:
    """Thaw a frozen sandbox on its host, or start a persisted one again from its snapshot (any host)."""
    try:
        await sb._request("resume", ResumeRequest(), Done)
        return
    except SandboxNotFound:
        pass
    rec = await sandbox_record(sb.nc, sb.sandbox_id)
    if rec is None or rec.state != "paused" or not rec.snapshot_id:
        raise SandboxNotFound(f"sandbox {sb.sandbox_id} is not running (killed, timed out, or never created) and not paused")
    now = time.time()
    spec = msgspec.structs.replace(
        rec.spec, snapshot=rec.snapshot_id, generation=rec.spec.generation + 1, requested_at=now, create_deadline=now + create_timeout, reply_to="",
    )
    again = await type(sb)._create_many([spec], None, create_timeout, None, batch=False, nc=sb.nc)
    sb.host_id = again[0].host_id
    sb.spec = spec


def _snapshot_reader(nc: Any) -> Any:
    reader = records_conn(nc)
    if reader is None:
        raise PermissionDenied("snapshot records hold their sandboxes' envs: reading them takes the operator's credential (or the gateway)")
    return reader


# A client tenant may not read sandbox records (their specs hold every tenant's envs): a service
# that acts for tenants (the gateway) lends its own connection for the reads (records_via).
_record_readers: dict[int, tuple[Any, Any]] = {}


def records_via(nc: Any, reader: Any) -> None:
    """Read sandbox records for ``nc``'s sandboxes over ``reader`` (a service's connection)."""
    _record_readers[id(nc)] = (nc, reader)


def records_conn(nc: Any) -> Any | None:
    """The connection that reads ``nc``'s sandbox records; None when nothing may (a client tenant)."""
    entry = _record_readers.get(id(nc))
    if entry is not None and entry[0] is nc:
        return entry[1]
    return nc if reads_records(nc) else None


async def sandbox_record(nc: Any, sandbox_id: str) -> Any:
    reader = records_conn(nc)
    if reader is None:
        return None
    return await (await KV.open(reader.jetstream(), S.KV_SANDBOXES, codec.SANDBOX_RECORD)).get(sandbox_id)


def restore_spec_template(rec: SnapshotRecord, template: str | None) -> str:
    if template not in (None, "", rec.template):
        raise InvalidArgument(f"snapshot {rec.snapshot_id} is of template {rec.template!r}, not {template!r}")
    return rec.template


__all__ = ["SnapshotInfo"]
