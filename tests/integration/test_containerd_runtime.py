"""Integration tests of the container backend on a REAL containerd + runc (root only).

One private containerd per module (temp data dir under /tmp: short unix-socket paths), a busybox
rootfs as the overlay's lower dir, a per-sandbox quota'd scratch fs for upper/work/run.
Everything (containers, mounts, loop devices, the daemon) is torn down even on failure.
Synchronisation is by polling with deadlines, never by fixed sleeps.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import pytest
import pytest_asyncio

from hostagent.backends.container.containerd import (
    ContainerdError,
    ContainerdUnavailable,
    ContainerExists,
    ContainerNotFound,
    ContainerRuntime,
    ContainerSpec,
)
from hostagent.backends.container.daemon import ContainerdDaemon
from hostagent._quota import ScratchFS
from hostagent._rootfs import RootfsLayout, overlay_mount
from imaged._busybox import build_busybox_rootfs

from .conftest import needs_stack

MiB = 1 << 20


pytestmark = [
    pytest.mark.containerd,
    needs_stack,
]


# ----------------------------------------------------------------------------- helpers
async def until(pred: Callable[[], bool | Awaitable[bool]], timeout: float = 15.0, what: str = "") -> None:
    """Poll `pred` until true; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        r = pred()
        if asyncio.iscoroutine(r) or isinstance(r, Awaitable):
            r = await r  # type: ignore[misc]
        if r:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for: {what or pred}")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.1)


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def ppid_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def mountinfo() -> str:
    return read("/proc/self/mountinfo")


def cg(controller: str, sid: str, name: str | None = None) -> str:
    p = f"/sys/fs/cgroup/{controller}/dsec/{sid}"
    return p if name is None else f"{p}/{name}"


@dataclass
class Env:
    data_dir: str
    daemon: ContainerdDaemon
    rt: ContainerRuntime
    scratch: ScratchFS
    lower: str
    created: list[str] = field(default_factory=list)

    def new_id(self, prefix: str = "t") -> str:
        sid = f"{prefix}-{uuid.uuid4().hex[:10]}"
        self.created.append(sid)
        return sid

    async def run(
        self,
        sid: str,
        script: str,
        *,
        disk_mb: int = 64,
        cpu: float = 0.5,
        memory_mb: int = 128,
        pids_max: int = 64,
        binds: list[tuple[str, str, bool]] | None = None,
        **kw,
    ) -> tuple[int, RootfsLayout]:
        sdir = await self.scratch.allocate_async(sid, disk_mb)
        layout = RootfsLayout(sdir).create()
        pid = await self.rt.create_and_start(ContainerSpec(
            sid,
            rootfs_mounts=[overlay_mount([self.lower], layout.upper, layout.work)],
            args=["/bin/sh", "-c", script],
            env={"SANDBOX": sid},
            cpu=cpu,
            memory_mb=memory_mb,
            pids_max=pids_max,
            bind_mounts=[(layout.run, "/.dsec/run", False)] + list(binds or []),
            hostname=kw.pop("hostname", "sb"),
            labels=kw.pop("labels", {"dsec.test": "1"}),
            **kw,
        ))
        return pid, layout

    async def destroy(self, sid: str) -> None:
        await self.rt.delete(sid)
        await self.scratch.release_async(sid)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def env():
    data_dir = tempfile.mkdtemp(prefix="dsec-it-", dir="/tmp")
    daemon = ContainerdDaemon(data_dir, start_timeout=30)
    rt: ContainerRuntime | None = None
    scratch = ScratchFS(data_dir, size_gb=16)
    try:
        await daemon.start()
        scratch.ensure()
        lower = os.path.join(data_dir, "images", "busybox")
        build_busybox_rootfs(lower)
        rt = ContainerRuntime(daemon.address, runc_root=daemon.runc_root)
        e = Env(data_dir, daemon, rt, scratch, lower)
        yield e
    finally:
        errors: list[str] = []
        if rt is not None:
            try:
                for info in await rt.list():
                    try:
                        await rt.delete(info.id)
                    except Exception as ex:  # keep going: clean as much as possible
                        errors.append(f"delete {info.id}: {ex!r}")
            except Exception as ex:
                errors.append(f"list: {ex!r}")
            await rt.close()
        try:
            scratch.release_all()
        except Exception as ex:
            errors.append(f"scratch: {ex!r}")
        await daemon.stop()
        leftover = [ln for ln in mountinfo().splitlines() if data_dir in ln]
        if not leftover:
            shutil.rmtree(data_dir, ignore_errors=True)
        assert not errors, errors
        assert not leftover, f"mounts left behind: {leftover}"


# ----------------------------------------------------------------------------- tests
async def test_daemon_answers_and_is_adopted(env: Env) -> None:
    assert env.daemon.started_by_us and env.daemon.version
    other = ContainerdDaemon(env.data_dir)
    await other.start()
    assert not other.started_by_us
    assert other.pid == env.daemon.pid
    assert os.path.exists(env.daemon.config_path)


async def test_run_basic(env: Env) -> None:
    sid = env.new_id("basic")
    pid, layout = await env.run(sid, "echo ok > /tmp/x; exec sleep 1000", labels={"owner": "me"})
    try:
        assert pid_alive(pid)
        marker = os.path.join(layout.upper, "tmp", "x")
        await until(lambda: os.path.exists(marker) and read(marker) == "ok\n", what="write in upper")
        assert await env.rt.task_pid(sid) == pid
        infos = {i.id: i for i in await env.rt.list()}
        assert infos[sid].status == "running"
        assert infos[sid].pid == pid
        assert infos[sid].labels == {"owner": "me"}
        # runc keeps its state under the private daemon's state dir
        assert os.path.exists(os.path.join(env.daemon.runc_root, "dsec", sid, "state.json"))
        # the rootfs is an overlay mounted by the shim, with our upper dir
        assert any("overlay" in ln and layout.upper in ln for ln in mountinfo().splitlines())
    finally:
        await env.destroy(sid)


async def test_namespaces_differ_from_host(env: Env) -> None:
    sid = env.new_id("ns")
    pid, _ = await env.run(sid, "exec sleep 1000")
    try:
        for ns in ("pid", "mnt", "uts", "ipc", "net"):
            assert os.readlink(f"/proc/{pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}"), ns
        # no user namespace: uids are host uids (root), by design
        assert os.readlink(f"/proc/{pid}/ns/user") == os.readlink("/proc/self/ns/user")
        # init of its own pid namespace
        assert read(f"/proc/{pid}/status").split("NSpid:")[1].splitlines()[0].split()[-1] == "1"
    finally:
        await env.destroy(sid)


async def test_cgroup_limits_and_update(env: Env) -> None:
    sid = env.new_id("cg")
    pid, _ = await env.run(sid, "exec sleep 1000", cpu=0.5, memory_mb=96, pids_max=50)
    try:
        assert int(read(cg("memory", sid, "memory.limit_in_bytes"))) == 96 * MiB
        memsw = cg("memory", sid, "memory.memsw.limit_in_bytes")
        if os.path.exists(memsw):
            assert int(read(memsw)) == 96 * MiB  # no swap on top of the memory limit
        assert int(read(cg("cpu", sid, "cpu.cfs_quota_us"))) == 50_000
        assert int(read(cg("cpu", sid, "cpu.cfs_period_us"))) == 100_000
        assert read(cg("pids", sid, "pids.max")).strip() == "50"
        assert str(pid) in read(cg("memory", sid, "cgroup.procs")).split()
        assert f"/dsec/{sid}" in read(f"/proc/{pid}/cgroup")

        await env.rt.update_resources(sid, cpu=1.5, memory_mb=200)
        assert int(read(cg("memory", sid, "memory.limit_in_bytes"))) == 200 * MiB
        if os.path.exists(memsw):
            assert int(read(memsw)) == 200 * MiB
        assert int(read(cg("cpu", sid, "cpu.cfs_quota_us"))) == 150_000
        await env.rt.update_resources(sid, memory_mb=64)  # shrinking works too (memsw ordering)
        assert int(read(cg("memory", sid, "memory.limit_in_bytes"))) == 64 * MiB
    finally:
        await env.destroy(sid)


async def test_memory_limit_enforced(env: Env) -> None:
    sid = env.new_id("oom")
    # 64 MiB of anonymous memory in a 32 MiB sandbox (no swap escape): the OOM killer strikes.
    script = "head -c 67108864 /dev/zero | sort > /dev/null; echo rc=$? > /.dsec/run/rc; exec sleep 1000"
    pid, layout = await env.run(sid, script, memory_mb=32)
    try:
        rc = os.path.join(layout.run, "rc")
        await until(lambda: os.path.exists(rc) and read(rc).strip(), what="oom result")
        assert read(rc).strip() == "rc=137"  # SIGKILLed by the memcg OOM killer
        oom = dict(ln.split() for ln in read(cg("memory", sid, "memory.oom_control")).splitlines())
        assert int(oom["oom_kill"]) >= 1
    finally:
        await env.destroy(sid)


async def test_security_profile(env: Env) -> None:
    sid = env.new_id("sec")
    results = tempfile.mkdtemp(prefix="res-", dir=env.data_dir)
    script = r"""
R=/results
grep CapEff /proc/self/status | cut -f2 > $R/capeff
grep NoNewPrivs /proc/self/status | cut -f2 > $R/nnp
grep '^Seccomp:' /proc/self/status | cut -f2 > $R/seccomp
hostname > $R/hostname
ls /sys/class/net > $R/netdevs
unshare -U true 2> $R/unshare_err; echo $? > $R/unshare_rc
mount -t tmpfs none /mnt 2>/dev/null; echo $? > $R/mount_rc
echo 1 > /proc/sys/kernel/panic 2>/dev/null; echo $? > $R/procsys_rc
cat /proc/timer_list /proc/keys /proc/kcore 2>/dev/null | wc -c > $R/masked_size
touch /sys/x 2>/dev/null; echo $? > $R/sys_rc
ls /dev > $R/devs
mknod /tmp/sda b 8 0 2>/dev/null && (head -c1 /tmp/sda >/dev/null 2>&1; echo $? > $R/blockdev_rc)
echo done > $R/done
exec sleep 1000
"""
    pid, _ = await env.run(sid, script, binds=[(results, "/results", False)], hostname="sec-box")
    try:
        done = os.path.join(results, "done")
        await until(lambda: os.path.exists(done), what="security script")
        r = lambda n: read(os.path.join(results, n)).strip()  # noqa: E731
        capeff = int(r("capeff"), 16)
        for bit, name in ((21, "SYS_ADMIN"), (12, "NET_ADMIN"), (13, "NET_RAW"), (16, "SYS_MODULE"),
                          (19, "SYS_PTRACE"), (24, "SYS_RESOURCE"), (17, "SYS_RAWIO")):
            assert not capeff & (1 << bit), f"CAP_{name} must not be granted"
        assert capeff & (1 << 0), "CAP_CHOWN expected"
        assert r("nnp") == "1"
        assert r("seccomp") == "2"
        assert r("hostname") == "sec-box"
        assert r("netdevs").split() == ["lo"]  # fresh, empty network namespace
        assert r("unshare_rc") != "0"
        assert r("mount_rc") != "0"
        assert r("procsys_rc") != "0"
        assert r("masked_size") == "0"  # masked paths read as /dev/null (or do not exist)
        assert r("sys_rc") != "0"
        devs = set(r("devs").split())
        assert {"null", "zero", "random", "urandom", "full", "tty", "pts", "shm"} <= devs
        assert not any(d.startswith(("sd", "vd", "loop", "nvme")) for d in devs)
        if os.path.exists(os.path.join(results, "blockdev_rc")):
            assert r("blockdev_rc") != "0"  # device cgroup denies access even after mknod
    finally:
        await env.destroy(sid)


async def test_bind_mounts_ro_and_rw(env: Env) -> None:
    sid = env.new_id("bind")
    ro_dir = tempfile.mkdtemp(prefix="ro-", dir=env.data_dir)
    rw_dir = tempfile.mkdtemp(prefix="rw-", dir=env.data_dir)
    with open(os.path.join(ro_dir, "hello"), "w") as f:
        f.write("from host\n")
    script = r"""
cat /.dsec/bin/hello > /.dsec/run/copied
(echo nope > /.dsec/bin/new) 2> /.dsec/run/ro_err; echo $? > /.dsec/run/ro_rc
echo hi > /work/out
echo done > /.dsec/run/done
exec sleep 1000
"""
    pid, layout = await env.run(sid, script, binds=[(ro_dir, "/.dsec/bin", True), (rw_dir, "/work", False)])
    try:
        done = os.path.join(layout.run, "done")
        await until(lambda: os.path.exists(done), what="bind script")
        assert read(os.path.join(layout.run, "copied")) == "from host\n"
        assert read(os.path.join(layout.run, "ro_rc")).strip() != "0"
        assert "Read-only" in read(os.path.join(layout.run, "ro_err"))
        assert not os.path.exists(os.path.join(ro_dir, "new"))
        assert read(os.path.join(rw_dir, "out")) == "hi\n"
        # the run dir is the same inode on both sides (the agent socket contract)
        assert os.path.exists(os.path.join(layout.run, "done"))
    finally:
        await env.destroy(sid)


async def test_disk_quota_enospc(env: Env) -> None:
    sid = env.new_id("quota")
    results = tempfile.mkdtemp(prefix="res-", dir=env.data_dir)  # NOT on the sandbox's scratch
    disk_mb = 32
    script = r"""
dd if=/dev/zero of=/tmp/fill bs=1M count=100 2> /results/dd_err; echo $? > /results/dd_rc
df -k / | tail -1 > /results/df
echo done > /results/done
exec sleep 1000
"""
    pid, layout = await env.run(sid, script, disk_mb=disk_mb, binds=[(results, "/results", False)])
    try:
        done = os.path.join(results, "done")
        await until(lambda: os.path.exists(done), timeout=60, what="dd to finish")
        assert read(os.path.join(results, "dd_rc")).strip() != "0"
        assert "No space left on device" in read(os.path.join(results, "dd_err"))
        written = os.path.getsize(os.path.join(layout.upper, "tmp", "fill"))
        assert (disk_mb - 4) * MiB <= written <= (disk_mb + 8) * MiB
        # df inside the sandbox reports the sandbox's own size, not the host disk
        size_kb = int(read(os.path.join(results, "df")).split()[1])
        assert size_kb <= (disk_mb + 8) * 1024
        # the host disk only holds what was written (sparse image), nothing more
        img = env.scratch.image_path(sid)
        assert os.stat(img).st_blocks * 512 <= (disk_mb + 8) * MiB
    finally:
        await env.destroy(sid)
    assert not os.path.exists(env.scratch.image_path(sid))


async def test_delete_removes_everything(env: Env) -> None:
    sid = env.new_id("del")
    pid, layout = await env.run(sid, "exec sleep 1000")
    shim = ppid_of(pid)
    assert os.path.isdir(cg("memory", sid))
    await env.rt.delete(sid)
    await until(lambda: not pid_alive(pid), what="init gone")
    assert await env.rt.task_pid(sid) is None
    assert sid not in {i.id for i in await env.rt.list()}
    mi = mountinfo()
    assert layout.upper not in mi  # the shim unmounted the overlay rootfs
    assert f"/{sid}/rootfs" not in mi
    for ctl in ("memory", "cpu", "pids", "cpuacct", "freezer", "devices", "blkio"):
        assert not os.path.exists(cg(ctl, sid)), f"{ctl} cgroup left"
    await until(lambda: not pid_alive(shim), what="shim exits")
    bundle = os.path.join(env.daemon.state_dir, "io.containerd.runtime.v2.task", "dsec", sid)
    assert not os.path.exists(bundle)
    # idempotent
    assert await env.rt.delete(sid) is None
    # the scratch fs: unmounted, loop device detached, image gone
    img = env.scratch.image_path(sid)
    await env.scratch.release_async(sid)
    assert layout.upper not in mountinfo() and env.scratch.path(sid) not in mountinfo()
    for dev in os.listdir("/sys/block"):
        bf = f"/sys/block/{dev}/loop/backing_file"
        if os.path.exists(bf):
            assert img not in read(bf), f"{dev} still backs {img}"
    assert not os.path.exists(img) and not os.path.exists(env.scratch.path(sid))
    await env.scratch.release_async(sid)  # idempotent


async def test_exit_status_and_stopped_state(env: Env) -> None:
    sid = env.new_id("exit")
    pid, _ = await env.run(sid, "exit 3")
    try:
        assert await env.rt.wait(sid, timeout=15) == 3
        info = {i.id: i for i in await env.rt.list()}[sid]
        assert info.status == "stopped" and info.exit_status == 3
        assert await env.rt.task_pid(sid) is None
    finally:
        assert await env.rt.delete(sid) == 3
        await env.scratch.release_async(sid)


async def test_kill_signal(env: Env) -> None:
    sid = env.new_id("kill")
    pid, layout = await env.run(sid, "trap 'echo got > /.dsec/run/term; exit 7' TERM; echo ready > /.dsec/run/ready; while :; do sleep 0.05; done")
    try:
        await until(lambda: os.path.exists(os.path.join(layout.run, "ready")), what="trap installed")
        await env.rt.kill(sid, 15)
        assert await env.rt.wait(sid, timeout=15) == 7
        assert read(os.path.join(layout.run, "term")) == "got\n"
    finally:
        await env.destroy(sid)


async def test_errors(env: Env) -> None:
    sid = env.new_id("err")
    pid, _ = await env.run(sid, "exec sleep 1000")
    try:
        with pytest.raises(ContainerExists):
            await env.rt.create_and_start(ContainerSpec(
                sid, rootfs_mounts=[], args=["/bin/true"], env={}, cpu=1, memory_mb=64,
                pids_max=10, bind_mounts=[], hostname="x", labels={},
            ))
        assert pid_alive(pid) and await env.rt.task_pid(sid) == pid  # the original is untouched
        with pytest.raises(ContainerNotFound):
            await env.rt.kill("no-such-sandbox", 9)
        with pytest.raises(ContainerNotFound):
            await env.rt.update_resources("no-such-sandbox", cpu=1)
        assert await env.rt.task_pid("no-such-sandbox") is None
        assert await env.rt.delete("no-such-sandbox") is None
        bad = ContainerRuntime(os.path.join(env.data_dir, "nothing.sock"), call_timeout=5)
        try:
            with pytest.raises(ContainerdUnavailable):
                await bad.list()
        finally:
            await bad.close()
    finally:
        await env.destroy(sid)


async def test_failed_start_leaves_nothing(env: Env) -> None:
    sid = env.new_id("bad")
    sdir = await env.scratch.allocate_async(sid, 16)
    layout = RootfsLayout(sdir).create()
    try:
        with pytest.raises(ContainerdError):
            await env.rt.create_and_start(ContainerSpec(
                sid,
                rootfs_mounts=[overlay_mount([env.lower], layout.upper, layout.work)],
                args=["/no/such/binary"], env={}, cpu=1, memory_mb=64, pids_max=10,
                bind_mounts=[], hostname="x", labels={},
            ))
        assert sid not in {i.id for i in await env.rt.list()}
        assert layout.upper not in mountinfo()
        assert not os.path.exists(cg("memory", sid))
    finally:
        await env.scratch.release_async(sid)


async def test_shim_grouping_shares_one_shim(env: Env) -> None:
    group = f"grp-{uuid.uuid4().hex[:6]}"
    ids = [env.new_id("grp") for _ in range(3)]
    pids = []
    try:
        for sid in ids:
            pid, _ = await env.run(sid, "exec sleep 1000", group=group, disk_mb=16)
            pids.append(pid)
        shims = {ppid_of(p) for p in pids}
        assert len(shims) == 1, f"expected one shared shim, got {shims}"
        shim = shims.pop()
        # deleting one member leaves the shim (and the others) running
        await env.destroy(ids[0])
        assert pid_alive(shim) and pid_alive(pids[1]) and pid_alive(pids[2])
        assert await env.rt.task_pid(ids[1]) == pids[1]
        # a new member after the first one (whose bundle started the shim) is gone still works
        late = env.new_id("grp")
        pid_late, _ = await env.run(late, "exec sleep 1000", group=group, disk_mb=16)
        assert ppid_of(pid_late) == shim
        ids.append(late)
        for sid in ids[1:]:
            await env.destroy(sid)
        await until(lambda: not pid_alive(shim), what="shared shim exits with its last container")
    finally:
        for sid in ids:
            await env.destroy(sid)


async def test_join_existing_netns(env: Env) -> None:
    # A sandbox can join a netns given by path: use another sandbox's netns.
    a, b = env.new_id("neta"), env.new_id("netb")
    pid_a, _ = await env.run(a, "exec sleep 1000")
    try:
        pid_b, _ = await env.run(b, "exec sleep 1000", netns_path=f"/proc/{pid_a}/ns/net")
        try:
            assert os.readlink(f"/proc/{pid_b}/ns/net") == os.readlink(f"/proc/{pid_a}/ns/net")
            assert os.readlink(f"/proc/{pid_b}/ns/pid") != os.readlink(f"/proc/{pid_a}/ns/pid")
        finally:
            await env.destroy(b)
    finally:
        await env.destroy(a)
