"""Host-side reader of the packets the sandbox egress rules drop (NFLOG over nfnetlink).

Why NFLOG and not ``log level audit``: an audit NETFILTER_PKT record carries neither the ports,
the input interface nor a prefix, so it can tell neither what was tried nor which sandbox tried
it. The host agent's ruleset (``hostagent/network/nftables.py``) puts, before each rule that refuses a
packet *sent by* a sandbox, a copy of its match with::

    update @drop_log { iifname limit rate R burst B packets } counter name "logged"
        log prefix "<NFLOG_PREFIX> <rule>" group <NFLOG_GROUP> snaplen 96

so the kernel itself caps what a flood can log, per sandbox veth (a dynamic set keyed by the
interface, one token bucket each), before anything reaches user space. This reader binds that
NFLOG group (needs CAP_NET_ADMIN in the host netns) and turns each message into a
:class:`guard._kernel.Denial` of kind ``network``.

Which sandbox: NFULA_IFINDEX_INDEV is the host end of the sandbox's veth, attached to the
packet by the kernel (nothing inside the sandbox can choose it); the host agent sets that link's
alias (IFLA_IFALIAS) to the sandbox id, whether the veth was made for the sandbox or adopted from
the warm pool. An ifindex is never reused while its link exists and a veth serves one sandbox for
its whole life, so ifindex -> sandbox id is cached (dropped when the sandbox ends).

A second, coarser per-sandbox bucket here bounds what one sandbox can put on the bus even when
its packets each name a different destination (which the guard's per-denial coalescing cannot
fold); the packets it holds back are counted into the next report of that sandbox.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import re
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from bus import subjects as S

from ._kernel import Denial
from ._netlink import NLMSG as _NLMSG
from ._netlink import drain
from ._buckets import SandboxBuckets

log = structlog.get_logger("dsec.guard.nflog")

NETLINK_NETFILTER = 12
NFNL_SUBSYS_ULOG = 4
NFULNL_MSG_PACKET = 0
NFULNL_MSG_CONFIG = 1
NFULA_CFG_CMD, NFULA_CFG_MODE, NFULA_CFG_TIMEOUT, NFULA_CFG_QTHRESH = 1, 2, 3, 4
NFULNL_CFG_CMD_BIND, NFULNL_CFG_CMD_UNBIND = 1, 2
NFULNL_COPY_PACKET = 2
NFULA_PACKET_HDR, NFULA_IFINDEX_INDEV, NFULA_PAYLOAD, NFULA_PREFIX = 1, 4, 9, 10
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLA_TYPE_MASK = 0x3FFF
ETH_P_IP, ETH_P_IPV6 = 0x0800, 0x86DD
PROTO_NAMES = {1: "icmp", 6: "tcp", 17: "udp", 58: "icmpv6", 132: "sctp", 136: "udplite"}
_V6_EXT = {0, 43, 60}  # hop-by-hop, routing, destination options: walked to find the ports


_NFGEN = struct.Struct("=BBH")  # family, version, res_id (big-endian group: packed by hand)
_NLA = struct.Struct("=HH")
_SANDBOX_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


class NflogError(OSError):
    """The NFLOG group cannot be bound (no CAP_NET_ADMIN, or another listener holds it)."""


@dataclass(frozen=True)
class Drop:
    """One dropped packet, as the kernel logged it."""

    rule: str  # the ruleset's counter name: to_host, between_sandboxes, denied, not_allowed, ...
    ifindex: int
    family: int  # 4 or 6 (0: unknown)
    proto: str
    src: str
    dst: str
    sport: int = 0
    dport: int = 0
    icmp_type: int = -1

    @property
    def what(self) -> str:
        dst = f"[{self.dst}]" if self.family == 6 else self.dst
        if self.proto in ("tcp", "udp", "sctp", "udplite"):
            return f"{self.proto} {dst}:{self.dport}"
        if self.icmp_type >= 0:
            return f"{self.proto} {self.dst} type {self.icmp_type}"
        return f"{self.proto} {self.dst}"

    def detail(self) -> dict[str, str]:
        d = {"rule": self.rule, "proto": self.proto, "dst": self.dst, "src": self.src}
        if self.dport or self.sport:
            d["dport"], d["sport"] = str(self.dport), str(self.sport)
        if self.icmp_type >= 0:
            d["icmp_type"] = str(self.icmp_type)
        return d


def _attrs(data: bytes, pos: int, end: int) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    while pos + _NLA.size <= end:
        length, kind = _NLA.unpack_from(data, pos)
        if length < _NLA.size:
            break
        out.setdefault(kind & NLA_TYPE_MASK, data[pos + _NLA.size:pos + length])
        pos += (length + 3) & ~3
    return out


def parse_ip(payload: bytes, hw_protocol: int = 0) -> tuple[int, str, str, str, int, int, int]:
    """An IPv4/IPv6 packet's (family, proto, src, dst, sport, dport, icmp_type) -- as much as the
    snapshot holds. Raises ValueError for something that is not an IP packet."""
    if not payload:
        raise ValueError("empty payload")
    version = payload[0] >> 4
    if version == 4 and len(payload) >= 20 and hw_protocol in (0, ETH_P_IP):
        ihl = (payload[0] & 15) * 4
        nr = payload[9]
        src, dst = socket.inet_ntoa(payload[12:16]), socket.inet_ntoa(payload[16:20])
        frag_off = struct.unpack_from("!H", payload, 6)[0] & 0x1FFF
        l4 = payload[ihl:] if frag_off == 0 else b""  # a later fragment carries no L4 header
        fam = 4
    elif version == 6 and len(payload) >= 40 and hw_protocol in (0, ETH_P_IPV6):
        nr = payload[6]
        src = str(ipaddress.IPv6Address(payload[8:24]))
        dst = str(ipaddress.IPv6Address(payload[24:40]))
        off = 40
        for _ in range(8):
            if nr not in _V6_EXT or off + 2 > len(payload):
                break
            nr, off = payload[off], off + (payload[off + 1] + 1) * 8
        l4 = payload[off:] if nr != 44 else b""  # 44: fragment header, ports unknown
        fam = 6
    else:
        raise ValueError(f"not an IP packet (version {version}, {len(payload)} bytes)")
    proto = PROTO_NAMES.get(nr, str(nr))
    sport = dport = 0
    icmp_type = -1
    if proto in ("tcp", "udp", "sctp", "udplite") and len(l4) >= 4:
        sport, dport = struct.unpack_from("!HH", l4)
    elif proto in ("icmp", "icmpv6") and l4:
        icmp_type = l4[0]
    return fam, proto, src, dst, sport, dport, icmp_type


def parse_packet_msg(body: bytes, prefix: str = S.NFLOG_PREFIX) -> Drop | None:
    """One NFULNL_MSG_PACKET body (after the nlmsghdr) -> Drop, or None when it is not one of ours."""
    if len(body) < _NFGEN.size:
        return None
    a = _attrs(body, _NFGEN.size, len(body))
    text = a.get(NFULA_PREFIX, b"").split(b"\0", 1)[0].decode(errors="replace")
    head, _, rule = text.partition(" ")
    if head != prefix or not rule:
        return None
    ifindex = struct.unpack("!I", a[NFULA_IFINDEX_INDEV][:4])[0] if len(a.get(NFULA_IFINDEX_INDEV, b"")) >= 4 else 0
    hw = struct.unpack("!H", a[NFULA_PACKET_HDR][:2])[0] if len(a.get(NFULA_PACKET_HDR, b"")) >= 2 else 0
    try:
        fam, proto, src, dst, sport, dport, icmp_type = parse_ip(a.get(NFULA_PAYLOAD, b""), hw)
    except ValueError:
        return Drop(rule, ifindex, 0, "unknown", "", "")
    return Drop(rule, ifindex, fam, proto, src, dst, sport, dport, icmp_type)


def config_msg(group: int, seq: int, attrs: list[tuple[int, bytes]]) -> bytes:
    body = struct.pack("=BB", socket.AF_UNSPEC, 0) + struct.pack("!H", group)
    for kind, data in attrs:
        n = _NLA.size + len(data)
        body += _NLA.pack(n, kind) + data + b"\0" * ((4 - n % 4) % 4)
    return _NLMSG.pack(_NLMSG.size + len(body), (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_CONFIG, NLM_F_REQUEST | NLM_F_ACK, seq, 0) + body


NETLINK_ROUTE = 0
RTM_NEWLINK, RTM_GETLINK = 16, 18
IFLA_IFNAME, IFLA_IFALIAS = 3, 20
_IFINFO = struct.Struct("=BxHiII")  # family, type, index, flags, change


def link_of(ifindex: int) -> tuple[str, str] | None:
    """(name, alias) of link ``ifindex`` in this thread's network namespace, None when there is none.

    Asked over rtnetlink, not read from sysfs: /sys/class/net shows the namespace that mounted sysfs,
    so a reader that only entered a host's network namespace (``nsenter --net``) would find there the
    machine's links, not the host's."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_ROUTE) as sock:
        sock.settimeout(2.0)
        body = _IFINFO.pack(socket.AF_UNSPEC, 0, ifindex, 0, 0)
        sock.send(_NLMSG.pack(_NLMSG.size + len(body), RTM_GETLINK, NLM_F_REQUEST, 1, 0) + body)
        data = sock.recv(65536)
    pos = 0
    while pos + _NLMSG.size <= len(data):
        length, rtype, _, _, _ = _NLMSG.unpack_from(data, pos)
        if length < _NLMSG.size:
            break
        if rtype == NLMSG_ERROR:
            return None  # ENODEV: gone
        if rtype == RTM_NEWLINK:
            a = _attrs(data, pos + _NLMSG.size + _IFINFO.size, pos + length)
            name = a.get(IFLA_IFNAME, b"").split(b"\0", 1)[0].decode(errors="replace")
            alias = a.get(IFLA_IFALIAS, b"").split(b"\0", 1)[0].decode(errors="replace")
            return name, alias.strip()
        pos += (length + 3) & ~3
    return None


class IfaceMap:
    """ifindex of a veth's host end -> the sandbox id in its alias, in the reader's network namespace
    (``sysfs``: read aliases from that directory instead -- tests)."""

    def __init__(self, sysfs: str | None = None) -> None:
        self.sysfs = Path(sysfs) if sysfs is not None else None
        self.by_index: dict[int, tuple[str, str]] = {}  # ifindex -> (sandbox id, ifname)

    def _link(self, ifindex: int) -> tuple[str, str] | None:
        if self.sysfs is None:
            try:
                return link_of(ifindex)
            except OSError:
                return None
        try:
            name = socket.if_indextoname(ifindex)
        except OSError:
            return None
        try:
            return name, (self.sysfs / name / "ifalias").read_text().strip()
        except OSError:
            return name, ""

    def of_index(self, ifindex: int) -> tuple[str | None, str]:
        hit = self.by_index.get(ifindex)
        if hit is not None:
            return hit
        link = self._link(ifindex)
        if link is None:
            return None, ""  # gone already (a sandbox ended between its packet and this lookup)
        name, alias = link
        if not _SANDBOX_ID.fullmatch(alias):
            return None, name  # a warm (not yet assigned) network, or not a sandbox veth at all
        self.by_index[ifindex] = (alias, name)
        return alias, name

    def gone(self) -> list[str]:
        """Sandboxes whose veth is no longer there (or serves another sandbox now), forgotten here:
        what a reader that sees no lifecycle events uses to keep its memory bounded."""
        out = [sid for ix, (sid, _) in list(self.by_index.items()) if (self._link(ix) or ("", ""))[1] != sid]
        for sid in out:
            self.forget(sid)
        return out

    def forget(self, sandbox_id: str) -> None:
        for k in [k for k, v in self.by_index.items() if v[0] == sandbox_id]:
            del self.by_index[k]


class NflogReader:
    """Reads the drops logged to ``group`` and reports each as a network Denial to ``on_denial``."""

    def __init__(
        self,
        on_denial: Callable[[Denial], None],
        *,
        group: int = S.NFLOG_GROUP,
        prefix: str = S.NFLOG_PREFIX,
        rate_per_s: float = 5.0,
        burst: int = 20,
        iface_map: IfaceMap | None = None,
    ) -> None:
        if not 0 <= group <= 0xFFFF:
            raise ValueError(f"NFLOG group must be 0..65535, got {group}")
        self.on_denial = on_denial
        self.group = group
        self.prefix = prefix
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.map = iface_map or IfaceMap()
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._limit = SandboxBuckets(rate_per_s, burst)
        self.packets = 0  # NFLOG messages of ours received (the kernel's "logged" counter, seen here)
        self.unmapped = 0  # drops from an interface that names no sandbox

    # --- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_NETFILTER)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            sock.bind((0, 0))
            sock.settimeout(2.0)
            # Flush to user space at once (qthresh 1): the kernel already rate-limits what is
            # logged, and the default (up to 100 packets or 1 s) would delay the first report.
            self._config(sock, 1, [
                (NFULA_CFG_CMD, bytes([NFULNL_CFG_CMD_BIND])),
            ])
            self._config(sock, 2, [
                (NFULA_CFG_MODE, struct.pack("!IBx", 0xFFFF, NFULNL_COPY_PACKET)),
                (NFULA_CFG_QTHRESH, struct.pack("!I", 1)),
                (NFULA_CFG_TIMEOUT, struct.pack("!I", 1)),
            ])
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            why = "another listener holds this group" if exc.errno == errno.EBUSY else exc.strerror
            raise NflogError(exc.errno or errno.EIO, f"cannot bind NFLOG group {self.group}: {why}") from None
        self._sock = sock
        self._loop.add_reader(sock.fileno(), self._readable)
        log.info("nflog_reader_started", group=self.group)

    def _config(self, sock: socket.socket, seq: int, attrs: list[tuple[int, bytes]]) -> None:
        sock.send(config_msg(self.group, seq, attrs))
        while True:
            data = sock.recv(65536)
            pos = 0
            while pos + _NLMSG.size <= len(data):
                length, rtype, _, rseq, _ = _NLMSG.unpack_from(data, pos)
                if rtype == NLMSG_ERROR and rseq == seq:
                    err = -struct.unpack_from("=i", data, pos + _NLMSG.size)[0]
                    if err:
                        raise OSError(err, f"NFLOG config: {errno.errorcode.get(err, err)}")
                    return
                if length < _NLMSG.size:
                    break
                pos += (length + 3) & ~3

    async def stop(self) -> None:
        if self._sock is None:
            return
        if self._loop is not None:
            self._loop.remove_reader(self._sock.fileno())
        try:
            self._sock.setblocking(True)
            self._sock.settimeout(1.0)
            self._config(self._sock, 3, [(NFULA_CFG_CMD, bytes([NFULNL_CFG_CMD_UNBIND]))])
        except OSError:
            pass  # closing the socket unbinds too
        self._sock.close()
        self._sock = None

    @property
    def held(self) -> int:
        """Reports the per-sandbox buckets held back."""
        return self._limit.held

    def forget(self, sandbox_id: str) -> None:
        self.map.forget(sandbox_id)
        self._limit.forget(sandbox_id)

    def sweep(self) -> list[str]:
        """Forget the sandboxes whose veth has gone; their ids."""
        out = self.map.gone()
        for sid in out:
            self._limit.forget(sid)
        return out

    # --- messages ---------------------------------------------------------------------------------
    def _readable(self) -> None:
        assert self._sock is not None
        drain(self._sock, self._on_message, batches=256, overrun="nflog_overrun", note="drop reports were lost: the reader fell behind")

    def _on_message(self, rtype: int, body: bytes) -> None:
        if rtype == (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_PACKET:
            self.feed(body)

    def feed(self, body: bytes) -> None:
        """Take one NFULNL_MSG_PACKET body (also the entry point for tests)."""
        drop = parse_packet_msg(body, self.prefix)
        if drop is None:
            return
        self.packets += 1
        sid, ifname = self.map.of_index(drop.ifindex)
        if sid is None:
            self.unmapped += 1
            return
        if not self._limit.take(sid):
            return
        detail = drop.detail()
        if ifname:
            detail["ifname"] = ifname
        held = self._limit.held_back(sid)
        if held:
            detail["held_back"] = str(held)  # reports of this sandbox's drops the bucket swallowed
        self.on_denial(Denial(kind="network", sandbox_id=sid, what=drop.what, detail=detail))


__all__ = ["Drop", "IfaceMap", "NflogError", "NflogReader", "config_msg", "link_of", "parse_ip", "parse_packet_msg"]
