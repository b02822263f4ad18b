"""Placement with real NATS and the host agent's real code on the simulated backend."""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile
import time
import uuid

import pytest

from bus import codec
from bus import subjects as S
from bus.errors import NoCapacity, UnknownTemplate
from bus.messages import CreateSandbox, HostStatus, PlaceBatch
from bus.streams import ensure_kv
from hostagent import HostAgent, HostAgentConfig, SimBackend
from placement import Placement
from sdk import AsyncSandbox, SandboxTimeout, build_spec
from sdk.errors import UnsupportedBackend

from .conftest import LAYER, eventually, hosts_up, listen_ready, ready_counts, spawn, stop_process, stored_events



def agent(url: str, hid: str, **kw) -> HostAgent:
    backend = kw.pop("backend", None) or SimBackend()
    kw.setdefault("heartbeat_s", 0.2)
    # persist_state=False: nothing is written under data_dir
    cfg = HostAgentConfig(nats_url=url, host_id=hid, data_dir=os.path.join(tempfile.gettempdir(), "dsec-pl-unused"), persist_state=False, grace_s=2, **kw)
    return HostAgent(backend, cfg)


async def test_host_rejects_and_request_is_replaced_elsewhere(nats_srv, nc) -> None:
    url = nats_srv.url
    js = nc.jetstream()
    # "liar" really admits nothing (0.5 cores, no overcommit) but advertises a big, warm host.
    liar = agent(url, "liar", backend=SimBackend(cpu_total=0.5), cpu_overcommit=1.0, heartbeat_s=3600)
    honest = agent(url, "honest")
    pl = Placement(url, pending_delay_s=0.1, grace_s=2)
    await liar.start()
    await honest.start()
    kv = await ensure_kv(js, S.KV_HOSTS)
    fake = HostStatus(host_id="liar", backend="sim", at=time.time() + 3600, cpu_total=64, mem_total_mb=1 << 20, disk_total_mb=1 << 24, layers=[LAYER])
    await kv.put("liar", codec.encode(fake))
    await pl.start()
    try:
        await eventually(lambda: "liar" in pl.table.hosts and pl.table.hosts["liar"].status.cpu_total == 64, what="fake heartbeat seen")
        sb = await AsyncSandbox.create("base", backend="sim", nats_url=url, create_timeout=20)
        assert sb.host_id == "honest"
        evs = await ready_counts(js, ("rejected", "ready"))
        kinds = [(e.kind, e.host_id, e.attempt) for e in evs[sb.sandbox_id]]
        assert ("rejected", "liar", 0) in kinds
        assert [k for k in kinds if k[0] == "ready"] == [("ready", "honest", 1)]
    finally:
        await pl.shutdown()
        await honest.shutdown()
        await liar.shutdown()


async def test_full_cluster_waits_pending_then_places_when_capacity_frees(nats_srv, nc) -> None:
    url = nats_srv.url
    h = agent(url, "one", max_sandboxes=1)
    pl = Placement(url, pending_delay_s=0.1, grace_s=2)
    await h.start()
    await pl.start()
    try:
        first = await AsyncSandbox.create("base", backend="sim", nats_url=url, create_timeout=10)
        pending: list[str] = []
        second = asyncio.ensure_future(AsyncSandbox.create("base", backend="sim", nats_url=url, create_timeout=20, on_pending=pending.append))
        await eventually(lambda: pending, what="a pending event")
        await asyncio.sleep(0.3)  # a while in the stream: must not be dropped nor placed
        assert not second.done()
        info = await nc.jetstream().consumer_info(S.STREAM_REQ, S.PLACEMENT_DURABLE)
        assert info.num_ack_pending + info.num_pending == 1  # the request waits in JetStream
        await first.kill()
        sb2 = await asyncio.wait_for(second, 15)
        assert sb2.host_id == "one" and pending == [sb2.sandbox_id]
    finally:
        await pl.shutdown()
        await h.shutdown()


async def test_no_host_ever_fits_fails_clearly_at_the_deadline(nats_srv, nc) -> None:
    url = nats_srv.url
    h = agent(url, "small", backend=SimBackend(cpu_total=1), cpu_overcommit=1.0)
    pl = Placement(url, pending_delay_s=0.1, grace_s=2)
    await h.start()
    await pl.start()
    try:
        with pytest.raises(SandboxTimeout) as ei:
            await AsyncSandbox.create("base", backend="sim", cpu=4, nats_url=url, create_timeout=1.5, sandbox_id="nofit")
        assert "pending" in str(ei.value)

        # placement itself ends the expired request with a clear failure event (nothing waits forever)
        async def failed() -> bool:
            return "nofit" in await ready_counts(nc.jetstream(), ("failed",))

        await eventually(failed, timeout=10, what="failed event")
        ev = (await ready_counts(nc.jetstream(), ("failed",)))["nofit"][0]
        assert ev.code == "timeout" and "expired" in ev.description
        info = await nc.jetstream().consumer_info(S.STREAM_REQ, S.PLACEMENT_DURABLE)
        assert info.num_pending == 0 and info.num_ack_pending == 0
    finally:
        await pl.shutdown()
        await h.shutdown()


async def test_batch_create_gives_exactly_one_ready_per_id(nats_srv, nc) -> None:
    url = nats_srv.url
    hosts = [agent(url, f"b{i}") for i in range(3)]
    pl = Placement(url, grace_s=2)
    for a in hosts:
        await a.start()
    await pl.start()
    try:
        await eventually(lambda: len(pl.table) == 3, what="3 hosts")
        sbs = await AsyncSandbox.create_batch(120, "base", backend="sim", nats_url=url, create_timeout=20)
        ids = {s.sandbox_id for s in sbs}
        assert len(ids) == 120
        assert {s.host_id for s in sbs} == {"b0", "b1", "b2"}  # spread
        ready = await stored_events(nc.jetstream(), ids)
        assert {sid: len(v) for sid, v in ready.items() if sid in ids} == {sid: 1 for sid in ids}
    finally:
        await pl.shutdown()
        for a in hosts:
            await a.shutdown()


@pytest.mark.parametrize("claim", [False, True], ids=["record-claims-after-create", "claim-before-create"])
async def test_batch_handed_to_two_hosts_is_created_once(nats_srv, nc, claim) -> None:
    """What a replica dying between hand-off and ack can cause: the same batch members on two hosts."""
    url = nats_srv.url
    js = nc.jetstream()
    a, b = agent(url, "ha"), agent(url, "hb")
    await a.start()
    await b.start()
    try:
        specs = [build_spec("base", backend="sim") for _ in range(40)]
        handoffs = []
        for hid, part in (("ha", specs), ("hb", specs[10:] + [build_spec("base", backend="sim")])):
            pb = PlaceBatch(batch_id="bx", host_id=hid, specs=part, claim=claim, placed_at=time.time())
            handoffs.append(nc.request(S.host_create(hid), codec.encode(pb), timeout=30))
        # both hand-offs answered "done": every member's outcome is durable (a duplicate would be in the stream)
        answers = [codec.HANDOFF_REPLY.decode(m.data) for m in await asyncio.gather(*handoffs)]
        assert [a.state for a in answers] == ["done", "done"]
        want = {s.sandbox_id for s in specs} | {part[-1].sandbox_id}
        ready = await stored_events(js, want)
        assert all(len(ready[sid]) == 1 for sid in want)
        assert a.created + b.created == 41
        assert not set(a.live) & set(b.live)
    finally:
        await a.shutdown()
        await b.shutdown()


class _SlowSim(SimBackend):
    """The simulated backend, taking a moment to start each sandbox as a real backend does: the
    members of a batch are all being made at once before any of them is in the registry."""

    async def create(self, spec, layers, **kw):
        await asyncio.sleep(0.05)
        return await super().create(spec, layers, **kw)


async def test_fresh_batch_larger_than_the_host_is_admitted_in_turn(nats_srv, nc) -> None:
    """A first-time batch handed to a host with room for 5: five are made, the rest handed back to
    placement (rejected, then re-placed elsewhere), and an id twice in the batch is made once."""
    url = nats_srv.url
    js = nc.jetstream()
    a = agent(url, "hsmall", backend=_SlowSim(), max_sandboxes=5)
    await a.start()
    try:
        specs = [build_spec("base", backend="sim") for _ in range(8)]
        pb = PlaceBatch(batch_id="big", host_id="hsmall", specs=[*specs[:2], specs[0], *specs[2:]], placed_at=time.time())
        answer = codec.HANDOFF_REPLY.decode((await nc.request(S.host_create("hsmall"), codec.encode(pb), timeout=30)).data)
        assert answer.state == "done"
        assert len(a.live) == 5 and a.created == 5  # never more than the host's room, the duplicate not twice
        ids = {s.sandbox_id for s in specs}
        assert set(a.live) <= ids
        rejected = await stored_events(js, ids - set(a.live), kinds=("rejected",))
        assert {sid: len(v) for sid, v in rejected.items() if sid in ids} == {sid: 1 for sid in ids - set(a.live)}
        ready = await stored_events(js, set(a.live))
        assert all(len(ready[sid]) == 1 for sid in a.live)
        assert a.intake.pending.sandboxes == 0 and not a.intake.creating  # nothing still counted as being made
    finally:
        await a.shutdown()


async def test_lease_not_renewed_is_reaped(nats_srv, nc) -> None:
    url = nats_srv.url
    h = agent(url, "lh")
    pl = Placement(url, grace_s=2)
    await h.start()
    await pl.start()
    try:
        kept = await AsyncSandbox.create("base", backend="sim", lease=1, nats_url=url)
        # renewed by the SDK in the background: alive well past its 1 s lease
        await asyncio.sleep(2.0)  # must outlive several lease periods
        assert kept.sandbox_id in h.live
        # the trainer "dies": renewals stop
        from sdk import _async

        for keeper in list(_async._leases.values()):
            keeper.stop()
        await eventually(lambda: kept.sandbox_id not in h.live, timeout=5, what="lease reaped")  # a few lease periods
        async def killed() -> bool:
            return kept.sandbox_id in await ready_counts(nc.jetstream(), ("killed",))

        await eventually(killed, timeout=5, what="killed event")
        evs = await ready_counts(nc.jetstream(), ("killed",))
        assert evs[kept.sandbox_id][0].detail["reason"] == "lease-expired"
        # sandboxes without a lease are left alone
        plain = await AsyncSandbox.create("base", backend="sim", nats_url=url)
        await asyncio.sleep(1.5)
        assert plain.sandbox_id in h.live
    finally:
        await pl.shutdown()
        await h.shutdown()


async def test_placement_replica_killed_mid_burst_loses_nothing(nats_srv, nc, tmp_path) -> None:
    url = nats_srv.url
    js = nc.jetstream()
    sim = spawn(["-m", "hostagent", "--backend", "sim", "--sim-hosts", "8", "--data-dir", str(tmp_path)], url, tmp_path / "sim.log")
    reps = [spawn(["-m", "placement", "--replica-id", f"r{i}", "--ack-wait", "2", "--capacity", "64"], url, tmp_path / f"p{i}.log") for i in range(2)]
    since = time.time()
    ready = await listen_ready(nc)
    try:
        async def consumers_ready() -> bool:
            try:
                ci = await js.consumer_info(S.STREAM_REQ, S.PLACEMENT_DURABLE)
                return await hosts_up(js, [f"sim-{i}" for i in range(8)], since) and ci.num_waiting >= 2
            except Exception:  # noqa: BLE001
                return False

        await eventually(consumers_ready, timeout=20, what="hosts and replicas up")
        n = 3000
        ids = [f"k{uuid.uuid4().hex[:8]}-{i}" for i in range(n)]

        async def publish(part: list[str]) -> None:
            futs = []
            for sid in part:
                spec = build_spec("base", backend="sim", sandbox_id=sid)
                futs.append(await js.publish_async(S.REQ_CREATE, codec.encode(CreateSandbox(spec=spec)), headers={S.HDR_MSG_ID: sid}))
            await asyncio.gather(*futs)

        await publish(ids[:1000])
        await eventually(lambda: len(ready) >= 100, timeout=20, what="the burst under way")
        # Freeze one replica so JetStream keeps handing it requests it will never ack, then kill it.
        os.kill(reps[0].pid, signal.SIGSTOP)
        await publish(ids[1000:])
        await asyncio.sleep(0.3)  # the frozen replica's open pull requests fill up meanwhile
        os.kill(reps[0].pid, signal.SIGKILL)
        reps[0].wait()
        held = (await js.consumer_info(S.STREAM_REQ, S.PLACEMENT_DURABLE)).num_ack_pending
        assert held > 0  # requests died un-acked with the replica: JetStream redelivers them after ack_wait
        await eventually(lambda: len(ready) >= n, timeout=40, what=f"all {n} ready ({len(ready)} so far)")
        counts = await stored_events(js, ids)
        assert [(sid, counts[sid]) for sid in ids if len(counts[sid]) != 1] == []
        hosts_of = {sid: {e.host_id for e in counts[sid]} for sid in ids}
        assert all(len(h) == 1 for h in hosts_of.values())
    finally:
        for p in [*reps, sim]:  # the killed one is only reaped; one left frozen by a failure is killed
            stop_process(p)


def test_bench_command_registers_and_runs_small(tmp_path) -> None:
    import argparse

    from placement import bench

    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd")
    bench.register(sub)
    args = ap.parse_args(["bench", "create", "--sim-hosts", "8", "--count", "400", "--clients", "1", "--concurrency", "50", "--warmup", "2", "--json"])
    res = bench.run(args)
    assert res["lost"] == 0 and res["duplicated"] == 0 and res["client_errors"] == 0, res
    assert res["created"] == 400 and res["ready_events"] == 402 and res["creates_per_s"] > 0


async def test_lost_outcome_reply_is_found_in_the_stream(nats_srv, nc, monkeypatch) -> None:
    """Outcomes come back as core messages on the client's reply inbox; if one is lost, the stream has it."""
    from sdk import _async

    monkeypatch.setattr(_async, "RECHECK_AFTER_S", 0.2)
    monkeypatch.setattr(_async._Replies, "_on", lambda self, msg: None)  # every reply is lost
    url = nats_srv.url
    h = agent(url, "quiet")
    pl = Placement(url, grace_s=2)
    await h.start()
    await pl.start()
    try:
        sb = await AsyncSandbox.create("base", backend="sim", nats_url=url, create_timeout=10)
        assert sb.host_id == "quiet"
        with pytest.raises(UnknownTemplate) as ei:
            await AsyncSandbox.create("nope", backend="sim", nats_url=url, create_timeout=10)
        assert ei.value.code == "unknown_template" and "nope" in ei.value.description
    finally:
        await pl.shutdown()
        await h.shutdown()


async def test_every_host_rejecting_ends_in_a_clear_failure_after_bounded_attempts(nats_srv, nc) -> None:
    url = nats_srv.url
    js = nc.jetstream()
    liar = agent(url, "liar2", backend=SimBackend(cpu_total=0.5), cpu_overcommit=1.0, heartbeat_s=3600)
    pl = Placement(url, pending_delay_s=0.05, max_attempts=3, grace_s=2)
    await liar.start()
    kv = await ensure_kv(js, S.KV_HOSTS)
    fake = HostStatus(host_id="liar2", backend="sim", at=time.time() + 3600, cpu_total=64, mem_total_mb=1 << 20, disk_total_mb=1 << 24)
    await kv.put("liar2", codec.encode(fake))
    await pl.start()
    try:
        await eventually(lambda: "liar2" in pl.table.hosts and pl.table.hosts["liar2"].status.cpu_total == 64, what="fake heartbeat seen")
        with pytest.raises(NoCapacity) as ei:
            await AsyncSandbox.create("base", backend="sim", nats_url=url, create_timeout=10, sandbox_id="never")
        assert ei.value.code == "no_capacity" and "after 3 attempts" in str(ei.value)
        async def settled() -> bool:
            evs = await ready_counts(js, ("rejected", "failed", "ready"))
            return len(evs.get("never", [])) >= 4

        await eventually(settled, timeout=5, what="3 rejections and the failure in the stream")
        evs = await ready_counts(js, ("rejected", "failed", "ready"))
        assert sorted(e.kind for e in evs["never"]) == ["failed", "rejected", "rejected", "rejected"]
        assert sorted(e.attempt for e in evs["never"] if e.kind == "rejected") == [0, 1, 2]
    finally:
        await pl.shutdown()
        await liar.shutdown()


async def test_a_backend_no_live_host_runs_is_refused_at_once_naming_those_run(nats_srv, nc) -> None:
    url = nats_srv.url
    h = agent(url, "simonly")  # its heartbeat may not list backends yet: it runs just "sim"
    pl = Placement(url, pending_delay_s=0.1, grace_s=2)
    await h.start()
    await pl.start()
    try:
        await eventually(lambda: "simonly" in pl.table.hosts, what="the host's heartbeat")
        t0 = time.monotonic()
        with pytest.raises(UnsupportedBackend) as ei:
            await AsyncSandbox.create("base", backend="microvm", nats_url=url, create_timeout=60, sandbox_id="wantvm")
        assert time.monotonic() - t0 < 10  # refused, not pending until the 60 s deadline
        assert ei.value.code == "unsupported_backend"
        assert "'microvm'" in ei.value.description and "available: sim" in ei.value.description
        ev = (await stored_events(nc.jetstream(), ["wantvm"], ("failed",)))["wantvm"][0]
        assert ev.code == "unsupported_backend" and ev.attempt == 0
        # positive control: the backend the host runs is placed on it
        sb = await AsyncSandbox.create("base", backend="sim", nats_url=url, create_timeout=20)
        assert sb.host_id == "simonly"

        async def settled() -> bool:  # neither request waits in the stream
            info = await nc.jetstream().consumer_info(S.STREAM_REQ, S.PLACEMENT_DURABLE)
            return info.num_pending == 0 and info.num_ack_pending == 0

        await eventually(settled, what="requests acked")
    finally:
        await pl.shutdown()
        await h.shutdown()


async def test_with_no_live_host_at_all_a_create_waits_pending(nats_srv, nc) -> None:
    """No host heartbeats (the cluster is away, or this replica has not heard it yet): nothing is refused."""
    url = nats_srv.url
    pl = Placement(url, pending_delay_s=0.1, grace_s=2)
    await pl.start()
    try:
        pending: list[str] = []
        with pytest.raises(SandboxTimeout) as ei:
            await AsyncSandbox.create("base", backend="microvm", nats_url=url, create_timeout=1.5, on_pending=pending.append)
        assert "pending" in str(ei.value) and len(pending) == 1
    finally:
        await pl.shutdown()
