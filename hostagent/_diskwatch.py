"""Who filled the host's disk: when the data dir's free space falls under the write reserve, the sandbox
whose host bytes grew most within ``HostAgentConfig.disk_growth_window_s`` is reported to guard.

A sandbox's host bytes are what its writable disk holds (the scratch file system under
``Freezing.scratch_dir``: a sparse image in the data dir that grows as the sandbox writes, and shrinks
as it deletes, the mount discards) plus what its snapshots stored within the window. Sampled at each
heartbeat. On the edge to full, the culprit (growth at least ``MIN_GROWTH``: a disk filled from
outside blames nobody) gets a ``GuardViolation`` of kind ``disk`` on ``dsec.evt.guard.violation``,
action ``record``; guard applies the sandbox's profile (``audit.other``: kill or quarantine) as for
any reported violation. One report per episode: the disk must have room again (twice the reserve
free) before a later fill is reported.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path

import structlog

from bus.messages import GuardViolation

from . import _storage as storage
from ._backend import Capabilities
from ._registry import Registry

log = structlog.get_logger("dsec.hostagent.disk")

MIN_GROWTH = 16 << 20  # less than this in a window is noise (logs, a small download), not the cause of a full disk
KIND = "disk"
SOURCE = "hostagent.disk"


def _used_bytes(mount: str) -> int | None:
    """Bytes in use in the file system mounted at ``mount`` (None when it is not a mount of its own:
    then its statvfs would be the host's)."""
    try:
        if not os.path.ismount(mount):
            return None
        st = os.statvfs(mount)
    except OSError:
        return None
    return (st.f_blocks - st.f_bfree) * st.f_frsize


class DiskWatch:
    def __init__(
        self, host_id: str, data_dir: str | os.PathLike[str], registry: Registry, caps: Capabilities, *, reserve_mb: int, window_s: float,
        publish: Callable[[GuardViolation], Awaitable[None]],
    ) -> None:
        self.host_id = host_id
        self.data_dir = Path(data_dir)
        self.registry = registry
        self.caps = caps
        self.reserve = reserve_mb << 20
        self.window_s = window_s
        self.publish = publish
        self.disk: dict[str, deque[tuple[float, int]]] = {}  # sandbox -> (time, scratch bytes), oldest first, within the window
        self.stored: dict[str, deque[tuple[float, int]]] = {}  # sandbox -> (time, snapshot bytes stored)
        self.full = False
        self.reported: list[GuardViolation] = []  # what this watch reported (tests, the dashboard's log)

    def note_stored(self, sandbox_id: str, nbytes: int) -> None:
        """A snapshot of the sandbox stored ``nbytes`` (its record's ``bytes_added``)."""
        if nbytes > 0:
            self.stored.setdefault(sandbox_id, deque()).append((time.monotonic(), nbytes))

    def _sample(self, now: float) -> int | None:
        """Each sandbox's scratch bytes, into its window; returns the data dir's free bytes."""
        freezer = self.caps.freezer
        if freezer is not None:
            for sid, handle in list(self.registry.handles.items()):
                try:
                    used = _used_bytes(freezer.scratch_dir(handle))
                except (KeyError, OSError):  # not made yet, or gone meanwhile
                    used = None
                if used is not None:
                    self.disk.setdefault(sid, deque()).append((now, used))
        horizon = now - self.window_s
        for series in (self.disk, self.stored):
            for sid in list(series):
                q = series[sid]
                if sid not in self.registry.handles and (not q or q[-1][0] < horizon):
                    del series[sid]
                    continue
                # keep one sample at or before the horizon: the baseline the growth is measured from
                while len(q) > 1 and q[1][0] <= horizon:
                    q.popleft()
        return storage.free_bytes(self.data_dir)

    def growth(self, sandbox_id: str, now: float | None = None) -> int:
        """Host bytes the sandbox added within the window: its disk's rise from the window's low point
        before its latest sample, plus its snapshots' stored bytes."""
        now = time.monotonic() if now is None else now
        horizon = now - self.window_s
        grew = 0
        q = self.disk.get(sandbox_id)
        if q and sandbox_id in self.registry.handles:  # a sandbox gone gave its disk back
            last = q[-1][1]
            grew = max(0, last - min(v for _, v in q))
        grew += sum(n for t, n in self.stored.get(sandbox_id, ()) if t > horizon)
        return grew

    def culprit(self, now: float | None = None) -> tuple[str, int] | None:
        now = time.monotonic() if now is None else now
        best = max(((sid, self.growth(sid, now)) for sid in {*self.disk, *self.stored}), key=lambda x: x[1], default=None)
        return best if best is not None and best[1] >= MIN_GROWTH else None

    async def tick(self) -> GuardViolation | None:
        """Sample; on the edge to a full disk, report the culprit (if any). Returns what it reported."""
        now = time.monotonic()
        free = await asyncio.to_thread(self._sample, now)
        if free is None:
            return None
        if self.full:
            self.full = free < 2 * self.reserve
            return None
        if free >= self.reserve:
            return None
        self.full = True
        found = self.culprit(now)
        log.warning("disk_full", free_bytes=free, culprit=found[0] if found else "", growth_bytes=found[1] if found else 0)
        if found is None:
            return None
        sid, grew = found
        ls = self.registry.live.get(sid)
        v = GuardViolation(
            sandbox_id=sid, at=time.time(), kind=KIND, action="record", host_id=self.host_id,
            what=f"the host's disk filled ({free >> 20} MiB free) while this sandbox stored {grew >> 20} MiB in {self.window_s:g}s, the most of any",
            detail={
                "source": SOURCE, "growth_bytes": str(grew), "free_bytes": str(free), "window_s": f"{self.window_s:g}",
                "tenant": ls.spec.client if ls is not None else "",
            },
        )
        self.reported.append(v)
        try:
            await self.publish(v)
        except Exception as exc:  # noqa: BLE001 - the log has it; the next episode reports again
            log.warning("disk_violation_publish_failed", error=str(exc))
        return v


__all__ = ["KIND", "MIN_GROWTH", "SOURCE", "DiskWatch"]
