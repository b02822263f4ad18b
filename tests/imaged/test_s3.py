"""The S3 blob store against a real SeaweedFS: primitives, a build, and the lazy loader reading from it."""

from __future__ import annotations

import asyncio
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
