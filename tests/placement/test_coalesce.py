"""Concurrent single creates of one client share request messages (``sdk/_coalesce.py``, issue 23's
single-create rate): fewer messages on ``DSEC_REQ``, and each create still gets its own sandbox, events
and error. Real nats-server, placement and a host agent (simulated backend) as child processes."""

from __future__ import annotations

import asyncio
import time
import uuid

from bus import subjects as S
from sdk import AsyncSandbox, UnknownTemplate
from sdk import _async as sdk_async

from .conftest import eventually, hosts_up, records_of, spawn, stop_process
from .test_batch_ready import batch_events, replica, sim_host
from .test_failures import assert_exactly_once, drained, kill9, up
from .test_failures import replica as capped_replica


async def req_seq(js) -> int:
    return (await js.stream_info(S.STREAM_REQ)).state.last_seq


async def test_concurrent_single_creates_share_messages_and_each_keeps_its_own_outcome(nats_srv, nc, tmp_path, monkeypatch) -> None:
    url, js = nats_srv.url, nc.jetstream()
    since = time.time()
    prefix = f"co{uuid.uuid4().hex[:6]}"
    procs = [sim_host(url, prefix, tmp_path / "h", tmp_path / "h.log"), replica(url, "r0", tmp_path / "p0.log")]
    host = f"{prefix}-0"
    kw = dict(backend="sim", nats_url=url, create_timeout=60, cpu=0.25, memory_mb=64)
    try:
        await eventually(lambda: hosts_up(js, [host], since), timeout=30, what="the host heartbeating")
        await AsyncSandbox.create("base", **kw)  # the SDK's connection and the code paths, warm
        good = [f"cg-{uuid.uuid4().hex[:8]}-{i}" for i in range(120)]
        bad = [f"cb-{uuid.uuid4().hex[:8]}-{i}" for i in range(3)]
        seq0 = await req_seq(js)
        got = await asyncio.gather(
            *(AsyncSandbox.create("base", sandbox_id=sid, **kw) for sid in good[:60]),
            *(AsyncSandbox.create("no-such-template", sandbox_id=sid, **kw) for sid in bad),
            *(AsyncSandbox.create("base", sandbox_id=sid, **kw) for sid in good[60:]),
            return_exceptions=True,
        )
        stored = await req_seq(js) - seq0
        made, failed = [*got[:60], *got[63:]], got[60:63]
        assert [sb.sandbox_id if isinstance(sb, AsyncSandbox) else sb for sb in made] == good
        assert {sb.host_id for sb in made if isinstance(sb, AsyncSandbox)} == {host}
        # the creates in a message with the bad ones are unharmed; each bad one fails alone, typed
        assert [type(e) for e in failed] == [UnknownTemplate] * 3
        assert all(isinstance(e, UnknownTemplate) and e.code == "unknown_template" and "no-such-template" in e.description for e in failed)
        assert stored < len(got) / 4, stored  # 123 creates, a few messages
        recs = await records_of(js, [*good, *bad])
        assert [sid for sid in good if (r := recs[sid]) is None or r.state != "running" or r.host_id != host] == []
        assert [sid for sid in bad if recs[sid] is not None] == []
        evs = await batch_events(js)
        named = [sid for _, ev in evs for sid in ev.sandbox_ids if sid in set(good)]
        assert len(named) == len(set(named))  # never announced twice
        # placement runs a shared message on hosts as it runs singles: a few host batches, not one per create
        assert len({ev.batch_id for _, ev in evs if set(ev.sandbox_ids) & set(good)}) <= len(good) / 8

        # control: coalescing off, one message per create
        monkeypatch.setattr(sdk_async, "COALESCE", False)
        seq0 = await req_seq(js)
        alone = await asyncio.gather(*(AsyncSandbox.create("base", **kw) for _ in range(20)))
        assert len(alone) == 20 and await req_seq(js) - seq0 == 20
    finally:
        for p in procs:
            stop_process(p)


async def test_a_thousand_coalesced_creates_survive_a_replica_killed_mid_burst_and_die_together(nats_srv, nc, tmp_path) -> None:
    """1,000 concurrent single creates from one client (coalesced into a few messages) on 4 hosts and 2
    placement replicas; one replica is kill -9ed once 150 are ready. Every create succeeds, each id is
    made exactly once on one host; then all 1,000 are killed at once and no record is left running."""
    url, js = nats_srv.url, nc.jetstream()
    since = time.time()
    # 50 ms per create, 8 at once per host: the 1,000 take about 1.5 s, so the kill lands among them
    sim = spawn(["-m", "hostagent", "--backend", "sim", "--sim-hosts", "4", "--data-dir", str(tmp_path)], url, tmp_path / "sim.log",
                level="INFO", env_extra={"DSEC_SIM_CREATE_S": "0.05"})
    victim, other = capped_replica(url, "r0", tmp_path / "p0.log"), capped_replica(url, "r1", tmp_path / "p1.log")
    procs = [sim, victim, other]
    kw = dict(backend="sim", nats_url=url, create_timeout=120, cpu=0.25, memory_mb=64)
    try:
        await up(js, 4, 2, since)
        ids = [f"ck-{uuid.uuid4().hex[:8]}-{i}" for i in range(1000)]
        seq0 = await req_seq(js)
        tasks = [asyncio.ensure_future(AsyncSandbox.create("base", sandbox_id=sid, **kw)) for sid in ids]
        await eventually(lambda: sum(t.done() for t in tasks) >= 150, timeout=60, what="150 creates ready")
        assert sum(t.done() for t in tasks) < len(tasks)  # the kill lands mid-burst
        kill9(victim)
        made = await asyncio.gather(*tasks)
        assert [sb.sandbox_id for sb in made] == ids
        assert await req_seq(js) - seq0 < len(ids) / 4  # coalesced (a kill can add a few redeliveries, not stores)
        hosts = await assert_exactly_once(js, ids)
        assert {hosts[sb.sandbox_id] for sb in made} == {sb.host_id for sb in made} and len(set(hosts.values())) > 1
        await eventually(lambda: drained(js), timeout=30, what="every request acked")

        await asyncio.gather(*(sb.kill() for sb in made))

        async def none_running() -> bool:
            recs = await records_of(js, ids)
            return not [sid for sid, r in recs.items() if r is not None and r.state == "running"]

        await eventually(none_running, timeout=60, what="no record of the 1,000 left running")
    finally:
        for p in procs:
            stop_process(p)
