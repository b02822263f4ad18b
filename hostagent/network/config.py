"""What a host agent's sandbox networks are made of and what they may never reach."""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
from dataclasses import dataclass
from typing import Any

from bus import subjects as S

__all__ = ["NetworkConfig", "network_config", "DEFAULT_DENY", "COUNTERS", "FAMILY_PREFIX", "IFNAMSIZ", "WARM_TAG", "hosts_of"]

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
WARM_TAG = "@warm-"  # netns file names of pre-made networks (never a sandbox id: '@' is not allowed there)


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
        """DSEC_NET_POOL, DSEC_NET_DENY (comma-separated CIDRs), DSEC_NET_NAMESERVERS, DSEC_NFLOG_GROUP, DSEC_NET_STATE_DIR
        (a host in a network namespace of its own keeps its ``ip_forward`` state apart: sdk._hostnet); the servers
        of DSEC_NATS_URL are added to the control plane (so they are never reachable from a sandbox)."""
        e = os.environ if env is None else env

        def split(k: str) -> tuple[str, ...]:
            return tuple(x.strip() for x in e.get(k, "").split(",") if x.strip())

        kw: dict[str, Any] = {"deny_out": split("DSEC_NET_DENY"), "nameservers": split("DSEC_NET_NAMESERVERS"), "control_plane": split("DSEC_NATS_URL")}
        if e.get("DSEC_NET_POOL"):
            kw["pool"] = e["DSEC_NET_POOL"]
        if e.get("DSEC_NFLOG_GROUP"):
            kw["log_group"] = int(e["DSEC_NFLOG_GROUP"])
        if e.get("DSEC_NET_STATE_DIR"):
            kw["state_dir"] = e["DSEC_NET_STATE_DIR"]
        return cls(**kw)


def network_config(prefix: str = "") -> NetworkConfig:
    """The network config from the environment (NetworkConfig.from_env), with ``prefix`` naming this
    agent's kernel objects (nft table ``dsec_<p>``, veths ``<p>*``, netns ``dsec-<p>-*``) so that two
    stacks on one machine keep apart; without it, the default names."""
    cfg = NetworkConfig.from_env()
    return dataclasses.replace(cfg, table=f"dsec_{prefix}", ifprefix=prefix, netns_prefix=f"dsec-{prefix}-") if prefix else cfg


def hosts_of(spec: str) -> list[str]:
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
