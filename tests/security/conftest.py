"""Fixtures for the red-team suites: a whole dsec stack per test, on real parts.

``stack`` (function-scoped) starts, in this process, a private NATS JetStream, placement, and a
host agent with the container backend (its own containerd + runc under a temp data dir) with the
busybox ``base`` template, and yields a :class:`SecStack`: ``await stack.create(**kw)`` makes an
``AsyncSandbox`` on it (same arguments as ``AsyncSandbox.create``). At the end every sandbox is
killed and everything is removed again: containers, mounts, containerd and its shims (by pid),
and the sandbox networks (netns mounts, veths, the nft table) the stack's host agent owned.

``make_stack(**options)`` builds one with options: ``auth`` (NATS with the per-role users and
permissions ``dsec up`` configures: each service connects as its role, ``stack.nc`` as ``admin``,
``stack.url`` has no credentials (refused), ``stack.client_url`` is a client tenant's; ``stack.auth`` the
``bus.auth.AuthConfig``),
``dedup_window_s`` (the streams' de-duplication window, for replay tests), ``network`` (a dict of
``hostagent.network.NetworkConfig`` overrides, e.g. nameservers), ``nats_host`` (the address NATS
listens on), ``guard`` (also run the guard service: profiles in KV, audit watcher, this host's
kernel audit reader and the reader of the stack's dropped packets; ``stack.guard``), ``warm_pool``
(started containers the host agent keeps ready per image and profile), ``fn_pools`` (the host agent's
FnCall pools, ``base=1,...``). Each stack claims its own nft
table, veth prefix, netns prefix, /22 address pool and NFLOG group (tests/netclaim.py), so stacks
never touch each other's (or a real host agent's) network state, in this run or a concurrent one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tests.conftest import cannot_run, eventually
from tests.netclaim import NetClaim, claim_net
from tests.integration.conftest import data_dir_leftovers, force_cleanup, register_base_template, stack_skip_reason

SKIP_REASON = stack_skip_reason()


def network_leftovers(cfg: Any, *, warm_ok: bool = False) -> list[str]:
    """Kernel state of a network config that is still there: veths, netns mounts, set elements.
    ``warm_ok``: ignore the host agent's pool of pre-made (unassigned) networks."""
    import subprocess

    from hostagent.network import WARM_TAG

    def warm_link(n: str) -> bool:
        try:
            return Path(f"/sys/class/net/{n}/ifalias").read_text().startswith(WARM_TAG)
        except OSError:
            return False

    left = [f"link {n}" for n in os.listdir("/sys/class/net") if n.startswith(cfg.ifprefix) and not (warm_ok and warm_link(n))]
    if os.path.isdir(cfg.netns_dir):
        left += [f"netns {n}" for n in os.listdir(cfg.netns_dir) if n.startswith(cfg.netns_prefix) and not (warm_ok and WARM_TAG in n)]
    with open("/proc/self/mountinfo") as f:
        left += [f"mount {mp}" for mp in (ln.split()[4] for ln in f) if f"/{cfg.netns_prefix}" in mp and not (warm_ok and WARM_TAG in mp)]
    for s in ("allow_net", "allow_port"):
        r = subprocess.run(["nft", "list", "set", "inet", cfg.table, s], capture_output=True, text=True)
        if r.returncode == 0 and "elements" in r.stdout:
            left.append(f"nft elements in {s}: {r.stdout.strip()}")
    return left


@dataclass
class SecStack:
    url: str
    uid: str
    data_dir: Path
    host_id: str
    net: Any  # NetworkConfig
    host: Any  # HostAgent
    backend: Any  # ContainerBackend
    placement: Any
    nc: Any
    nats: Any  # bus.natsd.NatsServer
    sandboxes: list[Any] = field(default_factory=list)
    guard: Any = None  # guard.Guard, with make_stack(guard=True)
    auth: Any = None  # bus.auth.AuthConfig, with make_stack(auth=True)
    stream_options: Any = None  # bus.streams.StreamOptions the services run with
    control_key: bytes | None = None  # placement signs host work with it (auth stacks, as `dsec up`)
    claim: Any = None  # tests.netclaim.NetClaim: the names of ``net``, this stack's alone
    client_user: str = ""  # auth stacks: the NATS user (tenant) the tests' own creates run as

    @property
    def client_url(self) -> str:
        """The URL of this stack's client tenant (auth stacks: nothing connects without credentials)."""
        return self.url_as(self.client_user) if self.auth is not None else self.url

    def url_as(self, role: str) -> str:
        """NATS URL of a service role (or named user) on an ``auth`` stack; the plain URL otherwise."""
        return self.auth.url_for(role, self.url) if self.auth is not None else self.url

    async def create(self, **kw: Any) -> Any:
        """``AsyncSandbox.create`` on this stack (killed at the end of the test)."""
        from sdk import AsyncSandbox

        kw.setdefault("sandbox_id", f"sb-{self.uid}-{uuid.uuid4().hex[:8]}")
        sb = await AsyncSandbox.create(nats_url=self.client_url, **kw)
        self.sandboxes.append(sb)
        return sb

    def handle(self, sb: Any) -> Any:
        return self.host.handles[sb.sandbox_id]

    def attachment(self, sb: Any) -> Any:
        """The sandbox's network (netns path, ip, host-side veth), or None."""
        return self.backend.net.attachment(sb.sandbox_id)

    async def new_hostagent(self) -> None:
        """Stop the host agent (sandboxes keep running) and start a fresh one on the same data dir."""
        from hostagent.backends.container import ContainerBackend

        self.host.config = self.host.config.replace(destroy_on_shutdown=False)
        await self.host.shutdown()
        self.backend = ContainerBackend(str(self.data_dir), scratch_size_gb=16, network=self.net, warm_pool=0)
        self.host = _hostagent(self.backend, self.url_as("hostagent"), self.host_id, self.data_dir, self.stream_options, self.control_key)
        await self.host.start()

    def network_leftovers(self, *, warm_ok: bool = True) -> list[str]:
        return network_leftovers(self.net, warm_ok=warm_ok)


def _hostagent(
    backend: Any, url: str, host_id: str, data_dir: Path, stream_options: Any = None, control_key: bytes | None = None, fn_pools: str = "",
) -> Any:
    from bus.streams import StreamOptions
    from hostagent import HostAgent, HostAgentConfig

    cfg = HostAgentConfig(
        nats_url=url, host_id=host_id, data_dir=str(data_dir), concurrency=8, heartbeat_s=1.0, destroy_on_shutdown=True, grace_s=20.0,
        control_key=control_key, fn_pools=fn_pools,
    )
    return HostAgent(backend, cfg, stream_options=stream_options or StreamOptions())


def _mounted_under(path: Path) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(str(path) in ln for ln in f)


async def _close_stack(st: SecStack) -> None:
    """Stop a stack made by ``make_stack`` and check it left nothing behind (then remove it anyway)."""
    import sdk._async

    problems: list[str] = []
    for sb in st.sandboxes:
        with contextlib.suppress(Exception):
            await sb.kill()
    with contextlib.suppress(Exception):
        await sdk._async.close_connections()
    with contextlib.suppress(Exception):
        await st.host.shutdown()
    with contextlib.suppress(Exception):
        await st.placement.shutdown()
    if st.guard is not None:
        with contextlib.suppress(Exception):
            await st.guard.shutdown()
    with contextlib.suppress(Exception):
        await st.nc.close()
    data_dir, net = st.data_dir, st.net
    left = data_dir_leftovers(data_dir)
    if left:
        problems.append(f"left under {data_dir}: {left}")
        await force_cleanup(data_dir)
    # The kernel frees a netns (and its veth pair) asynchronously once its last process is gone.
    with contextlib.suppress(AssertionError):
        await eventually(lambda: not network_leftovers(net), timeout=15, what="sandbox networks to be gone")
    netleft = network_leftovers(net)
    if netleft:
        problems.append(f"network state left: {netleft}")
    await st.claim.purge()  # the table itself (and ip_forward, if this was the last dsec table)
    if not _mounted_under(data_dir):
        shutil.rmtree(data_dir, ignore_errors=True)
    assert not problems, problems


def _released(claim: NetClaim) -> Callable[[], Awaitable[None]]:
    async def release() -> None:
        claim.release()

    return release


@pytest_asyncio.fixture(loop_scope="session")
async def make_stack() -> AsyncIterator[Callable[..., Awaitable[SecStack]]]:
    if SKIP_REASON is not None:
        cannot_run(SKIP_REASON)
    from bus import connect, ensure_all
    from bus.natsd import NatsServer
    from bus.streams import StreamOptions
    from hostagent.backends.container import ContainerBackend
    from imaged._busybox import build_busybox_rootfs
    from placement import Placement

    made: list[SecStack] = []
    cleanups: list[Callable[[], Awaitable[None]]] = []

    async def make(
        *, network: dict[str, Any] | None = None, nats_host: str = "127.0.0.1", guard: bool = False, warm_pool: int = 0,
        auth: bool = False, dedup_window_s: float | None = None, fn_pools: str = "",
    ) -> SecStack:
        uid = uuid.uuid4().hex[:8]
        data_dir = Path(tempfile.mkdtemp(prefix=f"dsec-sec-{uid}-", dir="/tmp"))

        async def remove_data_dir() -> None:  # runs last; also when make() failed half-way
            if data_dir.exists() and not _mounted_under(data_dir):
                shutil.rmtree(data_dir, ignore_errors=True)

        cleanups.append(remove_data_dir)
        nats_dir = tempfile.mkdtemp(prefix=f"dsec-secnats-{uid}-", dir="/tmp")  # not under data_dir: it outlives close()
        authcfg = None
        if auth:
            from bus.auth import AuthConfig

            # As `dsec up` does: the users file under the data dir, its authorization block in NATS' config.
            authcfg = AuthConfig.load_or_create(Path(nats_dir) / "auth.json")
            authcfg.issue_client_credential(f"sec{uid}")
        nats = NatsServer(nats_dir, host=nats_host, port=0, extra_config=authcfg.config_block() if authcfg else "")
        nats.start()

        async def stop_nats() -> None:
            await asyncio.to_thread(nats.stop)
            shutil.rmtree(nats_dir, ignore_errors=True)

        cleanups.append(stop_nats)
        url = nats.url

        def url_as(role: str) -> str:
            return authcfg.url_for(role, url) if authcfg is not None else url

        opts = StreamOptions() if dedup_window_s is None else StreamOptions(dedup_window_s=dedup_window_s)
        claim = await asyncio.to_thread(claim_net)  # may wait for a free slot
        cleanups.append(_released(claim))  # runs after the stack's close: its names are free only once it is gone
        net = claim.config(**({"control_plane": (url,)} | (network or {})))
        nc = await connect(url_as("admin"), name="dsec-sec-tests")
        await ensure_all(nc.jetstream(), opts)
        rootfs = data_dir / "rootfs"
        await asyncio.to_thread(build_busybox_rootfs, str(rootfs))
        await register_base_template(nc.jetstream(), str(rootfs))
        key = authcfg.control_key_bytes if authcfg else None
        placement = Placement(url_as("placement"), replica_id=f"p-{uid}", stream_options=opts, control_key=key)
        backend = ContainerBackend(str(data_dir), scratch_size_gb=16, network=net, warm_pool=warm_pool)
        host_id = f"sec-{uid}"
        st = SecStack(
            url, uid, data_dir, host_id, net, _hostagent(backend, url_as("hostagent"), host_id, data_dir, opts, key, fn_pools), backend, placement, nc, nats,
            auth=authcfg, stream_options=opts, control_key=key, claim=claim, client_user=f"cli-sec{uid}" if authcfg else "",
        )

        cleanups.append(lambda: _close_stack(st))
        if guard:
            from guard import Guard

            st.guard = Guard(url_as("guard"), host_id=f"guard-{uid}", nflog_group=net.log_group)
            await st.guard.start()
        await placement.start()
        await st.host.start()
        await eventually(lambda: host_id in placement.table.hosts, timeout=15, what="placement to see the host")
        made.append(st)
        return st

    try:
        yield make
    finally:
        errors: list[BaseException] = []
        for c in reversed(cleanups):
            try:
                await c()
            except BaseException as exc:  # noqa: BLE001 - run every cleanup, report the first failure
                errors.append(exc)
        if errors:
            raise errors[0]


@pytest_asyncio.fixture(loop_scope="session")
async def stack(make_stack: Callable[..., Awaitable[SecStack]]) -> SecStack:
    return await make_stack()


async def until(pred: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``pred`` (sync or async) until true, with a deadline."""
    await eventually(pred, timeout=timeout, what=what)


# ----------------------------------------------------------------------------- a principal on the bus
class Principal:
    """One NATS connection (``name`` in the red-team tally) with the permission errors the server sent
    it: ``denied_publish`` and ``denied_subscribe`` assert the server's ``Permissions Violation`` for
    exactly that subject."""

    def __init__(self, name: str, nc: Any = None, errs: list[str] | None = None) -> None:
        self.name, self.nc, self.errs = name, nc, errs if errs is not None else []

    @classmethod
    async def open(cls, url: str, name: str) -> "Principal":
        p = cls(name)
        await p.connect(url)
        return p

    async def connect(self, url: str) -> None:
        from bus.runtime import connect

        async def on_err(e: Exception) -> None:
            self.errs.append(str(e).lower())

        # bus.runtime.connect: the same inbox prefix the SDK and the services use for a named user.
        self.nc = await connect(url, name=self.name, error_cb=on_err, connect_attempts=3, connect_timeout_s=10, max_reconnect_attempts=0)

    def violation(self, kind: str, subject: str) -> bool:
        return any(f"permissions violation for {kind}" in e and f'"{subject.lower()}"' in e for e in self.errs)

    async def denied_publish(self, rt: "RedTeam", subject: str, data: bytes, what: str) -> None:
        await self.nc.publish(subject, data, reply=self.nc.new_inbox())
        await self.nc.flush()
        await eventually(lambda: self.violation("publish", subject), what=f"a publish violation for {subject}")
        rt.blocked(f"{self.name}: {what} [permissions violation: publish {subject}]")

    async def denied_subscribe(self, rt: "RedTeam", subject: str, what: str) -> None:
        got: list[Any] = []

        async def cb(m: Any) -> None:
            got.append(m)

        sub = await self.nc.subscribe(subject, cb=cb)
        await self.nc.flush()
        await eventually(lambda: self.violation("subscription", subject), what=f"a subscription violation for {subject}")
        assert not got
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
        rt.blocked(f"{self.name}: {what} [permissions violation: subscribe {subject}]")

    def no_violations(self) -> bool:
        return not [e for e in self.errs if "permissions violation" in e]

    async def close(self) -> None:
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()


class Tenant(Principal):
    """A client credential of its own (a tenant): its NATS user and URL, and a raw connection."""

    def __init__(self, name: str, user: str, url: str) -> None:
        super().__init__(f"tenant {name}")
        self.short, self.user, self.url = name, user, url

    @classmethod
    async def issue(cls, stack: "SecStack", name: str) -> "Tenant":
        user, _ = stack.auth.issue_client_credential(f"{name}{stack.uid}")
        return cls(name, user, stack.auth.url_for(user, stack.url))


async def tenants(stack: "SecStack", *names: str) -> list[Tenant]:
    """New tenants on an ``auth`` stack (nats-server reloaded with their users), each connected."""
    ts = [await Tenant.issue(stack, n) for n in names]
    await asyncio.to_thread(stack.nats.reload, stack.auth.config_block())
    for t in ts:
        await t.connect(t.url)
    return ts


# ----------------------------------------------------------------------------- red-team tally
_TALLY: list[tuple[str, str, str]] = []  # (test, "blocked" | "allowed", what)


class RedTeam:
    """Records each attack a test asserted to be blocked (and each positive control that had to
    work), so the run ends with a count of blocked attacks."""

    def __init__(self, test: str) -> None:
        self.test = test

    def blocked(self, what: str) -> None:
        _TALLY.append((self.test, "blocked", what))

    def allowed(self, what: str) -> None:
        _TALLY.append((self.test, "allowed", what))


@pytest.fixture
def redteam(request: pytest.FixtureRequest) -> RedTeam:
    return RedTeam(request.node.nodeid)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _TALLY:
        return
    blocked = [t for t in _TALLY if t[1] == "blocked"]
    allowed = [t for t in _TALLY if t[1] == "allowed"]
    tr = terminalreporter
    tr.section("red team")
    for test, _kind, what in blocked:
        tr.write_line(f"BLOCKED  {what}   [{test.split('::')[-1]}]")
    tr.write_line(f"{len(blocked)} attacks blocked; {len(allowed)} positive controls passed")


__all__ = ["SecStack", "RedTeam", "Principal", "Tenant", "tenants", "network_leftovers", "until", "SKIP_REASON"]
