"""The whole path through the real SDK: create -> exec -> files -> kill, on NATS, containerd + runc, real mounts.

Every test kills what it created and checks that nothing of it is left on the host: no task, container,
mounts, cgroups under /sys/fs/cgroup/*/dsec/<id>, scratch dir or image, loop device, or state file.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time

import pytest

from sdk import AsyncSandbox, CommandExitError, CommandTimeoutError, Sandbox, SandboxNotFound, UnknownTemplate
from sdk.errors import FileError, FileNotFound, InvalidArgument
from tests.conftest import eventually

from .conftest import Stack, cgroups_of, needs_stack

pytestmark = [pytest.mark.containerd, needs_stack]

MiB = 1 << 20


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


# --------------------------------------------------------------------------------------- commands
async def test_commands(stack: Stack) -> None:
    async with stack.sandbox(envs={"FOO": "from-spec"}, memory_mb=128) as sb:
        r = await sb.commands.run("echo out; echo err >&2")
        assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 0)

        with pytest.raises(CommandExitError) as ei:
            await sb.commands.run("echo partial; echo oops >&2; exit 7")
        assert ei.value.exit_code == 7 and ei.value.code == "command_exit"
        assert (ei.value.result.stdout, ei.value.result.stderr, ei.value.result.exit_code) == ("partial\n", "oops\n", 7)

        r = await sb.commands.run("echo $FOO $BAR", envs={"BAR": "from-call"})
        assert r.stdout == "from-spec from-call\n"
        r = await sb.commands.run("echo $FOO", envs={"FOO": "overridden"})
        assert r.stdout == "overridden\n"

        assert (await sb.commands.run("pwd", cwd="/tmp")).stdout == "/tmp\n"
        assert (await sb.commands.run("pwd")).stdout == "/\n"
        with pytest.raises(InvalidArgument, match="cwd"):
            await sb.commands.run("pwd", cwd="/no/such/dir")

        # A command past its timeout is killed; the sandbox lives on.
        t0 = time.monotonic()
        with pytest.raises(CommandTimeoutError) as te:
            await sb.commands.run("echo started; sleep 30", timeout=0.5)
        assert time.monotonic() - t0 < 10
        assert te.value.code == "timeout"
        assert (await sb.commands.run("echo alive")).stdout == "alive\n"

        async def sleep_gone() -> bool:
            return "sleep 30" not in (await sb.commands.run("ps -o args")).stdout

        await eventually(sleep_gone, timeout=5, what="the timed-out command to be killed")

        # Streamed output: every chunk reaches the callbacks (sync and async ones) before run() returns.
        out: list[str] = []
        err: list[str] = []

        async def on_err(s: str) -> None:
            err.append(s)

        r = await sb.commands.run(
            "for i in 1 2 3; do echo o$i; echo e$i >&2; sleep 0.05; done", on_stdout=out.append, on_stderr=on_err
        )
        assert "".join(out) == "o1\no2\no3\n" == r.stdout
        assert "".join(err) == "e1\ne2\ne3\n" == r.stderr
        assert len(out) >= 2  # streamed, not one chunk at the end

        # Lots of output, streamed and returned whole.
        got: list[str] = []
        r = await sb.commands.run("seq 1 20000", on_stdout=got.append)
        assert "".join(got) == r.stdout == "".join(f"{i}\n" for i in range(1, 20001))

        info = await sb.get_info()
        assert info.state == "running" and info.template == "base" and info.host_id == stack.host_id


# ------------------------------------------------------------------------------------------ files
async def test_files(stack: Stack) -> None:
    async with stack.sandbox(disk_mb=128) as sb:
        w = await sb.files.write("/tmp/t.txt", "héllo\nworld\n")
        assert w.path == "/tmp/t.txt" and w.size == len("héllo\nworld\n".encode())
        assert await sb.files.read("/tmp/t.txt") == "héllo\nworld\n"
        assert (await sb.commands.run("cat /tmp/t.txt")).stdout == "héllo\nworld\n"

        blob = bytes(range(256)) * 3
        await sb.files.write("/tmp/b.bin", blob)
        assert await sb.files.read("/tmp/b.bin", format="bytes") == blob

        big = os.urandom(3 * MiB + 12345)  # > 2 MiB: chunked both ways
        w = await sb.files.write("/workspace/big.bin", big)
        assert w.size == len(big)
        assert await sb.files.read("/workspace/big.bin", format="bytes") == big
        sha = (await sb.commands.run("sha256sum /workspace/big.bin")).stdout.split()[0]
        assert sha == hashlib.sha256(big).hexdigest()

        # Overwrite truncates.
        await sb.files.write("/tmp/t.txt", "short")
        assert await sb.files.read("/tmp/t.txt") == "short"

        entries = {e.name: e for e in await sb.files.list("/tmp")}
        assert entries["t.txt"].type == "file" and entries["t.txt"].size == 5
        assert entries["b.bin"].size == len(blob)
        assert entries["t.txt"].path == "/tmp/t.txt"
        await sb.commands.run("mkdir -p /tmp/sub && ln -s /tmp/t.txt /tmp/link")
        entries = {e.name: e for e in await sb.files.list("/tmp")}
        assert entries["sub"].type == "dir" and entries["link"].type == "symlink"

        assert await sb.files.exists("/tmp/b.bin")
        await sb.files.remove("/tmp/b.bin")
        assert not await sb.files.exists("/tmp/b.bin")
        assert not await sb.files.exists("/nope/nothing")
        with pytest.raises(FileNotFound):
            await sb.files.read("/tmp/b.bin")
        with pytest.raises(FileNotFound):
            await sb.files.list("/no/such/dir")

        # Files written through the API are seen by commands and the other way round.
        await sb.commands.run("echo from-shell > /tmp/s.txt")
        assert await sb.files.read("/tmp/s.txt") == "from-shell\n"


# ------------------------------------------------------------------------------------ sync client
async def test_sync_sandbox(stack: Stack) -> None:
    """The synchronous ``Sandbox`` (its own loop in a thread); run off this loop so the stack keeps serving."""
    sid = stack.new_id("sync")

    def body() -> int:
        with Sandbox.create(**stack.kw(sandbox_id=sid, memory_mb=64, timeout=120)) as sb:
            assert sb.sandbox_id == sid and sb.host_id == stack.host_id
            r = sb.commands.run("echo hi; echo there >&2")
            assert (r.stdout, r.stderr, r.exit_code) == ("hi\n", "there\n", 0)
            with pytest.raises(CommandExitError) as ei:
                sb.commands.run("exit 2")
            assert ei.value.result.exit_code == 2
            with pytest.raises(CommandTimeoutError):
                sb.commands.run("sleep 20", timeout=0.3)
            chunks: list[str] = []
            assert sb.commands.run("echo streamed", on_stdout=chunks.append).stdout == "streamed\n"
            assert "".join(chunks) == "streamed\n"
            assert sb.commands.run("echo $X", envs={"X": "y"}, cwd="/tmp").stdout == "y\n"

            sb.files.write("/tmp/a.txt", "text")
            assert sb.files.read("/tmp/a.txt") == "text"
            sb.files.write("/tmp/a.bin", b"\x00\x01\xff")
            assert sb.files.read("/tmp/a.bin", format="bytes") == b"\x00\x01\xff"
            assert {"a.txt", "a.bin"} <= {e.name for e in sb.files.list("/tmp")}
            assert sb.files.exists("/tmp/a.txt")
            sb.files.remove("/tmp/a.txt")
            assert not sb.files.exists("/tmp/a.txt")

            before = sb.get_info().expires_at
            sb.set_timeout(600)
            assert sb.get_info().expires_at > before + 400

            other = Sandbox.connect(sid, nats_url=stack.url)
            assert other.host_id == stack.host_id
            assert other.files.read("/tmp/a.bin", format="bytes") == b"\x00\x01\xff"
            assert sid in {i.sandbox_id for i in Sandbox.list(nats_url=stack.url)}
            assert sb.is_running()
            pid = stack.pid_of(sid)
        assert not other.is_running()
        with pytest.raises(SandboxNotFound):
            Sandbox.connect(sid, nats_url=stack.url)
        return pid

    pid = await asyncio.to_thread(body)
    await stack.assert_gone(sid, pid)


# ---------------------------------------------------------------------------- connect, list, kill
async def test_connect_list_kill_removes_everything(stack: Stack) -> None:
    sid = stack.new_id("kill")
    sb = await AsyncSandbox.create(**stack.kw(sandbox_id=sid, metadata={"run": stack.uid}))
    pid = stack.pid_of(sid)
    try:
        await sb.files.write("/tmp/keep", "v1")
        again = await AsyncSandbox.connect(sid, nats_url=stack.url)
        assert again.host_id == stack.host_id
        assert await again.files.read("/tmp/keep") == "v1"
        listed = {i.sandbox_id: i for i in await AsyncSandbox.list(nats_url=stack.url)}
        assert listed[sid].metadata == {"run": stack.uid} and listed[sid].host_id == stack.host_id

        # Everything the sandbox has on the host, before the kill.
        assert cgroups_of(stack.cid(sid)), "the sandbox has cgroups"
        assert await stack.leftovers(sid, pid), "the probes see a live sandbox"
        assert any(c.id == stack.cid(sid) and c.labels.get("dsec.sandbox") == sid and c.status == "running" for c in await stack.backend.rt.list())
    finally:
        await sb.kill()
    await stack.assert_gone(sid, pid)
    assert not await sb.is_running()
    await sb.kill()  # killing a gone sandbox is fine
    with pytest.raises(SandboxNotFound):
        await AsyncSandbox.connect(sid, nats_url=stack.url)
    with pytest.raises(SandboxNotFound):
        await sb.commands.run("true")
    assert sid not in {i.sandbox_id for i in await AsyncSandbox.list(nats_url=stack.url)}
    killed = [i for i in await AsyncSandbox.list(nats_url=stack.url, state="gone") if i.sandbox_id == sid]
    assert len(killed) == 1


# ------------------------------------------------------------------------------------- timeouts
async def test_sandbox_timeouts(stack: Stack) -> None:
    """A sandbox past its timeout is killed; ``set_timeout`` moves the deadline (both ways)."""
    short = await AsyncSandbox.create(**stack.kw(sandbox_id=stack.new_id("tmo"), timeout=1, memory_mb=32))
    moved = await AsyncSandbox.create(**stack.kw(sandbox_id=stack.new_id("tmo"), timeout=300, memory_mb=32))
    extended = await AsyncSandbox.create(**stack.kw(sandbox_id=stack.new_id("tmo"), timeout=2, memory_mb=32))
    pids = {sb.sandbox_id: stack.pid_of(sb.sandbox_id) for sb in (short, moved, extended)}
    try:
        await extended.set_timeout(300)
        await moved.set_timeout(1)
        t0 = time.monotonic()

        async def gone(sb: AsyncSandbox) -> bool:
            return not await sb.is_running()

        await eventually(lambda: gone(short), timeout=10, what="the short sandbox to time out")
        await eventually(lambda: gone(moved), timeout=10, what="the sandbox with a shortened timeout to go")
        assert time.monotonic() - t0 < 10
        await stack.assert_gone(short.sandbox_id, pids[short.sandbox_id])
        await stack.assert_gone(moved.sandbox_id, pids[moved.sandbox_id])
        # The extended one outlives its original 2 s deadline (wait for that deadline to pass, by polling).
        info = await extended.get_info()
        await eventually(lambda: time.time() > info.started_at + 3, timeout=10, what="the original deadline to pass")
        assert await extended.is_running()
        assert (await extended.commands.run("echo still")).stdout == "still\n"
    finally:
        for sb in (short, moved, extended):
            await sb.kill()
    await stack.assert_gone(extended.sandbox_id, pids[extended.sandbox_id])


# ------------------------------------------------------------------------- limits and isolation
async def test_limits_and_namespaces(stack: Stack) -> None:
    async with stack.sandbox(cpu=0.5, memory_mb=96, disk_mb=32) as sb:
        sid = sb.sandbox_id
        pid = stack.pid_of(sid)
        cg = "/sys/fs/cgroup"
        assert int(_read(f"{cg}/cpu/dsec/{sid}/cpu.cfs_quota_us")) == 50_000
        assert int(_read(f"{cg}/cpu/dsec/{sid}/cpu.cfs_period_us")) == 100_000
        assert int(_read(f"{cg}/memory/dsec/{sid}/memory.limit_in_bytes")) == 96 * MiB
        assert _read(f"{cg}/pids/dsec/{sid}/pids.max") == str(stack.backend.pids_max)
        assert str(pid) in _read(f"{cg}/memory/dsec/{sid}/cgroup.procs").split()

        # Own pid, mount, uts, ipc and network namespaces; the agent is PID 1 inside.
        for ns in ("pid", "mnt", "uts", "ipc", "net"):
            assert os.readlink(f"/proc/{pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}"), ns
        r = await sb.commands.run("cat /proc/1/cmdline | tr '\\0' ' '; echo; hostname; ls /sys/class/net")
        cmdline, hostname, *netdevs = r.stdout.split("\n")
        assert "dsec-agent" in cmdline and hostname == "sandbox"
        assert [d for d in netdevs if d] == ["lo"]

        # disk_mb: writing past it fails with ENOSPC inside the sandbox; the host disk is untouched.
        img = stack.data_dir / "scratch" / f"{stack.cid(sid)}.img"
        with pytest.raises(CommandExitError) as ei:
            await sb.commands.run("dd if=/dev/zero of=/tmp/fill bs=1M count=100")
        assert "No space left on device" in ei.value.stderr
        with pytest.raises(FileError, match="no space left"):
            await sb.files.write("/tmp/more.bin", b"\0" * (8 * MiB))
        used_inside = int((await sb.commands.run("du -sm /tmp/fill")).stdout.split()[0])
        assert 16 <= used_inside <= 40
        # Everything the sandbox wrote is in its scratch image, which holds no more than disk_mb (plus
        # filesystem metadata) of the host's disk; the image is sparse, the rest of the host is not written.
        # (Free space of the host disk itself is not compared: other tests and tools share it.)
        on_host = img.stat().st_blocks * 512
        assert 16 * MiB <= on_host <= (32 + 8) * MiB, f"{on_host / MiB:.1f} MiB of host disk for a 32 MB sandbox"
        assert img.stat().st_size <= (32 + 8) * MiB
        upper_dir = stack.data_dir / "scratch" / stack.cid(sid) / "upper"
        upper = await asyncio.to_thread(lambda: sum(p.stat().st_size for p in upper_dir.rglob("*") if p.is_file()))
        assert upper >= 16 * MiB  # the fill file is in the upper dir on that image (not elsewhere on the host)
        df = (await sb.commands.run("df -m / | tail -1")).stdout.split()
        assert 24 <= int(df[1]) <= 40, df  # the sandbox sees a root of about disk_mb
        # Freeing space inside makes room again.
        await sb.commands.run("rm /tmp/fill /tmp/more.bin 2>/dev/null; true")
        await sb.files.write("/tmp/after.bin", b"x" * MiB)



async def test_a_small_cpu_share_is_in_force_once_created(stack: Stack) -> None:
    """A container starts with the start-up share (its runc init and agent are not throttled by a
    tiny share) and runs under its own share and class from the moment its create is answered:
    cold, and claimed from the warm pool. A best-effort sandbox (the default) is SCHED_IDLE
    (``cpu.idle`` 1), for which the kernel reports the idle weight (3) as its shares."""
    from hostagent.backends.container import START_CPU
    from hostagent.backends.container.cgroups import class_shares

    cg = "/sys/fs/cgroup/cpu/dsec"
    disk = 40  # a disk size no other test asks for: the first create of it finds no warm container
    idle_weight = 3  # the kernel's WEIGHT_IDLEPRIO, what cpu.shares reads in a cpu.idle group

    def quota_shares_idle(cid: str) -> tuple[int, int, int]:
        return int(_read(f"{cg}/{cid}/cpu.cfs_quota_us")), int(_read(f"{cg}/{cid}/cpu.shares")), int(_read(f"{cg}/{cid}/cpu.idle"))

    def waiting() -> list[str]:
        return [w.cid for key, entries in stack.backend.pool.entries().items() if key.disk_mb == disk for w in entries]

    async with stack.sandbox(cpu=0.02, memory_mb=32, disk_mb=disk) as cold:
        assert stack.cid(cold.sandbox_id) == cold.sandbox_id  # started for this sandbox
        assert quota_shares_idle(cold.sandbox_id) == (2_000, idle_weight, 1)  # 0.02 of a CPU: 2 ms per 100 ms, best-effort
        await eventually(waiting, timeout=60, what="a warm container of that disk size")
        # Positive control: a waiting pool container runs with the start-up share, not idle (it starts fast).
        assert quota_shares_idle(waiting()[0]) == (int(START_CPU * 100_000), class_shares(START_CPU, "latency-sensitive"), 0)
        async with stack.sandbox(cpu=0.02, memory_mb=32, disk_mb=disk) as warm:
            cid = stack.cid(warm.sandbox_id)
            assert cid.startswith("wp-")  # claimed from the pool
            assert quota_shares_idle(cid) == (2_000, idle_weight, 1)
            assert int(_read(f"/sys/fs/cgroup/memory/dsec/{cid}/memory.limit_in_bytes")) == 32 * MiB
            assert (await warm.commands.run("echo up")).stdout == "up\n"


# -------------------------------------------------------------------------------- errors by name
async def test_unknown_template_and_killed_sandbox(stack: Stack) -> None:
    with pytest.raises(UnknownTemplate, match=f"nope-{stack.uid}"):
        await AsyncSandbox.create(template=f"nope-{stack.uid}", **stack.kw(create_timeout=20))
    sid = stack.new_id("gone")
    sb = await AsyncSandbox.create(**stack.kw(sandbox_id=sid, memory_mb=32))
    await sb.kill()
    with pytest.raises(SandboxNotFound, match=sid):
        await AsyncSandbox.connect(sid, nats_url=stack.url)
    await stack.assert_gone(sid)


# ---------------------------------------------------------------------------- burst and replicas
async def test_200_concurrent_creates_two_replicas(stack: Stack) -> None:
    """200 concurrent creates all succeed, both placement replicas take work, and kill leaves nothing."""
    n = 200
    placed_before = [p.placed for p in stack.placements]
    ids = [stack.new_id(f"burst{i}") for i in range(n)]
    t0 = time.monotonic()
    results = await asyncio.gather(
        *(AsyncSandbox.create(**stack.kw(sandbox_id=sid, memory_mb=32, disk_mb=16, cpu=0.1, create_timeout=150)) for sid in ids),
        return_exceptions=True,
    )
    created_s = time.monotonic() - t0
    sbs = [r for r in results if isinstance(r, AsyncSandbox)]
    errors = [r for r in results if not isinstance(r, AsyncSandbox)]
    pids = {sb.sandbox_id: stack.pid_of(sb.sandbox_id) for sb in sbs if sb.sandbox_id in stack.host.handles}
    try:
        assert not errors, f"{len(errors)} of {n} creates failed: {errors[:3]}"
        placed = [p.placed - b for p, b in zip(stack.placements, placed_before, strict=True)]
        assert sum(placed) >= n
        assert all(c > 0 for c in placed), f"both placement replicas must take work under load, got {placed}"
        # Each one is a working sandbox.
        outs = await asyncio.gather(*(sb.commands.run("echo $HOSTNAME") for sb in sbs))
        assert all(o.stdout == "sandbox\n" for o in outs)
        print(f"\n{n} concurrent creates in {created_s:.1f}s ({n / created_s:.0f}/s); placed per replica: {placed}")
    finally:
        await asyncio.gather(*(sb.kill() for sb in sbs), return_exceptions=True)
    await asyncio.gather(*(stack.assert_gone(sid, pids.get(sid), timeout=60) for sid in ids))
    cids = tuple(stack.cid(sid) for sid in ids)
    assert not [p for p in (stack.data_dir / "scratch").iterdir() if p.name.startswith(cids)]
    assert not [sid for sid in ids if sid in stack.host.live]
