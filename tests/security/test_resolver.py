"""The host agent's resolver for allowlisted names against hostile nameservers.

Each test starts real DNS servers on 127.0.0.1 (UDP and TCP on one port) that answer the way a
broken or hostile server does -- garbage, cut short, another query's id or question, a spoofed
source, SERVFAIL, silence -- next to a good server (the positive control). A bad server's reply is
a typed ``DnsQueryError`` of a specific kind and the next server's answer is used; when every
server fails the lookup is a ``ResolveFailed`` (``create_failed``), never an uncaught exception.
The fuzz test mutates real replies with a seeded generator (``DSEC_FUZZ_SEED`` replays a run).
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import random
import socket
import struct
from collections.abc import AsyncIterator, Callable
from typing import Any

import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdatatype
import dns.rrset
import pytest
import pytest_asyncio

from hostagent.network.resolver import DnsQueryError, Resolver, ResolveFailed

NAME = "svc.dsec.test"
GOOD = ["198.18.0.2", "198.18.0.3"]
OTHER = ["203.0.113.66"]  # what a spoofed or stale reply claims

# (query wire, udp?) -> reply bytes, or None for no reply
Behaviour = Callable[[bytes, bool], bytes | None]


def answer(query: bytes, ips: list[str], name: str | None = None, **flags: bool) -> bytes:
    """A well-formed reply to ``query`` (for ``name`` if given: another question)."""
    q = dns.message.from_wire(query)
    if name is not None:
        q.question = [dns.rrset.RRset(dns.name.from_text(name), 1, dns.rdatatype.A)]
    r = dns.message.make_response(q)
    if ips:
        r.answer.append(dns.rrset.from_text(q.question[0].name, 60, "IN", "A", *ips))
    if flags.get("tc"):
        r.flags |= dns.flags.TC
        r.answer = []
    if flags.get("servfail"):
        r.set_rcode(dns.rcode.SERVFAIL)
    return r.to_wire()


class DnsServer:
    """UDP and TCP on the same 127.0.0.1 port, answering with ``behaviour``."""

    __test__ = False

    def __init__(self, behaviour: Behaviour) -> None:
        self.behaviour = behaviour
        self.udp_queries = 0
        self.tcp_queries = 0
        self.port = 0
        self._udp: Any = None
        self._tcp: asyncio.Server | None = None
        self.spoof_from: socket.socket | None = None  # a second socket: replies from the wrong source

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> "DnsServer":
        loop = asyncio.get_running_loop()
        srv = self

        class Udp(asyncio.DatagramProtocol):
            def connection_made(self, transport: Any) -> None:
                self.t = transport

            def datagram_received(self, data: bytes, addr: Any) -> None:
                srv.udp_queries += 1
                if srv.spoof_from is not None:  # the attacker's guess arrives first
                    srv.spoof_from.sendto(answer(data, OTHER), addr)
                reply = srv.behaviour(data, True)
                if reply is not None:
                    self.t.sendto(reply, addr)

        for _ in range(20):  # a free UDP port whose TCP twin is free too
            self._udp, _ = await loop.create_datagram_endpoint(Udp, local_addr=("127.0.0.1", 0))
            self.port = self._udp.get_extra_info("sockname")[1]
            try:
                self._tcp = await asyncio.start_server(self._serve_tcp, "127.0.0.1", self.port)
                return self
            except OSError:
                self._udp.close()
        raise RuntimeError("no free UDP+TCP port pair on 127.0.0.1")

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            (n,) = struct.unpack("!H", await reader.readexactly(2))
            query = await reader.readexactly(n)
            self.tcp_queries += 1
            reply = self.behaviour(query, False)
            if reply is not None:
                writer.write(struct.pack("!H", len(reply)) + reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def close(self) -> None:
        if self._udp is not None:
            self._udp.close()
        if self._tcp is not None:
            self._tcp.close()
        if self.spoof_from is not None:
            self.spoof_from.close()


@pytest_asyncio.fixture
async def servers() -> AsyncIterator[Callable[[Behaviour], Any]]:
    made: list[DnsServer] = []

    async def make(behaviour: Behaviour) -> DnsServer:
        s = await DnsServer(behaviour).start()
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def good(query: bytes, udp: bool) -> bytes:
    return answer(query, GOOD)


# the hostile behaviours and the kind of error each must be typed as
BAD: dict[str, tuple[Behaviour, str]] = {
    "garbage": (lambda q, udp: b"\x13\x37garbage, not DNS at all", "malformed"),
    "header_only": (lambda q, udp: q[:2] + b"\x81\x80", "malformed"),
    "cut_short": (lambda q, udp: answer(q, GOOD)[:-3], "malformed"),
    "counts_lie": (lambda q, udp: q[:2] + struct.pack("!HHHHH", 0x8180, 1, 9, 0, 0) + answer(q, GOOD)[12:], "malformed"),
    "wrong_id": (lambda q, udp: struct.pack("!H", struct.unpack("!H", q[:2])[0] ^ 0x5A5A) + answer(q, OTHER)[2:], "mismatch"),
    "wrong_question": (lambda q, udp: answer(q, OTHER, name="evil.dsec.test"), "mismatch"),
    "not_a_reply": (lambda q, udp: q, "mismatch"),  # the query echoed back (QR clear)
    "servfail": (lambda q, udp: answer(q, [], servfail=True), "server_error"),
    "silent": (lambda q, udp: None, "timeout"),
    "truncated_then_garbage_tcp": (lambda q, udp: answer(q, [], tc=True) if udp else b"\xff" * 7, "malformed"),
}


async def test_good_server_answers(servers: Any) -> None:
    """The positive control: a good server's addresses come back, over UDP."""
    ok = await servers(good)
    assert sorted(await Resolver([ok.addr], 2.0).resolve(NAME)) == GOOD
    assert ok.udp_queries == 1 and ok.tcp_queries == 0


async def test_no_such_name_is_an_empty_answer(servers: Any) -> None:
    """NXDOMAIN is an answer (the allowlist then refuses the name with invalid_argument), not a failure."""

    def nx(q: bytes, udp: bool) -> bytes:
        r = dns.message.make_response(dns.message.from_wire(q))
        r.set_rcode(dns.rcode.NXDOMAIN)
        return r.to_wire()

    s = await servers(nx)
    assert await Resolver([s.addr], 2.0).resolve(NAME) == []


async def test_cname_chain_is_followed(servers: Any) -> None:
    def cname(q: bytes, udp: bool) -> bytes:
        r = dns.message.make_response(dns.message.from_wire(q))
        r.answer.append(dns.rrset.from_text(NAME + ".", 60, "IN", "CNAME", "real.dsec.test."))
        r.answer.append(dns.rrset.from_text("real.dsec.test.", 60, "IN", "A", *GOOD))
        r.answer.append(dns.rrset.from_text("unrelated.dsec.test.", 60, "IN", "A", *OTHER))  # not on the chain: ignored
        return r.to_wire()

    s = await servers(cname)
    assert sorted(await Resolver([s.addr], 2.0).resolve(NAME)) == GOOD


async def test_truncated_reply_is_asked_again_over_tcp(servers: Any) -> None:
    s = await servers(lambda q, udp: answer(q, [], tc=True) if udp else answer(q, GOOD))
    assert sorted(await Resolver([s.addr], 2.0).resolve(NAME)) == GOOD
    assert s.udp_queries == 1 and s.tcp_queries == 1


async def test_reply_from_a_spoofed_source_is_ignored(servers: Any) -> None:
    """A reply from another address/port than the server asked (sent first) is dropped; the real one is used."""
    s = await servers(good)
    s.spoof_from = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.spoof_from.bind(("127.0.0.1", 0))
    assert sorted(await Resolver([s.addr], 2.0).resolve(NAME)) == GOOD


async def test_query_ids_are_unpredictable(servers: Any) -> None:
    ids: list[int] = []

    def record(q: bytes, udp: bool) -> bytes:
        ids.append(struct.unpack("!H", q[:2])[0])
        return answer(q, GOOD)

    s = await servers(record)
    r = Resolver([s.addr], 2.0)
    for _ in range(64):
        await r.resolve(NAME)
    assert len(set(ids)) >= 60, ids  # 64 draws from 2**16: a repeat or two at most, never a sequence
    assert sorted(ids) != ids and sorted(ids, reverse=True) != ids


@pytest.mark.parametrize("case", sorted(BAD))
async def test_bad_server_is_a_typed_error_and_the_next_server_answers(servers: Any, case: str) -> None:
    behaviour, kind = BAD[case]
    bad = await servers(behaviour)
    ok = await servers(good)
    # alone: every server failed -> ResolveFailed (create_failed) naming the server and the kind
    with pytest.raises(ResolveFailed) as ei:
        await Resolver([bad.addr], 0.5).resolve(NAME)
    assert ei.value.code == "create_failed" and NAME in ei.value.description
    assert [(f.server, f.kind) for f in ei.value.failures] == [(bad.addr, kind)], ei.value
    # with a good server after it: that server's answer is used
    assert sorted(await Resolver([bad.addr, ok.addr], 1.0).resolve(NAME)) == GOOD
    assert ok.udp_queries == 1


def mutate(rng: random.Random, reply: bytes) -> bytes:
    """One random corruption of a real reply."""
    how = rng.randrange(6)
    if how == 0:  # cut anywhere
        return reply[: rng.randrange(len(reply))]
    if how == 1:  # flip bytes (the id's two included now and then)
        b = bytearray(reply)
        for _ in range(rng.randint(1, 6)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        return bytes(b)
    if how == 2:  # random bytes behind the real id
        return reply[:2] + rng.randbytes(rng.randrange(0, 300))
    if how == 3:  # header counts that lie
        return reply[:4] + struct.pack("!HHHH", *(rng.randrange(0x10000) for _ in range(4))) + reply[12:]
    if how == 4:  # a compression pointer loop or out of range in the answer's owner name
        off = len(reply) - 16  # the answer record's name pointer (one A record per test reply)
        return reply[:off] + struct.pack("!H", 0xC000 | rng.choice([off, off + 1, 0x3FFF, 12])) + reply[off + 2 :]
    return reply + rng.randbytes(rng.randrange(1, 40))  # trailing junk


async def test_fuzzed_replies_are_typed_errors_and_the_next_server_answers(servers: Any) -> None:
    """250 random corruptions of a real reply. Each is either a typed DnsQueryError -- and then,
    with a good server behind the fuzzing one, the good server's answer is used -- or still parses
    as this query's reply (a flipped TTL bit, say), and then that same answer comes back."""
    seed = int(os.environ.get("DSEC_FUZZ_SEED") or random.randrange(1 << 32))
    fuzz = await servers(good)
    ok = await servers(good)
    alone, both = Resolver([fuzz.addr], 2.0), Resolver([fuzz.addr, ok.addr], 4.0)
    qname = dns.name.from_text(NAME)
    kinds: dict[str, int] = {}
    for i in range(250):
        # the same corruption for both lookups of this case: positions and bits come from (seed, i)
        fuzz.behaviour = lambda q, udp, i=i: mutate(random.Random(f"{seed}:{i}"), answer(q, OTHER)) if udp else None
        try:
            got: list[str] | None = await alone.query(("127.0.0.1", fuzz.port), qname, 2.0)
            kinds["parsed"] = kinds.get("parsed", 0) + 1
        except DnsQueryError as exc:
            kinds[exc.kind] = kinds.get(exc.kind, 0) + 1
            got = None
        except Exception as exc:  # noqa: BLE001 - the point: nothing but the typed error may escape
            pytest.fail(f"DSEC_FUZZ_SEED={seed} case {i}: untyped {type(exc).__name__}: {exc}")
        asked = ok.udp_queries
        result = await both.resolve(NAME)
        if got is None:
            assert sorted(result) == GOOD and ok.udp_queries == asked + 1, (seed, i, result)
        else:
            assert result == got and ok.udp_queries == asked and all(ipaddress.IPv4Address(a) for a in got), (seed, i, got, result)
    assert sum(kinds.values()) == 250 and kinds.get("malformed", 0) > 25, (seed, kinds)
