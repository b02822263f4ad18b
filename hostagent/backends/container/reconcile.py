"""What of the container backend's sandboxes really exists: leftovers after a destroy, drift against
containerd and the scratch disks (both ways), and the sandboxes a restarted host agent takes back."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from ..._agent import AgentClient, AgentError
from ..._backend import Handle
from ..._quota import ScratchFS
from ..._rootfs import RootfsLayout
from ...network import NetworkManager
from .cgroups import cgroup_path, cgroups_of, in_cgroup
from .containerd import ContainerdError, ContainerInfo, ContainerRuntime
from .freezer import freeze, frozen, thaw
from .layers import LayerMounts
from .shims import ShimGroups
from .warmpool import WarmPool

log = structlog.get_logger("dsec.hostagent.container")

LABEL_SANDBOX = "dsec.sandbox"  # set once the container serves a sandbox (at once, or when claimed from the pool)
LABEL_CONTAINER = "dsec.container"  # every container this backend made


@dataclass
class Tables:
    """The backend's live tables, shared by its parts."""

    cid: dict[str, str] = field(default_factory=dict)  # sandbox id -> container id (they differ for pooled ones)
    clients: dict[str, AgentClient] = field(default_factory=dict)  # sandbox id (container id while warm) -> its agent
    starting: set[str] = field(default_factory=set)  # containers being started (not yet in any table): not orphans


def mounts_of(cid: str) -> list[str]:
    """Mount points with ``cid`` as a path component (its scratch fs, its rootfs overlay)."""
    comp = f"/{cid}/"
    with open("/proc/self/mountinfo") as f:
        return [mp for mp in (line.split()[4] for line in f) if comp in mp + "/"]


class LoopScan:
    """Backing files of the loop devices. A burst of kills checks them all from few listings
    (reading every /sys/block/loop* per kill would cost O(sandboxes) each): a caller takes any
    listing started after its own moment ``after`` (its scratch release), or makes one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._at = 0.0
        self._backing: list[tuple[str, str]] = []

    def bound(self, image: str, after: float) -> list[str]:
        with self._lock:
            if self._at < after:
                at = time.monotonic()
                backing = []
                for dev in Path("/sys/block").glob("loop*"):
                    try:
                        backing.append((dev.name, (dev / "loop" / "backing_file").read_text().strip()))
                    except OSError:
                        continue  # not bound
                self._backing, self._at = backing, at
            found = self._backing
        return [f"{name} -> {b}" for name, b in found if b == image or b.startswith(image + " ")]


RemoveFn = Callable[[str, "str | None"], Awaitable[None]]


class Recovery:
    def __init__(
        self, tables: Tables, scratch: ScratchFS, shims: ShimGroups, layers: LayerMounts, pool: WarmPool, net: NetworkManager,
        remove: RemoveFn,
    ) -> None:
        self.t = tables
        self.scratch = scratch
        self.shims = shims
        self.layers = layers
        self.pool = pool
        self.net = net
        self._remove = remove
        self._loops = LoopScan()

    # --- after a destroy --------------------------------------------------------------------------
    async def leftovers(self, rt: ContainerRuntime, sandbox_id: str) -> list[str]:
        cid = self.t.cid.get(sandbox_id, sandbox_id)
        after = time.monotonic()
        left = [f"container {cid}"] if await rt.exists(cid) else []
        left += await asyncio.to_thread(self._host_leftovers, sandbox_id, cid, after)
        if not left:
            self.t.cid.pop(sandbox_id, None)
        return left

    def _host_leftovers(self, sandbox_id: str, cid: str, after: float) -> list[str]:
        left = [f"cgroup {p}" for p in cgroups_of(cid)]
        left += [f"mount {m}" for m in mounts_of(cid)]
        netns = self.net.netns_path(sandbox_id)
        if os.path.lexists(netns):
            left.append(f"netns {netns}")
        for p in (self.scratch.path(cid), self.scratch.image_path(cid)):
            if os.path.lexists(p):
                left.append(f"scratch {p}")
        left += [f"loop {d}" for d in self._loops.bound(self.scratch.image_path(cid), after)]
        return left

    # --- periodically -------------------------------------------------------------------------------
    async def reconcile(self, rt: ContainerRuntime, holds: Callable[[str], bool], running: dict[str, int]) -> tuple[set[str], list[str]]:
        """Drift both ways against containerd and this data dir's scratch disks. (Network namespaces and
        cgroups are named in kernel-wide places other host agents on the machine share: only those of
        containers removed here are touched.)"""
        removed: list[str] = []
        by_sid: dict[str, ContainerInfo] = {}
        listed = await rt.list()
        # Whether a container is ours is decided now, after the listing (which may take long under
        # load): a warm container started, or a sandbox created, meanwhile is not an orphan.
        for c in listed:
            sid = c.labels.get(LABEL_SANDBOX, "")
            if sid:
                by_sid[sid] = c
            if self.serves(c.id, sid, holds):
                continue
            log.warning("removing_orphan_container", container=c.id, sandbox_id=sid, status=c.status)
            try:
                await self._remove(c.id, sid or None)
                removed.append(f"container {c.id}")
            except Exception as exc:  # noqa: BLE001 - the next pass tries again
                log.warning("orphan_remove_failed", container=c.id, error=str(exc))
        lost = set()
        for sid, pid in running.items():
            if sid in by_sid and by_sid[sid].status in ("running", "paused", "pausing"):
                continue
            # containerd's task listing skips a task whose shim is slow to answer: the kernel says
            # whether its init still runs in its cgroup, and containerd is asked for this one task.
            cid = self.t.cid.get(sid, sid)
            if pid and in_cgroup(pid, cid):
                continue
            try:
                if await rt.task_pid(cid) is None:
                    lost.add(sid)
            except ContainerdError as exc:  # cannot tell now: the next pass asks again
                log.info("reconcile_task_unknown", sandbox_id=sid, error=str(exc))
        listed_ids = {c.id for c in listed}
        for cid in list((await asyncio.to_thread(self.scratch.list)).keys()):
            if cid not in listed_ids and not self.serves(cid, "", holds):
                log.warning("releasing_orphan_scratch", container=cid)
                await self.scratch.release_async(cid)
                removed.append(f"scratch {cid}")
        return lost, removed

    def serves(self, cid: str, sid: str, holds: Callable[[str], bool]) -> bool:
        """The container is being started, waits in the warm pool, or serves a sandbox the host agent holds."""
        if cid in self.t.starting or self.pool.holds(cid) or cid in self.t.cid.values():
            return True
        return holds(sid) if sid else holds(cid)

    # --- at start -------------------------------------------------------------------------------------
    async def recover(self, rt: ContainerRuntime, known: dict[str, Handle]) -> dict[str, Handle]:
        alive: dict[str, Handle] = {}
        for c in await rt.list():
            sid = c.labels.get(LABEL_SANDBOX)
            if not sid:
                if c.labels.get(LABEL_CONTAINER):
                    log.info("removing_unclaimed_warm_container", container=c.id)
                    await self._remove(c.id, None)  # a warm-pool container nobody claimed
                continue
            h = known.get(sid)
            if h is None or c.status != "running" or not c.pid:
                log.info("removing_orphan_container", sandbox_id=sid, status=c.status)
                await self._remove(c.id, sid)
                continue
            handle = await self._adopt(c, sid, h)
            if handle is not None:
                alive[sid] = handle
        # Known sandboxes not running any more are torn down by the host agent: by their container id.
        for sid, h in known.items():
            if sid not in alive:
                self.t.cid[sid] = h.extra.get("cid", sid)
        # Scratch disks of containers that never got started (the agent died half-way) serve nobody.
        keep = set(self.t.cid.values()) | {c.id for c in await rt.list()}
        for cid in list((await asyncio.to_thread(self.scratch.list)).keys()):
            if cid not in keep:
                log.info("releasing_orphan_scratch", container=cid)
                await self.scratch.release_async(cid)
        self.layers.recover()
        await self.net.recover({sid: h.extra.get("net") for sid, h in alive.items()})
        return alive

    async def _adopt(self, c: ContainerInfo, sid: str, h: Handle) -> Handle | None:
        """A container still running a known sandbox: its agent reached again, its tables rebuilt."""
        sdir = h.extra.get("dir") or await self.scratch.allocate_async(c.id, 1)
        client = AgentClient(os.path.join(RootfsLayout(sdir).run, "agent.sock"), expected_pid=c.pid)
        cgroup = cgroup_path(c.id)
        was_frozen = frozen(cgroup)  # paused, or an agent that died mid-snapshot
        if was_frozen:
            await thaw(cgroup)  # a frozen agent cannot answer the ping
        try:
            await client.wait_ready(5.0)
        except AgentError as exc:
            log.warning("recover_agent_unreachable", sandbox_id=sid, error=str(exc))
            await self._remove(c.id, sid)
            return None
        if was_frozen and h.extra.get("paused"):
            await freeze(cgroup)  # it stays paused; a snapshot cut short is simply thawed
        self.t.clients[sid] = client
        self.t.cid[sid] = c.id
        g: str = h.extra.get("group") or ""
        if g:
            self.shims.adopt(g, c.id)
        return Handle(sid, c.pid or 0, h.extra)


__all__ = ["LABEL_CONTAINER", "LABEL_SANDBOX", "LoopScan", "Recovery", "Tables", "mounts_of"]
