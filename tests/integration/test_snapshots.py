"""Snapshots, fork and pause/resume on the real stack: the upper dir's diff packed by the host's real lazy
loader into EROFS layers in the real blob store (NATS object store), restored by stacking those layers.

A snapshot's record is in KV ``dsec_snapshots``; its provenance events in ``DSEC_EVT``.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from bus import codec
from bus import subjects as S
from bus.messages import LayerRef, SnapshotEvent, TemplateManifest
from bus.streams import ensure_kv
from sdk import AsyncSandbox
from sdk.errors import DsecError, InvalidArgument
from tests.conftest import eventually
from tests.imaged.conftest import LazyDaemon, needs_fuse

from .conftest import Stack, needs_stack

pytestmark = [pytest.mark.containerd, needs_stack, needs_fuse]

# A listing of every entry under the given dirs: kind, mode, owner, size, links, mtime, content hash or
# link target (a directory's size and link count are the file system's own business: not compared).
TREE = r"""
cd / && for f in $(find {dirs} | sort); do
  if [ -d "$f" ] && [ ! -L "$f" ]; then t=$(stat -c '%F|%a|%u:%g|%Y' "$f"); else t=$(stat -c '%F|%a|%u:%g|%s|%h|%Y' "$f"); fi
  if [ -L "$f" ]; then x=$(readlink "$f"); elif [ -f "$f" ]; then x=$(md5sum < "$f" | cut -c1-32); else x=-; fi
  echo "$f|$t|$x"
done
"""


def tree(dirs: str = "/root/data /workspace") -> str:
    return TREE.replace("{dirs}", dirs)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def lazy(stack: Stack, nats_server: Any) -> AsyncIterator[LazyDaemon]:
    """The stack host's lazy loader (it packs the snapshots' layers)."""
    d = LazyDaemon(data_dir=stack.data_dir, mount=stack.data_dir / "lazy", nats_url=nats_server.url, host_id=stack.host_id)
    d.start()
    try:
        yield d
    finally:
        d.release()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def tmpl(stack: Stack) -> AsyncIterator[str]:
    """A template with a workspace layer: busybox plus /workspace files a sandbox may delete or replace."""
    name = f"snapt-{stack.uid}"
    ws = stack.data_dir / f"ws-{name}"
    (ws / "workspace" / "keep").mkdir(parents=True)
    (ws / "workspace" / "lib").mkdir(parents=True)
    (ws / "workspace" / "keep" / "a.txt").write_text("template a\n")
    (ws / "workspace" / "lib" / "old.py").write_text("print('old')\n")
    (ws / "workspace" / "gone.txt").write_text("delete me\n")
    kv = await ensure_kv(stack.js, S.KV_IMAGES)
    m = TemplateManifest(name=name, created_at=time.time(), layers=[
        LayerRef(role="base", digest="sha256:" + "0" * 64, kind="dir", path=str(stack.rootfs)),
        LayerRef(role="workspace", digest="sha256:" + "1" * 64, kind="dir", path=str(ws)),
    ])
    await kv.put(name, codec.encode(m))
    try:
        yield name
    finally:
        await kv.delete(name)


@contextlib.asynccontextmanager
async def many(stack: Stack, sbs: list[AsyncSandbox]) -> AsyncIterator[list[AsyncSandbox]]:
    """Kill ``sbs`` at the end and check each left nothing behind."""
    pids = {sb.sandbox_id: stack.pid_of(sb.sandbox_id) for sb in sbs}
    try:
        yield sbs
    finally:
        await asyncio.gather(*(sb.kill() for sb in sbs), return_exceptions=True)
        for sb in sbs:
            await stack.assert_gone(sb.sandbox_id, pids[sb.sandbox_id])


async def snapshot_events(stack: Stack, snapshot_id: str) -> list[SnapshotEvent]:
    out: list[SnapshotEvent] = []
    sub = await stack.js.subscribe(S.evt_snapshot(snapshot_id, "*"), ordered_consumer=True)
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=0.5)
            except Exception:  # noqa: BLE001 - nats.errors.TimeoutError: no more
                break
            out.append(codec.EVENT.decode(msg.data))
    finally:
        await sub.unsubscribe()
    return out


WRITE_1 = r"""
set -e
mkdir -p /root/data/sub/deep /root/data/dir2 /root/data/empty
echo 'some text' > /root/data/t.txt
head -c 300000 /dev/urandom > /root/data/bin.dat
echo 'remove me' > /root/data/del.txt
echo 'rename me' > /root/data/old.txt
echo x > /root/data/dir2/x
echo deep > /root/data/sub/deep/f
ln -s /root/data/t.txt /root/data/link
ln /root/data/bin.dat /root/data/bin.hard
chmod 4751 /root/data/t.txt
chmod 700 /root/data/sub
chown 1234:567 /root/data/sub/deep/f
rm /workspace/gone.txt
rm -rf /workspace/lib && mkdir /workspace/lib && echo new > /workspace/lib/new.py
echo changed >> /workspace/keep/a.txt
"""

WRITE_2 = r"""
set -e
rm /root/data/del.txt
mv /root/data/old.txt /root/data/renamed.txt
rm -rf /root/data/dir2 && mkdir /root/data/dir2 && echo y > /root/data/dir2/y
ln /root/data/t.txt /root/data/t.hard
printf 'grown' >> /root/data/bin.dat
chmod 600 /root/data/bin.hard
mkfifo /root/data/fifo
touch -d '2001-02-03 04:05:06' /root/data/sub/deep/f
"""


async def test_snapshot_fork_8_same_tree_then_diverge(stack: Stack, lazy: LazyDaemon, tmpl: str) -> None:
    async with stack.sandbox(template=tmpl) as sb:
        await sb.commands.run(WRITE_1)
        s1 = await sb.create_snapshot("first", metadata={"step": "1"})
        assert s1.parent_id == "" and s1.layers == 1 and s1.bytes_added > 300000 and s1.template == tmpl and s1.sandbox_id == sb.sandbox_id
        await sb.commands.run(WRITE_2)
        want = (await sb.commands.run(tree())).stdout
        assert "/root/data/renamed.txt|" in want and "/root/data/del.txt|" not in want and "/workspace/gone.txt" not in want
        assert "/workspace/lib/old.py" not in want and "/workspace/lib/new.py|" in want and "fifo" in want
        forks = await sb.fork(8, **stack.kw())
        async with many(stack, forks):
            assert len(forks) == 8 and len({f.sandbox_id for f in forks}) == 8
            snaps = await AsyncSandbox.list_snapshots(nats_url=stack.url, sandbox_id=sb.sandbox_id)
            s2 = next(s for s in snaps if s.snapshot_id != s1.snapshot_id)
            assert s2.parent_id == s1.snapshot_id and s2.layers == 2
            assert s2.bytes_added < s1.bytes_added  # only what changed since the first (the grown file)
            for f in forks:
                assert (await f.commands.run(tree())).stdout == want
            # Each fork diverges on its own; the source sees none of it.
            await asyncio.gather(*(f.commands.run(f"echo fork{i} > /root/data/t.txt && rm /root/data/renamed.txt") for i, f in enumerate(forks)))
            for i, f in enumerate(forks):
                assert await f.files.read("/root/data/t.txt") == f"fork{i}\n"
                assert not await f.files.exists("/root/data/renamed.txt")
            assert (await sb.commands.run(tree())).stdout == want
            assert await sb.files.read("/root/data/t.txt") == "some text\n"
        evs = await snapshot_events(stack, s2.snapshot_id)
        kinds = [e.kind for e in evs]
        assert "created" in kinds and "forked" in kinds and kinds.count("restored") == 8
        forked = next(e for e in evs if e.kind == "forked")
        assert forked.sandbox_id == sb.sandbox_id and forked.parent_id == s1.snapshot_id and forked.detail["count"] == "8"
        created = next(e for e in (await snapshot_events(stack, s1.snapshot_id)) if e.kind == "created")
        assert created.metadata == {"step": "1"} and created.sandbox_id == sb.sandbox_id


async def test_bad_input(stack: Stack, lazy: LazyDaemon) -> None:
    with pytest.raises(DsecError) as ei:
        await AsyncSandbox.create(snapshot="snap-does-not-exist", **stack.kw())
    assert ei.value.code == "unknown_snapshot"
    async with stack.sandbox() as sb:
        with pytest.raises(InvalidArgument):
            await sb.fork(101, **stack.kw())
        await sb.pause()
        with pytest.raises(DsecError) as ei:
            await sb.create_snapshot()
        assert ei.value.code == "not_running"
        with pytest.raises(DsecError) as ei:
            await sb.commands.run("true")
        assert ei.value.code == "not_running"
        await sb.resume()
        assert (await sb.commands.run("echo back")).stdout == "back\n"
