"""A sandbox on a three-layer template whose layers exist only in the blob store: the host agent mounts
EROFS straight from the lazy loader's FUSE files, stacks base + workspace + toolkit with overlay, and
the sandbox reads data that is fetched on first touch. The lazy loader is then killed and restarted
under the running sandbox, mid-read, and nothing is lost."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import eventually
from tests.imaged.conftest import LazyDaemon, make_tree, needs_fuse

from .conftest import Stack, needs_stack

pytestmark = [pytest.mark.containerd, needs_stack, needs_fuse]
MiB = 1 << 20


async def test_sandbox_on_lazy_layers_survives_a_loader_restart(stack: Stack, nats_server, tmp_path: Path) -> None:
    from imaged import ImageBuilder

    name = f"lazy-{stack.uid}-{os.urandom(3).hex()}"
    work = {f"work/f{i}.bin": os.urandom(MiB) for i in range(6)}
    tool = {"opt/tool/run.sh": b"#!/bin/sh\necho toolkit ok\n"}
    builder = ImageBuilder(stack.nc.jetstream(), tmp_path / "builder", chunk_size=64 * 1024)
    res = await builder.build_template(
        name, str(stack.rootfs), str(make_tree(tmp_path / "ws", work)), str(make_tree(tmp_path / "tk", tool))
    )
    layers = res.manifest.layers
    assert [lay.role for lay in layers] == ["base", "workspace", "toolkit"]
    # Nothing of the template is on this host any more: only the blob store has it.
    shutil.rmtree(tmp_path / "builder")
    assert not any(lay.path and os.path.exists(lay.path) for lay in layers)

    # The loader the host agent expects: its cache under the agent's data dir, files at data_dir/lazy.
    d = LazyDaemon(
        data_dir=stack.data_dir, mount=stack.data_dir / "lazy", nats_url=nats_server.url,
        args=["--fault-delay", "0.05", "--fetch-concurrency", "1"],
    )
    d.start()
    try:
        async with stack.sandbox(template=name) as sb:
            r = await sb.commands.run("cat /opt/tool/run.sh >/dev/null && sh /opt/tool/run.sh && sha256sum /work/f0.bin")
            assert r.stdout.splitlines() == ["toolkit ok", f"{hashlib.sha256(work['work/f0.bin']).hexdigest()}  /work/f0.bin"]
            ws = next(lay for lay in layers if lay.role == "workspace")
            fetched = d.index()[ws.digest]["fetched_bytes"]
            assert 0 < fetched < ws.size  # only what was read came over
            # The three layers are EROFS mounts of the loader's files, one per layer on this host.
            mi = Path("/proc/self/mountinfo").read_text()
            for lay in layers:
                assert str(stack.data_dir / "layers" / lay.digest.split(":", 1)[1]) in mi

            # Kill the loader while the sandbox reads data nobody fetched yet.
            want = {rel: hashlib.sha256(data).hexdigest() for rel, data in work.items() if rel != "work/f0.bin"}
            reading = asyncio.create_task(sb.commands.run("sha256sum /work/f1.bin /work/f2.bin /work/f3.bin /work/f4.bin /work/f5.bin", timeout=120))
            await eventually(lambda: d.index().get(ws.digest, {}).get("fetched_bytes", 0) >= fetched + MiB // 2, timeout=30, what="the read under way")
            d.stop(signal.SIGKILL)
            assert not reading.done()
            d.args = []
            d.start()
            assert d.info()["taken_over"] is True
            r = await asyncio.wait_for(reading, 120)
            got = {line.split()[1].lstrip("/"): line.split()[0] for line in r.stdout.splitlines()}
            assert got == want
            assert (await sb.commands.run("sh /opt/tool/run.sh")).stdout == "toolkit ok\n"
    finally:
        # The template's layer mounts would outlive the connection: take them down with the loader.
        for lay in layers:
            hexd = lay.digest.split(":", 1)[1]
            if stack.backend.layers.forget(hexd):
                subprocess.run(["umount", str(stack.data_dir / "layers" / hexd)], check=False)
        d.release()
