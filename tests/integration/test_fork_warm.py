"""Fork children served by warm containers of their template (``warmroot``): a started, never used
container of the template is given the restore's root (the snapshot's layers over the template's, a
fresh upper, the profile's read-only binds made again over it) in its own mount namespace, and its agent
confines itself there (Landlock included) only then, instead of a cold container start. Both the
``e2b`` profile and ``default`` (Landlock, read-only /usr, /bin, /etc ...: what the gateway's E2B
sandboxes get); a create that finds no warm container starts cold.
Real containerd, real overlay mounts, the host's real lazy loader."""

from __future__ import annotations

import asyncio
import errno
import os
import time
from typing import Any

import pytest

from hostagent._agent import AgentError
from hostagent.backends.container.warmpool import Warm
from sdk import AsyncSandbox
from sdk.errors import DsecError, InvalidArgument
from tests.conftest import eventually
from tests.imaged.conftest import LazyDaemon, needs_fuse
from tests.security.conftest import RedTeam
from tests.security.test_network import DnsServer, TestHost, blocked, netprobe_bin, reach, testhost, with_probe  # noqa: F401 - fixtures
from tests.security.test_fs_syscalls import EACCES, EROFS, EXDEV, _merged_usr_rootfs, assert_errno, nr, progs, push, sysx  # noqa: F401 - progs is a fixture

from .conftest import Stack, needs_stack
from .test_fork import SOURCE_AFTER
from .test_snapshots import WRITE_1, many, tmpl, tree  # noqa: F401 - tmpl is a fixture

pytestmark = [pytest.mark.containerd, needs_stack, needs_fuse]

BASE = "sha256:" + "0" * 64  # the ``base`` template's layer (tests.integration.conftest)
PROFILES = ["e2b", "default"]  # no Landlock and every path writable; Landlock and read-only system dirs
# The root's entries, and every mount: its point, options, type and source (a loop device's number aside)
ROOT_VIEW = ("ls -la / | sed 1d | awk '{print $1, $NF}'; sed 's/^[^ ]* [^ ]* [^ ]* [^ ]* \\([^ ]*\\) \\([^ ]*\\).* - \\([^ ]*\\) \\([^ ]*\\) .*/"
             "\\1 \\2 \\3 \\4/; s/loop[0-9]*/loop/' /proc/self/mountinfo | sort")


def served_warm(stack: Stack, sb: AsyncSandbox) -> bool:
    """The sandbox runs in a container started for the warm pool (its id differs from the sandbox's)."""
    return str(stack.host.handles[sb.sandbox_id].extra["cid"]).startswith("wp-")


def members(stack: Stack, template_layers: int, profile: str, base: str = "") -> list[Warm]:
    """Warm containers waiting for the template (of ``template_layers`` layers; ``base``: its first
    layer's digest) in ``profile``."""
    return [w for k, ws in stack.backend.pool.entries().items()
            if k.profile == profile and len(k.layers) == template_layers and k.layers[0].startswith(base) for w in ws]


async def pool_full(stack: Stack, template_layers: int, profile: str, base: str = "") -> None:
    await eventually(lambda: len(members(stack, template_layers, profile, base)) >= stack.backend.pool.size, timeout=120, interval=0.1,
                     what=f"the warm pool of profile {profile} refilled")

async def warm_and_cold(stack: Stack, sb: AsyncSandbox, **kw: Any) -> tuple[AsyncSandbox, AsyncSandbox]:
    """A child of ``sb`` from the warm pool, then one with warm restores off (the cold control)."""
    (warm,) = await sb.fork(1, **kw, **stack.kw())
    stack.backend.warm_restores = False
    try:
        (cold,) = await sb.fork(1, **kw, **stack.kw())
    finally:
        stack.backend.warm_restores = True
    return warm, cold



@pytest.mark.parametrize("profile", PROFILES)
async def test_warm_children_see_the_exact_state_and_diverge_alone(stack: Stack, lazy: LazyDaemon, tmpl: str, profile: str) -> None:  # noqa: F811
    async with stack.sandbox(template=tmpl, profile=profile) as sb:
        await sb.commands.run(WRITE_1)  # contents, modes (setuid), owner, a symlink, a hard link, deleted and replaced template dirs
        want = (await sb.commands.run(tree())).stdout
        assert "/root/data/link|symbolic link|" in want and "/workspace/gone.txt" not in want and "|4751|" in want
        await pool_full(stack, 2, profile)  # the source's create started the pool of its template and profile
        forks = await sb.fork(stack.backend.pool.size, **stack.kw())
        async with many(stack, forks):
            assert all(served_warm(stack, f) for f in forks)
            assert {stack.host.handles[f.sandbox_id].extra["profile"] for f in forks} == {profile}
            await sb.commands.run(SOURCE_AFTER)
            for f in forks:
                assert (await f.commands.run(tree())).stdout == want
            await asyncio.gather(*(f.commands.run(f"echo child{i} > /root/data/t.txt && rm /root/data/bin.hard") for i, f in enumerate(forks)))
            for i, f in enumerate(forks):
                assert await f.files.read("/root/data/t.txt") == f"child{i}\n"
                assert not await f.files.exists("/root/data/bin.hard")
                assert not await f.files.exists("/root/data/late")
            assert await sb.files.read("/root/data/t.txt") == "some text\nmore\n"
            assert await sb.files.exists("/root/data/bin.hard") and not await sb.files.exists("/root/data/link")
            # A child's own snapshot is what it shows (its upper is the fresh one the swap made).
            again = await forks[0].fork(1, **stack.kw())
            async with many(stack, again) as (g,):
                assert await g.files.read("/root/data/t.txt") == "child0\n"
                assert (await g.commands.run(tree())).stdout == (await forks[0].commands.run(tree())).stdout


# What each profile lets a source change (e2b: system dirs too), and what its children then show.
STATE = {
    "e2b": ("mkdir -p /root/w && echo state > /root/w/f && chmod 604 /root/w/f && rm /bin/sed && touch /etc/marker",
            "cat /root/w/f; stat -c %a /root/w/f; ls /etc/marker; ls /bin/sed || echo no-sed", "state\n604\n/etc/marker\nno-sed\n"),
    "default": ("mkdir -p /root/w && echo state > /root/w/f && chmod 604 /root/w/f && touch /tmp/m",
                "cat /root/w/f; stat -c %a /root/w/f; ls /tmp", "state\n604\nm\n"),
}


@pytest.mark.parametrize("profile", PROFILES)
async def test_warm_and_cold_children_alike_and_none_shows_the_member_before(stack: Stack, lazy: LazyDaemon, profile: str) -> None:
    """More children than warm containers: the rest start cold (the pool is empty for them). Every
    child, warm or cold, shows the same root, mounts (the read-only binds too) and processes; a mark
    planted in each waiting member's old root (its upper, before the claim) reaches no child; a member
    serves nothing before its claim; and a member left running a process besides its agent is not used
    (removed; its child starts cold)."""
    change, show, shown = STATE[profile]
    async with stack.sandbox(profile=profile) as sb:
        await sb.commands.run(change)
        await pool_full(stack, 1, profile, BASE)
        waiting = members(stack, 1, profile, BASE)
        for w in waiting:
            with open(os.path.join(w.sdir, "upper", "planted"), "w") as f:  # in the member's old root
                f.write("member's\n")
            # The control: in the member, before the claim, the mark is there to be seen.
            with open(f"/proc/{w.pid}/root/planted") as f:
                assert f.read() == "member's\n"
            # Its agent is not confined yet, so it runs nothing and touches no file before its claim.
            with pytest.raises(AgentError) as ei:
                await stack.backend.t.clients[w.cid].exec("cat /planted")
            assert ei.value.errno == errno.EACCES and "not confined yet" in ei.value.message
        # The first one a fork claims: the newest of the first pool of the template with one waiting
        # and the source's disk (WarmPool.base_of); an earlier test's pool may still wait beside it.
        busy = next(ws[-1] for k, ws in stack.backend.pool.entries().items()
                    if ws and k.profile == profile and len(k.layers) == 1 and k.layers[0].startswith(BASE) and k.disk_mb == sb.spec.disk_mb)
        client = stack.backend.t.clients[busy.cid]
        await client.confine()  # as a claim would (then it runs commands): the root swap must still refuse it
        sleeper = asyncio.ensure_future(client.exec("sleep 1000"))  # runs while the call is open

        async def sleeping() -> bool:
            return (await client.exec("cat /proc/[0-9]*/comm | grep -c '^sleep$' || true")).stdout == b"1\n"

        await eventually(sleeping, timeout=30, what="the process in the member")  # the control: it runs
        n = len(waiting) + 2  # more than wait (the pool refills one container at a time, each a cold start)
        try:
            forks = await sb.fork(n, **stack.kw())
            for _ in range(4):  # another pool of the template may have been taken from first (its refill raced ours)
                if not stack.backend.pool.holds(busy.cid):
                    break
                forks += await sb.fork(1, **stack.kw())
        finally:
            sleeper.cancel()
            await asyncio.gather(sleeper, return_exceptions=True)  # its container was removed: the call ends either way
        if not any(served_warm(stack, f) for f in forks):
            # Every fork met the pool without a member (its refill, a cold start, had not finished: CI
            # on 94ad5ef); once it has one again, the next fork is served warm.
            await pool_full(stack, 1, profile, BASE)
            forks += await sb.fork(1, **stack.kw())
        async with many(stack, forks):
            warm = [f for f in forks if served_warm(stack, f)]
            cold = [f for f in forks if not served_warm(stack, f)]
            assert warm and cold, (len(warm), len(cold))
            assert busy.cid not in {stack.cid(f.sandbox_id) for f in forks} and not stack.backend.pool.holds(busy.cid)
            assert busy.cid not in {c.id for c in await stack.backend.rt.list()}  # removed, not left waiting
            ref = (await cold[0].commands.run(ROOT_VIEW)).stdout
            assert ".newroot" not in ref and "planted" not in ref and "/proc " in ref
            for f in forks:
                what = "warm" if f in warm else "cold"
                assert (await f.commands.run(ROOT_VIEW)).stdout == ref, f"a {what} child's root differs"
                assert (await f.commands.run(show)).stdout == shown, what
                assert not await f.files.exists("/planted")
                assert (await f.commands.run("cat /proc/[0-9]*/comm 2>/dev/null | grep -c '^sleep$' || true")).stdout == "0\n", what


O_WRONLY, O_CREAT = 0o1, 0o100
# The default profile's blocks, as tests/security/test_fs_syscalls asserts them in cold sandboxes: each
# raw call, its errno (EACCES: Landlock; EROFS/EXDEV: a read-only bind) and the same call where it is
# allowed (the positive control, None: nothing to compare).
BLOCKS: list[tuple[str, list[object], int, list[object] | None]] = [
    ("create /evil in the root dir", [nr("openat"), -100, "s:/evil", O_WRONLY | O_CREAT, 0o755], EACCES,
     [nr("openat"), -100, "s:/workspace/evil", O_WRONLY | O_CREAT, 0o755]),
    ("mkdir /var/evil", [nr("mkdir"), "s:/var/evil", 0o755], EACCES, [nr("mkdir"), "s:/tmp/evil", 0o755]),
    ("rename(/var/tmp, /var/tmp.old)", [nr("rename"), "s:/var/tmp", "s:/var/tmp.old"], EACCES, [nr("rename"), "s:/tmp/evil", "s:/tmp/evil2"]),
    ("rename(/etc, /tmp/etc)", [nr("rename"), "s:/etc", "s:/tmp/etc"], EACCES, None),
    ("open /etc/passwd for writing", [nr("openat"), -100, "s:/etc/passwd", O_WRONLY], EROFS, [nr("openat"), -100, "s:/workspace/evil", O_WRONLY]),
    ("unlink(/bin/busybox)", [nr("unlink"), "s:/bin/busybox"], EROFS, [nr("unlink"), "s:/workspace/evil"]),
    ("chmod(/bin/busybox, 04755)", [nr("chmod"), "s:/bin/busybox", 0o4755], EROFS, [nr("chmod"), "s:/tmp/sysx", 0o4755]),
    ("chown(/etc/passwd)", [nr("chown"), "s:/etc/passwd", 1000, 1000], EROFS, [nr("chown"), "s:/tmp/evil2", 1000, 1000]),
    ("link(/bin/busybox, /tmp/bb)", [nr("link"), "s:/bin/busybox", "s:/tmp/bb"], EXDEV, None),
    ("mkdir in /usr", [nr("mkdir"), "s:/usr/evil", 0o755], EROFS, None),
]
CONFINEMENT = "grep -E '^(NoNewPrivs|Seccomp|Seccomp_filters|CapBnd|CapEff):' /proc/self/status; cat /proc/self/loginuid; echo"


async def blocks(sb: AsyncSandbox, progs: dict[str, bytes], tag: str) -> dict[str, int | None]:  # noqa: F811
    """Each of ``BLOCKS`` in the sandbox: its positive control first (must work), then the attack, which
    must fail with its errno. Returns the errnos."""
    await push(sb, progs, "sysx")
    out = {}
    for what, attack, err, control in BLOCKS:
        if control is not None:
            c = await sysx(sb, *control)
            assert c.code == 0, f"positive control for {what!r} failed ({tag}): {c}"
        r = await sysx(sb, *attack)
        assert_errno(r, err, what=f"{what} ({tag})")
        out[what] = r.errno
    return out


async def test_default_profile_warm_children_are_confined_as_cold_ones(stack: Stack, lazy: LazyDaemon, progs: dict[str, bytes]) -> None:  # noqa: F811
    """The gateway's E2B default: a warm child of the ``default`` profile has the same Landlock rules (on
    its new root: /workspace and /tmp writable, the rest not), the same read-only binds of the system
    dirs (of the restore's root), seccomp filters, no_new_privs, capabilities and audit session as a cold
    child of the same source; the agent's own file ops are confined too."""
    async with stack.sandbox() as sb:
        await sb.commands.run("mkdir -p /workspace/d && echo src > /workspace/d/f")
        await pool_full(stack, 1, "default", BASE)
        warm, cold = await warm_and_cold(stack, sb)
        async with many(stack, [warm, cold]):
            assert served_warm(stack, warm) and not served_warm(stack, cold)
            hw, hc = (stack.host.handles[f.sandbox_id].extra for f in (warm, cold))
            assert hw["profile"] == hc["profile"] == "default" and hw["landlock_abi"] == hc["landlock_abi"] >= 1, (hw, hc)
            # (an audit session needs an unset login uid in the host agent: equal, whatever this host allows)
            assert hw["seccomp_log"] and (hw["seccomp_log"], hw["audit_session"]) == (hc["seccomp_log"], hc["audit_session"])
            got = {}
            for tag, f in (("warm", warm), ("cold", cold)):
                assert await f.files.read("/workspace/d/f") == "src\n"
                got[tag] = await blocks(f, progs, tag)
                # The agent's own file ops: Landlock refuses the root dir, the read-only bind /etc.
                with pytest.raises(DsecError) as ei:
                    await f.files.write("/evil", b"x")
                assert "ermission denied" in str(ei.value), ei.value
                with pytest.raises(DsecError) as ei:
                    await f.files.write("/etc/evil", b"x")
                assert "ead-only file system" in str(ei.value), ei.value
                await f.files.write("/workspace/ok", b"fine")  # the control
                assert (await f.commands.run("cat /workspace/ok")).stdout == "fine"
            assert got["warm"] == got["cold"]
            assert (await warm.commands.run(CONFINEMENT)).stdout == (await cold.commands.run(CONFINEMENT)).stdout
            assert (await warm.commands.run(ROOT_VIEW)).stdout == (await cold.commands.run(ROOT_VIEW)).stdout


async def test_memory_snapshot_of_a_warm_child_is_refused_typed(stack: Stack, lazy: LazyDaemon) -> None:
    """CRIU cannot dump a container whose root was swapped (runc gives it the configured one): a memory
    snapshot of a warm child is refused before anything is frozen, and the child runs on. The control: a
    cold child of the same source, with warm restores off, is dumped and restored."""
    async with stack.sandbox(profile="e2b") as sb:
        await sb.commands.run("echo m > /root/m")
        await pool_full(stack, 1, "e2b", BASE)
        c, cold = await warm_and_cold(stack, sb)
        async with many(stack, [c, cold]):
            assert served_warm(stack, c) and not served_warm(stack, cold)
            with pytest.raises(DsecError) as ei:
                await c.fork(1, memory=True, **stack.kw())
            assert ei.value.code == "snapshot_unsupported" and "warm container" in str(ei.value)
            await c.commands.run("echo c >> /root/m")  # it runs on, not left frozen
            assert await c.files.read("/root/m") == "m\nc\n"
            forks = await cold.fork(1, memory=True, **stack.kw())
            async with many(stack, forks) as (g,):
                assert await g.files.read("/root/m") == "m\n"


async def test_warm_children_with_a_network_as_cold_ones(
    stack: Stack, lazy: LazyDaemon, testhost: TestHost, netprobe_bin: bytes,  # noqa: F811
) -> None:
    """A fork child with an allowlist takes a warm container too (and so does a plain create whose
    allowlist names no host: nothing for /etc/hosts): the container's own (empty) netns gets the
    sandbox's veth, address, route and rules, pinned at the sandbox's netns path, as a cold child's
    pre-made one has them. All reach the allowlisted port and are refused another port of the same
    host by the same rule, have no IPv6, and leave no network state. A bad allowlist is the typed error
    a cold create gives, and costs no warm container."""
    rt = RedTeam("test_warm_children_with_a_network_as_cold_ones")
    lis, other = await testhost.listen(), await testhost.listen()
    net = {"allow_out": [f"{testhost.ip}:{lis.port}"]}
    async with stack.sandbox() as sb:
        await sb.commands.run("echo n > /workspace/n")
        await pool_full(stack, 1, "default", BASE)
        before = {w.cid for w in members(stack, 1, "default", BASE)}
        with pytest.raises(InvalidArgument, match="not a host!"):
            await sb.fork(1, network={"allow_out": ["not a host!"]}, **stack.kw())
        assert {w.cid for w in members(stack, 1, "default", BASE)} == before
        warm, cold = await warm_and_cold(stack, sb, network=net)
        await pool_full(stack, 1, "default", BASE)
        plain = await AsyncSandbox.create(network=net, create_timeout=120, **stack.kw())
        async with many(stack, [warm, cold, plain]):
            assert served_warm(stack, warm) and not served_warm(stack, cold) and served_warm(stack, plain)
            for tag, f in (("warm", warm), ("cold", cold), ("plain warm", plain)):
                att = stack.backend.net.attachment(f.sandbox_id)
                assert att is not None and stack.host.handles[f.sandbox_id].extra["net"]["ip"] == att.ip, tag
                # The sandbox's netns is the one its processes are in (the warm container's own).
                assert os.stat(att.netns).st_ino == os.stat(f"/proc/{stack.pid_of(f.sandbox_id)}/ns/net").st_ino, tag
                if f is not plain:
                    assert await f.files.read("/workspace/n") == "n\n"
                await with_probe(f, netprobe_bin)
                await reach(f, testhost.ip, lis.port, rt, f"{tag} child -> its allowlisted port")
                await blocked(rt, stack.backend.net.cfg.table, f, f"{tag} child -> another port", "not_allowed", "tcp", testhost.ip, other.port, "x")
                out = await f.commands.run(f"cat /proc/net/if_inet6; ip -4 -o addr show eth0 | grep -c ' {att.ip}/30 '")
                assert out.stdout == "1\n", (tag, out)
            assert other.hits == 0
        for f in (warm, cold, plain):
            assert stack.backend.net.attachment(f.sandbox_id) is None
            assert not os.path.lexists(stack.backend.net.netns_path(f.sandbox_id))


async def test_merged_usr_warm_children_bind_what_the_links_lead_to(stack: Stack, lazy: LazyDaemon, progs: dict[str, bytes]) -> None:  # noqa: F811
    """An image whose /bin, /sbin, /lib are symbolic links into /usr (and whose /lib64 dangles): runc's
    read-only binds landed where the links lead, and a warm child's are made again the same way in its
    new root: the same mounts as a cold child's, and what the links lead to is read-only."""
    from bus import codec
    from bus import subjects as S
    from bus.messages import LayerRef, TemplateManifest

    name = f"merged-{stack.uid}"
    rootfs = stack.data_dir / f"rootfs-{name}"
    await asyncio.to_thread(_merged_usr_rootfs, stack.rootfs, rootfs)
    kv = await stack.js.key_value(S.KV_IMAGES)
    await kv.put(name, codec.encode(TemplateManifest(name=name, created_at=time.time(), layers=[
        LayerRef(role="base", digest="sha256:" + "7" * 64, kind="dir", path=str(rootfs))])))
    async with stack.sandbox(template=name) as sb:
        await sb.commands.run("echo m > /workspace/m")
        await pool_full(stack, 1, "default", base="sha256:" + "7" * 64)
        warm, cold = await warm_and_cold(stack, sb)
        async with many(stack, [warm, cold]):
            assert served_warm(stack, warm) and not served_warm(stack, cold)
            assert (await warm.commands.run(ROOT_VIEW)).stdout == (await cold.commands.run(ROOT_VIEW)).stdout
            for tag, f in (("warm", warm), ("cold", cold)):
                assert (await f.commands.run("readlink /bin; cat /workspace/m")).stdout == "usr/bin\nm\n", tag
                await push(f, progs, "sysx")
                assert (await sysx(f, nr("chmod"), "s:/workspace/m", 0o600)).code == 0, tag  # the control
                assert_errno(await sysx(f, nr("chmod"), "s:/bin/busybox", 0o4755), EROFS, what=f"chmod /bin/busybox ({tag})")
                assert_errno(await sysx(f, nr("chown"), "s:/lib/libc.so.6", 1000, 1000), EROFS, what=f"chown /lib/libc.so.6 ({tag})")
                assert_errno(await sysx(f, nr("unlink"), "s:/lib"), EACCES, what=f"unlink the /lib link ({tag})")


async def test_warm_child_with_allowlisted_names_has_them_in_its_hosts_file(stack: Stack, lazy: LazyDaemon, testhost: TestHost) -> None:  # noqa: F811
    """An allowlist of names: the host agent resolves them, and a warm child's /etc/hosts (written into
    its fresh upper before its root is mounted; /etc is a read-only bind of the new root) holds them, so
    it reaches the name by name. A plain create with names starts cold (its /etc/hosts would have to go
    into a mounted root's upper dir)."""
    from hostagent.network import Resolver

    lis = await testhost.listen()
    dns = await DnsServer({"svc.dsec.test": [testhost.ip]}).start()
    backend = stack.backend
    before = backend.net.resolver
    backend.net.resolver = Resolver([f"127.0.0.1:{dns.port}"], 2.0)  # the host agent's resolver: a real one, on loopback
    try:
        async with stack.sandbox() as sb:
            await sb.commands.run("echo named > /workspace/n")  # (a fork of an unchanged sandbox needs no new root)
            await pool_full(stack, 1, "default", BASE)
            net = {"allow_out": [f"svc.dsec.test:{lis.port}"]}
            (warm,) = await sb.fork(1, network=net, **stack.kw())
            plain = await AsyncSandbox.create(network=net, create_timeout=120, **stack.kw())
            async with many(stack, [warm, plain]):
                assert served_warm(stack, warm) and not served_warm(stack, plain)
                assert "svc.dsec.test" in dns.queries
                assert await warm.files.read("/workspace/n") == "named\n"
                for f in (warm, plain):
                    assert f"{testhost.ip}\tsvc.dsec.test" in await f.files.read("/etc/hosts")
                    out = await f.commands.run(f"nc -w 3 svc.dsec.test {lis.port} </dev/null")
                    assert "hello-from-testhost" in out.stdout, out
    finally:
        backend.net.resolver = before
        dns.close()


async def test_fork_of_an_unchanged_sandbox_takes_a_plain_warm_container(stack: Stack, lazy: LazyDaemon) -> None:
    """A snapshot that added nothing has its template's very layers: its children take warm containers
    of the template as they are (no root to swap), confined as any claimed one; with warm restores off
    (the control) they start cold."""
    async with stack.sandbox() as sb:
        await pool_full(stack, 1, "default", BASE)
        f, cold = await warm_and_cold(stack, sb)
        async with many(stack, [f, cold]):
            assert served_warm(stack, f) and not served_warm(stack, cold)
            assert "warm_root" not in stack.host.handles[f.sandbox_id].extra
            assert stack.host.handles[f.sandbox_id].extra["landlock_abi"] >= 1
            for g in (f, cold):
                out = await g.commands.run("touch /evil 2>&1; echo x > /workspace/ok && cat /workspace/ok")
                assert "Permission denied" in out.stdout and out.stdout.endswith("x\n"), out


async def test_strict_warm_child_is_killed_by_guard_under_its_own_id(stack: Stack, lazy: LazyDaemon) -> None:
    """A fork child of a ``strict`` sandbox served by a warm container (a root swapped in: ``warm_root``)
    runs in the container's cgroup (``wp-...``); guard maps it to the child through its record and kills
    the child for a Landlock denial, reported under the child's id. Controls: the cold parent, which
    does nothing wrong, lives on; the child's denial is refused (EACCES) before guard acts."""
    from bus import codec
    from bus import subjects as S
    from bus.messages import GuardViolation
    from guard import Guard
    from sdk import SandboxNotFound

    g = Guard(stack.url, host_id=f"guard-{stack.uid}")
    await g.start()
    got: list[GuardViolation] = []

    async def on(msg: object) -> None:
        got.append(codec.EVENT.decode(msg.data))  # type: ignore[attr-defined]

    sub = await stack.nc.subscribe(S.EVT_GUARD_VIOLATION, cb=on)
    try:
        if g.kernel is None:
            pytest.skip("kernel audit not readable here")
        async with stack.sandbox(profile="strict") as sb:
            await sb.commands.run("mkdir -p /workspace/d && echo src > /workspace/d/f")
            await pool_full(stack, 1, "strict", BASE)
            (child,) = await sb.fork(1, **stack.kw())
            async with many(stack, [child]):
                assert served_warm(stack, child) and stack.host.handles[child.sandbox_id].extra.get("warm_root")
                cid = stack.host.handles[child.sandbox_id].extra["cid"]
                assert (await child.files.read("/workspace/d/f")) == "src\n"  # the control: it serves
                try:
                    r = await child.commands.run("(echo evil > /var/evil) 2>&1; echo rc=$?")
                    assert "Permission denied" in r.stdout, r
                except SandboxNotFound:
                    pass  # guard's kill can land before the exec's answer: the record says why
                kv = await stack.nc.jetstream().key_value(S.KV_SANDBOXES)

                async def killed() -> bool:
                    rec = codec.SANDBOX_RECORD.decode((await kv.get(child.sandbox_id)).value)
                    return rec.state == "gone" and rec.end_reason.startswith("guard-kill: landlock")

                await eventually(killed, timeout=30, what="guard to kill the strict warm child")
                v = next(v for v in got if v.sandbox_id == child.sandbox_id and v.kind == "landlock")
                assert v.action == "kill" and v.detail["container_id"] == cid and "/var" in v.what, v
                assert not [x for x in got if x.sandbox_id == cid], got
                assert (await sb.commands.run("echo still-here")).stdout == "still-here\n"
    finally:
        await sub.unsubscribe()
        await g.shutdown()
