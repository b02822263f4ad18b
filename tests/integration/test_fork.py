"""Fork at clone speed (hostagent._forks): children on the source's host stack a copy of its frozen
upper dir, made while it was frozen, before anything is packed; the pack follows in the background.
Real containerd, real overlay mounts, the host's real lazy loader packing into the NATS object store."""

from __future__ import annotations

import asyncio
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import msgspec
import pytest

from bus import codec
from bus import subjects as S
from bus.streams import ensure_kv
from sdk import AsyncSandbox
from sdk.errors import DsecError
from tests.conftest import eventually
from tests.imaged.conftest import LazyDaemon, needs_fuse

from .conftest import Stack, needs_stack
from .test_snapshots import WRITE_1, _record, get_snapshot_record, many, snapshot_events, tmpl, tree  # noqa: F401 - tmpl is a fixture

pytestmark = [pytest.mark.containerd, needs_stack, needs_fuse]

# After the fork the source changes a file of its upper dir in place (the same inode the fork's
# staged hard link had), deletes one, adds one: none of it may reach a child.
SOURCE_AFTER = "echo more >> /root/data/t.txt && printf x >> /root/data/bin.dat && rm /root/data/link && echo late > /root/data/late"


def fork_dirs(stack: Stack) -> list[str]:
    d = Path(stack.data_dir) / "forks"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


async def fork_created(stack: Stack, source_id: str) -> Any:
    """The ``created`` event of the source's newest snapshot (the fork's)."""
    snaps = await AsyncSandbox.list_snapshots(nats_url=stack.url, sandbox_id=source_id)
    newest = max(snaps, key=lambda s: s.created_at)
    return newest, next(e for e in await snapshot_events(stack, newest.snapshot_id) if e.kind == "created")


async def packed(stack: Stack, snapshot_id: str) -> bool:
    rec = await get_snapshot_record(stack, snapshot_id)
    return bool(rec.layers) and all(lay.kind == "erofs" for lay in rec.layers)


async def test_fork_children_see_the_frozen_state_and_diverge_alone(stack: Stack, lazy: LazyDaemon, tmpl: str) -> None:  # noqa: F811
    async with stack.sandbox(template=tmpl) as sb:
        await sb.commands.run(WRITE_1)  # contents, modes (setuid), owner, a symlink, a hard link, a deleted and a replaced template dir
        want = (await sb.commands.run(tree())).stdout
        assert "/root/data/link|symbolic link|" in want and "/workspace/gone.txt" not in want and "|4751|" in want
        forks = await sb.fork(4, **stack.kw())
        async with many(stack, forks):
            snap, created = await fork_created(stack, sb.sandbox_id)
            assert created.detail["local"] == "true"  # the children started over the frozen copy, not a packed layer
            await sb.commands.run(SOURCE_AFTER)
            for f in forks:
                assert (await f.commands.run(tree())).stdout == want
            await asyncio.gather(*(f.commands.run(f"echo child{i} > /root/data/t.txt && rm /root/data/bin.hard") for i, f in enumerate(forks)))
            for i, f in enumerate(forks):
                assert await f.files.read("/root/data/t.txt") == f"child{i}\n"
                assert not await f.files.exists("/root/data/bin.hard")
                assert not await f.files.exists("/root/data/late")
            assert await sb.files.read("/root/data/t.txt") == "some text\nmore\n"
            assert await sb.files.exists("/root/data/bin.hard") and not await sb.files.exists("/root/data/link")
            # In the background the layer is packed and the record names it: a later restore takes that one.
            await eventually(lambda: packed(stack, snap.snapshot_id), timeout=120, interval=0.2, what="the fork's layer packed")
            assert snap.snapshot_id in fork_dirs(stack)  # the children still stack the copy
            async with many(stack, [await AsyncSandbox.create(snapshot=snap.snapshot_id, **stack.kw())]) as (r,):
                assert (await r.commands.run(tree())).stdout == want
        await eventually(lambda: snap.snapshot_id not in fork_dirs(stack), timeout=30, what="the fork's copy removed")


async def test_fork_children_keep_the_source_allowlist_unless_told_otherwise(stack: Stack, lazy: LazyDaemon) -> None:
    """A source with an egress allowlist forks children with the same one (their records and their
    hosts' network attachments say so); a child given ``network=None`` has none (the control)."""
    net = {"allow_out": ["192.0.2.7/32", "192.0.2.8:443"]}
    async with stack.sandbox(network=net) as sb:
        assert stack.backend.net.attachment(sb.sandbox_id) is not None
        kept = await sb.fork(2, **stack.kw())
        (none,) = await sb.fork(1, network=None, **stack.kw())
        async with many(stack, [*kept, none]):
            for f in kept:
                rec = await _record(stack, f.sandbox_id)
                assert rec.spec.network is not None and rec.spec.network.allow_out == net["allow_out"]
                assert stack.backend.net.attachment(f.sandbox_id) is not None
            rec = await _record(stack, none.sandbox_id)
            assert rec.spec.network is None and stack.backend.net.attachment(none.sandbox_id) is None


async def test_fork_of_a_frozen_pause_leaves_it_paused(stack: Stack, lazy: LazyDaemon) -> None:
    async with stack.sandbox() as sb:
        await sb.commands.run("mkdir -p /root/p && echo paused-state > /root/p/f && chmod 640 /root/p/f && ln -s f /root/p/l")
        await sb.pause()
        forks = await sb.fork(3, **stack.kw())
        async with many(stack, forks):
            assert (await sb.get_info()).state == "paused"
            with pytest.raises(DsecError) as ei:
                await sb.commands.run("true")
            assert ei.value.code == "not_running"
            for f in forks:
                assert (await f.commands.run("cat /root/p/f; stat -c %a /root/p/f; readlink /root/p/l")).stdout == "paused-state\n640\nf\n"
            await forks[0].commands.run("echo mine > /root/p/f")
            assert await forks[1].files.read("/root/p/f") == "paused-state\n"
        # Positive control: the same source, resumed, runs (and kept its own state).
        await sb.resume()
        assert await sb.files.read("/root/p/f") == "paused-state\n"


async def test_fork_of_a_pause_on_disk_leaves_it_paused(stack: Stack, lazy: LazyDaemon) -> None:
    sb = await AsyncSandbox.create(**stack.kw())
    try:
        await sb.commands.run("mkdir -p /root/q && echo on-disk > /root/q/f")
        await sb.pause(persist=True)
        forks = await sb.fork(2, **stack.kw())
        async with many(stack, forks):
            for f in forks:
                assert await f.files.read("/root/q/f") == "on-disk\n"
            rec = await _record(stack, sb.sandbox_id)
            assert rec.state == "paused" and rec.snapshot_id and rec.host_id == ""  # not resumed anywhere
    finally:
        await sb.kill()


async def test_source_killed_while_children_run(stack: Stack, lazy: LazyDaemon) -> None:
    sb = await AsyncSandbox.create(**stack.kw())
    pid = stack.pid_of(sb.sandbox_id)
    try:
        await sb.commands.run("mkdir -p /root/k && echo kept > /root/k/f && echo gone > /root/k/g")
        await sb.create_snapshot()  # g is in a packed layer now: the fork's copy holds its whiteout
        await sb.commands.run("rm /root/k/g")
        forks = await sb.fork(2, **stack.kw())
    finally:
        await sb.kill()
    await stack.assert_gone(sb.sandbox_id, pid)
    snap, _ = await fork_created(stack, sb.sandbox_id)
    async with many(stack, forks):
        if snap.snapshot_id not in fork_dirs(stack):  # else the children hold the copy, not the source
            # (a small diff's pack can land before the children read the record: they start over the packed layer)
            assert not [lay for lay in (await get_snapshot_record(stack, snap.snapshot_id)).layers if lay.role == "fork"]
        for f in forks:
            assert await f.files.read("/root/k/f") == "kept\n"
            assert not await f.files.exists("/root/k/g")
            await f.commands.run("echo more >> /root/k/f")
            assert await f.files.read("/root/k/f") == "kept\nmore\n"
    await eventually(lambda: snap.snapshot_id not in fork_dirs(stack), timeout=150, what="the copy removed once packed and unused")


async def test_a_child_away_from_the_source_waits_for_the_pack(stack: Stack, lazy: LazyDaemon) -> None:
    """A fork's record that names another host's frozen copy (what a host other than the source's
    sees until the pack is in): a create from it waits, then starts over the packed layer."""
    async with stack.sandbox() as sb:
        await sb.commands.run("mkdir -p /root/w && echo away > /root/w/f")
        s = await sb.create_snapshot()
    rec = await get_snapshot_record(stack, s.snapshot_id)
    elsewhere = msgspec.structs.replace(rec.layers[-1], role="fork", kind="dir", path=f"/nonexistent-{uuid.uuid4().hex[:8]}/forks/x", chunks=[])
    sid = f"snap-away-{uuid.uuid4().hex[:12]}"
    kv = await ensure_kv(stack.js, S.KV_SNAPSHOTS)
    rev = await kv.create(sid, codec.encode(msgspec.structs.replace(rec, snapshot_id=sid, layers=[*rec.layers[:-1], elsewhere])))
    create = asyncio.ensure_future(AsyncSandbox.create(snapshot=sid, **stack.kw(create_timeout=120)))
    try:
        done, _ = await asyncio.wait({create}, timeout=2.0)
        assert not done, "started over a frozen copy that is not on this host"
        await kv.update(sid, codec.encode(msgspec.structs.replace(rec, snapshot_id=sid)), last=rev)  # the other host's pack is in
        r = await asyncio.wait_for(create, 60)
        async with many(stack, [r]):
            assert await r.files.read("/root/w/f") == "away\n"
    finally:
        if not create.done():
            create.cancel()
        await kv.purge(sid)


async def test_nothing_left_behind(stack: Stack, lazy: LazyDaemon) -> None:
    """Forks of forks (a child forked before its parent's copy was packed), all killed: no copy, no
    mount under the data dir, nothing in any record names a copy once packed."""
    sb = await AsyncSandbox.create(**stack.kw())
    try:
        await sb.commands.run("echo g0 > /root/g")
        (c,) = await sb.fork(1, **stack.kw())
        await c.commands.run("echo g1 > /root/g")
        (gc,) = await c.fork(1, **stack.kw())
        assert await gc.files.read("/root/g") == "g1\n"
        snap, _ = await fork_created(stack, c.sandbox_id)
        await eventually(lambda: packed(stack, snap.snapshot_id), timeout=120, interval=0.2, what="the grandchild's chain packed")
        await asyncio.gather(c.kill(), gc.kill())
    finally:
        await sb.kill()
    await eventually(lambda: fork_dirs(stack) == [], timeout=60, what="every fork copy removed")
    with open("/proc/self/mountinfo") as f:
        assert not [ln for ln in f if f"{stack.data_dir}/forks" in ln]
    assert not os.path.exists(Path(stack.data_dir) / "forks" / f"{snap.snapshot_id}.part")



async def test_a_restarted_agent_packs_what_it_left_and_removes_the_rest(stack: Stack, lazy: LazyDaemon) -> None:
    """What a host agent that stopped mid-pack leaves: a fork's copy its record still names (packed
    now, then removed: nothing stacks it), a copy of a removed snapshot and a half-made copy (removed)."""
    forks = stack.host.snapshots.forks
    async with stack.sandbox() as sb:
        await sb.commands.run("mkdir -p /root/r && echo left > /root/r/f")
        s = await sb.create_snapshot()
    rec = await get_snapshot_record(stack, s.snapshot_id)
    sid = f"snap-left-{uuid.uuid4().hex[:12]}"
    stage = Path(stack.data_dir) / f"stage-{sid}"
    (stage / "root" / "r").mkdir(parents=True)
    (stage / "root" / "r" / "f").write_text("left\n")
    ref = forks.freeze_copy(str(stage), sid)
    kv = await ensure_kv(stack.js, S.KV_SNAPSHOTS)
    await kv.create(sid, codec.encode(msgspec.structs.replace(rec, snapshot_id=sid, layers=[*rec.layers[:-1], ref])))
    orphan = Path(forks.path(f"snap-gone-{uuid.uuid4().hex[:12]}"))
    orphan.mkdir()
    half = Path(forks.path(sid + "x") + ".part")
    half.mkdir()
    try:
        await forks.recover()
        assert not half.exists() and not orphan.exists()
        await eventually(lambda: packed(stack, sid), timeout=120, interval=0.2, what="the left copy packed")
        await eventually(lambda: sid not in fork_dirs(stack), timeout=30, what="the left copy removed")
        async with many(stack, [await AsyncSandbox.create(snapshot=sid, **stack.kw())]) as (r,):
            assert await r.files.read("/root/r/f") == "left\n"
    finally:
        await kv.purge(sid)
        shutil.rmtree(stage, ignore_errors=True)
