"""``dsec up --cluster 3`` as a user runs it: three nats-server nodes (JetStream clustered, every stream
and bucket R3, the same users and permissions on each), every service and the client given the seed
list; a node SIGKILLed during creates is restarted by the supervisor and rejoins, and no create is lost.
Simulated hosts: this is about NATS, not containers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import tempfile
import uuid
from pathlib import Path

import pytest

from bus import subjects as S
from bus.auth import OPERATOR_ROLE, load_client_context, split_urls
from bus.errors import Unavailable
from bus.natsd import free_port
from bus.runtime import connect
from sdk._async import close_connections
from tests.conftest import eventually

from .conftest import PY, REPO, Child

DSEC = [PY, "-m", "sdk.cli"]
CREATES = 60


def free_run(n: int) -> int:
    """A port p with p .. p+n-1 all free (the nodes listen on consecutive ports)."""
    for _ in range(200):
        p = free_port()
        ok = True
        for q in range(p, p + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", q))
                except OSError:
                    ok = False
                    break
        if ok:
            return p
    raise RuntimeError("no run of free ports")


@pytest.fixture
async def stack():
    uid = uuid.uuid4().hex[:6]
    data = Path(tempfile.mkdtemp(prefix=f"dsec-upcl-{uid}-", dir="/tmp"))
    pointer = data.parent / f"{data.name}.context.json"
    port, route = free_run(3), free_run(3)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST") and k not in ("DSEC_NATS_URL", "DSEC_NATS_REPLICAS")}
    env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    child = Child([*DSEC, "up", "--backend", "sim", "--cluster", "3", "--data-dir", str(data), "--port", str(port), "--cluster-port", str(route),
                   "--http-port", str(free_port()), "--host-id", f"upcl-{uid}", "--reclaim", "off", "--ready-timeout", "240", "--context", str(pointer)],
                  env, data.parent / f"{data.name}.log").start()
    try:
        await eventually(lambda: "dsec up: ready" in child.log() or not child.alive(), timeout=240, interval=0.2, what="dsec up to print ready")
        assert child.alive(), child.log()
        yield child, data, pointer, port
    finally:
        await close_connections()
        if child.alive():
            child.signal(signal.SIGTERM)
            with contextlib.suppress(Exception):
                await child.wait(90)
        if child.alive():
            child.signal(signal.SIGKILL)
            await child.wait(10)
        shutil.rmtree(data, ignore_errors=True)
        for p in (pointer, data.parent / f"{data.name}.log"):
            p.unlink(missing_ok=True)


def services(data: Path) -> dict[str, dict]:
    return {s["name"]: s for s in json.loads((data / "services.json").read_text())["services"]}


async def test_up_cluster_3_replicates_secures_every_node_and_rides_through_a_node_loss(stack) -> None:
    from sdk import AsyncSandbox

    child, data, pointer, port = stack
    ctx = load_client_context(pointer)
    assert ctx is not None
    seeds = split_urls(ctx.url)
    assert [u.rsplit(":", 1)[1] for u in seeds] == [str(port + i) for i in range(3)]
    assert all(u.startswith(f"nats://{OPERATOR_ROLE}:") for u in seeds)  # credentials on every seed
    # Every node carries the users and permissions: none lets an anonymous client in (the server's
    # own refusal), each lets the operator in and serves the replicated streams (the control).
    for i in range(3):
        with pytest.raises(Unavailable, match="(?i)authorization violation"):
            await connect(f"nats://127.0.0.1:{port + i}", name="anon", connect_attempts=1, connect_timeout_s=5)
        nc = await connect(seeds[i], name="op", connect_attempts=3, connect_timeout_s=10)
        try:
            si = await nc.jetstream().stream_info(S.STREAM_REQ)
            assert si.config.num_replicas == 3 and si.cluster is not None and len(si.cluster.replicas or []) == 2
            kv = await nc.jetstream().stream_info(f"KV_{S.KV_SANDBOXES}")
            assert kv.config.num_replicas == 3
        finally:
            await nc.close()

    # Creates through the client, while the node leading DSEC_REQ is SIGKILLed.
    nc = await connect(ctx.url, name="probe")
    leader = (await nc.jetstream().stream_info(S.STREAM_REQ)).cluster.leader
    await nc.close()
    victim = f"nats-server-{leader.rsplit('-', 1)[1]}"
    old = services(data)[victim]

    async def one(i: int):
        await asyncio.sleep(i * 0.05)  # its place in the burst
        return await AsyncSandbox.create("base", backend="sim", nats_url=ctx.url, create_timeout=120)

    burst = [asyncio.create_task(one(i)) for i in range(CREATES)]
    await asyncio.sleep(0.5)  # into the burst: creates in flight when the node dies
    os.kill(old["pid"], signal.SIGKILL)
    made = await asyncio.wait_for(asyncio.gather(*burst), 300)
    ids = [sb.sandbox_id for sb in made]
    assert len(set(ids)) == CREATES  # every create answered with its own sandbox: none lost

    async def back() -> bool:
        now = services(data)[victim]
        return now["state"] == "running" and now["pid"] != old["pid"] and now["restarts"] == old["restarts"] + 1

    await eventually(back, timeout=60, interval=0.2, what=f"{victim} restarted by the supervisor")
    assert "exited with signal 9 (SIGKILL)" in child.log(50000)
    # ... and rejoined: every replica of DSEC_REQ current again.
    nc = await connect(ctx.url, name="probe")
    try:
        async def rejoined() -> bool:
            try:
                si = await nc.jetstream().stream_info(S.STREAM_REQ)
            except Exception:  # noqa: BLE001 - an election under way
                return False
            reps = si.cluster.replicas or [] if si.cluster else []
            return len(reps) == 2 and all(r.current and not r.offline for r in reps)

        await eventually(rejoined, timeout=120, interval=0.5, what=f"{victim} rejoined DSEC_REQ")
    finally:
        await nc.close()
    sb = await AsyncSandbox.create("base", backend="sim", nats_url=ctx.url, create_timeout=60)
    assert sb.sandbox_id not in ids
    await close_connections()
    child.signal(signal.SIGTERM)
    assert await child.wait(120) == 0, child.log()
    assert not (data / "services.json").exists()
