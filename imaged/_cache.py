"""The host-side chunk cache behind the lazy loader (asyncio; the FUSE front end calls into it).

On disk, under ``D/cache/``:

* ``chunks/<hex>``       one file per chunk (content-addressed: shared by every layer that has it);
* ``layers/<hex>.json``  the metadata of each layer this host has looked up (size, chunk list);
* ``index.json``         ``{"sha256:<hex>": {"total_bytes", "fetched_bytes", "chunks", "cached_chunks",
                         "complete", "last_access"}}`` for every known layer, rewritten atomically
                         (debounced) whenever it changes - the host agent reads it for its heartbeat;
* ``daemon.json``        the running daemon: pid, mount point, mode, start time, global counters.

Chunks are verified against their sha256 when fetched, and once more on first use after a restart
(a chunk file damaged on disk is dropped and fetched again). The cache is bounded: least recently
used chunks that no read is using are evicted when the total passes ``max_bytes``.

The blob store away (``BlobStoreUnavailable``, or an attempt that timed out) is not a bad chunk: a
fetch waits for the store to come back for up to ``store_wait_s`` seconds (trying again every
``store_probe_s`` at most), or with ``store_wait_s`` = 0 fails at once -- and while the store is known
to be away, later fetches fail without trying it, but for one probe every ``store_probe_s``. Either
way a failed read is EIO, and ``daemon.json`` says why (``store_available``, ``store_error``,
``store_unavailable_since``), written before the read is answered: the host agent reads it to give
the create that needed the chunk its typed error (``blob_store_unavailable``). Cached chunks are
served throughout.
"""

from __future__ import annotations

import asyncio
import collections
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nats.js import JetStreamContext

from bus import log as _log
from bus.errors import BlobStoreUnavailable

from ._manifests import find_layer, publish_event
from ._messages import HostImageStats, LayerCacheStats
from ._store import BlobStore, chunk_key
from ._util import atomic_write_json, digest_hex, is_hex_digest, read_json, sha256_bytes, sha256_file

logger = _log.get_logger("dsec.imaged.cache")


STORE_PROBE_S = 2.0  # while the store is away: how often a fetch tries it again


class FetchFailed(Exception):
    """A chunk could not be fetched (after bounded retries): the read fails with EIO."""


class CorruptChunk(Exception):
    """A fetched chunk did not match its digest or length."""


@dataclass
class LayerMeta:
    hex: str
    size: int
    chunk_size: int
    chunks: list[str]  # hex digests, one per chunk position
    templates: list[str] = field(default_factory=list)
    last_access: float = 0.0

    @property
    def digest(self) -> str:
        return f"sha256:{self.hex}"

    def chunk_len(self, idx: int) -> int:
        return min(self.chunk_size, self.size - idx * self.chunk_size)

    def to_json(self) -> dict[str, Any]:
        return {"digest": self.digest, "size": self.size, "chunk_size": self.chunk_size, "chunks": self.chunks, "templates": self.templates}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "LayerMeta":
        return cls(
            hex=digest_hex(d["digest"]),
            size=int(d["size"]),
            chunk_size=int(d["chunk_size"]),
            chunks=[digest_hex(c) for c in d["chunks"]],
            templates=list(d.get("templates") or []),
        )


@dataclass
class Counters:
    downloaded_bytes: int = 0
    cache_written_bytes: int = 0
    evicted_bytes: int = 0
    fetch_failures: int = 0
    corrupt_chunks: int = 0
    fetches: int = 0
    reads: int = 0
    fetch_seconds: float = 0.0  # summed wall time of store gets
    read_seconds: float = 0.0  # summed wall time of reads (FUSE side latency, including fetches)


class ChunkCache:
    def __init__(
        self,
        root: str | os.PathLike[str],
        store: BlobStore,
        *,
        js: JetStreamContext | None = None,
        host_id: str = "host",
        max_bytes: int = 10 * 1024**3,
        mode: str = "lazy",
        attempts: int = 4,
        attempt_timeout_s: float = 10.0,
        total_timeout_s: float = 30.0,
        backoff_s: float = 0.2,
        fetch_concurrency: int = 8,
        fault_delay_s: float = 0.0,
        store_wait_s: float = 30.0,
        store_probe_s: float = STORE_PROBE_S,
    ) -> None:
        self.root = Path(root)
        self.chunks_dir = self.root / "chunks"
        self.layers_dir = self.root / "layers"
        self.index_path = self.root / "index.json"
        self.daemon_path = self.root / "daemon.json"
        self.store = store
        self.js = js
        self.host_id = host_id
        self.max_bytes = max_bytes
        self.mode = mode
        self.attempts = max(1, attempts)
        self.attempt_timeout_s = attempt_timeout_s
        self.total_timeout_s = total_timeout_s
        self.backoff_s = backoff_s
        self.fault_delay_s = fault_delay_s
        self.store_wait_s = max(0.0, store_wait_s)  # 0: a fetch the store cannot serve fails at once
        self.store_probe_s = max(0.1, store_probe_s)  # the store away: how often it is tried again
        self.store_down_at: float | None = None  # monotonic time of the last failure while away
        self.store_down_since: float | None = None  # wall time the store went away (None: available)
        self.store_error = ""
        self._fetch_sem = asyncio.Semaphore(max(1, fetch_concurrency))
        self.lru: collections.OrderedDict[str, int] = collections.OrderedDict()  # chunk hex -> size
        self.cache_bytes = 0
        self.verified: set[str] = set()
        self.pins: collections.Counter[str] = collections.Counter()
        self.inflight: dict[str, asyncio.Future[None]] = {}
        self.layers: dict[str, LayerMeta] = {}
        self._lookups: dict[str, asyncio.Future[LayerMeta | None]] = {}
        self._negative: dict[str, float] = {}
        self.counters = Counters()
        self.started_at = time.time()
        self._dirty = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        self.extra_daemon_info: dict[str, Any] = {}
        self.extra_tasks: list[asyncio.Task[Any]] = []  # background work of the daemon (its local gc), cancelled at close
        trace = os.environ.get("DSEC_IMAGED_TRACE_READS")
        self.trace = open(trace, "a", buffering=1) if trace else None  # noqa: SIM115 - open for the cache's life; debugging: one line per FUSE read

    # --- start / stop ---------------------------------------------------------------------------
    def load(self) -> None:
        """Adopt what a previous daemon left on disk (chunks in mtime order = LRU order, layer metadata)."""
        for d in (self.chunks_dir, self.layers_dir):
            d.mkdir(parents=True, exist_ok=True)
        found: list[tuple[float, str, int]] = []
        for e in os.scandir(self.chunks_dir):
            if e.name.startswith("."):
                try:
                    os.unlink(e.path)  # a temp file of a write cut short
                except OSError:
                    pass
                continue
            if not is_hex_digest(e.name):
                continue
            st = e.stat()
            found.append((st.st_mtime, e.name, st.st_size))
        for _, name, size in sorted(found):
            self.lru[name] = size
            self.cache_bytes += size
        for e in os.scandir(self.layers_dir):
            if e.name.endswith(".json") and is_hex_digest(e.name[:-5]):
                rec = read_json(e.path)
                try:
                    meta = LayerMeta.from_json(rec)
                except (KeyError, TypeError, ValueError):
                    continue
                self.layers[meta.hex] = meta
        self._evict()
        self.write_index()
        self.write_daemon_info()

    def start_writer(self) -> None:
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(self._index_writer())

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.cancel()
            try:
                await self._writer
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
            self._writer = None
        self.write_index()
        self.write_daemon_info()

    async def _index_writer(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                self.write_index()
                self.write_daemon_info()
            except OSError as exc:
                logger.warning("index_write_failed", error=str(exc))
            await asyncio.sleep(0.2)  # debounce: at most five index writes a second

    def mark_dirty(self) -> None:
        self._dirty.set()

    # --- layers ---------------------------------------------------------------------------------
    async def layer(self, hexd: str) -> LayerMeta | None:
        """The layer's metadata: known, on disk, or looked up (layer record, then KV manifests)."""
        meta = self.layers.get(hexd)
        if meta is not None:
            return meta
        neg = self._negative.get(hexd)
        if neg is not None and time.monotonic() - neg < 2.0:
            return None
        fut = self._lookups.get(hexd)
        if fut is not None:
            return await asyncio.shield(fut)
        fut = asyncio.get_running_loop().create_future()
        self._lookups[hexd] = fut
        try:
            ref, users = await self._find_layer(hexd)
            if ref is None or not ref.chunks or ref.chunk_size <= 0:
                self._negative[hexd] = time.monotonic()
                fut.set_result(None)
                return None
            meta = LayerMeta(
                hex=hexd,
                size=ref.size,
                chunk_size=ref.chunk_size,
                chunks=[digest_hex(c) for c in ref.chunks],
                templates=users,
            )
            atomic_write_json(self.layers_dir / f"{hexd}.json", meta.to_json())
            self.layers[hexd] = meta
            self.mark_dirty()
            fut.set_result(meta)
            return meta
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved: concurrent waiters re-raise it
            raise
        finally:
            self._lookups.pop(hexd, None)

    # --- reads ----------------------------------------------------------------------------------
    async def read(self, hexd: str, off: int, size: int) -> bytes:
        meta = self.layers.get(hexd) or await self.layer(hexd)
        if meta is None:
            raise FileNotFoundError(hexd)
        self.counters.reads += 1
        t_read = time.monotonic()
        if self.trace is not None:
            self.trace.write(f"{hexd[:12]} {off} {size}\n")
        end = min(off + size, meta.size)
        if off >= end or size <= 0:
            return b""
        cs = meta.chunk_size
        first, last = off // cs, (end - 1) // cs
        needed = [meta.chunks[i] for i in range(first, last + 1)]
        for c in needed:
            self.pins[c] += 1
        try:
            if len(needed) == 1:
                await self._ensure(meta, first)
            else:
                await asyncio.gather(*(self._ensure(meta, i) for i in range(first, last + 1)))
            parts = []
            for i in range(first, last + 1):
                start = max(off, i * cs) - i * cs
                stop = min(end, (i + 1) * cs) - i * cs
                fd = os.open(self.chunks_dir / meta.chunks[i], os.O_RDONLY)
                try:
                    parts.append(os.pread(fd, stop - start, start))
                    # EROFS caches what it reads from us: a copy of the chunk in this file's page
                    # cache would be a second one of the same bytes on the host.
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the whole chunk: readahead too
                finally:
                    os.close(fd)
            meta.last_access = time.time()
            return parts[0] if len(parts) == 1 else b"".join(parts)
        finally:
            self.counters.read_seconds += time.monotonic() - t_read
            for c in needed:
                self.pins[c] -= 1
                if self.pins[c] <= 0:
                    del self.pins[c]

    async def prefetch(self, hexd: str) -> None:
        """Fetch every chunk of the layer (prefetch mode, or to warm a host)."""
        meta = self.layers.get(hexd) or await self.layer(hexd)
        if meta is None:
            raise FileNotFoundError(hexd)
        todo = sorted({c: i for i, c in reversed(list(enumerate(meta.chunks)))}.items(), key=lambda kv: kv[1])
        await asyncio.gather(*(self._ensure(meta, i) for _, i in todo))

    async def _ensure(self, meta: LayerMeta, idx: int) -> None:
        c = meta.chunks[idx]
        if c in self.lru:
            if c in self.verified:
                self.lru.move_to_end(c)
                return
            ok = await asyncio.to_thread(self._verify_file, c, meta.chunk_len(idx))
            if ok:
                self.verified.add(c)
                if c in self.lru:
                    self.lru.move_to_end(c)
                    return
            else:
                self.counters.corrupt_chunks += 1
                self._drop(c)
                logger.warning("cached_chunk_corrupt", chunk=c, layer=meta.hex)
                await publish_event(
                    self.js, meta.hex, "chunk_corrupt", layer=meta.digest, chunk=f"sha256:{c}", where="cache", host_id=self.host_id
                )
        fut = self.inflight.get(c)
        if fut is not None:
            await asyncio.shield(fut)
            return
        fut = asyncio.get_running_loop().create_future()
        self.inflight[c] = fut
        try:
            await self._fetch(meta, idx)
            fut.set_result(None)
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()
            raise
        finally:
            self.inflight.pop(c, None)

    def _verify_file(self, c: str, expected_len: int) -> bool:
        p = self.chunks_dir / c
        try:
            return p.stat().st_size == expected_len and sha256_file(p) == c
        except OSError:
            return False

    async def _find_layer(self, hexd: str) -> tuple[Any, list[str]]:
        """The layer's record, waiting for a store that is away as a chunk fetch does (a layer in no
        manifest -- a snapshot's -- is known to the store only)."""
        wait_until = time.monotonic() + self.store_wait_s
        while True:
            try:
                return await asyncio.wait_for(find_layer(self.js, self.store, hexd), self.attempt_timeout_s)
            except (BlobStoreUnavailable, asyncio.TimeoutError) as exc:
                self._store_away(exc)
                if time.monotonic() + self.store_probe_s >= wait_until:
                    raise
            await asyncio.sleep(self.store_probe_s)  # waiting for the store, as configured

    # --- the store's availability -----------------------------------------------------------------
    def _store_away(self, exc: BaseException) -> None:
        """Record that the store could not be reached; daemon.json says so before any read fails."""
        self.store_down_at = time.monotonic()
        self.store_error = f"{type(exc).__name__}: {exc}"[:500]
        if self.store_down_since is None:
            self.store_down_since = time.time()
            logger.error("blob_store_unavailable", store=self.store.url, error=self.store_error, wait_s=self.store_wait_s)
            self._write_daemon_info_now()

    def _store_back(self) -> None:
        if self.store_down_since is not None:
            logger.info("blob_store_available", store=self.store.url, away_s=round(time.time() - self.store_down_since, 3))
            self.store_down_since = self.store_down_at = None
            self.store_error = ""
            self._write_daemon_info_now()

    def _write_daemon_info_now(self) -> None:
        try:
            self.write_daemon_info()
        except OSError as exc:
            logger.warning("daemon_info_write_failed", error=str(exc))

    def _known_away(self) -> bool:
        """Fail-at-once mode, the store away and probed less than ``store_probe_s`` ago: do not try it."""
        return self.store_wait_s <= 0 and self.store_down_at is not None and time.monotonic() - self.store_down_at < self.store_probe_s

    async def _fetch(self, meta: LayerMeta, idx: int) -> None:
        c = meta.chunks[idx]
        want = meta.chunk_len(idx)
        deadline = time.monotonic() + self.total_timeout_s  # bad chunks and other failures
        wait_until: float | None = None  # the store away: how long this fetch waits for it
        attempt = 0
        last: BaseException | None = None
        while True:
            attempt += 1
            remaining = max(deadline, wait_until or 0.0) - time.monotonic()
            away = False
            try:
                if remaining <= 0:
                    raise asyncio.TimeoutError("fetch deadline passed")
                if self._known_away():
                    raise BlobStoreUnavailable(f"the blob store is away ({self.store_error}); not waiting for it (store_wait_s=0)")
                async with self._fetch_sem:
                    if self.fault_delay_s:
                        await asyncio.sleep(self.fault_delay_s)  # test knob: a slow store
                    t0 = time.monotonic()
                    try:
                        data = await asyncio.wait_for(self.store.get(chunk_key(c)), min(self.attempt_timeout_s, remaining))
                    except (BlobStoreUnavailable, asyncio.TimeoutError) as exc:
                        away = True
                        self._store_away(exc)
                        raise
                    self.counters.fetch_seconds += time.monotonic() - t0
                self._store_back()
                self.counters.fetches += 1
                self.counters.downloaded_bytes += len(data)
                if len(data) != want or sha256_bytes(data) != c:
                    self.counters.corrupt_chunks += 1
                    logger.warning("fetched_chunk_corrupt", chunk=c, layer=meta.hex, attempt=attempt, size=len(data))
                    await publish_event(
                        self.js, meta.hex, "chunk_corrupt", layer=meta.digest, chunk=f"sha256:{c}", where="store",
                        attempt=str(attempt), host_id=self.host_id,
                    )
                    raise CorruptChunk(f"chunk {c} does not match its digest")
                await asyncio.to_thread(self._write_chunk_file, c, data)
                self._adopt_chunk(c, len(data))
                return
            except asyncio.CancelledError:
                raise
            except BlobStoreUnavailable as exc:
                last, away = exc, True
            except Exception as exc:  # noqa: BLE001 - every failure is retried within the bounds
                last = exc
            delay = self.backoff_s * (2 ** (attempt - 1))
            if away:
                if self.store_wait_s <= 0:
                    break
                if wait_until is None:
                    wait_until = time.monotonic() + self.store_wait_s
                delay = min(delay, self.store_probe_s)  # notice the store's return soon
                if time.monotonic() + delay >= wait_until:
                    break
                await asyncio.sleep(delay)  # waiting for the store, as configured
                continue
            if attempt >= self.attempts or time.monotonic() + delay >= deadline:
                break
            await asyncio.sleep(delay)  # retry back-off
        self.counters.fetch_failures += 1
        self.mark_dirty()
        logger.error("chunk_fetch_failed", chunk=c, layer=meta.hex, attempts=attempt, error=str(last))
        await publish_event(
            self.js,
            meta.hex,
            "fetch_failed",
            layer=meta.digest,
            chunk=f"sha256:{c}",
            attempts=str(attempt),
            error=f"{type(last).__name__}: {last}",
            host_id=self.host_id,
            templates=",".join(meta.templates),
            code="blob_store_unavailable" if away else "fetch_failed",
        )
        raise FetchFailed(f"chunk {c} of layer {meta.hex}: {last}")

    def _write_chunk_file(self, c: str, data: bytes) -> None:
        p = self.chunks_dir / c
        tmp = self.chunks_dir / f".{c}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            # Written back now, and out of the page cache: EROFS keeps the pages of what is read
            # through us; these would be a second copy (a dirty page cannot be dropped).
            os.fdatasync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        os.replace(tmp, p)

    def _adopt_chunk(self, c: str, size: int) -> None:
        self.counters.cache_written_bytes += size
        old = self.lru.pop(c, None)
        if old is not None:
            self.cache_bytes -= old
        self.lru[c] = size
        self.cache_bytes += size
        self.verified.add(c)
        self._evict()
        self.mark_dirty()

    def _drop(self, c: str) -> None:
        size = self.lru.pop(c, None)
        if size is not None:
            self.cache_bytes -= size
        self.verified.discard(c)
        try:
            os.unlink(self.chunks_dir / c)
        except FileNotFoundError:
            pass
        self.mark_dirty()

    def _evict(self) -> None:
        if self.cache_bytes <= self.max_bytes:
            return
        for c in list(self.lru):
            if self.cache_bytes <= self.max_bytes:
                break
            if self.pins.get(c) or c in self.inflight:
                continue
            size = self.lru[c]
            self._drop(c)
            self.counters.evicted_bytes += size

    # --- stats ----------------------------------------------------------------------------------
    def layer_stats(self, meta: LayerMeta) -> dict[str, Any]:
        fetched = 0
        cached = 0
        for i, c in enumerate(meta.chunks):
            if c in self.lru:
                fetched += meta.chunk_len(i)
                cached += 1
        return {
            "total_bytes": meta.size,
            "fetched_bytes": fetched,
            "chunks": len(meta.chunks),
            "cached_chunks": cached,
            "complete": cached == len(meta.chunks),
            "last_access": round(meta.last_access, 3),
        }

    def index(self) -> dict[str, dict[str, Any]]:
        return {meta.digest: self.layer_stats(meta) for meta in self.layers.values()}

    def write_index(self) -> None:
        atomic_write_json(self.index_path, self.index())

    def daemon_info(self) -> dict[str, Any]:
        c = self.counters
        return {
            "pid": os.getpid(),
            "host_id": self.host_id,
            "mode": self.mode,
            "started_at": self.started_at,
            "cache_bytes": self.cache_bytes,
            "max_cache_bytes": self.max_bytes,
            "downloaded_bytes": c.downloaded_bytes,
            "cache_written_bytes": c.cache_written_bytes,
            "evicted_bytes": c.evicted_bytes,
            "fetch_failures": c.fetch_failures,
            "corrupt_chunks": c.corrupt_chunks,
            "store": self.store.url,
            "store_available": self.store_down_since is None,
            "store_unavailable_since": self.store_down_since,
            "store_error": self.store_error,
            "store_wait_s": self.store_wait_s,
            "fetches": c.fetches,
            "reads": c.reads,
            "fetch_seconds": round(c.fetch_seconds, 3),
            "read_seconds": round(c.read_seconds, 3),
            **self.extra_daemon_info,
        }

    def write_daemon_info(self) -> None:
        atomic_write_json(self.daemon_path, self.daemon_info())

    def host_stats(self, digests: list[str] | None = None) -> HostImageStats:
        want = {digest_hex(d) for d in digests} if digests else None
        layers = []
        for meta in self.layers.values():
            if want is not None and meta.hex not in want:
                continue
            s = self.layer_stats(meta)
            layers.append(
                LayerCacheStats(
                    digest=meta.digest,
                    total_bytes=s["total_bytes"],
                    fetched_bytes=s["fetched_bytes"],
                    chunks=s["chunks"],
                    cached_chunks=s["cached_chunks"],
                )
            )
        c = self.counters
        return HostImageStats(
            host_id=self.host_id,
            at=time.time(),
            mode=self.mode,
            pid=os.getpid(),
            layers=layers,
            cache_bytes=self.cache_bytes,
            max_cache_bytes=self.max_bytes,
            downloaded_bytes=c.downloaded_bytes,
            cache_written_bytes=c.cache_written_bytes,
            evicted_bytes=c.evicted_bytes,
            fetch_failures=c.fetch_failures,
            corrupt_chunks=c.corrupt_chunks,
        )
