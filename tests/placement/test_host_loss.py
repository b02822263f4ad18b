"""A host that disappears (issue 23, item 3): real nats-server, real placement replicas and host agents
(simulated backend) as child processes; a host agent is killed with ``kill -9`` and never beats again.

Within the grace period (``--host-down``) the host is marked down, every live record on it becomes
``lost`` with exactly one ``lost`` event however many replicas sweep, a persisted pause stays resumable,
and new creates land on the hosts still alive; a host that comes back on the same id resurrects nothing.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from pathlib import Path

from bus import codec
from bus import subjects as S
from bus.messages import CreateSandbox, SandboxRecord, SandboxSpec, SnapshotRecord
from bus.runtime import KV
from bus.streams import ensure_kv

from .conftest import eventually, hosts_up, ready_counts, records_of, spawn, stop_process, stored_events
from .test_failures import kill9

GRACE_S = 3.0

def sim_host(url: str, prefix: str, data: Path, log: Path):
    return spawn(["-m", "hostagent", "--backend", "sim", "--host-id", prefix, "--data-dir", str(data)], url, log, level="INFO")

def replica(url: str, rid: str, log: Path):
    return spawn(["-m", "placement", "--replica-id", rid, "--ack-wait", "2", "--host-down", str(GRACE_S)], url, log)

async def create(js, ids: list[str], **kw) -> None:
    now = time.time()
    for sid in ids:
        spec = SandboxSpec(sandbox_id=sid, requested_at=now, backend="sim", **kw)
        await js.publish(S.REQ_CREATE, codec.encode(CreateSandbox(spec=spec)), headers={S.HDR_MSG_ID: sid})

async def host_events(js, host_id: str) -> list[str]:
    """Kinds of the host events of ``host_id`` in DSEC_EVT."""
    sub = await js.subscribe(S.evt_host(host_id, "*"), ordered_consumer=True)
    out = []
    try:
        while True:
            try:
                m = await sub.next_msg(timeout=1)
            except Exception:  # noqa: BLE001 - nothing more
                break
            out.append(codec.EVENT.decode(m.data).kind)
    finally:
        await sub.unsubscribe()
    return out

async def test_a_silent_host_is_marked_down_and_its_sandboxes_lost_once(nats_srv, nc, tmp_path) -> None:
    url, js = nats_srv.url, nc.jetstream()
    since = time.time()
    a, b = f"a{uuid.uuid4().hex[:6]}", f"b{uuid.uuid4().hex[:6]}"
    hosts = {a: sim_host(url, a, tmp_path / "a", tmp_path / "a.log"), b: sim_host(url, b, tmp_path / "b", tmp_path / "b.log")}
    procs = [replica(url, f"r{i}", tmp_path / f"p{i}.log") for i in range(2)]
    try:
        await eventually(lambda: hosts_up(js, [f"{a}-0", f"{b}-0"], since), timeout=30, what="both hosts heartbeating")
        ids = [f"hl-{uuid.uuid4().hex[:8]}-{i}" for i in range(40)]
        await create(js, ids)
        await eventually(lambda: _all_running(js, ids), timeout=60, what="40 sandboxes running")
        await stored_events(js, ids)  # and announced (a record is stored before its ready event leaves)
        recs = await records_of(js, ids)
        on_a = sorted(sid for sid, r in recs.items() if r is not None and r.host_id == f"{a}-0")
        on_b = sorted(sid for sid, r in recs.items() if r is not None and r.host_id == f"{b}-0")
        assert on_a and on_b, "spread over both hosts"
        # One of host a's sandboxes was paused with persist (its state is in a snapshot): it stays resumable.
        kv: KV[SandboxRecord] = await KV.bind(js, S.KV_SANDBOXES, codec.SANDBOX_RECORD)
        paused_id = on_a.pop()
        rec = await kv.get(paused_id)
        assert rec is not None
        rec.state, rec.snapshot_id = "paused", "snap-x"
        await kv.put(paused_id, rec)

        kill9(hosts[a])
        t_kill = time.time()
        await eventually(lambda: _states(js, on_a, {"lost"}), timeout=GRACE_S + 30, what="host a's sandboxes lost")
        took = time.time() - t_kill
        # Marked within the grace period plus the sweep's period (grace/4) and the load's slack.
        assert took < GRACE_S + 20, took

        kv_hosts = await ensure_kv(js, S.KV_HOSTS)
        st = codec.HOST_STATUS.decode((await kv_hosts.get(f"{a}-0")).value)
        assert st.state == "down"
        assert (await host_events(js, f"{a}-0")).count("down") == 1  # two replicas, one mark
        lost = await ready_counts(js, ("lost",))
        assert {sid: len(lost.get(sid, [])) for sid in on_a} == dict.fromkeys(on_a, 1)
        assert all(ev.host_id == f"{a}-0" and ev.code == "host_unreachable" for sid in on_a for ev in lost[sid])
        # Untouched: host b's sandboxes and the persisted pause.
        assert await _states(js, on_b, {"running"})
        assert (await kv.get(paused_id)).state == "paused"  # type: ignore[union-attr]
        assert paused_id not in lost

        # New creates go to the host still alive.
        more = [f"hm-{uuid.uuid4().hex[:8]}-{i}" for i in range(10)]
        await create(js, more)
        await eventually(lambda: _all_running(js, more), timeout=60, what="creates after the loss")
        assert {r.host_id for r in (await records_of(js, more)).values() if r} == {f"{b}-0"}

        # Host a comes back on the same id: nothing of it is resurrected, nothing announced twice.
        since = time.time()
        hosts[a] = sim_host(url, a, tmp_path / "a", tmp_path / "a2.log")
        await eventually(lambda: hosts_up(js, [f"{a}-0"], since), timeout=30, what="host a back")
        await eventually(lambda: _ready_since(kv_hosts, f"{a}-0", since), timeout=30, what="host a ready again")
        assert await _states(js, on_a, {"lost"})
        lost = await ready_counts(js, ("lost",))
        assert {sid: len(lost.get(sid, [])) for sid in on_a} == dict.fromkeys(on_a, 1)
        ready = await ready_counts(js, ("ready",))
        assert Counter(len(ready.get(sid, [])) for sid in on_a) == Counter({1: len(on_a)})
    finally:
        for p in [*procs, *hosts.values()]:
            stop_process(p)

async def test_a_lost_sandbox_that_asked_is_restored_elsewhere_from_its_latest_snapshot(nats_srv, nc, tmp_path) -> None:
    url, js = nats_srv.url, nc.jetstream()
    since = time.time()
    a, b = f"a{uuid.uuid4().hex[:6]}", f"b{uuid.uuid4().hex[:6]}"
    hosts = {a: sim_host(url, a, tmp_path / "a", tmp_path / "a.log")}
    procs = [replica(url, "r0", tmp_path / "p0.log")]
    try:
        await eventually(lambda: hosts_up(js, [f"{a}-0"], since), timeout=30, what="host a heartbeating")
        keep, plain = f"rs-{uuid.uuid4().hex[:8]}", f"pl-{uuid.uuid4().hex[:8]}"
        await create(js, [keep], restore_on_host_loss=True)
        await create(js, [plain])
        await eventually(lambda: _all_running(js, [keep, plain]), timeout=60, what="both running on host a")
        snaps: KV[SnapshotRecord] = await KV.open(js, S.KV_SNAPSHOTS, codec.SNAPSHOT)
        for sid_, at in (("snap-old", 1.0), ("snap-new", 2.0)):
            await snaps.put(f"{sid_}-{keep}", SnapshotRecord(snapshot_id=f"{sid_}-{keep}", sandbox_id=keep, template="base", created_at=at))
        hosts[b] = sim_host(url, b, tmp_path / "b", tmp_path / "b.log")
        await eventually(lambda: hosts_up(js, [f"{b}-0"], since), timeout=30, what="host b heartbeating")
        kill9(hosts[a])
        kv: KV[SandboxRecord] = await KV.bind(js, S.KV_SANDBOXES, codec.SANDBOX_RECORD)

        async def restored() -> bool:
            r = await kv.get(keep)
            return r is not None and r.state == "running" and r.host_id == f"{b}-0"

        await eventually(restored, timeout=GRACE_S + 60, what="the sandbox restored on host b")
        rec = await kv.get(keep)
        assert rec is not None and rec.spec.snapshot == f"snap-new-{keep}" and rec.spec.generation == 1
        assert await _states(js, [plain], {"lost"})  # did not ask: stays lost
        lost = await ready_counts(js, ("lost",))
        assert len(lost[keep]) == 1 and lost[keep][0].detail == {"restore": "asked"}
        assert len(lost[plain]) == 1
    finally:
        for p in [*procs, *hosts.values()]:
            stop_process(p)

async def _states(js, ids: list[str], states: set[str]) -> bool:
    recs = await records_of(js, ids)
    return all(r is not None and r.state in states for r in recs.values())

async def _all_running(js, ids: list[str]) -> bool:
    return await _states(js, ids, {"running"})

async def _ready_since(kv_hosts, host_id: str, since: float) -> bool:
    st = codec.HOST_STATUS.decode((await kv_hosts.get(host_id)).value)
    return st.state == "ready" and st.at >= since
