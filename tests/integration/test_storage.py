"""What a sandbox makes the host store, on the real stack (containerd sandboxes, the real lazy loader
packing into the real NATS object store): sparse and repetitive files snapshot cheaply and come back
with their holes; quotas refuse a snapshot before it writes; a full data dir fails typed and heals;
gc reclaims what nothing references, even racing a snapshot that reuses a chunk."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bus import codec
from bus import subjects as S
from bus.streams import ensure_kv
from sdk import AsyncSandbox
from tests.conftest import eventually
from tests.imaged.conftest import LazyDaemon, needs_fuse

from .conftest import Stack, disk_bytes, needs_stack
from .test_snapshots import many  # noqa: F401 - a fixture

pytestmark = [pytest.mark.containerd, needs_stack, needs_fuse]
GiB, TiB = 1 << 30, 1 << 40


async def _record(stack: Stack, snapshot_id: str) -> Any:
    kv = await ensure_kv(stack.js, S.KV_SNAPSHOTS)
    return codec.SNAPSHOT.decode((await kv.get(snapshot_id)).value)


async def test_sparse_8g_and_1t_snapshot_fork_restore_with_holes(stack: Stack, lazy: LazyDaemon) -> None:  # noqa: F811
    images = stack.data_dir / "images"
    async with stack.sandbox() as sb:
        r = await sb.commands.run(f"truncate -s {8 * GiB} /root/s8g && truncate -s {TiB} /root/s1t")
        assert r.exit_code == 0, r.stderr
        host_before = disk_bytes(images)
        t0 = time.perf_counter()
        s = await sb.create_snapshot("sparse")
        took = time.perf_counter() - t0
        host_added = disk_bytes(images) - host_before
        rec = await _record(stack, s.snapshot_id)
        layer = rec.layers[-1]
        print(f"sparse 8 GiB + 1 TiB: snapshot {took:.3f}s, layer {layer.size} bytes, uploaded {s.bytes_added}, host +{host_added} bytes")
        # Before: 70 s and 8 GiB of the host's disk for the 8 GiB file alone.
        assert layer.size < 64 * 1024 and s.bytes_added < 64 * 1024 and host_added < 1024 * 1024
        assert took < 10, took  # the freeze, the pack and the round trips on a busy 2-core host
        forks = await sb.fork(2, **stack.kw())
        restored = await AsyncSandbox.create(snapshot=s.snapshot_id, **stack.kw())
        async with many(stack, [*forks, restored]):
            for other in [*forks, restored]:
                out = (await other.commands.run("stat -c '%s %n' /root/s8g /root/s1t")).stdout.split("\n")
                assert out[:2] == [f"{8 * GiB} /root/s8g", f"{TiB} /root/s1t"]
                # Reads are zeros from the lower layer's holes ...
                z = await other.commands.run("dd if=/root/s1t bs=4096 skip=$((1<<27)) count=1 2>/dev/null | od -An -c | head -2")
                assert z.stdout.split() == ["\\0"] * 16 + ["*"]
                # ... and a write copies the file up into the sandbox's own upper dir, holes and all: the
                # sandbox's 1 GiB disk quota would refuse an expanded copy of either file.
                w = await other.commands.run("echo tail >> /root/s8g && echo tail >> /root/s1t && stat -c '%s %b' /root/s8g /root/s1t")
                assert w.exit_code == 0, w.stderr
                (s8, b8), (s1, b1) = (map(int, line.split()) for line in w.stdout.split("\n")[:2])
                assert (s8, s1) == (8 * GiB + 5, TiB + 5) and b8 <= 64 and b1 <= 64
                assert (await other.commands.run("tail -c 5 /root/s1t")).stdout == "tail\n"


async def test_repeated_blocks_snapshot_stores_one_block(stack: Stack, lazy: LazyDaemon) -> None:  # noqa: F811
    async with stack.sandbox() as sb:
        r = await sb.commands.run(
            "head -c 4096 /dev/urandom > /root/blk && for i in $(seq 1 8); do cat /root/blk /root/blk /root/blk /root/blk; done > /root/x32"
            " && for i in $(seq 1 64); do cat /root/x32; done > /root/rep && rm /root/x32 && md5sum /root/rep | cut -c1-32"
        )
        assert r.exit_code == 0, r.stderr
        s = await sb.create_snapshot("repeated")
        layer = (await _record(stack, s.snapshot_id)).layers[-1]
        assert layer.size < 64 * 1024, layer.size  # 8 MiB of one 4 KiB block (plus that block on its own)
        async with many(stack, [await AsyncSandbox.create(snapshot=s.snapshot_id, **stack.kw())]) as (back,):
            assert (await back.commands.run("md5sum /root/rep | cut -c1-32")).stdout == r.stdout


def _limit(stack: Stack, monkeypatch: pytest.MonkeyPatch, **settings: int) -> None:
    """The stack's host agent as if started with these ``HostAgentConfig`` settings (its snapshot
    limits are the config's, made once; the test changes them on the running agent)."""
    from hostagent._storage import Limits

    cfg = stack.host.config.replace(**settings)
    monkeypatch.setattr(stack.host, "config", cfg)
    monkeypatch.setattr(stack.host.snapshots, "limits", Limits.of(cfg))


async def _layer_keys(stack: Stack) -> set[str]:
    from imaged._store import open_blob_store

    return set(await open_blob_store(stack.js).keys("layers/"))


async def test_snapshot_quota_per_sandbox_refuses_before_writing(stack: Stack, lazy: LazyDaemon, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    from bus.errors import QuotaExceeded

    _limit(stack, monkeypatch, snapshot_max_bytes_per_sandbox=4 << 20)
    async with stack.sandbox() as sb:
        await sb.commands.run("head -c 3000000 /dev/urandom > /root/a")
        s1 = await sb.create_snapshot("under")  # positive control: 3 MB of 4 MiB
        assert s1.bytes_added > 3_000_000
        await sb.commands.run("head -c 1500000 /dev/urandom > /root/b")
        layers = await _layer_keys(stack)
        with pytest.raises(QuotaExceeded, match=r"per-sandbox snapshot limit of 4194304 bytes") as ei:
            await sb.create_snapshot("over")
        assert ei.value.code == "quota_exceeded" and ei.value.context["limit"] == "snapshot_bytes_per_sandbox"
        assert ei.value.context["max"] == str(4 << 20)
        # Refused before the pack: no layer, no record; the sandbox runs on.
        assert await _layer_keys(stack) == layers
        assert [s.snapshot_id for s in await AsyncSandbox.list_snapshots(nats_url=stack.url, sandbox_id=sb.sandbox_id)] == [s1.snapshot_id]
        assert (await sb.commands.run("echo alive")).stdout == "alive\n"
        # Just under again: what is staged now (the 1.5 MB file gone, 0.5 MB new) fits beside the first snapshot.
        await sb.commands.run("rm /root/b && head -c 500000 /dev/urandom > /root/c")
        s3 = await sb.create_snapshot("under-again")
        assert s3.parent_id == s1.snapshot_id and 500_000 < s3.bytes_added < 1 << 20
        # A persisted pause is a snapshot too: refused the same way, and the sandbox stays running.
        await sb.commands.run("head -c 1000000 /dev/urandom > /root/d")
        with pytest.raises(QuotaExceeded, match="per-sandbox"):
            await sb.pause(persist=True)
        assert (await sb.get_info()).state == "running"


async def test_snapshot_quota_per_tenant(stack: Stack, lazy: LazyDaemon, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    from bus.errors import QuotaExceeded

    tenant = f"tenant-{stack.uid}"
    # The tenant is the connection's NATS user (placement binds the spec to it): this stack's server
    # checks no password, so a connection naming a user speaks as that tenant.
    as_tenant = stack.url.replace("nats://", f"nats://{tenant}:x@", 1)
    _limit(stack, monkeypatch, snapshot_max_bytes_per_tenant=3 << 20)
    async with stack.sandbox(nats_url=as_tenant) as a, stack.sandbox(nats_url=as_tenant) as b, stack.sandbox() as operator:
        assert a.tenant == tenant and b.tenant == tenant and operator.tenant != tenant
        await a.commands.run("head -c 2000000 /dev/urandom > /root/a")
        await a.create_snapshot()  # 2 MB of the tenant's 3 MiB
        await b.commands.run("head -c 1200000 /dev/urandom > /root/b")
        with pytest.raises(QuotaExceeded, match=rf"tenant '{tenant}' .* per-tenant snapshot limit of 3145728 bytes"):
            await b.create_snapshot()
        await b.commands.run("rm /root/b && head -c 900000 /dev/urandom > /root/b")
        await b.create_snapshot()  # just under: 2.9 MB
        # Another tenant (the operator) is not charged for it.
        await operator.commands.run("head -c 1200000 /dev/urandom > /root/o")
        _limit(stack, monkeypatch, snapshot_max_bytes_per_tenant=_usage_of(await _records(stack), operator.tenant) + (2 << 20))
        await operator.create_snapshot()
    import json

    from .test_snapshots import _cli

    rc, out, err = await _cli(stack, "ls", "--usage", "--json")
    assert rc == 0, err
    use = json.loads(out)
    assert 2_900_000 < use["tenants"][tenant] < 3 << 20 and use["sandboxes"][a.sandbox_id] > 2_000_000
    # The same figures, with the limit in force and the host's free disk, in `dsec status` and /metrics.
    from bus.metrics import parse
    from bus.runtime import scrape_one
    from sdk._admin import cluster_status

    from .test_metrics import _value

    limit = stack.host.snapshots.limits.per_tenant

    async def status_shows() -> bool:
        st = (await cluster_status(stack.url))["storage"]
        return st["tenants"].get(tenant) == {"used_bytes": use["tenants"][tenant], "limit_bytes": limit} and st["disk_free_mb"][stack.host_id] > 0

    await eventually(status_shows, timeout=15, what="dsec status to show the tenant's bytes against the limit of the next heartbeat")
    scraped = parse((await scrape_one(stack.nc, "hostagent", stack.host_id)).text)
    assert _value(scraped, "dsec_snapshot_bytes", tenant=tenant) == use["tenants"][tenant]
    assert _value(scraped, "dsec_storage_limit_bytes", limit="snapshot_bytes_per_tenant") == limit
    assert _value(scraped, "dsec_storage_limit_bytes", limit="snapshot_bytes_per_sandbox") == stack.host.snapshots.limits.per_sandbox


async def _records(stack: Stack) -> list[Any]:
    from hostagent._storage import snapshot_records

    return await snapshot_records(stack.js)


def _usage_of(recs: list[Any], client: str) -> int:
    """The snapshot bytes charged to the tenant whose sandboxes' ``spec.client`` is ``client``."""
    return sum(r.bytes_added for r in recs if (r.spec.client if r.spec else "") == client)


class SmallDisk:
    """A real small file system (ext4 on a loop device, no reserved blocks) for a host's data dir;
    ``fill`` fills it to the last block from an outside process."""

    def __init__(self, root: Path, mb: int) -> None:
        self.image, self.mnt, self.fill_path = root / "disk.img", root / "data", root / "data" / "fill"
        self.mnt.mkdir(parents=True)
        with open(self.image, "wb") as f:
            f.truncate(mb << 20)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(self.image)], check=True, capture_output=True)
        self.loop = subprocess.run(["losetup", "--find", "--show", str(self.image)], check=True, capture_output=True, text=True).stdout.strip()
        subprocess.run(["mount", self.loop, str(self.mnt)], check=True, capture_output=True)

    def fill(self) -> None:
        for bs in ("1M", "4K"):  # big writes, then the last blocks one by one
            p = subprocess.run(["dd", "if=/dev/zero", f"of={self.fill_path}", f"bs={bs}", "oflag=append", "conv=notrunc"], capture_output=True)
            assert p.returncode != 0 and b"No space left" in p.stderr, p.stderr
        subprocess.run(["sync", "-f", str(self.mnt)], check=True)

    def ballast(self, leave_mb: int) -> None:
        """Fill the file system from outside until ``leave_mb`` MiB are left free."""
        subprocess.run(["fallocate", "-l", str(self.free_bytes() - (leave_mb << 20)), str(self.fill_path)], check=True)
        subprocess.run(["sync", "-f", str(self.mnt)], check=True)

    def free(self) -> None:
        self.fill_path.unlink()
        subprocess.run(["sync", "-f", str(self.mnt)], check=True)

    def free_bytes(self) -> int:
        st = os.statvfs(self.mnt)
        return st.f_bfree * st.f_frsize

    def close(self) -> None:
        for _ in range(50):  # a mount the lazy loader's holder or a sandbox's loop had is let go lazily
            if subprocess.run(["umount", str(self.mnt)], capture_output=True).returncode == 0 or not os.path.ismount(self.mnt):
                break
            time.sleep(0.1)  # poll interval, not synchronisation
        subprocess.run(["losetup", "-d", self.loop], capture_output=True)


@dataclass
class SmallHost:
    """A host agent of the test's own (container backend, its lazy loader) whose data dir is a
    ``SmallDisk``, in its own pool, seen by the stack's placement."""

    host: Any
    disk: SmallDisk
    host_id: str
    pool: str
    hosts_kv: Any
    placement: Any


@contextlib.asynccontextmanager
async def small_host(stack: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mb: int = 384, **config: Any) -> Any:
    from hostagent import HostAgent, HostAgentConfig
    from hostagent.backends.container import ContainerBackend
    from tests.netclaim import claim_net

    for p in stack.placements:  # the floor for this small disk (the default is 1 GiB)
        monkeypatch.setattr(p.table, "policy", dataclasses.replace(p.table.policy, min_disk_free_mb=64))
    disk = SmallDisk(tmp_path, mb)
    d = disk.mnt
    host_id = pool = f"full-{stack.uid}"
    net = await asyncio.to_thread(claim_net)
    backend = ContainerBackend(str(d), scratch_size_gb=8, warm_pool=0, network=net.config())
    host = HostAgent(backend, HostAgentConfig(nats_url=stack.url, host_id=host_id, data_dir=str(d), pool=pool, concurrency=4, heartbeat_s=0.5,
                                              destroy_on_shutdown=True, grace_s=10.0, **config))
    lazy_d = LazyDaemon(data_dir=d, mount=d / "lazy", nats_url=stack.url, host_id=host_id)
    hosts_kv = await ensure_kv(stack.js, S.KV_HOSTS)
    try:
        await host.start()
        lazy_d.start()
        placement = stack.placements[0]
        await eventually(lambda: host_id in placement.table.hosts, timeout=15, what="placement to see the host")
        assert placement.table.why_not(placement.table.hosts[host_id], sb_spec(pool)) == ""
        yield SmallHost(host, disk, host_id, pool, hosts_kv, placement)
    finally:
        try:
            await host.shutdown()
            lazy_d.release()
            with contextlib.suppress(Exception):
                await hosts_kv.delete(host_id)
            await net.purge()
            net.release()
        finally:
            disk.close()


async def test_full_disk_fails_typed_writes_nothing_and_heals(stack: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bus.errors import NoSpace

    async with small_host(stack, tmp_path, monkeypatch) as sh:
        host, disk, d, host_id, pool, hosts_kv, placement = sh.host, sh.disk, sh.disk.mnt, sh.host_id, sh.pool, sh.hosts_kv, sh.placement
        sb = await AsyncSandbox.create(pool=pool, nats_url=stack.url, disk_mb=128, create_timeout=30)
        async with own(host, [sb]):
            await sb.commands.run("head -c 1000000 /dev/urandom > /root/before && md5sum /root/before > /root/sum")
            layers = await _layer_keys(stack)
            await asyncio.to_thread(disk.fill)
            assert disk.free_bytes() < 8 << 20  # what ext4 holds back for its own metadata

            # The heartbeat says so, placement sends the host no creates, and the disk watch has seen it
            # (it samples after the heartbeat is written: CI once looked in between).
            async def full_seen() -> bool:
                st = codec.HOST_STATUS.decode((await hosts_kv.get(host_id)).value)
                e = placement.table.hosts.get(host_id)
                return (0 < st.disk_free_mb < 8 and e is not None and placement.table.why_not(e, sb_spec(pool)) == "disk-full"
                        and host.diskwatch.full)

            await eventually(full_seen, timeout=15, what="the heartbeat to report the full disk")
            assert host.diskwatch.reported == []  # filled from outside: no sandbox is blamed
            from bus.metrics import parse
            from bus.runtime import scrape_one

            from .test_metrics import _value

            scraped = parse((await scrape_one(stack.nc, "hostagent", host_id)).text)
            assert _value(scraped, "dsec_host_disk_bytes", kind="free") < 8 << 20 < _value(scraped, "dsec_host_disk_bytes", kind="total")
            with pytest.raises(NoSpace, match="disk is full") as ei:
                await sb.create_snapshot("full")
            assert ei.value.code == "no_space"
            with pytest.raises(NoSpace):
                await sb.files.write("/root/upload", b"x" * 100_000)
            # Nothing half-written is visible: no record, no layer, no staging or pack leftovers.
            assert await AsyncSandbox.list_snapshots(nats_url=stack.url, sandbox_id=sb.sandbox_id) == []
            assert await _layer_keys(stack) == layers
            assert list((d / "images" / "tmp").iterdir()) == [] and not list((d / "images" / "blobs").iterdir())
            assert not await sb.files.exists("/root/upload")
            # The sandbox runs on and its files are intact.
            assert (await sb.commands.run("md5sum -c /root/sum")).exit_code == 0
            # A create that reaches the host all the same (placement's floor off) fails typed too.
            for p in stack.placements:
                monkeypatch.setattr(p.table, "policy", dataclasses.replace(p.table.policy, min_disk_free_mb=0))
            with pytest.raises(NoSpace, match="create: the host's disk is full"):
                await AsyncSandbox.create(pool=pool, nats_url=stack.url, disk_mb=128, create_timeout=30)
            for p in stack.placements:
                monkeypatch.setattr(p.table, "policy", dataclasses.replace(p.table.policy, min_disk_free_mb=64))

            # Space comes back: everything works again, no restart.
            await asyncio.to_thread(disk.free)
            await eventually(full_seen_not(hosts_kv, host_id), timeout=15, what="the heartbeat to report room")
            s = await sb.create_snapshot("after")
            await sb.files.write("/root/upload", b"x" * 100_000)
            assert (await sb.files.read("/root/upload")) == "x" * 100_000
            back = await AsyncSandbox.create(snapshot=s.snapshot_id, pool=pool, nats_url=stack.url, disk_mb=128)
            async with own(host, [back]):
                assert (await back.commands.run("md5sum -c /root/sum")).exit_code == 0
            from imaged._snapshots import remove_snapshot
            from imaged._store import open_blob_store

            await remove_snapshot(stack.js, open_blob_store(stack.js), s.snapshot_id, data_dir=d)



async def test_a_sandbox_that_fills_the_disk_is_flagged_to_guard(stack: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The host's (small, real) disk mostly taken from outside, a sandbox writes until it is full: the
    host agent reports it, not the quiet sandbox beside it nor the outside writer, as a ``disk`` guard
    violation; guard applies the sandbox's profile (``audit.other``: quarantine here), and the quiet
    sandbox runs on once the filler is gone."""
    import msgspec

    from bus.errors import SandboxNotFound
    from bus.messages import AuditPolicy, GuardViolation
    from bus.profiles import builtin_profiles, default_profile
    from guard import Guard

    q = msgspec.structs.replace(default_profile(), name=f"quar-st-{stack.uid}", audit=AuditPolicy(other="quarantine"))
    profiles = await ensure_kv(stack.js, S.KV_PROFILES)
    await profiles.put(q.name, codec.encode(q))
    got: list[GuardViolation] = []

    async def on_violation(msg: Any) -> None:
        v = codec.EVENT.decode(msg.data)
        if isinstance(v, GuardViolation):
            got.append(v)

    sub = await stack.nc.subscribe(S.EVT_GUARD_VIOLATION, cb=on_violation)
    g = Guard(stack.url, host_id=f"guard-{stack.uid}", kernel_audit=False, profiles={**builtin_profiles(), q.name: q})
    await g.start()
    try:
        async with small_host(stack, tmp_path, monkeypatch, disk_growth_window_s=600.0) as sh:
            host = sh.host
            await eventually(lambda: q.name in host.profiles.profiles, timeout=10, what="the host agent to see the profile")
            quiet = await AsyncSandbox.create(pool=sh.pool, nats_url=stack.url, disk_mb=128, create_timeout=30)
            filler = await AsyncSandbox.create(pool=sh.pool, nats_url=stack.url, disk_mb=200, profile=q.name, create_timeout=30)
            async with own(host, [quiet, filler]):
                # the baseline: both disks sampled before anything is written
                await eventually(lambda: {quiet.sandbox_id, filler.sandbox_id} <= set(host.diskwatch.disk), timeout=15, what="the first samples")
                assert (await quiet.commands.run("head -c 4000000 /dev/urandom > /root/q")).exit_code == 0
                await asyncio.to_thread(sh.disk.ballast, 150)  # before the window's baseline too: not a sandbox's doing
                # 190 MB into its 200 MB disk, a sparse image in the host's last 150 MB: the host fills first
                # (guard may kill it before the command returns: then its exec ends with the sandbox)
                with contextlib.suppress(SandboxNotFound):
                    await filler.commands.run("head -c 190000000 /dev/zero > /root/big; sync", timeout=300)
                await eventually(lambda: any(v.sandbox_id == filler.sandbox_id for v in got), timeout=30, what="the disk violation")
                v = next(v for v in got if v.sandbox_id == filler.sandbox_id)
                assert v.kind == "disk" and v.action == "record" and v.host_id == sh.host_id and v.detail["source"] == "hostagent.disk"
                assert int(v.detail["growth_bytes"]) > 80 << 20 and int(v.detail["free_bytes"]) < 64 << 20
                assert not any(x.sandbox_id == quiet.sandbox_id for x in got)  # it wrote 4 MB: not the cause
                # Guard applies the filler's profile: quarantined (the violation kept) and killed.
                qkv = await ensure_kv(stack.js, S.KV_QUARANTINE)

                async def quarantined() -> bool:
                    try:
                        return (await qkv.get(filler.sandbox_id)).value is not None
                    except Exception:  # noqa: BLE001 - not yet
                        return False

                await eventually(quarantined, timeout=30, what="guard to quarantine the filler")
                await eventually(lambda: filler.sandbox_id not in host.live, timeout=60, what="the filler to be killed")
                # Its disk is given back, and the quiet sandbox never stopped.
                await eventually(lambda: sh.disk.free_bytes() > 100 << 20, timeout=30, what="the space to come back")
                assert (await quiet.commands.run("echo alive")).stdout == "alive\n"
    finally:
        await g.shutdown()
        await sub.unsubscribe()
        await profiles.delete(q.name)


@contextlib.asynccontextmanager
async def own(host: Any, sbs: list[AsyncSandbox]) -> Any:
    """Kill ``sbs`` (of a host agent of the test's own) at the end, and wait until the host let them go."""
    from tests.conftest import eventually

    try:
        yield sbs
    finally:
        await asyncio.gather(*(sb.kill() for sb in sbs), return_exceptions=True)
        await eventually(lambda: not any(sb.sandbox_id in host.live for sb in sbs), timeout=20, what="the sandboxes to go")


def sb_spec(pool: str) -> Any:
    from bus.messages import SandboxSpec

    return SandboxSpec(sandbox_id="probe", template="base", pool=pool, disk_mb=128)


def full_seen_not(kv: Any, host_id: str) -> Any:
    async def check() -> bool:
        return codec.HOST_STATUS.decode((await kv.get(host_id)).value).disk_free_mb > 64

    return check


async def test_memory_dump_counts_against_the_quota(stack: Stack, lazy: LazyDaemon, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """A CRIU dump is charged before anything is packed (its anonymous memory, ahead; its real size once
    dumped): refused with no record, no layer and no dump left when the files fit and the dump does
    not; the same snapshot fits a limit above the dump's size."""
    import shutil

    from bus.errors import QuotaExceeded

    if not shutil.which("criu", path=os.environ.get("PATH", "") + ":/usr/local/sbin:/usr/sbin"):
        pytest.skip("needs CRIU")
    prof = await _nolandlock_profile(stack)
    try:
        async with stack.sandbox(profile=prof) as sb:
            await sb.commands.run("echo small > /root/f && setsid sh -c 'while true; do sleep 1; done' >/dev/null 2>&1 &")
            _limit(stack, monkeypatch, snapshot_max_bytes_per_sandbox=64 * 1024)  # the files' diff fits, no dump does
            layers = await _layer_keys(stack)
            await sb.create_snapshot()  # positive control: the files alone fit
            await sb.commands.run("echo more > /root/g")
            with pytest.raises(QuotaExceeded, match=r"per-sandbox snapshot limit of 65536 bytes"):
                await sb.create_snapshot(memory=True)
            assert len(await _layer_keys(stack) - layers) == 1  # the files-only snapshot's: the refused one packed nothing
            assert len(await AsyncSandbox.list_snapshots(nats_url=stack.url, sandbox_id=sb.sandbox_id)) == 1
            criu = stack.data_dir / "criu"
            assert not criu.exists() or not list(criu.iterdir())
            assert (await sb.commands.run("echo alive")).stdout == "alive\n"
            _limit(stack, monkeypatch, snapshot_max_bytes_per_sandbox=256 << 20)
            s = await sb.create_snapshot(memory=True)
            assert s.memory and s.bytes_added > 64 * 1024
    finally:
        await (await ensure_kv(stack.js, S.KV_PROFILES)).delete(prof)


async def _nolandlock_profile(stack: Stack) -> str:
    import msgspec

    from bus.profiles import default_profile
    from tests.conftest import eventually

    name = f"nolandlock-st-{stack.uid}"
    p = default_profile()
    prof = msgspec.structs.replace(p, name=name, fs=msgspec.structs.replace(p.fs, landlock=False, required=False))
    await (await ensure_kv(stack.js, S.KV_PROFILES)).put(name, codec.encode(prof))
    await eventually(lambda: name in stack.host.profiles.profiles, timeout=10, what="the host agent to see the profile")
    return name


async def test_random_data_near_the_disk_quota_snapshots_and_restores(stack: Stack, lazy: LazyDaemon) -> None:  # noqa: F811
    async with stack.sandbox(disk_mb=256) as sb:
        r = await sb.commands.run("head -c 200000000 /dev/urandom > /root/r && md5sum /root/r | cut -c1-32 && df -m / | tail -1")
        want = r.stdout.split("\n")[0]
        s = await sb.create_snapshot("random")
        assert s.bytes_added >= 200_000_000
        async with many(stack, [await AsyncSandbox.create(snapshot=s.snapshot_id, disk_mb=256, **stack.kw())]) as (back,):
            assert (await back.commands.run("md5sum /root/r | cut -c1-32")).stdout.strip() == want
