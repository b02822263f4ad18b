"""A 3-node NATS cluster (real nats-server processes, JetStream clustered, every stream and bucket R3)
losing a node mid-burst, and one node cut off from the other two (issue 23's NATS faults).

Placement replicas and simulated hosts run as child processes given the seed list; "exactly once" is
checked as in test_failures: one ready event per id in DSEC_EVT, one record naming its host, one
``sandbox_ready`` log line per id.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
import uuid

import pytest

from bus import subjects as S
from bus.auth import split_urls, with_credentials
from bus.errors import Unavailable
from bus.natsd import NatsCluster, NatsServer
from bus.runtime import connect
from bus.streams import REPLICAS_ENV

from .conftest import eventually, seed, stop_process
from .test_failures import assert_exactly_once, created, drained, listen_ready, publish_singles, replica, sim_hosts, up

STREAMS = (S.STREAM_REQ, S.STREAM_EVT, f"KV_{S.KV_SANDBOXES}")


def test_seed_list_carries_credentials_on_every_url() -> None:
    """A reconnect to another node presents that node's URL's credentials: each URL has them."""
    urls = split_urls(with_credentials("nats://127.0.0.1:4222, nats://127.0.0.1:4223", "placement", "p w"))
    assert urls == ["nats://placement:p%20w@127.0.0.1:4222", "nats://placement:p%20w@127.0.0.1:4223"]


def leader_of(cluster: NatsCluster, stream: str) -> NatsServer:
    for n in cluster.nodes:
        if n.proc is None:
            continue
        for acct in n.monitor("jsz?streams=true").get("account_details") or []:
            for st in acct.get("stream_detail") or []:
                if st["name"] == stream and (st.get("cluster") or {}).get("leader") == n.server_name:
                    return n
    raise AssertionError(f"no leader of {stream}")


def stored_on(node: NatsServer) -> dict[str, int]:
    """Messages each of ``STREAMS`` holds on ``node``'s own replica."""
    out = {}
    for acct in node.monitor("jsz?streams=true").get("account_details") or []:
        for st in acct.get("stream_detail") or []:
            if st["name"] in STREAMS:
                out[st["name"]] = st["state"]["messages"]
    return out


async def answered(js) -> bool:
    """``drained``, and false while the cluster cannot say (a leader being elected)."""
    try:
        return await drained(js)
    except Exception:  # noqa: BLE001 - no leader for a moment: ask again
        return False


async def caught_up(js, cluster: NatsCluster) -> bool:
    """Every replica of ``STREAMS`` current, and every node holding as many messages as the leader."""
    for s in STREAMS:
        try:
            si = await js.stream_info(s)
        except Exception:  # noqa: BLE001 - no leader for a moment: ask again
            return False
        if si.cluster is None or any(not p.current or p.offline for p in si.cluster.replicas or []) or len(si.cluster.replicas or []) != 2:
            return False
    counts = [stored_on(n) for n in cluster.nodes]
    return all(c == counts[0] and len(c) == len(STREAMS) for c in counts)


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    monkeypatch.setenv(REPLICAS_ENV, "3")  # this process and every child: streams and buckets R3
    c = NatsCluster(tmp_path / "nats", size=3).start()
    yield c
    c.stop()


async def test_nats_node_killed_mid_burst_loses_nothing_and_rejoins(cluster, tmp_path) -> None:
    """The node leading DSEC_REQ is SIGKILLed during a burst of 2,000 creates; clients and services
    move to the other two (seed list), the streams elect new leaders. Every create becomes ready
    exactly once; the node, started again on its store, catches up with every stream."""
    procs: list[subprocess.Popen] = []
    nc = await connect(cluster.url, name="cluster-test", max_reconnect_attempts=-1)
    try:
        js = nc.jetstream()
        await seed(js)
        assert (await js.stream_info(S.STREAM_EVT)).config.num_replicas == 3
        assert (await js.stream_info(f"KV_{S.KV_SANDBOXES}")).config.num_replicas == 3
        log = tmp_path / "sim.log"
        since = time.time()
        procs += [sim_hosts(cluster.url, 4, tmp_path / "sim", log), replica(cluster.url, "r0", tmp_path / "p0.log"),
                  replica(cluster.url, "r1", tmp_path / "p1.log")]
        ready = await listen_ready(nc)
        await up(js, 4, 2, since)
        ids = [f"c{uuid.uuid4().hex[:8]}-{i}" for i in range(2000)]
        await publish_singles(js, ids)
        await eventually(lambda: len(ready) >= 200, timeout=30, what="the burst under way")
        assert len(ready) < len(ids) - 300  # the kill comes mid-burst
        victim = leader_of(cluster, S.STREAM_REQ)
        victim.kill()
        await eventually(lambda: answered(js), timeout=180, what=f"every request answered on two nodes ({len(ready & set(ids))} of {len(ids)} ready)")
        await assert_exactly_once(js, ids)
        made = created(log)
        assert [(sid, made[sid]) for sid in ids if made[sid] > 1] == []
        # the node comes back on its store and catches up with what the other two took meanwhile
        victim.start()
        await eventually(lambda: caught_up(js, cluster), timeout=120, what="the restarted node caught up")
    finally:
        for p in procs:
            stop_process(p)
        with contextlib.suppress(Exception):
            await nc.close()


async def test_a_reconnect_to_a_node_learnt_from_the_cluster_presents_the_credentials(tmp_path) -> None:
    """A client given one node's URL (with credentials) learns the others from it, without credentials;
    when its node dies it moves to one of those and must log in there too. Control: a client without
    credentials is refused by each node (the server's authorization violation)."""
    auth = 'authorization { users: [{user: "svc", password: "pw-1"}] }'
    c = NatsCluster(tmp_path / "nats", size=3, extra_config=auth).start()
    nc = None
    try:
        seed0 = with_credentials(c.nodes[0].url, "svc", "pw-1")
        nc = await connect(seed0, name="one-seed", max_reconnect_attempts=-1)
        await eventually(lambda: len(nc.discovered_servers) >= 2, timeout=20, what="the other nodes learnt from the first")
        got: list[bytes] = []

        async def on(m) -> None:
            got.append(m.data)

        sub = await nc.subscribe("probe.x", cb=on)
        c.nodes[0].kill()
        await eventually(lambda: nc.is_connected and nc.connected_url is not None and nc.connected_url.port != c.nodes[0].port,
                         timeout=30, what="the client on another node")
        assert not nc.is_closed
        await nc.publish("probe.x", b"still here")
        await eventually(lambda: got == [b"still here"], timeout=10, what="a message through the new node")
        await sub.unsubscribe()
        for n in c.nodes[1:]:
            with pytest.raises(Unavailable, match="(?i)authorization violation"):
                await connect(n.url, name="anon", connect_attempts=1, connect_timeout_s=5)
    finally:
        if nc is not None:
            with contextlib.suppress(Exception):
                await nc.close()
        c.stop()
