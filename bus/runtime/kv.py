"""Typed KV buckets: values are msgspec Structs; one compare-and-set claim; one rule for bad records.

The rule for a record that is missing or cannot be decoded (written by a bug, a newer version, or
by hand):

* reading (``get``/``entry``): missing -> ``None``; undecodable -> ``None`` too, logged
  (``kv_corrupt_record``) and counted in ``KV.corrupt`` - a reader never crashes on one bad key;
* claiming (``claim``): an undecodable record is treated as absent and replaced, by a
  compare-and-set on its revision, so two claimers still cannot both win; also logged and counted.

Writes go through the connection's ``Publisher`` (pipelined acked writes to ``$KV.<bucket>.<key>``:
no request, timer or random inbox per write), except the tombstone path of a create, which is
nats-py's own.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import random
import uuid
from typing import Any, Callable, Generic, TypeVar

from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

from .. import log as _log
from ..codec import Decoder, encode
from ..errors import BadRequest
from ..streams import ensure_kv
from .publisher import ATOMIC_BATCH_MAX, ERR_WRONG_LAST_SEQUENCE, Publisher, StoreError, nc_of, publisher_for

T = TypeVar("T")

logger = _log.get_logger("dsec.bus.kv")

HDR_EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
CLAIM_ROUNDS = 4  # a claim re-reads at most this often while others keep writing the same key
WATCH_POLL_S = 1.0  # a watch looks at its stop flag this often while nothing changes
WATCH_BACKOFF_S = (0.5, 5.0)  # a broken watch is re-made after this (doubling, jittered, capped)


def _mine_of(mine: Callable[[T, T], bool], value: T, current: T) -> bool:
    return mine(current, value)


class Claim(enum.IntEnum):
    """Outcome of ``KV.claim``: falsy when another owner holds the key."""

    LOST = 0
    WON = 1  # our value is stored (the key was absent, deleted, or held an undecodable record)
    MINE = 2  # the key already holds a record ``mine`` accepted (left unchanged)


class Versioned(Generic[T]):
    __slots__ = ("value", "revision")

    def __init__(self, value: T, revision: int) -> None:
        self.value = value
        self.revision = revision


async def kv_keys(js: JetStreamContext, bucket: str) -> list[str]:
    """Keys of a KV bucket, from its stream's per-subject state: one request and exact (a deleted key
    whose delete marker is still kept is listed too; ``get`` then says missing). nats-py's
    ``kv.keys()`` is built on a watcher that can signal "no more keys" before a key already delivered
    to it is processed, and then reports an empty bucket (nats-io/nats.py#842)."""
    try:
        info = await js.stream_info(f"KV_{bucket}", subjects_filter=">")
    except NotFoundError:
        return []
    prefix = f"$KV.{bucket}."
    return sorted(s[len(prefix):] for s in (info.state.subjects or {}) if s.startswith(prefix))


async def kv_erase(js: JetStreamContext, bucket: str, key: str) -> None:
    """Remove every message of ``key`` (no delete or purge marker is left): for short-lived
    entries (dsec_gc's pins and tombstones) whose markers would otherwise pile up in ``kv_keys``
    until the bucket's TTL. A reader sees no entry, as after a purge."""
    try:
        await js.purge_stream(f"KV_{bucket}", subject=f"$KV.{bucket}.{key}")
    except NotFoundError:
        pass


class Watch(Generic[T]):
    """A running watch of a bucket: ``on_put(key, value, revision)`` for every decodable value (an
    undecodable one is logged and counted, as reads are), ``on_delete(key)`` for deletes and purges.
    ``synced`` is set once what the bucket held at the start was delivered. A watch that breaks
    (a reconnect, a server restart) is made again and replays the bucket, so handlers are idempotent."""

    def __init__(self, kv: "KV[T]", on_put: Callable[[str, T, int], None], on_delete: Callable[[str], None] | None) -> None:
        self.kv = kv
        self.on_put = on_put
        self.on_delete = on_delete
        self.synced = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> "Watch[T]":
        watcher = await self.kv.raw.watchall()  # made before start() returns: later writes are seen
        self._task = asyncio.create_task(self._run(watcher), name=f"kv-watch:{self.kv.bucket}")
        return self

    async def _run(self, watcher: Any) -> None:
        delay = WATCH_BACKOFF_S[0]
        while not self._stopping:
            try:
                entry = await watcher.updates(timeout=WATCH_POLL_S)
            except asyncio.TimeoutError:
                continue
            except asyncio.CancelledError:
                break
            except Exception as exc:  # noqa: BLE001 - connection lost or closing
                if self._stopping:
                    break
                logger.warning("kv_watch_broken", bucket=self.kv.bucket, error=str(exc))
                await _stop_watcher(watcher)
                await asyncio.sleep(delay * (0.5 + random.random()))  # retry back-off, jittered
                delay = min(delay * 2, WATCH_BACKOFF_S[1])
                try:
                    watcher = await self.kv.raw.watchall()
                except Exception as exc2:  # noqa: BLE001 - still away: try again after the back-off
                    logger.warning("kv_watch_restart_failed", bucket=self.kv.bucket, error=str(exc2))
                continue
            delay = WATCH_BACKOFF_S[0]
            if entry is None:
                self.synced.set()  # the initial snapshot is in
            elif entry.operation in ("DEL", "PURGE"):
                if self.on_delete is not None:
                    self.on_delete(entry.key)
            else:
                v = self.kv._decode(entry.key, entry.value or b"")
                if v is not None:
                    self.on_put(entry.key, v, entry.revision or 0)
        await _stop_watcher(watcher)

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - stopping anyway
                pass
            self._task = None


async def _stop_watcher(watcher: Any) -> None:
    try:
        await watcher.stop()
    except Exception:  # noqa: BLE001 - connection gone
        pass


class KV(Generic[T]):
    """One bucket holding values of one msgspec type."""

    def __init__(self, kv: KeyValue, bucket: str, type_: Any, *, js: JetStreamContext) -> None:
        self.raw = kv  # for watches
        self.js = js
        self.bucket = bucket
        self.decoder = type_ if isinstance(type_, Decoder) else Decoder(type_)
        self._publisher: Publisher | None = None  # the connection's, taken at the first write
        self.corrupt = 0  # undecodable records met (read or claimed)
        self._prefix = f"$KV.{self.bucket}."
        self.atomic: bool | None = None  # does the bucket take atomic batches (None: not asked yet)

    @classmethod
    async def open(cls, js: JetStreamContext, bucket: str, type_: Any, **ensure: Any) -> "KV[Any]":
        """The bucket (created with its dsec settings when missing), typed by ``type_``."""
        return cls(await ensure_kv(js, bucket, **ensure), bucket, type_, js=js)

    @classmethod
    async def bind(cls, js: JetStreamContext, bucket: str, type_: Any) -> "KV[Any]":
        """An existing bucket (never created: a client may only read it); raises when missing."""
        return cls(await js.key_value(bucket), bucket, type_, js=js)

    @classmethod
    def direct(cls, js: JetStreamContext, bucket: str, type_: Any) -> "KV[Any]":
        """A bucket read by direct gets only, without asking for its stream's info: what a client
        tenant may do on its own keys of a bucket whose other keys are other tenants' (the server
        checks a direct get's subject; a stream info would list every key)."""
        kv = KeyValue(name=bucket, stream=f"KV_{bucket}", pre=f"$KV.{bucket}.", js=js, direct=True)
        return cls(kv, bucket, type_, js=js)

    async def _pub(self) -> Publisher:
        if self._publisher is None or self._publisher.nc.is_closed:
            self._publisher = await publisher_for(nc_of(self.js))
        return self._publisher

    def subject(self, key: str) -> str:
        return self._prefix + key

    def _decode(self, key: str, data: bytes) -> T | None:
        try:
            value: T = self.decoder.decode(data)
            return value
        except BadRequest as exc:
            self.corrupt += 1
            logger.warning("kv_corrupt_record", bucket=self.bucket, key=key, error=str(exc))
            return None

    # --- reads ----------------------------------------------------------------------------
    async def entry(self, key: str) -> Versioned[T] | None:
        """The value with its revision; ``None`` when missing or undecodable (see the module rule)."""
        try:
            e = await self.raw.get(key)
        except KeyNotFoundError:
            return None
        v = self._decode(key, e.value or b"")
        return None if v is None else Versioned(v, e.revision or 0)

    async def get(self, key: str) -> T | None:
        e = await self.entry(key)
        return None if e is None else e.value

    async def exists(self, key: str) -> bool:
        """True when the key holds a value (decodable or not)."""
        try:
            await self.raw.get(key)
            return True
        except KeyNotFoundError:
            return False

    async def keys(self) -> list[str]:
        return await kv_keys(self.js, self.bucket)

    async def values_under(self, prefix: str, idle_s: float = 2.0) -> dict[str, T]:
        """Every decodable value whose key starts with ``prefix.``, by key: read through an ephemeral
        consumer whose filter (``$KV.<bucket>.<prefix>.>``) is in its create subject, delivering to
        the connection's own inbox: what a client tenant may list of its own keys (``keys`` asks for
        the stream's subjects, every tenant's)."""
        nc = nc_of(self.js)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        sub = await nc.subscribe(nc.new_inbox(), cb=queue.put)
        cfg = ConsumerConfig(
            name=f"keys-{uuid.uuid4().hex[:16]}", filter_subject=f"{self._prefix}{prefix}.>", deliver_subject=sub.subject,
            deliver_policy=DeliverPolicy.LAST_PER_SUBJECT, ack_policy=AckPolicy.NONE, inactive_threshold=30.0,
        )
        out: dict[str, T] = {}
        try:
            try:
                info = await self.js.add_consumer(f"KV_{self.bucket}", cfg)
            except NotFoundError:
                return out
            pending = info.num_pending or 0
            while pending > 0:
                try:
                    msg = await asyncio.wait_for(queue.get(), idle_s)
                except asyncio.TimeoutError:
                    break
                key = msg.subject[len(self._prefix):]
                if msg.data and (msg.headers or {}).get("KV-Operation") not in ("DEL", "PURGE"):
                    v = self._decode(key, msg.data)
                    if v is not None:
                        out[key] = v
                else:
                    out.pop(key, None)
                pending = msg.metadata.num_pending
        finally:
            await sub.unsubscribe()
        return out

    async def watch(self, on_put: Callable[[str, T, int], None], on_delete: Callable[[str], None] | None = None) -> Watch[T]:
        """Start a ``Watch`` of the whole bucket (see there)."""
        return await Watch(self, on_put, on_delete).start()

    # --- writes ---------------------------------------------------------------------------
    async def put_async(self, key: str, value: T) -> "asyncio.Future[Any]":
        """A pipelined write; the future holds its PubAck (``seq`` is the new revision)."""
        return await (await self._pub()).publish(self.subject(key), encode(value))

    async def put(self, key: str, value: T) -> int:
        """Store ``value``; returns the new revision."""
        return (await (await self._pub()).store(self.subject(key), encode(value))).seq

    async def update(self, key: str, value: T, *, last: int) -> bool:
        """Store ``value`` only if the key's revision is still ``last``; False when someone wrote first."""
        return await self.swap(key, value, last=last) is not None

    async def swap(self, key: str, value: T, *, last: int) -> int | None:
        """``update`` that returns the new revision (a writer caching what it wrote need not read it
        back); None when someone wrote first."""
        try:
            return (await (await self._pub()).store(self.subject(key), encode(value), {HDR_EXPECTED_LAST_SUBJECT_SEQ: str(last)})).seq
        except StoreError as exc:
            if exc.err_code == ERR_WRONG_LAST_SEQUENCE:
                return None
            raise

    async def create(self, key: str, value: T) -> bool:
        """Store ``value`` only if the key holds none (absent or deleted); False when it does."""
        if await self.update(key, value, last=0):
            return True
        try:  # a deleted key keeps a tombstone: nats-py's create re-checks it and updates on its revision
            await self.raw.create(key, encode(value))
            return True
        except KeyWrongLastSequenceError:
            return False

    async def claim_many(self, items: list[tuple[str, T]], *, mine: Callable[[T, T], bool] | None = None) -> list[Claim | BaseException]:
        """``claim`` of every ``(key, value)``, the first writes pipelined (one round trip for all, not
        one each): a key that holds nothing is ``WON`` by its create alone; one that does (a record,
        a tombstone, an unreadable value) goes through ``claim``, ``mine(current, value)`` saying
        whether what is there is ours. Per item, its outcome or the exception that writing it raised
        (StoreError, TimeoutError): the others still count."""
        pub = await self._pub()
        hdr = {HDR_EXPECTED_LAST_SUBJECT_SEQ: "0"}
        futs = [await pub.publish(self.subject(k), encode(v), hdr) for k, v in items]
        out: list[Claim | BaseException] = []
        for (key, value), fut in zip(items, futs, strict=True):
            try:
                await fut
                out.append(Claim.WON)
            except StoreError as exc:
                if exc.err_code != ERR_WRONG_LAST_SEQUENCE:
                    out.append(exc)
                    continue
                try:
                    out.append(await self.claim(key, value, mine=None if mine is None else functools.partial(_mine_of, mine, value)))
                except (StoreError, asyncio.TimeoutError) as again:
                    out.append(again)
            except asyncio.TimeoutError as exc:
                out.append(exc)
        return out

    async def claim_atomic(self, items: list[tuple[str, T]], *, mine: Callable[[T, T], bool] | None = None) -> list[Claim | BaseException]:
        """``claim_many`` written as atomic batches (a bucket made with ``allow_atomic``): each batch
        of keys that all hold nothing is stored at once, one answer for up to ``ATOMIC_BATCH_MAX``
        creates (one replicated write instead of one each). A batch the bucket refuses (a key holds a
        record already, the bucket has no atomic batches, too many in flight) stored nothing: its
        keys go through ``claim_many``."""
        if len(items) < 2 or not await self._takes_atomic():
            return await self.claim_many(items, mine=mine)
        pub = await self._pub()
        hdr = {HDR_EXPECTED_LAST_SUBJECT_SEQ: "0"}
        chunks = [items[i:i + ATOMIC_BATCH_MAX] for i in range(0, len(items), ATOMIC_BATCH_MAX)]
        futs = [await pub.publish_atomic([(self.subject(k), encode(v), hdr) for k, v in c]) for c in chunks]
        out: list[Claim | BaseException] = []
        for chunk, fut in zip(chunks, futs, strict=True):
            try:
                await fut
                out += [Claim.WON] * len(chunk)
            except (StoreError, asyncio.TimeoutError) as exc:
                logger.debug("atomic_claims_refused", bucket=self.bucket, keys=len(chunk), error=repr(exc))
                out += await self.claim_many(chunk, mine=mine)
        return out

    async def _takes_atomic(self) -> bool:
        """Whether the bucket's stream allows atomic batches (bus.streams: replicated buckets only),
        asked once; a bucket that does not answer is written key by key."""
        if self.atomic is None:
            try:
                si = await self.js.stream_info(f"KV_{self.bucket}")
                self.atomic = bool(si.config.allow_atomic)
            except Exception as exc:  # noqa: BLE001 - not allowed to ask, or no answer: key by key is always right
                logger.debug("atomic_unknown", bucket=self.bucket, error=repr(exc))
                self.atomic = False
        return self.atomic

    async def delete(self, key: str) -> None:
        await self.raw.delete(key)

    # --- the claim -----------------------------------------------------------------------------
    async def claim(self, key: str, value: T, *, mine: Callable[[T], bool] | None = None) -> Claim:
        """Make this caller the key's owner, compare-and-set; at most one of any number of racing
        claimers gets ``WON``. ``mine(current)`` says whether a record already there is ours (an
        earlier delivery of the same work): then ``MINE`` and the record is left as it is. Raises
        (StoreError, TimeoutError) when the bucket does not answer: the work stays un-acked."""
        if await self.create(key, value):
            return Claim.WON
        for _ in range(CLAIM_ROUNDS):
            try:
                e = await self.raw.get(key)
            except KeyNotFoundError:  # deleted meanwhile
                if await self.create(key, value):
                    return Claim.WON
                continue
            cur = self._decode(key, e.value or b"")
            if cur is not None:
                return Claim.MINE if mine is not None and mine(cur) else Claim.LOST
            # Undecodable: treated as absent, replaced on its revision (a racing claimer makes this fail).
            if await self.update(key, value, last=e.revision or 0):
                return Claim.WON
        return Claim.LOST


__all__ = ["Claim", "KV", "Versioned", "Watch", "kv_erase", "kv_keys"]
