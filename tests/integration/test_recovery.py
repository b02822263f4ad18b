"""A host agent SIGKILLed and restarted keeps its sandboxes usable.

The agent runs as its own process (``python -m hostagent``) with its own data dir, host id and pool;
placement and the ``base`` template come from the session's stack. The agent leaves its private
containerd running while sandboxes live, so a restarted agent adopts it and recovers them; once they
are all killed, a clean SIGTERM stops containerd too, and nothing of the data dir is left running.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest
from nats.js.errors import KeyNotFoundError

from bus import codec
from bus import subjects as S
from bus.streams import ensure_kv
from sdk import AsyncSandbox, SandboxNotFound
from tests.conftest import eventually

from .conftest import (
    PY,
    Child,
    Stack,
    assert_sandbox_gone,
    data_dir_leftovers,
    force_cleanup,
    needs_stack,
    pid_alive,
    processes_mentioning,
    subprocess_env,
)

pytestmark = [pytest.mark.containerd, needs_stack]


async def _host_ready_since(stack: Stack, host_id: str, since: float) -> bool:
    kv = await ensure_kv(stack.js, S.KV_HOSTS)
    try:
        st = codec.HOST_STATUS.decode((await kv.get(host_id)).value)
    except KeyNotFoundError:
        return False
    return st.state == "ready" and st.at >= since


async def test_agent_sigkill_and_restart_keeps_sandboxes(stack: Stack) -> None:
    uid = stack.new_id("rec")
    host_id, pool = uid, uid
    data = Path(tempfile.mkdtemp(prefix="dsec-rec-", dir="/tmp"))
    argv = [PY, "-m", "hostagent", "--data-dir", str(data), "--host-id", host_id, "--pool", pool, "--concurrency", "4"]
    env = subprocess_env(stack.url)
    log = data.parent / f"{data.name}.log"
    agents: list[Child] = []
    sbs: list[AsyncSandbox] = []
    try:
        t0 = time.time()
        agents.append(Child(argv, env, log).start())
        await eventually(lambda: _host_ready_since(stack, host_id, t0), timeout=90, interval=0.1, what="the host agent to come up")
        await eventually(lambda: all(host_id in p.table.hosts for p in stack.placements), timeout=15, what="placement to see it")

        sbs = list(await asyncio.gather(*(
            AsyncSandbox.create(**stack.kw(pool=pool, sandbox_id=f"{uid}-{i}", memory_mb=48, create_timeout=60)) for i in range(3)
        )))
        assert {sb.host_id for sb in sbs} == {host_id}
        for i, sb in enumerate(sbs):
            await sb.files.write("/workspace/state.txt", f"before-crash-{i}")
            await sb.commands.run(f"echo {i} > /tmp/n; sleep 1000 >/dev/null 2>&1 &")
        state = {p.stem: json.loads(p.read_text()) for p in (data / "hosts" / host_id / "sandboxes").glob("*.json")}
        pids = {sid: st["pid"] for sid, st in state.items()}
        assert set(pids) == {sb.sandbox_id for sb in sbs}
        containerd_pid = int((data / "containerd" / "containerd.pid").read_text())

        # SIGKILL: no clean-up at all. The sandboxes and containerd keep running without their agent.
        agents[0].signal(signal.SIGKILL)
        assert await agents[0].wait(30) == -signal.SIGKILL
        assert all(pid_alive(p) for p in pids.values()) and pid_alive(containerd_pid)
        with pytest.raises(SandboxNotFound):
            await sbs[0].commands.run("true")  # nobody serves it while the agent is down

        # Restart: the new agent adopts containerd and recovers every sandbox with its state.
        t1 = time.time()
        agents.append(Child(argv, env, log).start())
        await eventually(lambda: _host_ready_since(stack, host_id, t1), timeout=90, interval=0.1, what="the restarted agent")

        async def answers(sb: AsyncSandbox) -> bool:
            try:
                await sb.commands.run("true")
                return True
            except SandboxNotFound:
                return False

        for sb in sbs:
            await eventually(lambda sb=sb: answers(sb), timeout=30, interval=0.1, what=f"{sb.sandbox_id} to answer again")
        for i, sb in enumerate(sbs):
            assert await sb.files.read("/workspace/state.txt") == f"before-crash-{i}"
            r = await sb.commands.run("cat /tmp/n; ps -o args | grep -c '^sleep 1000'")
            assert r.stdout.split() == [str(i), "1"], r.stdout  # processes inside survived too
            await sb.files.write("/workspace/after.txt", "after")
            assert (await sb.get_info()).host_id == host_id
        assert int((data / "containerd" / "containerd.pid").read_text()) == containerd_pid  # adopted, not restarted
        for sid, pid in pids.items():
            assert pid_alive(pid), sid
        # The audit trail says so.
        kinds = await _event_kinds(stack, sbs[0].sandbox_id)
        assert "recovered" in kinds, kinds
        # New work still lands on the restarted agent.
        extra = await AsyncSandbox.create(**stack.kw(pool=pool, sandbox_id=f"{uid}-new", memory_mb=48, create_timeout=60))
        sbs.append(extra)
        assert (await extra.commands.run("echo new")).stdout == "new\n"

        # Kill them all; each leaves nothing behind.
        await asyncio.gather(*(sb.kill() for sb in sbs))
        for sb in sbs:
            await assert_sandbox_gone(sb.sandbox_id, data, host_id=host_id, pid=pids.get(sb.sandbox_id))
        sbs = []

        # A clean stop with no sandboxes left stops the private containerd as well.
        assert await agents[1].stop(timeout=60) == 0, agents[1].log()
        await eventually(lambda: not pid_alive(containerd_pid), timeout=30, what="containerd to stop")
        await eventually(
            lambda: not processes_mentioning(str(data)), timeout=30, what=f"no containerd or shim of the data dir: {processes_mentioning(str(data))}"
        )
        left = data_dir_leftovers(data)
        assert not left, left
    finally:
        for sb in sbs:
            try:
                await sb.kill()
            except Exception:  # noqa: BLE001 - the agent may be down: force_cleanup below
                pass
        for a in agents:
            if a.alive():
                a.signal(signal.SIGKILL)
                await a.wait(10)
        if data_dir_leftovers(data) or (data / "containerd" / "containerd.sock").exists():
            await force_cleanup(data)
        kv = await ensure_kv(stack.js, S.KV_HOSTS)
        try:
            await kv.delete(host_id)
        except Exception:  # noqa: BLE001
            pass
        if not data_dir_leftovers(data):
            shutil.rmtree(data, ignore_errors=True)
            log.unlink(missing_ok=True)


async def _event_kinds(stack: Stack, sid: str) -> list[str]:
    from nats.js.api import ConsumerConfig, DeliverPolicy

    sub = await stack.js.subscribe(
        S.evt_sandbox_all(sid), stream=S.STREAM_EVT, ordered_consumer=True, config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
    )
    kinds: list[str] = []
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=1.0)
            except Exception:  # noqa: BLE001 - caught up
                break
            kinds.append(codec.EVENT.decode(msg.data).kind)
            if msg.metadata.num_pending == 0:
                break
    finally:
        await sub.unsubscribe()
    return kinds
