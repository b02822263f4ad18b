"""A 3-node NATS cluster (real nats-server processes, JetStream clustered, every stream and bucket R3)
losing a node mid-burst, and one node cut off from the other two (issue 23's NATS faults).

Placement replicas and simulated hosts run as child processes given the seed list; "exactly once" is
checked as in test_failures: one ready event per id in DSEC_EVT, one record naming its host, one
``sandbox_ready`` log line per id.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from bus import codec
from bus import subjects as S
from bus.auth import split_urls, with_credentials
from bus.errors import Unavailable
from bus.natsd import NatsCluster, NatsServer, nats_server_binary
from bus.runtime import Publisher, StoreError, connect
from bus.streams import REPLICAS_ENV

from .conftest import as_sandbox_events, eventually, hosts_up, records_of, seed, stop_process
from .test_failures import created, drained, listen_ready, publish_singles, replica, sim_hosts

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
        procs.append(sim_hosts(cluster.url, 4, tmp_path / "sim", log))
        ready = await listen_ready(nc)
        await eventually(lambda: hosts_up(js, [f"sim-{i}" for i in range(4)], since), timeout=30, what="4 hosts up")
        # The whole burst is stored (every store acked) before placement starts on it, so the kill lands
        # while its creates are being made: with placement already running, CI once saw all 2,000 made
        # before the last store's ack came back.
        ids = [f"c{uuid.uuid4().hex[:8]}-{i}" for i in range(2000)]
        await publish_singles(js, ids)
        procs += [replica(cluster.url, "r0", tmp_path / "p0.log"), replica(cluster.url, "r1", tmp_path / "p1.log")]
        await eventually(lambda: len(ready) >= 200, timeout=60, what="the burst under way")
        assert len(ready) < len(ids) - 300  # the kill comes mid-burst
        victim = leader_of(cluster, S.STREAM_REQ)
        victim.kill()
        await eventually(lambda: answered(js), timeout=180, what=f"every request answered on two nodes ({len(ready & set(ids))} of {len(ids)} ready)")
        # One ready event per id, from one host, and a running record naming that host (test_failures'
        # check, read here with the stream named: finding it by subject asks the meta leader, which
        # answers nothing for a while after losing its node).
        evs: dict[str, list] = {}

        async def all_read() -> bool:
            return await succeeds(ready_events(js), into=evs) and set(ids) <= set(evs)

        with contextlib.suppress(AssertionError):
            await eventually(all_read, timeout=120, interval=1.0, what="every ready event read back")
        missing = [sid for sid in ids if sid not in evs]
        if missing:
            recs = await records_of(js, missing[:10])
            raise AssertionError(f"{len(missing)} of {len(ids)} ids without a ready event read back ({len(evs)} read); "
                                 f"records of some: {[(k, v and (v.state, v.host_id)) for k, v in recs.items()]}; last read error: {LAST_ERROR}")
        said = {sid: [(e.host_id, round(e.at, 2), e.detail.get("batch"), e.detail.get("from")) for e in evs[sid]] for sid in ids}
        assert [(sid, said[sid]) for sid in ids if len(evs[sid]) != 1][:4] == []
        recs = await records_of(js, ids)
        assert [sid for sid in ids if recs[sid] is None or recs[sid].host_id != evs[sid][0].host_id] == []
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


# --- a partition: one node cut off from the other two -------------------------------------------------
# nft on lo cannot tell which local process a packet belongs to by address, so the node to cut off runs
# as another user and the rules match its packets by owner. The table's name is apart from tests/netclaim's
# families (dsec_dsq*) and the host agents' (dsec_<prefix>): no stack sweeps it, and this test removes it.
NOBODY = 65534
PART_TABLE = "dsec_nspart_"  # + a per-run suffix
PARTITION_CONFIG = "ping_interval: \"1s\"\nping_max: 3\n"  # a dead route is seen in seconds, not minutes


def nft(script: str) -> None:
    subprocess.run(["nft", "-f", "-"], input=script.encode(), check=True, capture_output=True)


def cut_off(table: str, node: NatsServer, others: list[NatsServer]) -> None:
    """Drop every route packet between ``node`` (running as NOBODY) and ``others``, both ways."""
    theirs = ", ".join(str(o.cluster_port) for o in others)
    nft(f"""table inet {table} {{
  chain out {{
    type filter hook output priority 0; policy accept;
    meta skuid {NOBODY} tcp dport {{ {theirs} }} drop
    meta skuid {NOBODY} tcp sport {node.cluster_port} drop
    tcp dport {node.cluster_port} drop
  }}
}}
""")


def heal(table: str) -> None:
    subprocess.run(["nft", "delete", "table", "inet", table], capture_output=True)


def run_as_nobody(node: NatsServer) -> None:
    """The node's store in a directory of its own that NOBODY owns; the process started as NOBODY
    (as NatsServer.launch does, with a user)."""
    d = Path(tempfile.mkdtemp(prefix="dsec-part-node-"))
    os.chown(d, NOBODY, NOBODY)
    node.data_dir = d
    node.log_file = str(d / "nats-server.log")

    def launch() -> None:
        conf = d / "nats-server.conf"
        conf.write_text(node.config_text())
        with open(node.log_file, "ab") as log:
            node.proc = subprocess.Popen([nats_server_binary(), "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True, user=NOBODY, group=NOBODY, extra_groups=[])

    node.launch = launch  # type: ignore[method-assign]


async def write_until_acked(pub: Publisher, i: int, acked: list[str]) -> None:
    """Write ``i``, tried again until acked (its msg id makes a copy the stream holds harmless)."""
    mid = f"w-{i}"
    while True:
        try:
            await pub.store(f"part.{i % 7}", str(i).encode(), {S.HDR_MSG_ID: mid})
            acked.append(mid)
            return
        except (StoreError, TimeoutError):
            continue


LAST_ERROR: list[str] = []  # what the last call that did not go through raised (for a failure's message)


async def succeeds(call, into: list | dict | None = None) -> bool:
    """Whether ``call`` (a coroutine) went through; its result into ``into``. JetStream API calls fail
    for a moment while a cluster elects a leader (503, 10008): the caller asks again."""
    try:
        out = await call
    except Exception as exc:  # noqa: BLE001 - an election under way
        LAST_ERROR[:] = [repr(exc)]
        return False
    if isinstance(into, list):
        into[:] = out
    elif isinstance(into, dict):
        into.clear()
        into.update(out)
    return True


async def ready_events(js) -> dict[str, list]:
    """Every ``ready`` in DSEC_EVT, per sandbox id, its own event or a batch's naming it (ordered consumer on the stream by name)."""
    out: dict[str, list] = {}
    last = (await js.stream_info(S.STREAM_EVT)).state.last_seq
    if not last:
        return out
    sub = await js.subscribe(f"{S.PREFIX}.evt.>", stream=S.STREAM_EVT, ordered_consumer=True)
    try:
        while True:
            m = await sub.next_msg(timeout=10)
            for ev in as_sandbox_events(codec.EVENT.decode(m.data)):
                if ev.kind == "ready":
                    out.setdefault(ev.sandbox_id, []).append(ev)
            if m.metadata.sequence.stream >= last:
                return out
    finally:
        await sub.unsubscribe()


async def msg_ids(js, stream: str) -> list[str]:
    """The Nats-Msg-Id of every message ``stream`` holds, read by sequence (no consumer: right after a
    heal the cluster may be electing its meta leader, and a consumer cannot be made meanwhile)."""
    info = await js.stream_info(stream)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        m = await js.get_msg(stream, seq)
        out.append((m.headers or {}).get(S.HDR_MSG_ID, ""))
    return out


async def test_a_partitioned_node_the_majority_writes_on_and_nothing_acked_is_lost(tmp_path) -> None:
    """Node n2 (leading the stream) is cut off from n0 and n1: the majority elects a leader and takes
    writes; a client on n2 gets no ack meanwhile (the control: the cut is real). Healed, n2 catches up
    and the stream holds every acked write exactly once."""
    if shutil.which("nft") is None:
        pytest.skip("nft not installed")
    c = NatsCluster(tmp_path / "nats", size=3, extra_config=PARTITION_CONFIG)
    n0, n1, n2 = c.nodes
    run_as_nobody(n2)
    table = PART_TABLE + uuid.uuid4().hex[:6]
    majority = minority = None
    try:
        c.start()
        majority = await connect(",".join([n0.url, n1.url]), name="majority", max_reconnect_attempts=-1)
        minority = await connect(n2.url, name="minority", max_reconnect_attempts=-1)
        js = majority.jetstream(timeout=10)
        await eventually(lambda: succeeds(js.add_stream(name="PART", subjects=["part.>"], num_replicas=3, duplicate_window=600)),
                         timeout=60, interval=0.5, what="the R3 stream made")

        async def n2_leads() -> bool:
            try:
                si = await js.stream_info("PART")
            except Exception:  # noqa: BLE001 - an election under way
                return False
            if si.cluster is not None and si.cluster.leader == n2.server_name:
                return True
            with contextlib.suppress(Exception):
                await majority.request("$JS.API.STREAM.LEADER.STEPDOWN.PART", b"", timeout=5)
            return False

        await eventually(n2_leads, timeout=90, interval=1.0, what="n2 leading the stream")
        pub = Publisher(majority, timeout_s=5)
        acked: list[str] = []
        for i in range(100):
            await write_until_acked(pub, i, acked)
        cut_off(table, n2, [n0, n1])
        try:
            async def majority_leads() -> bool:
                try:
                    si = await js.stream_info("PART")
                except Exception:  # noqa: BLE001 - an election under way
                    return False
                return si.cluster is not None and si.cluster.leader in (n0.server_name, n1.server_name)

            await eventually(majority_leads, timeout=90, interval=0.5, what="a leader on the majority side")
            for i in range(100, 600):
                await asyncio.wait_for(write_until_acked(pub, i, acked), 60)
            # the control: through the cut-off node nothing is acked
            lone = Publisher(minority, timeout_s=3)
            with pytest.raises((StoreError, TimeoutError)):
                await lone.store("part.lone", b"x", {S.HDR_MSG_ID: "lone-1"})
            await lone.stop()
        finally:
            heal(table)
        assert len(acked) == 600

        async def n2_current() -> bool:
            try:
                si = await js.stream_info("PART")
            except Exception:  # noqa: BLE001
                return False
            reps = {r.name: r for r in (si.cluster.replicas or [])} if si.cluster else {}
            mine = {st["name"]: st["state"]["messages"] for a in n2.monitor("jsz?streams=true").get("account_details") or []
                    for st in a.get("stream_detail") or []}
            return all(r.current and not r.offline for r in reps.values()) and len(reps) == 2 and mine.get("PART") == si.state.messages

        await eventually(n2_current, timeout=120, interval=0.5, what="n2 caught up after the heal")
        seen: list[str] = []
        await eventually(lambda: succeeds(msg_ids(js, "PART"), into=seen), timeout=60, interval=0.5, what="the stream read back")
        missing = set(acked) - set(seen)
        assert not missing, f"{len(missing)} acked writes lost: {sorted(missing)[:10]}"
        twice = [m for m in acked if seen.count(m) > 1]
        assert twice == []
        await pub.stop()
    finally:
        heal(table)
        for x in (majority, minority):
            if x is not None:
                with contextlib.suppress(Exception):
                    await x.close()
        c.stop()
        shutil.rmtree(n2.data_dir, ignore_errors=True)
