"""The host-side lazy loader: a read-only FUSE file system that exposes every layer blob as a file.

    python -m imaged.lazy --data-dir D --mount M [--mode lazy|prefetch] [--cache-max-bytes N]

``M/<hex>`` is layer ``sha256:<hex>``: looking up an unknown name fetches only that layer's metadata
(the blob store's layer record, else the KV manifests); data chunks are fetched on first read,
verified against their sha256 and kept in ``D/cache/chunks`` (bounded, LRU). ``prefetch`` mode
fetches a whole layer when it is opened (the baseline the lazy mode is measured against).

The host agent mounts a layer with ``mount -t erofs -o ro M/<hex> <data_dir>/layers/<hex>``.

pyfuse3 runs on trio; NATS (nats-py) needs asyncio, so the chunk cache and every bus call run in an
asyncio loop on a second thread, and FUSE handlers await them through ``AsyncioBridge``.

Restarts: the cache survives (chunks, layer metadata, index.json). A FUSE mount dies with its daemon,
and so does every EROFS mount made on one of its files (reads fail with EIO / ENOTCONN): after a
restart the host agent must remount its layers (``daemon.json`` carries the daemon's pid and start
time, so a change tells it). On start the daemon lazily detaches a stale FUSE mount left at M.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import errno
import logging
import os
import signal
import stat
import sys
import threading
import time
from collections.abc import Coroutine
from typing import Any

import pyfuse3
import trio

from bus import codec
from bus import subjects as S
from bus.runtime import connect

from ._cache import ChunkCache, FetchFailed
from ._messages import HOST_STATS_REQUEST
from ._store import open_blob_store
from ._util import data_dir as _data_dir
from ._util import host_id as _host_id
from ._util import is_hex_digest

log = logging.getLogger("dsec.imaged.lazy")

ROOT = pyfuse3.ROOT_INODE
_TTL = 3600.0


class AsyncioBridge:
    """An asyncio loop on its own thread; trio code awaits coroutines run there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="dsec-lazy-asyncio", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def start(self) -> None:
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        """Blocking call from a plain thread (start-up and shut-down)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Await ``coro`` (run on the asyncio loop) from trio without blocking trio."""
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        fut: concurrent.futures.Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)

        def wake(_: object) -> None:
            try:
                token.run_sync_soon(done.set)
            except trio.RunFinishedError:
                pass

        fut.add_done_callback(wake)
        await done.wait()
        return fut.result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class LazyFS(pyfuse3.Operations):
    """Root directory of layer files; every file is read-only and immutable."""

    def __init__(self, bridge: AsyncioBridge, cache: ChunkCache, mode: str = "lazy") -> None:
        super().__init__()
        self.bridge = bridge
        self.cache = cache
        self.mode = mode
        self.by_ino: dict[int, str] = {}
        self.by_hex: dict[str, int] = {}
        self._next = ROOT + 1
        self._uid = os.getuid()
        self._gid = os.getgid()
        self._mounted_at = time.time_ns()

    def _ino(self, hexd: str) -> int:
        ino = self.by_hex.get(hexd)
        if ino is None:
            ino = self._next
            self._next += 1
            self.by_hex[hexd] = ino
            self.by_ino[ino] = hexd
        return ino

    def _attr(self, ino: int, size: int, *, is_dir: bool = False) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.generation = 0
        a.entry_timeout = _TTL
        a.attr_timeout = _TTL
        a.st_mode = (stat.S_IFDIR | 0o555) if is_dir else (stat.S_IFREG | 0o444)
        a.st_nlink = 2 if is_dir else 1
        a.st_uid = 0
        a.st_gid = 0
        a.st_rdev = 0
        a.st_size = size
        a.st_blksize = 4096
        a.st_blocks = (size + 511) // 512
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = self._mounted_at
        return a

    async def getattr(self, inode: int, ctx: Any = None) -> pyfuse3.EntryAttributes:
        if inode == ROOT:
            return self._attr(ROOT, 0, is_dir=True)
        hexd = self.by_ino.get(inode)
        meta = self.cache.layers.get(hexd) if hexd else None
        if meta is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(inode, meta.size)

    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> pyfuse3.EntryAttributes:
        if parent_inode != ROOT:
            raise pyfuse3.FUSEError(errno.ENOENT)
        n = name.decode("utf-8", "replace")
        if n in (".", ".."):
            return self._attr(ROOT, 0, is_dir=True)
        if n.startswith("sha256:"):
            n = n[7:]
        if not is_hex_digest(n):
            raise pyfuse3.FUSEError(errno.ENOENT)
        meta = self.cache.layers.get(n)
        if meta is None:
            try:
                meta = await self.bridge.call(self.cache.layer(n))
            except Exception as exc:  # noqa: BLE001 - NATS / store away: the lookup fails, not the daemon
                log.warning("lookup %s failed: %s", n, exc)
                raise pyfuse3.FUSEError(errno.EIO) from None
        if meta is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(self._ino(n), meta.size)

    async def opendir(self, inode: int, ctx: Any) -> int:
        if inode != ROOT:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return ROOT

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        names = sorted(self.cache.layers)
        for i, hexd in enumerate(names):
            if i < start_id:
                continue
            meta = self.cache.layers[hexd]
            if not pyfuse3.readdir_reply(token, hexd.encode(), self._attr(self._ino(hexd), meta.size), i + 1):
                break

    async def releasedir(self, fh: int) -> None:
        return None

    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        if inode == ROOT:
            raise pyfuse3.FUSEError(errno.EISDIR)
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & (os.O_TRUNC | os.O_APPEND):
            raise pyfuse3.FUSEError(errno.EROFS)
        hexd = self.by_ino.get(inode)
        if hexd is None or hexd not in self.cache.layers:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if self.mode == "prefetch":
            try:
                await self.bridge.call(self.cache.prefetch(hexd))
            except FetchFailed:
                raise pyfuse3.FUSEError(errno.EIO) from None
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        hexd = self.by_ino.get(fh)
        if hexd is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        try:
            return await self.bridge.call(self.cache.read(hexd, off, size))
        except FetchFailed:
            raise pyfuse3.FUSEError(errno.EIO) from None
        except FileNotFoundError:
            raise pyfuse3.FUSEError(errno.ENOENT) from None
        except Exception as exc:  # noqa: BLE001 - never crash the daemon on one read
            log.exception("read %s@%d+%d failed: %s", hexd, off, size, exc)
            raise pyfuse3.FUSEError(errno.EIO) from None

    async def release(self, fh: int) -> None:
        return None

    async def access(self, inode: int, mode: int, ctx: Any) -> bool:
        return not (mode & os.W_OK)

    async def statfs(self, ctx: Any) -> pyfuse3.StatvfsData:
        s = pyfuse3.StatvfsData()
        total = sum(m.size for m in self.cache.layers.values())
        s.f_bsize = 4096
        s.f_frsize = 4096
        s.f_blocks = (total + 4095) // 4096
        s.f_bfree = 0
        s.f_bavail = 0
        s.f_files = len(self.cache.layers) + 1
        s.f_ffree = 0
        s.f_favail = 0
        s.f_namemax = 255
        return s


# --- mount point hygiene ---------------------------------------------------------------------------
def mounts_at(path: str) -> list[str]:
    """File system types mounted exactly at ``path`` (from /proc/self/mountinfo)."""
    real = os.path.realpath(path)
    out = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 4 and parts[4].encode().decode("unicode_escape") == real:
                    sep = parts.index("-")
                    out.append(parts[sep + 1])
    except OSError:
        pass
    return out


_libc = None


def _umount2(path: str, flags: int = 0) -> int:
    """umount2(2) straight from libc: no canonicalisation, so no stat() that a dead FUSE would hang."""
    global _libc
    import ctypes
    import ctypes.util

    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if _libc.umount2(os.fsencode(path), flags) != 0:
        return ctypes.get_errno()
    return 0


MNT_DETACH = 2


def clear_stale_mount(path: str) -> None:
    """Lazily detach whatever FUSE mount a dead daemon left at ``path``."""
    for _ in range(8):
        kinds = mounts_at(path)
        if not kinds:
            return
        if not any(k.startswith("fuse") for k in kinds):
            raise SystemExit(f"{path} has a non-FUSE mount ({kinds}); refusing to mount over it")
        log.warning("detaching a stale FUSE mount at %s", path)
        _umount2(path, MNT_DETACH)


def unmount(path: str) -> None:
    err = _umount2(path)
    if err and mounts_at(path):
        log.warning(
            "umount %s: %s; detaching lazily (EROFS mounts on its files will get EIO)", path, os.strerror(err)
        )
        _umount2(path, MNT_DETACH)


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
    ap.add_argument("--fault-delay", type=float, default=0.0, help=argparse.SUPPRESS)  # tests: a slow store
    ap.add_argument("--debug", action="store_true")
    return ap.parse_args(argv)


async def _setup(args: argparse.Namespace, cache_root: str, host: str) -> tuple[Any, ChunkCache]:
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
    )
    cache.load()
    cache.start_writer()

    async def on_stats(msg: Any) -> None:
        try:
            req = HOST_STATS_REQUEST.decode(msg.data) if msg.data else None
            reply = cache.host_stats(list(req.digests) if req else None)
            await msg.respond(codec.encode(reply))
        except Exception as exc:  # noqa: BLE001
            from bus.runtime import error_of

            await msg.respond(codec.encode(error_of(exc)))

    await nc.subscribe(S.host_img_stats(host), cb=on_stats)
    return nc, cache


async def _teardown(nc: Any, cache: ChunkCache) -> None:
    await cache.close()
    try:
        await cache.store.close()
    finally:
        if not nc.is_closed:
            try:
                await asyncio.wait_for(nc.drain(), 5)
            except Exception:  # noqa: BLE001
                await nc.close()


async def _serve_trio() -> None:
    async with trio.open_nursery() as nursery:

        async def watch_signals() -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    return

        nursery.start_soon(watch_signals)
        await pyfuse3.main(min_tasks=4, max_tasks=128)
        nursery.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.INFO,
        format="%(asctime)s imaged.lazy %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    d = _data_dir(args.data_dir)
    mount = os.path.abspath(args.mount or str(d / "lazy"))
    host = _host_id(args.host_id)
    cache_root = str(d / "cache")
    os.makedirs(mount, exist_ok=True)
    clear_stale_mount(mount)

    bridge = AsyncioBridge()
    bridge.start()
    try:
        nc, cache = bridge.run(_setup(args, cache_root, host), timeout=60)
    except BaseException as exc:
        log.error("start-up failed: %s", exc)
        bridge.stop()
        return 1
    ops = LazyFS(bridge, cache, args.mode)
    opts = set(pyfuse3.default_options)
    opts |= {"fsname=dsec-lazy", "subtype=dsec", "ro", "allow_other"}
    opts.discard("default_permissions")
    pyfuse3.init(ops, mount, opts)
    cache.extra_daemon_info.update({"mount": mount, "mounted": True})
    bridge.run(_write_info(cache), timeout=10)
    log.info("serving %s (mode=%s, cache=%s, host=%s, store=%s)", mount, args.mode, cache_root, host, cache.store.url)
    rc = 0
    try:
        trio.run(_serve_trio)
    except BaseException as exc:  # noqa: BLE001
        log.exception("FUSE loop failed: %s", exc)
        rc = 1
    finally:
        unmount(mount)
        try:
            pyfuse3.close(unmount=False)
        except Exception:  # noqa: BLE001
            pass
        cache.extra_daemon_info.update({"mounted": False, "stopped_at": time.time()})
        try:
            bridge.run(_teardown(nc, cache), timeout=15)
        except Exception as exc:  # noqa: BLE001
            log.warning("teardown: %s", exc)
        bridge.stop()
    log.info("stopped")
    return rc


async def _write_info(cache: ChunkCache) -> None:
    cache.write_daemon_info()


if __name__ == "__main__":
    sys.exit(main())
