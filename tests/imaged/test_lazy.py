"""The lazy loader: a real FUSE daemon, EROFS mounted from its files, faults, restarts, stats."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from bus import codec
from bus import subjects as S
from imaged import ImageBuilder, host_image_stats, read_cache_index
from imaged._store import chunk_key
from imaged._util import digest_hex

from .conftest import REPO, await_for, drop_cached_pages, make_tree, mount_erofs, mounted, needs_fuse, umount

pytestmark = needs_fuse
CHUNK = 64 * 1024
MiB = 1 << 20


async def _template(js, tmp_path: Path, name: str, nfiles: int = 12, size: int = MiB, chunk: int = CHUNK):
    files = {f"data/f{i:02d}.bin": os.urandom(size) for i in range(nfiles)}
    files["etc/hello"] = b"hello from a lazy layer\n"
    base = make_tree(tmp_path / f"src-{name}", files)
    builder = ImageBuilder(js, tmp_path / "builder", chunk_size=chunk)
    res = await builder.build_template(name, str(base))
    return res.manifest.layers[0], files, builder


def _read(path: Path) -> bytes:
    return path.read_bytes()


async def test_lazy_mount_fetches_only_touched_chunks(js, tmp_path: Path, uid: str, lazy_daemons, mounts) -> None:
    name = f"lazy-{uid}"
    layer, files, _ = await _template(js, tmp_path, name)
    hexd = digest_hex(layer.digest)
    d = lazy_daemons()
    blob = d.mount / hexd
    assert not os.path.exists(d.mount / ("0" * 64))  # unknown layer: ENOENT
    assert not os.path.exists(d.mount / "not-a-digest")
    assert blob.stat().st_size == layer.size  # lookup fetched metadata only
    assert sorted(os.listdir(d.mount)) == [hexd]
    with pytest.raises(OSError) as exc:
        open(blob, "r+b")  # noqa: SIM115 - must fail: nothing to close
    assert exc.value.errno in (errno.EROFS, errno.EACCES)

    mnt = tmp_path / "layer"
    await asyncio.to_thread(mount_erofs, blob, mnt)
    mounts.append(mnt)
    assert (await asyncio.to_thread(_read, mnt / "etc/hello")) == files["etc/hello"]
    assert (await asyncio.to_thread(_read, mnt / "data/f03.bin")) == files["data/f03.bin"]

    def fetched() -> int:
        return d.index().get(layer.digest, {}).get("fetched_bytes", 0)

    await await_for(lambda: fetched() >= MiB, 10, "index.json to show the fetched bytes")
    f = fetched()
    assert MiB <= f <= MiB + 8 * CHUNK, f"fetched {f} of {layer.size}"  # one file + metadata, not the layer
    assert f < layer.size / 4
    st = await host_image_stats(js._nc, "testhost", digests=[layer.digest])
    assert st.layers[0].fetched_bytes == f and st.layers[0].total_bytes == layer.size
    assert st.downloaded_bytes >= f and st.fetch_failures == 0

    # `dsec image stats NAME --json` on this host (through NATS)
    r = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "imaged.cli", "--nats-url", d.nats_url, "image", "stats", name, "--json", "--host-id", "testhost"],
        cwd=REPO, capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["total_bytes"] == layer.size and out["fetched_bytes"] == f and out["source"] == "nats"

    # reading everything completes the layer; contents verified
    for rel, data in files.items():
        assert (await asyncio.to_thread(_read, mnt / rel)) == data
    await await_for(lambda: d.index().get(layer.digest, {}).get("complete"), 10, "the layer to be complete")
    assert read_cache_index(d.data_dir)[layer.digest]["fetched_bytes"] == layer.size


async def test_prefetch_mode_pulls_the_whole_layer_on_open(js, tmp_path: Path, uid: str, lazy_daemons, mounts) -> None:
    layer, files, _ = await _template(js, tmp_path, f"pre-{uid}", nfiles=6)
    d = lazy_daemons(args=["--mode", "prefetch"])
    mnt = tmp_path / "layer"
    await asyncio.to_thread(mount_erofs, d.mount / digest_hex(layer.digest), mnt)
    mounts.append(mnt)
    await await_for(lambda: d.index().get(layer.digest, {}).get("complete"), 10, "prefetch to complete")
    assert (await asyncio.to_thread(_read, mnt / "data/f01.bin")) == files["data/f01.bin"]
    assert d.info()["mode"] == "prefetch"


async def test_cache_is_bounded_with_lru_eviction(js, tmp_path: Path, uid: str, lazy_daemons, mounts) -> None:
    layer, files, _ = await _template(js, tmp_path, f"lru-{uid}", nfiles=10)
    bound = 3 * MiB
    d = lazy_daemons(args=["--cache-max-bytes", str(bound)])
    mnt = tmp_path / "layer"
    await asyncio.to_thread(mount_erofs, d.mount / digest_hex(layer.digest), mnt)
    mounts.append(mnt)
    for rel, data in files.items():  # 10 MiB through a 3 MiB cache
        assert (await asyncio.to_thread(_read, mnt / rel)) == data
    await await_for(lambda: d.info().get("evicted_bytes", 0) > 0, 10, "evictions to be recorded")
    info = d.info()
    assert info["cache_bytes"] <= bound
    on_disk = sum(p.stat().st_size for p in (d.data_dir / "cache" / "chunks").iterdir())
    assert on_disk <= bound


async def test_fetch_failure_gives_eio_and_an_event(js, tmp_path: Path, uid: str, lazy_daemons, mounts) -> None:
    layer, files, builder = await _template(js, tmp_path, f"fail-{uid}", nfiles=4)
    hexd = digest_hex(layer.digest)
    d = lazy_daemons(args=["--fetch-attempts", "3", "--fetch-timeout", "3", "--attempt-timeout", "1"])
    mnt = tmp_path / "layer"
    await asyncio.to_thread(mount_erofs, d.mount / hexd, mnt)
    mounts.append(mnt)
    # the chunks holding f02 vanish from the store (metadata chunks stay)
    victim = files["data/f02.bin"]
    blob = Path(layer.path).read_bytes()
    gone = {c for i, c in enumerate(layer.chunks) if blob[i * CHUNK : (i + 1) * CHUNK] in victim}
    assert len(gone) >= 8
    for c in gone:
        await builder.store.delete(chunk_key(c))
    sub = await js._nc.subscribe(S.evt_image(hexd, "fetch_failed"))
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(OSError) as exc:
        await asyncio.to_thread(_read, mnt / "data/f02.bin")
    assert exc.value.errno == errno.EIO
    assert loop.time() - t0 < 15  # bounded: no hang
    ev = codec.EVENT.decode((await sub.next_msg(timeout=10)).data)
    await sub.unsubscribe()
    assert ev.kind == "fetch_failed" and ev.detail["layer"] == layer.digest and ev.detail["host_id"] == "testhost"
    assert int(ev.detail["attempts"]) >= 2
    # other files are still fine, and so is f02 once its chunks are back
    assert (await asyncio.to_thread(_read, mnt / "data/f01.bin")) == files["data/f01.bin"]
    for i, c in enumerate(layer.chunks):
        if c in gone:
            await builder.store.put(chunk_key(c), blob[i * CHUNK : (i + 1) * CHUNK])
    assert (await asyncio.to_thread(_read, mnt / "data/f02.bin")) == victim
    await await_for(lambda: d.info()["fetch_failures"] >= 1, 10, "daemon.json to count the failures")


async def test_corrupt_chunks_are_rejected_and_refetched(js, tmp_path: Path, uid: str, lazy_daemons, mounts) -> None:
    layer, files, builder = await _template(js, tmp_path, f"bad-{uid}", nfiles=4)
    hexd = digest_hex(layer.digest)
    blob = Path(layer.path).read_bytes()
    victim = files["data/f01.bin"]
    idx = next(i for i in range(1, len(layer.chunks)) if victim[:64] in blob[i * CHUNK : (i + 1) * CHUNK])
    good = blob[idx * CHUNK : (idx + 1) * CHUNK]
    key = chunk_key(layer.chunks[idx])
    await builder.store.put(key, b"\0" * len(good))  # the store now serves garbage for that chunk
    d = lazy_daemons(args=["--fetch-attempts", "12", "--fetch-timeout", "60"])
    mnt = tmp_path / "layer"
    await asyncio.to_thread(mount_erofs, d.mount / hexd, mnt)
    mounts.append(mnt)
    sub = await js._nc.subscribe(S.evt_image(hexd, "chunk_corrupt"))
    reader = asyncio.ensure_future(asyncio.to_thread(_read, mnt / "data/f01.bin"))
    ev = codec.EVENT.decode((await sub.next_msg(timeout=20)).data)
    assert ev.detail["where"] == "store" and ev.detail["chunk"] == layer.chunks[idx]
    assert not reader.done()  # rejected, and still retrying
    await builder.store.put(key, good)  # repaired: the next attempt gets good data
    assert await asyncio.wait_for(reader, 60) == victim
    await sub.unsubscribe()
    # daemon.json is rewritten shortly after a change (debounced), not before the read is answered
    await await_for(lambda: d.info()["corrupt_chunks"] >= 1, 10, "daemon.json to count the corrupt chunk")

    # a chunk damaged on the host's disk is caught on first use after a restart and fetched again
    await asyncio.to_thread(umount, mnt)
    d.stop()
    cpath = d.data_dir / "cache" / "chunks" / digest_hex(layer.chunks[idx])
    assert cpath.exists()
    cpath.write_bytes(b"\xff" * len(good))
    d.start()
    # When something still held the file system at the stop, the restart took the connection over,
    # and the kernel's pages of the layer file, read before, survived with it: the read below would
    # never reach the daemon. (The root mount is private here: a mount namespace another process
    # creates meanwhile keeps its own copy of the EROFS mount, and so the layer file open, after our
    # umount.) Dropping those pages makes it a first use either way.
    await asyncio.to_thread(drop_cached_pages, d.mount / hexd)
    await asyncio.to_thread(mount_erofs, d.mount / hexd, mnt)
    assert (await asyncio.to_thread(_read, mnt / "data/f01.bin")) == victim
    assert cpath.read_bytes() == good
    await await_for(lambda: d.info()["corrupt_chunks"] >= 1, 10, "daemon.json to count the damaged chunk")
    assert d.info()["corrupt_chunks"] == 1  # counted once: the fresh copy is not damaged


async def test_daemon_killed_mid_read_is_taken_over_and_loses_nothing(js, tmp_path: Path, uid: str, lazy_daemons, mounts) -> None:
    """SIGKILL the daemon while a read is in flight: the FUSE connection outlives it (its holder keeps
    /dev/fuse open), the reader just waits, and a restarted daemon takes the connection over, gets the
    unanswered reads resent by the kernel and finishes them. The EROFS mount is never remounted and
    cached chunks are not downloaded again."""
    layer, files, _ = await _template(js, tmp_path, f"rst-{uid}", nfiles=8)
    hexd = digest_hex(layer.digest)
    d = lazy_daemons(args=["--fault-delay", "0.05", "--fetch-concurrency", "1"])
    holder = d.holder()
    assert holder
    mnt = tmp_path / "layer"
    await asyncio.to_thread(mount_erofs, d.mount / hexd, mnt)
    mounts.append(mnt)
    got: dict[str, bytes] = {}
    result: dict = {}

    def read_all() -> None:
        try:
            for rel in sorted(files):
                got[rel] = (mnt / rel).read_bytes()
            result["ok"] = True
        except OSError as exc:
            result["error"] = exc.errno

    t = threading.Thread(target=read_all)
    t.start()
    await await_for(lambda: d.index().get(layer.digest, {}).get("fetched_bytes", 0) >= 2 * MiB, 30, "the read to be under way")
    old_pid = d.pid
    d.kill()
    assert t.is_alive() and not result  # no error: the read waits for the next daemon
    cached = sum(1 for _ in (d.data_dir / "cache" / "chunks").iterdir())
    assert cached > 0
    assert d.holder() == holder and mounted(d.mount) and mounted(mnt)

    d.args = []
    d.start()
    assert d.pid != old_pid and d.info()["pid"] == d.pid and d.info()["taken_over"] is True
    assert d.holder() == holder  # the same connection, not a new mount
    await asyncio.to_thread(t.join, 60)
    assert not t.is_alive()
    assert result == {"ok": True}, result
    assert got == {rel: files[rel] for rel in sorted(files)}
    for rel, data in files.items():  # the same EROFS mount, never remounted
        assert (await asyncio.to_thread(_read, mnt / rel)) == data
    info = d.info()
    assert info["downloaded_bytes"] <= layer.size - (cached - 1) * CHUNK  # cached chunks not fetched again


async def test_sigterm_keeps_a_used_mount_for_the_next_daemon(js, tmp_path: Path, uid: str, lazy_daemons, mounts) -> None:
    """A clean stop (an upgrade) while EROFS mounts use the file system keeps the connection; the
    next daemon serves them. With nothing mounted on it, a clean stop unmounts and ends the holder."""
    layer, files, _ = await _template(js, tmp_path, f"trm-{uid}", nfiles=3)
    hexd = digest_hex(layer.digest)
    d = lazy_daemons()
    holder = d.holder()
    mnt = tmp_path / "layer"
    await asyncio.to_thread(mount_erofs, d.mount / hexd, mnt)
    mounts.append(mnt)
    assert (await asyncio.to_thread(_read, mnt / "etc/hello")) == files["etc/hello"]
    assert d.stop() == 0
    assert mounted(d.mount) and d.holder() == holder and d.info()["mounted"] is True
    d.start()
    assert d.info()["taken_over"] is True
    for rel, data in files.items():
        assert (await asyncio.to_thread(_read, mnt / rel)) == data

    await asyncio.to_thread(umount, mnt)
    assert d.stop() == 0
    assert not mounted(d.mount) and d.holder() == 0 and d.info()["mounted"] is False
    d.start()  # a fresh mount again
    assert d.info()["taken_over"] is False


async def test_a_second_daemon_on_the_same_cache_is_refused(js, tmp_path: Path, lazy_daemons) -> None:
    """Two daemons reading one FUSE connection would split its requests: the second one exits."""
    d = lazy_daemons()
    other = lazy_daemons(data_dir=d.data_dir, mount=tmp_path / "other", start=False)
    with pytest.raises(AssertionError, match="exited 1"):
        other.start(timeout=20)
    assert "another lazy loader serves" in other.log_text()
