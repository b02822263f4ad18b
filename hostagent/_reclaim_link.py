"""The host agent's side of the reclaim service (``hostagent.reclaim``, a process of its own): each
heartbeat tells it this host's sandboxes (``bus.subjects.reclaim_targets``), and its reports
(``reclaim_report``) are kept to show each sandbox's memory in its info."""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bus import codec
from bus import subjects as S
from bus.errors import BadRequest
from bus.messages import ReclaimReport, ReclaimTarget, ReclaimTargets, SandboxMemory

from ._backend import Backend, Handle
from ._registry import Registry

log = structlog.get_logger("dsec.hostagent")
REPORT = codec.Decoder(ReclaimReport)
STALE_S = 60.0  # a report this old is from a service that stopped (and took its swap away)


class ReclaimLink:
    def __init__(self, host_id: str, registry: Registry, backend: Backend) -> None:
        self.host_id = host_id
        self.registry = registry
        # The backend's cgroup of a sandbox (only backends whose sandboxes have one).
        self._cgroup: Callable[[Handle], str] | None = getattr(backend, "cgroup_of", None)
        self.last_op: dict[str, float] = {}  # sandbox -> monotonic time of its last operation
        self.memory: dict[str, SandboxMemory] = {}
        self.report: ReclaimReport | None = None
        self.nc: NATS | None = None

    def touch(self, sid: str) -> None:
        self.last_op[sid] = time.monotonic()

    async def start(self, nc: NATS) -> None:
        if self._cgroup is None:
            return  # a backend without cgroups (sim): nothing to reclaim, nothing to say
        self.nc = nc
        await nc.subscribe(S.reclaim_report(self.host_id), cb=self._on_report)

    async def _on_report(self, msg: Msg) -> None:
        try:
            r = REPORT.decode(msg.data)
        except BadRequest as exc:
            log.warning("bad_reclaim_report", error=str(exc))
            return
        if r.host_id == self.host_id:
            self.report, self.memory = r, {s.sandbox_id: s for s in r.sandboxes}

    def swap_mb(self) -> int:
        """Memory the reclaim service's compressed swap takes (its last report): sandboxes' pages
        still, so part of what the heartbeat says they hold."""
        r = self.report
        return r.swap_stored_bytes >> 20 if r is not None and time.time() - r.at < STALE_S else 0

    def targets(self) -> ReclaimTargets:
        now = time.monotonic()
        out = []
        for sid, ls in list(self.registry.live.items()):
            h = self.registry.handles.get(sid)
            if h is None or self._cgroup is None:
                continue
            last = self.last_op.setdefault(sid, now)  # a sandbox first seen now: idle from now
            out.append(ReclaimTarget(
                sandbox_id=sid, cgroup=self._cgroup(h), priority=ls.spec.priority, memory_mb=ls.spec.memory_mb,
                idle_s=round(now - last, 3), state=ls.state,
            ))
        for sid in set(self.last_op) - set(self.registry.live):
            del self.last_op[sid]
        return ReclaimTargets(host_id=self.host_id, at=time.time(), sandboxes=out)

    async def publish(self) -> None:
        if self.nc is not None and not self.nc.is_closed:
            await self.nc.publish(S.reclaim_targets(self.host_id), codec.encode(self.targets()))


__all__ = ["ReclaimLink"]
