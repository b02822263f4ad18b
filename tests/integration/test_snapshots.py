"""Snapshots, fork and pause/resume on the real stack: the upper dir's diff packed by the host's real lazy
loader into EROFS layers in the real blob store (NATS object store), restored by stacking those layers.

A snapshot's record is in KV ``dsec_snapshots``; its provenance events in ``DSEC_EVT``.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
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
async def tmpl(stack: Stack) -> AsyncIterator[str]:
    """A template with a workspace layer: busybox plus /workspace files a sandbox may delete or replace."""
    name = f"snapt-{stack.uid}-{uuid.uuid4().hex[:6]}"  # one per module that uses it (test_fork imports it)
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


async def test_a_fork_counts_against_its_tenants_quota(stack: Stack, lazy: LazyDaemon) -> None:
    """A fork is a batched create of the source's tenant: over its quota it fails with the typed
    error (the members that fitted are killed again), within it the fork runs and holds its place."""
    from bus.auth import with_credentials
    from bus.messages import TenantLimits
    from sdk.errors import QuotaExceeded

    tenant = f"cli-fork{stack.uid}"
    kw = stack.kw(nats_url=with_credentials(stack.url, tenant, "x"))  # no authorization here: the user name is the tenant
    kv = await ensure_kv(stack.js, S.KV_TENANTS)
    await kv.put(tenant, codec.encode(TenantLimits(max_sandboxes=2)))
    await eventually(lambda: all(tenant in p.quotas.limits for p in stack.placements), what="placement sees the quota")
    sb = await AsyncSandbox.create(**kw)
    made = [sb]
    try:
        await sb.files.write("/root/mark", "forked")
        with pytest.raises(QuotaExceeded) as ei:
            await sb.fork(2, **kw)
        assert ei.value.code == "quota_exceeded" and ei.value.description == f"tenant {tenant} holds 2 of max 2 sandboxes"
        (child,) = await sb.fork(1, **kw)
        made.append(child)
        assert await child.files.read("/root/mark") == "forked"
        with pytest.raises(QuotaExceeded) as ei:
            await AsyncSandbox.create(**kw)
        assert ei.value.description == f"tenant {tenant} holds 2 of max 2 sandboxes"
    finally:
        for x in made:
            with contextlib.suppress(DsecError):
                await x.kill()
        await kv.delete(tenant)


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


async def test_chain_of_20_snapshots_restores_exactly(stack: Stack, lazy: LazyDaemon, tmpl: str) -> None:
    """Each step deletes and adds files; a sandbox restored from the last snapshot sits on all 20 layers
    (each from the previous restore, so every layer holds one step) and sees exactly the source's tree."""
    async with stack.sandbox(template=tmpl) as sb:
        await sb.commands.run("mkdir -p /root/data && echo 0 > /root/data/f0")
        snaps = []
        cur = sb
        restored: list[AsyncSandbox] = []
        try:
            for i in range(1, 21):
                # Half the steps on the same sandbox (diffs against its own last snapshot), half on a restore.
                await cur.commands.run(
                    f"rm -f /root/data/f{i - 1} && echo {i} > /root/data/f{i} && echo {i} >> /root/data/log"
                    f" && rm -rf /workspace/keep/d{i - 1} && mkdir -p /workspace/keep/d{i}"
                )
                want = (await cur.commands.run(tree())).stdout
                s = await cur.create_snapshot(metadata={"step": str(i)})
                assert s.layers == i
                snaps.append(s)
                if i % 2 == 0:
                    nxt = await AsyncSandbox.create(snapshot=s.snapshot_id, **stack.kw())
                    restored.append(nxt)
                    assert (await nxt.commands.run(tree())).stdout == want
                    cur = nxt
            last = await AsyncSandbox.create(snapshot=snaps[-1].snapshot_id, **stack.kw())
            restored.append(last)
            got = (await last.commands.run(tree())).stdout
            assert got == want
            assert "/root/data/f20|" in got and "/root/data/f19|" not in got and "/workspace/keep/d20|" in got and "/workspace/keep/d19|" not in got
            assert (await last.files.read("/root/data/log")).split() == [str(i) for i in range(1, 21)]
            assert [s.parent_id for s in snaps[1:]] == [s.snapshot_id for s in snaps[:-1]]
        finally:
            async with many(stack, restored):
                pass


async def test_pause_resume_three_times_files_exact(stack: Stack, lazy: LazyDaemon, tmpl: str) -> None:
    async with stack.sandbox(template=tmpl) as sb:
        for cycle in range(3):
            await sb.commands.run(f"mkdir -p /root/data && echo {cycle} > /root/data/c{cycle} && rm -f /root/data/c{cycle - 1}"
                                  f" && echo {cycle} >> /root/data/all")
            want = (await sb.commands.run(tree())).stdout
            await sb.pause()
            info = await sb.get_info()
            assert info.state == "paused"
            rec = await _record(stack, sb.sandbox_id)
            assert rec.state == "paused" and rec.host_id == stack.host_id
            back = await AsyncSandbox.connect(sb.sandbox_id, nats_url=stack.url)  # connect resumes it
            assert (await back.get_info()).state == "running"
            assert (await sb.commands.run(tree())).stdout == want


async def test_persisted_pause_resume_three_times(stack: Stack, lazy: LazyDaemon, tmpl: str) -> None:
    """persist=True frees the host (the sandbox is gone from it) and keeps the files in a snapshot; resume
    starts the same sandbox id again from it, three times over, each time exact."""
    sb = await AsyncSandbox.create(template=tmpl, **stack.kw(sandbox_id=stack.new_id("pp")))
    try:
        for cycle in range(3):
            await sb.commands.run(f"mkdir -p /root/data && echo {cycle} > /root/data/c{cycle} && rm -f /root/data/c{cycle - 1}"
                                  f" && echo {cycle} >> /root/data/all")
            want = (await sb.commands.run(tree())).stdout
            pid = stack.pid_of(sb.sandbox_id)
            info = await sb.pause(persist=True)
            assert info is not None and info.sandbox_id == sb.sandbox_id
            await stack.assert_gone(sb.sandbox_id, pid)  # the host holds nothing of it
            rec = await _record(stack, sb.sandbox_id)
            assert rec.state == "paused" and rec.snapshot_id == info.snapshot_id and rec.host_id == ""
            with pytest.raises(DsecError) as ei:
                await _raise_in_use(stack, info.snapshot_id)
            assert ei.value.code == "snapshot_in_use"
            if cycle % 2:
                await sb.resume()
            else:
                sb = await AsyncSandbox.connect(sb.sandbox_id, nats_url=stack.url)
            assert (await sb.commands.run(tree())).stdout == want
            assert (await _record(stack, sb.sandbox_id)).state == "running"
    finally:
        await sb.kill()


async def _raise_in_use(stack: Stack, snapshot_id: str) -> None:
    """What the snapshot rule says for a paused sandbox's snapshot (checked without the image service:
    the same function it runs)."""
    from imaged._snapshots import remove_snapshot
    from imaged._store import open_blob_store

    await remove_snapshot(stack.js, open_blob_store(stack.js), snapshot_id)


async def _record(stack: Stack, sid: str) -> Any:
    kv = await ensure_kv(stack.js, S.KV_SANDBOXES)
    return codec.SANDBOX_RECORD.decode((await kv.get(sid)).value)


async def test_snapshot_while_a_command_runs(stack: Stack, lazy: LazyDaemon) -> None:
    """A writer keeps appending numbered lines; the snapshot holds a prefix of them, whole lines only
    (frozen between writes), and the writer carries on afterwards."""
    async with stack.sandbox() as sb:
        await sb.commands.run("mkdir -p /root/data; (i=0; while true; do i=$((i+1)); echo line-$i >> /root/data/w; done) >/dev/null 2>&1 &")
        await eventually(lambda: _lines(sb, 200), timeout=20, what="the writer to get going")
        s = await sb.create_snapshot()
        async with many(stack, [await AsyncSandbox.create(snapshot=s.snapshot_id, **stack.kw())]) as (r,):
            snap_lines = (await r.files.read("/root/data/w")).splitlines()
            assert len(snap_lines) >= 200 and snap_lines == [f"line-{i}" for i in range(1, len(snap_lines) + 1)]
            await eventually(lambda: _lines(sb, len(snap_lines) + 500), timeout=20, what="the writer to carry on")
            await asyncio.sleep(0.2)  # the restored sandbox has no writer: its file must not grow
            assert (await r.files.read("/root/data/w")).splitlines() == snap_lines


async def _lines(sb: AsyncSandbox, n: int) -> bool:
    out = (await sb.commands.run("wc -l < /root/data/w 2>/dev/null || echo 0")).stdout.strip()
    return int(out or 0) >= n


async def test_blob_store_failure_fails_whole_and_sandbox_runs_on(stack: Stack, lazy: LazyDaemon, nats_server: Any) -> None:
    """The loader's blob store refuses the chunks (a bucket too small for them): the snapshot fails with a
    typed error, no record appears, the sandbox is not left frozen, and the next snapshot (store back)
    holds everything the failed one would have."""
    from nats.js.api import ObjectStoreConfig

    bucket = f"snapfail-{stack.uid}"
    await stack.js.create_object_store(bucket, config=ObjectStoreConfig(max_bytes=64 * 1024))
    async with stack.sandbox() as sb:
        await sb.commands.run("mkdir -p /root/data && head -c 2000000 /dev/urandom > /root/data/big && echo hi > /root/data/small")
        lazy.stop()
        bad = LazyDaemon(data_dir=stack.data_dir, mount=stack.data_dir / "lazy", nats_url=nats_server.url, host_id=stack.host_id,
                         args=["--blob-store", f"nats-obj://{bucket}"])
        bad.start()
        try:
            before = {s.snapshot_id for s in await AsyncSandbox.list_snapshots(nats_url=stack.url, sandbox_id=sb.sandbox_id)}
            with pytest.raises(DsecError) as ei:
                await sb.create_snapshot()
            assert ei.value.code == "no_space" and "maximum bytes" in ei.value.description.lower(), ei.value
            after = {s.snapshot_id for s in await AsyncSandbox.list_snapshots(nats_url=stack.url, sandbox_id=sb.sandbox_id)}
            assert after == before == set()
            assert (await sb.commands.run("echo alive")).stdout == "alive\n"  # not frozen
        finally:
            bad.stop()
            lazy.start()
        s = await sb.create_snapshot()
        async with many(stack, [await AsyncSandbox.create(snapshot=s.snapshot_id, **stack.kw())]) as (r,):
            assert (await r.commands.run("md5sum < /root/data/big")).stdout == (await sb.commands.run("md5sum < /root/data/big")).stdout
            assert await r.files.read("/root/data/small") == "hi\n"
    await stack.js.delete_object_store(bucket)


async def test_restore_on_a_second_host_and_across_an_agent_restart(stack: Stack, lazy: LazyDaemon, nats_server: Any) -> None:
    """A second host (its own data dir, containerd, host id and lazy loader; it shares only NATS) restores
    a snapshot of the stack host's sandbox, fetching only what it reads; its own snapshot survives a
    restart of its agent, and the stack host restores that one."""
    import hashlib
    import os
    import signal
    import tempfile

    from .conftest import PY, Child, answers_again, data_dir_leftovers, force_cleanup, subprocess_env
    from .test_recovery import _host_ready_since

    uid = stack.new_id("h2")
    host_b, pool_b = uid, uid
    data_b = Path(tempfile.mkdtemp(prefix="dsec-snap2-", dir="/tmp"))
    argv = [PY, "-m", "hostagent", "--data-dir", str(data_b), "--host-id", host_b, "--pool", pool_b, "--concurrency", "4", "--warm-pool", "0"]
    env = subprocess_env(stack.url)
    log = data_b.parent / f"{data_b.name}.log"
    lazy_b = LazyDaemon(data_dir=data_b, mount=data_b / "lazy", nats_url=nats_server.url, host_id=host_b)
    agents: list[Child] = []
    sbs: list[AsyncSandbox] = []
    big = os.urandom(4 << 20)
    try:
        lazy_b.start()
        t0 = time.time()
        agents.append(Child(argv, env, log).start())
        async with stack.sandbox() as src:
            await src.commands.run("mkdir -p /root/data && echo small > /root/data/small")
            await src.files.write("/root/data/big", big)
            s1 = await src.create_snapshot()
        await eventually(lambda: _host_ready_since(stack, host_b, t0), timeout=90, interval=0.1, what="the second host agent")
        await eventually(lambda: all(host_b in p.table.hosts for p in stack.placements), timeout=15, what="placement to see it")

        rb = await AsyncSandbox.create(snapshot=s1.snapshot_id, **stack.kw(pool=pool_b, memory_mb=64))
        sbs.append(rb)
        assert rb.host_id == host_b
        assert await rb.files.read("/root/data/small") == "small\n"
        rec = await get_snapshot_record(stack, s1.snapshot_id)
        layer = rec.layers[-1]
        fetched_now = lambda: lazy_b.index().get(layer.digest, {}).get("fetched_bytes", 0)  # noqa: E731
        await eventually(lambda: fetched_now() > 0, timeout=10, what="the loader's index to show the read")  # rewritten at most 5x/s
        fetched = fetched_now()
        assert 0 < fetched < layer.size // 2, (fetched, layer.size)  # the big file was not read: not fetched
        assert (await rb.commands.run("sha256sum /root/data/big")).stdout.split()[0] == hashlib.sha256(big).hexdigest()
        await eventually(lambda: fetched_now() >= len(big), timeout=10, what="the big file's chunks in the index")

        await rb.commands.run("echo from-b > /root/data/b && rm /root/data/small")
        s2 = await rb.create_snapshot()
        assert s2.parent_id == s1.snapshot_id and s2.host_id == host_b

        # A paused sandbox there too: it must stay paused across the restart (not be taken for dead).
        pb = await AsyncSandbox.create(**stack.kw(pool=pool_b, memory_mb=48))
        sbs.append(pb)
        await pb.commands.run("echo kept > /root/kept")
        await pb.pause()

        # The agent restarts (its sandboxes live on); the sandbox still snapshots on top of s2.
        assert await agents[0].stop(timeout=60) == 0, agents[0].log()
        t1 = time.time()
        agents.append(Child(argv, env, log).start())
        await eventually(lambda: _host_ready_since(stack, host_b, t1), timeout=90, interval=0.1, what="the restarted agent")

        await answers_again(rb, DsecError, timeout=30, interval=0.1, what="the sandbox to answer again")
        assert (await pb.get_info()).state == "paused"
        with pytest.raises(DsecError) as ei:
            await pb.commands.run("true")
        assert ei.value.code == "not_running"
        await pb.resume()
        assert await pb.files.read("/root/kept") == "kept\n"
        await pb.kill()
        await rb.commands.run("echo again > /root/data/c")
        s3 = await rb.create_snapshot()
        assert s3.parent_id == s2.snapshot_id and s3.layers == 3
        want = (await rb.commands.run(tree("/root/data"))).stdout
        async with many(stack, [await AsyncSandbox.create(snapshot=s3.snapshot_id, **stack.kw())]) as (ra,):
            assert ra.host_id == stack.host_id
            assert (await ra.commands.run(tree("/root/data"))).stdout == want
        await rb.kill()
        sbs.clear()
        assert await agents[1].stop(timeout=60) == 0, agents[1].log()
    finally:
        for sb in sbs:
            with contextlib.suppress(Exception):
                await sb.kill()
        for a in agents:
            if a.alive():
                a.signal(signal.SIGKILL)
                await a.wait(10)
        lazy_b.release()
        if data_dir_leftovers(data_b):
            await force_cleanup(data_b)
        if not data_dir_leftovers(data_b):
            shutil.rmtree(data_b, ignore_errors=True)
            log.unlink(missing_ok=True)


async def get_snapshot_record(stack: Stack, snapshot_id: str) -> Any:
    kv = await ensure_kv(stack.js, S.KV_SNAPSHOTS)
    return codec.SNAPSHOT.decode((await kv.get(snapshot_id)).value)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def nolandlock(stack: Stack) -> AsyncIterator[str]:
    """A profile without Landlock: CRIU can checkpoint only such sandboxes (the default profile's memory
    snapshot is refused with snapshot_unsupported, see test_memory_snapshot_refused_under_landlock)."""
    import msgspec

    from bus.profiles import default_profile

    name = f"nolandlock-{stack.uid}"
    p = default_profile()
    prof = msgspec.structs.replace(p, name=name, fs=msgspec.structs.replace(p.fs, landlock=False, required=False))
    kv = await ensure_kv(stack.js, S.KV_PROFILES)
    await kv.put(name, codec.encode(prof))
    await eventually(lambda: name in stack.host.profiles.profiles, timeout=10, what="the host agent to see the profile")
    try:
        yield name
    finally:
        await kv.delete(name)


# Background processes in sessions of their own (setsid): CRIU 4.1.1 cannot restore a path-bound unix
# socket (the agent's) next to a process group whose leader is gone (criu#2687, fixed after 4.1.1).
COUNTER = (
    "mkdir -p /tmp/www && echo hello-from-httpd > /tmp/www/x && setsid httpd -p 8080 -h /tmp/www && "
    "setsid sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.05; done' >/dev/null 2>&1 &"
)


async def _count(sb: AsyncSandbox, timeout: float = 10.0) -> int:
    """The counter's value. The shell truncates the file, then writes it: an empty read falls between
    the two, so read again (polled, with a deadline) until it holds a number."""
    deadline = time.monotonic() + timeout
    while True:
        s = (await sb.files.read("/tmp/count")).strip()
        if s or time.monotonic() > deadline:
            return int(s or 0)
        await asyncio.sleep(0.01)  # poll interval


async def test_memory_snapshot_counter_keeps_counting_in_every_fork(stack: Stack, lazy: LazyDaemon, nolandlock: str) -> None:
    async with stack.sandbox(profile=nolandlock) as sb:
        await sb.commands.run(COUNTER)
        await eventually(lambda: _gt(sb, 20), timeout=20, what="the counter to run")
        before = await _count(sb)
        s = await sb.create_snapshot(memory=True, metadata={"step": "7"})
        assert s.memory
        forks = await sb.fork(2, **stack.kw(profile=nolandlock), memory=True)
        async with many(stack, forks):
            for f in forks:
                # (frozen between the shell's truncate and its write, the file may be empty: the next write fills it)
                await eventually(lambda f=f: _gt(f, 0), timeout=10, what="the restored counter's next write")
                first = await _count(f)
                assert first >= before  # not a fresh counter: it carries on from the dump's count
                await eventually(lambda f=f, n=first: _gt(f, n + 10), timeout=20, what="the restored counter to keep counting")
                r = await f.commands.run("wget -qO- http://127.0.0.1:8080/x")
                assert r.stdout == "hello-from-httpd\n"  # the listening server came back too
                ps = (await f.commands.run("ps -o args")).stdout
                assert "httpd -p 8080" in ps
            n = await _count(sb)
            await eventually(lambda: _gt(sb, n + 10), timeout=20, what="the source to keep counting")


async def _gt(sb: AsyncSandbox, n: int) -> bool:
    try:
        return await _count(sb) > n
    except (DsecError, ValueError):
        return False


async def test_memory_snapshot_refused_under_landlock(stack: Stack, lazy: LazyDaemon) -> None:
    async with stack.sandbox() as sb:
        with pytest.raises(DsecError) as ei:
            await sb.create_snapshot(memory=True)
        assert ei.value.code == "snapshot_unsupported" and "Landlock" in ei.value.description
        assert (await sb.commands.run("echo still")).stdout == "still\n"
        assert await AsyncSandbox.list_snapshots(nats_url=stack.url, sandbox_id=sb.sandbox_id) == []


async def test_memory_restore_criu_cannot_do_fails_typed_and_leaves_nothing(stack: Stack, lazy: LazyDaemon, nolandlock: str) -> None:
    """A background job whose process-group leader is gone (``sh -c 'job &'``): CRIU 4.1.1 dumps it but
    cannot restore it next to the agent's socket. The restore fails with a typed error naming CRIU's
    reason, leaves nothing on the host, and the source runs on."""
    async with stack.sandbox(profile=nolandlock) as sb:
        await sb.commands.run("(while true; do echo x > /tmp/beat; sleep 0.05; done) >/dev/null 2>&1 &")
        s = await sb.create_snapshot(memory=True)
        sid = stack.new_id("rf")
        with pytest.raises(DsecError) as ei:
            await AsyncSandbox.create(snapshot=s.snapshot_id, **stack.kw(sandbox_id=sid, profile=nolandlock, create_timeout=60))
        assert ei.value.code == "create_failed" and "CRIU could not restore" in ei.value.description, ei.value
        await stack.assert_gone(sid)
        assert (await sb.commands.run("echo alive")).stdout == "alive\n"


PY_ROOT_CACHE = "/var/tmp/dsec-snap-py"  # the debootstrap rootfs is built once and kept (about a minute)

PY_SERVER = r"""
import http.server, os, threading, time
state = {"n": 0, "secret": os.urandom(8).hex()}
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = f"{state['secret']} {state['n']}".encode()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
srv = http.server.HTTPServer(("127.0.0.1", 8000), H)
threading.Thread(target=srv.serve_forever, daemon=True).start()
open("/tmp/secret", "w").write(state["secret"])
while True:
    state["n"] += 1
    time.sleep(0.02)
"""
ASK = "python3 -c \"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8000').read().decode())\""


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def python_tmpl(stack: Stack) -> AsyncIterator[str]:
    from imaged._debootstrap import python_rootfs

    root = await python_rootfs(PY_ROOT_CACHE)
    name = f"snappy-{stack.uid}"
    kv = await ensure_kv(stack.js, S.KV_IMAGES)
    await kv.put(name, codec.encode(TemplateManifest(name=name, created_at=time.time(), layers=[
        LayerRef(role="base", digest="sha256:" + "3" * 64, kind="dir", path=str(root))])))
    try:
        yield name
    finally:
        await kv.delete(name)


async def _ask(sb: AsyncSandbox) -> tuple[str, int]:
    secret, n = (await sb.commands.run(ASK)).stdout.split()
    return secret, int(n)


async def test_python_process_and_its_server_come_back_in_every_fork(stack: Stack, lazy: LazyDaemon, nolandlock: str, python_tmpl: str) -> None:
    """A Python process holds a random secret and a counter in memory and serves them on a port; after a
    memory snapshot every fork answers on that port with the same secret (memory, not a re-run) and a
    counter that went on from where it was."""
    async with stack.sandbox(template=python_tmpl, profile=nolandlock, memory_mb=256) as sb:
        await sb.files.write("/tmp/srv.py", PY_SERVER)
        await sb.commands.run("setsid python3 /tmp/srv.py >/dev/null 2>&1 &")
        await eventually(lambda: sb.files.exists("/tmp/secret"), timeout=30, what="the server to start")
        secret, before = await _ask(sb)
        s = await sb.create_snapshot(memory=True)
        forks = await sb.fork(2, **stack.kw(profile=nolandlock, memory_mb=256), memory=True)
        async with many(stack, forks):
            for f in forks:
                got, n = await _ask(f)
                assert got == secret and n > 0
                await asyncio.sleep(0.3)
                assert (await _ask(f))[1] > n  # still counting
                assert n >= before  # the count went on from the snapshot's, not from zero
        assert (await _ask(sb))[0] == secret
        assert s.memory


async def _cli(stack: Stack, *args: str) -> tuple[int, str, str]:
    import sys

    from .conftest import REPO, subprocess_env

    p = await asyncio.create_subprocess_exec(sys.executable, "-m", "sdk.cli", "--nats-url", stack.url, "snapshot", *args, cwd=str(REPO),
                                             env=subprocess_env(stack.url), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await p.communicate()
    return p.returncode or 0, out.decode(), err.decode()


async def test_cli_ls_info_rm_keeps_parents_and_collects_chunks(stack: Stack, lazy: LazyDaemon) -> None:
    import json

    from imaged._service import ImagedService
    from imaged._store import chunk_key, open_blob_store

    svc = ImagedService(stack.url, data_dir=stack.data_dir / "imaged", ensure_base=False)
    await svc.start()
    store = open_blob_store(stack.js)
    try:
        async with stack.sandbox() as sb:
            await sb.commands.run("mkdir -p /root/d && head -c 300000 /dev/urandom > /root/d/a")
            s1 = await sb.create_snapshot("one")
            await sb.commands.run("head -c 300000 /dev/urandom > /root/d/b")
            s2 = await sb.create_snapshot("two")
        rec1, rec2 = await get_snapshot_record(stack, s1.snapshot_id), await get_snapshot_record(stack, s2.snapshot_id)
        own1 = set(rec1.layers[-1].chunks)
        own2 = set(rec2.layers[-1].chunks) - own1
        assert own2 and all([await store.exists(chunk_key(c)) for c in own1 | own2])

        rc, out, _ = await _cli(stack, "ls", "--sandbox", sb.sandbox_id, "--json")
        assert rc == 0 and {i["snapshot_id"] for i in json.loads(out)} == {s1.snapshot_id, s2.snapshot_id}
        rc, out, _ = await _cli(stack, "info", s2.snapshot_id, "--json")
        assert rc == 0 and json.loads(out)["parent_id"] == s1.snapshot_id and json.loads(out)["name"] == "two"
        rc, _, err = await _cli(stack, "rm", s1.snapshot_id)
        assert rc == 1 and "snapshot_in_use" in err  # s2 builds on it
        rc, _, err = await _cli(stack, "info", "snap-nope")
        assert rc == 1 and "unknown_snapshot" in err

        rc, out, err = await _cli(stack, "rm", s2.snapshot_id)
        assert rc == 0, err
        assert not any([await store.exists(chunk_key(c)) for c in own2])  # only s2 had them
        assert all([await store.exists(chunk_key(c)) for c in own1])  # s1 still needs its own
        rc, out, err = await _cli(stack, "rm", s1.snapshot_id)
        assert rc == 0, err
        assert not any([await store.exists(chunk_key(c)) for c in own1])
        rc, out, _ = await _cli(stack, "ls", "--sandbox", sb.sandbox_id, "--json")
        assert rc == 0 and json.loads(out) == []
        removed = [e.kind for e in await snapshot_events(stack, s2.snapshot_id)]
        assert "removed" in removed
    finally:
        await svc.shutdown()


async def test_persisted_pause_with_memory_counter_keeps_counting(stack: Stack, lazy: LazyDaemon, nolandlock: str) -> None:
    sb = await AsyncSandbox.create(**stack.kw(sandbox_id=stack.new_id("pm"), profile=nolandlock))
    try:
        await sb.commands.run(COUNTER)
        await eventually(lambda: _gt(sb, 20), timeout=20, what="the counter to run")
        pid = stack.pid_of(sb.sandbox_id)
        info = await sb.pause(persist=True, memory=True)
        assert info is not None and info.memory
        await stack.assert_gone(sb.sandbox_id, pid)
        sb = await AsyncSandbox.connect(sb.sandbox_id, nats_url=stack.url)
        await eventually(lambda: _gt(sb, 0), timeout=10, what="the restored counter's next write")
        first = await _count(sb)
        assert first > 20
        await eventually(lambda: _gt(sb, first + 10), timeout=20, what="the counter to carry on after the resume")
        assert (await sb.commands.run("wget -qO- http://127.0.0.1:8080/x")).stdout == "hello-from-httpd\n"
    finally:
        await sb.kill()
