"""The whole stack in-process, on real parts: NATS JetStream, two placement replicas, a host agent
with the container backend (a private containerd + runc), and a ``base`` template registered in KV.

One stack per session (``stack``) keeps the suite fast. The host agent runs in its own placement
pool (``stack.pool``), so sandboxes of these tests never land on a host another test suite started
on the same NATS, and theirs never land here; every create in these tests passes ``**stack.kw()``.

Helpers here also check that a sandbox left nothing behind (task, container, mounts, cgroups,
scratch fs, loop device, state file) and force-clean a data dir after a failed test.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest_asyncio

from tests.conftest import cannot_run, eventually, needs
from tests.netclaim import claim_net

REPO = Path(__file__).resolve().parents[2]
CGROUP_ROOT = Path("/sys/fs/cgroup")


def stack_skip_reason() -> str | None:
    """Why the real stack cannot run here (None when it can)."""
    if os.geteuid() != 0:
        return "needs root (mounts, cgroups, namespaces)"
    for tool in ("containerd", "containerd-shim-runc-v2", "runc", "mkfs.ext4", "gcc"):
        if shutil.which(tool) is None and shutil.which(tool, path="/usr/sbin:/sbin") is None:
            return f"{tool} not installed"
    if not os.path.exists("/bin/busybox"):
        return "busybox-static not installed"
    if not os.path.isdir("/sys/fs/cgroup/memory"):
        return "needs cgroups v1 (memory controller at /sys/fs/cgroup/memory)"
    return None


SKIP_REASON = stack_skip_reason()
needs_stack = needs(SKIP_REASON)


# ----------------------------------------------------------------------------------------------- probes
def mountinfo_lines() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return f.read().splitlines()


def mounts_mentioning(text: str) -> list[str]:
    """Mount points (or sources/options) naming ``text``: a data dir or a sandbox id."""
    return [ln for ln in mountinfo_lines() if text in ln]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def processes_mentioning(text: str) -> dict[int, str]:
    """Live processes whose command line names ``text`` (containerd and its shims name their data dir)."""
    me = os.getpid()
    out: dict[int, str] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        cmd = _cmdline(int(name))
        if text in cmd and pid_alive(int(name)):
            out[int(name)] = cmd
    return out


def loop_devices_backed_by(text: str) -> list[str]:
    out = []
    for dev in Path("/sys/block").glob("loop*"):
        try:
            backing = (dev / "loop" / "backing_file").read_text().strip()
        except OSError:
            continue
        if text in backing:
            out.append(f"{dev.name} -> {backing}")
    return out


def cgroups_of(sid: str) -> list[str]:
    return [str(p) for p in CGROUP_ROOT.glob(f"*/dsec/{sid}") if p.exists()]


async def sandbox_leftovers(
    sid: str, data_dir: str | Path, *, host_id: str | None = None, pid: int | None = None, rt: Any = None, cid: str | None = None
) -> list[str]:
    """Everything of sandbox ``sid`` (container ``cid``, the same unless it came from the warm pool)
    still on this host; empty when the kill removed it all."""
    data_dir = Path(data_dir)
    cid = cid or sid
    left: list[str] = []
    if rt is not None:
        left += [f"container {c.id} ({c.status})" for c in await rt.list() if c.id == cid or c.labels.get("dsec.sandbox") == sid]
    left += [f"mount {ln.split()[4]}" for ln in mounts_mentioning(cid)]
    left += [f"cgroup {p}" for p in cgroups_of(cid)]
    for p in (data_dir / "scratch" / cid, data_dir / "scratch" / f"{cid}.img"):
        if p.exists():
            left.append(f"scratch {p}")
    left += [f"loop {d}" for d in loop_devices_backed_by(f"/{cid}.img")]
    if host_id is not None:
        st = data_dir / "hosts" / host_id / "sandboxes" / f"{sid}.json"
        if st.exists():
            left.append(f"state file {st}")
    if pid and pid_alive(pid):
        left.append(f"process {pid} ({_cmdline(pid)})")
    return left


async def assert_sandbox_gone(sid: str, data_dir: str | Path, *, timeout: float = 15.0, **kw: Any) -> None:
    left: list[str] = []

    async def clean() -> bool:
        nonlocal left
        left = await sandbox_leftovers(sid, data_dir, **kw)
        return not left

    try:
        await eventually(clean, timeout=timeout, what=f"sandbox {sid} to be gone")
    except AssertionError:
        raise AssertionError(f"sandbox {sid} left behind: {left}") from None


def disk_bytes(root: Path, *skip: str) -> int:
    """Bytes the files under ``root`` occupy on disk (blocks, not sizes), but under ``skip`` dirs."""
    total = 0
    for dp, dns, fns in os.walk(root):
        dns[:] = [d for d in dns if os.path.join(dp, d) not in skip]
        for n in fns:
            try:
                total += os.lstat(os.path.join(dp, n)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


async def answers_again(sb: Any, error: type[Exception], *, timeout: float, interval: float, what: str) -> None:
    """Wait until ``sb`` runs a command again (after its host agent restarted); until then a run may
    fail only with ``error`` (any other error fails the test at once)."""

    async def answers() -> bool:
        try:
            await sb.commands.run("true")
            return True
        except error:
            return False

    await eventually(answers, timeout=timeout, interval=interval, what=what)


def data_dir_leftovers(data_dir: str | Path) -> list[str]:
    """Mounts, loop devices and live processes (containerd, shims) under a host agent's data dir.

    A loop device still attached to a scratch image means its filesystem is still mounted in some
    other mount namespace (say, a container init outliving its shim)."""
    d = str(data_dir)
    left = [f"mount {ln.split()[4]}" for ln in mounts_mentioning(d)]
    left += [f"process {pid}: {cmd}" for pid, cmd in processes_mentioning(d).items()]
    left += [f"loop {dev}" for dev in loop_devices_backed_by(d)]
    return left


async def force_cleanup(data_dir: str | Path) -> list[str]:
    """Remove whatever a failed test left under ``data_dir``: containers, scratch fs, containerd, shims.

    Everything is stopped by pid (verified by its command line naming the data dir), never by name.
    Returns what it had to clean up.
    """
    from hostagent.backends.container.containerd import ContainerRuntime
    from hostagent.backends.container.daemon import probe_version
    from hostagent._quota import ScratchFS

    data_dir = Path(data_dir)
    found = data_dir_leftovers(data_dir)
    sock = data_dir / "containerd" / "containerd.sock"
    if await probe_version(str(sock), timeout=2.0):
        rt = ContainerRuntime(str(sock), runc_root=str(data_dir / "containerd" / "state" / "runc"))
        try:
            for c in await rt.list():
                found.append(f"container {c.id}")
                with contextlib.suppress(Exception):
                    await rt.delete(c.id, stop_timeout=5.0)
        finally:
            await rt.close()
    if (data_dir / "scratch").exists():
        with contextlib.suppress(Exception):
            await asyncio.to_thread(ScratchFS(str(data_dir), None).release_all)
    # containerd first (so it does not restart shims), then anything else naming the data dir.
    procs = processes_mentioning(str(data_dir))
    for pid in sorted(procs, key=lambda p: "containerd-shim" in procs[p]):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(AssertionError):
        await eventually(lambda: not processes_mentioning(str(data_dir)), timeout=10, what="processes to exit")
    for ln in reversed(mounts_mentioning(str(data_dir))):
        subprocess.run(["umount", "-l", ln.split()[4]], capture_output=True)
    return found


def subprocess_env(nats_url: str, **extra: str) -> dict[str, str]:
    """Environment for a ``python -m <service>`` child: this repo importable, the test's NATS."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["DSEC_NATS_URL"] = nats_url
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env



async def run_process(*argv: str, env: dict[str, str], timeout: float = 60, cwd: str | None = None) -> tuple[int, str, str]:
    """Run ``argv`` as its own process; (exit code, stdout, stderr). Never blocks the event loop; killed at ``timeout``."""
    pipe = asyncio.subprocess.PIPE
    proc = await asyncio.create_subprocess_exec(*argv, cwd=cwd, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=pipe, stderr=pipe)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    return proc.returncode or 0, out.decode(), err.decode()

# ----------------------------------------------------------------------------------------------- stack
@dataclass
class Stack:
    url: str
    uid: str
    data_dir: Path
    rootfs: Path
    host_id: str
    pool: str
    host: Any  # hostagent.HostAgent
    backend: Any  # hostagent.backends.container.ContainerBackend
    placements: list[Any]  # placement.Placement
    nc: Any  # the tests' own NATS connection
    extra: dict[str, Any] = field(default_factory=dict)
    _cids: dict[str, str] = field(default_factory=dict)

    @property
    def js(self) -> Any:
        return self.nc.jetstream()

    def kw(self, **kw: Any) -> dict[str, Any]:
        """Create arguments that put the sandbox on this stack's host (its own pool)."""
        return {"pool": self.pool, "nats_url": self.url, **kw}

    def new_id(self, tag: str = "t") -> str:
        return f"{tag}-{self.uid}-{uuid.uuid4().hex[:8]}"

    async def leftovers(self, sid: str, pid: int | None = None) -> list[str]:
        return await sandbox_leftovers(sid, self.data_dir, host_id=self.host_id, pid=pid, rt=self.backend.rt, cid=self.cid(sid))

    async def assert_gone(self, sid: str, pid: int | None = None, timeout: float = 15.0) -> None:
        await assert_sandbox_gone(sid, self.data_dir, host_id=self.host_id, pid=pid, rt=self.backend.rt, timeout=timeout, cid=self.cid(sid))
        assert sid not in self.host.live

    def pid_of(self, sid: str) -> int:
        self.cid(sid)  # remember the container id while the sandbox lives
        return self.host.handles[sid].pid

    def cid(self, sid: str) -> str:
        """The sandbox's container id (a warm-pool container's own id when it was claimed from the pool)."""
        h = self.host.handles.get(sid)
        if h is not None:
            self._cids[sid] = h.extra.get("cid", sid)
        return self._cids.get(sid, sid)

    @contextlib.asynccontextmanager
    async def sandbox(self, **kw: Any) -> AsyncIterator[Any]:
        """An ``AsyncSandbox`` on this stack, killed at the end and checked to leave nothing behind."""
        from sdk import AsyncSandbox

        kw.setdefault("sandbox_id", self.new_id("sb"))
        sb = await AsyncSandbox.create(**self.kw(**kw))
        pid = self.pid_of(sb.sandbox_id)
        try:
            yield sb
        finally:
            await sb.kill()
            await self.assert_gone(sb.sandbox_id, pid)


async def register_base_template(js: Any, rootfs: str) -> bytes | None:
    """Put ``base`` (one kind=dir layer) into KV dsec_images; return what was there before."""
    from nats.js.errors import KeyNotFoundError

    from bus import codec
    from bus import subjects as S
    from bus.messages import LayerRef, TemplateManifest
    from bus.streams import ensure_kv

    kv = await ensure_kv(js, S.KV_IMAGES)
    try:
        before = (await kv.get("base")).value
    except KeyNotFoundError:
        before = None
    manifest = TemplateManifest(
        name="base", created_at=time.time(), description="busybox (tests)",
        layers=[LayerRef(role="base", digest="sha256:" + "0" * 64, kind="dir", path=rootfs)],
    )
    await kv.put("base", codec.encode(manifest))
    return before


async def busybox_host(nats_url: str, kind: str, client_name: str) -> tuple[str, Path, Path, Any]:
    """The start of a fixture that runs a real host agent (skipped where it cannot): a fresh uid, a
    data dir ``/tmp/dsec-{kind}-{uid}-*`` with a busybox rootfs in it, and a connection on which
    dsec's streams and buckets exist. Returns ``(uid, data_dir, rootfs, nc)``."""
    if SKIP_REASON is not None:
        cannot_run(SKIP_REASON)
    from bus import connect, ensure_all
    from imaged._busybox import build_busybox_rootfs

    uid = uuid.uuid4().hex[:8]
    data_dir = Path(tempfile.mkdtemp(prefix=f"dsec-{kind}-{uid}-", dir="/tmp"))
    rootfs = data_dir / "rootfs"
    nc = await connect(nats_url, name=client_name)
    await ensure_all(nc.jetstream())
    await asyncio.to_thread(build_busybox_rootfs, str(rootfs))
    return uid, data_dir, rootfs, nc


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def stack(nats_server: Any) -> AsyncIterator[Stack]:
    from bus import subjects as S
    from bus.streams import ensure_kv
    from hostagent import HostAgent, HostAgentConfig
    from hostagent.backends.container import ContainerBackend
    from placement import Placement
    import sdk._async
    import sdk._sync

    url = nats_server.url
    uid, data_dir, rootfs, nc = await busybox_host(url, "st", "dsec-tests")
    js = nc.jetstream()
    before = await register_base_template(js, str(rootfs))
    host_id = f"it-{uid}"
    placements = [Placement(url, replica_id=f"p{i}-{uid}") for i in (1, 2)]
    net = await asyncio.to_thread(claim_net)  # network names of its own: not the default ones other stacks share
    backend = ContainerBackend(str(data_dir), scratch_size_gb=64, warm_pool=2, network=net.config())
    host = HostAgent(backend, HostAgentConfig(
        nats_url=url, host_id=host_id, data_dir=str(data_dir), pool=f"it-{uid}",
        concurrency=16, heartbeat_s=1.0, destroy_on_shutdown=True, grace_s=20.0,
    ))
    problems: list[str] = []
    try:
        for p in placements:
            await p.start()
        await host.start()
        await eventually(lambda: all(host_id in p.table.hosts for p in placements), timeout=15, what="placement to see the host")
        yield Stack(url, uid, data_dir, rootfs, host_id, f"it-{uid}", host, backend, placements, nc)
    finally:
        with contextlib.suppress(Exception):
            await sdk._async.close_connections()
        if sdk._sync._loop is not None and not sdk._sync._loop.is_closed():
            with contextlib.suppress(Exception):
                await asyncio.to_thread(sdk._sync._run, sdk._async.close_connections())
        leaked = sorted(host.live)
        if leaked:
            problems.append(f"sandboxes still live at the end of the session: {leaked}")
        await host.shutdown()
        for p in placements:
            await p.shutdown()
        kv_hosts = await ensure_kv(js, S.KV_HOSTS)
        with contextlib.suppress(Exception):
            await kv_hosts.delete(host_id)
        kv = await ensure_kv(js, S.KV_IMAGES)
        with contextlib.suppress(Exception):
            if before is None:
                await kv.delete("base")
            else:
                await kv.put("base", before)
        await nc.close()
        left = data_dir_leftovers(data_dir)
        if left:
            problems.append(f"left under {data_dir} after shutdown: {left}")
            await force_cleanup(data_dir)
        await net.purge()  # the table: the host agent's shutdown removes its sandboxes' networks only
        net.release()
        if not mounts_mentioning(str(data_dir)):
            shutil.rmtree(data_dir, ignore_errors=True)
        assert not problems, problems


# ----------------------------------------------------------------------------------------------- children
class Child:
    """A ``python -m ...`` child process, stopped by pid; its output goes to a log file."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: str | Path) -> None:
        self.argv = argv
        self.env = env
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> "Child":
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv, env=self.env, cwd=str(REPO), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self, tail: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.proc is not None
            os.kill(self.proc.pid, sig)

    async def wait(self, timeout: float) -> int:
        assert self.proc is not None
        await eventually(lambda: self.proc.poll() is not None, timeout=timeout, interval=0.05, what=f"{self.argv[:4]} to exit")
        return self.proc.returncode

    async def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit code."""
        if self.proc is None:
            return None
        self.signal(signal.SIGTERM)
        try:
            return await self.wait(timeout)
        except AssertionError:
            self.signal(signal.SIGKILL)
            return await self.wait(10)


PY = sys.executable


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def lazy(stack: Stack, nats_server: Any) -> AsyncIterator[Any]:
    """The stack host's lazy loader (``tests.imaged.conftest.LazyDaemon``): it packs snapshots' and
    build steps' layers. A module's own ``lazy`` (another host's) takes its place there."""
    from tests.imaged.conftest import LazyDaemon

    d = LazyDaemon(data_dir=stack.data_dir, mount=stack.data_dir / "lazy", nats_url=nats_server.url, host_id=stack.host_id)
    d.start()
    try:
        yield d
    finally:
        d.release()
