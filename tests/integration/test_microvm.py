"""The microvm backend on real parts: a host agent process (``python -m hostagent --backend microvm``)
on the session stack's NATS and placement, QEMU microVMs booted from Debian's cloud kernel (TCG on
this machine: its /dev/kvm is a PVM host), the ``base`` template's layer attached as an EROFS disk.

TCG boots take seconds on shared cores: one module-scoped VM serves the exec, files, isolation and
restart tests; only the test that kills QEMU from outside boots a second one."""

from __future__ import annotations

import asyncio
import os
import signal
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
from nats.js.errors import KeyNotFoundError

from bus import codec
from bus import subjects as S
from bus.messages import ExecRequest, HostStatus, LayerRef, SandboxSpec
from bus.streams import ensure_kv
from hostagent._backend import Handle
from hostagent.backends.vm import VMBackend
from sdk import AsyncSandbox, CommandExitError, CommandTimeoutError, ProcessNotFound, SandboxNotFound
from tests.conftest import eventually, needs
from tests.imaged.conftest import LazyDaemon, needs_fuse
from tests.integration.conftest import PY, REPO, Child, Stack, answers_again, needs_stack, pid_alive, processes_mentioning, run_process, subprocess_env
from tests.netclaim import NetClaim, claim_net
from tests.pngpixels import png_pixels
from tests.security.test_network import TestHost, counters

NO_QEMU = None if shutil.which("qemu-system-x86_64") else "qemu-system-x86_64 not installed (compose/dev.sh installs it)"
pytestmark = [pytest.mark.containerd, needs_stack, needs(NO_QEMU)]

KERNEL_CACHE = "/tmp/dsec-microvm-kernel"  # the extracted cloud kernel, kept across runs (26 MB download)
BOOT_S = 240  # a TCG boot on two cores shared with other test runs


@dataclass
class MicroHost:
    stack: Stack
    host_id: str
    pool: str
    data: Path
    argv: list[str]
    env: dict[str, str]
    log: Path
    agent: Child
    net: NetClaim

    def vm_dir(self, sid: str) -> Path:
        return self.data / "mvm" / "vms" / sid

    async def status(self) -> HostStatus | None:
        kv = await ensure_kv(self.stack.js, S.KV_HOSTS)
        try:
            raw = (await kv.get(self.host_id)).value
        except KeyNotFoundError:
            return None
        return codec.HOST_STATUS.decode(raw) if raw else None

    async def ready_since(self, t: float) -> bool:
        st = await self.status()
        return st is not None and st.state == "ready" and st.at >= t

    async def record_state(self, sid: str) -> str:
        kv = await ensure_kv(self.stack.js, S.KV_SANDBOXES)
        raw = (await kv.get(sid)).value
        assert raw is not None
        return codec.SANDBOX_RECORD.decode(raw).state

    def create(self, sid: str) -> "asyncio.Future[AsyncSandbox]":
        return asyncio.ensure_future(AsyncSandbox.create(**self.stack.kw(
            pool=self.pool, sandbox_id=sid, backend="microvm", memory_mb=256, disk_mb=512, create_timeout=BOOT_S,
        )))

    async def kill_agent(self) -> None:
        """SIGKILL the host agent (its VMs run on)."""
        self.agent.signal(signal.SIGKILL)
        assert await self.agent.wait(30) == -signal.SIGKILL

    async def start_agent(self) -> None:
        """Start the host agent again; returns once it is ready."""
        t1 = time.time()
        self.agent = Child(self.argv, self.env, self.log).start()
        await eventually(lambda: self.ready_since(t1), timeout=120, interval=0.2, what="the restarted agent")

    def leftovers(self, sid: str) -> list[str]:
        """What of a microVM is still on this host: its QEMU, its dir (disk, sockets, pid file)."""
        d = self.vm_dir(sid)
        left = [f"process {pid}: {cmd[:120]}" for pid, cmd in processes_mentioning(str(d)).items()]
        return left + ([f"dir {d}: {sorted(os.listdir(d))}"] if d.exists() else [])


@pytest_asyncio.fixture(scope="module")
async def mhost(stack: Stack) -> AsyncIterator[MicroHost]:
    uid = stack.new_id("mvm")
    claim = await asyncio.to_thread(claim_net)  # the VMs' networks get names no other stack uses
    data = Path(tempfile.mkdtemp(prefix="dsec-mvm-", dir="/tmp"))
    argv = [PY, "-m", "hostagent", "--backend", "microvm", "--data-dir", str(data), "--host-id", uid, "--pool", uid,
            "--concurrency", "4", "--reconcile-s", "1"]
    env = subprocess_env(stack.url, DSEC_MICROVM_KERNEL_CACHE=KERNEL_CACHE, **claim.env())  # the accelerator is probed, not forced
    log = data.parent / f"{data.name}.log"
    h = MicroHost(stack, uid, uid, data, argv, env, log, Child(argv, env, log).start(), claim)
    try:
        t0 = time.time()
        await eventually(lambda: h.ready_since(t0), timeout=240, interval=0.2, what="the microvm host agent")
        yield h
    finally:
        if h.agent.alive():
            await h.agent.stop(timeout=60)
        for pid in processes_mentioning(str(data)):  # only what names this test's data dir
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(data, ignore_errors=True)
        log.unlink(missing_ok=True)
        await claim.purge()
        claim.release()


@pytest_asyncio.fixture(scope="module")
async def lazy(mhost: MicroHost) -> AsyncIterator[LazyDaemon]:
    """The microVM host's lazy loader: it packs snapshot layers (the disk's diff, the memory)."""
    d = LazyDaemon(data_dir=mhost.data, mount=mhost.data / "lazy", nats_url=mhost.stack.url, host_id=mhost.host_id)
    d.start()
    try:
        yield d
    finally:
        d.release()


@pytest_asyncio.fixture(scope="module")
async def vm(mhost: MicroHost) -> AsyncIterator[AsyncSandbox]:
    sid = f"{mhost.host_id}-vm"
    sb = await mhost.create(sid)
    try:
        yield sb
    finally:
        await sb.kill()
        await eventually(lambda: not mhost.leftovers(sid), timeout=30, what=f"the VM to be gone: {mhost.leftovers(sid)}")


async def test_heartbeat_names_the_accelerator_the_probe_found(mhost: MicroHost) -> None:
    st = await mhost.status()
    assert st is not None
    (b,) = [b for b in st.backends if b.name == "microvm"]
    assert b.detail["accel"] in ("kvm", "tcg") and b.detail["kernel"].endswith("-cloud-amd64"), b
    if not os.access("/dev/kvm", os.W_OK):
        assert b.detail["accel"] == "tcg"
    # The probe's answer is kept: a restarted agent does not boot the probe again.
    assert (mhost.data / "mvm" / f"accel-{b.detail['kernel']}").read_text() == b.detail["accel"]
    # `dsec status` shows it (its exit code also judges other hosts on this NATS: not asserted)
    _, out, err = await run_process(PY, "-m", "sdk.cli", "status", env=subprocess_env(mhost.stack.url), cwd=str(REPO))
    assert f"microvm: accel={b.detail['accel']} kernel={b.detail['kernel']}" in out, (out, err)


async def test_template_layers_are_one_host_copy_read_in_place_with_dax(vm: AsyncSandbox, mhost: MicroHost) -> None:
    """virtio-pmem with DAX (the cloud kernel has it): the guest maps the template's EROFS blob from
    the host's page cache instead of copying it into its RAM, and says so; the heartbeat names the
    mode. The region is read-only: the guest's root cannot change the blob every VM shares."""
    from hostagent.backends.microvm.kernel import ensure_kernel, has_pmem_dax

    assert has_pmem_dax(ensure_kernel(KERNEL_CACHE))  # the premise: CONFIG_VIRTIO_PMEM, FS_DAX, EROFS...

    async def layers() -> str:
        st = await mhost.status()
        return next((b.detail.get("layers", "") for b in st.backends if b.name == "microvm"), "") if st else ""

    async def confirmed() -> bool:  # by the first guest's report, in the next heartbeat
        return await layers() == "virtio-pmem+dax"

    await eventually(confirmed, timeout=60, interval=0.5, what="the heartbeat to name virtio-pmem+dax")
    assert (await vm.commands.run("cat /run/dsec/layers")).stdout == "layer0 dax\n"
    r = await vm.commands.run("grep -c ' /dev/pmem' /proc/mounts; ls /sys/bus/nd/devices | grep -c ^namespace")
    assert r.stdout.split() == ["0", "1"]  # mounted in the initramfs (not in the root's view), one region
    cmd = Path(f"/proc/{int((mhost.vm_dir(vm.sandbox_id) / 'qemu.pid').read_text())}/cmdline").read_bytes().split(b"\0")
    (backend,) = [a.decode() for a in cmd if a.startswith(b"memory-backend-file,id=l0,")]
    assert "share=on" in backend and "readonly=on" in backend, backend  # one host copy, never written
    blob = backend.split("mem-path=", 1)[1].split(",", 1)[0]
    assert os.path.getsize(blob) % (2 << 20) == 0
    before = await asyncio.to_thread(_sha256, blob)
    # The guest's root writes zeros over its view of the layer: the writes land (dd succeeds, it is a
    # block device) and are dropped by the read-only region, so neither the blob nor the guest's view changes.
    r = await vm.commands.run("sha256sum /dev/pmem0; dd if=/dev/zero of=/dev/pmem0 bs=4096 count=64 conv=fsync 2>&1; echo rc=$?; "
                              "echo 3 > /proc/sys/vm/drop_caches; sha256sum /dev/pmem0; ls /bin/sh")
    lines = r.stdout.splitlines()
    assert "64+0 records out" in r.stdout and "rc=0" in lines, r.stdout  # positive control: the writes were made
    assert lines[0].split()[0] == lines[-2].split()[0] == before and lines[-1] == "/bin/sh", (r.stdout, before)
    assert await asyncio.to_thread(_sha256, blob) == before


async def test_pmem_guest_keeps_its_memory_without_bounce_buffers(vm: AsyncSandbox, mhost: MicroHost) -> None:
    """The pmem layers' device-memory range lies above 4 GiB, which made the guest kernel set aside
    (and zero) 64 MiB of SWIOTLB bounce buffers that nothing used: 64 MiB less for the guest, 64 MiB
    more of QEMU's memory. ``swiotlb=noforce`` leaves them out; the guest keeps its RAM."""
    r = await vm.commands.run("cat /proc/cmdline; dmesg; grep MemTotal /proc/meminfo")
    assert "dsec_pmem=1" in r.stdout and "swiotlb=noforce" in r.stdout
    assert "Memory: " in r.stdout  # positive control: the boot log is there to read
    assert "software IO TLB: mapped" not in r.stdout, [ln for ln in r.stdout.splitlines() if "TLB" in ln]
    total_kb = int(r.stdout.split("MemTotal:")[1].split()[0])
    assert total_kb > (256 - 64) << 10, total_kb  # 256 MiB less the kernel's own (~40 MiB); with the buffers, ~104 MiB less


async def test_memory_the_guest_frees_goes_back_to_the_host(vm: AsyncSandbox, mhost: MicroHost) -> None:
    """Free page reporting (virtio-balloon): what the guest frees leaves QEMU's memory within seconds."""
    pid = int((mhost.vm_dir(vm.sandbox_id) / "qemu.pid").read_text())

    def anon_mb() -> int:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("Anonymous:")) >> 10

    fill = "dd if=/dev/urandom of=/run/fill/x bs=1M count=80 2>/dev/null"
    await vm.commands.run("mkdir -p /run/fill && mount -t tmpfs fill /run/fill")
    try:
        before = anon_mb()
        await vm.commands.run(fill)
        filled = anon_mb()
        assert filled >= before + 40, (before, filled)  # positive control: the guest's 80 MiB took the host's memory
        await vm.commands.run("rm /run/fill/x")
        await eventually(lambda: anon_mb() <= filled - 40, timeout=90, interval=0.5,
                         what=f"the freed 80 MiB to leave QEMU's memory ({before} MiB before, {filled} filled, now {anon_mb()})")
    finally:
        await vm.commands.run("umount /run/fill; rmdir /run/fill")


def _sha256(path: str) -> str:
    import hashlib

    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


async def test_layers_fall_back_to_virtio_blk_when_dax_is_not_there(tmp_path: Path) -> None:
    """Where a guest found no DAX (its report leaves a note per kernel) or the operator asks for it
    (DSEC_MICROVM_LAYERS=blk), the layers are virtio-blk disks on the microvm machine; pmem overrides the note."""
    from hostagent.backends.microvm import MicroVMBackend, qemu
    from hostagent.backends.microvm.kernel import ensure_kernel

    def mode(layers: str | None) -> str:
        b = MicroVMBackend(str(tmp_path), kernel_cache=KERNEL_CACHE, layers=layers)
        b.kernel = ensure_kernel(KERNEL_CACHE)
        return b._layer_mode()

    (tmp_path / "mvm").mkdir()
    assert mode(None) == "virtio-pmem"  # positive control: this kernel has what DAX needs
    assert mode("blk") == "virtio-blk"
    (tmp_path / "mvm" / f"layers-{ensure_kernel(KERNEL_CACHE).release}").write_text("virtio-blk")
    assert mode(None) == "virtio-blk" and mode("pmem") == "virtio-pmem"
    blob = tmp_path / "l.erofs"
    blob.write_bytes(b"\0" * (2 << 20))
    spec = qemu.VMSpec(str(tmp_path), "vmlinuz", "initrd", "tcg", layers=[str(blob)], upper="upper.img")
    argv = " ".join(spec.argv())
    assert "microvm" in argv and "virtio-blk-device,drive=l0" in argv and "pmem" not in argv
    spec.pmem = True
    argv = " ".join(spec.argv())
    assert "-M q35" in argv and "virtio-pmem-pci,memdev=l0" in argv and "dsec_pmem=1" in argv and "drive=l0" not in argv


async def test_exec_streams_output_and_reports_exit_codes(vm: AsyncSandbox) -> None:
    got: list[str] = []
    r = await vm.commands.run("for i in 1 2 3; do echo line$i; done; echo oops >&2", on_stdout=got.append)
    assert r.exit_code == 0 and r.stdout == "line1\nline2\nline3\n" and r.stderr == "oops\n"
    assert "".join(got) == r.stdout
    with pytest.raises(CommandExitError) as e:
        await vm.commands.run("exit 7")
    assert e.value.exit_code == 7
    r = await vm.commands.run("pwd; echo $FOO", cwd="/tmp", envs={"FOO": "bar"})
    assert r.stdout == "/tmp\nbar\n"


async def test_files_round_trip(vm: AsyncSandbox) -> None:
    data = os.urandom(3 << 20)  # more than one mux frame, in both directions
    w = await vm.files.write("/workspace/blob.bin", data)
    assert w.size == len(data)
    assert await vm.files.read("/workspace/blob.bin", format="bytes") == data
    assert (await vm.commands.run("wc -c < /workspace/blob.bin")).stdout.strip() == str(len(data))
    await vm.files.write("/workspace/a.txt", "hello")
    assert {e.name for e in await vm.files.list("/workspace")} == {"blob.bin", "a.txt"}
    assert await vm.files.exists("/workspace/a.txt")
    await vm.files.remove("/workspace/a.txt")
    assert not await vm.files.exists("/workspace/a.txt")


async def test_timeout_background_and_kill(vm: AsyncSandbox) -> None:
    t0 = time.monotonic()
    with pytest.raises(CommandTimeoutError):
        await vm.commands.run("sleep 60", timeout=2)
    assert time.monotonic() - t0 < 30
    h = await vm.commands.run("sleep 300", background=True, timeout=0)
    assert h.pid in {p.pid for p in await vm.commands.list()}
    await vm.commands.kill(h.pid, signal=signal.SIGTERM)
    with pytest.raises(CommandExitError) as e:
        await h.wait(timeout=20)
    assert e.value.result.signal == signal.SIGTERM
    with pytest.raises(ProcessNotFound):
        await vm.commands.kill(h.pid)
    assert (await vm.commands.run("echo alive")).stdout == "alive\n"  # positive control


async def test_the_guest_is_its_own_kernel_without_host_paths_or_network(vm: AsyncSandbox, mhost: MicroHost) -> None:
    r = await vm.commands.run("uname -r; hostname; tr -d '\\0' < /proc/1/cmdline; echo; ls /sys/class/net")
    release, hostname, init, *nets = r.stdout.split()
    assert release.endswith("-cloud-amd64") and release != os.uname().release  # not the host's kernel
    assert hostname == "sandbox" and init == "/init"
    assert nets == ["lo"]  # no NIC: network is off
    # Nothing of the host's filesystem: its data dir and this repo are not there (positive control: /bin is).
    r = await vm.commands.run(f"test -e {mhost.data}; echo $?; test -e {Path(__file__).parent}; echo $?; test -e /bin/sh; echo $?")
    assert r.stdout.split() == ["1", "1", "0"]
    r = await vm.commands.run("cat /proc/meminfo | head -1; nproc")
    mem_kb, ncpu = int(r.stdout.split()[1]), int(r.stdout.split()[3])
    assert mem_kb < 300 * 1024 and ncpu == 1  # memory_mb=256 of guest RAM, cpu=1 vCPU


async def test_egress_rules_hold_on_the_vm_nic(mhost: MicroHost) -> None:
    """A microVM with ``network``: its virtio NIC is a tap bridged to the sandbox's veth in its own
    netns, so the guard's host-side rules hold for the guest's packets as for a container's, also
    after a host-agent restart. The peer is a test host netns on this machine (198.18.X.2); nothing
    leaves the machine; a kill leaves no netns, veth or tap."""
    th = TestHost()
    th.start()
    sid = f"{mhost.host_id}-net"
    try:
        allowed, other = await th.listen(), await th.listen()
        sb = await AsyncSandbox.create(**mhost.stack.kw(
            pool=mhost.pool, sandbox_id=sid, backend="microvm", memory_mb=256, disk_mb=256, create_timeout=BOOT_S,
            network={"allow_out": [f"{th.ip}:{allowed.port}"]},
        ))
        netns = f"/run/netns/{mhost.net.netns_prefix}{sid}"
        qemu_pid = int((mhost.vm_dir(sid) / "qemu.pid").read_text())
        # QEMU itself runs in the sandbox's netns (it holds the tap), not in the host's.
        assert os.stat(f"/proc/{qemu_pid}/ns/net").st_ino == os.stat(netns).st_ino != os.stat("/proc/self/ns/net").st_ino
        r = await sb.commands.run("ls /sys/class/net; ip -4 -o addr show dev eth0; ip -4 route")
        assert r.stdout.split()[:2] == ["eth0", "lo"], r.stdout
        assert "inet 10.210." in r.stdout and "default via 10.210." in r.stdout, r.stdout  # the claim's pool, /30
        gw = r.stdout.split("default via ", 1)[1].split()[0]
        ip = r.stdout.split("inet ", 1)[1].split("/")[0]

        # Allowed: the allowlisted host:port answers (masqueraded behind the host end of the veth).
        r = await sb.commands.run(f"echo hi | nc -w 10 {th.ip} {allowed.port}", timeout=60)
        assert r.stdout.startswith(f"hello-from-testhost {th.gw}"), r
        assert allowed.hits == 1

        # Denied: the same host on a port the allowlist does not name: the host side's not_allowed
        # rule resets the connect (ECONNREFUSED in the guest), and the listener sees nothing.
        before = counters(mhost.net.table)
        r = await sb.commands.run(f"nc -w 10 {th.ip} {other.port} </dev/null 2>&1; echo rc=$?", timeout=60)
        assert "Connection refused" in r.stdout and r.stdout.rstrip().endswith("rc=1"), r.stdout
        assert counters(mhost.net.table)["not_allowed"] > before["not_allowed"]
        assert other.hits == 0
        # Denied: the host itself (the veth's own address, the gateway the guest routes by).
        before = counters(mhost.net.table)
        r = await sb.commands.run(f"nc -w 10 {gw} 22 </dev/null 2>&1; echo rc=$?", timeout=60)
        assert "Connection refused" in r.stdout, r.stdout
        assert counters(mhost.net.table)["to_host"] > before["to_host"]
        # Root in the guest takes another address: the host side drops what it sends (spoofed).
        spoof = f"{ip.rsplit('.', 1)[0]}.{(int(ip.rsplit('.', 1)[1]) + 4) % 256}"
        before = counters(mhost.net.table)
        r = await sb.commands.run(
            f"ip addr add {spoof}/32 dev eth0 && ip route replace default via {gw} src {spoof} && echo hi | nc -w 5 {th.ip} {allowed.port} 2>&1;"
            f" echo rc=$?; ip route replace default via {gw}; ip addr del {spoof}/32 dev eth0", timeout=60,
        )
        assert "hello-from" not in r.stdout and "refused" not in r.stdout and r.stdout.rstrip().endswith("rc=1"), r.stdout  # dropped
        assert counters(mhost.net.table)["spoofed"] > before["spoofed"] and allowed.hits == 1
        r = await sb.commands.run(f"echo hi | nc -w 10 {th.ip} {allowed.port}", timeout=60)  # positive control: its own address
        assert r.stdout.startswith(f"hello-from-testhost {th.gw}") and allowed.hits == 2, r

        # A restarted host agent re-arms the running VM's rules (and removes no part of its network).
        await mhost.kill_agent()
        await mhost.start_agent()
        await answers_again(sb, SandboxNotFound, timeout=60, interval=0.2, what="the VM to answer again")
        assert int((mhost.vm_dir(sid) / "qemu.pid").read_text()) == qemu_pid and pid_alive(qemu_pid)
        r = await sb.commands.run(f"echo hi | nc -w 10 {th.ip} {allowed.port}", timeout=60)
        assert r.stdout.startswith(f"hello-from-testhost {th.gw}") and allowed.hits == 3, r
        r = await sb.commands.run(f"nc -w 10 {th.ip} {other.port} </dev/null 2>&1; echo rc=$?", timeout=60)
        assert "Connection refused" in r.stdout and other.hits == 0, r.stdout

        await sb.kill()

        def left() -> list[str]:
            found = mhost.leftovers(sid) + ([f"netns {netns}"] if os.path.lexists(netns) else [])
            for name in os.listdir("/sys/class/net"):  # the veth's host end carries the sandbox id as alias
                if name.startswith(mhost.net.prefix) and Path(f"/sys/class/net/{name}/ifalias").read_text().strip() == sid:
                    found.append(f"link {name}")
            return found

        await eventually(lambda: not left(), timeout=60, what=f"nothing of the VM's network left: {left()}")
    finally:
        th.stop()


@needs_fuse
async def test_memory_snapshot_forks_carry_on_a_running_process(vm: AsyncSandbox, mhost: MicroHost, lazy: LazyDaemon) -> None:
    await vm.files.write("/root/snap.txt", "at-snapshot")
    await vm.commands.run("(i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.2; done) >/dev/null 2>&1 &")

    async def count(sb: AsyncSandbox) -> int:  # (0 until the loop first wrote it, or mid-write)
        r = await sb.commands.run("cat /tmp/count 2>/dev/null || true")
        return int(r.stdout.strip() or 0)

    def past(sb: AsyncSandbox, n: int) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            return await count(sb) > n
        return check

    async def written(sb: AsyncSandbox) -> int:
        """The counter's value, read until the file is not mid-write (`echo > file` truncates it
        first: CI once read 0 there)."""
        seen: list[int] = []

        async def read() -> bool:
            seen.append(await count(sb))
            return seen[-1] > 0

        await eventually(read, timeout=30, what="the counter's value")
        return seen[-1]

    await eventually(past(vm, 1), timeout=30, what="the counter to run")
    forks = await vm.fork(2, memory=True, **mhost.stack.kw(pool=mhost.pool, backend="microvm", create_timeout=BOOT_S))
    try:
        assert len({f.sandbox_id for f in forks}) == 2
        for i, f in enumerate(forks):
            assert await f.files.read("/root/snap.txt") == "at-snapshot"
            # The counter is the source's process, restored from memory: it carries on from its value.
            before = await written(f)
            assert before >= 2
            await eventually(past(f, before), timeout=30, what="the restored counter to advance")
            r = await f.commands.run("ps -o args | grep -c '^/bin/sh -c (i=0'")
            assert r.stdout.strip() == "1"  # one loop, not restarted
            await f.files.write("/root/mine.txt", str(i))
        # Each fork has its own disk: its writes reach neither the other fork nor the source.
        assert not await vm.files.exists("/root/mine.txt")
        assert await forks[0].files.read("/root/mine.txt") == "0" and await forks[1].files.read("/root/mine.txt") == "1"
        # The source runs on (thawed after the snapshot).
        before = await count(vm)
        await eventually(past(vm, before), timeout=30, what="the source's counter")
    finally:
        await asyncio.gather(*(f.kill() for f in forks))
    gone = [f.sandbox_id for f in forks]
    await eventually(lambda: not any(mhost.leftovers(sid) for sid in gone), timeout=30, what="the forks to be gone")
    mem = mhost.data / "mvm" / "mem"
    assert not mem.exists() or not os.listdir(mem)  # the memory layer was mounted only while restoring


async def test_pause_stops_the_vm_and_resume_continues_it(vm: AsyncSandbox, mhost: MicroHost) -> None:
    from hostagent.backends.microvm import qemu

    qmp = str(mhost.vm_dir(vm.sandbox_id) / "qmp.sock")
    await vm.pause()
    assert (await vm.get_info()).state == "paused"
    (st,) = await qemu.qmp(qmp, ("query-status", {}))
    assert st["status"] == "paused"  # QEMU runs no vCPU: the guest is stopped, not just its agent
    await vm.resume()
    (st,) = await qemu.qmp(qmp, ("query-status", {}))
    assert st["status"] == "running"
    assert (await vm.commands.run("echo resumed")).stdout == "resumed\n"
    assert not (mhost.vm_dir(vm.sandbox_id) / "disk").is_mount()  # the disk mounted while frozen is let go


async def test_agent_restart_reattaches_to_the_running_vm(vm: AsyncSandbox, mhost: MicroHost) -> None:
    await vm.files.write("/workspace/state.txt", "before")
    await vm.commands.run("sleep 1000 >/dev/null 2>&1 &")
    qemu_pid = int((mhost.vm_dir(vm.sandbox_id) / "qemu.pid").read_text())
    await mhost.kill_agent()
    assert pid_alive(qemu_pid)  # the VM runs on without its host agent
    with pytest.raises(SandboxNotFound):
        await vm.commands.run("true")
    await mhost.start_agent()

    await answers_again(vm, SandboxNotFound, timeout=60, interval=0.2, what="the VM to answer again")
    assert await vm.files.read("/workspace/state.txt") == "before"
    assert (await vm.commands.run("ps -o args | grep -c '^sleep 1000'")).stdout.strip() == "1"  # its processes too
    assert int((mhost.vm_dir(vm.sandbox_id) / "qemu.pid").read_text()) == qemu_pid and pid_alive(qemu_pid)  # the same QEMU


async def test_qemu_killed_from_outside_is_lost_and_leaves_nothing(mhost: MicroHost) -> None:
    sid = f"{mhost.host_id}-doomed"
    sb = await mhost.create(sid)
    assert (await sb.commands.run("echo up")).stdout == "up\n"
    qemu_pid = int((mhost.vm_dir(sid) / "qemu.pid").read_text())
    assert pid_alive(qemu_pid) and mhost.leftovers(sid)  # positive control: the probe sees a live VM
    os.kill(qemu_pid, signal.SIGKILL)

    async def lost() -> bool:
        return await mhost.record_state(sid) == "lost"

    await eventually(lost, timeout=30, what="the sandbox to be recorded lost")
    await eventually(lambda: not mhost.leftovers(sid), timeout=30, what=f"nothing left: {mhost.leftovers(sid)}")
    assert not pid_alive(qemu_pid)


async def test_vm_backend_screen_shows_what_is_typed(mhost: MicroHost) -> None:
    """The full-VM backend, driven directly (test_envd drives it through the SDK and the gateway): a
    q35 PC whose display shows a shell on tty1; typed keys reach that shell and change the frame,
    a click reaches the guest's tablet."""
    from bus.errors import InvalidArgument

    st = await mhost.status()
    assert st is not None
    accel = next(b.detail["accel"] for b in st.backends if b.name == "microvm")  # the probe's answer on this host
    data = Path(tempfile.mkdtemp(prefix="dsec-vm-", dir="/tmp"))
    b = VMBackend(str(data), kernel_cache=KERNEL_CACHE, accel=accel)
    sid = "gui"
    try:
        await b.start()
        base = LayerRef(role="base", digest="sha256:" + "0" * 64, kind="dir", path=str(mhost.stack.rootfs))
        h = await b.create(SandboxSpec(sandbox_id=sid, template="base", backend="vm", cpu=1, memory_mb=256, disk_mb=256), [base])
        first = await b.screenshot(h)
        assert first.startswith(b"\x89PNG\r\n\x1a\n")
        await b.input_type(h, "echo typed-Text > /tmp/typed")
        await b.input_key(h, "enter")

        async def typed() -> bool:
            r = await b.exec(h, ExecRequest(cmd="cat /tmp/typed 2>/dev/null || true"), None)
            return r.stdout == b"typed-Text\n"

        await eventually(typed, timeout=60, what="the typed command to run in the screen's shell")
        after = await b.screenshot(h)
        assert after.startswith(b"\x89PNG") and after != first  # the frame shows it
        # A click reaches the guest as the tablet's input events (what an X server would read);
        # it is also the positive control for the refusals below.
        r = await b.exec(h, ExecRequest(cmd="for e in /sys/class/input/event*; do grep -q Tablet $e/device/name && echo ${e##*/}; done"), None)
        ev = r.stdout.decode().strip()
        assert ev.startswith("event"), r
        await b.exec(h, ExecRequest(cmd=f"cat /dev/input/{ev} > /tmp/ev 2>/dev/null & echo $! > /tmp/ev.pid"), None)

        async def events(least: int) -> bool:  # (while the reader runs)
            r = await b.exec(h, ExecRequest(cmd="test -d /proc/$(cat /tmp/ev.pid) && wc -c < /tmp/ev"), None)
            return r.exit_code == 0 and int(r.stdout) >= least

        await eventually(lambda: events(0), timeout=30, what="the event reader to run")
        assert not await events(1)  # nothing before the click
        await b.input_click(h, 10, 10)
        await eventually(lambda: events(4 * 24), timeout=30, what="the click's events (x, y, button down and up) in the guest")
        with pytest.raises(InvalidArgument):
            await b.input_click(h, 5000, 10)
        with pytest.raises(InvalidArgument):
            await b.input_key(h, "hyper+q")
    finally:
        await b.destroy(sid)
        assert await b.leftovers(sid) == []
        await b.stop()
        assert not processes_mentioning(str(data))
        shutil.rmtree(data, ignore_errors=True)


@asynccontextmanager
async def gui_backend(mhost: MicroHost) -> AsyncIterator[tuple[VMBackend, LayerRef]]:
    """The full-VM backend (the host's accelerator) and the GUI template's rootfs as a layer (built
    once by ``compose/gui-rootfs.sh``, cached); its VMs are destroyed after, nothing left."""
    rc, out, err = await run_process("bash", str(REPO / "compose" / "gui-rootfs.sh"), env=dict(os.environ), timeout=1800)
    assert rc == 0, err[-2000:]
    rootfs = out.strip().splitlines()[-1]
    st = await mhost.status()
    assert st is not None
    accel = next(b.detail["accel"] for b in st.backends if b.name == "microvm")
    data = Path(tempfile.mkdtemp(prefix="dsec-gui-", dir="/tmp"))
    b = VMBackend(str(data), kernel_cache=KERNEL_CACHE, accel=accel)
    try:
        await b.start()
        assert b.kernel is not None and not b.kernel.release.endswith("-cloud-amd64")  # the generic kernel: DRM, fbdev
        yield b, LayerRef(role="base", digest="sha256:" + "9" * 64, kind="dir", path=rootfs)
    finally:
        for sid in [v.name for v in b.vms.iterdir()] if b.vms.exists() else []:
            await b.destroy(sid)
            assert await b.leftovers(sid) == []
        await b.stop()
        assert not processes_mentioning(str(data))
        shutil.rmtree(data, ignore_errors=True)


async def desktop_up(b: VMBackend, handle: Handle) -> bool:
    """The desktop's terminal runs its shell: X is up, its input enabled, twm manages windows."""
    r = await b.exec(handle, ExecRequest(cmd="test -e /run/dsec-desktop && pgrep -x Xorg >/dev/null && pgrep -x twm >/dev/null"), None)
    return r.exit_code == 0


@pytest.mark.slow
async def test_gui_template_desktop_takes_typed_input_and_forks_running(mhost: MicroHost) -> None:
    """The GUI template (``compose/gui-rootfs.sh``: Xorg, twm, xterm; built once, cached) on the
    full-VM backend: the screen shows the desktop, keys typed into its terminal run there and change
    the frame; a memory snapshot of the running desktop forks into a VM whose desktop runs on."""
    async with gui_backend(mhost) as (b, base):
        data = b.data_dir
        h = await b.create(SandboxSpec(sandbox_id="desk", template="gui", backend="vm", cpu=1, memory_mb=512, disk_mb=512), [base])
        await eventually(lambda: desktop_up(b, h), timeout=600, interval=1, what="Xorg, twm and xterm")
        first = await b.screenshot(h)
        w, hh = await b.screen_size(h)
        assert first.startswith(b"\x89PNG") and (w, hh) >= (800, 600)  # the DRM mode, not the 720x400 text screen
        await b.input_click(h, 100, 100)  # into the terminal (at +20+20): twm's focus follows the pointer
        await b.input_type(h, "echo typed-in-xterm > /tmp/typed")
        await b.input_key(h, "enter")

        async def typed(handle: Handle) -> bool:
            r = await b.exec(handle, ExecRequest(cmd="cat /tmp/typed 2>/dev/null || true"), None)
            return r.stdout == b"typed-in-xterm\n"

        await eventually(lambda: typed(h), timeout=120, interval=1, what="the keys typed into xterm to run")
        after = await b.screenshot(h)
        assert after != first  # the frame shows the typed line

        # Fork of the running desktop: its memory snapshot restored as a new VM.
        img = data / "img"
        img.mkdir()
        await b.before_freeze(h)
        await b.freeze(h)
        await b.checkpoint(h, str(img), str(data))
        await b.thaw(h)
        mem_blob = data / "mem.erofs"
        rc, _, err = await run_process("mkfs.erofs", "--quiet", str(mem_blob), str(img), env=dict(os.environ), timeout=600)
        assert rc == 0, err
        mem = LayerRef(role="memory", digest="sha256:" + "8" * 64, kind="erofs", path=str(mem_blob))
        f = await b.create(SandboxSpec(sandbox_id="desk-fork", template="gui", backend="vm", cpu=1, memory_mb=512), [base], memory=mem)
        assert await desktop_up(b, f) and await typed(f)  # the same desktop, running, with what was typed
        await b.input_click(f, 100, 100)
        await b.input_type(f, "echo in-fork > /tmp/fork")
        await b.input_key(f, "enter")

        async def fork_typed() -> bool:
            r = await b.exec(f, ExecRequest(cmd="cat /tmp/fork 2>/dev/null || true"), None)
            return r.stdout == b"in-fork\n"

        await eventually(fork_typed, timeout=120, interval=1, what="the fork's desktop to take input")
        r = await b.exec(h, ExecRequest(cmd="test -e /tmp/fork; echo $?"), None)
        assert r.stdout == b"1\n"  # the source's desktop is its own


MAGENTA, GREEN = (255, 0, 255), (0, 255, 0)  # on no frame of the bare desktop (xterm, twm, the root window)
PAGE_PIXELS = 100_000  # the page's colour fills the browser's 640x480 window but for its bars: ~240,000 pixels


@pytest.mark.slow
async def test_gui_template_browser_shows_a_local_page_and_reloads_it(mhost: MicroHost) -> None:
    """The GUI template's browser (Dillo), opened inside the VM on a file:// page: the screen shows
    the page's colour, which the frame before it did not have; the page changed and reloaded with a
    key typed into the browser's window, the screen shows the new colour and none of the old."""
    async with gui_backend(mhost) as (b, base):
        h = await b.create(SandboxSpec(sandbox_id="web", template="gui", backend="vm", cpu=1, memory_mb=512, disk_mb=512), [base])
        await eventually(lambda: desktop_up(b, h), timeout=600, interval=1, what="Xorg, twm and xterm")

        def page(rgb: tuple[int, int, int]) -> str:
            colour = "#" + "".join(f"{c:02x}" for c in rgb)
            return (f"cat > /tmp/page.html <<'EOF'\n<html><head><title>dsec</title></head><body bgcolor=\"{colour}\">"
                    f"<h1>dsec page</h1></body></html>\nEOF")

        await b.exec(h, ExecRequest(cmd=page(MAGENTA)), None)
        before = await b.screenshot(h)
        assert png_pixels(before, MAGENTA) == 0  # negative control: the page is not on the screen yet
        r = await b.exec(h, ExecRequest(cmd="DISPLAY=:0 HOME=/root setsid dillo -g 640x480+300+100 file:///tmp/page.html "
                                            "</dev/null >/tmp/dillo.log 2>&1 & echo started"), None)
        assert r.stdout == b"started\n", r
        shots: list[bytes] = []

        async def shows(rgb: tuple[int, int, int]) -> bool:
            shots.append(await b.screenshot(h))
            return png_pixels(shots[-1], rgb) >= PAGE_PIXELS

        await eventually(lambda: shows(MAGENTA), timeout=300, interval=2, what="the browser to show the page")
        assert png_pixels(shots[-1], GREEN) == 0
        await b.exec(h, ExecRequest(cmd=page(GREEN)), None)
        await b.input_click(h, 620, 400)  # into the page (twm's focus follows the pointer)
        await b.input_key(h, "ctrl+r")  # Dillo's reload
        await eventually(lambda: shows(GREEN), timeout=300, interval=2, what="the reloaded page on the screen")
        assert png_pixels(shots[-1], MAGENTA) == 0  # the old page is gone from the frame
        r = await b.exec(h, ExecRequest(cmd="pgrep -x dillo >/dev/null && echo running"), None)
        assert r.stdout == b"running\n"  # the same browser, reloaded, not a new one
