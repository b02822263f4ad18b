"""The compose stack for real: Docker builds the image FROM a base dsec makes itself (debootstrap +
docker import; no registry is reachable), brings up NATS, placement x2, guard, imaged, the lazy loader,
the host agent (its own containerd inside its container) and the gateway, creates a sandbox through the
SDK, reads the gateway's /metrics and /dashboard, and tears it all down leaving nothing behind.

Slow the first time on a machine (debootstrap, wheels, image build: a few minutes); cached after that.
Starts dockerd (--iptables=false) when none runs, and stops it again by pid.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import needs

from bus.metrics import parse
from bus.natsd import free_port

from .conftest import REPO, cgroups_of, loop_devices_backed_by, needs_stack

pytestmark = [
    pytest.mark.containerd,
    needs_stack,
    needs(None if shutil.which("dockerd") and shutil.which("docker-compose") else "docker.io / docker-compose not installed (bash compose/dev.sh install)"),
]

DOCKER = "/usr/bin/docker" if os.path.exists("/usr/bin/docker") else "docker"
SOCK = "/var/run/docker.sock"


def _docker(*args: str, timeout: float = 60) -> str:
    return subprocess.run([DOCKER, *args], check=True, capture_output=True, text=True, timeout=timeout).stdout


def _engine_answers() -> bool:
    try:
        _docker("info", "--format", "{{.ServerVersion}}", timeout=10)
        return True
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="module")
def docker_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The machine's Docker engine; started here (and stopped again, by pid) when none runs."""
    if os.path.exists(SOCK) and _engine_answers():
        yield
        return
    had_bridge = Path("/sys/class/net/docker0").exists()
    log = tmp_path_factory.mktemp("dockerd") / "dockerd.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(["dockerd", "--iptables=false"], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (os.path.exists(SOCK) and _engine_answers()):
            assert proc.poll() is None, f"dockerd exited {proc.returncode}: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"dockerd not answering: {log.read_text()[-3000:]}"
            time.sleep(0.2)  # engine start poll
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if not had_bridge and Path("/sys/class/net/docker0").exists():
            subprocess.run(["ip", "link", "del", "docker0"], check=False)  # dockerd leaves its default bridge


def _descendants(root: int) -> dict[int, str]:
    """Every process under ``root`` (pid -> start time), from /proc."""
    parent: dict[int, int] = {}
    start: dict[int, str] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(d)], start[int(d)] = int(fields[1]), fields[19]
    out: dict[int, str] = {}
    for pid in parent:
        p = pid
        while p > 1:
            if p == root:
                out[pid] = start[pid]
                break
            p = parent.get(p, 0)
    return out


def _dsec_cgroups(pids: dict[int, str]) -> set[str]:
    """Names of the /dsec/<name> cgroups those processes are in."""
    names = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cgroup") as f:
                for line in f:
                    path = line.rstrip("\n").split(":", 2)[2]
                    if path.startswith("/dsec/"):
                        names.add(path.split("/")[2])
        except OSError:
            continue
    return names


def _cgroup_name(proc_self_cgroup: str) -> str:
    return next(ln.split("/dsec/", 1)[1].split("/")[0] for ln in proc_self_cgroup.splitlines() if "/dsec/" in ln)


def _still_running(pids: dict[int, str]) -> list[int]:
    alive = []
    for pid, started in pids.items():
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[19] == started:
                    alive.append(pid)
        except OSError:
            continue
    return alive


async def _violation_of(url: str, sandbox_id: str, timeout: float = 60.0) -> Any:
    """The first guard violation naming ``sandbox_id`` in the event stream (read from its start)."""
    import nats

    from bus import codec
    from bus import subjects as S
    from bus.messages import GuardViolation

    nc = await nats.connect(url)
    try:
        sub = await nc.jetstream().subscribe(S.EVT_GUARD_VIOLATION, ordered_consumer=True, deliver_policy=nats.js.api.DeliverPolicy.ALL)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = await sub.next_msg(timeout=min(left, 5.0))
            except nats.errors.TimeoutError:
                continue
            v = codec.EVENT.decode(msg.data)
            if isinstance(v, GuardViolation) and v.sandbox_id == sandbox_id:
                return v
        raise AssertionError(f"no guard violation for {sandbox_id} within {timeout}s")
    finally:
        await nc.close()


def test_compose_stack_up_sandbox_metrics_down(docker_engine: None) -> None:
    from sdk import Sandbox

    project = f"dsectest{uuid.uuid4().hex[:8]}"
    nats_port, http_port = free_port(), free_port()
    env = {**os.environ, "DSEC_COMPOSE_PROJECT": project, "DSEC_NATS_PORT": str(nats_port), "DSEC_HTTP_PORT": str(http_port),
           "DSEC_CLI": str(Path(sys.executable).parent / "dsec"), "DSEC_PYTHON": sys.executable}
    stack = ["bash", str(REPO / "compose" / "stack.sh")]
    label = f"label=com.docker.compose.project={project}"
    touched: dict[int, str] = {}
    cgroups: set[str] = set()
    try:
        up = subprocess.run([*stack, "up"], env=env, capture_output=True, text=True, timeout=1200)
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-5000:]
        assert f"DSEC_NATS_URL=nats://127.0.0.1:{nats_port}" in up.stdout
        fmt = '{"Service":"{{.Label "com.docker.compose.service"}}","Name":"{{.Names}}"}'
        running = {c["Service"]: c for c in (json.loads(x) for x in _docker("ps", "--filter", label, "--format", fmt).splitlines())}
        assert {"nats", "placement", "guard", "guard-drops", "imaged", "lazy-loader", "hostagent", "gateway"} <= set(running), running
        assert len(_docker("ps", "-q", "--filter", label, "--filter", "label=com.docker.compose.service=placement").split()) == 2

        url = f"nats://127.0.0.1:{nats_port}"
        with Sandbox.create(template="base", memory_mb=64, timeout=300, nats_url=url, create_timeout=120) as sb:
            r = sb.commands.run("echo from-compose; cat /proc/self/cgroup")
            assert r.stdout.startswith("from-compose\n") and "/dsec/" in r.stdout
            names = {_cgroup_name(r.stdout)}  # the sandbox id, or a warm-pool container's id it was given
            sb.files.write("/tmp/compose.txt", "written in the compose stack")
            assert sb.files.read("/tmp/compose.txt") == "written in the compose stack"
            assert sb.sandbox_id in {s.sandbox_id for s in Sandbox.list(nats_url=url)}

            text = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=20).read().decode()
            s = parse(text)
            assert any(n == "dsec_host_creates_total" and lab.get("instance") == "compose-host" and lab.get("result") == "ready" and v >= 1
                       for n, lab, v in s), text[:3000]
            assert any(n == "dsec_host_sandboxes" and lab.get("state") == "running" and v >= 1 for n, lab, v in s)
            assert {"hostagent", "placement", "imaged", "guard", "lazy-loader", "gateway"} <= {lab.get("service") for _, lab, _ in s}
            page = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/dashboard", timeout=20).read().decode()
            assert "<title>dsec dashboard</title>" in page
            state = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{http_port}/dashboard/state", timeout=20).read())
            assert sb.sandbox_id in {x["sandbox_id"] for x in state["sandboxes"]}

            # The host's dropped packets reach guard: guard-drops reads NFLOG in the host agent's
            # namespace (per namespace, as dsec up --hosts runs one per host).
            with Sandbox.create(template="base", memory_mb=64, timeout=300, nats_url=url, create_timeout=120,
                                network={"allow_out": ["192.0.2.1/32"]}) as net_sb:
                got = net_sb.commands.run("nc -w 5 192.0.2.2 80 </dev/null 2>&1; echo rc=$?", timeout=60).stdout
                assert "Connection refused" in got, got  # not in its allowlist: refused by its host's agent
                v = asyncio.run(_violation_of(url, net_sb.sandbox_id))
                assert (v.kind, v.what, v.host_id, v.detail["rule"]) == ("network", "tcp 192.0.2.2:80", "compose-host", "not_allowed"), v

            for svc in running.values():  # every service still up, none restarted (a crash loop shows here)
                status, restarts = _docker("inspect", "-f", "{{.State.Status}} {{.RestartCount}}", svc["Name"]).split()
                assert (status, restarts) == ("running", "0"), (svc, status, restarts, _docker("logs", "--tail", "20", svc["Name"]))
            # The unmodified e2b SDK through the stack's gateway (NATS has no passwords here: any
            # well-formed key is accepted as the user it names).
            from e2b import Sandbox as E2BSandbox

            from sdk.gateway._keys import make_key

            gw = f"http://127.0.0.1:{http_port}"
            key = make_key("cli-compose", uuid.uuid4().hex)
            e2b_sb = E2BSandbox.create("base", timeout=120, api_key=key, api_url=gw, sandbox_url=gw, request_timeout=60)
            try:
                out = e2b_sb.commands.run("echo from-e2b; cat /proc/self/cgroup").stdout
                assert out.startswith("from-e2b\n")
                names.add(_cgroup_name(out))
                e2b_sb.files.write("/tmp/e2b.txt", "through the gateway")
                assert e2b_sb.files.read("/tmp/e2b.txt") == "through the gateway"
                e2b_id = e2b_sb.sandbox_id
                assert e2b_id in {x["sandbox_id"] for x in json.loads(urllib.request.urlopen(f"{gw}/dashboard/state", timeout=20).read())["sandboxes"]}
                agent_pid = int(_docker("inspect", "-f", "{{.State.Pid}}", running["hostagent"]["Name"]).strip())
                touched = _descendants(agent_pid)  # its containerd, the shims, the sandboxes' processes
                touched[agent_pid] = ""
                cgroups = _dsec_cgroups(touched)
                assert len(names) == 2 and names <= cgroups, (names, cgroups)
            finally:
                e2b_sb.kill()
    finally:
        import sdk._async
        import sdk._sync

        sdk._sync._run(sdk._async.close_connections())  # no SDK connection left reconnecting to the stack's NATS
        down = subprocess.run([*stack, "down"], env=env, capture_output=True, text=True, timeout=300)
    assert down.returncode == 0, down.stderr[-3000:]
    assert _docker("ps", "-aq", "--filter", label) == ""
    assert _docker("network", "ls", "-q", "--filter", label) == ""
    assert _docker("volume", "ls", "-q", "--filter", label) == ""
    assert not _still_running({p: s for p, s in touched.items() if s}), "processes of the host agent's container outlived it"
    left = [p for name in cgroups for p in cgroups_of(name)]
    assert not left, left
    # (a loop device's backing file reads as the path inside the host agent's container: scratch/<sandbox>.img)
    loops = [d for text in (project, *(f"/{n}.img" for n in cgroups)) for d in loop_devices_backed_by(text)]
    assert not loops, loops
    with open("/proc/self/mountinfo") as f:
        mounts = [ln for ln in f if project in ln]
    assert not mounts, mounts
