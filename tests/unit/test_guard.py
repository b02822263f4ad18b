"""Guard's profiles and audit reader, and the host agent's compilation of profiles (no containers).

The seccomp program the host compiles for the in-sandbox agent is run here through a small
classic-BPF interpreter, so its decisions (architecture check, 32-bit masked ioctl compare,
namespace flags, device nodes) are checked exactly as the kernel would evaluate them.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import struct
import uuid
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.js.errors import KeyNotFoundError

from bus import codec
from bus import subjects as S
from bus.errors import InvalidArgument
from bus.messages import GuardViolation, KillRequest, SandboxRecord, SandboxSpec, SecurityProfile
from guard import DENY_IOCTLS, Denial, KernelAudit, SandboxMap, builtin_profiles, default_profile, parse_record, publish_profiles
from bus import profiles as gp
from hostagent import _profiles as hp
from tests.conftest import cannot_run, eventually, needs

X86_64, I386 = 0xC000003E, 0x40000003
ALLOW, KILL = hp.SECCOMP_RET_ALLOW, hp.SECCOMP_RET_KILL_PROCESS
EPERM = hp.SECCOMP_RET_ERRNO | 1
TABLE = {"getpid": 39, "mount": 165, "ioctl": 16, "clone": 56, "unshare": 272, "mknod": 133, "mknodat": 259, "bpf": 321, "setns": 308, "read": 0}


def run_bpf(prog: bytes, nr: int, arch: int = X86_64, args: tuple[int, ...] = ()) -> int:
    """Evaluate a seccomp classic-BPF program on one syscall (the subset the compiler emits)."""
    a6 = (list(args) + [0] * 6)[:6]
    data = struct.pack("=iIQ6Q", nr, arch, 0, *a6)
    insns = [struct.unpack_from("=HBBI", prog, i) for i in range(0, len(prog), 8)]
    acc, pc = 0, 0
    for _ in range(10000):
        code, jt, jf, k = insns[pc]
        if code == 0x20:
            acc = struct.unpack_from("=I", data, k)[0]
        elif code == 0x54:
            acc &= k
        elif code == 0x15:
            pc += jt if acc == k else jf
        elif code == 0x35:
            pc += jt if acc >= k else jf
        elif code == 0x06:
            return k
        else:
            raise AssertionError(f"unexpected BPF opcode {code:#x}")
        pc += 1
    raise AssertionError("BPF program did not return")


@pytest.fixture(scope="module")
def prog() -> bytes:
    return hp.compile_log_filter(default_profile().syscalls, table=hp.syscall_numbers(), arch=("SCMP_ARCH_X86_64", X86_64, 0x40000000))


# --------------------------------------------------------------------------------- profiles
def test_default_profile_shape() -> None:
    p = default_profile()
    assert not set(gp.ALLOW) & set(gp.DENY)
    assert {"mount", "bpf", "io_uring_setup", "keyctl", "ptrace", "open_by_handle_at", "setns", "kexec_load"} <= set(gp.DENY)
    assert "ioctl" in gp.ALLOW and "clone" not in gp.ALLOW and "unshare" not in gp.ALLOW
    assert not {"CAP_SYS_ADMIN", "CAP_NET_ADMIN", "CAP_MKNOD", "CAP_NET_RAW", "CAP_SYS_PTRACE", "CAP_BPF"} & set(p.capabilities)
    assert p.fs.read_only == ["/"] and {"/tmp", "/workspace"} <= set(p.fs.writable)
    assert DENY_IOCTLS["XFS_IOC_SWAPEXT"] == 0xC0C0586D and DENY_IOCTLS["FICLONE"] == 0x40049409
    assert DENY_IOCTLS["FIDEDUPERANGE"] == 0xC0189436 and DENY_IOCTLS["EXT4_IOC_MOVE_EXT"] == 0xC028660F
    strict = builtin_profiles()["strict"]
    assert strict.audit.seccomp == "kill" and strict.syscalls == p.syscalls
    # round trip through the bus encoding
    assert msgspec.msgpack.decode(codec.encode(p), type=SecurityProfile) == p


def test_oci_seccomp_is_an_allow_list_for_the_native_abi_only() -> None:
    oci = hp.compile_oci_seccomp(default_profile().syscalls, arch=("SCMP_ARCH_X86_64", X86_64, 0x40000000))
    assert oci["defaultAction"] == "SCMP_ACT_ERRNO" and oci["defaultErrnoRet"] == 1
    assert oci["architectures"] == ["SCMP_ARCH_X86_64"]  # i386 and x32 calls hit the bad-arch action
    allow = oci["syscalls"][0]
    assert allow["action"] == "SCMP_ACT_ALLOW" and "ioctl" in allow["names"] and "mount" not in allow["names"]
    denied = {n for r in oci["syscalls"] if r["action"] == "SCMP_ACT_ERRNO" and "args" not in r for n in r["names"]}
    assert {"mount", "bpf", "setns", "io_uring_setup"} <= denied
    clone = [r for r in oci["syscalls"] if r["names"] == ["clone"]]
    assert clone == [{"names": ["clone"], "action": "SCMP_ACT_ALLOW", "args": [
        {"index": 0, "value": gp.CLONE_NS_MASK, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}]}]
    # libseccomp would drop a conditional ioctl rule next to the unconditional allow: not emitted
    assert not [r for r in oci["syscalls"] if r["names"] == ["ioctl"]]
    assert {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38} in oci["syscalls"]


def test_agent_filter_decisions(prog: bytes) -> None:
    n = hp.syscall_numbers()
    assert run_bpf(prog, n["getpid"]) == ALLOW
    assert run_bpf(prog, n["read"]) == ALLOW
    for name in ("mount", "bpf", "setns", "io_uring_setup", "keyctl", "kexec_load", "init_module", "open_by_handle_at", "ptrace"):
        assert run_bpf(prog, n[name]) == EPERM, name
    # foreign ABIs are killed whatever the call
    assert run_bpf(prog, 20, arch=I386) == KILL
    assert run_bpf(prog, 21, arch=I386) == KILL
    assert run_bpf(prog, 0x40000000 | n["getpid"]) == KILL
    # ioctls: compared on the low 32 bits, high bits can't dodge
    for name, cmd in DENY_IOCTLS.items():
        for high in (0, 1 << 32, 0xFFFFFFFF << 32):
            assert run_bpf(prog, n["ioctl"], args=(3, cmd | high, 0)) == EPERM, (name, high)
    assert run_bpf(prog, n["ioctl"], args=(3, 0x541B, 0)) == ALLOW  # FIONREAD
    assert run_bpf(prog, n["ioctl"], args=(3, 0xFFFFFFFF_C0189437, 0)) == ALLOW  # musl sign-extends: still fine
    # namespaces
    assert run_bpf(prog, n["clone"], args=(17,)) == ALLOW
    assert run_bpf(prog, n["clone"], args=(0x10000000 | 17,)) == EPERM
    assert run_bpf(prog, n["clone"], args=(0x00020000,)) == EPERM
    assert run_bpf(prog, n["unshare"], args=(0,)) == ALLOW
    assert run_bpf(prog, n["unshare"], args=(0x200,)) == ALLOW
    assert run_bpf(prog, n["unshare"], args=(0x80,)) == EPERM  # CLONE_NEWTIME
    assert run_bpf(prog, n["unshare"], args=(0x10000000,)) == EPERM
    # device nodes only
    assert run_bpf(prog, n["mknod"], args=(0, 0o020600, 0x101)) == EPERM
    assert run_bpf(prog, n["mknod"], args=(0, 0o010644, 0)) == ALLOW
    assert run_bpf(prog, n["mknodat"], args=(0, 0, 0o060600, 0x800)) == EPERM
    assert run_bpf(prog, n["mknodat"], args=(0, 0, 0o100644, 0)) == ALLOW


def test_compile_profile_agent_args() -> None:
    e = hp.compile_profile(default_profile())
    args = list(e.agent_args)
    assert args[:2] == ["--landlock-ro", "/"] and "--landlock-required" in args
    assert args[args.index("--audit-loginuid") + 1] == str(hp.AUDIT_LOGINUID)
    pairs = list(itertools.pairwise(args))
    assert ("--landlock-rw", "/tmp") in pairs and ("--landlock-rw", "/workspace") in pairs and ("--landlock-dev", "/dev") in pairs
    bpf = bytes.fromhex(args[args.index("--seccomp-bpf") + 1])
    assert len(bpf) % 8 == 0 and len(bpf) // 8 < hp.BPF_MAXINSNS
    assert e.capabilities == tuple(default_profile().capabilities) and e.landlock_required
    off = msgspec.structs.replace(default_profile(), fs=msgspec.structs.replace(default_profile().fs, landlock=False))
    assert not [a for a in hp.compile_profile(off).agent_args if a.startswith("--landlock")]
    with pytest.raises(InvalidArgument, match="not absolute"):
        hp.landlock_args(msgspec.structs.replace(default_profile().fs, writable=["relative/path"]))


def test_system_paths_become_read_only_mounts() -> None:
    """Landlock can't refuse metadata changes, so the system paths are read-only mounts as well;
    the spec hands them to runc, and a profile whose read-only mount would swallow one of its own
    writable paths is refused rather than quietly breaking that path."""
    from hostagent.backends.container.containerd import build_spec

    fs = default_profile().fs
    e = hp.compile_profile(default_profile())
    assert set(gp.SYSTEM_PATHS) <= set(e.readonly_paths) and set(gp.READONLY_PATHS) <= set(e.readonly_paths)
    assert {"/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc"} <= set(gp.SYSTEM_PATHS)
    assert not {"/tmp", "/workspace", "/root", "/home", "/var", "/"} & set(e.readonly_paths)
    spec = build_spec("sb-x", args=["/init"], env={}, cpu=1.0, memory_mb=64, pids_max=64, readonly_paths=e.readonly_paths)
    assert spec["linux"]["readonlyPaths"] == list(e.readonly_paths) and spec["root"]["readonly"] is False
    for bad in (["/"], ["/var"], ["/workspace"], ["/dev"], ["etc"]):
        with pytest.raises(hp.InvalidArgument):
            hp.readonly_mounts(msgspec.structs.replace(fs, readonly_paths=bad))
    assert hp.readonly_mounts(msgspec.structs.replace(fs, readonly_paths=["/usr/", "/usr", "/opt"])) == ("/usr", "/opt")
    # The warm pool keys on the fingerprint: same name and version, other mounts -> other key.
    no_etc = msgspec.structs.replace(default_profile(), fs=msgspec.structs.replace(fs, readonly_paths=[p for p in fs.readonly_paths if p != "/etc"]))
    assert hp.compile_profile(no_etc).fingerprint != e.fingerprint
    assert hp.compile_profile(default_profile()).fingerprint == e.fingerprint


# ------------------------------------------------------------------------------ audit records
def test_parse_record() -> None:
    serial, f = parse_record(
        'audit(1795943804.067:3): auid=1685284195 uid=0 ses=2 pid=18551 comm="sc" exe=2F746D702F612062 sig=0 arch=c000003e syscall=110 code=0x50000'
    )
    assert serial == "3" and f["comm"] == "sc" and f["exe"] == "/tmp/a b" and f["syscall"] == "110" and f["ses"] == "2"


def _fake_host(tmp: Path, sid: str, agent_pid: int, ses: int) -> SandboxMap:
    (tmp / "proc" / str(agent_pid)).mkdir(parents=True)
    (tmp / "proc" / str(agent_pid) / "sessionid").write_text(f"{ses}")
    (tmp / "proc" / str(agent_pid) / "cgroup").write_text(f"12:pids:/dsec/{sid}\n1:name=systemd:/\n")
    cg = tmp / "cg" / "pids" / "dsec" / sid
    cg.mkdir(parents=True)
    (cg / "cgroup.procs").write_text(f"{agent_pid}\n")
    return SandboxMap("/dsec", proc=str(tmp / "proc"), cgroup_root=str(tmp / "cg"))


def test_kernel_records_map_to_sandboxes(tmp_path: Path) -> None:
    m = _fake_host(tmp_path, "sb-one", 4242, 9)
    got: list[Denial] = []
    k = KernelAudit(got.append, sandbox_map=m)
    auid = 1685284195
    # a process that already exited: found by its audit session
    k.feed(1326, f'audit(1.0:10): auid={auid} uid=0 gid=0 ses=9 pid=99999 comm="sysx" exe="/tmp/sysx" sig=0 '
                 'arch=c000003e syscall=165 compat=0 ip=0x1 code=0x50000')
    # a 32-bit call, killed
    k.feed(1326, f'audit(1.0:11): auid={auid} uid=0 gid=0 ses=9 pid=99998 comm="sysx" exe="/tmp/sysx" sig=31 '
                 'arch=40000003 syscall=21 compat=1 ip=0x1 code=0x80000000')
    # not a sandbox: ignored
    k.feed(1326, 'audit(1.0:12): auid=4294967295 uid=0 gid=0 ses=4294967295 pid=99997 comm="x" exe="/x" sig=0 '
                 'arch=c000003e syscall=165 compat=0 ip=0x1 code=0x50000')
    # Landlock: access + domain + syscall + end of event
    k.feed(1423, 'audit(1.0:13): domain=abc blockers=fs.write_file path="/etc/passwd" dev="overlay" ino=5')
    k.feed(1424, 'audit(1.0:13): domain=abc status=allocated mode=enforcing pid=4242 uid=0 exe="/.dsec/bin/dsec-agent" comm="dsec-agent"')
    k.feed(1300, f'audit(1.0:13): arch=c000003e syscall=257 success=no exit=-13 ppid=4242 pid=99996 auid={auid} uid=0 ses=9 '
                 'comm="sh" exe="/bin/busybox" key=(null)')
    k.feed(1320, "audit(1.0:13): ")
    # Landlock without a syscall record: the domain's creator names the sandbox
    k.feed(1423, 'audit(1.0:14): domain=abc blockers=fs.remove_file path="/bin" dev="overlay" ino=6')
    k._flush()
    assert [(d.kind, d.sandbox_id, d.what, d.killed) for d in got] == [
        ("seccomp", "sb-one", "mount", False),
        ("seccomp", "sb-one", "i386 mount", True),
        ("landlock", "sb-one", "fs.write_file /etc/passwd", False),
        ("landlock", "sb-one", "fs.remove_file /bin", False),
    ]
    assert got[0].detail["exe"] == "/tmp/sysx" and got[2].detail["comm"] == "sh"


# ------------------------------------------------------------------------------ KV and service
async def test_publish_profiles_is_idempotent_and_versioned(nats_server: Any) -> None:
    from nats.js.api import KeyValueConfig

    from bus import connect
    from bus.streams import KV_BUCKETS

    nc = await connect(nats_server.url)
    try:
        js = nc.jetstream()
        bucket = f"t_profiles_{uuid.uuid4().hex[:8]}"
        kv = await js.create_key_value(config=KeyValueConfig(bucket=bucket, history=KV_BUCKETS[S.KV_PROFILES]["history"]))
        p = default_profile()
        assert await publish_profiles(kv, [p]) == {"default": "created"}
        assert await publish_profiles(kv, [p]) == {"default": "kept"}
        assert await publish_profiles(kv, [msgspec.structs.replace(p, version=p.version + 1)]) == {"default": "updated"}
        assert await publish_profiles(kv, [p]) == {"default": "kept"}  # never downgrades an operator's newer one
        hist = await kv.history("default")
        assert len(hist) == 2
        await js.delete_key_value(bucket)
    finally:
        await nc.close()


async def test_host_profile_cache_watches_kv(nats_server: Any) -> None:
    from bus import connect
    from bus.streams import ensure_kv

    nc = await connect(nats_server.url)
    cache = hp.ProfileCache()
    try:
        js = nc.jetstream()
        kv = await ensure_kv(js, S.KV_PROFILES)
        name = f"t-{uuid.uuid4().hex[:8]}"
        await cache.start(js)
        assert cache.enforcement("default").profile == "default"  # KV may be empty: built-in copy
        with pytest.raises(hp.UnknownProfile):
            cache.enforcement(name)
        custom = msgspec.structs.replace(default_profile(), name=name, version=3)
        await kv.put(name, codec.encode(custom))
        await eventually(lambda: name in cache.profiles, timeout=5, what="the watch to deliver")
        assert cache.enforcement(name).version == 3
        await kv.put(name, b"garbage")  # a bad document never replaces the last good one
        await kv.delete(name)
        await eventually(lambda: name not in cache.profiles, timeout=5, what="the delete")
    finally:
        await cache.stop()
        await nc.close()


async def test_guard_applies_the_sandboxs_audit_policy(nats_server: Any) -> None:
    """A denial of a strict sandbox: violation published, kill requested on dsec.sbx.<id>.kill."""
    from bus import connect
    from bus.streams import ensure_kv
    from guard import Guard

    nc = await connect(nats_server.url)
    g = Guard(nats_server.url, host_id="h-test", kernel_audit=False)
    await g.start()
    try:
        js = nc.jetstream()
        sbx = await ensure_kv(js, S.KV_SANDBOXES)
        strict_id, default_id = f"sb-s-{uuid.uuid4().hex[:6]}", f"sb-d-{uuid.uuid4().hex[:6]}"
        # One machine may run several hosts under one guard (dsec up --hosts): a violation names the
        # host of the sandbox's record, the guard's own id only when the record names none.
        for sid, prof, host in ((strict_id, "strict", ""), (default_id, "default", "h-other")):
            await sbx.put(sid, codec.encode(SandboxRecord(spec=SandboxSpec(sandbox_id=sid, profile=prof), state="running", host_id=host)))
        kills: list[tuple[str, KillRequest]] = []
        violations: list[GuardViolation] = []

        async def on_kill(msg: Any) -> None:
            kills.append((msg.subject, codec.SBX_KILL.decode(msg.data)))
            from bus.messages import Done

            await msg.respond(codec.encode(Done(detail="killed")))

        async def on_violation(msg: Any) -> None:
            violations.append(codec.EVENT.decode(msg.data))

        s1 = await nc.subscribe(S.sbx(strict_id, "kill"), cb=on_kill)
        s2 = await nc.subscribe(S.sbx(default_id, "kill"), cb=on_kill)
        s3 = await nc.subscribe(S.EVT_GUARD_VIOLATION, cb=on_violation)
        await nc.flush()
        for sid in (strict_id, default_id):
            g._on_denial(Denial(kind="seccomp", sandbox_id=sid, what="bpf", detail={"exe": "/tmp/x", "pid": "7"}))
            g._on_denial(Denial(kind="seccomp", sandbox_id=sid, what="bpf", detail={"exe": "/tmp/x", "pid": "8"}))
        await eventually(lambda: len(violations) >= 2 and len(kills) >= 1, timeout=5, what="violations and the kill")
        await asyncio.sleep(0.2)  # let a wrong second kill or report show up, if there were one
        assert [k[0] for k in kills] == [S.sbx(strict_id, "kill")]
        assert kills[0][1].reason == "guard-kill: seccomp bpf"
        by = {v.sandbox_id: v for v in violations}
        assert by[strict_id].action == "kill" and by[default_id].action == "record"
        assert (by[strict_id].host_id, by[default_id].host_id) == ("h-test", "h-other")
        assert len(violations) == 2, "the repeat within the report interval is folded"
        # The agent acting for the host API is recorded, never killed for.
        g._on_denial(Denial(kind="landlock", sandbox_id=strict_id, what="fs.write_file /etc/x", detail={"exe": "/.dsec/bin/dsec-agent"}))
        await eventually(lambda: len(violations) == 3, timeout=5, what="agent violation")
        assert violations[-1].action == "record" and violations[-1].detail["process"] == "agent"
        for s in (s1, s2, s3):
            await s.unsubscribe()
    finally:
        await g.shutdown()
        await nc.close()


async def test_guard_reports_a_containers_denials_under_the_sandbox_it_serves(nats_server: Any, monkeypatch: Any) -> None:
    """The kernel names a warm-pool container (``wp-...``) or a later generation's (``<id>-g<n>``); the
    sandbox's record names that container, and guard reports and acts under the sandbox's id: also for
    a denial that came before the record (held until it comes). A container no record names is
    reported under its own id once the wait is over; a sandbox's own id is reported at once."""
    from bus import connect
    from bus.messages import Done
    from bus.streams import ensure_kv
    from guard import Guard
    from guard import _service as gs

    monkeypatch.setattr(gs, "ALIAS_WAIT_S", 120.0)  # far beyond the test: a report before a record is never its timeout's
    nc = await connect(nats_server.url)
    g = Guard(nats_server.url, host_id="h-test", kernel_audit=False)
    await g.start()
    try:
        js = nc.jetstream()
        sbx = await ensure_kv(js, S.KV_SANDBOXES)
        u = uuid.uuid4().hex[:6]
        warm_id, gen_id, cold_id = f"sb-w-{u}", f"sb-g-{u}", f"sb-c-{u}-g7"  # (a sandbox's own id may look like a generation's)
        warm_cid, gen_cid, stray_cid = f"wp-{u}a", f"{gen_id}-g2", f"wp-{u}b"

        async def record(sid: str, cid: str, profile: str = "strict") -> None:
            rec = SandboxRecord(spec=SandboxSpec(sandbox_id=sid, profile=profile), state="running", container_id=cid)
            await sbx.put(sid, codec.encode(rec))

        await record(gen_id, gen_cid)
        await record(cold_id, "", "default")
        await eventually(lambda: g.sandbox_of(gen_cid) == gen_id, timeout=5, what="the generation's container mapped")
        kills: list[str] = []
        violations: list[GuardViolation] = []

        async def on_kill(msg: Any) -> None:
            kills.append(msg.subject)
            await msg.respond(codec.encode(Done(detail="killed")))

        async def on_violation(msg: Any) -> None:
            violations.append(codec.EVENT.decode(msg.data))

        subs = [await nc.subscribe(S.sbx(sid, "kill"), cb=on_kill) for sid in (warm_id, gen_id, cold_id, warm_cid, gen_cid, stray_cid)]
        subs.append(await nc.subscribe(S.EVT_GUARD_VIOLATION, cb=on_violation))
        await nc.flush()
        g._on_denial(Denial(kind="landlock", sandbox_id=warm_cid, what="fs.make_reg /var/evil", detail={"exe": "/bin/sh"}))
        g._on_denial(Denial(kind="seccomp", sandbox_id=gen_cid, what="bpf", detail={"exe": "/tmp/x"}))
        g._on_denial(Denial(kind="seccomp", sandbox_id=cold_id, what="bpf", detail={"exe": "/tmp/x"}))
        await eventually(lambda: {v.sandbox_id for v in violations} == {gen_id, cold_id}, timeout=10, what="the known ones' reports")
        assert not [v for v in violations if v.sandbox_id in (warm_id, warm_cid)], "the warm container's denial waits for its record"
        await record(warm_id, warm_cid)  # the claim's record arrives after the denial
        await eventually(lambda: any(v.sandbox_id == warm_id for v in violations), timeout=10, what="the held denial reported")
        monkeypatch.setattr(gs, "ALIAS_WAIT_S", 0.5)
        g._on_denial(Denial(kind="seccomp", sandbox_id=stray_cid, what="bpf", detail={"exe": "/tmp/x"}))
        await eventually(lambda: any(v.sandbox_id == stray_cid for v in violations), timeout=10, what="the stray container's report")
        await eventually(lambda: len(kills) >= 2, timeout=5, what="the strict sandboxes' kills")
        by = {v.sandbox_id: v for v in violations}
        assert by[warm_id].detail["container_id"] == warm_cid and by[warm_id].action == "kill"
        assert by[gen_id].detail["container_id"] == gen_cid and by[gen_id].action == "kill"
        assert "container_id" not in by[cold_id].detail and by[cold_id].action == "record"
        assert by[stray_cid].action == "record"  # no record: the default profile
        assert sorted(kills) == sorted([S.sbx(warm_id, "kill"), S.sbx(gen_id, "kill")])
        await sbx.delete(warm_id)
        await eventually(lambda: g.sandbox_of(warm_cid) is None, timeout=5, what="a deleted record's container forgotten")
        for s in subs:
            await s.unsubscribe()
    finally:
        await g.shutdown()
        await nc.close()


# ------------------------------------------------------------------------------- the agent itself
def _landlock_abi() -> int:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1)))


@pytest.fixture(scope="module")
def agent_bin(tmp_path_factory: Any) -> str:
    from hostagent._agent import ensure_agent_binary

    return ensure_agent_binary(str(tmp_path_factory.mktemp("agent")))


@needs(None if _landlock_abi() >= 1 else "kernel without Landlock")
async def test_agent_confines_itself_before_serving(tmp_path: Path, agent_bin: str) -> None:
    """The agent applies Landlock and its audited seccomp filter to itself; commands inherit both."""
    import os
    import signal
    import subprocess

    from hostagent._agent import AgentClient, AgentError

    binary = agent_bin
    rw = tmp_path / "rw"
    sock = str(tmp_path / "agent.sock")
    bpf = hp.compile_log_filter(default_profile().syscalls).hex()
    args = [binary, "--socket", sock, "--landlock-ro", "/", "--landlock-rw", str(rw), "--landlock-dev", "/dev",
            "--landlock-required", "--seccomp-bpf", bpf]
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        client = AgentClient(sock, expected_pid=proc.pid)
        info = await client.wait_ready(10)
        assert info.landlock and info.landlock_abi == _landlock_abi() and info.seccomp_log and not info.audit_session
        assert rw.is_dir()  # created because it was missing
        out = await client.exec(f"echo in > {rw}/f && cat {rw}/f && echo x > /dev/null && echo ok")
        assert out.exit_code == 0 and out.stdout == b"in\nok\n", out
        out = await client.exec(f"echo x > {tmp_path}/outside")
        assert out.exit_code != 0 and b"Permission denied" in out.stderr, out
        out = await client.exec("grep -E '^(NoNewPrivs|Seccomp):' /proc/self/status")
        assert out.stdout.split() == [b"NoNewPrivs:", b"1", b"Seccomp:", b"2"], out
        with pytest.raises(AgentError) as ei:
            await client.write_file(str(tmp_path / "nope"), b"x")
        assert ei.value.errno == 13
        await client.write_file(str(rw / "yes"), b"x")
        assert (rw / "yes").read_bytes() == b"x"
        assert not (tmp_path / "outside").exists() and not (tmp_path / "nope").exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
        if os.path.exists(sock):
            os.unlink(sock)  # the confined agent may not remove it itself


async def test_agent_exits_on_a_bad_seccomp_program(tmp_path: Path, agent_bin: str) -> None:
    import subprocess

    r = subprocess.run([agent_bin, "--socket", str(tmp_path / "s.sock"), "--seccomp-bpf", "zz"], capture_output=True, timeout=10)
    assert r.returncode != 0 and b"--seccomp-bpf" in r.stderr


async def test_guard_quarantines_and_acts_on_other_components_reports(nats_server: Any) -> None:
    """``quarantine`` kills and keeps the violation in KV dsec_quarantine; a violation another
    component published (say, the network filter, action "record") gets the profile's ``other``."""
    from bus import connect
    from bus.messages import AuditPolicy, Done
    from bus.streams import ensure_kv
    from guard import Guard

    q = msgspec.structs.replace(default_profile(), name=f"q-{uuid.uuid4().hex[:6]}", audit=AuditPolicy(seccomp="quarantine", landlock="record", other="kill"))
    nc = await connect(nats_server.url)
    g = Guard(nats_server.url, host_id="h-test", kernel_audit=False, profiles={**builtin_profiles(), q.name: q})
    await g.start()
    subs = []
    try:
        js = nc.jetstream()
        sbx = await ensure_kv(js, S.KV_SANDBOXES)
        a, b = f"sb-qa-{uuid.uuid4().hex[:6]}", f"sb-qb-{uuid.uuid4().hex[:6]}"
        for sid in (a, b):
            await sbx.put(sid, codec.encode(SandboxRecord(spec=SandboxSpec(sandbox_id=sid, profile=q.name), state="running")))
        kills: list[tuple[str, str]] = []

        async def on_kill(msg: Any) -> None:
            kills.append((msg.subject.split(".")[3], codec.SBX_KILL.decode(msg.data).reason))
            await msg.respond(codec.encode(Done(detail="killed")))

        for sid in (a, b):
            subs.append(await nc.subscribe(S.sbx(sid, "kill"), cb=on_kill))
        await nc.flush()
        g._on_denial(Denial(kind="seccomp", sandbox_id=a, what="keyctl", detail={"exe": "/tmp/x"}))
        await js.publish(S.EVT_GUARD_VIOLATION, codec.encode(GuardViolation(
            sandbox_id=b, at=0.0, kind="network", what="egress to 203.0.113.9:443", action="record", detail={"source": "hostagent.network"})))
        await eventually(lambda: len(kills) == 2, timeout=10, what="both kills")
        assert dict(kills) == {a: "guard-quarantine: seccomp keyctl", b: "guard-kill: network egress to 203.0.113.9:443"}
        qkv = await js.key_value(S.KV_QUARANTINE)
        v = codec.EVENT.decode((await qkv.get(a)).value)
        assert isinstance(v, GuardViolation) and v.action == "quarantine" and v.what == "keyctl"
        with pytest.raises(KeyNotFoundError):
            await qkv.get(b)
    finally:
        for s in subs:
            await s.unsubscribe()
        await g.shutdown()
        await nc.close()


# ------------------------------------------------------------------------------- dropped packets (NFLOG)
def _nla(kind: int, data: bytes) -> bytes:
    n = 4 + len(data)
    return struct.pack("=HH", n, kind) + data + b"\0" * ((4 - n % 4) % 4)


def _nflog_packet(payload: bytes, *, ifindex: int = 1, prefix: str = "dsec-drop not_allowed", hw: int = 0x0800) -> bytes:
    """An NFULNL_MSG_PACKET body as the kernel lays it out (nfgenmsg + attributes)."""
    from guard._nflog import NFULA_IFINDEX_INDEV, NFULA_PACKET_HDR, NFULA_PAYLOAD, NFULA_PREFIX

    return (struct.pack("=BBH", 2, 0, 0) + _nla(NFULA_PACKET_HDR, struct.pack("!HBx", hw, 2)) + _nla(NFULA_IFINDEX_INDEV, struct.pack("!I", ifindex))
            + _nla(NFULA_PREFIX, prefix.encode() + b"\0") + _nla(NFULA_PAYLOAD, payload))


def _ipv4(proto: int, src: str, dst: str, l4: bytes) -> bytes:
    import socket

    return struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(l4), 1, 0, 64, proto, 0, socket.inet_aton(src), socket.inet_aton(dst)) + l4


def test_nflog_messages_become_network_denials(tmp_path: Path) -> None:
    import ipaddress
    import socket

    from guard._nflog import IfaceMap, NflogReader, config_msg, parse_ip, parse_packet_msg

    # The interface: ifindex 1 is lo everywhere; its "sysfs" alias names the sandbox.
    lo = socket.if_indextoname(1)
    (tmp_path / lo).mkdir()
    (tmp_path / lo / "ifalias").write_text("sb-net-1\n")
    tcp = _ipv4(6, "10.210.0.2", "10.210.0.1", struct.pack("!HHII", 40000, 4222, 0, 0))
    udp = _ipv4(17, "10.210.0.2", "198.18.0.2", struct.pack("!HHHH", 5353, 53, 9, 0))
    icmp = _ipv4(1, "10.210.0.2", "10.210.0.6", bytes([8, 0, 0, 0]))
    v6 = (struct.pack("!IHBB", 6 << 28, 8, 17, 64) + ipaddress.IPv6Address("fd00::2").packed + ipaddress.IPv6Address("2001:db8::1").packed
          + struct.pack("!HHHH", 1234, 443, 8, 0))
    assert parse_ip(v6) == (6, "udp", "fd00::2", "2001:db8::1", 1234, 443, -1)
    assert parse_ip(tcp)[1:] == ("tcp", "10.210.0.2", "10.210.0.1", 40000, 4222, -1)
    d = parse_packet_msg(_nflog_packet(tcp, prefix="dsec-drop to_host"))
    assert d is not None and d.rule == "to_host" and d.what == "tcp 10.210.0.1:4222" and d.ifindex == 1
    assert parse_packet_msg(_nflog_packet(tcp, prefix="someone-else to_host")) is None  # not our rules
    assert parse_packet_msg(_nflog_packet(b"\x00junk")).proto == "unknown"  # reported, never crashes the reader
    assert config_msg(7301, 1, [(1, b"\x01")])[18:20] == struct.pack("!H", 7301)  # the group, big-endian res_id

    got: list[Denial] = []
    r = NflogReader(got.append, group=7301, rate_per_s=0.001, burst=3, iface_map=IfaceMap(str(tmp_path)))
    r.feed(_nflog_packet(udp))
    r.feed(_nflog_packet(icmp, prefix="dsec-drop between_sandboxes"))
    r.feed(_nflog_packet(v6, hw=0x86DD, prefix="dsec-drop ipv6"))
    assert [(x.sandbox_id, x.kind, x.what, x.detail["rule"]) for x in got] == [
        ("sb-net-1", "network", "udp 198.18.0.2:53", "not_allowed"),
        ("sb-net-1", "network", "icmp 10.210.0.6 type 8", "between_sandboxes"),
        ("sb-net-1", "network", "udp [2001:db8::1]:443", "ipv6"),
    ]
    assert got[0].detail == {"rule": "not_allowed", "proto": "udp", "dst": "198.18.0.2", "src": "10.210.0.2", "dport": "53", "sport": "5353", "ifname": lo}
    # over the per-sandbox bucket: held back, counted into the sandbox's next report
    for _ in range(10):
        r.feed(_nflog_packet(udp))
    assert len(got) == 3 and r.held == 10 and r.packets == 13
    r._limit.buckets["sb-net-1"].tokens = 1.0
    r.feed(_nflog_packet(tcp))
    assert len(got) == 4 and got[-1].detail["held_back"] == "10"
    # an interface whose alias is no sandbox id (a warm network) is not blamed on anyone
    (tmp_path / lo / "ifalias").write_text("@warm-3\n")
    r.forget("sb-net-1")
    r.feed(_nflog_packet(tcp))
    assert len(got) == 4 and r.unmapped == 1


@needs(None if os.geteuid() == 0 else "needs root (network namespaces)")
def test_link_aliases_are_read_in_the_readers_own_network_namespace() -> None:
    """A guard that entered a host's network namespace (``nsenter --net``, as ``dsec up --hosts``
    starts it) names the sandbox from its veth's alias in that namespace -- the machine's sysfs shows
    the root namespace's links, where that veth is not -- and forgets it once the veth is gone."""
    import subprocess
    import sys

    from tests.netclaim import claim_net

    repo = str(Path(__file__).resolve().parents[2])
    claim = claim_net()
    ns, veth = f"{claim.netns_prefix}guard", f"{claim.prefix}g0"
    script = (
        "import sys, socket; from guard._nflog import IfaceMap\n"
        "m = IfaceMap(); ix = socket.if_nametoindex(sys.argv[1])\n"
        "print(m.of_index(ix)); print(IfaceMap('/sys/class/net').of_index(ix))\n"  # the sysfs look-up: blind here
        "sys.stdin.readline(); print(m.gone(), m.by_index)\n"
    )
    ip = lambda *a: subprocess.run(["ip", *a], check=True, capture_output=True)  # noqa: E731
    p: subprocess.Popen[str] | None = None
    try:
        ip("netns", "add", ns)
        ip("-n", ns, "link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
        ip("-n", ns, "link", "set", veth, "alias", "sb-in-a-host-ns")
        assert not os.path.exists(f"/sys/class/net/{veth}")  # not the machine's link
        p = subprocess.Popen(["nsenter", f"--net=/run/netns/{ns}", "--", sys.executable, "-c", script, veth], cwd=repo, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": repo})
        assert p.stdout is not None and p.stdin is not None
        assert p.stdout.readline().strip() == f"('sb-in-a-host-ns', '{veth}')"
        assert p.stdout.readline().strip() == f"(None, '{veth}')"
        ip("-n", ns, "link", "delete", veth)
        out, err = p.communicate("\n", timeout=30)
        assert p.returncode == 0 and out.strip() == "['sb-in-a-host-ns'] {}", (out, err)
    finally:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()
        subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
        claim.release()


# ----------------------------------------------------------------- writes refused by read-only mounts
def _ro_event(serial: int, syscall: int, exit: int, paths: list[tuple[str, str]], *, cwd: str = "/", pid: int = 99990,
              auid: int = 1685284195, ses: int = 9, comm: str = "sh", exe: str = "/bin/busybox", a0: str = "ffffff9c",
              key: str = '"dsec-erofs"') -> list[tuple[int, str]]:
    """One event as the kernel sends it for our exit rule: SYSCALL, CWD, PATH..., PROCTITLE, EOE."""
    h = f"audit(1795956216.279:{serial}): "
    recs = [(1300, h + f"arch=c000003e syscall={syscall} success=no exit={exit} a0={a0} a1=b097bd0 a2=441 a3=1b6 "
             f"items={len(paths)} ppid=14918 pid={pid} auid={auid} uid=0 gid=0 euid=0 suid=0 fsuid=0 egid=0 sgid=0 "
             f'fsgid=0 tty=(none) ses={ses} comm="{comm}" exe="{exe}" key={key}'),
            (1307, h + f'cwd="{cwd}"')]
    for i, (name, nametype) in enumerate(paths):
        recs.append((1302, h + f'item={i} name="{name}" inode=2273115 dev=00:70 mode=0100644 ouid=0 ogid=0 rdev=00:00 '
                     f"nametype={nametype} cap_fp=0 cap_fi=0 cap_fe=0 cap_fver=0 cap_frootid=0"))
    recs.append((1327, h + "proctitle=2F62696E2F7368"))
    recs.append((1320, h))
    return recs


def test_read_only_mount_refusals_become_fs_denials(tmp_path: Path) -> None:
    from guard._kernel import EXDEV_SYSCALLS, READONLY_SYSCALLS_X86_64 as NR

    m = _fake_host(tmp_path, "sb-one", 4242, 9)
    got: list[Denial] = []
    k = KernelAudit(got.append, sandbox_map=m, fs_burst=8, fs_rate_per_s=0.001)

    def feed(recs: list[tuple[int, str]]) -> None:
        for t, text in recs:
            k.feed(t, text)

    # echo x >> /etc/passwd: the file exists, so the kernel names it in full
    feed(_ro_event(100, NR["openat"], -30, [("/etc/passwd", "NORMAL")]))
    # rm /bin/sh: the name is never looked up, so only its directory is named
    feed(_ro_event(101, NR["unlink"], -30, [("/bin/", "PARENT")], comm="rm", a0="1a576730"))
    # chmod u+s busybox from /usr, relative to the cwd
    feed(_ro_event(102, NR["fchmodat"], -30, [("../bin/busybox", "NORMAL")], cwd="/usr", comm="chmod"))
    # fsetxattr: an fd, no name at all; a process that has exited already (mapped by its session)
    feed(_ro_event(103, NR["fsetxattr"], -30, [], pid=123456, comm="sysx", exe="/tmp/sysx"))
    # rename(/tmp/evil, /bin/sh) across the mount's edge
    feed(_ro_event(104, NR["rename"], -18, [("/tmp/", "PARENT"), ("/bin/", "PARENT")], comm="sysx", exe="/tmp/sysx"))
    # an mv between two writable mounts tries rename first and gets EXDEV: not a violation
    feed(_ro_event(105, NR["rename"], -18, [("/tmp/", "PARENT"), ("/workspace/", "PARENT")], comm="mv"))
    # a host process on some read-only mount of its own: not ours to judge
    feed(_ro_event(106, NR["openat"], -30, [("aud/ro/", "PARENT")], cwd="/tmp", pid=999999, auid=4294967295, ses=4294967295))
    # relative to a directory fd: the name is kept as given (the fd's directory is unknown)
    feed(_ro_event(107, NR["mkdirat"], -30, [("evil/", "PARENT")], a0="5"))
    # a SYSCALL record of someone else's rule (or of a Landlock event) is not ours
    feed(_ro_event(108, NR["openat"], -30, [("/etc/shadow", "NORMAL")], key="(null)"))
    assert [(d.kind, d.sandbox_id, d.what) for d in got] == [
        ("fs", "sb-one", "openat /etc/passwd"),
        ("fs", "sb-one", "unlink /bin/"),
        ("fs", "sb-one", "fchmodat /bin/busybox"),
        ("fs", "sb-one", "fsetxattr"),
        ("fs", "sb-one", "rename /bin/"),
        ("fs", "sb-one", "mkdirat evil/"),
    ]
    assert got[0].detail["errno"] == "EROFS" and got[0].detail["syscall"] == "257" and got[0].detail["path"] == "/etc/passwd"
    assert got[0].detail["exe"] == "/bin/busybox" and got[0].detail["pid"] == "99990" and "path_is_parent" not in got[0].detail
    assert got[1].detail["path_is_parent"] == "true" and got[1].detail["comm"] == "rm"
    assert got[4].detail["errno"] == "EXDEV" and got[4].detail["paths"] == "/tmp/, /bin/"
    assert k.fs_ignored == 1
    assert set(EXDEV_SYSCALLS) <= set(NR)

    # A Landlock refusal that also matched the EXDEV rule (a refer denial): its Landlock records
    # come first, and it is reported once, as Landlock's.
    k.feed(1423, 'audit(1795956216.3:200): domain=abc blockers=fs.refer path="/var" dev="overlay" ino=6')
    feed(_ro_event(200, NR["rename"], -18, [("/var/", "PARENT"), ("/etc/", "PARENT")]))
    assert [(d.kind, d.what) for d in got[6:]] == [("landlock", "fs.refer /var")]

    # No EOE (the flush after a grace reports it anyway).
    feed(_ro_event(300, NR["truncate"], -30, [("/bin/busybox", "NORMAL")])[:-1])
    k._flush()
    assert got[-1].what == "truncate /bin/busybox"

    # rm -rf /usr: one refusal per directory, each with its own path: the per-sandbox bucket holds
    # the flood back and counts it into the sandbox's next report.
    before = len([d for d in got if d.kind == "fs"])
    for i in range(50):
        feed(_ro_event(400 + i, NR["unlinkat"], -30, [(f"/usr/lib/d{i}/", "PARENT")], comm="rm"))
    assert len([d for d in got if d.kind == "fs"]) == 8 and k.fs_held == 50 - (8 - before)
    k._fs_limit.buckets["sb-one"].tokens = 1.0
    feed(_ro_event(500, NR["chmod"], -30, [("/etc/passwd", "NORMAL")]))
    assert got[-1].what == "chmod /etc/passwd" and got[-1].detail["held_back"] == str(k.fs_held)
    k.forget("sb-one")
    assert "sb-one" not in k._fs_limit.buckets


def test_read_only_audit_rules_are_what_auditctl_would_send() -> None:
    """-a always,exit -F exit=-EROFS -F arch=b64 -S ... -k dsec-erofs (and the EXDEV one), as bytes."""
    from guard._kernel import _RULE, READONLY_SYSCALLS_X86_64 as NR, audit_rule, readonly_rules, rule_key

    ro, xdev = readonly_rules("x86_64")
    for rule, err, calls in ((ro, 30, NR.values()), (xdev, 18, [NR[n] for n in ("rename", "renameat", "renameat2", "link", "linkat")])):
        v = _RULE.unpack_from(rule)
        flags, action, count = v[:3]
        mask, fields, values, ops, buflen = v[3:67], v[67:131], v[131:195], v[195:259], v[259]
        assert (flags, action, count) == (0x04, 2, 3)  # AUDIT_FILTER_EXIT, AUDIT_ALWAYS
        assert fields[:3] == (103, 11, 210) and values[:3] == ((-err) & 0xFFFFFFFF, 0xC000003E, len("dsec-erofs"))
        assert ops[:3] == (0x40000000,) * 3 and not any(fields[3:]) and buflen == 10
        assert {i * 32 + b for i, w in enumerate(mask) for b in range(32) if w >> b & 1} == set(calls)
        assert rule_key(rule) == "dsec-erofs" and rule[_RULE.size:] == b"dsec-erofs"
    assert 2 in NR.values() and NR["openat"] == 257 and NR["fchmodat2"] == 452 and NR["setxattr"] == 188
    # Rules under another key are told apart by it (the kernel lists every rule of the host).
    assert rule_key(audit_rule(0xC000003E, [2], 30, "other")) == "other"
    assert readonly_rules("sparc64") == []


@needs(None if os.geteuid() == 0 else "needs root (CAP_AUDIT_CONTROL)")
def test_read_only_audit_rules_are_shared_by_guards(tmp_path: Path) -> None:
    """Two guards: the first to stop keeps the rules for the other; the last one deletes them.

    The kernel's audit rules are the machine's, and other guards (other tests, a ``dsec up``, another
    version of this code with other rules) add and delete theirs meanwhile: so these two guards share
    rules with a key of their own and a lock of their own, which nothing else on the machine touches
    -- the kernel tells rules apart by their key, so theirs are neither EEXIST for nor deleted by
    anyone else's -- and the protocol is checked on the real kernel, whatever else runs here."""
    import secrets

    from guard._kernel import ReadonlyRules, readonly_rules

    try:
        ReadonlyRules.listed()
    except OSError as exc:
        cannot_run(f"audit rules not readable here: {exc}")
    key = f"dsec-erofs-test-{secrets.token_hex(4)}"
    rules = readonly_rules(key=key)
    if not rules:
        cannot_run(f"no read-only audit rules for {os.uname().machine}")
    assert rules != readonly_rules() and ReadonlyRules.listed(key) == []  # the machine's guards' rules are another key's
    lock = str(tmp_path / "rules.lock")
    a, b = ReadonlyRules(lock, rules), ReadonlyRules(lock, rules)
    try:
        a.install()
        b.install()  # EEXIST: tolerated
        assert ReadonlyRules.listed(key) == a.rules == b.rules  # byte for byte, once each
        assert a.ensure() == 0
        assert a.remove() is False  # b still relies on them
        assert ReadonlyRules.listed(key) == b.rules
        assert b.remove() is True  # the last one deletes them
        assert ReadonlyRules.listed(key) == []
        # ... and a guard that comes after adds them again.
        a.install()
        assert ReadonlyRules.listed(key) == rules
    finally:
        a.remove()
        b.remove()
    assert ReadonlyRules.listed(key) == []
