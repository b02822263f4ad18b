"""Idempotent set-up of every stream, KV bucket and object store dsec uses."""

from __future__ import annotations

import asyncio
import os
import random
from dataclasses import dataclass, field, replace

from nats.js import JetStreamContext
from nats.js.api import (
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
import nats.errors
from nats.js.errors import BucketNotFoundError, NotFoundError, ServiceUnavailableError
from nats.js.kv import KeyValue

from . import subjects as S

DAY = 86_400.0
REPLICAS_ENV = "DSEC_NATS_REPLICAS"  # how many copies of every stream and bucket: 1 on one node, 3 on a 3-node cluster


def default_replicas() -> int:
    """$DSEC_NATS_REPLICAS, else 1. Every process that sets the streams up must agree (each one's
    ``ensure_all`` updates them to its own figure), so `dsec up --cluster 3` sets it for all of them."""
    raw = os.environ.get(REPLICAS_ENV, "").strip()
    if not raw:
        return 1
    n = int(raw)
    if n not in (1, 3, 5):  # JetStream's Raft groups want an odd count; more than 5 buys nothing
        raise ValueError(f"{REPLICAS_ENV}={raw}: stream replicas are 1, 3 or 5")
    return n


@dataclass(frozen=True)
class StreamOptions:
    """Knobs that differ between the dev stack, tests and scale benchmarks."""

    storage: StorageType = StorageType.FILE
    events_max_age_s: float = 7 * DAY
    events_max_bytes: int = 4 * 1024**3
    dedup_window_s: float = 120.0
    replicas: int = field(default_factory=default_replicas)


def stream_configs(opts: StreamOptions | None = None) -> list[StreamConfig]:
    opts = opts or StreamOptions()  # made per call: its replicas follow the environment
    req, evt, dlq = _core_streams(opts)
    # The trajectory log is kept as the events are; rollout jobs are a work queue as the requests are.
    traj = replace(evt, name=S.STREAM_TRAJ, subjects=S.TRAJ_SUBJECTS)
    # (a tenant looks up its queued jobs by direct gets, whose subject the server checks: bus.auth)
    rollouts = replace(req, name=S.STREAM_ROLLOUTS, subjects=S.ROLLOUT_SUBJECTS, allow_direct=True)
    return [req, evt, dlq, traj, rollouts]


def _core_streams(opts: StreamOptions) -> list[StreamConfig]:
    return [
        StreamConfig(
            name=S.STREAM_REQ,
            subjects=S.REQ_SUBJECTS,
            retention=RetentionPolicy.WORK_QUEUE,
            storage=opts.storage,
            duplicate_window=opts.dedup_window_s,
            num_replicas=opts.replicas,
        ),
        StreamConfig(
            name=S.STREAM_EVT,
            subjects=S.EVT_SUBJECTS,
            retention=RetentionPolicy.LIMITS,
            storage=opts.storage,
            max_age=opts.events_max_age_s,
            max_bytes=opts.events_max_bytes,
            discard=DiscardPolicy.OLD,
            duplicate_window=opts.dedup_window_s,
            allow_direct=True,  # a tenant reads its own events by direct gets, whose subject the server checks (bus.auth)
            num_replicas=opts.replicas,
        ),
        StreamConfig(
            name=S.STREAM_DLQ,
            subjects=S.DLQ_SUBJECTS,
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=7 * DAY,
            num_replicas=opts.replicas,
        ),
    ]


KV_BUCKETS: dict[str, dict[str, int]] = {
    S.KV_HOSTS: {"history": 1},
    S.KV_SANDBOXES: {"history": 1, "atomic": 1},  # replicated: a host batch's records are claimed in atomic batches (KV.claim_atomic)
    S.KV_IMAGES: {"history": 5},
    S.KV_PROFILES: {"history": 10},
    S.KV_ROLLOUTS: {"history": 1, "direct": 1},  # a tenant reads its own jobs by direct gets (bus.auth)
    S.KV_LEASES: {"history": 1},
    S.KV_SNAPSHOTS: {"history": 1},
    S.KV_TENANTS: {"history": 1},
    S.KV_QUOTA: {"history": 1},
}


async def ensure_stream(js: JetStreamContext, cfg: StreamConfig) -> None:
    assert cfg.name, "a stream config names its stream"
    try:
        await js.stream_info(cfg.name)
    except NotFoundError:
        await js.add_stream(cfg)
        return
    await js.update_stream(cfg)


async def ensure_kv(js: JetStreamContext, bucket: str, *, storage: StorageType = StorageType.FILE, replicas: int | None = None) -> KeyValue:
    """The bucket, made if missing; ``replicas`` None: ``default_replicas()``."""
    replicas = default_replicas() if replicas is None else replicas
    opts = KV_BUCKETS.get(bucket, {"history": 1})
    direct = bool(opts.get("direct"))
    # Atomic batches spare a replicated write per record; on one node a stream that allows them costs
    # nats-server 3-4x the CPU per write of any kind (measured: 58 -> 270 us per single create), so
    # there a host batch's records are claimed one by one (pipelined), as before.
    atomic = bool(opts.get("atomic")) and replicas > 1
    try:
        kv = await js.key_value(bucket)
    except (BucketNotFoundError, NotFoundError):
        kv = await js.create_key_value(
            config=KeyValueConfig(bucket=bucket, history=opts["history"], storage=storage, replicas=replicas, direct=direct or None)
        )
        if not atomic:
            return kv
    if not direct and not atomic and replicas == 1:  # nothing to compare: spare the extra request on one node
        return kv
    si = await js.stream_info(f"KV_{bucket}")
    # a bucket made before it was read by direct gets or written in atomic batches (nats-py's bucket
    # config has no such setting), or on one node before the cluster grew
    if (direct and not si.config.allow_direct) or (atomic and not si.config.allow_atomic) or (si.config.num_replicas or 1) != replicas:
        await js.update_stream(replace(
            si.config, allow_direct=si.config.allow_direct or direct, allow_atomic=si.config.allow_atomic or atomic or None, num_replicas=replicas,
        ))
        kv = await js.key_value(bucket)
    return kv


# Setting up replicated streams while other services do the same (every service at `dsec up`), or while
# a node is lost, can time out on the JetStream API: each step is tried again, bounded and jittered.
ENSURE_ATTEMPTS = 6
ENSURE_RETRY_S = (0.2, 0.5)


async def ensure_all(js: JetStreamContext, opts: StreamOptions | None = None) -> None:
    """Create or update every stream and bucket; safe to call from every service at start."""
    opts = opts or StreamOptions()
    for attempt in range(1, ENSURE_ATTEMPTS + 1):
        try:
            await _ensure_all(js, opts)
            return
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError, ServiceUnavailableError):
            if attempt == ENSURE_ATTEMPTS:
                raise
        await asyncio.sleep(random.uniform(*ENSURE_RETRY_S) * attempt)  # back-off, jittered


async def _ensure_all(js: JetStreamContext, opts: StreamOptions) -> None:
    await _drop_host_stream(js)
    for cfg in stream_configs(opts):
        await ensure_stream(js, cfg)
    for bucket in KV_BUCKETS:
        await ensure_kv(js, bucket, storage=opts.storage, replicas=opts.replicas)


async def _drop_host_stream(js: JetStreamContext) -> None:
    """Earlier versions kept hosts' work in a DSEC_HOST stream; hand-offs are core messages now
    (bus.runtime.handoff) and a stream on their subjects would store every one: remove it once it is
    empty. Work still queued in it was handed to a host and is not dropped silently: start the old
    host agents until it drains."""
    try:
        info = await js.stream_info(S.STREAM_HOST)
    except NotFoundError:
        return
    if info.state.messages:
        raise RuntimeError(
            f"the {S.STREAM_HOST} stream of an earlier dsec still holds {info.state.messages} hand-off(s) to hosts; "
            "let its host agents finish them (or purge it on purpose) before starting this version"
        )
    await js.delete_stream(S.STREAM_HOST)

