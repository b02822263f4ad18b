"""A sandbox's life converges: kills are durable intents, drift is reconciled both ways.

Each test runs its own host agent (own data dir, private containerd, own placement pool) beside the
session's stack, so what it leaves (or not) is its own: records in KV, containers, agent processes,
mounts, cgroups, netns and loop devices of that data dir.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import tempfile
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from bus import codec
from bus import subjects as S
from bus.messages import SandboxEvent
from bus.streams import ensure_kv
from sdk import AsyncSandbox, KillPending
from tests.conftest import eventually
from tests.netclaim import claim_net

from .conftest import Stack, cgroups_of, data_dir_leftovers, force_cleanup, loop_devices_backed_by, mounts_mentioning, needs_stack

pytestmark = [pytest.mark.containerd, needs_stack]



def proc_id(pid: int) -> tuple[int, int] | None:
    """(pid, start time) of a live, non-zombie process: pids are reused on a busy machine."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else (pid, int(fields[19]))


@dataclass
class Host:
    agent: Any  # hostagent.HostAgent
    backend: Any  # hostagent.backends.container.ContainerBackend
    data: Path
    pool: str
    stack: Stack

    def kw(self, **kw: Any) -> dict[str, Any]:
        return self.stack.kw(pool=self.pool, **kw)

    async def record(self, sid: str) -> Any:
        kv = await ensure_kv(self.stack.js, S.KV_SANDBOXES)
        return codec.SANDBOX_RECORD.decode((await kv.get(sid)).value)

    async def states(self, sids: list[str]) -> dict[str, str]:
        kv = await ensure_kv(self.stack.js, S.KV_SANDBOXES)
        sem = asyncio.Semaphore(64)

        async def one(sid: str) -> str:
            async with sem:
                return codec.SANDBOX_RECORD.decode((await kv.get(sid)).value).state

        return dict(zip(sids, await asyncio.gather(*(one(s) for s in sids)), strict=True))

    async def leftovers(self, sids: list[str], cids: list[str], procs: list[tuple[int, int] | None]) -> list[str]:
        """What of these sandboxes is still on the host: one scan for all of them."""
        left = [f"container {c.id}" for c in await self.backend.rt.list()]
        wanted = set(cids)
        with open("/proc/self/mountinfo") as f:
            left += [f"mount {mp}" for mp in (ln.split()[4] for ln in f) if set(mp.split("/")) & wanted]
        left += [f"cgroup {p}" for p in Path("/sys/fs/cgroup").glob("*/dsec/*") if p.name in wanted]
        left += [f"loop {d}" for d in loop_devices_backed_by(str(self.data))]
        left += [f"netns {sid}" for sid in sids if os.path.lexists(self.backend.net.netns_path(sid))]
        left += [f"agent process {p[0]}" for p in procs if p is not None and proc_id(p[0]) == p]
        left += [f"state file {p.name}" for p in (self.data / "hosts" / self.agent.host_id / "sandboxes").glob("*")]
        left += [f"live {sid}" for sid in self.agent.live]
        return left


@pytest_asyncio.fixture(loop_scope="session")
async def host(stack: Stack) -> AsyncIterator[Host]:
    from hostagent import HostAgent, HostAgentConfig
    from hostagent.backends.container import ContainerBackend

    uid = f"lc-{uuid.uuid4().hex[:8]}"
    data = Path(tempfile.mkdtemp(prefix="dsec-lc-", dir="/tmp"))
    net = await asyncio.to_thread(claim_net)  # network names of its own: not the default ones other stacks share
    backend = ContainerBackend(str(data), scratch_size_gb=None, warm_pool=0, network=net.config())
    agent = HostAgent(backend, HostAgentConfig(
        nats_url=stack.url, host_id=uid, data_dir=str(data), pool=uid, concurrency=16, heartbeat_s=1.0,
        destroy_on_shutdown=True, grace_s=30.0, reconcile_s=1.0, kill_wait_s=3.0,
    ))
    try:
        await agent.start()
        await eventually(lambda: all(uid in p.table.hosts for p in stack.placements), timeout=15, what="placement to see the host")
        yield Host(agent, backend, data, uid, stack)
    finally:
        await agent.shutdown()
        with contextlib.suppress(Exception):
            await (await ensure_kv(stack.js, S.KV_HOSTS)).delete(uid)
        left = data_dir_leftovers(data)
        if left:
            await force_cleanup(data)
        await net.purge()
        net.release()
        if not mounts_mentioning(str(data)):
            shutil.rmtree(data, ignore_errors=True)
        assert not left, f"left under {data} after the host agent stopped: {left}"


class Events:
    """Sandbox events of this test's ids, from a core subscription (the stream captures them too)."""

    def __init__(self) -> None:
        self.seen: list[SandboxEvent] = []
        self.sub: Any = None

    async def start(self, nc: Any) -> "Events":
        async def on(msg: Any) -> None:
            self.seen.append(codec.EVENT.decode(msg.data))

        self.sub = await nc.subscribe(S.EVT_SANDBOX_ALL, cb=on)
        return self

    def of(self, sid: str, kind: str) -> list[SandboxEvent]:
        return [e for e in self.seen if isinstance(e, SandboxEvent) and e.sandbox_id == sid and e.kind == kind]

    async def stop(self) -> None:
        await self.sub.unsubscribe()


# ------------------------------------------------------------------------------ a burst of kills
async def _create_then_kill_all(host: Host, n: int) -> None:
    sbs = await AsyncSandbox.create_batch(n, **host.kw(cpu=0.02, memory_mb=16, disk_mb=32, create_timeout=1200))
    assert len(sbs) == n and {sb.host_id for sb in sbs} == {host.agent.host_id}
    sids = [sb.sandbox_id for sb in sbs]
    cids = [host.agent.handles[s].extra.get("cid", s) for s in sids]
    procs = [proc_id(host.agent.handles[s].pid) for s in sids]
    assert all(procs), "every sandbox's agent runs"
    running = {i.sandbox_id for i in await AsyncSandbox.list(nats_url=host.stack.url)}
    assert set(sids) <= running

    results = await asyncio.gather(*(sb.kill() for sb in sbs), return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    assert not failed, f"{len(failed)} of {n} kills failed, first: {failed[0]!r}"

    states = await host.states(sids)
    assert set(states.values()) == {"gone"}, {s: v for s, v in states.items() if v != "gone"}
    assert not set(sids) & {i.sandbox_id for i in await AsyncSandbox.list(nats_url=host.stack.url)}
    left: list[str] = []

    async def clean() -> bool:
        nonlocal left
        left = await host.leftovers(sids, cids, procs)
        return not left

    try:
        await eventually(clean, timeout=30, interval=0.5, what="nothing left of the sandboxes")
    except AssertionError:
        raise AssertionError(f"left behind after {n} kills: {len(left)} items, first: {left[:10]}") from None


async def test_1000_sandboxes_killed_at_once_leave_nothing(host: Host) -> None:
    await _create_then_kill_all(host, 1000)


# ------------------------------------------------------------------------------------- drift
async def test_container_removed_behind_the_agents_back_becomes_lost(host: Host) -> None:
    from hostagent.backends.container.containerd import ContainerRuntime

    ev = await Events().start(host.stack.nc)
    rt = ContainerRuntime(host.backend.rt.address, runc_root=str(host.data / "containerd" / "state" / "runc"))
    try:
        sb = await AsyncSandbox.create(**host.kw(memory_mb=32, disk_mb=32, create_timeout=60))
        sid = sb.sandbox_id
        cid = host.agent.handles[sid].extra.get("cid", sid)
        proc = proc_id(host.agent.handles[sid].pid)
        assert proc is not None and (await host.record(sid)).state == "running"

        await rt.delete(cid)  # straight through containerd: the host agent is not told
        assert proc_id(proc[0]) != proc
        period = host.agent.reconciler.period_s
        await eventually(lambda: ev.of(sid, "lost"), timeout=period * 2 + 10, what="the lost event")
        rec = await host.record(sid)
        assert rec.state == "lost" and rec.end_reason == "its container is gone", rec
        assert ev.of(sid, "lost")[0].code == "internal" and not ev.of(sid, "killed")
        assert sid not in host.agent.live
        assert not await host.leftovers([sid], [cid], [proc])
        assert sid not in {i.sandbox_id for i in await AsyncSandbox.list(nats_url=host.stack.url)}
        await sb.kill()  # killing a lost sandbox is fine
    finally:
        await ev.stop()
        await rt.close()


async def test_container_without_record_is_removed(host: Host) -> None:
    from hostagent.backends.container.containerd import ContainerRuntime, ContainerSpec

    @dataclass
    class Bind:
        type: str
        source: str
        options: list[str]

    rt = ContainerRuntime(host.backend.rt.address, runc_root=str(host.data / "containerd" / "state" / "runc"))
    cid = f"orphan-{uuid.uuid4().hex[:8]}"
    try:
        pid = await rt.create_and_start(ContainerSpec(
            cid, rootfs_mounts=[Bind("bind", str(host.stack.rootfs), ["rbind", "ro"])], args=["/bin/sleep", "1000"], env={},
            cpu=0.1, memory_mb=32, pids_max=16, labels={"dsec.sandbox": f"sb-{cid}"},
        ))
        proc = proc_id(pid)
        assert proc is not None and cgroups_of(cid)
        period = host.agent.reconciler.period_s

        async def removed() -> bool:
            return not await rt.exists(cid)

        await eventually(removed, timeout=period * 2 + 10, what="the orphan container to be removed")
        await eventually(lambda: proc_id(pid) != proc and not cgroups_of(cid), timeout=10, what="its process and cgroups to go")
        assert not mounts_mentioning(cid)
    finally:
        with contextlib.suppress(Exception):
            await rt.delete(cid)
        await rt.close()


# ------------------------------------------------------------------------------ a stalled containerd
async def test_kill_while_containerd_is_stalled_is_pending_then_completes(host: Host) -> None:
    sb = await AsyncSandbox.create(**host.kw(memory_mb=32, disk_mb=32, create_timeout=60))
    sid = sb.sandbox_id
    cid = host.agent.handles[sid].extra.get("cid", sid)
    proc = proc_id(host.agent.handles[sid].pid)
    containerd = host.backend.daemon.pid
    assert containerd and proc_id(containerd)
    os.kill(containerd, signal.SIGSTOP)
    try:
        with pytest.raises(KillPending):
            await sb.kill(timeout=1.0)  # the host waits kill_wait_s, then says the kill goes on
        assert sid in host.agent.live and host.agent.live[sid].state == "stopping"
        assert (await host.record(sid)).state == "stopping"
        assert sid not in {i.sandbox_id for i in await AsyncSandbox.list(nats_url=host.stack.url)}
        await asyncio.sleep(3.0)  # containerd stays stopped a while longer (the stall under test, not a sync)
    finally:
        os.kill(containerd, signal.SIGCONT)
    await sb.kill()  # waits for the intent to finish
    rec = await host.record(sid)
    assert rec.state == "gone" and rec.end_reason == "user", rec
    await eventually(lambda: sid not in host.agent.live, timeout=10, what="the sandbox to leave the live table")
    assert not await host.leftovers([sid], [cid], [proc])
