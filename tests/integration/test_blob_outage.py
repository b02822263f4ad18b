"""The blob store away for a while (issue 23): the production store is S3-compatible (here a real
SeaweedFS, stopped by pid and started again on its ports and data). The host's lazy loader either
fails a read of an uncached chunk at once (``--store-wait-s 0``) -- the create that needed it fails
with ``blob_store_unavailable`` -- or waits for the store (``--store-wait-s N``) and the create
succeeds once the store is back. A template whose layers the host has cached starts throughout; a
snapshot (a layer to store) fails typed while the store is away and is stored once it is back."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from sdk import AsyncSandbox
from sdk.errors import BlobStoreUnavailable
from tests.conftest import eventually
from tests.imaged.conftest import LazyDaemon, make_tree, needs_fuse, seaweed_server

from .conftest import Stack, needs_stack

pytestmark = [pytest.mark.containerd, needs_stack, needs_fuse]
KiB = 1 << 10


async def test_uncached_create_fails_typed_or_waits_cached_proceeds(stack: Stack, nats_server, tmp_path: Path) -> None:
    from imaged import ImageBuilder, S3BlobStore
    from imaged._manifests import delete_manifest

    js = stack.js
    tag = f"{stack.uid}-{os.urandom(3).hex()}"
    blob = os.urandom(256 * KiB)
    with seaweed_server() as sw:
        bucket = f"dsec-{tag}"
        store = S3BlobStore(bucket, endpoint=sw.endpoint, access_key="dsec", secret_key="dsec-secret")
        builder = ImageBuilder(js, tmp_path / "builder", store=store, chunk_size=64 * KiB)
        warm, cold = f"warm-{tag}", f"cold-{tag}"
        try:
            built_w = await builder.build_template(warm, str(stack.rootfs), str(make_tree(tmp_path / "ww", {"work/hello": "warm\n"})))
            built_c = await builder.build_template(
                cold, str(stack.rootfs), str(make_tree(tmp_path / "wc", {"work/hello": f"cold {tag}\n", "work/data.bin": blob})),
            )
        finally:
            await store.close()
        layers = [*built_w.manifest.layers, *built_c.manifest.layers]
        cold_ws = built_c.manifest.layers[-1]
        assert cold_ws.digest not in {lay.digest for lay in built_w.manifest.layers}
        shutil.rmtree(tmp_path / "builder")  # only the blob store has the layers now
        assert not any(lay.path and os.path.exists(lay.path) for lay in layers)

        loader = LazyDaemon(
            data_dir=stack.data_dir, mount=stack.data_dir / "lazy", nats_url=nats_server.url, host_id=stack.host_id,
            env=sw.env(bucket), args=["--store-wait-s", "0", "--attempt-timeout", "5"],
        )
        loader.start(60)
        sbs: list[AsyncSandbox] = []
        try:
            # The warm template is used once while the store is up: its layers are on this host.
            async with stack.sandbox(template=warm) as sb:
                assert (await sb.commands.run("cat /work/hello")).stdout == "warm\n"
            assert loader.info()["store_available"] is True

            sw.stop()
            # Fail at once: the uncached template's create fails typed, and says why.
            sid = stack.new_id("cold")
            with pytest.raises(BlobStoreUnavailable) as ei:
                await AsyncSandbox.create(**stack.kw(template=cold, sandbox_id=sid, create_timeout=180))
            assert ei.value.code == "blob_store_unavailable"
            assert cold_ws.digest in ei.value.description, ei.value.description
            info = loader.info()
            assert info["store_available"] is False and info["store_error"], info
            assert not await stack.leftovers(sid)
            # The cached template proceeds during the outage (its reads are served from the host's cache);
            # a snapshot of it, which must store a layer, fails typed.
            async with stack.sandbox(template=warm) as sb:
                assert (await sb.commands.run("cat /work/hello && echo changed > /root/f")).stdout == "warm\n"
                with pytest.raises(BlobStoreUnavailable) as ei:
                    await sb.create_snapshot()
                assert ei.value.code == "blob_store_unavailable", ei.value
                assert (await sb.commands.run("cat /root/f")).stdout == "changed\n"  # the sandbox runs on

            # Wait mode: the create waits for the store, and succeeds once it is back.
            loader.stop()
            loader.args = ["--store-wait-s", "240", "--attempt-timeout", "5"]
            loader.start(60)
            assert loader.info()["taken_over"] is True
            creating = asyncio.create_task(AsyncSandbox.create(**stack.kw(template=cold, sandbox_id=stack.new_id("cold"), create_timeout=300)))
            await eventually(lambda: loader.info()["store_available"] is False, timeout=120, interval=0.2, what="the loader to find the store away")
            assert not creating.done()  # waiting, not failed
            await asyncio.to_thread(sw.restart)
            sb = await asyncio.wait_for(creating, 300)
            sbs.append(sb)
            r = await sb.commands.run("cat /work/hello && sha256sum /work/data.bin")
            assert r.stdout.splitlines() == [f"cold {tag}", f"{hashlib.sha256(blob).hexdigest()}  /work/data.bin"]
            await eventually(lambda: loader.info()["store_available"] is True, timeout=30, interval=0.2, what="the loader to see the store back")
            # The positive control of the snapshot: with the store back, the same kind of snapshot is stored.
            await sb.commands.run("echo changed > /root/f")
            assert (await sb.create_snapshot()).snapshot_id
        finally:
            for sb in sbs:
                await sb.kill()
            for lay in layers:  # the template's layer mounts would outlive the loader's connection
                hexd = lay.digest.split(":", 1)[1]
                if stack.backend.layers.forget(hexd):
                    subprocess.run(["umount", str(stack.data_dir / "layers" / hexd)], check=False)
            loader.release()
            for name in (warm, cold):
                await delete_manifest(js, name)
