"""The network manager: owns this host agent's sandbox networks (the /30 pool, netns, veths, the
nft table), a warm pool of pre-made networks, teardown and recovery. Kernel state is touched only
from one worker thread (it switches its own netns with unshare/setns; the rest of the agent never
leaves the host netns); the async methods hand work to it."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import errno
import hashlib
import ipaddress
import json
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import structlog

from bus.errors import CreateFailed, InvalidArgument
from bus.messages import NetworkSpec

from . import netns
from .allowlist import Entry, compile_allowlist, parse_allow_out
from .config import DEFAULT_DENY, IFNAMSIZ, WARM_TAG, NetworkConfig, hosts_of
from .nftables import ALLOW_SETS, Nft, NftError, base_ruleset, elements_cmd, list_elements
from .resolver import Resolver
from .rtnetlink import Rtnl

log = structlog.get_logger("dsec.hostagent.network")

__all__ = ["NetworkManager", "Attachment"]

T = TypeVar("T")


@dataclass
class Attachment:
    """One sandbox's network: what it was given and what must be removed again (JSON-able)."""

    sandbox_id: str
    slot: int
    ifname: str
    ip: str
    gateway: str
    netns: str
    elements: dict[str, list[str]]
    hosts: list[tuple[str, str]] = field(default_factory=list)
    setup_ms: float = 0.0

    def to_extra(self) -> dict[str, Any]:
        return {"slot": self.slot, "ifname": self.ifname, "ip": self.ip, "gateway": self.gateway, "netns": self.netns, "elements": self.elements}

    @classmethod
    def from_extra(cls, sid: str, d: dict[str, Any]) -> "Attachment":
        return cls(sid, int(d["slot"]), d["ifname"], d["ip"], d["gateway"], d["netns"], {k: list(v) for k, v in d.get("elements", {}).items()})


def _ifname(prefix: str, sid: str) -> str:
    digest = hashlib.blake2b(sid.encode(), digest_size=10).digest()
    return prefix + base64.b32encode(digest).decode().lower()[: IFNAMSIZ - len(prefix)]


class NetworkManager:
    """Owns this host agent's sandbox networks: pool, netns, veths, nft table. Kernel state is only
    touched from one worker thread; the async methods hand work to it."""

    def __init__(self, config: NetworkConfig | None = None, *, resolver: Resolver | None = None) -> None:
        self.cfg = config or NetworkConfig()
        self.pool = ipaddress.IPv4Network(self.cfg.pool)
        self.nslots = self.pool.num_addresses // 4
        self.resolver = resolver or Resolver(self.cfg.nameservers, self.cfg.resolve_timeout_s)
        self.unavailable = ""
        self.deny: list[ipaddress.IPv4Network] = [self.pool, *(ipaddress.IPv4Network(d) for d in DEFAULT_DENY)]
        self._started = False
        self._pool_exec: concurrent.futures.ThreadPoolExecutor | None = None
        # --- worker-thread state ---
        self._ipr: Any = None
        self._nl: Rtnl | None = None
        self._nft: Nft | None = None
        self._root_ns_fd = -1
        self._root_ns_ino = 0
        self._att: dict[str, Attachment] = {}
        self._used: dict[int, str] = {}  # slot -> sandbox id
        self._draining: dict[int, tuple[str, float]] = {}  # slot -> (old host ifname, since)
        self._next = 0
        self._host_addrs: tuple[float, set[ipaddress.IPv4Address]] = (0.0, set())
        self._warm: list[Attachment] = []  # pre-made networks, oldest first
        self._warm_seq = 0
        self._refill_task: asyncio.Task[None] | None = None
        # setup_ms: the create path (pool hit or made inline); make_ms: making one network (netns,
        # veth, addresses, routes) wherever it happens; teardown_ms: the destroy path.
        self.stats: dict[str, list[float]] = {"setup_ms": [], "make_ms": [], "teardown_ms": [], "pool_hits": [], "pool_misses": []}

    # --- plumbing ---------------------------------------------------------------------------
    def _exec(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool_exec is None:
            self._pool_exec = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsec-net")
        return self._pool_exec

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._exec(), fn, *args)

    def _w_init(self) -> None:
        if self._ipr is not None:
            return
        from pyroute2 import IPRoute

        self._root_ns_fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        self._root_ns_ino = os.fstat(self._root_ns_fd).st_ino
        self._ipr = IPRoute()
        self._nl = Rtnl()
        self._nft = Nft()

    def _w_check_root_ns(self) -> None:
        if os.stat("/proc/thread-self/ns/net").st_ino != self._root_ns_ino:
            raise RuntimeError("network worker thread is not in the host netns")

    def wanted(self, network: NetworkSpec | None) -> bool:
        return network is not None and bool(network.allow_out)

    def netns_path(self, sid: str) -> str:
        return os.path.join(self.cfg.netns_dir, self.cfg.netns_prefix + sid)

    def ifname(self, sid: str) -> str:
        return _ifname(self.cfg.ifprefix, sid)

    def slot_addrs(self, slot: int) -> tuple[str, str, ipaddress.IPv4Network]:
        base = int(self.pool.network_address) + 4 * slot
        return str(ipaddress.IPv4Address(base + 1)), str(ipaddress.IPv4Address(base + 2)), ipaddress.IPv4Network((base, 30))

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
                for ip in await Resolver((), 2.0).resolve(host):
                    deny.append(ipaddress.IPv4Network(ip))
        self.deny = list(ipaddress.collapse_addresses(deny))
        # The kernel is touched only once a sandbox asks for a network (or there is state to
        # recover): a host that never runs one keeps its ip_forward and ruleset as they were.

    def _w_ensure_started(self) -> None:
        if self._started:
            return
        if self.unavailable:
            raise CreateFailed(f"network isolation is unavailable on this host ({self.unavailable})")
        try:
            self._w_start()
        except Exception as exc:  # tried again by the next sandbox that wants a network
            why = f"{type(exc).__name__}: {exc}"
            log.error("network_unavailable", error=why)
            raise CreateFailed(f"network isolation is unavailable on this host ({why})") from None
        self._started = True

    def _w_has_state(self) -> bool:
        assert self._nft is not None
        try:
            self._nft.run(f"list table inet {self.cfg.table}")
            return True
        except NftError:
            pass
        if any((link.get_attr("IFLA_IFNAME") or "").startswith(self.cfg.ifprefix) for link in self._ipr.get_links()):
            return True
        try:
            return any(n.startswith(self.cfg.netns_prefix) for n in os.listdir(self.cfg.netns_dir))
        except FileNotFoundError:
            return False

    def _w_start(self) -> None:
        self._w_init()
        os.makedirs(self.cfg.netns_dir, mode=0o755, exist_ok=True)
        os.makedirs(self.cfg.state_dir, mode=0o700, exist_ok=True)
        state_path = os.path.join(self.cfg.state_dir, f"net-{self.cfg.table}.json")
        try:
            with open(state_path) as f:
                state = json.load(f)
        except (OSError, ValueError):
            state = {}
        with open("/proc/sys/net/ipv4/ip_forward") as f:
            fwd = f.read().strip()
        if "forward_was" not in state:
            state["forward_was"] = fwd
        if fwd != "1":
            with open("/proc/sys/net/ipv4/ip_forward", "w") as f:
                f.write("1")
        tmp = state_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(state, f)
        os.replace(tmp, state_path)
        guard = state["forward_was"] == "0"  # nobody forwarded before us: forward nothing but sandbox traffic
        self._w_apply_base(guard)
        self._w_learn_slots()

    def _w_apply_base(self, guard: bool) -> None:
        assert self._nft is not None
        text = base_ruleset(self.cfg, self.deny, guard)
        try:
            self._nft.run(text)  # one transaction: rules replaced atomically, set elements kept
        except NftError as exc:
            # An incompatible older table (changed set or chain types): rebuild it from scratch;
            # live sandboxes' elements come back in recover().
            log.warning("nft_table_rebuilt", error=str(exc))
            self._nft.run(f"add table inet {self.cfg.table}\ndelete table inet {self.cfg.table}\n" + text)

    def _w_learn_slots(self) -> None:
        """Which /30s are taken: from the host ends of our veths (the kernel is the record)."""
        for link in self._ipr.get_links():
            name = link.get_attr("IFLA_IFNAME") or ""
            if not name.startswith(self.cfg.ifprefix):
                continue
            for a in self._ipr.get_addr(family=socket.AF_INET, index=link["index"]):
                slot = self._slot_of(a.get_attr("IFA_ADDRESS"))
                if slot is not None:
                    self._draining.setdefault(slot, (name, time.monotonic()))

    def _slot_of(self, ip: str | None) -> int | None:
        if not ip:
            return None
        a = ipaddress.IPv4Address(ip)
        if a not in self.pool:
            return None
        return (int(a) - int(self.pool.network_address)) // 4

    async def stop(self) -> None:
        if self._refill_task is not None:
            self._refill_task.cancel()
            try:
                await self._refill_task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
            self._refill_task = None
        if self._pool_exec is not None:
            try:
                await self._run(self._w_drain_warm)
                await self._run(self._w_close)
            finally:
                self._pool_exec.shutdown(wait=True)
                self._pool_exec = None

    def _w_close(self) -> None:
        if self._ipr is not None:
            self._ipr.close()
            self._ipr = None
        if self._nl is not None:
            self._nl.close()
            self._nl = None
        if self._nft is not None:
            self._nft.close()
            self._nft = None
        if self._root_ns_fd >= 0:
            os.close(self._root_ns_fd)
            self._root_ns_fd = -1

    # --- host addresses ------------------------------------------------------------------------
    def _w_host_addrs(self) -> set[ipaddress.IPv4Address]:
        at, addrs = self._host_addrs
        if time.monotonic() - at > 2.0:
            addrs = {ipaddress.IPv4Address(a.get_attr("IFA_ADDRESS")) for a in self._ipr.get_addr(family=socket.AF_INET)}
            self._host_addrs = (time.monotonic(), addrs)
        return addrs

    # --- setup ------------------------------------------------------------------------------------
    async def setup(self, sid: str, network: NetworkSpec) -> Attachment:
        """Create the sandbox's netns, veth, addresses and allowlist. Raises InvalidArgument for a
        bad allowlist, CreateFailed when the host cannot do it."""
        if self.unavailable:
            raise CreateFailed(f"network isolation is unavailable on this host ({self.unavailable}); sandboxes with a network cannot be created here")
        entries = parse_allow_out(network.allow_out, self.cfg.max_entries)
        domains = sorted({e.host for e in entries if e.is_domain})
        resolved: dict[str, list[str]] = {}
        if domains:
            res = await asyncio.gather(*(self.resolver.resolve(d) for d in domains))
            resolved = {d: ips[: self.cfg.max_ips_per_domain] for d, ips in zip(domains, res, strict=True)}
        try:
            return await self._run(self._w_setup, sid, entries, resolved)
        except (InvalidArgument, CreateFailed):
            raise
        except Exception as exc:  # noqa: BLE001
            log.exception("network_setup_failed", sandbox_id=sid)
            raise CreateFailed(f"cannot set up the sandbox network: {type(exc).__name__}: {exc}") from None
        finally:
            self._kick_refill()

    # --- warm pool ----------------------------------------------------------------------------
    def _kick_refill(self) -> None:
        """Top the pool of pre-made networks up in the background, one network per worker job, so
        a create waits behind at most one of them."""
        if self.cfg.warm_pool <= 0 or (self._refill_task is not None and not self._refill_task.done()):
            return
        self._refill_task = asyncio.get_running_loop().create_task(self._refill())

    async def _refill(self) -> None:
        try:
            while await self._run(self._w_refill_one):
                pass
        except Exception:  # noqa: BLE001 - creates still work (inline); try again next time
            log.exception("warm_pool_refill_failed")

    def _w_refill_one(self) -> bool:
        if not self._started or self.unavailable or len(self._warm) >= self.cfg.warm_pool:
            return False
        self._w_check_root_ns()
        self._warm_seq += 1
        key = f"{WARM_TAG}{self._warm_seq}"
        slot = self._w_alloc(key)
        gw, ip, _ = self.slot_addrs(slot)
        att = Attachment("", slot, self._random_ifname(), ip, gw, self.netns_path(key), {s: [] for s in ALLOW_SETS})
        t0 = time.perf_counter()
        try:
            self._w_make_netns(att, alias=key)
        except BaseException:
            netns.umount(att.netns)
            self._used.pop(slot, None)
            self._draining[slot] = (att.ifname, time.monotonic())
            raise
        self.stats["make_ms"].append((time.perf_counter() - t0) * 1000)
        self._warm.append(att)
        return len(self._warm) < self.cfg.warm_pool

    def _random_ifname(self) -> str:
        return self.cfg.ifprefix + base64.b32encode(os.urandom(10)).decode().lower()[: IFNAMSIZ - len(self.cfg.ifprefix)]

    def _w_adopt(self, att: Attachment, sid: str) -> None:
        """Give a pre-made network to a sandbox: its netns gets the sandbox's name, its veth the
        sandbox id as alias. (A second bind mount, then the old one removed: MS_MOVE is refused
        under shared mount propagation.)"""
        path = self.netns_path(sid)
        netns.mountpoint(path)
        try:
            netns.bind_mount(att.netns, path)
        except OSError:
            os.unlink(path)
            raise
        netns.umount(att.netns)
        att.netns = path
        att.sandbox_id = sid
        self._used[att.slot] = sid
        assert self._nl is not None
        self._nl.call([Rtnl.set_alias_by_name(att.ifname, sid[:255])])

    def _w_drain_warm(self) -> None:
        """Drop the pre-made networks (stop, purge): unmounted, the kernel destroys them."""
        while self._warm:
            att = self._warm.pop()
            netns.umount(att.netns)
            self._used.pop(att.slot, None)
            self._draining[att.slot] = (att.ifname, time.monotonic())

    def _w_alloc(self, sid: str) -> int:
        now = time.monotonic()
        for i in range(self.nslots):
            slot = (self._next + i) % self.nslots
            if slot in self._used:
                continue
            old = self._draining.get(slot)
            if old is not None:
                if self._w_link_exists(old[0]):
                    if now - old[1] < 10.0:
                        continue  # the kernel is still destroying its netns: try the next /30
                    self._w_del_link(old[0])  # kept alive by something else: take it down
                del self._draining[slot]
            self._used[slot] = sid
            self._next = (slot + 1) % self.nslots
            return slot
        raise CreateFailed(f"the sandbox network pool {self.pool} is exhausted")

    def _w_setup(self, sid: str, entries: list[Entry], resolved: dict[str, list[str]]) -> Attachment:
        t0 = time.perf_counter()
        self._w_init()
        self._w_check_root_ns()
        self._w_ensure_started()
        if sid in self._att:
            return self._att[sid]  # redelivered create
        plan = compile_allowlist(entries, resolved, self.deny, self._w_host_addrs())
        warm = self._warm.pop(0) if self._warm else None
        if warm is not None:
            att = warm
            att.elements, att.hosts = plan.elements(att.ifname), plan.hosts
        else:
            slot = self._w_alloc(sid)
            gw, ip, _ = self.slot_addrs(slot)
            host_if = self.ifname(sid)
            att = Attachment(sid, slot, host_if, ip, gw, self.netns_path(sid), plan.elements(host_if), plan.hosts)
            self._att[sid] = att
        try:
            if warm is not None:
                self._w_adopt(att, sid)
                self._att[sid] = att
            else:
                t1 = time.perf_counter()
                self._w_make_netns(att, alias=sid)
                self.stats["make_ms"].append((time.perf_counter() - t1) * 1000)
            assert self._nft is not None
            self._nft.run(elements_cmd(self.cfg.table, "add", att.elements))
        except BaseException:
            if sid in self._att:
                self._w_teardown(sid)
            elif warm is not None:  # failed before the sandbox owned it
                netns.umount(att.netns)
                self._used.pop(att.slot, None)
                self._draining[att.slot] = (att.ifname, time.monotonic())
            raise
        self.stats["pool_hits" if warm is not None else "pool_misses"].append(1.0)
        att.setup_ms = (time.perf_counter() - t0) * 1000
        self.stats["setup_ms"].append(att.setup_ms)
        return att

    def _w_make_netns(self, att: Attachment, alias: str) -> None:
        """netns + veth + addresses + route: 3 netlink round trips, raw (pyroute2 serves the rare
        paths: dumps, recovery, deletes -- its per-call overhead is most of the cost here)."""
        path = att.netns
        netns.mountpoint(path)  # (a leftover of a crashed create of this very sandbox goes first)
        ns_nl: Rtnl | None = None
        try:
            netns.unshare_net()
            try:
                netns.bind_mount("/proc/thread-self/ns/net", path)
                # Inside the new netns: unprivileged ICMP echo sockets (no CAP_NET_RAW needed for
                # ping), no IPv6 anywhere; a netlink socket that stays bound to this netns.
                for key, val in (("ipv4/ping_group_range", "0 2147483647"), ("ipv6/conf/all/disable_ipv6", "1"), ("ipv6/conf/default/disable_ipv6", "1")):
                    with open(f"/proc/sys/net/{key}", "w") as f:
                        f.write(val)
                ns_nl = Rtnl()
            finally:
                err = netns.setns_net(self._root_ns_fd)
                if err:
                    # This thread is stuck in a sandbox's netns: refuse all further network work.
                    self.unavailable = "network worker could not return to the host netns"
                    log.critical("netns_setns_back_failed", errno=err)
            self._w_check_root_ns()
            assert self._nl is not None and ns_nl is not None
            nsfd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                # the host end created up; the sandbox end named eth0, straight in its netns
                self._nl.call([Rtnl.new_veth(att.ifname, "eth0", nsfd)])
            finally:
                os.close(nsfd)
            idx = self._nl.index_of(att.ifname)
            with open(f"/proc/sys/net/ipv6/conf/{att.ifname}/disable_ipv6", "w") as f:
                f.write("1")
            self._nl.call([Rtnl.new_addr(idx, att.gateway, 30), Rtnl.set_alias(idx, alias[:255])])
            eth = ns_nl.index_of("eth0")
            ns_nl.call([Rtnl.set_up(1), Rtnl.set_up(eth), Rtnl.new_addr(eth, att.ip, 30), Rtnl.new_default_route(att.gateway)])  # lo: ifindex 1
        finally:
            if ns_nl is not None:
                ns_nl.close()

    # --- teardown -----------------------------------------------------------------------------
    async def teardown(self, sid: str) -> None:
        """Remove the sandbox's allowlist, netns and veth. Idempotent; never raises for 'already gone'."""
        if self.unavailable and not self._att:
            return
        try:
            await self._run(self._w_teardown, sid)
        except Exception:  # noqa: BLE001 - destroy goes on; recover()/the allocator clean up later
            log.exception("network_teardown_failed", sandbox_id=sid)

    def _w_teardown(self, sid: str) -> None:
        t0 = time.perf_counter()
        self._w_init()
        self._w_check_root_ns()
        att = self._att.pop(sid, None)
        host_if = att.ifname if att else self.ifname(sid)
        path = att.netns if att else self.netns_path(sid)
        link: list[int] = []
        if att is None:  # not ours in memory (a failed create, an orphan): look at the kernel
            link = self._ipr.link_lookup(ifname=host_if)
            if not link:  # made from the warm pool: a random name, the sandbox id as alias
                for other in self._ipr.get_links():
                    if other.get_attr("IFLA_IFALIAS") == sid and (other.get_attr("IFLA_IFNAME") or "").startswith(self.cfg.ifprefix):
                        host_if, link = other.get_attr("IFLA_IFNAME"), [other["index"]]
                        break
            if not link and not os.path.lexists(path):
                return  # never had a network here
        # 1. the allowlist (fail closed first)
        try:
            if att is not None and any(att.elements.values()):
                try:
                    assert self._nft is not None
                    self._nft.run(elements_cmd(self.cfg.table, "delete", att.elements))
                except NftError:
                    self._w_gc_elements(only={host_if})
            elif att is None:
                self._w_gc_elements(only={host_if})
        except NftError as exc:  # no table: no elements
            log.info("nft_elements_gone", sandbox_id=sid, error=str(exc))
        # 2. the netns: once the sandbox's processes are gone the kernel destroys it, and the
        # veth pair with it (asynchronously, batched); the /30 is reused only after that.
        netns.umount(path)
        slot = att.slot if att else None
        if slot is None:
            for a in self._ipr.get_addr(family=socket.AF_INET, index=link[0]) if link else []:
                slot = self._slot_of(a.get_attr("IFA_ADDRESS"))
        if slot is not None:
            if self._used.get(slot) == sid:
                del self._used[slot]
            self._draining[slot] = (host_if, time.monotonic())
        if att is not None:
            self.stats["teardown_ms"].append((time.perf_counter() - t0) * 1000)

    def _w_link_exists(self, name: str) -> bool:
        assert self._nl is not None
        try:
            self._nl.index_of(name)
            return True
        except OSError as exc:
            if exc.errno == errno.ENODEV:
                return False
            raise

    def _w_del_link(self, name: str) -> None:
        try:
            self._ipr.link("del", ifname=name)
        except Exception as exc:  # noqa: BLE001
            if "No such device" not in str(exc):
                log.warning("veth_delete_failed", ifname=name, error=str(exc))

    def _w_gc_elements(self, only: set[str] | None = None, keep: set[str] | None = None) -> int:
        """Delete elements of the given ifnames (``only``), or of every ifname not in ``keep``."""
        assert self._nft is not None
        doomed: dict[str, list[str]] = {}
        for s, els in list_elements(self._nft, self.cfg.table).items():
            for ifn, text in els:
                if (only is not None and ifn in only) or (keep is not None and ifn not in keep):
                    doomed.setdefault(s, []).append(text)
        if doomed:
            self._nft.run(elements_cmd(self.cfg.table, "delete", doomed))
        return sum(len(v) for v in doomed.values())

    # --- recovery --------------------------------------------------------------------------------
    async def recover(self, alive: dict[str, dict[str, Any] | None]) -> None:
        """After a restart: ``alive`` maps each still-running sandbox to its saved network extra
        (or None). Re-arms their allowlists and removes every other trace of earlier sandboxes."""
        try:
            await self._run(self._w_recover, alive)
        except CreateFailed as exc:
            log.error("network_recover_failed", error=str(exc))
            return
        if self._started:
            self._kick_refill()

    def _w_recover(self, alive: dict[str, dict[str, Any] | None]) -> None:
        self._w_init()
        if not self._started and not any(alive.values()) and not self._w_has_state():
            return
        self._w_ensure_started()
        keep_if: set[str] = set()
        readd: dict[str, list[str]] = {}
        for sid, extra in alive.items():
            if not extra:
                continue
            att = Attachment.from_extra(sid, extra)
            if not self._ipr.link_lookup(ifname=att.ifname):
                log.warning("recover_network_lost", sandbox_id=sid)  # fail closed: no veth, no egress
                continue
            self._att[sid] = att
            self._used[att.slot] = sid
            self._draining.pop(att.slot, None)
            keep_if.add(att.ifname)
            for s, els in att.elements.items():
                readd.setdefault(s, []).extend(els)
        if readd:
            assert self._nft is not None
            self._nft.run(elements_cmd(self.cfg.table, "add", readd))  # idempotent; back after a table rebuild
        removed = self._w_gc_elements(keep=keep_if)
        # veths and netns mounts of sandboxes that are gone
        orphans = 0
        for link in self._ipr.get_links():
            name = link.get_attr("IFLA_IFNAME") or ""
            if name.startswith(self.cfg.ifprefix) and name not in keep_if:
                self._w_del_link(name)
                orphans += 1
        live_ns = {a.netns for a in self._att.values()}
        try:
            names = os.listdir(self.cfg.netns_dir)
        except FileNotFoundError:
            names = []
        for n in names:
            p = os.path.join(self.cfg.netns_dir, n)
            if n.startswith(self.cfg.netns_prefix) and p not in live_ns:
                netns.umount(p)
                orphans += 1
        if self._used:
            self._next = (max(self._used) + 1) % self.nslots
        self._w_drain_warm()
        log.info("network_recovered", live=len(self._att), stale_elements=removed, orphans=orphans)

    # --- tests / dev stacks -------------------------------------------------------------------
    async def purge(self) -> None:
        """Remove everything this config owns from the kernel (table, veths, netns mounts) and put
        ip_forward back if we turned it on and no other dsec table is left. Only with no sandboxes."""
        await self._run(self._w_purge)

    def _w_purge(self) -> None:
        self._w_init()
        self._w_drain_warm()
        self._started = False
        assert self._nft is not None
        for sid in list(self._att):
            self._w_teardown(sid)
        try:
            self._nft.run(f"delete table inet {self.cfg.table}")
        except NftError:
            pass
        for link in self._ipr.get_links():
            name = link.get_attr("IFLA_IFNAME") or ""
            if name.startswith(self.cfg.ifprefix):
                self._w_del_link(name)
        for n in os.listdir(self.cfg.netns_dir) if os.path.isdir(self.cfg.netns_dir) else []:
            if n.startswith(self.cfg.netns_prefix):
                netns.umount(os.path.join(self.cfg.netns_dir, n))
        state_path = os.path.join(self.cfg.state_dir, f"net-{self.cfg.table}.json")
        try:
            with open(state_path) as f:
                was = json.load(f).get("forward_was")
            os.unlink(state_path)
        except (OSError, ValueError):
            was = None
        others = [x for x in os.listdir(self.cfg.state_dir) if x.startswith("net-")] if os.path.isdir(self.cfg.state_dir) else []
        if was == "0" and not others:
            with open("/proc/sys/net/ipv4/ip_forward", "w") as f:
                f.write("0")
        self._used.clear()
        self._draining.clear()
