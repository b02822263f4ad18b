"""Network names of a test stack that no other stack on this machine uses at the same time.

A host agent owns everything in the kernel that carries its network config's names: at start it
removes veths and netns of its prefix that belong to none of its sandboxes, and its clean-up
removes the nft table and every veth and netns of the prefix. Two stacks sharing names (two test
runs, or a test's stack and a ``dsec up`` it starts) delete each other's sandbox networks. So every
stack a test (or benchmark) starts claims a slot here: an flock on ``/run/lock/dsec-test-nets/<prefix>``
held until ``release()`` -- or until the process ends, however it ends -- so claims by concurrent
runs exclude each other, and a slot whose names are still in the kernel (a crashed run's
leftovers, a run that does not claim) is passed over.

Slot ``i`` names: veths ``dsq<c>*``, nft table ``dsec_dsq<c>``, netns ``dsec-dsq<c>-*``, address
pool ``10.210.<4i>.0/22`` and NFLOG group ``7400+i``.
"""

from __future__ import annotations

import fcntl
import os
import random
import string
import subprocess
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["NetClaim", "claim_net", "lock_route"]

SLOTS = string.ascii_lowercase + string.digits
LOCK_DIR = "/run/lock/dsec-test-nets"
FAMILY = "dsq"  # no other ifprefix in use starts with it (the default is dsx); each slot adds one character


@dataclass
class NetClaim:
    index: int
    _fd: int

    @property
    def prefix(self) -> str:
        return FAMILY + SLOTS[self.index]

    @property
    def table(self) -> str:
        return f"dsec_{self.prefix}"

    @property
    def netns_prefix(self) -> str:
        return f"dsec-{self.prefix}-"

    @property
    def pool(self) -> str:
        return f"10.210.{self.index * 4}.0/22"

    @property
    def log_group(self) -> int:
        return 7400 + self.index  # one NFLOG listener per group: each stack's guard gets its own

    def env(self) -> dict[str, str]:
        """For a ``dsec up`` / ``python -m hostagent`` child (hostagent/__main__.py's network_config)."""
        return {"DSEC_NET_PREFIX": self.prefix, "DSEC_NET_POOL": self.pool, "DSEC_NFLOG_GROUP": str(self.log_group)}

    def config(self, **overrides: Any) -> Any:
        """A ``hostagent.network.NetworkConfig`` with this slot's names (``overrides`` on top)."""
        from hostagent.network import NetworkConfig

        kw: dict[str, Any] = {"pool": self.pool, "table": self.table, "ifprefix": self.prefix, "netns_prefix": self.netns_prefix, "log_group": self.log_group}
        return NetworkConfig(**(kw | overrides))

    def in_kernel(self) -> list[str]:
        """This slot's names still present in the kernel."""
        found = [f"link {n}" for n in os.listdir("/sys/class/net") if n.startswith(self.prefix)]
        if os.path.isdir("/run/netns"):
            found += [f"netns {n}" for n in os.listdir("/run/netns") if n.startswith(self.netns_prefix)]
        if subprocess.run(["nft", "list", "table", "inet", self.table], capture_output=True).returncode == 0:
            found.append(f"nft table {self.table}")
        return found

    async def purge(self) -> None:
        """Remove this slot's nft table, veths and netns mounts (a stack's last step, with no sandboxes left)."""
        from hostagent.network import NetworkManager

        m = NetworkManager(self.config())
        try:
            await m.purge()
        finally:
            await m.stop()

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def claim_net(timeout: float = 120.0) -> NetClaim:
    """Claim a free slot (waits while all are held, up to ``timeout`` seconds)."""
    os.makedirs(LOCK_DIR, exist_ok=True)
    deadline = time.monotonic() + timeout
    while True:
        for i in random.sample(range(len(SLOTS)), len(SLOTS)):
            fd = os.open(os.path.join(LOCK_DIR, FAMILY + SLOTS[i]), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            claim = NetClaim(i, fd)
            if not claim.in_kernel():
                return claim
            claim.release()
        if time.monotonic() > deadline:
            raise RuntimeError(f"no free test network slot in {timeout:.0f}s (all {len(SLOTS)} held or in use)")
        time.sleep(random.uniform(0.5, 1.5))  # back-off with jitter while every slot is held


def lock_route(dest: str, timeout: float = 300.0) -> int:
    """Hold the machine-wide lock on a host route to ``dest`` (an address every test host would route
    to itself, like 169.254.169.254): one test at a time owns it. Returns the fd; closing it unlocks."""
    os.makedirs(LOCK_DIR, exist_ok=True)
    fd = os.open(os.path.join(LOCK_DIR, f"route-{dest}"), os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise RuntimeError(f"the route to {dest} stayed taken by another test for {timeout:.0f}s") from None
            time.sleep(random.uniform(0.2, 0.6))  # back-off with jitter while another test holds it
