"""The network manager: owns this host agent's sandbox networks and composes the parts that make
them -- the /30 address pool (``slots``), veth/netns plumbing (``plumbing``), the per-sandbox
nftables rules (``rules``), the warm pool of pre-made networks (``warm``), cleanup and reconcile
(``reconcile``), and the allowlist (``allowlist``, names looked up by ``resolver``). Kernel state is
touched only from one worker thread (``worker``); the async methods hand work to it."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import time
from dataclasses import dataclass
from typing import Any

import structlog

from bus.errors import CreateFailed, InvalidArgument, NotSupported
from bus.messages import NetworkSpec

from . import forwarding, netns
from .allowlist import Entry, compile_allowlist, parse_allow_out
from .attachment import Attachment, host_ifname, netns_path
from .config import DEFAULT_DENY, NetworkConfig, hosts_of
from .plumbing import Plumbing
from .reconcile import Reconciler
from .resolver import Resolver, ResolveFailed
from .rules import SandboxRules
from .slots import SlotPool
from .warm import WarmPool
from .worker import Worker

log = structlog.get_logger("dsec.hostagent.network")

__all__ = ["NetworkManager", "Attachment", "Prepared"]


@dataclass(frozen=True)
class Prepared:
    """An allowlist parsed, its names resolved (``NetworkManager.prepare``)."""

    entries: list[Entry]
    resolved: dict[str, list[str]]

    @property
    def names(self) -> bool:
        """Whether it names hosts (lines for the sandbox's /etc/hosts)."""
        return any(e.is_domain for e in self.entries)


class NetworkManager:
    """Owns this host agent's sandbox networks: pool, netns, veths, nft table. Kernel state is only
    touched from one worker thread; the async methods hand work to it."""

    def __init__(self, config: NetworkConfig | None = None, *, resolver: Resolver | None = None) -> None:
        self.cfg = config or NetworkConfig()
        self.slots = SlotPool(self.cfg.pool)
        self.pool = self.slots.pool
        self.nslots = self.slots.nslots
        self.resolver = resolver or Resolver(self.cfg.nameservers, self.cfg.resolve_timeout_s)
        self.deny: list[ipaddress.IPv4Network] = [self.pool, *(ipaddress.IPv4Network(d) for d in DEFAULT_DENY)]
        # setup_ms: the create path (pool hit or made inline); make_ms: making one network (netns,
        # veth, addresses, routes) wherever it happens; teardown_ms: the destroy path.
        self.stats: dict[str, list[float]] = {"setup_ms": [], "make_ms": [], "teardown_ms": [], "pool_hits": [], "pool_misses": []}
        self._started = False
        self._worker = Worker()
        # --- worker-thread state ---
        self._kernel = Plumbing(self.cfg)
        self._rules = SandboxRules(self.cfg, self._kernel)
        self._att: dict[str, Attachment] = {}
        self._warm = WarmPool(self.cfg, self._kernel, self.slots, self._worker, self.stats["make_ms"], ready=lambda: self._started and not self.unavailable)
        self._reconcile = Reconciler(self.cfg, self._kernel, self._rules, self.slots, self._att)

    @property
    def unavailable(self) -> str:
        """Why this host can make no sandbox networks (empty: it can)."""
        return self._kernel.unavailable

    def wanted(self, network: NetworkSpec | None) -> bool:
        return network is not None and bool(network.allow_out)

    def netns_path(self, sid: str) -> str:
        return netns_path(self.cfg, sid)

    def ifname(self, sid: str) -> str:
        return host_ifname(self.cfg, sid)

    def slot_addrs(self, slot: int) -> tuple[str, str, ipaddress.IPv4Network]:
        return self.slots.addrs(slot)

    def attachment(self, sid: str) -> Attachment | None:
        return self._att.get(sid)

    # --- start / stop -------------------------------------------------------------------------
    async def start(self) -> None:
        deny = [ipaddress.IPv4Network(d) for d in DEFAULT_DENY]
        deny.append(self.pool)
        deny.extend(ipaddress.IPv4Network(d, strict=False) for d in self.cfg.deny_out)
        for cp in self.cfg.control_plane:
            for host in hosts_of(cp):
                try:
                    deny.append(ipaddress.IPv4Network(host))
                    continue
                except ValueError:
                    pass
                try:
                    ips = await Resolver((), 2.0).resolve(host)
                except ResolveFailed as exc:  # not resolvable now: nothing to deny by address
                    log.warning("control_plane_unresolved", host=host, error=exc.description)
                    ips = []
                deny.extend(ipaddress.IPv4Network(ip) for ip in ips)
        self.deny = list(ipaddress.collapse_addresses(deny))
        # The kernel is touched only once a sandbox asks for a network (or there is state to
        # recover): a host that never runs one keeps its ip_forward and ruleset as they were.

    def _w_ensure_started(self) -> None:
        if self._started:
            return
        if self.unavailable:
            raise CreateFailed(f"network isolation is unavailable on this host ({self.unavailable})")
        try:
            self._kernel.init()
            os.makedirs(self.cfg.netns_dir, mode=0o755, exist_ok=True)
            guard = forwarding.enable(self.cfg)  # nobody forwarded before us: forward nothing but sandbox traffic
            self._rules.apply_base(self.deny, guard)
            self._reconcile.learn_slots()
        except Exception as exc:  # tried again by the next sandbox that wants a network
            why = f"{type(exc).__name__}: {exc}"
            log.error("network_unavailable", error=why)
            raise CreateFailed(f"network isolation is unavailable on this host ({why})") from None
        self._started = True

    async def stop(self) -> None:
        await self._warm.stop()
        if self._worker.active:
            try:
                await self._worker.run(self._warm.drain)
                await self._worker.run(self._kernel.close)
            finally:
                self._worker.shutdown()

    # --- setup ------------------------------------------------------------------------------------
    async def prepare(self, network: NetworkSpec) -> Prepared:
        """The allowlist parsed and its names resolved: InvalidArgument for a bad allowlist, CreateFailed
        (ResolveFailed: no nameserver answered) when the host cannot do it."""
        if self.unavailable:
            raise CreateFailed(f"network isolation is unavailable on this host ({self.unavailable}); sandboxes with a network cannot be created here")
        entries = parse_allow_out(network.allow_out, self.cfg.max_entries)
        domains = sorted({e.host for e in entries if e.is_domain})
        resolved: dict[str, list[str]] = {}
        if domains:
            res = await asyncio.gather(*(self.resolver.resolve(d) for d in domains))
            resolved = {d: ips[: self.cfg.max_ips_per_domain] for d, ips in zip(domains, res, strict=True)}
        return Prepared(entries, resolved)

    async def setup(self, sid: str, network: NetworkSpec, *, prepared: Prepared | None = None, netns_of: str = "") -> Attachment:
        """Create the sandbox's netns, veth, addresses and allowlist. Raises InvalidArgument for a
        bad allowlist, CreateFailed (ResolveFailed: no nameserver answered) when the host cannot do it.
        ``prepared``: ``prepare``'s answer for ``network`` (given: no second look-up). ``netns_of``: the
        netns to use (a warm container's own, ``/proc/<pid>/ns/net``) instead of a new or pre-made one."""
        if prepared is None:
            prepared = await self.prepare(network)
        try:
            return await self._worker.run(self._w_setup, sid, prepared.entries, prepared.resolved, netns_of)
        except (InvalidArgument, CreateFailed):
            raise
        except Exception as exc:  # noqa: BLE001
            log.exception("network_setup_failed", sandbox_id=sid)
            raise CreateFailed(f"cannot set up the sandbox network: {type(exc).__name__}: {exc}") from None
        finally:
            self._warm.kick()

    def _w_setup(self, sid: str, entries: list[Entry], resolved: dict[str, list[str]], netns_of: str = "") -> Attachment:
        t0 = time.perf_counter()
        self._kernel.init()
        self._kernel.check_root_ns()
        self._w_ensure_started()
        if sid in self._att:
            return self._att[sid]  # redelivered create
        plan = compile_allowlist(entries, resolved, self.deny, self._kernel.host_addrs())
        warm = self._warm.take() if not netns_of else None
        if warm is not None:
            att = warm
            att.elements, att.hosts = plan.elements(att.ifname), plan.hosts
        else:
            slot = self.slots.alloc(sid, self._kernel)
            gw, ip, _ = self.slots.addrs(slot)
            host_if = self.ifname(sid)
            att = Attachment(sid, slot, host_if, ip, gw, self.netns_path(sid), plan.elements(host_if), plan.hosts)
            self._att[sid] = att
        try:
            if warm is not None:
                self._kernel.rename(att, self.netns_path(sid), sid)
                self.slots.used[att.slot] = sid
                self._att[sid] = att
            else:
                t1 = time.perf_counter()
                self._kernel.make_netns(att, alias=sid, existing=netns_of)
                self.stats["make_ms"].append((time.perf_counter() - t1) * 1000)
            self._rules.add(att.elements)
        except BaseException:
            if sid in self._att:
                self._w_teardown(sid)
            elif warm is not None:  # failed before the sandbox owned it
                self._warm.discard(att)
            raise
        self.stats["pool_hits" if warm is not None else "pool_misses"].append(1.0)
        att.setup_ms = (time.perf_counter() - t0) * 1000
        self.stats["setup_ms"].append(att.setup_ms)
        return att

    # --- a running sandbox's allowlist ---------------------------------------------------------
    async def update(self, sid: str, network: NetworkSpec | None) -> Attachment | None:
        """Replace the allowlist of ``sid``'s network (None or empty: no egress): the new elements are
        added before the old ones go, so no moment allows what neither list does. /etc/hosts keeps the
        names resolved at create (a name new here is reachable by the addresses resolved now).
        A sandbox with no network of its own (created without an allowlist) has no egress already: None
        for no egress, NotSupported for an allowlist (there is no netns to attach it to now).
        InvalidArgument for a bad allowlist."""
        entries = parse_allow_out(network.allow_out if network is not None else [], self.cfg.max_entries)
        if sid not in self._att and not entries:
            return None
        if sid not in self._att:
            raise NotSupported(f"sandbox {sid} was created without a network (no allowlist): its egress cannot be opened while it runs")
        domains = sorted({e.host for e in entries if e.is_domain})
        resolved: dict[str, list[str]] = {}
        if domains:
            res = await asyncio.gather(*(self.resolver.resolve(d) for d in domains))
            resolved = {d: ips[: self.cfg.max_ips_per_domain] for d, ips in zip(domains, res, strict=True)}
        return await self._worker.run(self._w_update, sid, entries, resolved)

    def _w_update(self, sid: str, entries: list[Entry], resolved: dict[str, list[str]]) -> Attachment:
        att = self._att.get(sid)
        if att is None:
            raise NotSupported(f"sandbox {sid} has no network of its own")
        plan = compile_allowlist(entries, resolved, self.deny, self._kernel.host_addrs())
        new = plan.elements(att.ifname)
        old = {k: [e for e in v if e not in new.get(k, [])] for k, v in att.elements.items()}
        if any(new.values()):
            self._rules.add(new)
        if any(old.values()):
            self._rules.remove(sid, att.ifname, old)
        att.elements = new
        return att

    # --- teardown -----------------------------------------------------------------------------
    async def teardown(self, sid: str) -> None:
        """Remove the sandbox's allowlist, netns and veth. Idempotent; never raises for 'already gone'."""
        if self.unavailable and not self._att:
            return
        try:
            await self._worker.run(self._w_teardown, sid)
        except Exception:  # noqa: BLE001 - destroy goes on; recover()/the allocator clean up later
            log.exception("network_teardown_failed", sandbox_id=sid)

    def _w_teardown(self, sid: str) -> None:
        t0 = time.perf_counter()
        self._kernel.init()
        self._kernel.check_root_ns()
        att = self._att.pop(sid, None)
        host_if = att.ifname if att else self.ifname(sid)
        path = att.netns if att else self.netns_path(sid)
        index: int | None = None
        if att is None:  # not ours in memory (a failed create, an orphan): look at the kernel
            index = self._kernel.link_index(host_if)
            if index is None:  # made from the warm pool: a random name, the sandbox id as alias
                for name, idx, alias in self._kernel.links():
                    if alias == sid:
                        host_if, index = name, idx
                        break
            if index is None and not os.path.lexists(path):
                return  # never had a network here
        # 1. the allowlist (fail closed first)
        self._rules.remove(sid, host_if, att.elements if att is not None else None)
        # 2. the netns: once the sandbox's processes are gone the kernel destroys it, and the
        # veth pair with it (asynchronously, batched); the /30 is reused only after that.
        netns.umount(path)
        slot = att.slot if att else None
        if slot is None:
            for ip in self._kernel.addresses(index) if index is not None else []:
                slot = self.slots.slot_of(ip)
        if slot is not None:
            self.slots.release(slot, host_if, owner=sid)
        if att is not None:
            self.stats["teardown_ms"].append((time.perf_counter() - t0) * 1000)

    # --- recovery --------------------------------------------------------------------------------
    async def recover(self, alive: dict[str, dict[str, Any] | None]) -> None:
        """After a restart: ``alive`` maps each still-running sandbox to its saved network extra
        (or None). Re-arms their allowlists and removes every other trace of earlier sandboxes."""
        try:
            await self._worker.run(self._w_recover, alive)
        except CreateFailed as exc:
            log.error("network_recover_failed", error=str(exc))
            return
        if self._started:
            self._warm.kick()

    def _w_recover(self, alive: dict[str, dict[str, Any] | None]) -> None:
        self._kernel.init()
        if not self._started and not any(alive.values()) and not self._reconcile.has_state():
            return
        self._w_ensure_started()
        self._reconcile.recover(alive)
        self._warm.drain()

    # --- tests / dev stacks -------------------------------------------------------------------
    async def purge(self) -> None:
        """Remove everything this config owns from the kernel (table, veths, netns mounts) and put
        ip_forward back if we turned it on and no other dsec table is left. Only with no sandboxes."""
        await self._worker.run(self._w_purge)

    def _w_purge(self) -> None:
        self._kernel.init()
        self._warm.drain()
        self._started = False
        for sid in list(self._att):
            self._w_teardown(sid)
        self._reconcile.purge()
