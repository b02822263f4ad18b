"""Garbage collection of the blob store (layer records and chunks nothing references) and of a host's
data dir (local blobs, build and pack leftovers, dumps of failed CRIU runs), safe against packs and
builds that reuse a chunk while a collection runs.

The race: a pack finds chunk C in the store and does not upload it; a collection that found C
unreferenced deletes it a moment later; the new snapshot's record then names a chunk that is gone.
The protocol, over KV bucket ``dsec_gc`` (entries expire after ``PIN_TTL_S``):

* a writer that may reuse keys first **pins** them (``pin.<layer hex>.<id>``: the keys, written
  before it looks at the store), then waits while any of them is **tombstoned**, then checks and
  uploads; the pin goes (``release``) once a record references the layer (the snapshot record: the
  host agent releases it; a template's manifest: the builder), else it lapses after PIN_TTL_S;
* a collection **tombstones** a batch of candidates (``tomb.<key>``: its deadline), reads the pins
  *after* that, deletes only the unpinned candidates and only before the deadline, then clears
  the tombstones.

Either the pin was written before the collection read the pins (the key is kept), or the writer
pinned after the tombstone was written, so it sees the tombstone and waits for it to clear (or its
deadline to pass: a collection never deletes after it), and its existence check comes after the
deletion: it uploads the chunk again. Layer records go before chunks, so a layer record that exists
once its tombstone is clear still has its chunks. A crash mid-collection leaves tombstones that lapse
at their deadline and deletes nothing that is referenced (the reference sets are read first; a
collection started later recomputes them).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import msgspec
from nats.js.api import KeyValueConfig
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError

from bus import subjects as S
from bus.runtime import kv_erase, kv_keys

from ._store import BlobStore
from ._util import digest_hex

GC_BUCKET = S.KV_GC
PIN_TTL_S = 3600.0  # longer than any pack or build, plus the write of its record
TOMB_MAX_S = 10.0  # a collection deletes a batch within this long of tombstoning it, or not at all
BATCH = 256
CONCURRENCY = 32  # store deletes and KV writes of one batch in flight at once
DELETE_MARGIN_S = 2.0  # no delete starts later than this before its batch's deadline
PIN_KEYS_PER_ENTRY = 4000  # one KV value stays well under the NATS max payload
LOCAL_GRACE_S = 3600.0  # a data-dir leftover this old belongs to no pack, build or dump still running

_keys_enc = msgspec.msgpack.Encoder()
_keys_dec = msgspec.msgpack.Decoder(list[str])


async def _kv(js: Any) -> Any:
    try:
        return await js.key_value(GC_BUCKET)
    except (BucketNotFoundError, NotFoundError):
        return await js.create_key_value(config=KeyValueConfig(
            bucket=GC_BUCKET, history=1, ttl=PIN_TTL_S, description="dsec gc: pins of keys being reused, tombstones of keys being deleted",
        ))


def _tomb(key: str) -> str:
    return "tomb." + key.replace("/", ".")


def _untomb(kvkey: str) -> str:
    kind, _, rest = kvkey[5:].partition(".")
    return f"{kind}/{rest}"


async def _entries(js: Any, prefix: str) -> list[tuple[str, bytes]]:
    kv = await _kv(js)

    async def one(k: str) -> tuple[str, bytes] | None:
        try:
            e = await kv.get(k)
        except KeyNotFoundError:
            return None
        return (k, bytes(e.value)) if e.value else None

    sem = asyncio.Semaphore(CONCURRENCY)

    async def bounded(k: str) -> tuple[str, bytes] | None:
        async with sem:
            return await one(k)

    got = await asyncio.gather(*(bounded(k) for k in await kv_keys(js, GC_BUCKET) if k.startswith(prefix)))
    return [g for g in got if g is not None]


async def _erase(js: Any, kvkey: str) -> None:
    """A pin or tombstone gone without a marker: markers of thousands of them would make every
    listing (each batch's pin check, every waiting writer's poll) slower until they lapse."""
    await kv_erase(js, GC_BUCKET, kvkey)


# --- writers ---------------------------------------------------------------------------------------
async def pin(js: Any, owner: str, keys: Iterable[str]) -> None:
    """Keep ``keys`` (store keys: ``chunks/<hex>``, ``layers/<hex>``) from any collection until
    ``release(owner)`` (``owner``: the layer's digest), or PIN_TTL_S."""
    kv = await _kv(js)
    ks = sorted(set(keys))
    base = f"pin.{digest_hex(owner)}.{uuid.uuid4().hex}"
    for i in range(0, len(ks), PIN_KEYS_PER_ENTRY):
        await kv.put(f"{base}.{i // PIN_KEYS_PER_ENTRY}", _keys_enc.encode(ks[i : i + PIN_KEYS_PER_ENTRY]))


async def release(js: Any, owner: str) -> None:
    """Drop the pins of layer ``owner``: a record references it now."""
    await _kv(js)
    prefix = f"pin.{digest_hex(owner)}."
    for k in await kv_keys(js, GC_BUCKET):
        if k.startswith(prefix):
            await _erase(js, k)


async def pinned(js: Any) -> set[str]:
    out: set[str] = set()
    for _, v in await _entries(js, "pin."):
        try:
            out.update(_keys_dec.decode(v))
        except msgspec.DecodeError:
            continue
    return out


async def tombstoned(js: Any) -> dict[str, float]:
    """Keys a collection may be deleting now -> its deadline (past deadlines included)."""
    out: dict[str, float] = {}
    for k, v in await _entries(js, "tomb."):
        try:
            out[_untomb(k)] = float(v.decode())
        except ValueError:
            continue
    return out


async def guard_reuse(js: Any, owner: str, keys: Iterable[str], poll_s: float = 0.05) -> None:
    """Pin ``keys`` for layer ``owner``, then wait until none is being deleted: existence checks made
    after this hold."""
    ks = set(keys)
    await pin(js, owner, ks)
    while True:
        now = time.time()
        busy = [d for k, d in (await tombstoned(js)).items() if k in ks and d > now]
        if not busy:
            return
        await asyncio.sleep(min(poll_s, max(0.0, max(busy) - now)))  # poll interval until the collection's deadline


# --- collection ------------------------------------------------------------------------------------
async def _bounded(fn: Callable[[str], Awaitable[str | None]], keys: list[str], n: int = CONCURRENCY) -> list[str]:
    """``fn`` over ``keys``, ``n`` at a time (each a NATS round trip or two); the keys it returned."""
    sem = asyncio.Semaphore(n)

    async def one(k: str) -> str | None:
        async with sem:
            return await fn(k)

    return [k for k in await asyncio.gather(*(one(k) for k in keys)) if k is not None]


async def sweep(js: Any, store: BlobStore, candidates: Iterable[str], *, on_tombstoned: Callable[[list[str]], Awaitable[None]] | None = None) -> list[str]:
    """Delete the candidate store keys no writer pinned (layer records first); returns those deleted.
    ``on_tombstoned`` runs between the tombstones and the pin check (tests force races with it)."""
    kv = await _kv(js)
    ordered = sorted(set(candidates), key=lambda k: (not k.startswith("layers/"), k))
    deleted: list[str] = []
    for i in range(0, len(ordered), BATCH):
        deadline = time.time() + TOMB_MAX_S

        async def tomb(k: str, deadline: float = deadline) -> str | None:
            try:
                await kv.create(_tomb(k), str(deadline).encode())
                return k
            except KeyWrongLastSequenceError:
                return None  # another collection has it

        async def drop(k: str, deadline: float = deadline) -> str | None:
            # a delete starts early enough to end before the deadline, when a waiting writer goes on
            if time.time() >= deadline - DELETE_MARGIN_S:
                return None  # left to the next run
            await store.delete(k)
            return k

        async def untomb(k: str) -> str | None:
            try:
                await _erase(js, _tomb(k))
            except Exception:  # noqa: BLE001 - NATS away: the tombstone lapses at its deadline
                pass
            return None

        mine = await _bounded(tomb, ordered[i : i + BATCH])  # every tombstone is written before the pins are read
        try:
            if on_tombstoned is not None:
                await on_tombstoned(mine)
            keep = await pinned(js)
            todo = [k for k in mine if k not in keep]
            layers = [k for k in todo if k.startswith("layers/")]
            deleted += await _bounded(drop, layers)  # layer records before any chunk
            deleted += await _bounded(drop, [k for k in todo if not k.startswith("layers/")])
        finally:
            await _bounded(untomb, mine)
    return deleted


async def clear_stale_tombstones(js: Any) -> int:
    now, n = time.time(), 0
    for k, d in (await tombstoned(js)).items():
        if d < now:
            await _erase(js, _tomb(k))
            n += 1
    return n


async def collect(
    js: Any, store: BlobStore, *, data_dir: str | os.PathLike[str] | None = None, local_grace_s: float = LOCAL_GRACE_S, blob_grace_s: float | None = None,
) -> dict[str, int]:
    """One full collection: the layer records and chunks no template, snapshot or pinned writer
    references, then (with ``data_dir``) that host's local leftovers."""
    from ._snapshots import referenced

    t0 = time.monotonic()
    keep_layers, keep_chunks = await referenced(js)
    pins = await pinned(js)
    out = {"layers": 0, "chunks": 0, "bytes": 0, "local_files": 0, "local_bytes": 0, "tombstones": await clear_stale_tombstones(js)}
    layer_keys = await store.keys("layers/")
    gone = set(await sweep(js, store, [k for k in layer_keys if k.split("/", 1)[1] not in keep_layers and k not in pins]))
    out["layers"] = len(gone)
    # A layer record left in the store (a pinned writer's) keeps its chunks.
    for k in layer_keys:
        if k not in gone and k.split("/", 1)[1] not in keep_layers:
            ref = await store.get_layer(k.split("/", 1)[1])
            if ref is not None:
                keep_chunks.update(digest_hex(c) for c in ref.chunks)
    chunk_keys = [k for k in await store.keys("chunks/") if k.split("/", 1)[1] not in keep_chunks and k not in pins]
    out["chunks"] = len(await sweep(js, store, chunk_keys))
    if data_dir is not None:
        files, nbytes = await asyncio.to_thread(collect_local, data_dir, keep_layers | {k.split("/", 1)[1] for k in pins if k.startswith("layers/")},
                                                local_grace_s, blob_grace_s)
        out["local_files"], out["local_bytes"] = files, nbytes
    out["ms"] = int((time.monotonic() - t0) * 1000)
    return out


def _touched_since(p: Path, cutoff: float) -> bool:
    """Anything at or under ``p`` modified after ``cutoff`` (gone counts as touched: leave it)."""
    try:
        if p.lstat().st_mtime > cutoff:
            return True
    except FileNotFoundError:
        return True
    if p.is_dir() and not p.is_symlink():
        for dp, dns, fns in os.walk(p):
            for name in (*dns, *fns):
                try:
                    if os.lstat(os.path.join(dp, name)).st_mtime > cutoff:
                        return True
                except FileNotFoundError:
                    continue
    return False


def _size(p: Path) -> int:
    if p.is_dir() and not p.is_symlink():
        return sum(_size(c) for c in p.iterdir())
    try:
        return p.lstat().st_blocks * 512
    except FileNotFoundError:
        return 0


def collect_local(
    data_dir: str | os.PathLike[str], keep_layers: set[str], grace_s: float = LOCAL_GRACE_S, blob_grace_s: float | None = None,
) -> tuple[int, int]:
    """A host's data-dir leftovers older than ``grace_s``: local blobs of layers nothing references
    (``blob_grace_s``, default the same), build/pack work dirs (``images/tmp``) and CRIU dump dirs
    (``criu``) of runs that died. Returns (entries removed, bytes freed)."""
    d = Path(data_dir)
    now = time.time()
    n = freed = 0

    def drop(p: Path, grace: float = grace_s) -> None:
        nonlocal n, freed
        if _touched_since(p, now - grace):  # a long build or dump still writes deep inside its dir
            return
        freed += _size(p)
        n += 1
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)

    blobs = d / "images" / "blobs"
    if blobs.is_dir():
        for p in blobs.iterdir():
            hexd = p.name.split(".", 1)[0]
            if len(hexd) == 64 and hexd not in keep_layers:
                drop(p, grace_s if blob_grace_s is None else blob_grace_s)
    for sub in (d / "images" / "tmp", d / "criu"):
        if sub.is_dir():
            for p in sub.iterdir():
                drop(p)
    return n, freed


__all__ = ["GC_BUCKET", "clear_stale_tombstones", "collect", "collect_local", "guard_reuse", "pin", "pinned", "release", "sweep", "tombstoned"]
