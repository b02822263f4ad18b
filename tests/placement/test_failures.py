"""The failure cases of the create path's shortcuts (issue 11), each shown to lose and duplicate nothing.

Real nats-server, the real host-agent code on the simulated backend and real placement replicas, as
child processes where one must die with ``kill -9``. "Exactly once" is checked three ways: one ``ready``
event per id in DSEC_EVT (on one host), one record per id in KV ``dsec_sandboxes`` naming that host,
and one ``sandbox_ready`` log line per id from the host agents (a sandbox created twice logs it twice).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
import uuid
from collections import Counter
from pathlib import Path

import msgspec
import nats.js.errors
import pytest

from bus import codec
from bus import subjects as S
from bus.messages import CreateBatch, CreateSandbox, PlaceSandbox, SandboxSpec
from bus.natsd import NatsServer
from bus.runtime import connect
from sdk import AsyncSandbox, build_spec

from .conftest import eventually, hosts_up, listen_ready, log_lines, ready_counts, records_of, seed, spawn, stop_process, stored_events

DEDUP_WINDOW_S = 120.0  # bus.streams.StreamOptions().dedup_window_s: what every service here runs with


def sim_hosts(url: str, n: int, data: Path, log: Path) -> subprocess.Popen:
    """``n`` simulated hosts ``sim-0`` .. in one process; INFO, so every created sandbox logs ``sandbox_ready``."""
    return spawn(["-m", "hostagent", "--backend", "sim", "--sim-hosts", str(n), "--data-dir", str(data)], url, log, level="INFO")


def replica(url: str, rid: str, log: Path) -> subprocess.Popen:
    return spawn(["-m", "placement", "--replica-id", rid, "--ack-wait", "2", "--capacity", "64"], url, log)


def kill9(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGKILL)
    p.wait()


async def up(js, hosts: int, replicas: int, since: float) -> None:
    """Every host ``sim-<i>`` heartbeated since ``since`` and every replica pulling."""
    async def ready() -> bool:
        try:
            ci = await js.consumer_info(S.STREAM_REQ, S.PLACEMENT_DURABLE)
            return await hosts_up(js, [f"sim-{i}" for i in range(hosts)], since) and ci.num_waiting >= replicas
        except Exception:  # noqa: BLE001 - not made yet
            return False

    await eventually(ready, timeout=30, what=f"{hosts} hosts and {replicas} replicas up")


async def publish_singles(js, ids: list[str]) -> None:
    """Single creates as the SDK stores them (Nats-Msg-Id = the id), every store acked."""
    futs = []
    for sid in ids:
        spec = build_spec("base", backend="sim", sandbox_id=sid)
        futs.append(await js.publish_async(S.REQ_CREATE, codec.encode(CreateSandbox(spec=spec)), headers={S.HDR_MSG_ID: sid}))
    await asyncio.wait_for(asyncio.gather(*futs), 30)


async def publish_batches(js, ids: list[str], size: int) -> None:
    """Batch creates as ``sdk._async._send_creates`` stores them: CreateBatch messages of ``size`` specs."""
    bid = f"batch-{uuid.uuid4().hex[:12]}"
    futs = []
    for n, i in enumerate(range(0, len(ids), size)):
        specs = [build_spec("base", backend="sim", sandbox_id=sid) for sid in ids[i:i + size]]
        for s in specs:
            s.batch_id = bid
        data = codec.encode(CreateBatch(batch_id=f"{bid}-{n}", specs=specs))
        futs.append(await js.publish_async(S.REQ_CREATE_BATCH, data, headers={S.HDR_MSG_ID: f"{bid}-{n}"}))
    await asyncio.wait_for(asyncio.gather(*futs), 30)


def created(*logs: Path) -> Counter[str]:
    """How many times each id was created (its record stored and ``ready`` announced), over host logs."""
    return Counter(d["sandbox_id"] for log in logs for d in log_lines(log, "sandbox_ready"))


async def assert_exactly_once(js, ids: list[str], from_record: set[str] | None = None) -> dict[str, str]:
    """One ready event per id, on one host, and one running record naming that host; the host of each.
    ``from_record`` collects the ids whose ready event another host said from the record (the host that
    made the sandbox stored its record and died before its own event left: bus events' rule).
    (Called once every request is answered: a ready event is a core publish the stream stores, so it
    may still be on its way for a moment; one that never comes is reported with the id's record.)"""
    evs: dict = {}

    async def all_there() -> bool:
        evs.clear()
        evs.update(await ready_counts(js))
        return set(ids) <= set(evs)

    with contextlib.suppress(AssertionError):
        # a ready said from the record by another host comes once the maker's own is surely not coming
        # (hostagent._intake.DROPPED_WAIT_S after the record)
        await eventually(all_there, timeout=70, what="every ready event stored")
    missing = [sid for sid in ids if sid not in evs]
    if missing:
        recs = await records_of(js, missing[:20])
        raise AssertionError(f"{len(missing)} of {len(ids)} ids have no ready event in DSEC_EVT; the records of some: "
                             + ", ".join(f"{sid}={r and (r.state, r.host_id)}" for sid, r in recs.items()))
    assert [(sid, evs[sid]) for sid in ids if len(evs[sid]) != 1] == []
    host_of = {sid: evs[sid][0].host_id for sid in ids}
    if from_record is not None:
        from_record.update(sid for sid in ids if evs[sid][0].detail.get("from") == "record")
    recs = await records_of(js, ids)
    wrong = [(sid, r and (r.state, r.host_id)) for sid, r in recs.items() if r is None or r.state != "running" or r.host_id != host_of[sid]]
    assert wrong == []
    return host_of


async def requested(js) -> set[str]:
    """Ids in the create requests DSEC_REQ holds now (a work queue: taken and not acked, or not taken yet)."""
    out: set[str] = set()
    seq = (await js.stream_info(S.STREAM_REQ)).state.first_seq
    while True:
        try:
            m = await js.get_msg(S.STREAM_REQ, seq, subject=f"{S.PREFIX}.req.>", next=True)
        except nats.js.errors.NotFoundError:
            return out
        req = codec.REQ.decode(m.data)
        out.update(s.sandbox_id for s in (req.specs if isinstance(req, CreateBatch) else [req.spec]))
        seq = m.seq + 1


async def drained(js) -> bool:
    """Every create request answered and acked."""
    ci = await js.consumer_info(S.STREAM_REQ, S.PLACEMENT_DURABLE)
    return ci.num_pending == 0 and ci.num_ack_pending == 0


async def test_host_killed_between_handoff_and_confirm_loses_nothing(nats_srv, nc, tmp_path) -> None:
    """kill -9 of the host agents mid-burst: placement holds each request until its host answers the
    hand-off; the dead hosts never do, so the requests are placed again (as redeliveries: the host claims
    the id first) once the agents run again on the same ids; what was asked for meanwhile waits in DSEC_REQ."""
    url = nats_srv.url
    js = nc.jetstream()
    since = time.time()
    logs = [tmp_path / "sim-1.log", tmp_path / "sim-2.log"]
    sim = sim_hosts(url, 4, tmp_path, logs[0])
    procs = [sim, replica(url, "r0", tmp_path / "p0.log")]
    ready = await listen_ready(nc)
    try:
        await up(js, 4, 1, since)
        n = 3000
        ids = [f"h{uuid.uuid4().hex[:8]}-{i}" for i in range(n)]
        await publish_singles(js, ids[:2000])
        await eventually(lambda: len(ready) >= 200, timeout=20, what="the burst under way")
        kill9(sim)
        # requests held for hand-offs the dead hosts took and never answered
        assert (await js.consumer_info(S.STREAM_REQ, S.PLACEMENT_DURABLE)).num_ack_pending > 0
        in_flight = await requested(js)  # those, and what was not placed yet
        died_having = created(logs[0])
        await publish_singles(js, ids[2000:])  # while no host runs: they wait in DSEC_REQ
        procs.append(sim_hosts(url, 4, tmp_path, logs[1]))
        await eventually(lambda: drained(js), timeout=60, what=f"every request answered ({len(ready & set(ids))} of {n} ready so far)")
        said_from_record: set[str] = set()
        host_of = await assert_exactly_once(js, ids, said_from_record)
        again = created(logs[1])
        assert [sid for sid in ids if again[sid] > 1 or died_having[sid] > 1] == []
        # Made by the dead process after its last log line (record stored, then killed): a host that was
        # handed the id again lost the claim to that record and said the ready from it.
        assert said_from_record <= in_flight
        for sid in said_from_record:
            died_having[sid] = max(died_having[sid], 1)
        # Created by both processes: only what the dead one had not confirmed (its sandboxes died with it),
        # made again by the restarted host it was handed to.
        twice = {sid for sid in ids if again[sid] and died_having[sid]}
        assert twice <= in_flight
        assert set(host_of.values()) <= {f"sim-{i}" for i in range(4)}
        assert sum(again.values()) + sum(died_having.values()) - len(twice) == n
    finally:
        for p in procs:
            stop_process(p)


async def test_replica_killed_with_unacked_batches_loses_nothing(nats_srv, nc, tmp_path) -> None:
    """Two placement replicas take CreateBatch requests; one is frozen (JetStream keeps handing it batches
    it never acks), then killed: its batches are redelivered to the other, which skips the ids a host
    already claimed and hands the rest off with claim=True."""
    url = nats_srv.url
    js = nc.jetstream()
    since = time.time()
    log = tmp_path / "sim.log"
    procs = [sim_hosts(url, 8, tmp_path, log)] + [replica(url, f"r{i}", tmp_path / f"p{i}.log") for i in range(2)]
    frozen = procs[1]
    ready = await listen_ready(nc)
    try:
        await up(js, 8, 2, since)
        n, size = 3000, 50
        ids = [f"b{uuid.uuid4().hex[:8]}-{i}" for i in range(n)]
        await publish_batches(js, ids[:1500], size)
        await eventually(lambda: len(ready) >= 100, timeout=20, what="the burst under way")
        os.kill(frozen.pid, signal.SIGSTOP)
        await publish_batches(js, ids[1500:], size)

        async def all_delivered() -> bool:
            return (await js.consumer_info(S.STREAM_REQ, S.PLACEMENT_DURABLE)).num_pending == 0

        await eventually(all_delivered, timeout=20, what="every batch delivered to a replica")
        kill9(frozen)
        held = (await js.consumer_info(S.STREAM_REQ, S.PLACEMENT_DURABLE)).num_ack_pending
        assert held > 0  # batches died un-acked with the replica: redelivered after ack_wait (2 s)
        await eventually(lambda: ready >= set(ids), timeout=40, what=f"all {n} ready ({len(ready & set(ids))} so far)")
        await assert_exactly_once(js, ids)
        made = created(log)
        assert [(sid, made[sid]) for sid in ids if made[sid] != 1] == []
        await eventually(lambda: drained(js), what="every request acked")
    finally:
        for p in procs:
            if p is frozen and p.poll() is None:
                kill9(p)
            stop_process(p)


def _stale(spec: SandboxSpec) -> SandboxSpec:
    """The same create as it looks once the dedup window has passed: asked for longer ago than half the
    window (placement and host then claim the id in KV: their ``_fresh``), with a deadline still ahead."""
    now = time.time()
    return msgspec.structs.replace(spec, requested_at=now - DEDUP_WINDOW_S / 2 - 5, create_deadline=now + 60)


async def test_duplicate_create_after_a_restart_makes_nothing_twice(nats_srv, nc, tmp_path) -> None:
    """Sandboxes created, then placement and host agent killed and started again, then the same create
    requests again: the same message (same Nats-Msg-Id), with a fresh Nats-Msg-Id, and as seen after the
    dedup window (a stale spec: placement hands off with claim=True); and the hand-off itself again."""
    url = nats_srv.url
    js = nc.jetstream()
    since = time.time()
    logs = [tmp_path / "sim-1.log", tmp_path / "sim-2.log"]
    procs = [sim_hosts(url, 1, tmp_path, logs[0]), replica(url, "r0", tmp_path / "p0.log")]
    try:
        await up(js, 1, 1, since)
        # x: a single create (handed off alone, as x:0); y and z: one batch request (handed off as a PlaceBatch)
        x = f"x{uuid.uuid4().hex[:8]}"
        sb = await AsyncSandbox.create("base", backend="sim", nats_url=url, sandbox_id=x, create_timeout=20)
        assert sb.host_id == "sim-0"
        y, z = f"y{uuid.uuid4().hex[:8]}", f"z{uuid.uuid4().hex[:8]}"
        await AsyncSandbox.create_batch(2, "base", backend="sim", nats_url=url, sandbox_ids=[y, z], create_timeout=20)
        ids = [x, y, z]
        await assert_exactly_once(js, ids)
        before = await records_of(js, ids)
        spec = {sid: before[sid].spec for sid in ids}  # type: ignore[union-attr] - the specs as the host got them
        bid = spec[y].batch_id
        for p in procs:
            kill9(p)
        since = time.time()
        procs = [sim_hosts(url, 1, tmp_path, logs[1]), replica(url, "r1", tmp_path / "p1.log")]
        await up(js, 1, 1, since)

        # the request messages exactly as the SDK stored them (sdk._async._send_creates)
        def single(s: SandboxSpec) -> bytes:
            return codec.encode(CreateSandbox(spec=s))

        def batch(ss: list[SandboxSpec]) -> bytes:
            return codec.encode(CreateBatch(batch_id=f"{bid}-0", specs=ss))

        same = [
            await js.publish(S.REQ_CREATE, single(spec[x]), headers={S.HDR_MSG_ID: x}),
            await js.publish(S.REQ_CREATE_BATCH, batch([spec[y], spec[z]]), headers={S.HDR_MSG_ID: f"{bid}-0"}),
        ]
        assert [a.duplicate for a in same] == [True, True]  # the stream drops them (its window is open)
        for fresh in (lambda s: s, _stale):
            await js.publish(S.REQ_CREATE, single(fresh(spec[x])), headers={S.HDR_MSG_ID: f"{x}-{uuid.uuid4().hex[:6]}"})
            await js.publish(S.REQ_CREATE_BATCH, batch([fresh(spec[y]), fresh(spec[z])]), headers={S.HDR_MSG_ID: f"{bid}-{uuid.uuid4().hex[:6]}"})
            for sid in (y, z):  # a batch member asked for again on its own
                await js.publish(S.REQ_CREATE, single(fresh(spec[sid])), headers={S.HDR_MSG_ID: f"{sid}-{uuid.uuid4().hex[:6]}"})
        for sid in ids:  # the hand-off itself again (a core request, answered once durable), claim=True as placement sets it
            hand = PlaceSandbox(spec=_stale(spec[sid]), host_id="sim-0", placed_by="r1", placed_at=time.time(), claim=True)
            answer = await nc.request(S.host_create("sim-0"), codec.encode(hand), timeout=10)
            assert codec.HANDOFF_REPLY.decode(answer.data).state == "done"

        # A marker asked for after the replays: once it is ready and both work queues are empty, every replay was handled.
        marker = await AsyncSandbox.create("base", backend="sim", nats_url=url, create_timeout=20)

        await eventually(lambda: drained(js), timeout=20, what="every replay handled")
        host_of = await assert_exactly_once(js, [*ids, marker.sandbox_id])
        assert set(host_of.values()) == {"sim-0"}
        made_before, made_after = created(logs[0]), created(logs[1])
        assert {sid: made_before[sid] for sid in ids} == dict.fromkeys(ids, 1)
        # The simulated host keeps no sandbox over its restart (nothing persisted, nothing recovered), while
        # its records still say running: a replay that reaches it (one not de-duplicated by the streams)
        # finds its own record, takes the id as its own and makes the sandbox again, once. Never a second
        # copy next to a live one, never a second record or ready event.
        assert [sid for sid in ids if made_after[sid] > 1] == []
        for sid in ids:
            if made_after[sid]:
                info = await (await AsyncSandbox.connect(sid, nats_url=url)).get_info()
                assert (info.host_id, info.state) == ("sim-0", "running")
    finally:
        for p in procs:
            stop_process(p)


async def test_nats_server_restart_mid_burst_loses_nothing(tmp_path) -> None:
    """The server stops (SIGTERM) mid-burst and starts again on the same port and store: hand-offs,
    records, events and acks in flight are lost with it; placement's requests are still in DSEC_REQ and
    are placed again. Every create acked by the stream before the restart becomes ready once."""
    srv = NatsServer(tmp_path / "nats", port=0).start()
    procs: list[subprocess.Popen] = []
    nc = await connect(srv.url, name="restart-test", max_reconnect_attempts=-1)
    try:
        js = nc.jetstream()
        await seed(js)
        log = tmp_path / "sim.log"
        since = time.time()
        procs += [sim_hosts(srv.url, 4, tmp_path / "sim", log), replica(srv.url, "r0", tmp_path / "p0.log")]
        ready = await listen_ready(nc)
        await up(js, 4, 1, since)
        ids = [f"n{uuid.uuid4().hex[:8]}-{i}" for i in range(2500)]
        await publish_singles(js, ids[:2000])
        await eventually(lambda: len(ready) >= 200, timeout=20, what="the burst under way")
        assert len(ready) < len(ids) - 500  # the restart comes mid-burst
        srv.stop()
        srv.start()
        await eventually(lambda: nc.is_connected, timeout=20, what="the test's client to reconnect")

        async def streams_back() -> bool:  # the server answers before it has loaded every stream again
            try:
                return all([await js.stream_info(s) for s in (S.STREAM_REQ, S.STREAM_EVT)])
            except Exception:  # noqa: BLE001 - not loaded yet
                return False

        await eventually(streams_back, timeout=20, what="the streams loaded again")
        await publish_singles(js, ids[2000:])  # and work asked for after the restart
        # (a store whose ack the restart lost takes the publisher's 30 s to fail; the host says "working" meanwhile)
        await eventually(lambda: drained(js), timeout=60, what=f"every request answered ({len(ready & set(ids))} of {len(ids)} ready so far)")
        await assert_exactly_once(js, ids)
        # (a create whose record could not be stored when the server went away logs no sandbox_ready: its
        # redelivery finds it held here, stores the record and says ready again)
        made = created(log)
        assert [(sid, made[sid]) for sid in ids if made[sid] > 1] == []
    finally:
        for p in procs:
            stop_process(p)
        await nc.close()
        srv.stop()


async def test_ready_never_heard_nor_in_the_stream_is_read_from_the_record(nats_srv, nc, monkeypatch) -> None:
    """The host's ``ready`` is a core publish: its reply to the client and its copy in DSEC_EVT can both
    be missing. The client then finds the sandbox by its record."""
    from sdk import _async

    from .test_flows import agent
    from placement import Placement

    monkeypatch.setattr(_async, "RECHECK_AFTER_S", 0.5)
    monkeypatch.setattr(_async._Replies, "_on", lambda self, msg: None)  # every reply to the client is lost
    answers: list = []
    look = _async._outcome_in_stream

    async def looked(js, sid, since=0.0):  # what the client's look-up found (the real one, observed)
        ev = await look(js, sid, since)
        answers.append(ev)
        return ev

    monkeypatch.setattr(_async, "_outcome_in_stream", looked)
    url = nats_srv.url
    js = nc.jetstream()
    h = agent(url, "quiet")
    pl = Placement(url, grace_s=2)
    await h.start()
    await pl.start()
    purged: list[str] = []

    async def purge(msg) -> None:  # the ready event is taken out of the stream as soon as it is there
        tenant, sid = msg.subject.split(".")[3:5]  # dsec.evt.sandbox.<tenant>.<id>.ready
        subject = S.evt_sandbox(sid, "ready", tenant)

        async def stored() -> bool:
            try:
                await js.get_last_msg(S.STREAM_EVT, subject)
                return True
            except Exception:  # noqa: BLE001 - not stored yet
                return False

        await eventually(stored, timeout=5, what="the ready event stored")
        await js.purge_stream(S.STREAM_EVT, subject=subject)
        purged.append(sid)

    sub = await nc.subscribe(f"{S.PREFIX}.evt.sandbox.*.*.ready", cb=purge)
    try:
        # 1. the client waits while the ready event goes astray
        sb = await AsyncSandbox.create("base", backend="sim", nats_url=url, create_timeout=10)
        assert sb.host_id == "quiet" and sb.sandbox_id in h.live
        assert purged == [sb.sandbox_id]
        assert [a and (a.sandbox_id, a.kind, a.host_id, a.detail) for a in answers if a is not None] == [
            (sb.sandbox_id, "ready", "quiet", {"from": "record"})
        ]
        await sub.unsubscribe()
        # 2. the client comes after the fact: its own request was stored already (same Nats-Msg-Id), the
        # sandbox is running, its reply went to an inbox nobody listens on, its event is gone
        late = f"late{uuid.uuid4().hex[:8]}"
        spec = build_spec("base", backend="sim", sandbox_id=late)
        spec.reply_to = f"_INBOX.nobody{uuid.uuid4().hex}"
        await js.publish(S.REQ_CREATE, codec.encode(CreateSandbox(spec=spec)), headers={S.HDR_MSG_ID: late})
        await eventually(lambda: late in h.live, what="the sandbox made")
        await stored_events(js, [late])
        await js.purge_stream(S.STREAM_EVT, subject=S.evt_sandbox(late, "ready", S.OPERATOR_TENANT))
        with pytest.raises(nats.js.errors.NotFoundError):  # nothing left in the stream
            await js.get_last_msg(S.STREAM_EVT, S.evt_sandbox(late, "ready", S.OPERATOR_TENANT))
        answers.clear()
        sb2 = await AsyncSandbox.create("base", backend="sim", nats_url=url, sandbox_id=late, create_timeout=10)
        assert sb2.host_id == "quiet"
        assert [a and a.detail for a in answers if a is not None] == [{"from": "record"}]
        assert h.created == 2 and set(h.live) == {sb.sandbox_id, late}
    finally:
        await pl.shutdown()
        await h.shutdown()
