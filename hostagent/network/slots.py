"""The address pool: one /30 per sandbox network (host end .1, sandbox end .2), handed out
next-fit, and a /30 whose old veth the kernel is still destroying is skipped for a while."""

from __future__ import annotations

import ipaddress
import time
from typing import Protocol

from bus.errors import CreateFailed

__all__ = ["SlotPool", "Links"]

# How long a /30 waits for the kernel to destroy its old veth before that veth is deleted by hand.
DRAIN_S = 10.0


class Links(Protocol):
    def link_exists(self, name: str) -> bool: ...
    def del_link(self, name: str) -> None: ...


class SlotPool:
    """Which /30s of ``pool`` are taken (by whom) or draining (old host ifname, since when)."""

    def __init__(self, pool: str) -> None:
        self.pool = ipaddress.IPv4Network(pool)
        self.nslots = self.pool.num_addresses // 4
        self.used: dict[int, str] = {}  # slot -> owner (sandbox id or warm key)
        self.draining: dict[int, tuple[str, float]] = {}  # slot -> (old host ifname, since)
        self._next = 0

    def addrs(self, slot: int) -> tuple[str, str, ipaddress.IPv4Network]:
        """(host end, sandbox end, the /30)."""
        base = int(self.pool.network_address) + 4 * slot
        return str(ipaddress.IPv4Address(base + 1)), str(ipaddress.IPv4Address(base + 2)), ipaddress.IPv4Network((base, 30))

    def slot_of(self, ip: str | None) -> int | None:
        if not ip:
            return None
        a = ipaddress.IPv4Address(ip)
        if a not in self.pool:
            return None
        return (int(a) - int(self.pool.network_address)) // 4

    def alloc(self, owner: str, links: Links) -> int:
        now = time.monotonic()
        for i in range(self.nslots):
            slot = (self._next + i) % self.nslots
            if slot in self.used:
                continue
            old = self.draining.get(slot)
            if old is not None:
                if links.link_exists(old[0]):
                    if now - old[1] < DRAIN_S:
                        continue  # the kernel is still destroying its netns: try the next /30
                    links.del_link(old[0])  # kept alive by something else: take it down
                del self.draining[slot]
            self.used[slot] = owner
            self._next = (slot + 1) % self.nslots
            return slot
        raise CreateFailed(f"the sandbox network pool {self.pool} is exhausted")

    def release(self, slot: int, ifname: str, owner: str | None = None) -> None:
        """The /30 is free once ``ifname`` is gone; ``owner``: only if still taken by it."""
        if owner is None or self.used.get(slot) == owner:
            self.used.pop(slot, None)
        self.draining[slot] = (ifname, time.monotonic())

    def learned(self, slot: int, ifname: str) -> None:
        """A veth of ours found in the kernel holds ``slot`` (until recovery says whose it is)."""
        self.draining.setdefault(slot, (ifname, time.monotonic()))

    def claim(self, slot: int, owner: str) -> None:
        """A live sandbox's /30, re-learned after a restart."""
        self.used[slot] = owner
        self.draining.pop(slot, None)

    def continue_after_used(self) -> None:
        if self.used:
            self._next = (max(self.used) + 1) % self.nslots

    def clear(self) -> None:
        self.used.clear()
        self.draining.clear()
