"""The few rtnetlink requests a sandbox network needs on its hot path, raw and batched (pyroute2
serves the rare paths: dumps, recovery, deletes -- its per-call overhead is most of the cost of a
create)."""

from __future__ import annotations

import os
import socket
import struct

__all__ = ["Rtnl"]


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
                    index: int = struct.unpack("=BxHiII", payload[:16])[2]
                    return index

    def _recv(self) -> list[tuple[int, int, bytes]]:
        data = self.sock.recv(65536)
        out = []
        off = 0
        while off + 16 <= len(data):
            n, mtype, _flags, seq, _pid = struct.unpack("=IHHII", data[off : off + 16])
            out.append((mtype, seq, data[off + 16 : off + n]))
            off += (n + 3) & ~3
        return out
