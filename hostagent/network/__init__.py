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

Modules: ``config`` (NetworkConfig, the fixed deny ranges), ``allowlist`` (parse + compile
``allow_out``, ``/etc/hosts``), ``resolver`` (DNS for allowlisted names, dnspython; its typed
errors), ``nftables`` (libnftables and the ruleset text), ``rtnetlink`` (the raw hot-path
requests), ``netns`` (named namespaces: unshare/setns/bind mounts), and the parts the manager
composes: ``attachment`` (a sandbox's network and its kernel names), ``slots`` (the /30 address
pool), ``plumbing`` (veth/netns making and look-ups), ``rules`` (the base ruleset and per-sandbox
set elements), ``warm`` (pre-made networks), ``forwarding`` (ip_forward and its saved state),
``reconcile`` (recovery and purge), ``worker`` (the kernel thread) and ``manager``
(NetworkManager: setup, teardown, start/stop, recover, purge).
"""

from .allowlist import AllowPlan, compile_allowlist, parse_allow_out, write_hosts_file
from .config import COUNTERS, DEFAULT_DENY, WARM_TAG, NetworkConfig, network_config
from .manager import Attachment, NetworkManager, Prepared
from .resolver import DnsQueryError, Resolver, ResolveFailed

__all__ = [
    "NetworkConfig",
    "network_config",
    "NetworkManager",
    "Attachment",
    "Prepared",
    "AllowPlan",
    "parse_allow_out",
    "compile_allowlist",
    "Resolver",
    "ResolveFailed",
    "DnsQueryError",
    "write_hosts_file",
    "DEFAULT_DENY",
    "COUNTERS",
    "WARM_TAG",
]
