"""A microVM's NIC on the host network package's sandbox network (``hostagent.network``: the netns,
its veth, the /30 and the egress rules on the veth's host end, exactly as a container gets them).

Inside the sandbox's netns the veth's inner end (``eth0``) loses its address and joins a bridge
with a tap (``tap0``) that QEMU, started in that netns, opens for the guest's virtio NIC; the guest
takes the address eth0 had. So the host sees the guest's packets on the sandbox's veth with the
sandbox's own address: the allowlist, the anti-spoofing check and the masquerade apply unchanged,
and nothing the guest does reaches the host's side of them. The tap and the bridge live and die
with the netns (the network package's teardown unmounts it once QEMU is gone)."""

from __future__ import annotations

import hashlib
import subprocess

from bus.errors import CreateFailed

from ...network import Attachment
from .qemu import NetSpec

TAP = "tap0"
BRIDGE = "br0"

# one ``ip -batch`` in the netns; eth0's address and route go with the flush (the guest owns them now)
_PLUMB = f"""link add {BRIDGE} type bridge
tuntap add dev {TAP} mode tap
link set eth0 master {BRIDGE}
link set {TAP} master {BRIDGE}
addr flush dev eth0
link set {BRIDGE} up
link set {TAP} up
"""


def mac_of(sandbox_id: str) -> str:
    """A locally administered unicast MAC derived from the sandbox id (stable across a restart)."""
    b = hashlib.blake2b(sandbox_id.encode(), digest_size=5).digest()
    return "02:" + ":".join(f"{x:02x}" for x in b)


def plumb(att: Attachment, sandbox_id: str) -> NetSpec:
    """Bridge a tap to the sandbox's veth inside its netns; what QEMU and the guest need of it."""
    r = subprocess.run(["nsenter", f"--net={att.netns}", "--", "ip", "-batch", "-"], input=_PLUMB, capture_output=True, text=True)
    if r.returncode != 0:
        raise CreateFailed(f"cannot give the microVM its NIC: {r.stderr.strip()[-500:]}")
    return NetSpec(netns=att.netns, tap=TAP, ip=att.ip, gateway=att.gateway, mac=mac_of(sandbox_id))


def hosts_script(hosts: list[tuple[str, str]]) -> str:
    """Shell that appends the host-resolved allowlisted names to the guest's /etc/hosts (a guest
    lookup then needs no DNS, as in a container)."""
    lines = "".join(f"{ip}\\t{name}\\n" for ip, name in hosts)
    return f"printf '# allowlisted names, resolved by the dsec host agent\\n{lines}' >> /etc/hosts"


__all__ = ["BRIDGE", "TAP", "hosts_script", "mac_of", "plumb"]
