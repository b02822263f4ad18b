"""The host-side lazy loader: a read-only FUSE file system that exposes every layer blob as a file.

    python -m imaged.lazy --data-dir D --mount M [--mode lazy|prefetch] [--cache-max-bytes N]

``M/<hex>`` is layer ``sha256:<hex>``: looking up an unknown name fetches only that layer's metadata
(the blob store's layer record, else the KV manifests); data chunks are fetched on first read,
verified against their sha256 and kept in ``D/cache/chunks`` (bounded, LRU). ``prefetch`` mode
fetches a whole layer when it is opened (the baseline the lazy mode is measured against).

It also packs a host agent's directory into a new layer on request (``dsec.imaged.<host>.pack``:
snapshots of sandboxes, see ``Packer``).

The host agent mounts a layer with ``mount -t erofs -o ro M/<hex> <data_dir>/layers/<hex>``.

Restarts lose nothing: the FUSE connection is kept open by a holder process (``imaged._fuse``), so a
daemon that crashes, is killed or upgraded leaves M and every EROFS mount on its files in place;
the next daemon takes the connection over, the kernel resends the reads the old one had not
answered, and the cache (chunks, layer metadata, index.json) carries on. On SIGTERM/SIGINT the
daemon unmounts M when nothing uses it, and otherwise keeps it for its successor.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import signal
import sys
import time
from typing import Any

from nats.js.errors import APIError

from bus import subjects as S
from bus.codec import PACK_REQ
from bus.errors import InvalidArgument, NoSpace
from bus.messages import PackedLayer
from bus.metrics import add_cli_flag as add_metrics_flag
from bus.runtime import Endpoint, Exposition, connect

from ._build import ImageBuilder

from ._cache import ChunkCache, FetchFailed
from ._cache_metrics import cache_registry
from ._gc import collect_local, pinned
from ._snapshots import referenced
from ._fuse import ROOT_INODE, Attr, FuseError, FuseMount, Session, lock_exclusive
from ._messages import HOST_STATS_REQUEST
from ._store import open_blob_store
from ._util import data_dir as _data_dir
from ._util import host_id as _host_id
from ._util import is_hex_digest

log = logging.getLogger("dsec.imaged.lazy")
LOCAL_GC_INTERVAL_S = 3600.0
JS_FULL = (10023, 10047)  # JetStream API errors: insufficient resources, insufficient storage


def layer_inode(hexd: str) -> int:
    """A layer's inode number, derived from its digest: a daemon that takes over a live connection
    must understand the node ids its predecessor handed to the kernel."""
    return int(hexd[:15], 16) + 2  # 60 bits, never the root (1)


class LazyFS:
    """Root directory of layer files; every file is read-only and immutable."""

    def __init__(self, cache: ChunkCache, mode: str = "lazy") -> None:
        self.cache = cache
        self.mode = mode
        self.by_ino: dict[int, str] = {}
        self._mounted_at = time.time_ns()

    def _hex_of(self, ino: int) -> str | None:
        hexd = self.by_ino.get(ino)
        if hexd is None:
            # a node id from before a takeover: the layer's metadata is in the cache already
            for h in self.cache.layers:
                if layer_inode(h) == ino:
                    self.by_ino[ino] = hexd = h
                    break
        return hexd

    def _attr(self, hexd: str, size: int) -> Attr:
        ino = layer_inode(hexd)
        self.by_ino[ino] = hexd
        return Attr(ino, size, mtime_ns=self._mounted_at)

    async def getattr(self, ino: int) -> Attr:
        if ino == ROOT_INODE:
            return Attr(ROOT_INODE, 0, is_dir=True, mtime_ns=self._mounted_at)
        hexd = self._hex_of(ino)
        meta = self.cache.layers.get(hexd) if hexd else None
        if meta is None:
            raise FuseError(errno.ENOENT)
        return self._attr(meta.hex, meta.size)

    async def lookup(self, parent: int, name: bytes) -> Attr:
        if parent != ROOT_INODE:
            raise FuseError(errno.ENOENT)
        n = name.decode("utf-8", "replace")
        if n in (".", ".."):
            return Attr(ROOT_INODE, 0, is_dir=True, mtime_ns=self._mounted_at)
        if n.startswith("sha256:"):
            n = n[7:]
        if not is_hex_digest(n):
            raise FuseError(errno.ENOENT)
        meta = self.cache.layers.get(n)
        if meta is None:
            try:
                meta = await self.cache.layer(n)
            except Exception as exc:  # noqa: BLE001 - NATS / store away: the lookup fails, not the daemon
                log.warning("lookup %s failed: %s", n, exc)
                raise FuseError(errno.EIO) from None
        if meta is None:
            raise FuseError(errno.ENOENT)
        return self._attr(n, meta.size)

    def readdir(self, ino: int) -> list[tuple[bytes, Attr]]:
        return [(h.encode(), self._attr(h, self.cache.layers[h].size)) for h in sorted(self.cache.layers)]

    async def open(self, ino: int, flags: int) -> int:
        if ino == ROOT_INODE:
            raise FuseError(errno.EISDIR)
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & (os.O_TRUNC | os.O_APPEND):
            raise FuseError(errno.EROFS)
        hexd = self._hex_of(ino)
        if hexd is None or hexd not in self.cache.layers:
            raise FuseError(errno.ENOENT)
        if self.mode == "prefetch":
            try:
                await self.cache.prefetch(hexd)
            except FetchFailed:
                raise FuseError(errno.EIO) from None
        return ino

    async def read(self, fh: int, offset: int, size: int) -> bytes:
        hexd = self._hex_of(fh)
        if hexd is None:
            raise FuseError(errno.EBADF)
        try:
            return await self.cache.read(hexd, offset, size)
        except FetchFailed:
            raise FuseError(errno.EIO) from None
        except FileNotFoundError:
            raise FuseError(errno.ENOENT) from None
        except Exception as exc:  # noqa: BLE001 - never crash the daemon on one read
            log.exception("read %s@%d+%d failed: %s", hexd, offset, size, exc)
            raise FuseError(errno.EIO) from None

    def statfs(self) -> tuple[int, int]:
        return sum(m.size for m in self.cache.layers.values()), len(self.cache.layers) + 1


# --- main ------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m imaged.lazy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", default=None, help="default: $DSEC_DATA_DIR or /var/lib/dsec (cache in D/cache)")
    ap.add_argument("--mount", default=None, help="mount point (default: D/lazy)")
    ap.add_argument("--mode", choices=["lazy", "prefetch"], default="lazy")
    ap.add_argument("--cache-max-bytes", type=int, default=int(os.environ.get("DSEC_IMAGE_CACHE_MAX_BYTES", 20 * 1024**3)))
    ap.add_argument("--host-id", default=None, help="default: $DSEC_HOST_ID or the hostname")
    ap.add_argument("--nats-url", default=None, help="default: $DSEC_NATS_URL")
    ap.add_argument("--blob-store", default=None, help="default: $DSEC_BLOB_STORE or nats")
    ap.add_argument("--fetch-attempts", type=int, default=4)
    ap.add_argument("--attempt-timeout", type=float, default=10.0)
    ap.add_argument("--fetch-timeout", type=float, default=30.0, help="bound on all attempts of one chunk fetch")
    ap.add_argument("--fetch-concurrency", type=int, default=8)
    ap.add_argument(
        "--store-wait-s", type=float, default=float(os.environ.get("DSEC_BLOB_STORE_WAIT_S", 30.0)),
        help="the blob store away: how long a read of an uncached chunk waits for it to come back; 0 fails at once "
        "(default: $DSEC_BLOB_STORE_WAIT_S or 30)",
    )
    ap.add_argument("--store-probe-s", type=float, default=2.0, help="the blob store away: how often it is tried again (default: 2)")
    ap.add_argument("--fault-delay", type=float, default=0.0, help=argparse.SUPPRESS)  # tests: a slow store
    ap.add_argument("--debug", action="store_true")
    add_metrics_flag(ap)
    return ap.parse_args(argv)


async def _setup(args: argparse.Namespace, cache_root: str, host: str) -> tuple[Any, ChunkCache, Exposition]:
    async def on_error(exc: Exception) -> None:
        log.warning("nats: %s: %s", type(exc).__name__, exc)

    nc = await connect(args.nats_url, name=f"imaged-lazy-{host}", connect_timeout_s=30.0, error_cb=on_error)
    js = nc.jetstream()
    store = open_blob_store(js, args.blob_store)
    cache = ChunkCache(
        cache_root,
        store,
        js=js,
        host_id=host,
        max_bytes=args.cache_max_bytes,
        mode=args.mode,
        attempts=args.fetch_attempts,
        attempt_timeout_s=args.attempt_timeout,
        total_timeout_s=args.fetch_timeout,
        fetch_concurrency=args.fetch_concurrency,
        fault_delay_s=args.fault_delay,
        store_wait_s=args.store_wait_s,
        store_probe_s=args.store_probe_s,
    )
    cache.load()
    cache.start_writer()

    async def on_stats(msg: Any, _: Any) -> Any:
        req = HOST_STATS_REQUEST.decode(msg.data) if msg.data else None  # empty: every layer
        return cache.host_stats(list(req.digests) if req else None)

    await Endpoint(nc, "host-image-stats", on_stats).serve(S.host_img_stats(host))
    packer = Packer(js, store, os.path.dirname(os.path.abspath(cache_root)))
    await Endpoint(nc, "pack", packer.on_pack, decoder=PACK_REQ).serve(S.host_pack(host))
    interval = float(os.environ.get("DSEC_GC_INTERVAL_S", LOCAL_GC_INTERVAL_S))
    if interval > 0:
        cache.extra_tasks.append(asyncio.get_running_loop().create_task(packer.collect_loop(interval)))
    reg = cache_registry(cache)
    reg.const_labels = {"service": "lazy-loader", "instance": host}
    metrics = Exposition(reg, "lazy-loader", host)
    await metrics.start(nc, http_port=args.metrics_port)
    return nc, cache, metrics


class Packer:
    """Answers ``dsec.imaged.<host>.pack``: a host agent's directory (a snapshot's upper-dir diff) packed
    into a layer in the blob store, the same chunks and layer records images use. Only directories
    under this host's data dir are packed."""

    def __init__(self, js: Any, store: Any, data_dir: str, concurrency: int = 2) -> None:
        self.js = js
        self.data_dir = os.path.realpath(data_dir)
        self.builder = ImageBuilder(js, data_dir, store=store, upload_concurrency=16)
        self._sem = asyncio.Semaphore(concurrency)  # mkfs and uploads compete with the sandboxes for disk and CPU

    async def collect_loop(self, interval_s: float) -> None:
        """This host's data-dir leftovers (local blobs nothing references, dead pack and build dirs,
        dumps of CRIU runs that died), every ``interval_s``."""
        while True:
            await asyncio.sleep(interval_s)  # the period, not synchronisation
            try:
                keep, _ = await referenced(self.js)
                keep |= {k.split("/", 1)[1] for k in await pinned(self.js) if k.startswith("layers/")}
                n, freed = await asyncio.to_thread(collect_local, self.data_dir, keep)
                if n:
                    log.info("collected %d leftover(s) (%d bytes) under %s", n, freed, self.data_dir)
            except Exception as exc:  # noqa: BLE001 - next period
                log.warning("local gc failed: %s", exc)

    async def on_pack(self, msg: Any, req: Any) -> PackedLayer:
        t0 = time.monotonic()
        path = os.path.realpath(req.path)
        if os.path.commonpath([path, self.data_dir]) != self.data_dir or not os.path.isdir(path):
            raise InvalidArgument(f"not a directory under {self.data_dir}: {req.path!r}")
        async with self._sem:
            try:
                built = await self.builder.pack_dir(path, role=req.role or "snapshot")
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # pack_dir left nothing behind: retry when there is room
                    raise NoSpace(f"packing {req.path}: no space left in {self.data_dir}: {exc.strerror}") from None
                raise
            except APIError as exc:
                if exc.err_code in JS_FULL:  # JetStream's file store is full
                    raise NoSpace(f"packing {req.path}: the blob store is full: {exc.description}") from None
                raise
        reply = PackedLayer(ref=built.ref, uploaded_bytes=built.uploaded_bytes, seconds=time.monotonic() - t0)
        log.info("packed %s: %s (%d bytes, %d uploaded) in %.3fs", path, built.ref.digest, built.ref.size, built.uploaded_bytes, reply.seconds)
        return reply


async def _teardown(nc: Any, cache: ChunkCache, metrics: Exposition) -> None:
    for t in cache.extra_tasks:
        t.cancel()
    await metrics.stop()
    await cache.close()
    try:
        await cache.store.close()
    finally:
        if not nc.is_closed:
            try:
                await asyncio.wait_for(nc.drain(), 5)
            except Exception:  # noqa: BLE001
                await nc.close()


async def _serve(args: argparse.Namespace, mount: str, cache_root: str, host: str) -> int:
    os.makedirs(cache_root, exist_ok=True)
    try:
        lock = lock_exclusive(os.path.join(cache_root, "lazy.lock"))
    except BlockingIOError:
        log.error("another lazy loader serves %s", cache_root)
        return 1
    try:
        nc, cache, metrics = await asyncio.wait_for(_setup(args, cache_root, host), 60)
    except Exception as exc:  # noqa: BLE001
        log.error("start-up failed: %s", exc)
        os.close(lock)
        return 1
    rc = 0
    fm = FuseMount(mount, os.path.join(cache_root, "fuse.json"))
    try:
        fd = fm.open()
        session = Session(fd, LazyFS(cache, args.mode), initialized=fm.taken_over)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, session.stop)
        cache.extra_daemon_info.update({"mount": mount, "mounted": True, "taken_over": fm.taken_over, "holder_pid": fm.holder_pid})
        cache.write_daemon_info()
        log.info(
            "serving %s (mode=%s, cache=%s, host=%s, store=%s%s)", mount, args.mode, cache_root, host, cache.store.url,
            ", took over the live connection" if fm.taken_over else "",
        )
        try:
            why = await session.serve()
            log.info("FUSE loop ended: %s", why)
        except Exception as exc:  # noqa: BLE001
            log.exception("FUSE loop failed: %s", exc)
            rc = 1
        unfinished = await session.drain(10.0)
        if unfinished:
            log.warning("%d reads still running at exit: the kernel resends them to the next daemon", unfinished)
        outcome = fm.close()
        cache.extra_daemon_info.update({"mounted": outcome == "kept", "stopped_at": time.time()})
    except Exception as exc:  # noqa: BLE001
        log.error("cannot serve %s: %s", mount, exc)
        rc = 1
    finally:
        try:
            await asyncio.wait_for(_teardown(nc, cache, metrics), 15)
        except Exception as exc:  # noqa: BLE001
            log.warning("teardown: %s", exc)
        os.close(lock)
    return rc


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.INFO,
        format="%(asctime)s imaged.lazy %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    d = _data_dir(args.data_dir)
    mount = os.path.abspath(args.mount or str(d / "lazy"))
    rc = asyncio.run(_serve(args, mount, str(d / "cache"), _host_id(args.host_id)))
    log.info("stopped")
    return rc


if __name__ == "__main__":
    sys.exit(main())
