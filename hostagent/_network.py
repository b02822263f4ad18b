"""Per-sandbox network namespaces with a default-deny egress allowlist enforced on the host side.

Only sandboxes created with a non-empty ``network={"allow_out": [...]}`` get a network: a named
netns (``/run/netns/dsec-dsx-<sandbox id>``) with ``lo`` and one veth (``eth0``), a /30 out of a
private pool (default 10.200.0.0/16: host end ``.1``, sandbox end ``.2``, default route via ``.1``,
no IPv6), and masquerade for the egress the allowlist opens. Every other sandbox keeps runc's empty
netns (only loopback): no veth, no address, no rules -- the cheapest and the safest default.

Enforcement lives in the host's network namespace (``table inet dsec``), on the host side of the
veth, where root inside the sandbox (no CAP_NET_ADMIN there, and no way to reach that netns) cannot
change it. The ruleset is static; a sandbox only adds set elements keyed by its host-side veth
name, which the kernel -- not the sandbox -- attaches to each packet::

    input    iifname "dsx*"  -> reject  to_host           (every local address of the host: its
                                                          IPs, 127/8, the veth's own .1 -- NATS,
                                                          the host agent, any host service)
    forward  dsx* -> dsx*    -> reject  between_sandboxes
             dsx* -> *       -> egress
             * -> dsx*       -> replies from its allowlisted peers (+ related ICMP), else drop  inbound
             [neither side a sandbox, and ip_forward was 0 before us -> drop  forward_guard]
    egress   IPv6            -> reject  ipv6
             spoofed source  -> drop    spoofed   (fib saddr . iif: must route back via this veth)
             daddr @deny_net -> reject  denied    (0/8, 127/8, 169.254/16 incl. metadata,
                                                   multicast, 240/4, the pool, control plane)
             iifname . daddr @allow_net                      -> accept
             iifname . daddr . l4proto . dport @allow_port   -> accept  (tcp and udp)
             otherwise       -> reject  not_allowed
    postrouting  dsx* -> not dsx*  -> masquerade

"reject" is a TCP reset for TCP (a blocked connect fails at once with ECONNREFUSED, never rate
limited) and ICMP admin-prohibited otherwise (EHOSTUNREACH). Each has a named counter (the word
after it above), so a test or an audit can tell which rule stopped what.

Every packet a sandbox sends that a rule above refuses (to_host, between_sandboxes, ipv6,
spoofed, denied, not_allowed) is also logged to the NFLOG group ``log_group`` with the prefix
``"dsec-drop <counter name>"`` (``bus.subjects.NFLOG_PREFIX``), by a rule with the same match just
before it; guard listens there and reports the drop for the sandbox whose veth (alias = sandbox
id) the packet came in on. The log rule first passes a per-veth token bucket (the dynamic set
``drop_log``), so a flood logs at most ``log_burst`` packets at once and ``log_rate_per_s`` after
that, per sandbox, and one sandbox's flood cannot hide another's drops; counter ``logged`` counts
what was logged. Inbound drops (packets *to* a sandbox) are not the sandbox's doing: not logged.

Allowlist entries: ``CIDR`` or ``IP`` (every port and protocol), ``host:port`` or ``host:lo-hi``
(TCP and UDP to those ports; host is an IP, CIDR or domain), or ``domain`` (every port). Domains
are resolved by the host agent (the host's resolver, or the ``nameservers`` it is configured
with) when the sandbox is created; the addresses go into the sets and the names into the
sandbox's ``/etc/hosts``, so a lookup inside the sandbox needs no DNS and no sandbox can make an
allowlisted name point anywhere the host did not resolve it to. An entry that can only name
forbidden addresses (inside a deny range, or one of the host's own addresses) fails the create
with ``invalid_argument``; broader entries (``0.0.0.0/0``) are accepted and the kernel still
refuses the forbidden part.

Speed: all kernel work runs in one worker thread (it switches its own netns with unshare/setns;
the rest of the agent never leaves the host netns). The hot path talks raw rtnetlink (3 batched
round trips) and libnftables in-process (one transaction); pyroute2 serves the rare paths (dumps,
recovery, deletes). A small warm pool of pre-made networks (netns + veth + addresses + routes)
takes even that off the create path: a create adopts one (a bind mount, an alias, the set
elements) and the pool refills in the background, one network per worker job. Teardown deletes
the set elements and unmounts the netns; the kernel destroys the veth pair with the netns once
the sandbox's last process is gone (batched, asynchronous), so a /30 is reused only once its old
veth is gone (next-fit allocation makes that the rare case anyway).

Recovery: the kernel is the record. The base ruleset is (re)applied in one transaction that keeps
set elements; after the containers are recovered, the elements of live sandboxes are re-added
(idempotent) and everything of this agent's that belongs to no live sandbox (veths, netns mounts,
set elements, pre-made networks) is removed. Slots are re-learned from the host ends' addresses.
Nothing in the kernel is touched until a sandbox asks for a network (or there is state to recover).
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import ctypes
import ctypes.util
import errno
import hashlib
import ipaddress
import json
import os
import random
import re
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, TypeVar

import structlog

from bus import subjects as S
from bus.errors import CreateFailed, InvalidArgument
from bus.messages import NetworkSpec

log = structlog.get_logger("dsec.hostagent.network")

__all__ = [
    "NetworkConfig",
    "NetworkManager",
    "Attachment",
    "AllowPlan",
    "parse_allow_out",
    "compile_allowlist",
    "Resolver",
    "write_hosts_file",
    "DEFAULT_DENY",
    "COUNTERS",
]

T = TypeVar("T")

# Never reachable from a sandbox, whatever its allowlist (the pool and control plane are added).
DEFAULT_DENY: tuple[str, ...] = (
    "0.0.0.0/8",  # "this network"
    "127.0.0.0/8",  # loopback (the host's, should a packet ever get there)
    "169.254.0.0/16",  # link-local, cloud metadata services (169.254.169.254)
    "224.0.0.0/4",  # multicast
    "240.0.0.0/4",  # reserved + limited broadcast
)
COUNTERS: tuple[str, ...] = ("to_host", "between_sandboxes", "inbound", "ipv6", "spoofed", "denied", "not_allowed", "forward_guard", "logged")
FAMILY_PREFIX = "ds"  # every dsec instance's veth names start with this (the forwarding guard keys on it)
IFNAMSIZ = 15
MAX_PORT = 65535

_CLONE_NEWNET = 0x40000000
_MS_BIND = 4096
WARM_TAG = "@warm-"  # netns file names of pre-made networks (never a sandbox id: '@' is not allowed there)
_MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)
_DOMAIN_RE = re.compile(r"^(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*\.?$")


# ----------------------------------------------------------------------------- config
@dataclass(frozen=True)
class NetworkConfig:
    """Where sandbox networks come from and what they may never reach.

    ``table``/``ifprefix``/``netns_prefix``/``pool`` name everything this host agent owns in the
    kernel; two agents on one machine (tests) must use different ones, and neither ``ifprefix``
    may be a prefix of the other (the rules match veth names by prefix; recovery removes what
    carries its prefix and belongs to no live sandbox). ``netns_prefix`` defaults to
    ``dsec-<ifprefix>-``, which keeps the netns names of such agents apart as well. ``deny_out`` adds
    never-reachable CIDRs (the control plane's addresses: NATS servers, object store, other hosts);
    ``control_plane`` adds host names or URLs resolved at start for the same purpose.
    ``nameservers`` (``ip`` or ``ip:port``): the resolver for allowlisted domains; empty means the
    host's own resolver (getaddrinfo).
    """

    pool: str = "10.200.0.0/16"
    table: str = "dsec"
    ifprefix: str = "dsx"
    netns_dir: str = "/run/netns"
    netns_prefix: str = ""  # default: f"dsec-{ifprefix}-"
    deny_out: tuple[str, ...] = ()
    control_plane: tuple[str, ...] = ()
    nameservers: tuple[str, ...] = ()
    max_entries: int = 64
    max_ips_per_domain: int = 16
    resolve_timeout_s: float = 3.0
    state_dir: str = "/run/dsec"
    warm_pool: int = 8  # networks made ahead of time (netns + veth + addresses), off the create path
    log_group: int = S.NFLOG_GROUP  # NFLOG group guard reads dropped packets from; -1: do not log drops
    log_rate_per_s: int = 10  # per sandbox, after the burst
    log_burst: int = 20

    def __post_init__(self) -> None:
        pool = ipaddress.ip_network(self.pool)
        if not isinstance(pool, ipaddress.IPv4Network) or pool.prefixlen > 30:
            raise ValueError(f"network pool must be an IPv4 network of /30 or larger, got {self.pool!r}")
        if not re.fullmatch(r"[a-z][a-z0-9]{1,5}", self.ifprefix) or not self.ifprefix.startswith(FAMILY_PREFIX):
            raise ValueError(f"ifprefix must be 2-6 of [a-z0-9] starting with {FAMILY_PREFIX!r}, got {self.ifprefix!r}")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,31}", self.table):
            raise ValueError(f"bad nft table name {self.table!r}")
        if not self.netns_prefix:
            object.__setattr__(self, "netns_prefix", f"dsec-{self.ifprefix}-")
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}-", self.netns_prefix):
            raise ValueError(f"netns_prefix must be 1-64 of [A-Za-z0-9_.-] ending in '-', got {self.netns_prefix!r}")
        for d in self.deny_out:
            ipaddress.IPv4Network(d, strict=False)
        if not -1 <= self.log_group <= 0xFFFF or self.log_rate_per_s < 1 or self.log_burst < 1:
            raise ValueError(f"log_group must be -1..65535 and log_rate_per_s, log_burst >= 1, got {self.log_group}, {self.log_rate_per_s}, {self.log_burst}")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "NetworkConfig":
        """DSEC_NET_POOL, DSEC_NET_DENY (comma-separated CIDRs), DSEC_NET_NAMESERVERS, DSEC_NFLOG_GROUP; the servers of
        DSEC_NATS_URL are added to the control plane (so they are never reachable from a sandbox)."""
        e = os.environ if env is None else env
        split = lambda k: tuple(x.strip() for x in e.get(k, "").split(",") if x.strip())  # noqa: E731
        kw: dict[str, Any] = {"deny_out": split("DSEC_NET_DENY"), "nameservers": split("DSEC_NET_NAMESERVERS"), "control_plane": split("DSEC_NATS_URL")}
        if e.get("DSEC_NET_POOL"):
            kw["pool"] = e["DSEC_NET_POOL"]
        if e.get("DSEC_NFLOG_GROUP"):
            kw["log_group"] = int(e["DSEC_NFLOG_GROUP"])
        return cls(**kw)


# ----------------------------------------------------------------------------- allowlist
@dataclass(frozen=True)
class Entry:
    raw: str
    host: str  # IP/CIDR text or a domain
    is_domain: bool
    ports: tuple[int, int] | None  # None: all ports and protocols


def parse_allow_out(entries: Iterable[str], max_entries: int = 64) -> list[Entry]:
    """Syntax check of ``allow_out``; raises InvalidArgument naming the bad entry."""
    out: list[Entry] = []
    entries = list(entries)
    if len(entries) > max_entries:
        raise InvalidArgument(f"network allow_out has {len(entries)} entries; at most {max_entries}")
    for raw in entries:
        if not isinstance(raw, str) or not raw.strip():
            raise InvalidArgument(f"allow_out entries must be non-empty strings, got {raw!r}")
        s = raw.strip().lower()
        if s.startswith("[") or s.count(":") > 1:
            raise InvalidArgument(f"allow_out entry {raw!r}: IPv6 is not supported (sandboxes have no IPv6 egress)")
        ports: tuple[int, int] | None = None
        host = s
        if ":" in s:
            host, p = s.rsplit(":", 1)
            m = re.fullmatch(r"(\d{1,5})(?:-(\d{1,5}))?", p)
            if not m:
                raise InvalidArgument(f"allow_out entry {raw!r}: port must be N or N-M, got {p!r}")
            lo = int(m.group(1))
            hi = int(m.group(2) or lo)
            if not (1 <= lo <= hi <= MAX_PORT):
                raise InvalidArgument(f"allow_out entry {raw!r}: ports must satisfy 1 <= lo <= hi <= 65535")
            ports = (lo, hi)
        try:
            net = ipaddress.ip_network(host, strict=False)
        except ValueError:
            net = None
        if net is not None:
            if net.version != 4:
                raise InvalidArgument(f"allow_out entry {raw!r}: IPv6 is not supported")
            out.append(Entry(raw, str(net), False, ports))
            continue
        if "/" in host or re.fullmatch(r"[\d.]+", host):
            raise InvalidArgument(f"allow_out entry {raw!r} is not a valid IPv4 address or CIDR")
        if host.startswith("*"):
            raise InvalidArgument(f"allow_out entry {raw!r}: wildcard domains are not supported; name each host")
        if not _DOMAIN_RE.match(host) or "." not in host.rstrip("."):
            raise InvalidArgument(f"allow_out entry {raw!r} is neither a CIDR, host:port nor a domain name")
        out.append(Entry(raw, host.rstrip("."), True, ports))
    return out


@dataclass
class AllowPlan:
    nets: list[ipaddress.IPv4Network] = field(default_factory=list)  # every port/protocol
    ports: list[tuple[ipaddress.IPv4Network, int, int]] = field(default_factory=list)  # tcp+udp lo..hi
    hosts: list[tuple[str, str]] = field(default_factory=list)  # (ip, name) for /etc/hosts

    def elements(self, ifname: str) -> dict[str, list[str]]:
        n = [f'"{ifname}" . {_net_str(x)}' for x in self.nets]
        p = []
        for net, lo, hi in self.ports:
            pr = str(lo) if lo == hi else f"{lo}-{hi}"
            for proto in ("tcp", "udp"):
                p.append(f'"{ifname}" . {_net_str(net)} . {proto} . {pr}')
        return {"allow_net": n, "allow_port": p}


def _net_str(n: ipaddress.IPv4Network) -> str:
    return str(n.network_address) if n.prefixlen == 32 else str(n)


def _forbidden(net: ipaddress.IPv4Network, deny: list[ipaddress.IPv4Network], host_addrs: set[ipaddress.IPv4Address]) -> str:
    for d in deny:
        if net.subnet_of(d):
            return f"inside {d}"
    if net.num_addresses == 1 and net.network_address in host_addrs:
        return "an address of this host"
    return ""


def compile_allowlist(
    entries: list[Entry],
    resolved: dict[str, list[str]],
    deny: list[ipaddress.IPv4Network],
    host_addrs: set[ipaddress.IPv4Address],
) -> AllowPlan:
    """Entries (+ resolved domains) to disjoint set elements. Raises InvalidArgument for entries
    that could only ever name forbidden addresses."""
    plan = AllowPlan()
    all_nets: list[ipaddress.IPv4Network] = []
    port_rules: list[tuple[ipaddress.IPv4Network, int, int]] = []
    seen_hosts: set[tuple[str, str]] = set()
    for e in entries:
        if e.is_domain:
            nets = []
            for ip in resolved.get(e.host, []):
                n = ipaddress.IPv4Network(ip)
                why = _forbidden(n, deny, host_addrs)
                if why:
                    log.warning("allowlist_domain_address_dropped", domain=e.host, ip=ip, why=why)
                    continue
                nets.append(n)
                if (ip, e.host) not in seen_hosts:
                    seen_hosts.add((ip, e.host))
                    plan.hosts.append((ip, e.host))
            if not nets:
                if resolved.get(e.host):
                    raise InvalidArgument(f"allow_out entry {e.raw!r}: {e.host} resolves only to addresses a sandbox may never reach")
                raise InvalidArgument(f"allow_out entry {e.raw!r}: cannot resolve {e.host}")
        else:
            n = ipaddress.IPv4Network(e.host)
            why = _forbidden(n, deny, host_addrs)
            if why:
                raise InvalidArgument(
                    f"allow_out entry {e.raw!r} is never reachable from a sandbox ({why}): the host, the control plane and other sandboxes are off limits"
                )
            nets = [n]
        if e.ports is None:
            all_nets.extend(nets)
        else:
            port_rules.extend((n, e.ports[0], e.ports[1]) for n in nets)
    plan.nets = list(ipaddress.collapse_addresses(all_nets))
    # Port rules as disjoint rectangles (the kernel's interval sets refuse overlapping elements):
    # cut the port axis at every boundary, collapse the networks of each piece, drop what the
    # all-ports networks already cover, then merge adjacent pieces with identical networks.
    if port_rules:
        cuts = sorted({lo for _, lo, _ in port_rules} | {hi + 1 for _, _, hi in port_rules})
        pieces: list[tuple[int, int, tuple[ipaddress.IPv4Network, ...]]] = []
        for a, b in zip(cuts, cuts[1:]):
            nets = [n for n, lo, hi in port_rules if lo <= a and b - 1 <= hi]
            nets = [n for n in ipaddress.collapse_addresses(nets) if not any(n.subnet_of(m) for m in plan.nets)]
            if not nets:
                continue
            key = tuple(nets)
            if pieces and pieces[-1][1] == a - 1 and pieces[-1][2] == key:
                pieces[-1] = (pieces[-1][0], b - 1, key)
            else:
                pieces.append((a, b - 1, key))
        for lo, hi, nets in pieces:
            plan.ports.extend((n, lo, hi) for n in nets)
    return plan


def write_hosts_file(upper: str, lowers: list[str], hosts: list[tuple[str, str]]) -> None:
    """Put the host-resolved names into the sandbox's /etc/hosts (the overlay's upper dir, before
    the sandbox starts). ``lowers``: the image layers, top first."""
    base = "127.0.0.1\tlocalhost\n"
    for lower in lowers:
        p = os.path.join(lower, "etc", "hosts")
        if os.path.isfile(p) and not os.path.islink(p):
            with open(p) as f:
                base = f.read()
            break
    if base and not base.endswith("\n"):
        base += "\n"
    etc = os.path.join(upper, "etc")
    os.makedirs(etc, mode=0o755, exist_ok=True)
    lines = "".join(f"{ip}\t{name}\n" for ip, name in hosts)
    tmp = os.path.join(etc, ".hosts.dsec")
    with open(tmp, "w") as f:
        f.write(base + "# allowlisted names, resolved by the dsec host agent\n" + lines)
    os.chmod(tmp, 0o644)
    os.replace(tmp, os.path.join(etc, "hosts"))


# ----------------------------------------------------------------------------- resolver
class Resolver:
    """A-record lookups for allowlisted domains, done by the host agent (never by the sandbox).

    With ``nameservers`` it asks those servers directly over UDP (a minimal stub resolver, no
    search domains); otherwise it uses the host's own resolver (getaddrinfo).
    """

    def __init__(self, nameservers: Iterable[str] = (), timeout_s: float = 3.0) -> None:
        self.servers: list[tuple[str, int]] = []
        for ns in nameservers:
            host, _, port = ns.partition(":")
            ipaddress.IPv4Address(host)
            self.servers.append((host, int(port or 53)))
        self.timeout_s = timeout_s

    async def resolve(self, name: str) -> list[str]:
        if not self.servers:
            loop = asyncio.get_running_loop()
            try:
                infos = await asyncio.wait_for(loop.getaddrinfo(name, None, family=socket.AF_INET, type=socket.SOCK_STREAM), self.timeout_s)
            except (OSError, asyncio.TimeoutError):
                return []
            return list(dict.fromkeys(i[4][0] for i in infos))
        per_try = max(0.2, self.timeout_s / len(self.servers))
        for server in self.servers:
            try:
                return await asyncio.wait_for(self._query(server, name), per_try)
            except (OSError, asyncio.TimeoutError, ValueError) as exc:
                log.info("dns_query_failed", server=f"{server[0]}:{server[1]}", name=name, error=str(exc) or type(exc).__name__)
        return []

    async def _query(self, server: tuple[str, int], name: str) -> list[str]:
        loop = asyncio.get_running_loop()
        qid = random.getrandbits(16)
        fut: asyncio.Future[bytes] = loop.create_future()

        class _P(asyncio.DatagramProtocol):
            def datagram_received(self, data: bytes, addr: Any) -> None:
                if len(data) >= 2 and struct.unpack("!H", data[:2])[0] == qid and not fut.done():
                    fut.set_result(data)

            def error_received(self, exc: Exception) -> None:
                if not fut.done():
                    fut.set_exception(exc)

        transport, _ = await loop.create_datagram_endpoint(_P, remote_addr=server, family=socket.AF_INET)
        try:
            transport.sendto(_dns_query(name, qid))
            return _dns_answers(await fut, name)
        finally:
            transport.close()


def _dns_query(name: str, qid: int) -> bytes:
    q = b"".join(bytes([len(label)]) + label.encode("ascii") for label in name.rstrip(".").split(".")) + b"\0"
    return struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + q + struct.pack("!HH", 1, 1)


def _dns_name(data: bytes, off: int) -> tuple[str, int]:
    labels: list[str] = []
    end = -1
    for _ in range(128):
        n = data[off]
        if n & 0xC0 == 0xC0:
            if end < 0:
                end = off + 2
            off = ((n & 0x3F) << 8) | data[off + 1]
            continue
        if n == 0:
            return ".".join(labels).lower(), (end if end >= 0 else off + 1)
        labels.append(data[off + 1 : off + 1 + n].decode("ascii", "replace"))
        off += 1 + n
    raise ValueError("DNS name too long or looping")


def _dns_answers(data: bytes, qname: str) -> list[str]:
    _, flags, qd, an, _, _ = struct.unpack("!HHHHHH", data[:12])
    rcode = flags & 0xF
    if rcode == 3:
        return []
    if rcode != 0:
        raise ValueError(f"DNS rcode {rcode}")
    off = 12
    for _ in range(qd):
        _, off = _dns_name(data, off)
        off += 4
    records: list[tuple[str, int, bytes, int]] = []
    for _ in range(an):
        owner, off = _dns_name(data, off)
        rtype, _, _, rdlen = struct.unpack("!HHIH", data[off : off + 10])
        off += 10
        records.append((owner, rtype, data[off : off + rdlen], off))
        off += rdlen
    chain = {qname.rstrip(".").lower()}
    for _ in range(8):  # follow CNAMEs inside the answer
        for owner, rtype, _rd, roff in records:
            if rtype == 5 and owner in chain:
                chain.add(_dns_name(data, roff)[0])
    return list(dict.fromkeys(socket.inet_ntoa(rd) for owner, rtype, rd, _ in records if rtype == 1 and owner in chain and len(rd) == 4))


# ----------------------------------------------------------------------------- nftables
class Nft:
    """libnftables in-process (no fork/exec per sandbox). Not thread-safe: one owner thread."""

    _OUTPUT_JSON = 1 << 4

    def __init__(self) -> None:
        path = ctypes.util.find_library("nftables") or "libnftables.so.1"
        lib = ctypes.CDLL(path)
        lib.nft_ctx_new.restype = ctypes.c_void_p
        lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
        lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
        lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_output_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_output_buffer.restype = ctypes.c_char_p
        lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
        lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        self._lib = lib
        self._ctx = self._new(0)
        self._jctx = self._new(self._OUTPUT_JSON)

    def _new(self, flags: int) -> int:
        ctx = self._lib.nft_ctx_new(0)
        if not ctx:
            raise OSError("nft_ctx_new failed")
        self._lib.nft_ctx_buffer_output(ctx)
        self._lib.nft_ctx_buffer_error(ctx)
        if flags:
            self._lib.nft_ctx_output_set_flags(ctx, flags)
        return ctx

    def run(self, cmd: str, *, json_out: bool = False) -> str:
        ctx = self._jctx if json_out else self._ctx
        rc = self._lib.nft_run_cmd_from_buffer(ctx, cmd.encode())
        out = (self._lib.nft_ctx_get_output_buffer(ctx) or b"").decode()
        err = (self._lib.nft_ctx_get_error_buffer(ctx) or b"").decode()
        if rc != 0:
            raise NftError(err.strip() or f"nft failed (rc={rc})")
        return out

    def close(self) -> None:
        for ctx in (self._ctx, self._jctx):
            if ctx:
                self._lib.nft_ctx_free(ctx)
        self._ctx = self._jctx = 0


class NftError(RuntimeError):
    pass



# ----------------------------------------------------------------------------- rtnetlink (hot path)
class Rtnl:
    """The few rtnetlink requests a sandbox network needs, batched: several messages per send,
    one ack each. A socket is bound to the netns it was created in."""

    _NEWLINK, _GETLINK, _NEWADDR, _NEWROUTE = 16, 18, 20, 24
    _REQ, _ACK, _EXCL, _CREATE = 0x1, 0x4, 0x200, 0x400
    _IFF_UP = 0x1
    _IFLA_IFNAME, _IFLA_IFALIAS, _IFLA_LINKINFO, _IFLA_NET_NS_FD = 3, 20, 18, 28
    _IFLA_INFO_KIND, _IFLA_INFO_DATA, _VETH_INFO_PEER = 1, 2, 1
    _IFA_ADDRESS, _IFA_LOCAL = 1, 2
    _RTA_GATEWAY = 5

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, 0)  # NETLINK_ROUTE
        self.sock.bind((0, 0))
        self.seq = 0

    def close(self) -> None:
        self.sock.close()

    @staticmethod
    def _attr(kind: int, data: bytes) -> bytes:
        n = 4 + len(data)
        return struct.pack("=HH", n, kind) + data + b"\0" * ((4 - n % 4) % 4)

    @staticmethod
    def _ifinfo(index: int = 0, up: bool = False) -> bytes:
        f = Rtnl._IFF_UP if up else 0
        return struct.pack("=BxHiII", 0, 0, index, f, f)

    @classmethod
    def new_veth(cls, name: str, peer: str, peer_netns_fd: int) -> tuple[int, int, bytes]:
        a = cls._attr
        # (the peer cannot be created up: a veth end opens only once its peer is registered)
        peer_msg = cls._ifinfo() + a(cls._IFLA_IFNAME, peer.encode() + b"\0") + a(cls._IFLA_NET_NS_FD, struct.pack("=I", peer_netns_fd))
        info = a(cls._IFLA_INFO_KIND, b"veth\0") + a(cls._IFLA_INFO_DATA, a(cls._VETH_INFO_PEER, peer_msg))
        return cls._NEWLINK, cls._CREATE | cls._EXCL, cls._ifinfo(up=True) + a(cls._IFLA_IFNAME, name.encode() + b"\0") + a(cls._IFLA_LINKINFO, info)

    @classmethod
    def set_up(cls, index: int) -> tuple[int, int, bytes]:
        return cls._NEWLINK, 0, cls._ifinfo(index, up=True)

    @classmethod
    def set_alias(cls, index: int, alias: str) -> tuple[int, int, bytes]:
        return cls._NEWLINK, 0, cls._ifinfo(index) + cls._attr(cls._IFLA_IFALIAS, alias.encode())

    @classmethod
    def set_alias_by_name(cls, name: str, alias: str) -> tuple[int, int, bytes]:
        return cls._NEWLINK, 0, cls._ifinfo() + cls._attr(cls._IFLA_IFNAME, name.encode() + b"\0") + cls._attr(cls._IFLA_IFALIAS, alias.encode())

    @classmethod
    def new_addr(cls, index: int, ip: str, prefixlen: int) -> tuple[int, int, bytes]:
        raw = socket.inet_aton(ip)
        body = struct.pack("=BBBBI", socket.AF_INET, prefixlen, 0, 0, index) + cls._attr(cls._IFA_LOCAL, raw) + cls._attr(cls._IFA_ADDRESS, raw)
        return cls._NEWADDR, cls._CREATE | cls._EXCL, body

    @classmethod
    def new_default_route(cls, gateway: str) -> tuple[int, int, bytes]:
        # main table, static, universe scope, unicast
        body = struct.pack("=BBBBBBBBI", socket.AF_INET, 0, 0, 0, 254, 4, 0, 1, 0) + cls._attr(cls._RTA_GATEWAY, socket.inet_aton(gateway))
        return cls._NEWROUTE, cls._CREATE | cls._EXCL, body

    def call(self, msgs: list[tuple[int, int, bytes]]) -> None:
        """Send all messages in one datagram; wait for every ack; raise the first error."""
        buf = bytearray()
        seqs = []
        for kind, flags, body in msgs:
            self.seq += 1
            seqs.append(self.seq)
            buf += struct.pack("=IHHII", 16 + len(body), kind, self._REQ | self._ACK | flags, self.seq, 0) + body
        self.sock.sendto(bytes(buf), (0, 0))
        pending = set(seqs)
        err = 0
        while pending:
            for mtype, seq, payload in self._recv():
                if mtype == 2 and seq in pending:  # NLMSG_ERROR (0 = ack)
                    pending.discard(seq)
                    code = -struct.unpack("=i", payload[:4])[0]
                    if code and not err:
                        err = code
        if err:
            raise OSError(err, f"rtnetlink: {os.strerror(err)}")

    def index_of(self, name: str) -> int:
        self.seq += 1
        body = self._ifinfo() + self._attr(self._IFLA_IFNAME, name.encode() + b"\0")
        self.sock.sendto(struct.pack("=IHHII", 16 + len(body), self._GETLINK, self._REQ, self.seq, 0) + body, (0, 0))
        while True:
            for mtype, seq, payload in self._recv():
                if seq != self.seq:
                    continue
                if mtype == 2:
                    code = -struct.unpack("=i", payload[:4])[0]
                    raise OSError(code, f"rtnetlink: no link {name!r}: {os.strerror(code)}")
                if mtype == self._NEWLINK:
                    return struct.unpack("=BxHiII", payload[:16])[2]

    def _recv(self) -> list[tuple[int, int, bytes]]:
        data = self.sock.recv(65536)
        out = []
        off = 0
        while off + 16 <= len(data):
            n, mtype, _flags, seq, _pid = struct.unpack("=IHHII", data[off : off + 16])
            out.append((mtype, seq, data[off + 16 : off + n]))
            off += (n + 3) & ~3
        return out

# ----------------------------------------------------------------------------- attachment
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


# ----------------------------------------------------------------------------- manager
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
            for host in _hosts_of(cp):
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
        if any((l.get_attr("IFLA_IFNAME") or "").startswith(self.cfg.ifprefix) for l in self._ipr.get_links()):
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

    def _base_ruleset(self, guard: bool) -> str:
        t = f"inet {self.cfg.table}"
        p = f'"{self.cfg.ifprefix}*"'
        # TCP gets a reset (never rate-limited: a blocked connect fails at once, ECONNREFUSED);
        # the rest ICMP admin-prohibited (EHOSTUNREACH; the kernel rate-limits these per peer).
        rej = "reject with icmpx admin-prohibited"
        deny = ", ".join(str(n) for n in self.deny)

        def logged(chain: str, match: str, counter: str) -> list[str]:
            if self.cfg.log_group < 0:
                return []
            m = f"{match} " if match else ""
            bucket = f"update @drop_log {{ iifname limit rate {self.cfg.log_rate_per_s}/second burst {self.cfg.log_burst} packets }}"
            return [
                f'add rule {t} {chain} {m}{bucket} counter name "logged" '
                f'log prefix "{S.NFLOG_PREFIX} {counter}" group {self.cfg.log_group} snaplen 96'
            ]

        def reject(chain: str, match: str, counter: str) -> list[str]:
            m = f"{match} " if match else ""
            return [
                *logged(chain, match, counter),
                f'add rule {t} {chain} {m}meta l4proto tcp counter name "{counter}" reject with tcp reset',
                f'add rule {t} {chain} {m}counter name "{counter}" {rej}',
            ]

        lines = [
            f"add table {t}",
            f"add set {t} deny_net {{ type ipv4_addr; flags interval; auto-merge; }}",
            f"add set {t} allow_net {{ type ifname . ipv4_addr; flags interval; }}",
            f"add set {t} allow_port {{ type ifname . ipv4_addr . inet_proto . inet_service; flags interval; }}",
            # one token bucket per sandbox veth for the drop log; idle ones expire
            f"add set {t} drop_log {{ type ifname; flags dynamic,timeout; timeout 60s; size 65536; }}",
            *(f"add counter {t} {c}" for c in COUNTERS),
            f"add chain {t} sbx_input {{ type filter hook input priority filter - 10; policy accept; }}",
            f"add chain {t} sbx_forward {{ type filter hook forward priority filter - 10; policy accept; }}",
            f"add chain {t} sbx_egress",
            f"add chain {t} sbx_nat {{ type nat hook postrouting priority srcnat; policy accept; }}",
            f"flush set {t} deny_net",
            f"add element {t} deny_net {{ {deny} }}",
            *(f"flush chain {t} {c}" for c in ("sbx_input", "sbx_forward", "sbx_egress", "sbx_nat")),
            # The host itself: any local address (its IPs, 127/8, the veth's own .1) -- services,
            # NATS, the host agent. Nothing from a sandbox is delivered locally.
            *reject("sbx_input", f"iifname {p}", "to_host"),
            *reject("sbx_forward", f"iifname {p} oifname {p}", "between_sandboxes"),
            f"add rule {t} sbx_forward iifname {p} jump sbx_egress",
            # Into a sandbox: only replies, and only from what *its* allowlist names (a /30 is
            # reused after its old owner is gone; a stale conntrack entry must not let the old
            # owner's peers in), plus ICMP errors about its own flows (path MTU).
            f"add rule {t} sbx_forward oifname {p} ct state established,related oifname . ip saddr @allow_net accept",
            f"add rule {t} sbx_forward oifname {p} ct state established,related meta l4proto {{ tcp, udp }} oifname . ip saddr . meta l4proto . th sport @allow_port accept",
            f"add rule {t} sbx_forward oifname {p} ct state related meta l4proto icmp accept",
            f'add rule {t} sbx_forward oifname {p} counter name "inbound" drop',
            *logged("sbx_egress", "meta nfproto ipv6", "ipv6"),
            f'add rule {t} sbx_egress meta nfproto ipv6 counter name "ipv6" {rej}',
            *logged("sbx_egress", "fib saddr . iif oif missing", "spoofed"),
            f'add rule {t} sbx_egress fib saddr . iif oif missing counter name "spoofed" drop',
            *reject("sbx_egress", "ip daddr @deny_net", "denied"),
            # no "established" shortcut: every packet out is checked against this veth's elements
            f"add rule {t} sbx_egress iifname . ip daddr @allow_net accept",
            f"add rule {t} sbx_egress meta l4proto {{ tcp, udp }} iifname . ip daddr . meta l4proto . th dport @allow_port accept",
            *reject("sbx_egress", "", "not_allowed"),
            f"add rule {t} sbx_nat iifname {p} oifname != {p} masquerade",
        ]
        if guard:
            fam = f'"{FAMILY_PREFIX}*"'
            lines.append(f'add rule {t} sbx_forward iifname != {fam} oifname != {fam} counter name "forward_guard" drop')
        return "\n".join(lines) + "\n"

    def _w_apply_base(self, guard: bool) -> None:
        assert self._nft is not None
        text = self._base_ruleset(guard)
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
            resolved = {d: ips[: self.cfg.max_ips_per_domain] for d, ips in zip(domains, res)}
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
        att = Attachment("", slot, self._random_ifname(), ip, gw, self.netns_path(key), {"allow_net": [], "allow_port": []})
        t0 = time.perf_counter()
        try:
            self._w_make_netns(att, alias=key)
        except BaseException:
            self._w_umount(att.netns)
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
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0)
        except FileExistsError:
            self._w_umount(path)
            fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0)
        os.close(fd)
        if _libc.mount(att.netns.encode(), path.encode(), None, _MS_BIND, None) != 0:
            e = ctypes.get_errno()
            os.unlink(path)
            raise OSError(e, f"bind-mount netns at {path}: {os.strerror(e)}")
        self._w_umount(att.netns)
        att.netns = path
        att.sandbox_id = sid
        self._used[att.slot] = sid
        assert self._nl is not None
        self._nl.call([Rtnl.set_alias_by_name(att.ifname, sid[:255])])

    def _w_drain_warm(self) -> None:
        """Drop the pre-made networks (stop, purge): unmounted, the kernel destroys them."""
        while self._warm:
            att = self._warm.pop()
            self._w_umount(att.netns)
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
            self._nft.run(self._elements_cmd("add", att.elements))
        except BaseException:
            if sid in self._att:
                self._w_teardown(sid)
            elif warm is not None:  # failed before the sandbox owned it
                self._w_umount(att.netns)
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
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0)
        except FileExistsError:
            self._w_umount(path)  # leftover of a crashed create of this very sandbox
            fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0)
        os.close(fd)
        ns_nl: Rtnl | None = None
        try:
            if _libc.unshare(_CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"unshare(CLONE_NEWNET): {os.strerror(ctypes.get_errno())}")
            try:
                if _libc.mount(b"/proc/thread-self/ns/net", path.encode(), None, _MS_BIND, None) != 0:
                    e = ctypes.get_errno()
                    raise OSError(e, f"bind-mount netns at {path}: {os.strerror(e)}")
                # Inside the new netns: unprivileged ICMP echo sockets (no CAP_NET_RAW needed for
                # ping), no IPv6 anywhere; a netlink socket that stays bound to this netns.
                for key, val in (("ipv4/ping_group_range", "0 2147483647"), ("ipv6/conf/all/disable_ipv6", "1"), ("ipv6/conf/default/disable_ipv6", "1")):
                    with open(f"/proc/sys/net/{key}", "w") as f:
                        f.write(val)
                ns_nl = Rtnl()
            finally:
                if _libc.setns(self._root_ns_fd, _CLONE_NEWNET) != 0:
                    # This thread is stuck in a sandbox's netns: refuse all further network work.
                    self.unavailable = "network worker could not return to the host netns"
                    log.critical("netns_setns_back_failed", errno=ctypes.get_errno())
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

    def _elements_cmd(self, verb: str, elements: dict[str, list[str]]) -> str:
        t = f"inet {self.cfg.table}"
        return "".join(f"{verb} element {t} {s} {{ {', '.join(els)} }}\n" for s, els in elements.items() if els)

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
                for l in self._ipr.get_links():
                    if l.get_attr("IFLA_IFALIAS") == sid and (l.get_attr("IFLA_IFNAME") or "").startswith(self.cfg.ifprefix):
                        host_if, link = l.get_attr("IFLA_IFNAME"), [l["index"]]
                        break
            if not link and not os.path.lexists(path):
                return  # never had a network here
        # 1. the allowlist (fail closed first)
        try:
            if att is not None and any(att.elements.values()):
                try:
                    assert self._nft is not None
                    self._nft.run(self._elements_cmd("delete", att.elements))
                except NftError:
                    self._w_gc_elements(only={host_if})
            elif att is None:
                self._w_gc_elements(only={host_if})
        except NftError as exc:  # no table: no elements
            log.info("nft_elements_gone", sandbox_id=sid, error=str(exc))
        # 2. the netns: once the sandbox's processes are gone the kernel destroys it, and the
        # veth pair with it (asynchronously, batched); the /30 is reused only after that.
        self._w_umount(path)
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

    def _w_umount(self, path: str) -> None:
        if _libc.umount2(path.encode(), _MNT_DETACH) != 0:
            e = ctypes.get_errno()
            if e not in (errno.EINVAL, errno.ENOENT):
                log.warning("netns_umount_failed", path=path, error=os.strerror(e))
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def _w_del_link(self, name: str) -> None:
        try:
            self._ipr.link("del", ifname=name)
        except Exception as exc:  # noqa: BLE001
            if "No such device" not in str(exc):
                log.warning("veth_delete_failed", ifname=name, error=str(exc))

    def _w_list_elements(self) -> dict[str, list[tuple[str, str]]]:
        """set -> [(ifname, element text)] of this table's allow sets."""
        assert self._nft is not None
        out: dict[str, list[tuple[str, str]]] = {"allow_net": [], "allow_port": []}
        for s in out:
            doc = json.loads(self._nft.run(f"list set inet {self.cfg.table} {s}", json_out=True))
            for item in doc.get("nftables", []):
                for el in (item.get("set") or {}).get("elem", []) or []:
                    if isinstance(el, dict) and "elem" in el:  # an element with options
                        el = el["elem"].get("val", el["elem"])
                    parts = el.get("concat") if isinstance(el, dict) else None
                    if not parts:
                        continue
                    out[s].append((parts[0], " . ".join(_json_val(p) for p in parts)))
        return out

    def _w_gc_elements(self, only: set[str] | None = None, keep: set[str] | None = None) -> int:
        """Delete elements of the given ifnames (``only``), or of every ifname not in ``keep``."""
        assert self._nft is not None
        doomed: dict[str, list[str]] = {}
        for s, els in self._w_list_elements().items():
            for ifn, text in els:
                if (only is not None and ifn in only) or (keep is not None and ifn not in keep):
                    doomed.setdefault(s, []).append(text)
        if doomed:
            self._nft.run(self._elements_cmd("delete", doomed))
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
            self._nft.run(self._elements_cmd("add", readd))  # idempotent; back after a table rebuild
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
                self._w_umount(p)
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
                self._w_umount(os.path.join(self.cfg.netns_dir, n))
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


def _json_val(v: Any) -> str:
    if isinstance(v, dict):
        if "prefix" in v:
            return f"{v['prefix']['addr']}/{v['prefix']['len']}"
        if "range" in v:
            return f"{v['range'][0]}-{v['range'][1]}"
    if isinstance(v, str) and not re.fullmatch(r"[\d.]+|tcp|udp", v):
        return json.dumps(v)
    return str(v)


def _hosts_of(spec: str) -> list[str]:
    """Host names in a URL list like nats://a:4222,nats://b:4222 (or bare hosts)."""
    out = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        if "://" in part:
            part = part.split("://", 1)[1]
        part = part.rsplit("@", 1)[-1].split("/", 1)[0]
        if part.startswith("["):
            continue  # IPv6 literal: sandboxes have no IPv6 anyway
        host = part.rsplit(":", 1)[0] if part.count(":") == 1 else part
        if host:
            out.append(host)
    return out
