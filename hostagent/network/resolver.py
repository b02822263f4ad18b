"""A-record lookups for allowlisted domains, done by the host agent (never by the sandbox): the
host's resolver, or the configured nameservers asked directly through dnspython.

dnspython gives each query an unpredictable id (``dns.entropy``) and a random source port, checks
that a reply answers the query (id, question, source address) and parses defensively; a truncated
UDP reply is asked again over TCP. Every way one server can fail -- no reply, an unreachable
server, a reply that does not parse, a reply to some other query (spoofed or stale), an error
rcode -- is a :class:`DnsQueryError` of one ``kind``, and the next server is tried. When no server
gave an answer the lookup raises :class:`ResolveFailed` (wire code ``create_failed``: the host, not
the request, is at fault); a name that does not exist (NXDOMAIN) or has no A record is an answer,
the empty list, which the allowlist refuses with ``invalid_argument``."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import Iterable, Literal

import dns.exception
import dns.message
import dns.name
import dns.query
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import structlog
from dns import asyncquery

from bus.errors import CreateFailed

log = structlog.get_logger("dsec.hostagent.network")

__all__ = ["Resolver", "DnsQueryError", "ResolveFailed", "DnsFailure"]

# How one server's attempt failed.
DnsFailure = Literal["timeout", "unreachable", "malformed", "mismatch", "server_error"]
# getaddrinfo's "this name has no address": an answer, not a failure.
_NO_SUCH_NAME = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


class DnsQueryError(Exception):
    """One nameserver did not give a usable answer; the resolver goes on with the next one."""

    def __init__(self, server: str, kind: DnsFailure, detail: str) -> None:
        super().__init__(f"{server}: {kind} ({detail})")
        self.server = server
        self.kind: DnsFailure = kind
        self.detail = detail


class ResolveFailed(CreateFailed):
    """No nameserver answered a lookup for an allowlisted name (``failures``: each server's error)."""

    def __init__(self, name: str, failures: list[DnsQueryError]) -> None:
        why = "; ".join(str(f) for f in failures) or "no nameserver"
        super().__init__(f"cannot resolve {name}: {why}", name=name, kinds=",".join(f.kind for f in failures))
        self.name = name
        self.failures = failures


class Resolver:
    """A-record lookups for allowlisted domains, done by the host agent (never by the sandbox).

    With ``nameservers`` (``ip`` or ``ip:port``) it asks those servers in order, each with an equal
    share of ``timeout_s`` (at least 0.2 s), no search domains; otherwise it uses the host's own
    resolver (getaddrinfo). ``resolve`` returns the addresses (empty: no such name, or no A record)
    or raises :class:`ResolveFailed`.
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
            return await self._getaddrinfo(name)
        try:
            qname = dns.name.from_text(name)
        except dns.exception.DNSException as exc:
            raise ResolveFailed(name, [DnsQueryError("-", "malformed", f"not a DNS name: {exc}")]) from None
        per_try = max(0.2, self.timeout_s / len(self.servers))
        failures: list[DnsQueryError] = []
        for server in self.servers:
            try:
                return await self.query(server, qname, per_try)
            except DnsQueryError as exc:
                log.info("dns_query_failed", server=exc.server, name=name, kind=exc.kind, error=exc.detail)
                failures.append(exc)
        raise ResolveFailed(name, failures)

    async def query(self, server: tuple[str, int], qname: dns.name.Name, timeout_s: float) -> list[str]:
        """One server's A records for ``qname`` (UDP, then TCP if the reply was truncated); raises
        DnsQueryError."""
        where = f"{server[0]}:{server[1]}"
        q = dns.message.make_query(qname, dns.rdatatype.A)
        try:
            async with asyncio.timeout(timeout_s):
                reply, _ = await asyncquery.udp_with_fallback(q, server[0], timeout=timeout_s, port=server[1], ignore_unexpected=True)
        except (TimeoutError, dns.exception.Timeout):
            raise DnsQueryError(where, "timeout", f"no reply within {timeout_s:.1f}s") from None
        except dns.query.BadResponse:
            raise DnsQueryError(where, "mismatch", "the reply does not answer the query (id or question differ)") from None
        except (dns.exception.DNSException, ValueError, EOFError, IndexError) as exc:
            raise DnsQueryError(where, "malformed", f"{type(exc).__name__}: {exc}") from None
        except OSError as exc:
            raise DnsQueryError(where, "unreachable", f"{type(exc).__name__}: {exc}") from None
        return _addresses(reply, where)

    async def _getaddrinfo(self, name: str) -> list[str]:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.timeout_s):
                infos = await loop.getaddrinfo(name, None, family=socket.AF_INET, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            if exc.errno in _NO_SUCH_NAME:
                return []
            raise ResolveFailed(name, [DnsQueryError("getaddrinfo", "server_error", str(exc))]) from None
        except TimeoutError:
            raise ResolveFailed(name, [DnsQueryError("getaddrinfo", "timeout", f"no answer within {self.timeout_s:.1f}s")]) from None
        except (OSError, UnicodeError) as exc:
            raise ResolveFailed(name, [DnsQueryError("getaddrinfo", "unreachable", f"{type(exc).__name__}: {exc}")]) from None
        return list(dict.fromkeys(str(i[4][0]) for i in infos))


def _addresses(reply: dns.message.Message, where: str) -> list[str]:
    """The A records at the end of the reply's CNAME chain; [] for NXDOMAIN or no A record."""
    rcode = reply.rcode()
    if rcode == dns.rcode.NXDOMAIN:
        return []
    if rcode != dns.rcode.NOERROR:
        raise DnsQueryError(where, "server_error", f"rcode {dns.rcode.to_text(rcode)}")
    if not isinstance(reply, dns.message.QueryMessage):
        raise DnsQueryError(where, "malformed", f"not a query reply (opcode {reply.opcode()})")
    try:
        chain = reply.resolve_chaining()
    except dns.exception.DNSException as exc:
        raise DnsQueryError(where, "malformed", f"{type(exc).__name__}: {exc}") from None
    if chain.answer is None or chain.answer.rdclass != dns.rdataclass.IN:
        return []
    return list(dict.fromkeys(rd.to_text() for rd in chain.answer))
