"""Shim groups: up to ``size`` containers share one containerd shim (one process per group instead of
one per sandbox), and the shims an agent that stops leaves idle."""

from __future__ import annotations

import asyncio
import os

import structlog

from .cgroups import children, kill

log = structlog.get_logger("dsec.hostagent.container")


class ShimGroups:
    def __init__(self, size: int) -> None:
        self.size = size
        self._members: dict[str, set[str]] = {}
        self._group_of: dict[str, str] = {}
        self._up: set[str] = set()  # groups whose shim is running

    def group_of(self, cid: str) -> str:
        return self._group_of.get(cid, "")

    def pick(self, cid: str) -> str | None:
        """The group the container ``cid`` joins (None: a shim of its own)."""
        if self.size <= 1:
            return None
        # Only join a group whose shim is up: two creates starting the same group's shim at once
        # can race in containerd and leave a second shim behind.
        for g, members in self._members.items():
            if g in self._up and len(members) < self.size:
                members.add(cid)
                self._group_of[cid] = g
                return g
        g = f"grp-{cid}"
        self._members[g] = {cid}
        self._group_of[cid] = g
        return g

    def started(self, group: str) -> None:
        """The group's shim runs (its first container started)."""
        self._up.add(group)

    def leave(self, cid: str) -> None:
        g = self._group_of.pop(cid, None)
        if g is not None:
            members = self._members.get(g)
            if members is not None:
                members.discard(cid)
                if not members:
                    del self._members[g]
                    self._up.discard(g)

    def adopt(self, group: str, cid: str) -> None:
        """A recovered container in its (running) group."""
        self._members.setdefault(group, set()).add(cid)
        self._group_of[cid] = group
        self._up.add(group)


async def reap_idle_shims(address: str, grace_s: float = 5.0) -> None:
    """With no container left, our shims should exit on their own; stop any that lingers, by pid.

    containerd asks a shim to shut down after its last container's delete; when containerd itself
    stops right after, that request can be lost and the idle shim would stay forever."""
    needle = f"-address\0{address}".encode()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while True:
        pids = []
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/cmdline", "rb") as f:
                        cmd = f.read()
                except OSError:
                    continue
                if b"containerd-shim" in cmd and needle in cmd:
                    pids.append(int(d))
        if not pids:
            return
        if loop.time() > deadline:
            for pid in pids:
                # A shim is the subreaper of its containers' inits: a `runc init` left parked by a
                # create cut short would outlive it holding the sandbox's mounts, so it goes first.
                for child in children(pid):
                    log.warning("stopping_orphan_container_init", pid=child, shim=pid)
                    kill(child)
                log.warning("stopping_idle_shim", pid=pid)
                kill(pid)
            return
        await asyncio.sleep(0.1)  # poll interval while shims exit


__all__ = ["ShimGroups", "reap_idle_shims"]
