"""The ``dsec`` command line, run as a separate process (``python -m sdk.cli``) against the real stack,
and ``dsec up`` end to end once."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil
import signal
import tempfile
import urllib.request
import uuid
from pathlib import Path

import pytest

from bus.metrics import parse
from bus.natsd import free_port
from tests.conftest import eventually, needs
from tests.netclaim import claim_net

from .conftest import PY, REPO, Child, Stack, data_dir_leftovers, force_cleanup, needs_stack, run_process, subprocess_env

pytestmark = [pytest.mark.containerd, needs_stack]

DSEC = [PY, "-m", "sdk.cli"]


async def dsec(*args: str, url: str, timeout: float = 120, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run ``dsec ARGS`` as its own process; (exit code, stdout, stderr)."""
    return await run_process(*DSEC, *args, env=env or subprocess_env(url), timeout=timeout, cwd=str(REPO))


async def test_status(stack: Stack) -> None:
    rc, out, err = await dsec("status", "--json", url=stack.url)
    assert rc == 0, (out, err)
    st = json.loads(out)
    assert st["ok"] is True and st["ready_hosts"] >= 1
    mine = [h for h in st["hosts"] if h["host_id"] == stack.host_id]
    assert mine and mine[0]["state"] == "ready" and mine[0]["backend"] == "container" and mine[0]["pool"] == stack.pool
    assert "base" in st["templates"]
    # what the host stores: its free disk, and the snapshots' bytes against the limits it enforces
    assert 0 < mine[0]["disk_free_mb"] <= mine[0]["disk_total_mb"]
    storage = st["storage"]
    assert storage["limits"]["snapshot_bytes_per_tenant"] > 0 and storage["disk_free_mb"][stack.host_id] == mine[0]["disk_free_mb"]
    assert all(set(u) == {"used_bytes", "limit_bytes"} for u in storage["tenants"].values())
    rc, out, err = await dsec("status", url=stack.url)
    assert rc == 0 and stack.host_id in out and "disk free=" in out and "snapshots: " in out, (out, err)


async def test_unreachable_stack_is_one_line_within_5s() -> None:
    closed = f"nats://127.0.0.1:{free_port()}"
    commands = (["sandbox", "ls"], ["sandbox", "create"], ["image", "ls"], ["image", "build", "x", "--base", "template:base"], ["audit", "replay"], ["status"])
    for args in commands:
        rc, out, err = await dsec(*args, url=closed, timeout=5)  # the whole process, start-up included
        assert rc == 1, (args, out, err)
        assert "cannot reach NATS" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, (args, err)


async def test_status_without_nats() -> None:
    closed = f"nats://127.0.0.1:{free_port()}"
    rc, out, err = await dsec("status", "--json", "--timeout", "2", url=closed, timeout=60)
    assert rc == 1, (out, err)
    st = json.loads(out)
    assert st["ok"] is False and st["error"] == "unavailable"
    assert "Traceback" not in err
    rc, out, err = await dsec("status", "--timeout", "2", url=closed, timeout=60)
    assert rc == 1 and "cannot reach NATS" in err


async def test_sandbox_commands_and_audit(stack: Stack) -> None:
    url = stack.url
    rc, out, err = await dsec(
        "sandbox", "create", "--pool", stack.pool, "--memory-mb", "64", "--env", "GREETING=hello", "--json", url=url
    )
    assert rc == 0, err
    sid = json.loads(out)["sandbox_id"]
    assert json.loads(out)["host_id"] == stack.host_id
    pid = stack.pid_of(sid)
    try:
        rc, out, err = await dsec("sandbox", "exec", sid, "--", "sh", "-c", "echo $GREETING world; echo to-err >&2", url=url)
        assert (rc, out, err) == (0, "hello world\n", "to-err\n")
        rc, out, _ = await dsec("sandbox", "exec", sid, "echo a | tr a b", url=url)  # one argument: a shell line
        assert (rc, out) == (0, "b\n")
        rc, out, _ = await dsec("sandbox", "exec", "--cwd", "/tmp", sid, "--", "pwd", url=url)
        assert (rc, out) == (0, "/tmp\n")
        rc, out, err = await dsec("sandbox", "exec", sid, "--", "sh", "-c", "exit 4", url=url)
        assert rc == 4  # the command's exit code is the CLI's

        rc, out, _ = await dsec("sandbox", "ls", "--json", url=url)
        assert rc == 0
        listed = {i["sandbox_id"]: i for i in json.loads(out)}
        assert listed[sid]["state"] == "running" and listed[sid]["host_id"] == stack.host_id
        rc, out, _ = await dsec("sandbox", "ls", url=url)
        assert rc == 0 and sid in out
    finally:
        rc, out, err = await dsec("sandbox", "kill", sid, url=url)
    assert rc == 0, err
    await stack.assert_gone(sid, pid)
    rc, _, err = await dsec("sandbox", "exec", sid, "--", "true", url=url)
    assert rc == 1 and "sandbox_not_found" in err
    rc, out, _ = await dsec("sandbox", "ls", "--json", url=url)
    assert sid not in {i["sandbox_id"] for i in json.loads(out)}

    # The audit trail of that sandbox, from the event stream.
    rc, out, err = await dsec("audit", "replay", "--sandbox", sid, "--json", url=url)
    assert rc == 0, err
    events = [json.loads(line) for line in out.splitlines() if line.strip()]
    kinds = [e["kind"] for e in events]
    for kind in ("ready", "exec", "killed"):
        assert kind in kinds, (kind, kinds)
    assert kinds.index("ready") < kinds.index("exec") < kinds.index("killed")
    assert all(e["sandbox_id"] == sid for e in events)
    ready = [e for e in events if e["kind"] == "ready"][0]
    assert ready["host_id"] == stack.host_id
    # who placed it and how long the request waited for a host: facts of the ready event, not events of their own
    assert ready["detail"]["placed_by"] and float(ready["detail"]["placed_ms"]) >= 0, ready
    execs = [e for e in events if e["kind"] == "exec"]
    assert any(e["detail"].get("exit_code") == "4" for e in execs)
    assert [e for e in events if e["kind"] == "killed"][0]["detail"]["reason"] == "user"
    rc, out, err = await dsec("audit", "replay", "--sandbox", sid, "--kind", "exec", "--since", "10m", url=url)
    assert rc == 0 and out.count(" exec ") == len(execs), out
    rc, _, err = await dsec("audit", "replay", "--since", "yesterday-ish", url=url)
    assert rc == 1 and "--since" in err


async def test_sandbox_create_bad_arguments(stack: Stack) -> None:
    rc, _, err = await dsec("sandbox", "create", "--pool", stack.pool, "--cpu", "0", url=stack.url)
    assert rc == 1 and "cpu" in err and "invalid_argument" in err
    rc, _, err = await dsec("sandbox", "create", "--pool", stack.pool, "--env", "NOEQUALS", url=stack.url)
    assert rc == 2 and "K=V" in err
    rc, _, err = await dsec("sandbox", "create", "--pool", stack.pool, "--template", f"nope-{stack.uid}", url=stack.url)
    assert rc == 1 and "unknown_template" in err


# --------------------------------------------------------------------------------------------- dsec up
def _up_missing() -> str | None:
    for mod in ("imaged.__main__", "guard.__main__", "placement.__main__", "hostagent.__main__"):
        try:
            if importlib.util.find_spec(mod) is None:
                return f"{mod} is not there yet"
        except ModuleNotFoundError:
            return f"{mod} is not there yet"
    return None


@needs(_up_missing())
async def test_dsec_up_end_to_end() -> None:
    """``dsec up`` in the foreground: ready, a sandbox through the SDK, SIGINT, and nothing left behind."""
    from bus.auth import load_client_context
    from bus.errors import Unavailable
    from sdk import AsyncSandbox
    import sdk._async

    data = Path(tempfile.mkdtemp(prefix=f"dsec-up-{uuid.uuid4().hex[:6]}-", dir="/tmp"))
    port = free_port()
    url = f"nats://127.0.0.1:{port}"
    net = await asyncio.to_thread(claim_net)  # network names of its own: not the default ones other stacks share
    env = subprocess_env(url, DSEC_CONTEXT=str(data.parent / f"{data.name}.context.json"), **net.env())
    http_port = free_port()
    up = Child([*DSEC, "up", "--data-dir", str(data), "--port", str(port), "--http-port", str(http_port), "--host-id", f"up-{uuid.uuid4().hex[:6]}",
                "--ready-timeout", "240"],
               env, data.parent / f"{data.name}.log").start()
    try:
        await eventually(lambda: "dsec up: ready" in up.log() or not up.alive(), timeout=240, interval=0.2, what="dsec up to print ready")
        assert up.alive(), up.log()
        # Nothing connects without credentials; the operator's context `dsec up` wrote does.
        with pytest.raises(Unavailable, match="Authorization Violation"):
            await AsyncSandbox.create(nats_url=url, memory_mb=64, create_timeout=10)
        ctx = load_client_context(data.parent / f"{data.name}.context.json")
        assert ctx is not None and ctx.user == "admin"
        url = ctx.url
        sb = await AsyncSandbox.create(nats_url=url, memory_mb=64, create_timeout=60)
        try:
            assert (await sb.commands.run("echo up")).stdout == "up\n"
            await sb.files.write("/tmp/x", "y")
            assert await sb.files.read("/tmp/x") == "y"
        finally:
            await sb.kill()
        await sdk._async.close_connections()
        assert f"metrics: http://127.0.0.1:{http_port}/metrics" in up.log()
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10).read().decode())
        assert {"hostagent", "placement", "imaged", "guard", "lazy-loader", "gateway"} <= {lab.get("service") for _, lab, _ in parse(text)}, text[:2000]
        rc, out, err = await dsec("status", "--json", url=url)
        assert rc == 0, (out, err)
        up.signal(signal.SIGINT)
        rc = await up.wait(120)
        assert rc == 0, up.log()
        assert "stopped" in up.log()
        left = data_dir_leftovers(data)
        assert not left, left
    finally:
        if up.alive():
            up.signal(signal.SIGKILL)
            await up.wait(10)
        left = data_dir_leftovers(data)
        if left:
            await force_cleanup(data)
        if not data_dir_leftovers(data):
            shutil.rmtree(data, ignore_errors=True)
            for p in (data.parent / f"{data.name}.log", data.parent / f"{data.name}.context.json"):
                p.unlink(missing_ok=True)
        net.release()
