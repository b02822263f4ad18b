"""Many hosts on one machine, each behind a network link of its own (``dsec up --hosts N``, the tests).

Host ``i`` lives in network namespace ``dsec-<prefix>-host<i>``, joined to a bridge in the root
namespace by a veth pair (``<prefix>h<i>`` in the root namespace, ``uplink`` inside): it reaches NATS
over that link as a remote machine would (nats-server listens on the bridge's address, and every
process of the stack uses that address), so cutting the link (``ip link set <prefix>h<i> down``) or
shaping it (``tc qdisc ... tbf``) is what a real network fault does to that host. Only the network is
separate: the host's processes (its agent, lazy loader and private containerd) are started with
``nsenter --net``, sharing the machine's mounts, cgroups and /run/netns with the rest; each host's
agent gets a net prefix of its own (``<prefix><i>``: its sandboxes' veths, netns and nft table) and a
sandbox address pool of its own.

Sandboxes on these hosts get the network they get on a machine of their own: each host's agent
enforces the allowlists in the host's namespace (its nft table, its masquerade behind ``uplink``), and
the root namespace is the network beyond: it forwards the links' traffic out and masquerades it
(nft table ``inet dsec_<prefix>_hosts``), as a site's router would, so allowed addresses -- the
internet where the allowlist opens it -- are reached from a host as from the root host. What a host's
sandbox may never reach, whatever its allowlist: this machine's own addresses but the bridge's
(counter ``to_machine``, the hosts' ``to_host``), the bridge's address itself (NATS: each agent's
control plane), every host's link address and every host's sandbox pool (``DSEC_NET_DENY``, added
to each agent's own deny list). ``ip_forward`` in the root namespace is turned on if it was off (and
then only the hosts' and sandboxes' traffic is forwarded), and put back by ``destroy``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import subprocess
from dataclasses import dataclass

NETNS_DIR = "/run/netns"
UPLINK = "uplink"
STATE_DIR = "/run/dsec"
_FORWARD = "/proc/sys/net/ipv4/ip_forward"
FAMILY = "ds"  # every dsec link and veth name starts with it (the forwarding guard keys on it)


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    argv = ["ip", *(("-n", netns) if netns else ()), *args]
    return subprocess.run(argv, capture_output=True, text=True, check=check)


@dataclass(frozen=True)
class HostNet:
    """The links of ``count`` hosts. ``prefix``: 2-5 of [a-z0-9] starting with ``ds`` (kernel names);
    ``link_net``: the /24 of the bridge and the hosts' uplinks; ``pools``: one sandbox pool per host."""

    prefix: str
    count: int
    link_net: str
    pools: tuple[str, ...]
    log_group: int = -1  # the NFLOG group each host's agent logs dropped packets to (-1: none)

    def __post_init__(self) -> None:
        if len(self.pools) < self.count:
            raise ValueError(f"{self.count} hosts need {self.count} sandbox pools, got {len(self.pools)}")
        if not (2 <= len(self.prefix) <= 5 and self.prefix.isalnum() and self.prefix.startswith("ds")):
            raise ValueError(f"host net prefix must be 2-5 of [a-z0-9] starting with 'ds', got {self.prefix!r}")

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br"

    @property
    def gateway(self) -> str:
        """The bridge's address: where nats-server listens for the hosts (and everything else)."""
        return str(ipaddress.ip_network(self.link_net)[1])

    def address(self, i: int) -> str:
        return str(ipaddress.ip_network(self.link_net)[10 + i])

    def netns(self, i: int) -> str:
        return f"dsec-{self.prefix}-host{i}"

    def link(self, i: int) -> str:
        """Host ``i``'s end of its link in the root namespace (what a fault cuts or shapes)."""
        return f"{self.prefix}h{i}"

    def net_prefix(self, i: int) -> str:
        """Names host ``i``'s agent gives its sandboxes' kernel objects (apart from every other host's)."""
        return f"{self.prefix}{i}"

    @property
    def table(self) -> str:
        """The root namespace's nft table for these hosts (forwarding, masquerade, the machine's guard)."""
        return f"dsec_{self.prefix}_hosts"

    def state_dir(self, i: int) -> str:
        """Host ``i``'s agent's network state (what its namespace's ``ip_forward`` was): it lives and dies
        with the namespace, apart from the root namespace's agents' (whose state outlives them)."""
        return os.path.join(STATE_DIR, "hostns", self.net_prefix(i))

    def deny(self) -> list[str]:
        """What no host's sandbox may reach: every link address and every host's sandbox pool."""
        return [self.link_net, *self.pools]

    def env(self, i: int) -> dict[str, str]:
        """For host ``i``'s agent (hostagent's network config from the environment)."""
        deny = [d for d in os.environ.get("DSEC_NET_DENY", "").split(",") if d.strip()] + self.deny()
        env = {"DSEC_NET_PREFIX": self.net_prefix(i), "DSEC_NET_POOL": self.pools[i], "DSEC_NET_DENY": ",".join(deny),
               "DSEC_NET_STATE_DIR": self.state_dir(i)}
        if self.log_group >= 0:
            env["DSEC_NFLOG_GROUP"] = str(self.log_group)
        return env

    def enter(self, i: int) -> list[str]:
        """The argv prefix that runs a command in host ``i``'s network namespace (nothing else changes)."""
        return ["nsenter", f"--net={os.path.join(NETNS_DIR, self.netns(i))}", "--"]

    def create(self) -> None:
        """The bridge and every host's namespace and link; on failure, what was made is removed again."""
        plen = ipaddress.ip_network(self.link_net).prefixlen
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/{plen}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i in range(self.count):
                ns = self.netns(i)
                _ip("netns", "add", ns)
                _ip("link", "add", self.link(i), "type", "veth", "peer", "name", UPLINK, "netns", ns)
                _ip("link", "set", self.link(i), "master", self.bridge)
                _ip("link", "set", self.link(i), "up")
                _ip("link", "set", "lo", "up", netns=ns)
                _ip("addr", "add", f"{self.address(i)}/{plen}", "dev", UPLINK, netns=ns)
                _ip("link", "set", UPLINK, "up", netns=ns)
                _ip("route", "add", "default", "via", self.gateway, netns=ns)
            guard = self._enable_forwarding()
            r = subprocess.run(["nft", "-f", "-"], input=self.ruleset(guard), capture_output=True, text=True)
            if r.returncode != 0:
                raise subprocess.CalledProcessError(r.returncode, ["nft", "-f", "-"], r.stdout, r.stderr)
        except subprocess.CalledProcessError as exc:
            self.destroy()
            raise RuntimeError(f"host network {self.prefix}: {' '.join(exc.cmd)}: {exc.stderr.strip()}") from None

    def ruleset(self, guard: bool) -> str:
        """The root namespace's rules for these hosts, one transaction. ``guard``: nobody forwarded
        before us, so forward nothing but dsec's traffic."""
        t = f"inet {self.table}"
        br = f'"{self.bridge}"'
        machine = f"iifname {br} ip daddr != {self.gateway}"
        lines = [
            f"add table {t}",
            f"delete table {t}",
            f"add table {t}",
            f"add counter {t} to_machine",
            f"add chain {t} input {{ type filter hook input priority filter - 20; policy accept; }}",
            f"add chain {t} forward {{ type filter hook forward priority filter - 20; policy accept; }}",
            f"add chain {t} nat {{ type nat hook postrouting priority srcnat; policy accept; }}",
            # A host reaches this machine at the bridge's address only (NATS, the stack's services):
            # the rest of the machine is as closed to its sandboxes as the root host's is to its own.
            f'add rule {t} input {machine} meta l4proto tcp counter name "to_machine" reject with tcp reset',
            f'add rule {t} input {machine} counter name "to_machine" reject with icmpx admin-prohibited',
            # Out to the network beyond, under this machine's address (replies find their way back).
            f"add rule {t} nat ip saddr {self.link_net} oifname != {br} masquerade",
        ]
        if guard:
            lines.append(f'add rule {t} forward iifname != "{FAMILY}*" oifname != "{FAMILY}*" drop')
        return "\n".join(lines) + "\n"

    def _state_path(self) -> str:
        return os.path.join(STATE_DIR, f"hosts-{self.prefix}.json")

    def _enable_forwarding(self) -> bool:
        """Forwarding on in the root namespace; True when it was off before (kept across a crashed run)."""
        os.makedirs(STATE_DIR, mode=0o700, exist_ok=True)
        try:
            with open(self._state_path()) as f:
                was = str(json.load(f)["forward_was"])
        except (OSError, ValueError, KeyError):
            with open(_FORWARD) as f:
                was = f.read().strip()
            with open(self._state_path(), "w") as f:
                json.dump({"forward_was": was}, f)
        with open(_FORWARD, "w") as f:
            f.write("1")
        return was == "0"

    def _restore_forwarding(self) -> None:
        """Forwarding back off if these hosts turned it on and no other dsec forwarding state is left
        (other hosts' sets, or a root-namespace host agent's ``net-*``)."""
        try:
            with open(self._state_path()) as f:
                was = str(json.load(f).get("forward_was"))
            os.unlink(self._state_path())
        except (OSError, ValueError):
            return
        others = [x for x in os.listdir(STATE_DIR) if x.startswith(("hosts-", "net-"))] if os.path.isdir(STATE_DIR) else []
        if was == "0" and not others:
            with open(_FORWARD, "w") as f:
                f.write("0")

    def set_link(self, i: int, up: bool) -> None:
        _ip("link", "set", self.link(i), "up" if up else "down")

    def shape(self, i: int, rate: str, burst: str = "32kbit", latency: str = "400ms") -> None:
        """Limit host ``i``'s link to ``rate`` both ways (tbf on each end: netem is not in this kernel)."""
        for netns, dev in ((None, self.link(i)), (self.netns(i), UPLINK)):
            args = ("qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", burst, "latency", latency)
            subprocess.run(["tc", *(("-n", netns) if netns else ()), *args], capture_output=True, text=True, check=True)

    def unshape(self, i: int) -> None:
        for netns, dev in ((None, self.link(i)), (self.netns(i), UPLINK)):
            subprocess.run(["tc", *(("-n", netns) if netns else ()), "qdisc", "del", "dev", dev, "root"], capture_output=True, text=True)

    def destroy(self) -> None:
        """Remove every namespace and link of these hosts (deleting a namespace deletes its veth pair)."""
        for i in range(self.count):
            _ip("netns", "delete", self.netns(i), check=False)
            _ip("link", "delete", self.link(i), check=False)
            shutil.rmtree(self.state_dir(i), ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(STATE_DIR, "hostns"))  # when no other hosts' state is left
        _ip("link", "delete", self.bridge, check=False)
        subprocess.run(["nft", "delete", "table", "inet", self.table], capture_output=True)
        self._restore_forwarding()

    def leftovers(self) -> list[str]:
        """These hosts' names still in the kernel (empty after ``destroy``)."""
        left = [f"link {n}" for n in os.listdir("/sys/class/net") if n == self.bridge or n.startswith(f"{self.prefix}h")]
        if os.path.isdir(NETNS_DIR):
            left += [f"netns {n}" for n in os.listdir(NETNS_DIR) if n.startswith(f"dsec-{self.prefix}-host")]
        if subprocess.run(["nft", "list", "table", "inet", self.table], capture_output=True).returncode == 0:
            left.append(f"nft table {self.table}")
        left += [f"state {self.state_dir(i)}" for i in range(self.count) if os.path.exists(self.state_dir(i))]
        return left


__all__ = ["HostNet"]
