"""The S3 blob store against a real SeaweedFS: primitives, a build, and the lazy loader reading from it."""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path

import pytest


from imaged import ImageBuilder, S3BlobStore, open_blob_store
from imaged._store import BlobNotFound, chunk_key
from imaged._util import digest_hex

from .conftest import await_for, make_tree, mount_erofs, needs_fuse


@pytest.fixture
def s3_env(seaweed, uid: str, monkeypatch):
    env = seaweed.env(f"dsec-{uid}")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


async def test_s3_store_primitives(s3_env) -> None:
    store = open_blob_store(None)
    assert isinstance(store, S3BlobStore)
    try:
        assert not await store.exists("chunks/" + "a" * 64)
        await store.put("chunks/" + "a" * 64, b"hello")
        assert await store.exists("chunks/" + "a" * 64)
        assert await store.get("chunks/" + "a" * 64) == b"hello"
        with pytest.raises(BlobNotFound):
            await store.get("chunks/" + "b" * 64)
        assert await store.keys("chunks/") == ["chunks/" + "a" * 64]
        await store.delete("chunks/" + "a" * 64)
        assert await store.keys("chunks/") == []
    finally:
        await store.close()


@needs_fuse
async def test_build_to_s3_and_lazy_load_from_it(js, s3_env, tmp_path: Path, uid: str, lazy_daemons, mounts) -> None:
    files = {f"data/f{i}": os.urandom(256 * 1024) for i in range(6)}
    files["etc/motd"] = b"served from seaweedfs\n"
    src = make_tree(tmp_path / "src", files)
    store = open_blob_store(js)
    try:
        builder = ImageBuilder(js, tmp_path / "b", store=store, chunk_size=64 * 1024)
        res = await builder.build_template(f"s3-{uid}", str(src))
        layer = res.manifest.layers[0]
        assert res.uploaded_bytes > 0
        keys = await store.keys("chunks/")
        assert {chunk_key(c) for c in layer.chunks} <= set(keys)
        assert await store.get_layer(layer.digest) is not None
        again = await builder.build_template(f"s3-{uid}", str(src))
        assert again.uploaded_bytes == 0
    finally:
        await store.close()
    d = lazy_daemons(env=s3_env)
    mnt = tmp_path / "layer"
    await asyncio.to_thread(mount_erofs, d.mount / digest_hex(layer.digest), mnt)
    mounts.append(mnt)
    assert (await asyncio.to_thread((mnt / "etc/motd").read_bytes)) == files["etc/motd"]
    assert (await asyncio.to_thread((mnt / "data/f3").read_bytes)) == files["data/f3"]
    fetched = await await_for(lambda: d.index().get(layer.digest, {}).get("fetched_bytes", 0), 10, "index.json")
    assert 256 * 1024 <= fetched < layer.size / 2
    await await_for(lambda: d.info()["downloaded_bytes"] >= fetched, 10, "daemon.json")


@needs_fuse
async def test_a_hung_store_fails_reads_at_once_or_is_waited_for(js, tmp_path: Path, uid: str, lazy_daemons, mounts) -> None:
    """The S3 store hangs (its process stopped with SIGSTOP: connections are taken, nothing answers --
    a partition looks like this). ``--store-wait-s 0``: a read of an uncached chunk fails with EIO after
    one attempt's timeout, daemon.json says the store is away, and the next such read fails without
    trying the store; cached data is read throughout. ``--store-wait-s 120``: a read waits, and is
    answered once the store runs again (SIGCONT)."""
    import signal

    from bus import codec
    from bus import subjects as S
    from imaged._store import S3BlobStore

    from .conftest import seaweed_server

    files = {f"data/f{i}.bin": os.urandom(256 * 1024) for i in range(4)}
    with seaweed_server() as sw:
        bucket = f"dsec-hang-{uid}"
        store = S3BlobStore(bucket, endpoint=sw.endpoint, access_key="dsec", secret_key="dsec-secret")
        try:
            res = await ImageBuilder(js, tmp_path / "b", store=store, chunk_size=64 * 1024).build_template(
                f"hang-{uid}", str(make_tree(tmp_path / "src", files)))
        finally:
            await store.close()
        layer = res.manifest.layers[0]
        hexd = digest_hex(layer.digest)
        # a long probe interval: "the next read does not try the store" must not depend on how fast it comes
        d = lazy_daemons(env=sw.env(bucket), args=["--store-wait-s", "0", "--attempt-timeout", "3", "--store-probe-s", "600"])
        mnt = tmp_path / "layer"
        await asyncio.to_thread(mount_erofs, d.mount / hexd, mnt)
        mounts.append(mnt)
        assert (await asyncio.to_thread((mnt / "data/f0.bin").read_bytes)) == files["data/f0.bin"]
        sub = await js._nc.subscribe(S.evt_image(hexd, "fetch_failed"))
        os.kill(sw.proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(OSError) as e1:
                await asyncio.to_thread((mnt / "data/f1.bin").read_bytes)
            assert e1.value.errno == errno.EIO
            info = d.info()
            assert info["store_available"] is False and "Timeout" in info["store_error"], info
            ev = codec.EVENT.decode((await sub.next_msg(timeout=10)).data)
            assert ev.detail["code"] == "blob_store_unavailable" and "not waiting" not in ev.detail["error"], ev.detail
            # known away: the next uncached read fails without trying the store
            with pytest.raises(OSError) as e2:
                await asyncio.to_thread((mnt / "data/f2.bin").read_bytes)
            assert e2.value.errno == errno.EIO
            # (the first read's other chunks, read ahead by the kernel, may still report their own timeouts first)
            seen = []
            while not any("not waiting for it" in e.detail["error"] for e in seen):
                seen.append(codec.EVENT.decode((await sub.next_msg(timeout=10)).data))
            assert all(e.detail["code"] == "blob_store_unavailable" for e in seen), [e.detail for e in seen]
            assert (await asyncio.to_thread((mnt / "data/f0.bin").read_bytes)) == files["data/f0.bin"]  # cached: served

            # Wait mode (a restarted daemon takes the connection over): the read waits for the store.
            d.stop()
            d.args = ["--store-wait-s", "120", "--attempt-timeout", "3"]
            d.start()
            reading = asyncio.ensure_future(asyncio.to_thread((mnt / "data/f3.bin").read_bytes))
            await await_for(lambda: d.info()["store_available"] is False, 60, "the daemon to find the store away", interval=0.1)
            assert not reading.done()
        finally:
            os.kill(sw.proc.pid, signal.SIGCONT)
            await sub.unsubscribe()
        assert await asyncio.wait_for(reading, 120) == files["data/f3.bin"]
        await await_for(lambda: d.info()["store_available"] is True, 30, "daemon.json to say the store is back")
        assert (await asyncio.to_thread((mnt / "data/f1.bin").read_bytes)) == files["data/f1.bin"]
