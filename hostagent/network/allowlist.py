"""The egress allowlist: ``allow_out`` entries parsed, resolved names checked, and compiled into
disjoint nftables set elements plus the sandbox's ``/etc/hosts`` lines.

Entries: ``CIDR`` or ``IP`` (every port and protocol), ``host:port`` or ``host:lo-hi`` (TCP and UDP
to those ports; host is an IP, CIDR or domain), or ``domain`` (every port). An entry that can only
name forbidden addresses (inside a deny range, or one of the host's own addresses) is refused with
``InvalidArgument``; broader entries (``0.0.0.0/0``) are accepted and the kernel still refuses the
forbidden part.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import re
from dataclasses import dataclass, field
from typing import Iterable

import structlog

from bus.errors import InvalidArgument

log = structlog.get_logger("dsec.hostagent.network")

__all__ = ["Entry", "AllowPlan", "parse_allow_out", "compile_allowlist", "write_hosts_file"]

MAX_PORT = 65535
_DOMAIN_RE = re.compile(r"^(?=.{1,253}\Z)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*\.?\Z")


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
    plan.ports = _disjoint_port_rules(port_rules, plan.nets)
    return plan


def _disjoint_port_rules(
    port_rules: list[tuple[ipaddress.IPv4Network, int, int]], all_ports: list[ipaddress.IPv4Network]
) -> list[tuple[ipaddress.IPv4Network, int, int]]:
    """Port rules as disjoint rectangles (the kernel's interval sets refuse overlapping elements):
    cut the port axis at every boundary, collapse the networks of each piece, drop what the
    all-ports networks already cover, then merge adjacent pieces with identical networks."""
    cuts = sorted({lo for _, lo, _ in port_rules} | {hi + 1 for _, _, hi in port_rules})
    pieces: list[tuple[int, int, tuple[ipaddress.IPv4Network, ...]]] = []
    for a, b in itertools.pairwise(cuts):
        nets = [n for n, lo, hi in port_rules if lo <= a and b - 1 <= hi]
        nets = [n for n in ipaddress.collapse_addresses(nets) if not any(n.subnet_of(m) for m in all_ports)]
        if not nets:
            continue
        key = tuple(nets)
        if pieces and pieces[-1][1] == a - 1 and pieces[-1][2] == key:
            pieces[-1] = (pieces[-1][0], b - 1, key)
        else:
            pieces.append((a, b - 1, key))
    return [(n, lo, hi) for lo, hi, nets in pieces for n in nets]

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

