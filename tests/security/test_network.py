"""Red team: the network boundary of container sandboxes.

Attacks run as root inside real sandboxes (containerd + runc, the default guard profile) created
through the SDK on a whole in-process stack. Every attack asserts a specific block -- the error
the sandbox sees (our rules reject with ICMP admin-prohibited, so a blocked connect fails with
EHOSTUNREACH, not a timeout or a refusal by a closed port) and, where it is a firewall rule, the
named nft counter that fired -- and every test carries a positive control: the same destination
IS reachable for a sandbox whose allowlist names it, or the listener IS up, so a broken sandbox
or a dead server never counts as a pass.

Traffic only ever goes to addresses on this machine: a "test host" network namespace made here
(198.18.X.2, RFC 2544 benchmark space, routed to a veth of ours -- checked before use), the host's
own addresses, and the sandboxes' own namespaces.
"""

from __future__ import annotations

import asyncio
import ctypes
import ipaddress
import json
import os
import random
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from hostagent._network import (
    AllowPlan,
    NetworkConfig,
    NetworkManager,
    _dns_answers,
    compile_allowlist,
    parse_allow_out,
)
from bus.errors import InvalidArgument
from bus.messages import NetworkSpec
from tests.conftest import eventually
from tests.security.conftest import SKIP_REASON, RedTeam, SecStack, network_config, network_leftovers

pytestmark = [pytest.mark.containerd]
needs_stack = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")

_libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNET = 0x40000000

# ----------------------------------------------------------------------------- the probe
NETPROBE_C = r"""
/* netprobe: one network action, one line of outcome.
 *   netprobe tcp IP PORT [MSG]   connect (3 s); send MSG, print the first reply line
 *   netprobe udp IP PORT MSG     send one datagram, wait 2 s for a reply
 *   netprobe raw                 socket(AF_INET, SOCK_RAW, IPPROTO_ICMP)
 *   netprobe packet              socket(AF_PACKET, SOCK_RAW, ETH_P_ALL)
 *   netprobe nft TABLE           nfnetlink batch: delete table inet TABLE
 * Prints "ok ..." (exit 0), "err ERRNONAME ..." (exit 1) or "timeout" (exit 2). */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <linux/if_ether.h>
#include <linux/netfilter.h>
#include <linux/netfilter/nf_tables.h>
#include <linux/netfilter/nfnetlink.h>
#include <linux/netlink.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static int fail(const char *what) {
    int e = errno;
    printf("err %s %s (%s)\n", strerrorname_np(e) ? strerrorname_np(e) : "?", strerror(e), what);
    return 1;
}
static int addr(const char *ip, const char *port, struct sockaddr_in *sa) {
    memset(sa, 0, sizeof *sa);
    sa->sin_family = AF_INET;
    sa->sin_port = htons(atoi(port));
    return inet_pton(AF_INET, ip, &sa->sin_addr) == 1 ? 0 : -1;
}
static int tcp(const char *ip, const char *port, const char *msg) {
    struct sockaddr_in sa;
    if (addr(ip, port, &sa)) { errno = EINVAL; return fail("address"); }
    int s = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (s < 0) return fail("socket");
    if (connect(s, (struct sockaddr *)&sa, sizeof sa) < 0 && errno != EINPROGRESS) return fail("connect");
    struct pollfd p = {s, POLLOUT, 0};
    if (poll(&p, 1, 3000) == 0) { printf("timeout\n"); return 2; }
    int err = 0; socklen_t l = sizeof err;
    getsockopt(s, SOL_SOCKET, SO_ERROR, &err, &l);
    if (err) { errno = err; return fail("connect"); }
    char buf[256] = "";
    if (msg) {
        if (write(s, msg, strlen(msg)) < 0) return fail("write");
        p.events = POLLIN;
        if (poll(&p, 1, 2000) > 0) {
            ssize_t r = read(s, buf, sizeof buf - 1);
            if (r > 0) buf[r] = 0;
            buf[strcspn(buf, "\n")] = 0;
        }
    }
    printf("ok %s\n", buf);
    return 0;
}
static int udp(const char *ip, const char *port, const char *msg) {
    struct sockaddr_in sa;
    if (addr(ip, port, &sa)) { errno = EINVAL; return fail("address"); }
    int s = socket(AF_INET, SOCK_DGRAM, 0);
    if (s < 0) return fail("socket");
    if (connect(s, (struct sockaddr *)&sa, sizeof sa) < 0) return fail("connect");
    if (send(s, msg, strlen(msg), 0) < 0) return fail("send");
    struct pollfd p = {s, POLLIN, 0};
    if (poll(&p, 1, 2000) == 0) { printf("timeout\n"); return 2; }
    char buf[256];
    ssize_t r = recv(s, buf, sizeof buf - 1, 0);
    if (r < 0) return fail("recv");
    buf[r] = 0;
    buf[strcspn(buf, "\n")] = 0;
    printf("ok %s\n", buf);
    return 0;
}
static void put(char **w, const void *d, size_t n) { memcpy(*w, d, n); *w += NLMSG_ALIGN(n); }
static int nft(const char *table) {
    int s = socket(AF_NETLINK, SOCK_RAW, NETLINK_NETFILTER);
    if (s < 0) return fail("socket(NETLINK_NETFILTER)");
    char msg[512] = {0}, *w = msg;
    struct nlmsghdr *h;
    struct nfgenmsg g = {0};
    h = (struct nlmsghdr *)w; h->nlmsg_type = NFNL_MSG_BATCH_BEGIN; h->nlmsg_flags = NLM_F_REQUEST; h->nlmsg_seq = 1;
    w += NLMSG_HDRLEN; g.nfgen_family = AF_UNSPEC; g.res_id = htons(NFNL_SUBSYS_NFTABLES); put(&w, &g, sizeof g);
    h->nlmsg_len = w - (char *)h;
    h = (struct nlmsghdr *)w; h->nlmsg_type = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_DELTABLE;
    h->nlmsg_flags = NLM_F_REQUEST | NLM_F_ACK; h->nlmsg_seq = 2;
    w += NLMSG_HDRLEN; g.nfgen_family = NFPROTO_INET; g.res_id = 0; put(&w, &g, sizeof g);
    struct nlattr *a = (struct nlattr *)w; a->nla_type = NFTA_TABLE_NAME; a->nla_len = NLA_HDRLEN + strlen(table) + 1;
    memcpy(w + NLA_HDRLEN, table, strlen(table) + 1); w += NLA_ALIGN(a->nla_len);
    h->nlmsg_len = w - (char *)h;
    h = (struct nlmsghdr *)w; h->nlmsg_type = NFNL_MSG_BATCH_END; h->nlmsg_flags = NLM_F_REQUEST; h->nlmsg_seq = 3;
    w += NLMSG_HDRLEN; g.nfgen_family = AF_UNSPEC; g.res_id = htons(NFNL_SUBSYS_NFTABLES); put(&w, &g, sizeof g);
    h->nlmsg_len = w - (char *)h;
    struct sockaddr_nl k = {.nl_family = AF_NETLINK};
    if (sendto(s, msg, w - msg, 0, (struct sockaddr *)&k, sizeof k) < 0) return fail("sendto");
    char buf[4096];
    struct pollfd p = {s, POLLIN, 0};
    if (poll(&p, 1, 2000) == 0) { printf("timeout\n"); return 2; }
    ssize_t r = recv(s, buf, sizeof buf, 0);
    if (r < 0) return fail("recv");
    for (struct nlmsghdr *m = (struct nlmsghdr *)buf; NLMSG_OK(m, r); m = NLMSG_NEXT(m, r)) {
        if (m->nlmsg_type == NLMSG_ERROR) {
            struct nlmsgerr *e = NLMSG_DATA(m);
            if (e->error) { errno = -e->error; return fail("delete table"); }
            printf("ok deleted\n");
            return 0;
        }
    }
    printf("ok no-error\n");
    return 0;
}
int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IONBF, 0);
    if (argc >= 4 && !strcmp(argv[1], "tcp")) return tcp(argv[2], argv[3], argc > 4 ? argv[4] : NULL);
    if (argc >= 5 && !strcmp(argv[1], "udp")) return udp(argv[2], argv[3], argv[4]);
    if (argc >= 2 && !strcmp(argv[1], "raw")) {
        if (socket(AF_INET, SOCK_RAW, IPPROTO_ICMP) < 0) return fail("socket(AF_INET, SOCK_RAW)");
        printf("ok raw socket\n"); return 0;
    }
    if (argc >= 2 && !strcmp(argv[1], "packet")) {
        if (socket(AF_PACKET, SOCK_RAW, htons(ETH_P_ALL)) < 0) return fail("socket(AF_PACKET)");
        printf("ok packet socket\n"); return 0;
    }
    if (argc >= 3 && !strcmp(argv[1], "nft")) return nft(argv[2]);
    fprintf(stderr, "usage: netprobe tcp|udp|raw|packet|nft ...\n");
    return 64;
}
"""

PROBE = "/tmp/netprobe"  # where it lives inside a sandbox (a Landlock-writable dir)


@pytest.fixture(scope="session")
def netprobe_bin() -> bytes:
    if shutil.which("gcc") is None:
        pytest.skip("gcc not installed (needed to build the static probe)")
    d = tempfile.mkdtemp(prefix="dsec-netprobe-")
    try:
        src = Path(d, "netprobe.c")
        src.write_text(NETPROBE_C)
        r = subprocess.run(["gcc", "-static", "-O1", "-w", "-o", str(Path(d, "netprobe")), str(src)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot build a static probe: {r.stderr[-500:]}")
        return Path(d, "netprobe").read_bytes()
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ----------------------------------------------------------------------------- helpers
@dataclass
class Out:
    code: int
    stdout: str
    stderr: str

    @property
    def text(self) -> str:
        return (self.stdout + self.stderr).strip()


async def sh(sb: Any, cmd: str, timeout: float = 30) -> Out:
    """Run ``cmd`` as root in the sandbox; never raises on a non-zero exit."""
    from sdk.errors import CommandExitError

    try:
        r = await sb.commands.run(cmd, timeout=timeout)
    except CommandExitError as exc:
        r = exc.result if hasattr(exc, "result") else None
        if r is None:
            raise
    return Out(r.exit_code, r.stdout, r.stderr)


async def with_probe(sb: Any, binary: bytes) -> Any:
    await sb.files.write(PROBE, binary, mode=0o755)
    return sb


async def probe(sb: Any, *args: Any) -> Out:
    return await sh(sb, " ".join([PROBE, *map(str, args)]))


def counters(table: str) -> dict[str, int]:
    r = subprocess.run(["nft", "-j", "list", "counters", "table", "inet", table], capture_output=True, text=True, check=True)
    out = {}
    for item in json.loads(r.stdout)["nftables"]:
        c = item.get("counter")
        if c:
            out[c["name"]] = int(c["packets"])
    return out


def host_rules(table: str) -> str:
    """The host's sandbox ruleset as text, without counter values (nft -s)."""
    return subprocess.run(["nft", "-s", "list", "table", "inet", table], capture_output=True, text=True, check=True).stdout


def host_ipv4_addresses() -> list[str]:
    r = subprocess.run(["ip", "-4", "-j", "addr"], capture_output=True, text=True, check=True)
    return [a["local"] for link in json.loads(r.stdout) for a in link.get("addr_info", []) if not a["local"].startswith("127.")]


def in_netns(path: str, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in a throwaway thread that has joined the netns at ``path`` (sockets it makes stay there)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                if _libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns")
            finally:
                os.close(fd)
            box["v"] = fn()
        except BaseException as exc:  # noqa: BLE001
            box["e"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "e" in box:
        raise box["e"]
    return box.get("v")


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=check)


# ----------------------------------------------------------------------------- listeners
@dataclass
class Listener:
    """TCP + UDP servers on one port that record who reached them."""

    port: int
    tcp_peers: list[str] = field(default_factory=list)
    udp_peers: list[str] = field(default_factory=list)
    _closers: list[Callable[[], Any]] = field(default_factory=list)

    @property
    def hits(self) -> int:
        return len(self.tcp_peers) + len(self.udp_peers)

    def close(self) -> None:
        for c in self._closers:
            c()


async def listen(tcp_sock: socket.socket, udp_sock: socket.socket, tag: str) -> Listener:
    lis = Listener(tcp_sock.getsockname()[1])
    loop = asyncio.get_running_loop()

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")[0]
        lis.tcp_peers.append(peer)
        try:
            writer.write(f"hello-from-{tag} {peer}\n".encode())
            await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_server(on_conn, sock=tcp_sock)

    class Echo(asyncio.DatagramProtocol):
        def connection_made(self, transport: Any) -> None:
            self.t = transport

        def datagram_received(self, data: bytes, addr: Any) -> None:
            lis.udp_peers.append(addr[0])
            self.t.sendto(b"echo-from-" + tag.encode() + b" " + data, addr)

    transport, _ = await loop.create_datagram_endpoint(Echo, sock=udp_sock)
    lis._closers += [server.close, transport.close]
    return lis


def _sockets(bind: str, port: int = 0) -> tuple[socket.socket, socket.socket]:
    t = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    t.bind((bind, port))
    t.listen(64)
    t.setblocking(False)
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.bind((bind, t.getsockname()[1]))
    u.setblocking(False)
    return t, u


class TestHost:
    """A netns standing in for a server out there: 198.18.X.2 behind a veth of ours."""

    __test__ = False

    def __init__(self) -> None:
        self.uid = uuid.uuid4().hex[:8]
        self.ns = f"dtt-{self.uid}"
        self.nspath = f"/run/netns/{self.ns}"
        self.veth = f"dtt{self.uid}"  # 11 chars; not a sandbox prefix (they start with "ds")
        x = random.randrange(0, 256)
        self.net = ipaddress.IPv4Network(f"198.18.{x}.0/30")
        self.gw = str(self.net.network_address + 1)
        self.ip = str(self.net.network_address + 2)
        self.listeners: list[Listener] = []

    def start(self) -> None:
        taken = run("ip", "-4", "route", "show", str(self.net)).stdout.strip()
        if taken:
            raise RuntimeError(f"{self.net} is already routed here: {taken}")
        run("ip", "netns", "add", self.ns)
        run("ip", "link", "add", self.veth, "type", "veth", "peer", "name", "eth0", "netns", self.ns)
        run("ip", "addr", "add", f"{self.gw}/30", "dev", self.veth)
        run("ip", "link", "set", self.veth, "up")
        for cmd in (["ip", "link", "set", "lo", "up"], ["ip", "addr", "add", f"{self.ip}/30", "dev", "eth0"], ["ip", "link", "set", "eth0", "up"],
                    ["ip", "route", "add", "10.0.0.0/8", "via", self.gw]):
            run("ip", "netns", "exec", self.ns, *cmd)
        # SAFETY: traffic to the test host must stay on this machine.
        route = run("ip", "route", "get", self.ip).stdout
        assert f"dev {self.veth}" in route, route

    async def listen(self, port: int = 0) -> Listener:
        t, u = in_netns(self.nspath, lambda: _sockets("0.0.0.0", port))
        lis = await listen(t, u, "testhost")
        self.listeners.append(lis)
        return lis

    def connect_from_here(self, ip: str, port: int) -> str:
        """A TCP connect from inside the test host (for the inbound test)."""

        def go() -> str:
            s = socket.socket()
            s.settimeout(2)
            try:
                s.connect((ip, port))
                return "connected"
            except OSError as exc:
                return type(exc).__name__
            finally:
                s.close()

        return in_netns(self.nspath, go)

    def stop(self) -> None:
        for lis in self.listeners:
            lis.close()
        run("ip", "netns", "del", self.ns, check=False)
        run("ip", "link", "del", self.veth, check=False)


@pytest_asyncio.fixture(loop_scope="session")
async def testhost() -> AsyncIterator[TestHost]:
    if SKIP_REASON is not None:
        pytest.skip(SKIP_REASON)
    th = TestHost()
    try:
        th.start()
        yield th
    finally:
        th.stop()
        assert not os.path.exists(th.nspath)
        assert not os.path.exists(f"/sys/class/net/{th.veth}")


@pytest_asyncio.fixture(loop_scope="session")
async def host_listener() -> AsyncIterator[Listener]:
    """A TCP+UDP service on every address of the host (0.0.0.0): what a sandbox must never reach."""
    t, u = _sockets("0.0.0.0")
    lis = await listen(t, u, "host")
    try:
        yield lis
    finally:
        lis.close()


async def assert_blocked(out: Out, what: str, rt: RedTeam, *, errno_name: str = "EHOSTUNREACH") -> None:
    """A blocked connect/send: our reject (ICMP admin-prohibited) surfaces as EHOSTUNREACH."""
    assert out.code != 0 and errno_name in out.text, f"{what}: expected {errno_name}, got {out}"
    rt.blocked(what)


async def reach(sb: Any, ip: str, port: int, rt: RedTeam, what: str) -> str:
    out = await probe(sb, "tcp", ip, port, "hi")
    assert out.code == 0 and out.stdout.startswith("ok hello-from-"), f"positive control {what}: {out}"
    rt.allowed(what)
    return out.stdout


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}


# ============================================================================= pure logic (no root)
def test_allowlist_parsing_and_compilation() -> None:
    deny = [ipaddress.IPv4Network(n) for n in ("127.0.0.0/8", "10.200.0.0/16", "169.254.0.0/16")]
    host = {ipaddress.IPv4Address("192.0.2.2")}
    es = parse_allow_out(["198.18.0.0/24", "198.18.0.7", "198.18.1.5:80", "198.18.1.0/24:70-90", "api.example.com:443", "0.0.0.0/0:53"])
    plan = compile_allowlist(es, {"api.example.com": ["203.0.113.7", "127.0.0.1"]}, deny, host)
    assert [str(n) for n in plan.nets] == ["198.18.0.0/24"]  # the /32 inside the /24 is merged
    assert plan.hosts == [("203.0.113.7", "api.example.com")]  # 127.0.0.1 dropped
    # disjoint rectangles: 198.18.1.0/24 ports 70-90 (covers :80), 203.0.113.7:443, everything:53
    rects = {(str(n), lo, hi) for n, lo, hi in plan.ports}
    assert rects == {("198.18.1.0/24", 70, 90), ("203.0.113.7/32", 443, 443), ("0.0.0.0/0", 53, 53)}, rects
    els = plan.elements("dsxabc")
    assert '"dsxabc" . 198.18.0.0/24' in els["allow_net"]
    assert '"dsxabc" . 203.0.113.7 . udp . 443' in els["allow_port"]
    # refused: could only name forbidden addresses, or is not an allowlist entry at all
    for bad in ("127.0.0.1", "127.0.0.0/8", "10.200.3.4", "10.200.0.0/16:22", "169.254.169.254", "192.0.2.2", "192.0.2.2:4222"):
        with pytest.raises(InvalidArgument):
            compile_allowlist(parse_allow_out([bad]), {}, deny, host)
    for bad in ("::1", "[2001:db8::1]:443", "*.example.com", "not a domain", "1.2.3.4:0", "1.2.3.4:70000", "1.2.3.4:9-8", "1.2.3", "localhost"):
        with pytest.raises(InvalidArgument):
            parse_allow_out([bad])
    with pytest.raises(InvalidArgument):  # a domain that resolves only to forbidden addresses
        compile_allowlist(parse_allow_out(["evil.example.com"]), {"evil.example.com": ["127.0.0.1"]}, deny, host)
    with pytest.raises(InvalidArgument):  # a domain that does not resolve
        compile_allowlist(parse_allow_out(["nx.example.com"]), {}, deny, host)
    # broad entries are accepted: the kernel still refuses the forbidden part
    assert compile_allowlist(parse_allow_out(["0.0.0.0/0"]), {}, deny, host).nets == [ipaddress.IPv4Network("0.0.0.0/0")]


def _dns_reply(query: bytes, answers: dict[str, list[str]]) -> bytes:
    qid = query[:2]
    off, labels = 12, []
    while query[off]:
        labels.append(query[off + 1 : off + 1 + query[off]].decode())
        off += 1 + query[off]
    qname = ".".join(labels).lower()
    question = query[12 : off + 5]
    ips = answers.get(qname)
    if ips is None:
        return qid + struct.pack("!HHHHH", 0x8183, 1, 0, 0, 0) + question
    body = b"".join(b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 60, 4) + socket.inet_aton(ip) for ip in ips)
    return qid + struct.pack("!HHHHH", 0x8180, 1, len(ips), 0, 0) + question + body


def test_dns_answer_parsing() -> None:
    from hostagent._network import _dns_query

    q = _dns_query("svc.dsec.test", 0x1234)
    assert _dns_answers(_dns_reply(q, {"svc.dsec.test": ["198.18.0.2", "198.18.0.3"]}), "svc.dsec.test") == ["198.18.0.2", "198.18.0.3"]
    assert _dns_answers(_dns_reply(q, {}), "svc.dsec.test") == []


class DnsServer:
    """A tiny authoritative DNS server on the host's loopback: the resolver the host agent is given."""

    __test__ = False

    def __init__(self, answers: dict[str, list[str]]) -> None:
        self.answers = answers
        self.queries: list[str] = []
        self.port = 0
        self._t: Any = None

    async def start(self) -> "DnsServer":
        srv = self

        class P(asyncio.DatagramProtocol):
            def connection_made(self, transport: Any) -> None:
                self.t = transport

            def datagram_received(self, data: bytes, addr: Any) -> None:
                off, labels = 12, []
                while data[off]:
                    labels.append(data[off + 1 : off + 1 + data[off]].decode())
                    off += 1 + data[off]
                srv.queries.append(".".join(labels))
                self.t.sendto(_dns_reply(data, srv.answers), addr)

        self._t, _ = await asyncio.get_running_loop().create_datagram_endpoint(P, local_addr=("127.0.0.1", 0))
        self.port = self._t.get_extra_info("sockname")[1]
        return self

    def close(self) -> None:
        if self._t is not None:
            self._t.close()


# ============================================================================= red team
@needs_stack
async def test_default_sandbox_has_no_network(stack: SecStack, testhost: TestHost, netprobe_bin: bytes, redteam: RedTeam) -> None:
    """Without ``network`` a sandbox gets loopback only: no veth, no route, no nft elements."""
    await testhost.listen(8080)
    links_before = {n for n in os.listdir("/sys/class/net") if n.startswith(stack.net.ifprefix)}
    plain = await with_probe(await stack.create(), netprobe_bin)
    assert stack.attachment(plain) is None
    assert {n for n in os.listdir("/sys/class/net") if n.startswith(stack.net.ifprefix)} == links_before
    links = (await sh(plain, "ip -o link")).stdout
    assert [ln.split(":")[1].strip() for ln in links.splitlines()] == ["lo"], links
    assert (await sh(plain, "ip -4 route")).stdout.strip() == ""
    await assert_blocked(await probe(plain, "tcp", testhost.ip, 8080, "x"), "no-network sandbox -> test host (TCP)", redteam, errno_name="ENETUNREACH")
    await assert_blocked(await probe(plain, "udp", testhost.ip, 8080, "x"), "no-network sandbox -> test host (UDP)", redteam, errno_name="ENETUNREACH")
    await assert_blocked(await probe(plain, "tcp", "10.0.0.1", 8080, "x"), "no-network sandbox -> any address", redteam, errno_name="ENETUNREACH")
    # positive control: with the allowlist, the same destination is reachable
    allowed = await with_probe(await stack.create(network={"allow_out": [f"{testhost.ip}/32"]}), netprobe_bin)
    await reach(allowed, testhost.ip, 8080, redteam, "allowlisted sandbox -> test host")
    ping = await sh(allowed, f"ping -c1 -W2 {testhost.ip}")
    assert ping.code == 0 and "1 packets received" in ping.stdout, ping
    # no IPv6 anywhere in a networked sandbox
    assert (await sh(allowed, "cat /proc/net/if_inet6")).stdout.strip() == ""


@needs_stack
async def test_allowlisted_cidr_reachable_only_by_its_sandbox(stack: SecStack, testhost: TestHost, netprobe_bin: bytes, redteam: RedTeam) -> None:
    tcp = await testhost.listen()
    a = await with_probe(await stack.create(network={"allow_out": [f"{testhost.ip}/32"]}), netprobe_bin)
    b = await with_probe(await stack.create(network={"allow_out": ["198.51.100.0/24"]}), netprobe_bin)  # something else
    out = await reach(a, testhost.ip, tcp.port, redteam, "A -> its allowlisted CIDR (TCP)")
    assert testhost.gw in out  # masqueraded behind the host
    udp = await probe(a, "udp", testhost.ip, tcp.port, "ping")
    assert udp.code == 0 and "echo-from-testhost ping" in udp.stdout, udp
    redteam.allowed("A -> its allowlisted CIDR (UDP)")
    hits = tcp.hits
    c0 = counters(stack.net.table)
    await assert_blocked(await probe(b, "tcp", testhost.ip, tcp.port, "x"), "B -> A's allowlisted destination (TCP)", redteam)
    await assert_blocked(await probe(b, "udp", testhost.ip, tcp.port, "x"), "B -> A's allowlisted destination (UDP)", redteam)
    ping = await sh(b, f"ping -c1 -W2 {testhost.ip}")
    assert ping.code != 0 and "0 packets received" in ping.stdout, ping
    redteam.blocked("B -> A's allowlisted destination (ICMP echo)")
    assert delta(c0, counters(stack.net.table)).get("not_allowed", 0) >= 3
    assert tcp.hits == hits, "the test host saw traffic from B"


@needs_stack
async def test_host_port_entry_opens_only_that_port(stack: SecStack, testhost: TestHost, netprobe_bin: bytes, redteam: RedTeam) -> None:
    open_ = await testhost.listen()
    closed = await testhost.listen()
    a = await with_probe(await stack.create(network={"allow_out": [f"{testhost.ip}:{open_.port}"]}), netprobe_bin)
    await reach(a, testhost.ip, open_.port, redteam, "A -> allowlisted host:port (TCP)")
    udp = await probe(a, "udp", testhost.ip, open_.port, "u")
    assert udp.code == 0 and "echo-from-testhost u" in udp.stdout, udp
    redteam.allowed("A -> allowlisted host:port (UDP)")
    c0 = counters(stack.net.table)
    await assert_blocked(await probe(a, "tcp", testhost.ip, closed.port, "x"), "A -> same host, another port (TCP)", redteam)
    await assert_blocked(await probe(a, "udp", testhost.ip, closed.port, "x"), "A -> same host, another port (UDP)", redteam)
    ping = await sh(a, f"ping -c1 -W2 {testhost.ip}")
    assert ping.code != 0, ping
    redteam.blocked("A -> host:port entry does not open ICMP")
    assert delta(c0, counters(stack.net.table)).get("not_allowed", 0) >= 3
    assert closed.hits == 0


@needs_stack
async def test_host_is_unreachable_even_when_everything_is_allowed(
    stack: SecStack, testhost: TestHost, host_listener: Listener, netprobe_bin: bytes, redteam: RedTeam
) -> None:
    """allow_out 0.0.0.0/0: the host's own addresses (all of them, incl. the veth's .1) stay closed."""
    th = await testhost.listen()
    a = await with_probe(await stack.create(network={"allow_out": ["0.0.0.0/0"]}), netprobe_bin)
    att = stack.attachment(a)
    # positive controls: the sandbox does have egress, and the host service is up and answering
    await reach(a, testhost.ip, th.port, redteam, "allow-all sandbox -> test host")
    for ip in ("127.0.0.1", *host_ipv4_addresses()):
        with socket.create_connection((ip, host_listener.port), timeout=2) as s:
            assert s.recv(64).startswith(b"hello-from-host")
    redteam.allowed("the host's own service answers the host")
    host_listener.tcp_peers.clear()
    targets = sorted(set(host_ipv4_addresses()) | {att.gateway})
    c0 = counters(stack.net.table)
    for ip in targets:
        what = "the veth's host end" if ip == att.gateway else f"host address {ip}"
        await assert_blocked(await probe(a, "tcp", ip, host_listener.port, "x"), f"allow-all sandbox -> {what} (TCP)", redteam)
        await assert_blocked(await probe(a, "udp", ip, host_listener.port, "x"), f"allow-all sandbox -> {what} (UDP)", redteam)
        ping = await sh(a, f"ping -c1 -W2 {ip}")
        assert ping.code != 0 and "0 packets received" in ping.stdout, ping
        redteam.blocked(f"allow-all sandbox -> {what} (ICMP echo)")
    # 127.0.0.1 inside the sandbox is the sandbox's own loopback, never the host's
    lo = await probe(a, "tcp", "127.0.0.1", host_listener.port, "x")
    assert lo.code != 0 and "ECONNREFUSED" in lo.text, lo
    redteam.blocked("allow-all sandbox -> 127.0.0.1 (the host's loopback services)")
    d = delta(c0, counters(stack.net.table))
    assert d.get("to_host", 0) >= 3 * len(targets), d
    assert host_listener.hits == 0, f"the host service was reached from the sandbox: {host_listener.tcp_peers + host_listener.udp_peers}"


@needs_stack
async def test_control_plane_is_unreachable(make_stack: Any, testhost: TestHost, netprobe_bin: bytes, redteam: RedTeam) -> None:
    """NATS listens on a non-loopback host address here (a dummy interface), the stack runs over it;
    a sandbox allowed 0.0.0.0/0 still cannot reach it, and naming it in the allowlist is refused.
    containerd is a unix socket: not in the sandbox's filesystem at all."""
    from sdk.errors import DsecError

    dummy = f"dtn{uuid.uuid4().hex[:8]}"
    nats_ip = f"198.19.{random.randrange(256)}.{random.randrange(1, 255)}"
    run("ip", "link", "add", dummy, "type", "dummy")
    try:
        run("ip", "addr", "add", f"{nats_ip}/32", "dev", dummy)
        run("ip", "link", "set", dummy, "up")
        st = await make_stack(nats_host=nats_ip)
        assert st.url == f"nats://{nats_ip}:{st.nats.port}"
        th = await testhost.listen()
        a = await with_probe(await st.create(network={"allow_out": ["0.0.0.0/0"]}), netprobe_bin)
        await reach(a, testhost.ip, th.port, redteam, "allow-all sandbox -> test host")
        redteam.allowed("the whole stack talks to NATS over that address")  # the create above went through it
        c0 = counters(st.net.table)
        await assert_blocked(await probe(a, "tcp", nats_ip, st.nats.port, "CONNECT {}"), "allow-all sandbox -> NATS client port", redteam)
        await assert_blocked(await probe(a, "tcp", nats_ip, st.nats.monitor_port, "GET /varz"), "allow-all sandbox -> NATS monitoring port", redteam)
        await assert_blocked(await probe(a, "tcp", st.backend.net.attachment(a.sandbox_id).gateway, st.nats.port, "x"), "allow-all sandbox -> NATS port via the veth's host end", redteam)
        assert delta(c0, counters(st.net.table)).get("to_host", 0) >= 3
        for entry in (f"{nats_ip}:{st.nats.port}", nats_ip, "127.0.0.1:4222"):
            with pytest.raises(DsecError) as ei:
                await st.create(network={"allow_out": [entry]})
            assert ei.value.code == "invalid_argument" and "never reachable" in str(ei.value), ei.value
            redteam.blocked(f"allowlist naming the control plane refused ({entry})")
        # containerd's socket: present on the host, absent from the sandbox's filesystem
        sock = st.backend.daemon.address
        assert Path(sock).is_socket()
        redteam.allowed("containerd socket exists on the host")
        out = await sh(a, f"ls -la {sock} {os.path.dirname(sock)} /run/containerd")
        assert out.code != 0 and "containerd.sock" not in out.stdout and out.stderr.count("No such file") == 3, out
        sockets = (await sh(a, "find / \\( -path /proc -o -path /sys \\) -prune -o -type s -print")).stdout.split()
        assert sockets == ["/.dsec/run/agent.sock"], sockets
        redteam.blocked("containerd socket not visible in the sandbox filesystem")
    finally:
        run("ip", "link", "del", dummy, check=False)


@needs_stack
async def test_sandboxes_cannot_reach_each_other(stack: SecStack, testhost: TestHost, netprobe_bin: bytes, redteam: RedTeam) -> None:
    a = await with_probe(await stack.create(network={"allow_out": ["0.0.0.0/0"]}), netprobe_bin)
    b = await with_probe(await stack.create(network={"allow_out": ["0.0.0.0/0"]}), netprobe_bin)
    aa, ba = stack.attachment(a), stack.attachment(b)
    assert aa.ip != ba.ip and ipaddress.IPv4Network(f"{aa.ip}/30", strict=False) != ipaddress.IPv4Network(f"{ba.ip}/30", strict=False)
    started = await sh(b, "setsid nc -ll -p 7000 -e /bin/echo listener-b </dev/null >/dev/null 2>&1 &")
    assert started.code == 0, started

    async def b_listens() -> bool:
        return (await probe(b, "tcp", ba.ip, 7000)).stdout.startswith("ok")

    await eventually(b_listens, timeout=10, what="B's listener")
    own = await probe(b, "tcp", ba.ip, 7000, "x")
    assert own.code == 0 and "listener-b" in own.stdout, own
    redteam.allowed("B's listener answers B")
    c0 = counters(stack.net.table)
    await assert_blocked(await probe(a, "tcp", ba.ip, 7000, "x"), "sandbox A -> sandbox B (TCP)", redteam)
    await assert_blocked(await probe(a, "udp", ba.ip, 7000, "x"), "sandbox A -> sandbox B (UDP)", redteam)
    ping = await sh(a, f"ping -c1 -W2 {ba.ip}")
    assert ping.code != 0 and "0 packets received" in ping.stdout, ping
    redteam.blocked("sandbox A -> sandbox B (ICMP echo)")
    await assert_blocked(await probe(a, "tcp", ba.gateway, 7000, "x"), "sandbox A -> B's veth host end", redteam)
    d = delta(c0, counters(stack.net.table))
    assert d.get("between_sandboxes", 0) >= 3 and d.get("to_host", 0) >= 1, d
    # nothing from outside can open a connection into a sandbox either
    assert testhost.connect_from_here(ba.ip, 7000) in ("TimeoutError", "timeout")
    assert delta(c0, counters(stack.net.table)).get("inbound", 0) >= 1
    redteam.blocked("outside (test host) -> sandbox B (inbound TCP)")
    # and another sandbox's address (the pool) cannot be allowlisted
    from sdk.errors import DsecError

    for entry in (ba.ip, f"{ba.ip}:7000", stack.net.pool):
        with pytest.raises(DsecError) as ei:
            await stack.create(network={"allow_out": [entry]})
        assert ei.value.code == "invalid_argument", ei.value
        redteam.blocked(f"allowlist naming another sandbox refused ({entry})")


@needs_stack
async def test_raw_sockets_are_refused(stack: SecStack, testhost: TestHost, netprobe_bin: bytes, redteam: RedTeam) -> None:
    a = await with_probe(await stack.create(network={"allow_out": [f"{testhost.ip}/32"]}), netprobe_bin)
    # positive control: ICMP echo through the unprivileged ping socket works
    ping = await sh(a, f"ping -c1 -W2 {testhost.ip}")
    assert ping.code == 0 and "1 packets received" in ping.stdout, ping
    redteam.allowed("ping (ICMP datagram socket) to an allowlisted address")
    out = await probe(a, "raw")
    assert out.code != 0 and "EPERM" in out.text, out
    redteam.blocked("raw IP socket (SOCK_RAW)")
    out = await probe(a, "packet")
    assert out.code != 0 and "EPERM" in out.text, out
    redteam.blocked("packet socket (AF_PACKET)")
    out = await sh(a, f"arping -c1 -w1 -I eth0 {stack.attachment(a).gateway}")
    assert out.code != 0 and "not permitted" in out.text, out
    redteam.blocked("arping (ARP spoofing needs a packet socket)")
    out = await sh(a, f"traceroute -n -m 2 -w 1 {testhost.ip}")
    assert out.code != 0 and "not permitted" in out.text.lower(), out
    redteam.blocked("traceroute (raw ICMP receive socket)")


@needs_stack
async def test_routes_and_firewall_cannot_be_changed_from_inside(
    stack: SecStack, testhost: TestHost, host_listener: Listener, netprobe_bin: bytes, redteam: RedTeam
) -> None:
    th = await testhost.listen()
    a = await with_probe(await stack.create(network={"allow_out": [f"{testhost.ip}:{th.port}"]}), netprobe_bin)
    att = stack.attachment(a)
    rules_before = host_rules(stack.net.table)
    routes = await sh(a, "ip -4 route")
    assert routes.code == 0 and f"default via {att.gateway}" in routes.stdout, routes  # `ip` works (read)
    redteam.allowed("ip route (read) inside the sandbox")
    attempts = {
        "add a route": "ip route add 10.99.0.0/16 via " + att.gateway,
        "delete the default route": "ip route del default",
        "add an address (another sandbox's)": "ip addr add 10.210.255.254/32 dev eth0",
        "take eth0 down": "ip link set eth0 down",
        "change eth0's MAC": "ip link set eth0 address 02:00:00:00:00:01",
        "add a tunnel device": "ip link add t0 type dummy",
        "policy routing rule": "ip rule add from all lookup 100",
        "ifconfig eth0 down": "ifconfig eth0 down",
        "route add default gw": f"route add -net 10.98.0.0 netmask 255.255.0.0 gw {att.gateway}",
        "tc qdisc": "tc qdisc add dev eth0 root handle 1: htb",
        "enable forwarding (sysctl)": "sysctl -w net.ipv4.ip_forward=1",
        "re-enable IPv6 (sysctl)": "sysctl -w net.ipv6.conf.all.disable_ipv6=0",
        "new network namespace": "unshare -n true",
        "join the host's netns": "nsenter -t 1 -n true",
    }
    for what, cmd in attempts.items():
        out = await sh(a, cmd)
        assert out.code != 0 and any(s in out.text.lower() for s in ("not permitted", "read-only", "permission denied")), f"{what}: {out}"
        redteam.blocked(f"inside the sandbox: {what}")
    # bring your own nft: the host's nft binary with its libraries, run inside the sandbox
    libs = [l.split("=>")[1].split()[0] for l in run("ldd", shutil.which("nft") or "/usr/sbin/nft").stdout.splitlines() if "=>" in l]
    loader = next(l.split()[0] for l in run("ldd", shutil.which("nft") or "/usr/sbin/nft").stdout.splitlines() if "ld-linux" in l)
    for f in [*libs, loader, shutil.which("nft") or "/usr/sbin/nft"]:
        await a.files.write(f"/tmp/nft/{os.path.basename(f)}", Path(f).read_bytes(), mode=0o755)
    nft = f"/tmp/nft/{os.path.basename(loader)} --library-path /tmp/nft /tmp/nft/nft"
    out = await sh(a, f"{nft} --version")
    assert out.code == 0 and "nftables" in out.stdout, out
    redteam.allowed("nft runs inside the sandbox")
    for cmd in ("list ruleset", "flush ruleset", f"delete table inet {stack.net.table}", "add table inet mine"):
        out = await sh(a, f"{nft} {cmd}")
        assert out.code != 0 and "Operation not permitted" in out.text, f"nft {cmd}: {out}"
        redteam.blocked(f"inside the sandbox: nft {cmd}")
    out = await probe(a, "nft", stack.net.table)
    assert out.code != 0 and "EPERM" in out.text, out
    redteam.blocked("inside the sandbox: raw nfnetlink delete of the host's table")
    # nothing changed: the host's rules, the sandbox's routes, its reach
    assert host_rules(stack.net.table) == rules_before
    assert (await sh(a, "ip -4 route")).stdout == routes.stdout
    await reach(a, testhost.ip, th.port, redteam, "A still reaches its allowlisted port")
    await assert_blocked(await probe(a, "tcp", att.gateway, host_listener.port, "x"), "A -> host after the attempts", redteam)


@needs_stack
async def test_root_of_the_netns_still_cannot_pass(
    stack: SecStack, testhost: TestHost, host_listener: Listener, netprobe_bin: bytes, redteam: RedTeam
) -> None:
    """Worse than the sandbox can do: full root with every capability inside the sandbox's netns
    (nsenter from the host). It owns that netns -- flushes its rules, rewrites routes, spoofs
    addresses -- and still the host-side rules hold and stay untouched."""
    th = await testhost.listen()
    other = await testhost.listen()
    a = await with_probe(await stack.create(network={"allow_out": [f"{testhost.ip}:{th.port}"]}), netprobe_bin)
    b = await with_probe(await stack.create(network={"allow_out": [f"{testhost.ip}:{other.port}"]}), netprobe_bin)
    aa, ba = stack.attachment(a), stack.attachment(b)
    await reach(b, testhost.ip, other.port, redteam, "B -> its allowlisted port")
    other.tcp_peers.clear()
    rules_before = host_rules(stack.net.table)
    ns = ["nsenter", f"--net={aa.netns}"]
    for cmd in (["nft", "flush", "ruleset"], ["nft", "add table inet t; add chain inet t c { type filter hook output priority 0; policy accept; }"],
                ["ip", "route", "replace", "default", "via", aa.gateway], ["ip", "addr", "add", f"{ba.ip}/32", "dev", "eth0"],
                ["sysctl", "-qw", "net.ipv4.conf.all.rp_filter=0"]):
        r = run(*ns, *cmd, check=False)
        assert r.returncode == 0, (cmd, r.stderr)  # root of the netns can do all this ...
    redteam.allowed("root in the sandbox netns rewrote its own rules, routes and addresses")
    c0 = counters(stack.net.table)
    py = [*ns, sys.executable, "-c"]
    # spoof B's address to borrow B's allowlist
    spoof = run(*py, f"""
import socket
s = socket.socket(); s.settimeout(3); s.bind(("{ba.ip}", 0))
try:
    s.connect(("{testhost.ip}", {other.port})); print("connected")
except OSError as e:
    print(type(e).__name__)
""", check=False)
    assert "connected" not in spoof.stdout, spoof
    redteam.blocked("netns root spoofs another sandbox's source address to use its allowlist")
    run(*ns, "ip", "addr", "del", f"{ba.ip}/32", "dev", "eth0")
    # raw packets (root of the netns has CAP_NET_RAW there) to the host and to B
    raw = run(*py, f"""
import socket, time
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
for dst in ("{aa.gateway}", "{ba.ip}", "{testhost.gw}"):
    s.sendto(bytes([8, 0, 0xf7, 0xff, 0, 0, 0, 0]), (dst, 0))
s.settimeout(0.3)
end = time.time() + 1.5
while time.time() < end:
    try:
        d, a = s.recvfrom(200)
        print("icmp-type", d[(d[0] & 15) * 4], "from", a[0])
    except OSError:
        pass
""", check=True)
    types = [int(ln.split()[1]) for ln in raw.stdout.splitlines() if ln.startswith("icmp-type")]
    assert 0 not in types and types.count(3) >= 3, raw.stdout  # only "unreachable (admin prohibited)" comes back
    redteam.blocked("netns root sends raw ICMP to the host, sandbox B and the host's other interface")
    for ip, what in ((aa.gateway, "the veth's host end"), (ba.ip, "sandbox B")):
        r = run(*py, f"""
import socket
s = socket.socket(); s.settimeout(3)
try:
    s.connect(("{ip}", {host_listener.port})); print("connected")
except OSError as e:
    print(type(e).__name__)
""", check=False)
        assert "connected" not in r.stdout, (what, r)
        redteam.blocked(f"netns root -> {what} (TCP)")
    d = delta(c0, counters(stack.net.table))
    assert d.get("spoofed", 0) >= 1 and d.get("to_host", 0) >= 2 and d.get("between_sandboxes", 0) >= 1, d
    assert other.hits == 0 and host_listener.hits == 0
    # the host side did not move, and A's real allowlist still works (nothing else does)
    assert host_rules(stack.net.table) == rules_before
    redteam.blocked("netns root cannot change the host-side rules")
    await reach(a, testhost.ip, th.port, redteam, "A -> its allowlisted port afterwards")


@needs_stack
async def test_domain_allowlist_resolves_through_the_host(make_stack: Any, testhost: TestHost, netprobe_bin: bytes, redteam: RedTeam) -> None:
    from sdk.errors import DsecError

    dns = await DnsServer({"svc.dsec.test": [testhost.ip], "evil.dsec.test": ["127.0.0.1"], "meta.dsec.test": ["169.254.169.254"]}).start()
    try:
        st = await make_stack(network={"nameservers": (f"127.0.0.1:{dns.port}",)})
        lis = await testhost.listen()
        other = await testhost.listen()
        a = await with_probe(await st.create(network={"allow_out": [f"svc.dsec.test:{lis.port}"]}), netprobe_bin)
        assert "svc.dsec.test" in dns.queries  # the host agent asked the host's resolver
        redteam.allowed("the host agent resolved the allowlisted name")
        hosts = await a.files.read("/etc/hosts")
        assert f"{testhost.ip}\tsvc.dsec.test" in hosts and "127.0.0.1\tlocalhost" in hosts, hosts
        out = await sh(a, f"nc -w 3 svc.dsec.test {lis.port} </dev/null")
        assert out.code == 0 and "hello-from-testhost" in out.stdout, out
        redteam.allowed("the sandbox reaches the allowlisted name")
        ping = await sh(a, "ping -c1 -W1 svc.dsec.test")
        assert f"({testhost.ip})" in ping.stdout and ping.code != 0, ping  # resolves; ICMP not allowlisted (a :port entry)
        # The sandbox cannot do DNS of its own: the host's resolver, any resolver, is out of reach.
        n0 = len(dns.queries)
        out = await sh(a, f"nslookup svc.dsec.test {st.attachment(a).gateway}", timeout=30)
        assert out.code != 0, out
        redteam.blocked("sandbox queries DNS on the host (veth host end :53)")
        out = await sh(a, "nslookup other.dsec.test 127.0.0.1", timeout=30)
        assert out.code != 0, out
        redteam.blocked("sandbox queries DNS on 127.0.0.1 (its own loopback, not the host's)")
        await assert_blocked(await probe(a, "udp", testhost.ip, 53, "query"), "sandbox -> an outside DNS server (UDP 53)", redteam)
        assert len(dns.queries) == n0
        # Rewriting /etc/hosts would not help (Landlock keeps /etc read-only anyway): the sets hold IPs, not names.
        await sh(a, f"echo '{testhost.ip} other.dsec.test' >> /etc/hosts")
        await assert_blocked(await probe(a, "tcp", testhost.ip, other.port, "x"), "sandbox -> the allowlisted name's IP on another port", redteam)
        assert other.hits == 0
        # names that resolve only to forbidden addresses, or not at all, are refused at create
        for entry, why in (("evil.dsec.test", "never reach"), ("meta.dsec.test:80", "never reach"), ("nx.dsec.test", "cannot resolve")):
            with pytest.raises(DsecError) as ei:
                await st.create(network={"allow_out": [entry]})
            assert ei.value.code == "invalid_argument" and why in str(ei.value), ei.value
            redteam.blocked(f"allowlisted domain resolving to a forbidden/no address refused ({entry})")
    finally:
        dns.close()


@needs_stack
async def test_allowlist_validation_refuses_forbidden_entries(stack: SecStack, redteam: RedTeam) -> None:
    from sdk.errors import DsecError

    host_ip = host_ipv4_addresses()[0]
    pool_ip = str(ipaddress.IPv4Network(stack.net.pool).network_address + 6)
    bad = ["127.0.0.1", "127.0.0.0/8", "127.0.0.1:22", host_ip, f"{host_ip}:22", "169.254.169.254", "169.254.169.254:80",
           pool_ip, stack.net.pool, "224.0.0.1", "::1", "*.example.com", "no_such_thing!", "1.2.3.4:99999"]
    links_before = sorted(n for n in os.listdir("/sys/class/net") if n.startswith(stack.net.ifprefix))
    for entry in bad:
        with pytest.raises(DsecError) as ei:
            await stack.create(network={"allow_out": [entry]})
        assert ei.value.code == "invalid_argument" and entry.split(":")[0].strip("[]*") in str(ei.value), ei.value
        redteam.blocked(f"allowlist entry refused: {entry}")
    assert sorted(n for n in os.listdir("/sys/class/net") if n.startswith(stack.net.ifprefix)) == links_before
    assert not [n for n in os.listdir(stack.net.netns_dir) if n.startswith(stack.net.netns_prefix)]
    ok = await stack.create(network={"allow_out": ["0.0.0.0/0", "198.18.0.0/15:443", "198.51.100.1"]})
    assert stack.attachment(ok) is not None
    redteam.allowed("valid broad allowlist accepted")


@needs_stack
async def test_network_survives_a_hostagent_restart(
    stack: SecStack, testhost: TestHost, host_listener: Listener, netprobe_bin: bytes, redteam: RedTeam
) -> None:
    lis = await testhost.listen()
    a = await with_probe(await stack.create(network={"allow_out": [f"{testhost.ip}/32"]}), netprobe_bin)
    b = await with_probe(await stack.create(network={"allow_out": ["198.51.100.0/24"]}), netprobe_bin)
    gone = await stack.create(network={"allow_out": [f"{testhost.ip}/32"]})
    gone_if = stack.attachment(gone).ifname
    await reach(a, testhost.ip, lis.port, redteam, "A before the restart")
    await stack.new_hostagent()
    rules_after_restart = host_rules(stack.net.table)
    assert stack.attachment(a) is not None and stack.attachment(b) is not None  # re-learned
    await reach(a, testhost.ip, lis.port, redteam, "A after the restart")
    await assert_blocked(await probe(b, "tcp", testhost.ip, lis.port, "x"), "B after the restart (not allowlisted)", redteam)
    await assert_blocked(await probe(a, "tcp", stack.attachment(a).gateway, host_listener.port, "x"), "A -> host after the restart", redteam)
    c = await stack.create(network={"allow_out": [f"{testhost.ip}/32"]})
    assert stack.attachment(c).slot not in {stack.attachment(a).slot, stack.attachment(b).slot}
    assert len({stack.attachment(x).ip for x in (a, b, c)}) == 3
    await gone.kill()
    await eventually(lambda: not os.path.exists(f"/sys/class/net/{gone_if}"), timeout=15, what="the killed sandbox's veth to go")
    assert '"' + gone_if + '"' not in host_rules(stack.net.table)
    assert stack.attachment(a).ifname in rules_after_restart


@needs_stack
async def test_kill_leaves_no_network_state(stack: SecStack, testhost: TestHost, redteam: RedTeam) -> None:
    sbs = [await stack.create(network={"allow_out": [f"{testhost.ip}/32", f"198.51.100.7:{p}"]}) for p in (80, 443)]
    atts = [stack.attachment(s) for s in sbs]
    for att in atts:
        assert os.path.exists(att.netns) and os.path.exists(f"/sys/class/net/{att.ifname}")
        assert att.ifname in host_rules(stack.net.table)
    for s in sbs:
        await s.kill()
    for att in atts:
        assert not os.path.exists(att.netns)  # unmounted at once
        assert att.ifname not in host_rules(stack.net.table)  # allowlist gone at once (fail closed)
    await eventually(lambda: not any(os.path.exists(f"/sys/class/net/{a.ifname}") for a in atts), timeout=15, what="veths to go with their netns")
    assert network_leftovers(stack.net) == []


@needs_stack
async def test_setup_latency(stack: SecStack, testhost: TestHost, redteam: RedTeam, capsys: pytest.CaptureFixture[str]) -> None:
    """Setup/teardown cost of one sandbox network, in the agent (containers included) and alone."""
    m = stack.backend.net
    m.stats["setup_ms"].clear()
    m.stats["teardown_ms"].clear()
    sbs = [await stack.create(network={"allow_out": [f"{testhost.ip}/32", "198.51.100.0/24:443", "203.0.113.9"]}) for _ in range(20)]
    for s in sbs:
        await s.kill()
    in_agent = sorted(m.stats["setup_ms"]), sorted(m.stats["teardown_ms"])
    # the network alone (no containers), on a private config
    from tests.security.conftest import _free_prefix

    prefix = _free_prefix()
    cfg = network_config(prefix, table=f"dsec_b{prefix}", netns_prefix=f"dsec-b{prefix}-", pool="10.219.0.0/20")
    bench = NetworkManager(cfg)
    await bench.start()
    try:
        ids = [f"bench-{i}" for i in range(100)]
        for sid in ids:
            await bench.setup(sid, NetworkSpec(allow_out=[f"{testhost.ip}/32", "198.51.100.0/24:443"]))
        for sid in ids:
            await bench.teardown(sid)
        alone = sorted(bench.stats["setup_ms"]), sorted(bench.stats["teardown_ms"])
    finally:
        await bench.purge()
        await bench.stop()

    def pct(v: list[float], p: float) -> float:
        return v[min(len(v) - 1, int(p * len(v)))]

    with capsys.disabled():
        for name, (su, td) in (("in host agent (20)", in_agent), ("network alone (100)", alone)):
            print(f"\nnetwork {name}: setup p50 {pct(su, .5):.2f} ms p90 {pct(su, .9):.2f} ms max {su[-1]:.2f} ms;"
                  f" teardown p50 {pct(td, .5):.2f} ms p90 {pct(td, .9):.2f} ms max {td[-1]:.2f} ms")
    assert pct(alone[0], 0.5) < 10.0 and pct(alone[1], 0.5) < 10.0
    assert network_leftovers(cfg) == []
