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
from bus.messages import ReadyMany
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
    any other filter). With ``sandbox_id``: that sandbox's lifecycle events, the batch ready events
    that name it (a host announces a batch's members in one event, ``ReadyMany``: shown as that
    sandbox's ``ready``) and, for the operator, the guard violations about it (those live on one
    subject for all sandboxes, so they are filtered here by their ``sandbox_id``)."""
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
        # Batch ready events live on their own subjects (the operator's whole-stream replay has them):
        # read first, merged in by stream sequence. Few: one per host batch.
        batches: list[dict[str, Any]] = []
        if sandbox_id or not operator:
            scope, from_ = (own, start) if not (operator and sandbox_id) else await _batch_scope(js, sandbox_id or "", start)
            async for msg, ev in _events_on(nc, S.evt_ready_tenant(scope), from_, operator=operator, idle_timeout=idle_timeout):
                if isinstance(ev, ReadyMany) and (not sandbox_id or sandbox_id in ev.sandbox_ids):
                    batches.append(_event_dict(msg, ev, sandbox_id))
        filters = [subject, S.EVT_GUARD_VIOLATION] if operator and sandbox_id else [subject]
        async for msg, ev in _events_on(nc, filters, start, operator=operator, idle_timeout=idle_timeout):
            d = _event_dict(msg, ev, sandbox_id)
            while batches and batches[0]["seq"] < d["seq"]:
                b = batches.pop(0)
                if not kinds or b.get("kind") in kinds:
                    yield b
            if (not kinds or d.get("kind") in kinds) and (not sandbox_id or d.get("sandbox_id") == sandbox_id):
                yield d
        for b in batches:
            if not kinds or b.get("kind") in kinds:
                yield b
    finally:
        await nc.close()


# A client's clock may run ahead of the servers': a sandbox's batch event is looked for from this long
# before its request's time.
CLOCK_SLACK_S = 300.0


async def _batch_scope(js: Any, sandbox_id: str, start: dt.datetime | None) -> tuple[str, dt.datetime | None]:
    """Where the operator's replay of one sandbox looks for the batch ready events naming it: its
    tenant's, from its request on when its record says it never ran before (generation 0; a resumed
    or restored one's earlier generations were announced before that); else every tenant's from ``start``."""
    try:
        rec = await (await KV.bind(js, S.KV_SANDBOXES, codec.SANDBOX_RECORD)).get(sandbox_id)
    except Exception:  # noqa: BLE001 - no records: look everywhere
        rec = None
    if rec is None:
        return "*", start
    tenant = S.tenant(rec.spec.client) if S.valid_token(rec.spec.client or S.OPERATOR_TENANT) else "*"
    if rec.spec.generation or not rec.created_at:
        return tenant, start
    asked = dt.datetime.fromtimestamp(max(0.0, rec.created_at - CLOCK_SLACK_S), dt.timezone.utc)
    return tenant, max(start, asked) if start else asked


def _event_dict(msg: Any, ev: Any, sandbox_id: str | None) -> dict[str, Any]:
    """An event as replay shows it; a batch ready event as ``ready`` (for one member, when replaying one sandbox)."""
    d = msgspec.structs.asdict(ev)
    d["type"] = type(ev).__name__
    d["seq"] = msg.metadata.sequence.stream
    d["subject"] = msg.subject
    if isinstance(ev, ReadyMany):
        d["kind"] = "ready"
        d["members"] = len(ev.sandbox_ids)
        if sandbox_id:
            d["sandbox_id"] = sandbox_id
            del d["sandbox_ids"]
    return d


async def _events_on(
    nc: Any, subjects: str | list[str], start: dt.datetime | None, *, operator: bool, idle_timeout: float = 2.0,
) -> AsyncIterator[tuple[Any, Any]]:
    """Every event stored on ``subjects`` from ``start`` (all: None), oldest first, until caught up:
    (message, decoded event); undecodable ones are skipped. The operator reads with an ordered
    consumer (several filters at once); a tenant through its own consumer, one filter."""
    if start:
        # the server reads RFC 3339 text, which nats-py passes on as given (it annotates a datetime)
        cfg = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=start.isoformat())  # type: ignore[arg-type]  # see above
    else:
        cfg = ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
    subs = [subjects] if isinstance(subjects, str) else subjects
    queue: asyncio.Queue[Any] = asyncio.Queue()
    if operator:
        if len(subs) > 1:
            cfg.filter_subjects = subs
        sub = await nc.jetstream().subscribe(subs[0], stream=S.STREAM_EVT, ordered_consumer=True, config=cfg, cb=queue.put)
    else:
        sub = await _tenant_consumer(nc, subs[0], cfg, queue)
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
                ev = None
            if ev is not None:
                yield msg, ev
            if msg.metadata.num_pending == 0:
                return
    finally:
        await sub.unsubscribe()


async def ready_in_batches(nc: Any, tenant: str, ids: set[str], since: float, *, operator: bool) -> dict[str, ReadyMany]:
    """The batch ready events naming any of ``ids``, stored from ``since`` (unix seconds) on, in the
    events of ``tenant``: each id's first. (A waiting create's slow path when its reply was lost and
    it may not read records: a client tenant.)"""
    out: dict[str, ReadyMany] = {}
    start = dt.datetime.fromtimestamp(max(0.0, since), dt.timezone.utc)
    async for _, ev in _events_on(nc, S.evt_ready_tenant(tenant), start, operator=operator, idle_timeout=1.0):
        if isinstance(ev, ReadyMany):
            for sid in ev.sandbox_ids:
                if sid in ids and sid not in out:
                    out[sid] = ev
    return out


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
