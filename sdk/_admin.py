"""Operator queries: cluster status and audit replay."""

from __future__ import annotations

import asyncio
import datetime as dt
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import KeyNotFoundError, NotFoundError

from bus import codec
from bus import subjects as S
from bus.errors import BadRequest, InvalidArgument, Unavailable
from bus.runtime import KV, connect, kv_keys, nats_url, reads_records, tenant_of

STALE_S = 10.0


async def cluster_status(url: str | None = None, *, timeout: float = 5.0) -> dict[str, Any]:
    nc = await connect(url, name="dsec-status", connect_attempts=2, connect_timeout_s=timeout)
    try:
        js = nc.jetstream(timeout=timeout)
        hosts = []
        templates: list[str] = []
        n_sbx = 0
        try:
            kv = await KV.bind(js, S.KV_HOSTS, codec.HOST_STATUS)
            for k in await kv.keys():
                st = await kv.get(k)
                if st is None:
                    continue  # gone since the listing, or not a heartbeat: not a host to report
                age = time.time() - st.at
                d = msgspec.to_builtins(st)  # nested structs too (its backends): the document is plain JSON
                d.pop("type", None)
                d["age_s"] = round(age, 2)
                if st.state == "ready" and age > STALE_S:
                    d["state"] = "stale"
                hosts.append(d)
            kvi = await js.key_value(S.KV_IMAGES)
            names = await kv_keys(js, S.KV_IMAGES)
            # A removed template's key keeps its delete marker in the stream: only live entries count.
            got = await asyncio.gather(*(kvi.get(n) for n in names), return_exceptions=True)
            for g in got:
                if isinstance(g, BaseException) and not isinstance(g, KeyNotFoundError):
                    raise g
            templates = [n for n, g in zip(names, got, strict=True) if not isinstance(g, KeyNotFoundError)]
            n_sbx = sum(h["sandboxes"] for h in hosts if h["state"] == "ready")
        except NotFoundError:
            pass
        return {
            "nats_url": nats_url(url),
            "hosts": hosts,
            "ready_hosts": sum(1 for h in hosts if h["state"] == "ready"),
            "templates": templates,
            "sandboxes": n_sbx,
            "storage": await _storage(nc, hosts) if reads_records(nc) else None,
        }
    finally:
        await nc.close()


async def _storage(nc: Any, hosts: list[dict[str, Any]]) -> dict[str, Any]:
    """What the snapshots hold per tenant against the limits the ready hosts enforce (the smallest
    where they differ; 0: none), and the hosts' free disk: the operator's view (it reads the records)."""
    from ._snapshots import list_records
    from .snapcli import usage

    use = usage(await list_records(nc))
    limits: dict[str, int] = {}
    for h in hosts:
        for name, v in (h.get("storage_limits") or {}).items() if h["state"] == "ready" else ():
            have = limits.get(name)
            limits[name] = v if have is None or (v and (not have or v < have)) else have  # 0: none, the loosest
    per_tenant = limits.get("snapshot_bytes_per_tenant", 0)
    return {
        "snapshot_bytes": use["bytes"], "snapshots": use["snapshots"], "limits": limits,
        "tenants": {t: {"used_bytes": b, "limit_bytes": per_tenant} for t, b in sorted(use["tenants"].items())},
        "disk_free_mb": {h["host_id"]: h.get("disk_free_mb", 0) for h in hosts},
        # file uploads held in sandboxes, per host and tenant (the limit is per tenant on each host)
        "uploads": {h["host_id"]: dict(sorted((h.get("upload_bytes") or {}).items())) for h in hosts if h.get("upload_bytes")},
    }


_AGE = re.compile(r"^(\d+(?:\.\d+)?)([smhd])\Z")


def parse_since(since: str | None) -> dt.datetime | None:
    if not since:
        return None
    m = _AGE.match(since.strip())
    if m:
        secs = float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
        return dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=secs)
    try:
        return dt.datetime.fromtimestamp(float(since), dt.timezone.utc)
    except ValueError:
        pass
    try:
        t = dt.datetime.fromisoformat(since.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidArgument(f"--since {since!r}: use ISO time, unix seconds, or an age like 10m, 2h, 1d") from None
    return t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)


async def replay_events(
    url: str | None = None, *, since: str | None = None, sandbox_id: str | None = None, kinds: list[str] | None = None, idle_timeout: float = 2.0
) -> AsyncIterator[dict[str, Any]]:
    """Yield every event kept in DSEC_EVT (oldest first) from ``since``, until caught up.

    The operator sees every event; a client tenant only its own sandboxes' (the server refuses it
    any other filter). With ``sandbox_id``: that sandbox's lifecycle events and, for the operator,
    the guard violations about it (those live on one subject for all sandboxes, so they are
    filtered here by their ``sandbox_id``)."""
    start = parse_since(since)
    if sandbox_id is not None and not S.valid_token(sandbox_id):
        raise InvalidArgument(f"not a sandbox id: {sandbox_id!r}")
    nc = await connect(url, name="dsec-audit", connect_attempts=2, connect_timeout_s=5)
    try:
        operator = reads_records(nc)
        own = "*" if operator else tenant_of(nc)
        subject = S.evt_sandbox_all(sandbox_id, own) if sandbox_id else (S.EVT_ALL if operator else S.evt_tenant(own))
        js = nc.jetstream()
        if operator:
            try:
                info = await js.stream_info(S.STREAM_EVT)
            except NotFoundError:
                raise Unavailable("no event stream: has `dsec up` ever run against this NATS?") from None
            if info.state.messages == 0:
                return
        if start:
            # the server reads RFC 3339 text, which nats-py passes on as given (it annotates a datetime)
            cfg = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=start.isoformat())  # type: ignore[arg-type]  # see above
        else:
            cfg = ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        if operator:
            if sandbox_id:
                cfg.filter_subjects = [subject, S.EVT_GUARD_VIOLATION]
            sub = await js.subscribe(subject, stream=S.STREAM_EVT, ordered_consumer=True, config=cfg, cb=queue.put)
        else:
            sub = await _tenant_consumer(nc, subject, cfg, queue)
            if sub is None:
                return
        try:
            while True:
                try:
                    msg = await asyncio.wait_for(queue.get(), idle_timeout)
                except asyncio.TimeoutError:
                    return
                try:
                    ev = codec.EVENT.decode(msg.data)
                except BadRequest:
                    continue
                d = msgspec.structs.asdict(ev)
                d["type"] = type(ev).__name__
                d["seq"] = msg.metadata.sequence.stream
                d["subject"] = msg.subject
                if (not kinds or d.get("kind") in kinds) and (not sandbox_id or d.get("sandbox_id") == sandbox_id):
                    yield d
                if msg.metadata.num_pending == 0:
                    return
        finally:
            await sub.unsubscribe()
    finally:
        await nc.close()


async def _tenant_consumer(nc: Any, subject: str, cfg: ConsumerConfig, queue: "asyncio.Queue[Any]", stream: str = S.STREAM_EVT) -> Any:
    """A tenant's own ephemeral push consumer on its events (or trajectory logs: ``stream``): named,
    with the filter in the create subject (the only create its credential may make), delivering to
    its own inbox; None when the stream does not exist."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=queue.put)
    cfg.name = f"{'audit' if stream == S.STREAM_EVT else 'read'}-{uuid.uuid4().hex[:16]}"
    cfg.filter_subject = subject
    cfg.deliver_subject = inbox
    cfg.ack_policy = AckPolicy.NONE
    cfg.inactive_threshold = 30.0
    try:
        await nc.jetstream().add_consumer(stream, cfg)
    except NotFoundError:
        await sub.unsubscribe()
        return None
    return sub
