"""What a sandbox makes the host store, on the real stack (containerd sandboxes, the real lazy loader
packing into the real NATS object store): sparse and repetitive files snapshot cheaply and come back
with their holes; quotas refuse a snapshot before it writes; a full data dir fails typed and heals;
gc reclaims what nothing references, even racing a snapshot that reuses a chunk."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from bus import codec
from bus import subjects as S
from bus.streams import ensure_kv
from sdk import AsyncSandbox
from tests.imaged.conftest import LazyDaemon, needs_fuse

from .conftest import Stack, needs_stack
from .test_snapshots import lazy, many  # noqa: F401 - the stack host's lazy loader fixture

pytestmark = [pytest.mark.containerd, needs_stack, needs_fuse]
GiB, TiB = 1 << 30, 1 << 40


def disk_bytes(root: Path, *skip: str) -> int:
    """Bytes the files under ``root`` occupy on disk (blocks, not sizes), but under ``skip`` dirs."""
    total = 0
    for dp, dns, fns in os.walk(root):
        dns[:] = [d for d in dns if os.path.join(dp, d) not in skip]
        for n in fns:
            try:
                total += os.lstat(os.path.join(dp, n)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


async def _record(stack: Stack, snapshot_id: str) -> Any:
    kv = await ensure_kv(stack.js, S.KV_SNAPSHOTS)
    return codec.SNAPSHOT.decode((await kv.get(snapshot_id)).value)


async def test_sparse_8g_and_1t_snapshot_fork_restore_with_holes(stack: Stack, lazy: LazyDaemon) -> None:  # noqa: F811
    images = stack.data_dir / "images"
    async with stack.sandbox() as sb:
        r = await sb.commands.run(f"truncate -s {8 * GiB} /root/s8g && truncate -s {TiB} /root/s1t")
        assert r.exit_code == 0, r.stderr
        host_before = disk_bytes(images)
        t0 = time.perf_counter()
        s = await sb.create_snapshot("sparse")
        took = time.perf_counter() - t0
        host_added = disk_bytes(images) - host_before
        rec = await _record(stack, s.snapshot_id)
        layer = rec.layers[-1]
        print(f"sparse 8 GiB + 1 TiB: snapshot {took:.3f}s, layer {layer.size} bytes, uploaded {s.bytes_added}, host +{host_added} bytes")
        # Before: 70 s and 8 GiB of the host's disk for the 8 GiB file alone.
        assert layer.size < 64 * 1024 and s.bytes_added < 64 * 1024 and host_added < 1024 * 1024
        assert took < 10, took  # the freeze, the pack and the round trips on a busy 2-core host
        forks = await sb.fork(2, **stack.kw())
        restored = await AsyncSandbox.create(snapshot=s.snapshot_id, **stack.kw())
        async with many(stack, [*forks, restored]):
            for other in [*forks, restored]:
                out = (await other.commands.run("stat -c '%s %n' /root/s8g /root/s1t")).stdout.split("\n")
                assert out[:2] == [f"{8 * GiB} /root/s8g", f"{TiB} /root/s1t"]
                # Reads are zeros from the lower layer's holes ...
                z = await other.commands.run("dd if=/root/s1t bs=4096 skip=$((1<<27)) count=1 2>/dev/null | od -An -c | head -2")
                assert z.stdout.split() == ["\\0"] * 16 + ["*"]
                # ... and a write copies the file up into the sandbox's own upper dir, holes and all: the
                # sandbox's 1 GiB disk quota would refuse an expanded copy of either file.
                w = await other.commands.run("echo tail >> /root/s8g && echo tail >> /root/s1t && stat -c '%s %b' /root/s8g /root/s1t")
                assert w.exit_code == 0, w.stderr
                (s8, b8), (s1, b1) = (map(int, line.split()) for line in w.stdout.split("\n")[:2])
                assert (s8, s1) == (8 * GiB + 5, TiB + 5) and b8 <= 64 and b1 <= 64
                assert (await other.commands.run("tail -c 5 /root/s1t")).stdout == "tail\n"


async def test_repeated_blocks_snapshot_stores_one_block(stack: Stack, lazy: LazyDaemon) -> None:  # noqa: F811
    async with stack.sandbox() as sb:
        r = await sb.commands.run(
            "head -c 4096 /dev/urandom > /root/blk && for i in $(seq 1 8); do cat /root/blk /root/blk /root/blk /root/blk; done > /root/x32"
            " && for i in $(seq 1 64); do cat /root/x32; done > /root/rep && rm /root/x32 && md5sum /root/rep | cut -c1-32"
        )
        assert r.exit_code == 0, r.stderr
        s = await sb.create_snapshot("repeated")
        layer = (await _record(stack, s.snapshot_id)).layers[-1]
        assert layer.size < 64 * 1024, layer.size  # 8 MiB of one 4 KiB block (plus that block on its own)
        async with many(stack, [await AsyncSandbox.create(snapshot=s.snapshot_id, **stack.kw())]) as (back,):
            assert (await back.commands.run("md5sum /root/rep | cut -c1-32")).stdout == r.stdout
