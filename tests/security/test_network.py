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
import re
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

from hostagent.network import NetworkManager, compile_allowlist, parse_allow_out
from bus.errors import InvalidArgument, NotSupported
from bus.messages import NetworkSpec
from tests.conftest import eventually
from tests.netclaim import claim_net, lock_route
from tests.conftest import cannot_run, needs
from tests.security.conftest import SKIP_REASON, RedTeam, SecStack, network_leftovers, until

pytestmark = [pytest.mark.containerd]
needs_stack = needs(SKIP_REASON)

_libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNET = 0x40000000

# ----------------------------------------------------------------------------- the probe
NETPROBE_C = r"""
/* netprobe: one network action, one line of outcome.
 *   netprobe tcp IP PORT [MSG]   connect (3 s); send MSG, print the first reply line
 *   netprobe udp IP PORT MSG     send one datagram, wait 2 s for a reply
 *   netprobe icmp IP             ICMP echo through an unprivileged ping socket (SOCK_DGRAM)
 *   netprobe raw                 socket(AF_INET, SOCK_RAW, IPPROTO_ICMP)
 *   netprobe packet              socket(AF_PACKET, SOCK_RAW, ETH_P_ALL)
 *   netprobe nft TABLE           nfnetlink batch: delete table inet TABLE
 *   netprobe flood IP PORT N     N one-byte UDP datagrams to PORT, PORT+1, ... (1000 ports, cycled)
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
static int icmp(const char *ip) {
    struct sockaddr_in sa;
    if (addr(ip, "0", &sa)) { errno = EINVAL; return fail("address"); }
    int s = socket(AF_INET, SOCK_DGRAM, IPPROTO_ICMP);
    if (s < 0) return fail("socket(AF_INET, SOCK_DGRAM, IPPROTO_ICMP)");
    unsigned char req[16] = {8, 0, 0, 0, 0, 0, 0, 1, 'd', 's', 'e', 'c'};
    if (connect(s, (struct sockaddr *)&sa, sizeof sa) < 0) return fail("connect");
    if (send(s, req, sizeof req, 0) < 0) return fail("send");
    struct pollfd p = {s, POLLIN, 0};
    if (poll(&p, 1, 2000) == 0) { printf("timeout\n"); return 2; }
    unsigned char buf[256];
    ssize_t r = recv(s, buf, sizeof buf, 0);
    if (r < 0) return fail("recv");
    printf("ok icmp type %d\n", buf[0]);
    return buf[0] == 0 ? 0 : 1;
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
static int flood(const char *ip, const char *port, const char *count) {
    struct sockaddr_in sa;
    if (addr(ip, port, &sa)) { errno = EINVAL; return fail("address"); }
    int s = socket(AF_INET, SOCK_DGRAM, 0);
    if (s < 0) return fail("socket");
    int n = atoi(count), base = atoi(port), sent = 0;
    for (int i = 0; i < n; i++) {
        sa.sin_port = htons(base + i % 1000);
        if (sendto(s, "x", 1, 0, (struct sockaddr *)&sa, sizeof sa) == 1) sent++;
    }
    printf("ok sent %d\n", sent);
    return 0;
}
int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IONBF, 0);
    if (argc >= 4 && !strcmp(argv[1], "tcp")) return tcp(argv[2], argv[3], argc > 4 ? argv[4] : NULL);
    if (argc >= 5 && !strcmp(argv[1], "udp")) return udp(argv[2], argv[3], argv[4]);
    if (argc >= 3 && !strcmp(argv[1], "icmp")) return icmp(argv[2]);
    if (argc >= 2 && !strcmp(argv[1], "raw")) {
        if (socket(AF_INET, SOCK_RAW, IPPROTO_ICMP) < 0) return fail("socket(AF_INET, SOCK_RAW)");
        printf("ok raw socket\n"); return 0;
    }
    if (argc >= 2 && !strcmp(argv[1], "packet")) {
        if (socket(AF_PACKET, SOCK_RAW, htons(ETH_P_ALL)) < 0) return fail("socket(AF_PACKET)");
        printf("ok packet socket\n"); return 0;
    }
    if (argc >= 3 && !strcmp(argv[1], "nft")) return nft(argv[2]);
    if (argc >= 5 && !strcmp(argv[1], "flood")) return flood(argv[2], argv[3], argv[4]);
    fprintf(stderr, "usage: netprobe tcp|udp|raw|packet|nft ...\n");
    return 64;
}
"""

PROBE = "/tmp/netprobe"  # where it lives inside a sandbox (a Landlock-writable dir)


@pytest.fixture(scope="session")
def netprobe_bin() -> bytes:
    if shutil.which("gcc") is None:
        cannot_run("gcc not installed (needed to build the static probe)")
    d = tempfile.mkdtemp(prefix="dsec-netprobe-")
    try:
        src = Path(d, "netprobe.c")
        src.write_text(NETPROBE_C)
        r = subprocess.run(["gcc", "-static", "-O1", "-w", "-o", str(Path(d, "netprobe")), str(src)], capture_output=True, text=True)
        if r.returncode != 0:
            cannot_run(f"cannot build a static probe (static libc missing?): {r.stderr[-500:]}")
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
    """The host's sandbox ruleset as text, without counter values (nft -s) nor the drop log's
    token buckets (elements of set drop_log: kernel state every logged drop updates, not rules)."""
    text = subprocess.run(["nft", "-s", "list", "table", "inet", table], capture_output=True, text=True, check=True).stdout
    return re.sub(r"(set drop_log \{[^}]*?)\s*elements = \{[^}]*\}", r"\1", text)


def host_ipv4_addresses() -> list[str]:
    """The host's own IPv4 addresses that stay put during a test: not loopback, and not on the
    veths of sandboxes or test hosts (other tests' come and go -- an address that vanishes
    mid-probe would turn a local destination into one routed off this machine)."""
    r = subprocess.run(["ip", "-4", "-j", "addr"], capture_output=True, text=True, check=True)
    return [a["local"] for link in json.loads(r.stdout) if not link["ifname"].startswith(("ds", "dt"))
            for a in link.get("addr_info", []) if not a["local"].startswith("127.")]


def assert_stays_here(ip: str, *devs: str) -> None:
    """SAFETY: traffic to ``ip`` from a sandbox must end on this machine: a local address of the
    host, or routed to one of our own veths (``devs``)."""
    route = run("ip", "-4", "route", "get", ip).stdout
    assert route.startswith("local ") or any(f"dev {d} " in route + " " for d in devs), f"{ip} would leave this machine: {route}"


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
        self.extra_routes: list[str] = []
        self.route_locks: list[int] = []

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
        assert_stays_here(self.ip, self.veth)
        _OUR_DEVS.add(self.veth)

    async def add_service(self, ip: str) -> Listener:
        """Give the test host one more address (routed to it from the host) with a listener on it."""
        # A host route is machine-wide: a concurrent test's test host would route the same address
        # (the metadata one) to itself, and its clean-up would delete ours mid-test.
        self.route_locks.append(await asyncio.to_thread(lock_route, ip))
        run("ip", "netns", "exec", self.ns, "ip", "addr", "add", f"{ip}/32", "dev", "eth0")
        run("ip", "route", "add", f"{ip}/32", "via", self.ip, "dev", self.veth)
        self.extra_routes.append(ip)
        assert_stays_here(ip, self.veth)
        t, u = in_netns(self.nspath, lambda: _sockets(ip, 0))
        lis = await listen(t, u, "testhost")
        self.listeners.append(lis)
        return lis

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
        for ip in self.extra_routes:
            run("ip", "route", "del", f"{ip}/32", "via", self.ip, "dev", self.veth, check=False)  # ours only
        run("ip", "netns", "del", self.ns, check=False)
        run("ip", "link", "del", self.veth, check=False)
        for fd in self.route_locks:
            os.close(fd)
        _OUR_DEVS.discard(self.veth)


@pytest_asyncio.fixture(loop_scope="session")
async def testhost() -> AsyncIterator[TestHost]:
    if SKIP_REASON is not None:
        cannot_run(SKIP_REASON)
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


EXPECT = {"tcp": ("ECONNREFUSED",), "udp": ("EHOSTUNREACH", "timeout"), "icmp": ("EHOSTUNREACH", "timeout")}


async def blocked(rt: RedTeam, table: str | None, sb: Any, what: str, counter: str | None, *args: Any) -> Out:
    """Run one probe that must fail, and (``counter``) be stopped by that very host-side rule.

    A TCP connect our rules reject gets a reset at once (ECONNREFUSED); UDP and ICMP get ICMP
    admin-prohibited (EHOSTUNREACH), which the kernel rate-limits per peer, so a timeout is
    accepted there. Which rule fired is told by its named counter, read before and after.
    """
    before = counters(table) if counter else {}
    if str(args[0]) in ("tcp", "udp", "icmp"):
        _safe_target(str(args[1]))
    out = await probe(sb, *args)
    kind = str(args[0])
    expect = EXPECT.get(kind, ("EPERM",))
    assert out.code != 0 and any(e in out.text for e in expect), f"{what}: expected one of {expect}, got {out}"
    if counter:
        assert table is not None
        after = counters(table)
        assert after[counter] > before[counter], f"{what}: counter {counter} did not move ({delta(before, after)})"
    rt.blocked(f"{what} [{counter or (out.text.split()[1] if out.text.startswith('err') else out.text)}]")
    return out


_OUR_DEVS: set[str] = set()  # veths of this run's test hosts (filled by the fixture)


def _safe_target(ip: str) -> None:
    """SAFETY: never send from a sandbox to an address that would be routed off this machine."""
    if ip.startswith("127."):
        return  # the sandbox's own loopback
    assert_stays_here(ip, *_OUR_DEVS, *[n for n in os.listdir("/sys/class/net") if n.startswith("dsq")])


async def reach(sb: Any, ip: str, port: int, rt: RedTeam, what: str) -> str:
    _safe_target(ip)
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


class DnsServer:
    """A tiny authoritative DNS server on the host's loopback: the resolver the host agent is given.
    Names in ``garbage`` are answered with bytes that are no DNS reply (a broken server)."""

    __test__ = False

    def __init__(self, answers: dict[str, list[str]], garbage: tuple[str, ...] = ()) -> None:
        self.answers = answers
        self.garbage = garbage
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
                self.t.sendto(data[:2] + b"\x81\x80garbage" if srv.queries[-1] in srv.garbage else _dns_reply(data, srv.answers), addr)

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
    lis = await testhost.listen()
    links_before = {n for n in os.listdir("/sys/class/net") if n.startswith(stack.net.ifprefix)}
    plain = await with_probe(await stack.create(), netprobe_bin)
    assert stack.attachment(plain) is None
    assert {n for n in os.listdir("/sys/class/net") if n.startswith(stack.net.ifprefix)} == links_before
    links = (await sh(plain, "ip -o link")).stdout
    assert [ln.split(":")[1].strip() for ln in links.splitlines()] == ["lo"], links
    assert (await sh(plain, "ip -4 route")).stdout.strip() == ""
    for kind in ("tcp", "udp"):
        out = await probe(plain, kind, testhost.ip, lis.port, "x")
        assert out.code != 0 and "ENETUNREACH" in out.text, out
        redteam.blocked(f"no-network sandbox -> test host ({kind.upper()}) [ENETUNREACH: no route at all]")
    out = await probe(plain, "icmp", testhost.ip)
    assert out.code != 0 and "ENETUNREACH" in out.text, out
    redteam.blocked("no-network sandbox -> test host (ICMP) [ENETUNREACH]")
    assert lis.hits == 0
    # positive control: with the allowlist entry, the same destination is reachable
    allowed = await with_probe(await stack.create(network={"allow_out": [f"{testhost.ip}/32"]}), netprobe_bin)
    await reach(allowed, testhost.ip, lis.port, redteam, "allowlisted sandbox -> test host (TCP)")
    ping = await probe(allowed, "icmp", testhost.ip)
    assert ping.code == 0 and "ok icmp type 0" in ping.stdout, ping
    redteam.allowed("allowlisted sandbox -> test host (ICMP echo)")
    assert (await sh(allowed, "cat /proc/net/if_inet6")).stdout.strip() == ""  # no IPv6 at all


@needs_stack
async def test_allowlisted_cidr_reachable_only_by_its_sandbox(stack: SecStack, testhost: TestHost, netprobe_bin: bytes, redteam: RedTeam) -> None:
    lis = await testhost.listen()
    a = await with_probe(await stack.create(network={"allow_out": [f"{testhost.ip}/32"]}), netprobe_bin)
    b = await with_probe(await stack.create(network={"allow_out": ["198.51.100.0/24"]}), netprobe_bin)  # something else
    out = await reach(a, testhost.ip, lis.port, redteam, "A -> its allowlisted CIDR (TCP)")
    assert testhost.gw in out  # masqueraded behind the host
    udp = await probe(a, "udp", testhost.ip, lis.port, "ping")
    assert udp.code == 0 and "echo-from-testhost ping" in udp.stdout, udp
    redteam.allowed("A -> its allowlisted CIDR (UDP)")
    hits = lis.hits
    t = stack.net.table
    await blocked(redteam, t, b, "B -> A's allowlisted destination (TCP)", "not_allowed", "tcp", testhost.ip, lis.port, "x")
    await blocked(redteam, t, b, "B -> A's allowlisted destination (UDP)", "not_allowed", "udp", testhost.ip, lis.port, "x")
    await blocked(redteam, t, b, "B -> A's allowlisted destination (ICMP echo)", "not_allowed", "icmp", testhost.ip)
    assert lis.hits == hits, "the test host saw traffic from B"


@needs_stack
async def test_host_port_entry_opens_only_that_port(stack: SecStack, testhost: TestHost, netprobe_bin: bytes, redteam: RedTeam) -> None:
    open_ = await testhost.listen()
    closed = await testhost.listen()
    a = await with_probe(await stack.create(network={"allow_out": [f"{testhost.ip}:{open_.port}"]}), netprobe_bin)
    await reach(a, testhost.ip, open_.port, redteam, "A -> allowlisted host:port (TCP)")
    udp = await probe(a, "udp", testhost.ip, open_.port, "u")
    assert udp.code == 0 and "echo-from-testhost u" in udp.stdout, udp
    redteam.allowed("A -> allowlisted host:port (UDP)")
    t = stack.net.table
    await blocked(redteam, t, a, "A -> same host, another port (TCP)", "not_allowed", "tcp", testhost.ip, closed.port, "x")
    await blocked(redteam, t, a, "A -> same host, another port (UDP)", "not_allowed", "udp", testhost.ip, closed.port, "x")
    await blocked(redteam, t, a, "A -> a host:port entry does not open ICMP", "not_allowed", "icmp", testhost.ip)
    assert closed.hits == 0


@needs_stack
async def test_host_is_unreachable_even_when_everything_is_allowed(
    stack: SecStack, testhost: TestHost, host_listener: Listener, netprobe_bin: bytes, redteam: RedTeam
) -> None:
    """allow_out 0.0.0.0/0: the host's own addresses (all of them, incl. the veth's .1) stay closed."""
    th = await testhost.listen()
    a = await with_probe(await stack.create(network={"allow_out": ["0.0.0.0/0"]}), netprobe_bin)
    att = stack.attachment(a)
    # positive controls: the sandbox does have egress, and the host service is up on every address
    await reach(a, testhost.ip, th.port, redteam, "allow-all sandbox -> test host")
    for ip in ("127.0.0.1", *host_ipv4_addresses()):
        reader, writer = await asyncio.wait_for(asyncio.open_connection(ip, host_listener.port), 5)
        assert (await asyncio.wait_for(reader.readline(), 5)).startswith(b"hello-from-host")
        writer.close()
    redteam.allowed("the host's own service answers the host on all its addresses")
    host_listener.tcp_peers.clear()
    t = stack.net.table
    for ip in sorted(set(host_ipv4_addresses()) | {att.gateway, testhost.gw}):
        assert_stays_here(ip)
        what = "the veth's host end" if ip == att.gateway else f"host address {ip}"
        await blocked(redteam, t, a, f"allow-all sandbox -> {what} (TCP)", "to_host", "tcp", ip, host_listener.port, "x")
        await blocked(redteam, t, a, f"allow-all sandbox -> {what} (UDP)", "to_host", "udp", ip, host_listener.port, "x")
        await blocked(redteam, t, a, f"allow-all sandbox -> {what} (ICMP echo)", "to_host", "icmp", ip)
    # 127.0.0.1 inside the sandbox is the sandbox's own loopback, never the host's
    lo = await probe(a, "tcp", "127.0.0.1", host_listener.port, "x")
    assert lo.code != 0 and "ECONNREFUSED" in lo.text, lo
    redteam.blocked("allow-all sandbox -> 127.0.0.1 (the host's loopback services) [own loopback]")
    # The cloud metadata address is refused by the deny set, whatever the allowlist. For this
    # test it lives in the test host (routed there, so nothing could ever leave this machine):
    # the host itself reaches it, the allow-all sandbox does not.
    meta = await testhost.add_service("169.254.169.254")
    reader, writer = await asyncio.wait_for(asyncio.open_connection("169.254.169.254", meta.port), 5)
    assert (await asyncio.wait_for(reader.readline(), 5)).startswith(b"hello-from-testhost")
    writer.close()
    redteam.allowed("the (test) metadata service answers the host")
    meta.tcp_peers.clear()
    await blocked(redteam, t, a, "allow-all sandbox -> metadata 169.254.169.254 (TCP)", "denied", "tcp", "169.254.169.254", meta.port, "x")
    await blocked(redteam, t, a, "allow-all sandbox -> metadata 169.254.169.254 (UDP)", "denied", "udp", "169.254.169.254", meta.port, "x")
    assert meta.hits == 0
    assert host_listener.hits == 0, f"the host service was reached from the sandbox: {host_listener.tcp_peers + host_listener.udp_peers}"


@pytest.fixture
def nats_alias() -> Any:
    """A non-loopback address of this host (a /32 on lo) for NATS to listen on. Requested before
    ``make_stack`` so it goes away only after the stack has shut down."""
    ip = f"198.19.{random.randrange(256)}.{random.randrange(1, 255)}"
    run("ip", "addr", "add", f"{ip}/32", "dev", "lo")
    try:
        yield ip
    finally:
        run("ip", "addr", "del", f"{ip}/32", "dev", "lo", check=False)


@needs_stack
async def test_control_plane_is_unreachable(nats_alias: str, make_stack: Any, testhost: TestHost, netprobe_bin: bytes, redteam: RedTeam) -> None:
    """NATS listens on a non-loopback host address here (a /32 on lo), the whole stack runs over it;
    a sandbox allowed 0.0.0.0/0 still cannot reach it, and naming it in the allowlist is refused.
    containerd is a unix socket: it is not in the sandbox's filesystem at all."""
    from sdk.errors import DsecError

    nats_ip = nats_alias
    st = await make_stack(nats_host=nats_ip)
    assert st.url == f"nats://{nats_ip}:{st.nats.port}"
    th = await testhost.listen()
    a = await with_probe(await st.create(network={"allow_out": ["0.0.0.0/0"]}), netprobe_bin)
    await reach(a, testhost.ip, th.port, redteam, "allow-all sandbox -> test host")
    redteam.allowed("the stack itself talks to NATS over that address")  # the create above went through it
    t = st.net.table
    gw = st.attachment(a).gateway
    await blocked(redteam, t, a, "allow-all sandbox -> NATS client port", "to_host", "tcp", nats_ip, st.nats.port, "CONNECT {}")
    await blocked(redteam, t, a, "allow-all sandbox -> NATS monitoring port", "to_host", "tcp", nats_ip, st.nats.monitor_port, "GET /varz")
    await blocked(redteam, t, a, "allow-all sandbox -> NATS port via the veth's host end", "to_host", "tcp", gw, st.nats.port, "x")
    for entry in (f"{nats_ip}:{st.nats.port}", nats_ip, f"127.0.0.1:{st.nats.port}"):
        with pytest.raises(DsecError) as ei:
            await st.create(network={"allow_out": [entry]})
        assert ei.value.code == "invalid_argument" and "never reachable" in str(ei.value), ei.value
        redteam.blocked(f"allowlist naming the control plane refused ({entry}) [invalid_argument]")
    # containerd's socket: present on the host, absent from the sandbox's filesystem
    sock = st.backend.daemon.address
    assert Path(sock).is_socket()
    redteam.allowed("containerd socket exists on the host")
    out = await sh(a, f"ls -la {sock} {os.path.dirname(sock)} /run/containerd")
    assert out.code != 0 and "containerd.sock" not in out.stdout and out.stderr.count("No such file") == 3, out
    sockets = (await sh(a, "find / \\( -path /proc -o -path /sys \\) -prune -o -type s -print")).stdout.split()
    assert sockets == ["/.dsec/run/agent.sock"], sockets
    redteam.blocked("containerd socket not visible in the sandbox filesystem [only its own agent socket is]")


@needs_stack
async def test_sandboxes_cannot_reach_each_other(stack: SecStack, testhost: TestHost, netprobe_bin: bytes, redteam: RedTeam) -> None:
    from sdk.errors import DsecError

    a = await with_probe(await stack.create(network={"allow_out": ["0.0.0.0/0"]}), netprobe_bin)
    b = await with_probe(await stack.create(network={"allow_out": ["0.0.0.0/0"]}), netprobe_bin)
    aa, ba = stack.attachment(a), stack.attachment(b)
    assert ipaddress.IPv4Network(f"{aa.ip}/30", strict=False) != ipaddress.IPv4Network(f"{ba.ip}/30", strict=False)
    started = await sh(b, "setsid nc -ll -p 7000 -e /bin/echo listener-b </dev/null >/dev/null 2>&1 &")
    assert started.code == 0, started

    async def b_listens() -> bool:
        return (await probe(b, "tcp", ba.ip, 7000)).stdout.startswith("ok")

    await eventually(b_listens, timeout=10, what="B's listener")
    own = await probe(b, "tcp", ba.ip, 7000, "x")
    assert own.code == 0 and "listener-b" in own.stdout, own
    redteam.allowed("B's listener answers B")
    t = stack.net.table
    await blocked(redteam, t, a, "sandbox A -> sandbox B (TCP)", "between_sandboxes", "tcp", ba.ip, 7000, "x")
    await blocked(redteam, t, a, "sandbox A -> sandbox B (UDP)", "between_sandboxes", "udp", ba.ip, 7000, "x")
    await blocked(redteam, t, a, "sandbox A -> sandbox B (ICMP echo)", "between_sandboxes", "icmp", ba.ip)
    await blocked(redteam, t, a, "sandbox A -> B's veth host end", "to_host", "tcp", ba.gateway, 7000, "x")
    # nothing from outside can open a connection into a sandbox either
    c0 = counters(t)
    assert testhost.connect_from_here(ba.ip, 7000) == "TimeoutError"
    assert counters(t)["inbound"] > c0["inbound"]
    redteam.blocked("outside (test host) -> sandbox B (inbound TCP) [inbound]")
    # and another sandbox's address (the pool) cannot be allowlisted
    for entry in (ba.ip, f"{ba.ip}:7000", stack.net.pool):
        with pytest.raises(DsecError) as ei:
            await stack.create(network={"allow_out": [entry]})
        assert ei.value.code == "invalid_argument", ei.value
        redteam.blocked(f"allowlist naming another sandbox refused ({entry}) [invalid_argument]")


@needs_stack
async def test_raw_sockets_are_refused(stack: SecStack, testhost: TestHost, netprobe_bin: bytes, redteam: RedTeam) -> None:
    a = await with_probe(await stack.create(network={"allow_out": [f"{testhost.ip}/32"]}), netprobe_bin)
    # positive control: ICMP echo through the unprivileged ping socket works
    ping = await probe(a, "icmp", testhost.ip)
    assert ping.code == 0 and "ok icmp type 0" in ping.stdout, ping
    redteam.allowed("ICMP echo (datagram ping socket) to an allowlisted address")
    for kind, what in (("raw", "raw IP socket (SOCK_RAW)"), ("packet", "packet socket (AF_PACKET)")):
        out = await probe(a, kind)
        assert out.code != 0 and "EPERM" in out.text, out
        redteam.blocked(f"{what} [EPERM: no CAP_NET_RAW]")
    for cmd, what in ((f"ping -c1 -W1 {testhost.ip}", "busybox ping (raw ICMP socket)"),
                      (f"arping -c1 -w1 -I eth0 {stack.attachment(a).gateway}", "arping (ARP spoofing needs a packet socket)"),
                      (f"traceroute -n -m 2 -w 1 {testhost.ip}", "traceroute (raw ICMP receive socket)")):
        out = await sh(a, cmd)
        assert out.code != 0 and any(x in out.text.lower() for x in ("not permitted", "permission denied")), out
        redteam.blocked(f"{what} [EPERM]")


@needs_stack
async def test_routes_and_firewall_cannot_be_changed_from_inside(
    stack: SecStack, testhost: TestHost, host_listener: Listener, netprobe_bin: bytes, redteam: RedTeam
) -> None:
    th = await testhost.listen()
    a = await with_probe(await stack.create(network={"allow_out": [f"{testhost.ip}:{th.port}"]}), netprobe_bin)
    att = stack.attachment(a)
    rules_before = host_rules(stack.net.table)
    routes = await sh(a, "ip -4 route")
    assert routes.code == 0 and f"default via {att.gateway}" in routes.stdout, routes  # `ip` itself works
    redteam.allowed("ip route (read) inside the sandbox")
    attempts = {
        "add a route": f"ip route add 10.99.0.0/16 via {att.gateway}",
        "delete the default route": "ip route del default",
        "add another sandbox's address": "ip addr add 10.210.255.254/32 dev eth0",
        "take eth0 down": "ip link set eth0 down",
        "change eth0's MAC": "ip link set eth0 address 02:00:00:00:00:01",
        "add a link": "ip link add t0 type bridge",
        "add a policy routing rule": "ip rule add from all lookup 100",
        "ifconfig eth0 down": "ifconfig eth0 down",
        "route add": f"route add -net 10.98.0.0 netmask 255.255.0.0 gw {att.gateway}",
        "static ARP entry (neighbour table)": f"arp -s {att.gateway} 02:00:00:00:00:02",
        "enable forwarding (sysctl)": "sysctl -w net.ipv4.ip_forward=1",
        "re-enable IPv6 (sysctl)": "sysctl -w net.ipv6.conf.all.disable_ipv6=0",
        "a new network namespace": "unshare -n true",
        "join another netns": "nsenter -t 1 -n true",
    }
    for what, cmd in attempts.items():
        out = await sh(a, cmd)
        assert out.code != 0 and any(x in out.text.lower() for x in ("not permitted", "read-only", "permission denied")), f"{what}: {out}"
        redteam.blocked(f"inside the sandbox: {what} [{out.text.splitlines()[-1][:60]}]")
    # bring your own nft: the host's nft binary and its libraries, run inside the sandbox
    nft_bin = shutil.which("nft") or "/usr/sbin/nft"
    ldd = run("ldd", nft_bin).stdout.splitlines()
    files = [ln.split("=>")[1].split()[0] for ln in ldd if "=>" in ln] + [ln.split()[0] for ln in ldd if "ld-linux" in ln and "=>" not in ln] + [nft_bin]
    loader = next(os.path.basename(f) for f in files if "ld-linux" in f)
    for f in files:
        await a.files.write(f"/tmp/nft/{os.path.basename(f)}", Path(f).read_bytes(), mode=0o755)
    nft = f"/tmp/nft/{loader} --library-path /tmp/nft /tmp/nft/nft"
    out = await sh(a, f"{nft} --version")
    assert out.code == 0 and "nftables" in out.stdout, out
    redteam.allowed("nft runs inside the sandbox")
    for cmd in ("list ruleset", "flush ruleset", f"delete table inet {stack.net.table}", "add table inet mine"):
        out = await sh(a, f"{nft} {cmd}")
        assert out.code != 0 and "Operation not permitted" in out.text, f"nft {cmd}: {out}"
        redteam.blocked(f"inside the sandbox: nft {cmd} [EPERM]")
    out = await probe(a, "nft", stack.net.table)
    assert out.code != 0 and "EPERM" in out.text, out
    redteam.blocked("inside the sandbox: raw nfnetlink batch deleting the host's table [EPERM]")
    # nothing moved: the host's rules, the sandbox's routes, what it can reach
    assert host_rules(stack.net.table) == rules_before
    assert (await sh(a, "ip -4 route")).stdout == routes.stdout
    await reach(a, testhost.ip, th.port, redteam, "A still reaches its allowlisted port")
    await blocked(redteam, stack.net.table, a, "A -> host after the attempts", "to_host", "tcp", att.gateway, host_listener.port, "x")


NS_CONNECT = """
import socket, sys
s = socket.socket(); s.settimeout(3)
if sys.argv[3]: s.bind((sys.argv[3], 0))
try:
    s.connect((sys.argv[1], int(sys.argv[2]))); print("connected")
except OSError as e:
    print(type(e).__name__)
"""

NS_RAW_ICMP = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
for dst in sys.argv[1:]:
    s.sendto(bytes([8, 0, 0xf7, 0xff, 0, 0, 0, 0]), (dst, 0))
s.settimeout(0.2)
end = time.time() + 1.5
while time.time() < end:
    try:
        d, a = s.recvfrom(200)
        print("icmp-type", d[(d[0] & 15) * 4], "from", a[0])
    except OSError:
        pass
"""


@needs_stack
async def test_root_of_the_netns_still_cannot_pass(
    stack: SecStack, testhost: TestHost, host_listener: Listener, netprobe_bin: bytes, redteam: RedTeam
) -> None:
    """Worse than the sandbox can do: full root, every capability, inside the sandbox's netns
    (nsenter from the host). It owns that netns -- flushes its rules, rewrites routes, spoofs
    addresses, sends raw packets -- and still the host-side rules hold and stay untouched."""
    th = await testhost.listen()
    other = await testhost.listen()
    a = await with_probe(await stack.create(network={"allow_out": [f"{testhost.ip}:{th.port}"]}), netprobe_bin)
    b = await with_probe(await stack.create(network={"allow_out": [f"{testhost.ip}:{other.port}"]}), netprobe_bin)
    aa, ba = stack.attachment(a), stack.attachment(b)
    await reach(b, testhost.ip, other.port, redteam, "B -> its allowlisted port")
    other.tcp_peers.clear()
    t = stack.net.table
    rules_before = host_rules(t)
    ns = ["nsenter", f"--net={aa.netns}"]
    for cmd in (["nft", "flush", "ruleset"],
                ["nft", "add table inet t; add chain inet t c { type filter hook output priority 0; policy accept; }"],
                ["ip", "route", "replace", "default", "via", aa.gateway],
                ["sysctl", "-qw", "net.ipv4.conf.all.rp_filter=0"],
                ["ip", "addr", "add", f"{ba.ip}/32", "dev", "eth0"]):
        r = run(*ns, *cmd, check=False)
        assert r.returncode == 0, (cmd, r.stderr)
    redteam.allowed("root of the sandbox netns rewrote its own rules, routes and addresses")

    def ns_py(script: str, *args: str) -> str:
        return run(*ns, sys.executable, "-c", script, *args, check=False).stdout

    # 1. spoof B's address to borrow B's allowlist
    c0 = counters(t)
    out = ns_py(NS_CONNECT, testhost.ip, str(other.port), ba.ip)
    assert "connected" not in out and counters(t)["spoofed"] > c0["spoofed"], out
    redteam.blocked("netns root spoofs sandbox B's address to use B's allowlist [spoofed]")
    run(*ns, "ip", "addr", "del", f"{ba.ip}/32", "dev", "eth0")
    # 2. plain connects to the host and to B
    for ip, what, counter in ((aa.gateway, "the veth's host end", "to_host"), (ba.ip, "sandbox B", "between_sandboxes"),
                              (testhost.gw, "the host's other interface", "to_host")):
        c0 = counters(t)
        out = ns_py(NS_CONNECT, ip, str(host_listener.port), "")
        assert "connected" not in out and counters(t)[counter] > c0[counter], (what, out)
        redteam.blocked(f"netns root -> {what} (TCP) [{counter}]")
    # 3. raw ICMP (root of the netns has CAP_NET_RAW there): only "admin prohibited" comes back
    c0 = counters(t)
    out = ns_py(NS_RAW_ICMP, aa.gateway, ba.ip, testhost.gw)
    types = [int(ln.split()[1]) for ln in out.splitlines() if ln.startswith("icmp-type")]
    d = delta(c0, counters(t))
    assert 0 not in types and d.get("to_host", 0) >= 2 and d.get("between_sandboxes", 0) >= 1, (out, d)
    redteam.blocked("netns root sends raw ICMP echo to the host, its other interface and sandbox B [to_host, between_sandboxes]")
    # 4. the host's loopback: route 127/8 out of eth0 instead of lo (the host drops such martians)
    for cmd in (["ip", "route", "del", "local", "127.0.0.0/8", "dev", "lo", "table", "local"],
                ["ip", "route", "add", "127.0.0.0/8", "via", aa.gateway, "dev", "eth0", "onlink"]):
        r = run(*ns, *cmd, check=False)
        assert r.returncode == 0, (cmd, r.stderr)
    out = ns_py(NS_CONNECT, "127.0.0.1", str(host_listener.port), "")
    assert "connected" not in out, out
    redteam.blocked("netns root routes 127.0.0.0/8 to the host to reach its loopback services [martian, dropped]")
    # 5. a port A's allowlist does not name
    c0 = counters(t)
    out = ns_py(NS_CONNECT, testhost.ip, str(other.port), "")
    assert "connected" not in out and counters(t)["not_allowed"] > c0["not_allowed"], out
    redteam.blocked("netns root -> a test-host port not on A's allowlist [not_allowed]")
    assert other.hits == 0 and host_listener.hits == 0
    # the host side did not move, and A's real allowlist still works
    assert host_rules(t) == rules_before
    redteam.blocked("netns root cannot change the host-side rules [ruleset unchanged]")
    await reach(a, testhost.ip, th.port, redteam, "A -> its allowlisted port afterwards")


@needs_stack
async def test_domain_allowlist_resolves_through_the_host(make_stack: Any, testhost: TestHost, netprobe_bin: bytes, redteam: RedTeam) -> None:
    from sdk.errors import DsecError

    answers = {"svc.dsec.test": [testhost.ip], "evil.dsec.test": ["127.0.0.1"], "meta.dsec.test": ["169.254.169.254"]}
    dns = await DnsServer(answers, garbage=("broken.dsec.test",)).start()
    try:
        st = await make_stack(network={"nameservers": (f"127.0.0.1:{dns.port}",)})
        lis = await testhost.listen()
        other = await testhost.listen()
        a = await with_probe(await st.create(network={"allow_out": [f"svc.dsec.test:{lis.port}"]}), netprobe_bin)
        assert "svc.dsec.test" in dns.queries  # the host agent asked the resolver it was given
        redteam.allowed("the host agent resolved the allowlisted name through its resolver")
        hosts = await a.files.read("/etc/hosts")
        assert f"{testhost.ip}\tsvc.dsec.test" in hosts and "127.0.0.1\tlocalhost" in hosts, hosts
        out = await sh(a, f"nc -w 3 svc.dsec.test {lis.port} </dev/null")
        assert out.code == 0 and "hello-from-testhost" in out.stdout, out
        redteam.allowed("the sandbox reaches the allowlisted name by name")
        # The sandbox has no DNS of its own: the host's resolver and any other are out of reach.
        t = st.net.table
        n0 = len(dns.queries)
        gw = st.attachment(a).gateway
        await blocked(redteam, t, a, "sandbox -> DNS on the veth's host end (UDP 53)", "to_host", "udp", gw, 53, "q")
        await blocked(redteam, t, a, "sandbox -> the host agent's resolver port via the veth", "to_host", "udp", gw, dns.port, "q")
        await blocked(redteam, t, a, "sandbox -> an outside DNS server (UDP 53)", "not_allowed", "udp", testhost.ip, 53, "q")
        out = await sh(a, "nslookup other.dsec.test 127.0.0.1", timeout=30)
        assert out.code != 0, out
        redteam.blocked("sandbox -> DNS on 127.0.0.1 (its own loopback, not the host's)")
        assert len(dns.queries) == n0
        # /etc/hosts is the sandbox's to read, not to widen: the sets hold addresses, not names
        await sh(a, f"echo '{testhost.ip} other.dsec.test' >> /etc/hosts")
        await blocked(redteam, t, a, "sandbox -> the allowlisted name's address on another port", "not_allowed", "tcp", testhost.ip, other.port, "x")
        assert other.hits == 0
        # names that resolve only to forbidden addresses, or not at all, are refused at create
        for entry, why in (("evil.dsec.test", "never reach"), ("meta.dsec.test:80", "never reach"), ("nx.dsec.test", "cannot resolve")):
            with pytest.raises(DsecError) as ei:
                await st.create(network={"allow_out": [entry]})
            assert ei.value.code == "invalid_argument" and why in str(ei.value), ei.value
            redteam.blocked(f"allowlisted domain resolving to a forbidden or no address refused ({entry}) [invalid_argument]")
        # a nameserver that answers garbage: the create fails typed (the host could not resolve), and the agent serves on
        with pytest.raises(DsecError) as ei:
            await st.create(network={"allow_out": ["broken.dsec.test"]})
        assert ei.value.code == "create_failed" and "cannot resolve broken.dsec.test" in str(ei.value) and "malformed" in str(ei.value), ei.value
        redteam.blocked("allowlisted domain whose nameserver answers garbage refused [create_failed]")
        assert st.attachment(await st.create(network={"allow_out": [f"svc.dsec.test:{lis.port}"]})) is not None
        redteam.allowed("the next create with a resolvable name works")
    finally:
        dns.close()


@needs_stack
async def test_allowlist_validation_refuses_forbidden_entries(stack: SecStack, redteam: RedTeam) -> None:
    from sdk.errors import DsecError

    host_ip = host_ipv4_addresses()[0]
    pool_ip = str(ipaddress.IPv4Network(stack.net.pool).network_address + 6)
    bad = ["127.0.0.1", "127.0.0.0/8", "127.0.0.1:22", host_ip, f"{host_ip}:22", "169.254.169.254", "169.254.169.254:80",
           pool_ip, stack.net.pool, "224.0.0.1", "::1", "*.example.com", "no_such_thing!", "1.2.3.4:99999"]
    for entry in bad:
        with pytest.raises(DsecError) as ei:
            await stack.create(network={"allow_out": [entry]})
        assert ei.value.code == "invalid_argument" and entry.split(":")[0].strip("[]*") in str(ei.value), ei.value
        redteam.blocked(f"allowlist entry refused: {entry} [invalid_argument]")
    assert stack.network_leftovers(warm_ok=True) == []  # nothing was set up for any of them
    ok = await stack.create(network={"allow_out": ["0.0.0.0/0", "198.18.0.0/15:443", "198.51.100.1"]})
    assert stack.attachment(ok) is not None
    redteam.allowed("a valid broad allowlist is accepted")


@needs_stack
async def test_network_survives_a_hostagent_restart(
    stack: SecStack, testhost: TestHost, host_listener: Listener, netprobe_bin: bytes, redteam: RedTeam
) -> None:
    lis = await testhost.listen()
    a = await with_probe(await stack.create(network={"allow_out": [f"{testhost.ip}/32"]}), netprobe_bin)
    b = await with_probe(await stack.create(network={"allow_out": ["198.51.100.0/24"]}), netprobe_bin)
    c = await stack.create(network={"allow_out": [f"{testhost.ip}/32"]})
    c_if = stack.attachment(c).ifname
    await reach(a, testhost.ip, lis.port, redteam, "A before the restart")
    await stack.new_hostagent()  # a fresh agent (and backend) on the same data dir; sandboxes live on
    assert stack.attachment(a) is not None and stack.attachment(b) is not None  # re-learned
    await reach(a, testhost.ip, lis.port, redteam, "A after the restart")
    t = stack.net.table
    await blocked(redteam, t, b, "B after the restart (not allowlisted)", "not_allowed", "tcp", testhost.ip, lis.port, "x")
    await blocked(redteam, t, a, "A -> host after the restart", "to_host", "tcp", stack.attachment(a).gateway, host_listener.port, "x")
    d = await stack.create(network={"allow_out": [f"{testhost.ip}/32"]})
    assert len({stack.attachment(x).slot for x in (a, b, c, d)}) == 4  # no /30 handed out twice
    await c.kill()
    assert f'"{c_if}"' not in host_rules(t)
    await eventually(lambda: not os.path.exists(f"/sys/class/net/{c_if}"), timeout=15, what="the killed sandbox's veth to go")


@needs_stack
async def test_allowlist_replaced_while_the_sandbox_runs(stack: SecStack, testhost: TestHost, netprobe_bin: bytes, redteam: RedTeam) -> None:
    """``set_network`` (E2B's update_network) swaps a running sandbox's allowlist in the kernel: what it
    no longer names is blocked at once, what it names now passes, a host agent restart keeps the new
    one, and a sandbox created without a network has none to open."""
    lis = await testhost.listen()
    t = stack.net.table
    a = await with_probe(await stack.create(network={"allow_out": ["198.51.100.0/24"]}), netprobe_bin)
    await blocked(redteam, t, a, "A -> test host before its allowlist names it", "not_allowed", "tcp", testhost.ip, lis.port, "x")
    await a.set_network({"allow_out": [f"{testhost.ip}/32"]})
    await reach(a, testhost.ip, lis.port, redteam, "A -> test host once set_network names it")
    rules = host_rules(t)
    assert testhost.ip in rules and "198.51.100.0/24" not in rules, rules
    await a.set_network({"allow_out": [f"{testhost.ip}/32"]})  # the same again: nothing changes
    await stack.new_hostagent()  # the new allowlist is what a restarted agent re-arms
    await reach(a, testhost.ip, lis.port, redteam, "A -> test host after a host agent restart")
    await a.set_network(None)
    await blocked(redteam, t, a, "A -> test host after set_network(None)", "not_allowed", "tcp", testhost.ip, lis.port, "x")
    assert testhost.ip not in host_rules(t)
    b = await stack.create()
    with pytest.raises(NotSupported) as ei:
        await b.set_network({"allow_out": [f"{testhost.ip}/32"]})
    assert ei.value.code == "not_supported" and "created without a network" in ei.value.description
    await b.set_network(None)  # no egress, which it has: accepted
    with pytest.raises(InvalidArgument):
        await a.set_network({"allow_out": ["*.example.com"]})


@needs_stack
async def test_kill_leaves_no_network_state(stack: SecStack, testhost: TestHost) -> None:
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
    assert stack.network_leftovers(warm_ok=True) == []  # the agent's pre-made networks aside


@needs_stack
async def test_networks_made_inline_and_from_the_warm_pool(stack: SecStack, testhost: TestHost) -> None:
    """Sandbox creates with and without a network, and the network manager alone on private names:
    without a warm pool every network is made inline, with one the creates are served from it; each
    setup gives a working attachment and teardown removes it all. (Its speed: tests/bench/bench_network.py.)"""
    m = stack.backend.net
    allow = [f"{testhost.ip}/32", "198.51.100.0/24:443", "203.0.113.9"]
    small = {"disk_mb": 64, "memory_mb": 64}
    plain = [await stack.create(**small) for _ in range(2)]
    sbs = [await stack.create(network={"allow_out": allow}, **small) for _ in range(3)]
    assert all(stack.attachment(s) is not None for s in sbs) and all(stack.attachment(s) is None for s in plain)
    assert len(m.stats["setup_ms"]) >= len(sbs)
    for s in sbs + plain:
        await s.kill()
    for pool, gap in ((0, 0.0), (4, 0.05)):
        claim = await asyncio.to_thread(claim_net)
        try:
            cfg = claim.config(warm_pool=pool)
            bench = NetworkManager(cfg)
            await bench.start()
            try:
                ids, ifnames = [f"bench-{i}" for i in range(6)], []
                for sid in ids:
                    if gap:
                        await asyncio.sleep(gap)  # the rest of a create: the pool refills meanwhile
                    att = await bench.setup(sid, NetworkSpec(allow_out=allow))
                    assert os.path.exists(att.netns) and os.path.exists(f"/sys/class/net/{att.ifname}")
                    assert att.ifname in host_rules(cfg.table)
                    ifnames.append(att.ifname)
                hits, misses = len(bench.stats["pool_hits"]), len(bench.stats["pool_misses"])
                assert hits + misses == len(ids)
                assert (hits == 0) if pool == 0 else (hits > 0), bench.stats
                for sid in ids:
                    await bench.teardown(sid)
                rules = host_rules(cfg.table)
                assert all(bench.attachment(sid) is None for sid in ids) and not [n for n in ifnames if n in rules]  # fail closed at once
            finally:
                await bench.purge()
                await bench.stop()
            await eventually(lambda cfg=cfg: not network_leftovers(cfg), timeout=15, what="the networks to be gone")
        finally:
            claim.release()


# ============================================================================= drops reach the guard
class Violations:
    """Every GuardViolation published on the stack's bus, as it arrives."""

    __test__ = False

    def __init__(self) -> None:
        self.got: list[Any] = []
        self._sub: Any = None

    async def start(self, nc: Any) -> "Violations":
        from bus import codec
        from bus import subjects as S

        async def on(msg: Any) -> None:
            self.got.append(codec.EVENT.decode(msg.data))

        self._sub = await nc.subscribe(S.EVT_GUARD_VIOLATION, cb=on)
        await nc.flush()
        return self

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()

    def network(self, sid: str) -> list[Any]:
        return [v for v in self.got if v.kind == "network" and v.sandbox_id == sid]

    def find(self, sid: str, proto: str, dst: str, dport: int | None = None) -> Any:
        return next((v for v in self.network(sid) if v.detail.get("proto") == proto and v.detail.get("dst") == dst
                     and (dport is None or v.detail.get("dport") == str(dport))), None)

    async def expect(self, sid: str, proto: str, dst: str, dport: int | None, rule: str) -> Any:
        await eventually(lambda: self.find(sid, proto, dst, dport), timeout=10, what=f"a network violation of {sid}: {proto} {dst}:{dport}")
        v = self.find(sid, proto, dst, dport)
        assert v.detail["rule"] == rule and v.detail.get("source") == "guard.kernel" and v.host_id, v
        assert v.what == (f"{proto} {dst}:{dport}" if dport is not None else v.what), v
        return v


async def _guarded_stack(make_stack: Any, **kw: Any) -> tuple[SecStack, Violations]:
    st = await make_stack(guard=True, **kw)
    if st.guard.nflog is None:
        pytest.fail(f"guard could not bind NFLOG group {st.net.log_group} (another listener on this machine holds it?)")
    return st, await Violations().start(st.nc)


@needs_stack
async def test_dropped_packets_are_reported_for_their_sandbox(
    nats_alias: str, make_stack: Any, testhost: TestHost, host_listener: Listener, netprobe_bin: bytes, redteam: RedTeam
) -> None:
    """Each denied packet a sandbox sends -- to the host, the control plane, another sandbox, a
    destination its allowlist does not name -- becomes a guard violation naming that sandbox and
    what it tried; allowed traffic is not reported."""
    st, vs = await _guarded_stack(make_stack, nats_host=nats_alias)
    try:
        th = await testhost.listen()
        other = await testhost.listen()
        a = await with_probe(await st.create(network={"allow_out": [f"{testhost.ip}:{th.port}"]}), netprobe_bin)
        b = await with_probe(await st.create(network={"allow_out": ["198.51.100.0/24"]}), netprobe_bin)
        aa, ba = st.attachment(a), st.attachment(b)
        t = st.net.table
        # positive control: allowed TCP and UDP are neither logged by the kernel nor reported
        c0 = counters(t)
        await reach(a, testhost.ip, th.port, redteam, "A -> its allowlisted host:port (TCP), not reported")
        udp = await probe(a, "udp", testhost.ip, th.port, "u")
        assert udp.code == 0 and "echo-from-testhost u" in udp.stdout, udp
        redteam.allowed("A -> its allowlisted host:port (UDP), not reported")
        assert counters(t)["logged"] == c0["logged"], delta(c0, counters(t))
        host_ip = next(ip for ip in host_ipv4_addresses() if ip != nats_alias)
        attacks = [
            ("the host (veth's host end), TCP", "to_host", "tcp", aa.gateway, host_listener.port),
            (f"the host ({host_ip}), UDP", "to_host", "udp", host_ip, host_listener.port),
            ("NATS client port", "to_host", "tcp", nats_alias, st.nats.port),
            ("NATS client port, UDP", "to_host", "udp", nats_alias, st.nats.port),
            ("sandbox B", "between_sandboxes", "tcp", ba.ip, 7000),
            ("sandbox B, UDP", "between_sandboxes", "udp", ba.ip, 7001),
            ("a non-allowlisted port, TCP", "not_allowed", "tcp", testhost.ip, other.port),
            ("a non-allowlisted port, UDP", "not_allowed", "udp", testhost.ip, other.port),
        ]
        for what, rule, proto, ip, port in attacks:
            await blocked(redteam, t, a, f"A -> {what}", rule, proto, ip, port, "x")
            v = await vs.expect(a.sandbox_id, proto, ip, port, rule)
            assert v.action == "record" and v.detail["src"] == aa.ip and v.detail["ifname"] == aa.ifname, v
            redteam.blocked(f"A -> {what}: reported to guard as {v.what!r} [{rule}]")
        # ICMP has no port: reported by type
        await blocked(redteam, t, a, "A -> sandbox B (ICMP echo)", "between_sandboxes", "icmp", ba.ip)
        v = await vs.expect(a.sandbox_id, "icmp", ba.ip, None, "between_sandboxes")
        assert v.what == f"icmp {ba.ip} type 8", v
        # the other sandbox did nothing and is blamed for nothing; allowed traffic was never reported
        assert vs.network(b.sandbox_id) == [], vs.network(b.sandbox_id)
        assert vs.find(a.sandbox_id, "tcp", testhost.ip, th.port) is None and vs.find(a.sandbox_id, "udp", testhost.ip, th.port) is None
        assert other.hits == 0 and host_listener.hits == 0
        # the audit trail: `dsec audit replay --sandbox A` shows A's drops (and nothing of B's)
        from tests.integration.test_cli import dsec

        rc, out, err = await dsec("audit", "replay", "--sandbox", a.sandbox_id, "--kind", "network", "--json", url=st.url)
        assert rc == 0, err
        replayed = [json.loads(ln) for ln in out.splitlines() if ln.strip()]
        assert sorted(e["what"] for e in replayed) == sorted(v.what for v in vs.network(a.sandbox_id)), replayed
        assert all(e["type"] == "GuardViolation" and e["sandbox_id"] == a.sandbox_id for e in replayed)
        rc, out, err = await dsec("audit", "replay", "--sandbox", a.sandbox_id, url=st.url)
        lines = [ln.split() for ln in out.splitlines()]
        assert rc == 0 and any(ln[2:5] == ["GuardViolation", "network", a.sandbox_id] and f"what=tcp {ba.ip}:7000" in " ".join(ln) for ln in lines), out
        assert any(ln[2:5] == ["SandboxEvent", "ready", a.sandbox_id] for ln in lines), out
    finally:
        await vs.stop()


@needs_stack
async def test_a_flood_of_drops_is_rate_limited_per_sandbox(make_stack: Any, testhost: TestHost, netprobe_bin: bytes, redteam: RedTeam) -> None:
    """2000 denied datagrams to 1000 different ports: every one is dropped, a bounded number is
    reported (the kernel's per-veth bucket, then the guard's), and a second sandbox's drop right
    after is still reported -- one sandbox's flood does not use up another's reports."""
    st, vs = await _guarded_stack(make_stack)
    try:
        th = await testhost.listen()
        a = await with_probe(await st.create(network={"allow_out": [f"{testhost.ip}:{th.port}"]}), netprobe_bin)
        b = await with_probe(await st.create(network={"allow_out": [f"{testhost.ip}:{th.port}"]}), netprobe_bin)
        t = st.net.table
        g = st.guard
        c0, p0 = counters(t), g.nflog.packets
        t0 = time.monotonic()
        out = await probe(a, "flood", testhost.ip, 20000, 2000)
        elapsed = time.monotonic() - t0
        assert out.code == 0 and out.stdout.strip() == "ok sent 2000", out
        c1 = counters(t)
        dropped, logged = c1["not_allowed"] - c0["not_allowed"], c1["logged"] - c0["logged"]
        assert dropped >= 2000, delta(c0, c1)
        burst, rate = st.net.log_burst, st.net.log_rate_per_s
        assert 1 <= logged <= burst + rate * elapsed + 1, (logged, elapsed)
        # barrier: the guard has read every logged packet, and every report it decided on is here
        await eventually(lambda: g.nflog.packets - p0 >= logged, timeout=10, what="guard to read the logged drops")
        await eventually(lambda: len(vs.got) == g.violations, timeout=10, what="every report on the bus")
        flood = vs.network(a.sandbox_id)
        assert 1 <= len(flood) <= min(logged, g.net_report_burst + g.net_report_rate_per_s * (time.monotonic() - t0) + 1), (len(flood), logged)
        assert all(v.detail["rule"] == "not_allowed" and v.detail["proto"] == "udp" and v.detail["dst"] == testhost.ip for v in flood)
        redteam.blocked(f"UDP flood of 2000 denied packets: all dropped, {len(flood)} reports on the bus ({logged} logged by the kernel)")
        # a second sandbox is reported at once
        await blocked(redteam, t, b, "B -> a non-allowlisted port right after A's flood", "not_allowed", "tcp", testhost.ip, 20001, "x")
        await vs.expect(b.sandbox_id, "tcp", testhost.ip, 20001, "not_allowed")
        redteam.blocked("B's drop still reported during A's flood [per-sandbox buckets]")
    finally:
        await vs.stop()


@needs_stack
async def test_dropped_packets_apply_the_sandbox_audit_policy(
    make_stack: Any, testhost: TestHost, host_listener: Listener, netprobe_bin: bytes, redteam: RedTeam
) -> None:
    """A profile whose audit policy quarantines on network violations: the first denied packet
    gets the sandbox killed and marked; a default-profile sandbox doing the same is only recorded."""
    import msgspec

    from bus import codec
    from bus import subjects as S
    from guard import default_profile

    st, vs = await _guarded_stack(make_stack)
    try:
        base = default_profile()
        prof = msgspec.structs.replace(base, name="net-quarantine", version=1, audit=msgspec.structs.replace(base.audit, other="quarantine"))
        await (await st.nc.jetstream().key_value(S.KV_PROFILES)).put(prof.name, codec.encode(prof))
        await until(
            lambda: prof.name in st.host.profiles.profiles and prof.name in st.guard.profiles, timeout=10, what="the profile to reach host agent and guard"
        )
        th = await testhost.listen()
        q = await with_probe(await st.create(profile=prof.name, network={"allow_out": [f"{testhost.ip}:{th.port}"]}), netprobe_bin)
        r = await with_probe(await st.create(network={"allow_out": [f"{testhost.ip}:{th.port}"]}), netprobe_bin)
        await reach(q, testhost.ip, th.port, redteam, "quarantine-profile sandbox -> its allowlisted port (not reported)")
        kv_sbx = await st.nc.jetstream().key_value(S.KV_SANDBOXES)

        async def state(sid: str) -> Any:
            return codec.SANDBOX_RECORD.decode((await kv_sbx.get(sid)).value)

        assert (await state(q.sandbox_id)).state == "running"
        gq, gr = st.attachment(q).gateway, st.attachment(r).gateway
        await blocked(redteam, st.net.table, r, "default-profile sandbox -> a host service", "to_host", "tcp", gr, host_listener.port, "x")
        await blocked(redteam, st.net.table, q, "quarantine-profile sandbox -> a host service", "to_host", "tcp", gq, host_listener.port, "x")
        v = await vs.expect(q.sandbox_id, "tcp", gq, host_listener.port, "to_host")

        async def killed() -> bool:
            return (await state(q.sandbox_id)).state == "gone"

        await until(killed, timeout=20, what="guard to quarantine the sandbox")
        rec = await state(q.sandbox_id)
        assert rec.end_reason.startswith("guard-quarantine: network tcp"), rec
        quarantined = codec.EVENT.decode((await (await st.nc.jetstream().key_value(S.KV_QUARANTINE)).get(q.sandbox_id)).value)
        assert quarantined.kind == "network" and quarantined.action == "quarantine" and quarantined.detail["rule"] == "to_host", quarantined
        assert v.action == "quarantine"
        redteam.blocked("quarantine profile: sandbox killed and marked after one denied packet")
        vr = await vs.expect(r.sandbox_id, "tcp", gr, host_listener.port, "to_host")
        assert vr.action == "record"
        assert (await state(r.sandbox_id)).state == "running" and (await sh(r, "echo still-here")).stdout.strip() == "still-here"
        redteam.allowed("default profile: the same drop is recorded, the sandbox keeps running")
    finally:
        await vs.stop()
