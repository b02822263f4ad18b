"""A-record lookups for allowlisted domains, done by the host agent (never by the sandbox): the
host's resolver, or a minimal UDP stub resolver asking configured nameservers."""

from __future__ import annotations

import asyncio
import ipaddress
import random
import socket
import struct
from typing import Any, Iterable

import structlog

log = structlog.get_logger("dsec.hostagent.network")

__all__ = ["Resolver"]


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

