"""Many real hosts on one machine, and the faults between them (issue 23, items 2 and 3).

Three hosts, each a real host agent with its own private containerd, data dir, host id and lazy loader,
running in a network namespace of its own behind a veth to a bridge in the root namespace
(sdk._hostnet): it reaches nats-server -- listening on the bridge's address only -- as a remote machine
would. Placement (two real replicas) runs in the test process. Faults are real: the link of a host is
cut with ``ip link set ... down``, or shaped with ``tc ... tbf``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from bus import codec
from bus import subjects as S
from bus.messages import SandboxRecord
from bus.natsd import NatsServer
from bus.runtime import KV
from bus.streams import ensure_kv
from sdk import AsyncSandbox
from sdk.errors import DsecError
from sdk._hostnet import HostNet
from tests.conftest import eventually
from tests.imaged.conftest import LazyDaemon, needs_fuse
from tests.netclaim import claim_net

from .conftest import (
    PY, Child, busybox_host, cgroups_of, data_dir_leftovers, force_cleanup, mounts_mentioning, needs_stack, register_base_template, subprocess_env,
)

pytestmark = [pytest.mark.containerd, needs_stack, needs_fuse]

N = 3
HOST_DOWN_S = 12.0  # placement's grace: generous, the machine is loaded (heartbeats every 2 s)


@dataclass
class Hosts:
    url: str
    net: HostNet
    pool: str
    ids: list[str]
    data: list[Path]
    agents: list[Child]
    guards: list[Child]  # each host's drops-only guard, in its namespace (as dsec up --hosts runs them)
    lazies: list[LazyDaemon]
    placements: list[Any]
    nc: Any
    root: Path
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def js(self) -> Any:
        return self.nc.jetstream()

    def kw(self, **kw: Any) -> dict[str, Any]:
        return {"pool": self.pool, "nats_url": self.url, "memory_mb": 64, **kw}

    def index(self, host_id: str) -> int:
        return self.ids.index(host_id)

    async def record(self, sid: str) -> SandboxRecord | None:
        kv: KV[SandboxRecord] = await KV.bind(self.js, S.KV_SANDBOXES, codec.SANDBOX_RECORD)
        return await kv.get(sid)

    async def host_state(self, i: int) -> tuple[str, float]:
        kv = await ensure_kv(self.js, S.KV_HOSTS)
        try:
            st = codec.HOST_STATUS.decode((await kv.get(self.ids[i])).value)
        except Exception:  # noqa: BLE001 - no heartbeat yet
            return "", 0.0
        return st.state, st.at


def _agent(h: HostNet, i: int, url: str, host_id: str, pool: str, data: Path) -> Child:
    argv = [*h.enter(i), PY, "-m", "hostagent", "--data-dir", str(data), "--host-id", host_id, "--pool", pool,
            "--concurrency", "4", "--warm-pool", "0", "--destroy-on-shutdown", "--reconcile-s", "3"]
    return Child(argv, subprocess_env(url, **h.env(i)), data.parent / f"{data.name}.log").start()


def _drops_guard(h: HostNet, i: int, url: str, host_id: str, data: Path) -> Child:
    argv = [*h.enter(i), PY, "-m", "guard", "--drops-only", "--host-id", host_id, "--report-interval", "0"]
    return Child(argv, subprocess_env(url, **h.env(i)), data.parent / f"{data.name}-guard.log").start()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def hosts() -> AsyncIterator[Hosts]:
    from placement import Placement

    claim = await asyncio.to_thread(claim_net)
    i = claim.index
    net = HostNet(prefix=claim.prefix, count=N, link_net=f"10.210.{4 * i + 3}.0/24", pools=tuple(f"10.210.{4 * i + j}.0/24" for j in range(N)),
                  log_group=claim.log_group)
    root = Path(tempfile.mkdtemp(prefix="dsec-hosts-", dir="/tmp"))
    nats: NatsServer | None = None
    h: Hosts | None = None
    problems: list[str] = []
    try:
        await asyncio.to_thread(net.create)
        nats = NatsServer(str(root / "nats"), host=net.gateway, port=0)
        await asyncio.to_thread(nats.start)
        uid, rootfs_dir, rootfs, nc = await busybox_host(nats.url, "hosts", "dsec-hosts-test")
        await register_base_template(nc.jetstream(), str(rootfs))
        pool = f"hosts-{uid}"
        ids = [f"h{j}-{uid}" for j in range(N)]
        data = [root / f"host{j}" for j in range(N)]
        h = Hosts(nats.url, net, pool, ids, data, [], [], [], [], nc, root, {"rootfs_dir": rootfs_dir})
        for j in range(N):
            data[j].mkdir()
            # in the host's namespace: its layers come over its own link
            h.lazies.append(LazyDaemon(data_dir=data[j], mount=data[j] / "lazy", nats_url=nats.url, host_id=ids[j], wrap=net.enter(j)))
        await asyncio.gather(*(asyncio.to_thread(lz.start, 60) for lz in h.lazies))
        t0 = time.time()
        h.agents = [_agent(net, j, nats.url, ids[j], pool, data[j]) for j in range(N)]
        h.guards = [_drops_guard(net, j, nats.url, ids[j], data[j]) for j in range(N)]
        h.placements = [Placement(nats.url, replica_id=f"p{j}-{uid}", host_down_s=HOST_DOWN_S) for j in range(2)]
        for p in h.placements:
            await p.start()

        async def all_up() -> bool:
            beats = [(await h.host_state(j))[1] for j in range(N)]
            return all(at >= t0 for at in beats) and all(len(p.table.hosts) >= N for p in h.placements)

        await eventually(all_up, timeout=120, interval=0.2, what="three hosts heartbeating over their links")
        await eventually(lambda: all("nflog_reader_started" in g.log(100_000) or not g.alive() for g in h.guards),
                         timeout=120, interval=0.2, what="each host's guard reading its namespace's drops")
        assert all(g.alive() for g in h.guards), [g.log() for g in h.guards]
        yield h
    finally:
        if h is not None:
            problems += await _stop_hosts(h)
        if nats is not None:
            await asyncio.to_thread(nats.stop)
        await asyncio.to_thread(net.destroy)
        left = net.leftovers() + claim.in_kernel()
        if left:
            problems.append(f"network left: {left}")
        await claim.purge()
        claim.release()
        if h is not None:
            shutil.rmtree(h.extra["rootfs_dir"], ignore_errors=True)
        for lg in root.glob("*.log") if problems or os.environ.get("DSEC_KEEP_LOGS") else ():  # kept next to it for a post-mortem
            shutil.copy(lg, root.parent / f"{root.name}-{lg.name}")
        if not mounts_mentioning(str(root)):
            shutil.rmtree(root, ignore_errors=True)
        assert not problems, problems


async def _stop_hosts(h: Hosts) -> list[str]:
    """Stop the agents (they remove their sandboxes), loaders and replicas; what a host left behind."""
    problems = []
    for a in h.agents:
        rc = await a.stop(timeout=90)
        if rc != 0:
            problems.append(f"agent exited {rc}: {a.log()[-1500:]}")
    for g in h.guards:
        rc = await g.stop(timeout=60)
        if rc != 0:
            problems.append(f"guard exited {rc}: {g.log()[-1500:]}")
    for lz in h.lazies:
        with contextlib.suppress(Exception):
            lz.release()
    for p in h.placements:
        await p.shutdown()
    from sdk._async import close_connections

    with contextlib.suppress(Exception):
        await close_connections()
    await h.nc.close()
    for d in h.data:
        left = data_dir_leftovers(d)
        if left:
            problems.append(f"left under {d}: {left}")
            await force_cleanup(d)
    return problems


async def _lost_events(h: Hosts, sid: str) -> list[Any]:
    from tests.placement.conftest import ready_counts

    return (await ready_counts(h.js, ("lost",))).get(sid, [])


@dataclass
class Outside:
    """The network beyond this machine, as far as a host can tell: a namespace behind a veth of the
    root namespace's (198.19.<n>.2/30, RFC 2544 space, with no route to the hosts' addresses: only
    the root namespace's masquerade gets its answers back), serving HTTP on two ports; and an HTTP
    server of the root namespace's own, on its end of that veth (198.19.<n>.1)."""

    netns: str
    link: str
    ip: str
    root_ip: str
    ports: dict[str, int]
    procs: list[Any] = field(default_factory=list)


def _serve_http(enter: list[str], ip: str, port: int, d: Path) -> Any:
    import subprocess

    return subprocess.Popen([*enter, PY, "-m", "http.server", str(port), "--bind", ip, "--directory", str(d)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, start_new_session=True)


@contextlib.asynccontextmanager
async def _outside(net: HostNet, root: Path) -> AsyncIterator[Outside]:
    import ipaddress
    import subprocess
    import urllib.request

    from bus.natsd import free_port

    n = ipaddress.ip_network(net.link_net).network_address.packed[2]  # the claim's: unique on this machine
    o = Outside(f"dsec-{net.prefix}-out", f"{net.prefix}o", f"198.19.{n}.2", f"198.19.{n}.1",
                {"allowed": free_port(), "other_port": free_port(), "machine": free_port()})
    ip = lambda *a: subprocess.run(["ip", *a], check=True, capture_output=True)  # noqa: E731
    d = root / "www"
    d.mkdir(exist_ok=True)
    (d / "token").write_text(f"outside {net.prefix}\n")
    try:
        ip("netns", "add", o.netns)
        ip("link", "add", o.link, "type", "veth", "peer", "name", "eth0", "netns", o.netns)
        ip("addr", "add", f"{o.root_ip}/30", "dev", o.link)
        ip("link", "set", o.link, "up")
        ip("-n", o.netns, "addr", "add", f"{o.ip}/30", "dev", "eth0")
        ip("-n", o.netns, "link", "set", "eth0", "up")
        ip("-n", o.netns, "link", "set", "lo", "up")
        enter = ["nsenter", f"--net=/run/netns/{o.netns}", "--"]
        o.procs += [_serve_http(enter, o.ip, o.ports["allowed"], d), _serve_http(enter, o.ip, o.ports["other_port"], d),
                    _serve_http([], o.root_ip, o.ports["machine"], d)]

        def up() -> bool:  # the positive control: every server answers from the root namespace
            try:
                return all(urllib.request.urlopen(f"http://{a}:{o.ports[k]}/token", timeout=2).read() == (d / "token").read_bytes()
                           for k, a in (("allowed", o.ip), ("other_port", o.ip), ("machine", o.root_ip)))
            except OSError:
                return False

        await eventually(lambda: asyncio.to_thread(up), timeout=60, interval=0.2, what="the test's HTTP servers to answer")
        yield o
    finally:
        for p in o.procs:
            p.terminate()
            await asyncio.to_thread(p.wait, 10)
        subprocess.run(["ip", "netns", "delete", o.netns], capture_output=True)
        subprocess.run(["ip", "link", "delete", o.link], capture_output=True)


def _counter(enter: list[str] | None, table: str, name: str) -> int:
    import re
    import subprocess

    out = subprocess.run([*(enter or []), "nft", "list", "counter", "inet", table, name], check=True, capture_output=True, text=True).stdout
    m = re.search(r"packets (\d+)", out)
    assert m, out
    return int(m.group(1))


async def test_a_hosts_sandboxes_get_the_network_their_allowlist_opens(hosts: Hosts) -> None:
    """A sandbox on each host in its namespace reaches an allowed server beyond the machine (the host's
    masquerade, then the root namespace's forwarding and masquerade); the same server on a port its
    allowlist does not name is refused by its host's agent (``not_allowed``), and this machine's own
    address is refused by the root namespace (``to_machine``) even when the allowlist names it."""
    h = hosts
    async with _outside(h.net, h.root) as o:
        allow = [f"{o.ip}:{o.ports['allowed']}", f"{o.root_ip}:{o.ports['machine']}"]
        made: list[AsyncSandbox] = []
        on: dict[str, AsyncSandbox] = {}
        try:
            while len(on) < N and len(made) < 4 * N:  # one sandbox on every host (placement spreads)
                sb = await AsyncSandbox.create(**h.kw(network={"allow_out": allow}))
                made.append(sb)
                on.setdefault(sb.host_id, sb)
            assert len(on) == N, {k: v.sandbox_id for k, v in on.items()}
            for host_id, sb in sorted(on.items()):
                i = h.index(host_id)
                host_table = f"dsec_{h.net.net_prefix(i)}"

                async def get(ip: str, port: int, sb: AsyncSandbox = sb) -> str:  # busybox nc: an HTTP GET, and its exit status
                    r = await sb.commands.run(f"printf 'GET /token HTTP/1.0\\r\\n\\r\\n' | nc -w 10 {ip} {port} 2>&1; echo rc=$?", timeout=60)
                    return r.stdout

                got = await get(o.ip, o.ports["allowed"])
                assert got.startswith("HTTP/1.0 200") and got.endswith(f"\r\n\r\noutside {h.net.prefix}\nrc=0\n"), (host_id, got)

                before = _counter(h.net.enter(i), host_table, "not_allowed")
                got = await get(o.ip, o.ports["other_port"])
                assert "Connection refused" in got and "rc=1" in got, (host_id, got)
                assert _counter(h.net.enter(i), host_table, "not_allowed") > before

                before = _counter(None, h.net.table, "to_machine")
                got = await get(o.root_ip, o.ports["machine"])
                assert "Connection refused" in got and "rc=1" in got, (host_id, got)
                assert _counter(None, h.net.table, "to_machine") > before

            # NATS (the bridge's address) is each agent's control plane: not even nameable.
            with pytest.raises(DsecError) as ei:
                await AsyncSandbox.create(**h.kw(network={"allow_out": [f"{h.net.gateway}:4222"]}))
            assert ei.value.code == "invalid_argument", ei.value
        finally:
            for sb in made:
                await sb.kill()


async def test_a_hosts_dropped_packets_are_guard_violations_naming_sandbox_and_host(hosts: Hosts) -> None:
    """A packet a host's agent drops in the host's own namespace (NFLOG there, not in the root
    namespace) reaches guard: the host's drops-only guard reports a network violation naming the
    sandbox and that host. The positive control: the same sandbox's allowed connection, made first,
    is reported by nobody."""
    from bus.messages import GuardViolation

    h = hosts
    target = N - 1  # host 2
    seen: list[GuardViolation] = []

    async def on_violation(m: Any) -> None:
        v = codec.EVENT.decode(m.data)
        if isinstance(v, GuardViolation):
            seen.append(v)

    sub = await h.nc.subscribe(S.EVT_GUARD_VIOLATION, cb=on_violation)
    async with _outside(h.net, h.root) as o:
        made: list[AsyncSandbox] = []
        try:
            sb: AsyncSandbox | None = None
            while sb is None and len(made) < 4 * N:  # placement spreads: one lands on host 2
                made.append(await AsyncSandbox.create(**h.kw(network={"allow_out": [f"{o.ip}:{o.ports['allowed']}"]})))
                sb = made[-1] if made[-1].host_id == h.ids[target] else None
            assert sb is not None, [x.host_id for x in made]

            async def get(port: int) -> str:
                r = await sb.commands.run(f"printf 'GET /token HTTP/1.0\\r\\n\\r\\n' | nc -w 10 {o.ip} {port} 2>&1; echo rc=$?", timeout=60)
                return r.stdout

            got = await get(o.ports["allowed"])  # allowed: through, and nobody reports it
            assert got.startswith("HTTP/1.0 200") and got.endswith("rc=0\n"), got
            got = await get(o.ports["other_port"])  # not in the allowlist: refused in host 2's namespace
            assert "Connection refused" in got and "rc=1" in got, got

            def mine() -> list[GuardViolation]:
                return [v for v in seen if v.sandbox_id == sb.sandbox_id]

            await eventually(lambda: any(v.detail.get("dport") == str(o.ports["other_port"]) for v in mine()), timeout=60,
                             interval=0.1, what=f"the violation of {sb.sandbox_id}'s refused connection")
            v = next(v for v in mine() if v.detail.get("dport") == str(o.ports["other_port"]))
            assert (v.kind, v.what, v.host_id) == ("network", f"tcp {o.ip}:{o.ports['other_port']}", h.ids[target]), v
            assert v.detail["rule"] == "not_allowed" and v.detail["source"] == "guard.kernel", v.detail
            assert v.detail["ifname"].startswith(h.net.net_prefix(target)), v.detail  # the sandbox's veth, in host 2's namespace
            # The allowed connection went first, from the same sandbox through the same guard: not reported.
            assert [x for x in mine() if x.detail.get("dport") == str(o.ports["allowed"])] == [], mine()
            assert {x.host_id for x in mine()} == {h.ids[target]}, mine()
        finally:
            await sub.unsubscribe()
            for x in made:
                await x.kill()


async def test_spread_link_cut_lost_restored_elsewhere_then_fenced(hosts: Hosts) -> None:
    h = hosts
    sbs = [await AsyncSandbox.create(**h.kw()) for _ in range(6)]
    on: dict[str, list[AsyncSandbox]] = {}
    for sb in sbs:
        on.setdefault(sb.host_id, []).append(sb)
    assert len(on) >= 2, {k: len(v) for k, v in on.items()}  # placement spreads
    # One asks to be restored elsewhere, from its snapshot, if its host is lost: its host is the victim.
    keep = await AsyncSandbox.create(**h.kw(restore_on_host_loss=True))
    victim = keep.host_id
    vi = h.index(victim)
    assert on.get(victim), {k: len(v) for k, v in on.items()}  # spread: every host holds some
    await keep.commands.run("mkdir -p /root/data && echo before-the-cut > /root/data/f")
    snap = await keep.create_snapshot()
    victims = [*on[victim], keep]
    pids = {sb.sandbox_id: _container_pids(sb.sandbox_id) for sb in victims}
    assert all(pids.values())

    t_cut = time.monotonic()
    h.net.set_link(vi, False)
    try:
        async def all_lost() -> bool:
            recs = [await h.record(sb.sandbox_id) for sb in on[victim]]
            return all(r is not None and r.state == "lost" for r in recs)

        await eventually(all_lost, timeout=HOST_DOWN_S + 60, interval=0.25, what="the cut host's sandboxes lost")
        marked_s = time.monotonic() - t_cut
        assert (await h.host_state(vi))[0] == "down"
        for sb in on[victim]:
            evs = await _lost_events(h, sb.sandbox_id)
            assert len(evs) == 1 and evs[0].code == "host_unreachable", evs

        # The sandbox that asked is restored on another host from its snapshot, the same id one generation up.
        async def restored() -> bool:
            r = await h.record(keep.sandbox_id)
            return r is not None and r.state == "running" and r.host_id != victim and r.spec.generation == 1

        await eventually(restored, timeout=120, interval=0.25, what="the restore on another host")
        rec = await h.record(keep.sandbox_id)
        assert rec is not None and rec.spec.snapshot == snap.snapshot_id
        assert rec.container_id == f"{keep.sandbox_id}-g1", rec  # guard maps the incarnation's cgroup through it
        assert (await keep.commands.run("cat /root/data/f")).stdout == "before-the-cut\n"

        # Creates keep succeeding, on the hosts still reachable.
        more = [await AsyncSandbox.create(**h.kw()) for _ in range(3)]
        sbs += more
        assert victim not in {sb.host_id for sb in more}
        # Still cut off, the host still runs its sandboxes (it cannot know yet).
        assert all(_container_pids(sid) for sid in pids)
    finally:
        h.net.set_link(vi, True)
    print(f"\nhost marked down and its sandboxes lost {marked_s:.1f}s after the cut (grace {HOST_DOWN_S:.0f}s)")

    # Back on the link, the host answers for a lost sandbox only that it has none: no op runs on it
    # (until it is swept, each op checks the record first). Until the host is heard, ops time out.
    lost_sb = on[victim][0]
    answer: DsecError | None = None

    async def answered() -> bool:
        nonlocal answer
        try:
            await lost_sb.commands.run("true", timeout=5)
        except DsecError as exc:
            if exc.code in ("timeout", "unavailable", "host_unreachable", "sandbox_timeout"):
                return False
            answer = exc
            return True
        raise AssertionError("an op ran on a sandbox the cluster declared lost")

    await eventually(answered, timeout=120, interval=0.5, what="the returning host to answer")
    assert answer is not None and answer.code == "sandbox_not_found", answer

    # Link back: the host fences what the cluster gave up -- removed locally, nothing written, nothing twice.
    async def fenced() -> bool:
        return all(not _container_pids(sid) and not cgroups_of(sid) for sid in pids)

    await eventually(fenced, timeout=120, interval=0.5, what="the returning host to remove its lost sandboxes")
    t_back = time.monotonic()
    await eventually(lambda: _ready(h, vi), timeout=60, interval=0.25, what="the host ready again")
    for sb in on[victim]:
        r = await h.record(sb.sandbox_id)
        assert r is not None and r.state == "lost" and r.host_id == victim
        assert len(await _lost_events(h, sb.sandbox_id)) == 1
    rec = await h.record(keep.sandbox_id)
    assert rec is not None and rec.state == "running" and rec.host_id != victim  # the restore stays; no second copy
    assert (await keep.commands.run("cat /root/data/f")).stdout == "before-the-cut\n"
    print(f"fenced within {time.monotonic() - t_back:.1f}s of the host being ready again")

    for sb in sbs:
        if sb.host_id != victim:
            await sb.kill()
    await keep.kill()
    for sid in [sb.sandbox_id for sb in sbs] + [keep.sandbox_id, f"{keep.sandbox_id}-g1"]:  # -g1: the restored incarnation's container
        await eventually(lambda s=sid: not cgroups_of(s) and not mounts_mentioning(s), timeout=30, what=f"{sid} gone")


async def test_a_shaped_link_still_loads_lazily_and_execs_slower(hosts: Hosts) -> None:
    """tbf on one host's link (both ways): a restore whose layer that host must fetch, a lazy read of
    2 MiB and execs still work, and the read is no faster than the rate allows; figures printed."""
    h = hosts
    size, rate_bit = 2 << 20, 8_000_000
    figures: dict[str, float] = {}
    for label, shaped in (("plain", False), ("tbf 8mbit", True)):
        # A fresh random blob each round: the target has none of its chunks cached.
        src = await AsyncSandbox.create(**h.kw())
        try:
            await src.commands.run(f"mkdir -p /root/data && head -c {size} /dev/urandom > /root/data/blob && md5sum /root/data/blob > /root/sum")
            snap = await src.create_snapshot()
            want = (await src.commands.run("cat /root/sum")).stdout
        finally:
            await src.kill()
        target = next(j for j in range(N) if h.ids[j] != src.host_id)
        others = [j for j in range(N) if j != target]
        if shaped:
            h.net.shape(target, "8mbit", burst="64kbit")
        for j in others:  # only the target can take the restore
            h.net.set_link(j, False)
        try:
            await eventually(lambda o=others: _stale_everywhere(h, o), timeout=60, interval=0.25, what="the other hosts out of the table")
            t0 = time.monotonic()
            sb = await AsyncSandbox.create(snapshot=snap.snapshot_id, **h.kw(create_timeout=300))
            figures[f"{label}: restore"] = time.monotonic() - t0
            assert sb.host_id == h.ids[target]
            t0 = time.monotonic()
            got = (await sb.commands.run("md5sum /root/data/blob", timeout=300)).stdout
            figures[f"{label}: read 2 MiB lazily"] = time.monotonic() - t0
            assert got == want
            t0 = time.monotonic()
            for _ in range(10):
                await sb.commands.run("true")
            figures[f"{label}: 10 execs"] = time.monotonic() - t0
            await sb.kill()
        finally:
            if shaped:
                h.net.unshape(target)
            for j in others:
                h.net.set_link(j, True)
        await eventually(lambda o=others: all(_fresh(h, j) for j in o), timeout=90, interval=0.25, what="the other hosts back")
    print("\n" + "\n".join(f"{k}: {v:.2f}s" for k, v in figures.items()))
    # The shaped link cannot carry the blob faster than its rate (restore and read together: the
    # restore may have fetched some of it).
    floor = size * 8 / rate_bit
    assert figures["tbf 8mbit: restore"] + figures["tbf 8mbit: read 2 MiB lazily"] >= 0.8 * floor, (figures, floor)


def _container_pids(sid: str) -> list[int]:
    """Pids in the sandbox's cgroup (its container's processes), empty once it is gone."""
    out: list[int] = []
    for cg in cgroups_of(sid):
        with contextlib.suppress(OSError):
            out += [int(x) for x in Path(cg, "cgroup.procs").read_text().split()]
    return out


async def _ready(h: Hosts, i: int) -> bool:
    st, at = await h.host_state(i)
    return st == "ready" and at > time.time() - 10


def _stale_everywhere(h: Hosts, js: list[int]) -> bool:
    from placement._table import STALE_AFTER_S

    now = time.time()
    return all(now - p.table.hosts[h.ids[j]].seen_at > STALE_AFTER_S for p in h.placements for j in js if h.ids[j] in p.table.hosts)


def _fresh(h: Hosts, j: int) -> bool:
    now = time.time()
    return all(h.ids[j] in p.table.hosts and now - p.table.hosts[h.ids[j]].seen_at < 5 for p in h.placements)



async def test_dsec_up_hosts_2_spreads_and_leaves_nothing(tmp_path: Path) -> None:
    """``dsec up --hosts 2`` as a user runs it: two hosts behind their links, creates spread over both,
    and SIGTERM leaves no namespace, link, containerd or mount behind."""
    import ipaddress
    import os
    import signal
    import subprocess
    import sys

    from bus.natsd import free_port
    from sdk._up import host_data

    from .conftest import REPO

    claim = await asyncio.to_thread(claim_net)
    data = Path(tempfile.mkdtemp(prefix="dsec-uphosts-", dir="/tmp"))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST") and k not in ("DSEC_NATS_URL", "DSEC_NATS_CREDS")}
    env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", **claim.env())
    argv = [sys.executable, "-m", "sdk.cli", "up", "--data-dir", str(data), "--port", str(port), "--http-port", str(free_port()), "--host-id", "uph",
            "--no-auth", "--reclaim", "off", "--hosts", "2", "--hosts-prefix", claim.prefix, "--hosts-net", claim.pool,
            "--context", f"{data}.ctx", "--ready-timeout", "240"]
    up = Child(argv, env, f"{data}.log").start()
    gateway = list(ipaddress.ip_network(claim.pool).subnets(new_prefix=24))[-1][1]
    url = f"nats://{gateway}:{port}"
    try:
        await eventually(lambda: "dsec up: ready" in up.log() or not up.alive(), timeout=300, interval=0.5, what="dsec up --hosts 2 ready")
        assert up.alive(), up.log()
        assert "ready: 2 host(s)" in up.log()
        sbs = [await AsyncSandbox.create(nats_url=url, memory_mb=64) for _ in range(4)]
        assert {sb.host_id for sb in sbs} == {"uph-0", "uph-1"}
        assert (await sbs[0].commands.run("echo hi")).stdout == "hi\n"
        # A sandbox with a network: its host's agent takes the hosts' deny list, and the root
        # namespace's table for the hosts is there (and gone after the stop, below).
        sbs.append(await AsyncSandbox.create(nats_url=url, memory_mb=64, network={"allow_out": ["192.0.2.1/32"]}))
        assert (await sbs[-1].commands.run("ip -o addr show eth0")).exit_code == 0
        assert subprocess.run(["nft", "list", "table", "inet", f"dsec_{claim.prefix}_hosts"], capture_output=True).returncode == 0
        # Its host's guard (dsec up runs one in each host's namespace) reports what the host's agent drops.
        import nats

        from bus.messages import GuardViolation

        seen: list[GuardViolation] = []

        async def on_violation(m: Any) -> None:
            v = codec.EVENT.decode(m.data)
            if isinstance(v, GuardViolation) and v.sandbox_id == sbs[-1].sandbox_id:
                seen.append(v)

        nc = await nats.connect(url)
        try:
            await nc.subscribe(S.EVT_GUARD_VIOLATION, cb=on_violation)
            await nc.flush()
            got = (await sbs[-1].commands.run("nc -w 5 192.0.2.2 80 </dev/null 2>&1; echo rc=$?", timeout=60)).stdout
            assert "Connection refused" in got, got  # not in its allowlist: refused by its host's agent
            await eventually(lambda: bool(seen), timeout=60, interval=0.1, what="the host's guard to report the refused connection")
            assert (seen[0].kind, seen[0].what, seen[0].host_id, seen[0].detail["rule"]) == (
                "network", "tcp 192.0.2.2:80", sbs[-1].host_id, "not_allowed"), seen
            # The machine's guard reads the kernel's audit for every host here: a Landlock denial
            # names the sandbox's host (its record's), not the machine.
            got = (await sbs[-1].commands.run("sh -c 'echo evil > /var/evil' 2>&1; echo rc=$?")).stdout
            assert "Permission denied" in got and "rc=0" not in got, got
            await eventually(lambda: any(v.kind == "landlock" for v in seen), timeout=60, interval=0.1, what="the Landlock violation")
            fs = next(v for v in seen if v.kind == "landlock")
            assert ("/var" in fs.what, fs.host_id, fs.detail["source"]) == (True, sbs[-1].host_id, "guard.kernel"), fs
        finally:
            await nc.close()
        for sb in sbs:
            await sb.kill()
    finally:
        from sdk._async import close_connections

        with contextlib.suppress(Exception):
            await close_connections()
        up.signal(signal.SIGTERM)
        rc = await up.wait(300)
        left = claim.in_kernel() + [x for i in range(2) for x in data_dir_leftovers(host_data(data, i))]
        if subprocess.run(["nft", "list", "table", "inet", f"dsec_{claim.prefix}_hosts"], capture_output=True).returncode == 0:
            left.append(f"nft table dsec_{claim.prefix}_hosts")
        claim.release()
        if not left:
            shutil.rmtree(data, ignore_errors=True)
            Path(f"{data}.log").unlink(missing_ok=True)
    assert rc == 0, up.log()
    assert left == [], left
