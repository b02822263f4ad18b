"""``dsec up`` as a user runs it (authenticated NATS, a client context, supervision), as its own process
on a free port with its own data dir and its own network names; the CLI as its own process against it.

One stack for the module: the client context and the README's image build first, then ``kill -9`` of
each service in turn during a burst of creates, then SIGTERM and nothing left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from bus.auth import load_client_context, with_credentials
from bus.errors import DsecError
from bus.natsd import free_port
from sdk._async import close_connections
from sdk.gateway._keys import parse_key
from tests.conftest import eventually
from tests.netclaim import NetClaim, claim_net

from .conftest import PY, REPO, Child, data_dir_leftovers, needs_stack, pid_alive, processes_mentioning

pytestmark = [pytest.mark.containerd, needs_stack]

DSEC = [PY, "-m", "sdk.cli"]


@dataclass
class Up:
    child: Child
    data: Path
    pointer: Path
    url: str  # without credentials
    host_id: str
    net: NetClaim  # this stack's own nft table, veths, netns, pool, NFLOG group (apart from other stacks')

    def env(self, **extra: str) -> dict[str, str]:
        """A client's environment: this repo importable, the stack found through its context only."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST") and k not in ("DSEC_NATS_URL", "DSEC_NATS_CREDS")}
        env["PYTHONPATH"] = str(REPO)
        env["DSEC_CONTEXT"] = str(self.pointer)
        env.update(extra)
        return env

    @property
    def operator_url(self) -> str:
        ctx = load_client_context(self.pointer)
        assert ctx is not None
        return ctx.url

    def services(self) -> dict[str, dict[str, Any]]:
        return {s["name"]: s for s in json.loads((self.data / "services.json").read_text())["services"]}


async def dsec(*args: str, env: dict[str, str], timeout: float = 120) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *DSEC, *args, cwd=str(REPO), env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    return proc.returncode or 0, out.decode(), err.decode()


def one_line_error(err: str) -> None:
    assert "Traceback" not in err, err
    assert len([ln for ln in err.splitlines() if ln.strip()]) == 1, err


@contextlib.asynccontextmanager
async def running_up(tag: str) -> AsyncIterator[Up]:
    """``dsec up`` on a free port, own data dir, own context pointer and network names; whatever the
    test did, everything is stopped and cleaned at the end."""
    uid = uuid.uuid4().hex[:6]
    data = Path(tempfile.mkdtemp(prefix=f"dsec-{tag}-{uid}-", dir="/tmp"))
    pointer = data.parent / f"{data.name}.context.json"
    port = free_port()
    host_id = f"{tag}-{uid}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST") and k != "DSEC_NATS_URL"}
    net = await asyncio.to_thread(claim_net)
    env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", **net.env())
    child = Child([*DSEC, "up", "--data-dir", str(data), "--port", str(port), "--http-port", str(free_port()), "--host-id", host_id,
                   "--ready-timeout", "240", "--context", str(pointer)],
                  env, data.parent / f"{data.name}.log").start()
    u = Up(child, data, pointer, f"nats://127.0.0.1:{port}", host_id, net)
    try:
        await eventually(lambda: "dsec up: ready" in child.log() or not child.alive(), timeout=240, interval=0.2, what="dsec up to print ready")
        assert child.alive(), child.log()
        yield u
    finally:
        await close_connections()
        if child.alive():
            child.signal(signal.SIGKILL)
            await child.wait(10)
        if data_dir_leftovers(data) or _nft_table_exists(u):  # the test failed half-way: the host agent's own clean-up
            await asyncio.to_thread(subprocess.run, [PY, "-m", "hostagent", "--cleanup", "--data-dir", str(data)], env=env, capture_output=True, timeout=180)
        net.release()  # a slot whose names are still in the kernel is passed over by the next claim
        if not data_dir_leftovers(data):
            shutil.rmtree(data, ignore_errors=True)
            for p in (pointer, data.parent / f"{data.name}.log"):
                p.unlink(missing_ok=True)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def up() -> AsyncIterator[Up]:
    async with running_up("upsv") as u:
        yield u


# ------------------------------------------------------------------------------------------ the CLI
async def test_client_context_reaches_the_stack_as_the_operator(up: Up) -> None:
    ctx_file = up.data / "client.json"
    assert stat.S_IMODE(ctx_file.stat().st_mode) == 0o600 and stat.S_IMODE(up.pointer.stat().st_mode) == 0o600
    ctx = load_client_context(up.pointer)
    assert ctx is not None and ctx.nats_url == up.url and ctx.user == "admin" and ctx.data_dir == str(up.data)
    rc, out, err = await dsec("status", "--json", env=up.env())
    assert rc == 0, (out, err)
    st = json.loads(out)
    assert st["ok"] and any(h["host_id"] == up.host_id and h["state"] == "ready" for h in st["hosts"])
    assert ctx.password not in out and st["nats_url"].endswith(f"@127.0.0.1:{up.url.rsplit(':', 1)[1]}")
    names = {s["name"]: s for s in st["services"]}
    assert {"nats-server", "imaged", "lazy-loader", "placement-0", "guard", "hostagent"} <= set(names)  # and whatever SERVICES adds
    assert all(s["state"] == "running" and s["pid"] and s["restarts"] == 0 and s["up_since"] for s in names.values()), names
    rc, out, _ = await dsec("status", env=up.env())
    assert rc == 0 and "services (dsec up):" in out and "hostagent" in out and ctx.password not in out
    # DSEC_NATS_URL overrides the context: without credentials, refused in one line.
    rc, out, err = await dsec("image", "ls", "--json", env=up.env(DSEC_NATS_URL=up.url))
    assert rc == 1 and "Authorization Violation" in err, (rc, out, err)
    one_line_error(err)


async def test_readme_image_build_on_the_default_stack(up: Up, tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    (ws / "app").mkdir(parents=True)
    (ws / "app" / "hello.txt").write_text("from the workspace\n")
    name = f"readme-{uuid.uuid4().hex[:6]}"
    # As the README shows it: dsec image build NAME --base SRC [--workspace SRC]
    rc, out, err = await dsec("image", "build", name, "--base", "template:base", "--workspace", str(ws), env=up.env(), timeout=300)
    assert rc == 0, (out, err)
    assert f"template {name}: 2 layer(s)" in out
    rc, out, err = await dsec("image", "ls", "--json", env=up.env())
    assert rc == 0 and name in {t["name"] for t in json.loads(out)}, (out, err)
    rc, out, err = await dsec("sandbox", "create", "--template", name, "--memory-mb", "64", env=up.env())
    assert rc == 0, err
    sid = out.strip()
    try:
        rc, out, err = await dsec("sandbox", "exec", sid, "--", "cat", "/app/hello.txt", env=up.env())
        assert (rc, out) == (0, "from the workspace\n"), err
    finally:
        rc, _, err = await dsec("sandbox", "kill", sid, env=up.env())
        assert rc == 0, err
    rc, _, err = await dsec("image", "rm", name, env=up.env())
    assert rc == 0, err

    # Without credentials the same command is refused, in one line; an API key lists templates.
    rc, out, err = await dsec("image", "build", f"{name}-anon", "--base", "template:base", env=up.env(DSEC_NATS_URL=up.url), timeout=60)
    assert rc == 1 and "Authorization Violation" in err, (out, err)
    one_line_error(err)
    rc, key, err = await dsec("api-key", "create", "--name", "builder", env=up.env())
    assert rc == 0, err
    tenant_url = with_credentials(up.url, *parse_key(key.strip()))
    rc, out, err = await dsec("image", "ls", "--json", env=up.env(DSEC_NATS_URL=tenant_url))
    assert rc == 0 and "base" in {t["name"] for t in json.loads(out)}, (out, err)


async def test_readme_build_python_on_the_default_stack(up: Up) -> None:
    rc, out, err = await dsec("image", "build-python", env=up.env(), timeout=1800)
    assert rc == 0, (out, err)
    rc, out, err = await dsec("sandbox", "create", "--template", "python", "--memory-mb", "256", env=up.env())
    assert rc == 0, err
    sid = out.strip()
    try:
        rc, out, err = await dsec("sandbox", "exec", sid, "--", "python3", "-c", "print(6*7)", env=up.env())
        assert (rc, out) == (0, "42\n"), err
    finally:
        await dsec("sandbox", "kill", sid, env=up.env())


async def test_expected_failures_are_one_line(up: Up) -> None:
    rc, _, err = await dsec("sandbox", "create", "--template", f"nope-{uuid.uuid4().hex[:6]}", env=up.env())
    assert rc == 1 and "unknown_template" in err
    one_line_error(err)
    rc, _, err = await dsec("sandbox", "create", "--cpu", "0", env=up.env())
    assert rc == 1 and "invalid_argument" in err
    one_line_error(err)
    rc, _, err = await dsec("image", "build", "x", "--base", "/nonexistent/dir", env=up.env())
    assert rc == 1 and "invalid_argument" in err
    one_line_error(err)
    rc, _, err = await dsec("sandbox", "exec", "sb-doesnotexist", "--", "true", env=up.env())
    assert rc == 1 and "sandbox_not_found" in err
    one_line_error(err)
    rc, _, err = await dsec("image", "build", "x", env=up.env())  # --base missing: argparse's usage + one error line
    assert rc == 2 and "--base" in err and "Traceback" not in err


# ------------------------------------------------------------------------------------ supervision
KILL_ORDER = ["placement-0", "hostagent", "guard", "imaged", "lazy-loader", "nats-server"]
BURST = 10
BURST_SPACING_S = 0.3  # creates start over ~3 s: before, during and after the kill and the restart
CREATE_TIMEOUT = 60.0


async def _create_one(url: str, delay: float) -> Any:
    from sdk import AsyncSandbox

    await asyncio.sleep(delay)  # this create's place in the burst
    try:
        return await AsyncSandbox.create(nats_url=url, memory_mb=32, cpu=0.1, create_timeout=CREATE_TIMEOUT, timeout=600)
    except DsecError as exc:
        return exc


async def _shim_cgroups(data: Path) -> set[Path]:
    """The per-sandbox cgroup dirs of every container init under this stack's shims."""
    out: set[Path] = set()
    for pid, cmd in processes_mentioning(str(data)).items():
        if "containerd-shim" not in cmd:
            continue
        try:
            kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            continue
        for k in kids:
            try:
                lines = Path(f"/proc/{k}/cgroup").read_text().splitlines()
            except OSError:
                continue
            for ln in lines:
                _, ctl, path = ln.split(":", 2)
                if path.startswith("/dsec/") and ctl:
                    out |= {Path("/sys/fs/cgroup") / c.removeprefix("name=") / path.lstrip("/") for c in ctl.split(",")}
    return out


async def test_kill_9_of_each_service_during_creates_then_sigterm_leaves_nothing(up: Up) -> None:
    from sdk import AsyncSandbox

    url = up.operator_url
    before = [
        await AsyncSandbox.create(nats_url=url, memory_mb=32, create_timeout=CREATE_TIMEOUT, timeout=900),
        # With a network: the stack's nft table, veth and netns exist, and must survive and then go.
        await AsyncSandbox.create(nats_url=url, memory_mb=32, create_timeout=CREATE_TIMEOUT, timeout=900, network={"allow_out": ["192.0.2.1/32"]}),
    ]
    assert (await before[1].commands.run("ip -o addr show eth0")).exit_code == 0
    assert _nft_table_exists(up)
    outcomes: dict[str, list[str]] = {}
    for name in KILL_ORDER:
        old = up.services()[name]
        assert old["state"] == "running" and old["pid"], old
        burst = [asyncio.create_task(_create_one(url, i * BURST_SPACING_S)) for i in range(BURST)]
        await asyncio.sleep(2 * BURST_SPACING_S)  # into the burst: creates in flight when the service dies
        os.kill(old["pid"], signal.SIGKILL)

        async def back(name: str = name, old: dict[str, Any] = old) -> bool:
            rc, out, _ = await dsec("status", "--json", env=up.env(), timeout=20)
            s = {x["name"]: x for x in (json.loads(out).get("services") or [])} if out.strip() else {}
            now = s.get(name, {})
            return now.get("state") == "running" and now.get("pid") not in (None, old["pid"]) and now["restarts"] == old["restarts"] + 1

        await eventually(back, timeout=10, interval=0.2, what=f"{name} back after kill -9")
        # Every create returns within its own timeout: a sandbox or a typed error, none lost.
        done = await asyncio.wait_for(asyncio.gather(*burst), BURST * BURST_SPACING_S + CREATE_TIMEOUT + 15)
        outcomes[name] = []
        made = []
        for r in done:
            if isinstance(r, DsecError):
                assert r.code and r.code != "internal", (name, r)
                outcomes[name].append(r.code)
            else:
                assert isinstance(r, AsyncSandbox), (name, r)
                made.append(r)
                outcomes[name].append("ok")

        # The sandboxes from before still answer (a host agent takes a moment to recover them).
        async def answer() -> bool:
            try:
                return [(await sb.commands.run("echo alive", timeout=10)).stdout for sb in before] == ["alive\n"] * len(before)
            except DsecError:
                return False

        await eventually(answer, timeout=60, interval=0.5, what=f"sandboxes from before to answer after kill -9 of {name}")
        for sb in made:
            assert (await sb.commands.run("echo made")).stdout == "made\n"
            await sb.kill()
    assert up.child.log(50000).count("exited with signal 9 (SIGKILL)") == len(KILL_ORDER)
    assert sum(o.count("ok") for o in outcomes.values()) >= len(KILL_ORDER), outcomes

    cgroups = await _shim_cgroups(up.data)
    assert cgroups, "no sandbox cgroups seen"
    await close_connections()  # before NATS goes: a closed connection is no one's to drain later
    up.child.signal(signal.SIGTERM)
    await assert_stopped_leaving_nothing(up, cgroups)
    print(f"create outcomes per killed service: {outcomes}")


def _nft_table_exists(up: Up) -> bool:
    return subprocess.run(["nft", "list", "table", "inet", up.net.table], capture_output=True).returncode == 0


async def assert_stopped_leaving_nothing(up: Up, cgroups: set[Path]) -> None:
    assert await up.child.wait(240) == 0, up.child.log()
    assert "dsec up: stopped" in up.child.log()
    left = data_dir_leftovers(up.data)  # containerd, shims, FUSE holder, agents' mounts, layer mounts, loop devices
    assert not left, left
    assert not [c for c in cgroups if c.exists()]
    netns = [n for n in os.listdir("/run/netns") if n.startswith(up.net.netns_prefix)] if os.path.isdir("/run/netns") else []
    assert not netns, netns
    assert not _nft_table_exists(up)
    assert not up.pointer.exists() and not (up.data / "services.json").exists()


async def test_sigterm_right_after_crashes_still_leaves_nothing() -> None:
    """The host agent, the lazy loader and guard die by SIGKILL with sandboxes running (nobody to remove
    them), and the stop comes before any restart: the final sweep removes what they left."""
    from sdk import AsyncSandbox

    async with running_up("upcr") as up:
        url = up.operator_url
        sbs = [
            await AsyncSandbox.create(nats_url=url, memory_mb=32, create_timeout=CREATE_TIMEOUT),
            await AsyncSandbox.create(nats_url=url, memory_mb=32, create_timeout=CREATE_TIMEOUT, network={"allow_out": ["192.0.2.1/32"]}),
        ]
        for sb in sbs:
            assert (await sb.commands.run("echo up")).stdout == "up\n"
        assert _nft_table_exists(up)
        cgroups = await _shim_cgroups(up.data)
        assert cgroups
        svc = up.services()
        await close_connections()
        for name in ("hostagent", "lazy-loader", "guard"):
            os.kill(svc[name]["pid"], signal.SIGKILL)
        up.child.signal(signal.SIGTERM)
        await assert_stopped_leaving_nothing(up, cgroups)
        assert "restarted hostagent" not in up.child.log(50000)
        swept = (up.data / "logs" / "cleanup.log").read_text()
        assert swept.count("removing_orphan_container") >= len(sbs), swept[-3000:]


async def test_a_killed_supervisor_takes_its_services_along() -> None:
    """SIGKILL of `dsec up` itself (nothing to stop anything): every service gets SIGTERM from the kernel
    and stops as on a Ctrl-C, the host agent removing its sandboxes; `bash compose/dev.sh clean` (the host agent's clean-up) does the rest."""
    from sdk import AsyncSandbox

    async with running_up("upkl") as up:
        sb = await AsyncSandbox.create(nats_url=up.operator_url, memory_mb=32, create_timeout=CREATE_TIMEOUT)
        assert (await sb.commands.run("echo up")).stdout == "up\n"
        await close_connections()
        cgroups = await _shim_cgroups(up.data)
        assert cgroups
        services = {n: s["pid"] for n, s in up.services().items() if n != "nats-server"}
        up.child.signal(signal.SIGKILL)
        await up.child.wait(10)
        await eventually(lambda: not any(pid_alive(p) for p in services.values()), timeout=90, what="the services to stop")
        assert "service_stopped" in (up.data / "logs" / "hostagent.log").read_text()
        rc = await asyncio.to_thread(
            subprocess.run, [PY, "-m", "hostagent", "--cleanup", "--data-dir", str(up.data)], env=up.env(**up.net.env()), capture_output=True,
        )
        assert rc.returncode == 0, rc.stderr[-2000:]
        left = data_dir_leftovers(up.data)
        assert not left, left
        assert not [c for c in cgroups if c.exists()] and not _nft_table_exists(up)
