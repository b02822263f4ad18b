"""Reconcile what this host's records say against what really exists, at start and periodically.

Both ways: a resource (container, scratch mount, cgroup, netns) that belongs to no sandbox this host
holds is removed by the backend; a sandbox this host holds whose container is gone is ``lost``
(its leftovers removed, then the record and an event say so); a KV record naming this host for a
sandbox it does not hold is marked ``lost`` too. Stopping sandboxes whose round of teardown ran out
get another one.

Fencing: a sandbox this host holds whose record says the cluster moved on without it (placement
declared it ``lost`` while this host was cut off, or another host took the id over: a restore) is
removed here without a word (no record, no event: those were written when it was declared lost), so
it never runs twice. Checked at each KV sweep and at once after the connection to NATS came back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from nats.js import JetStreamContext

from bus.errors import InternalError

from ._backend import Backend, Handle
from ._ops import OpsEndpoint
from ._reaper import FENCED, Reaper
from ._records import Records
from ._registry import Registry

log = structlog.get_logger("dsec.hostagent")

_LIVE_RECORD_STATES = ("running", "paused", "stopping")
_SWEEP_CONCURRENCY = 64


class Reconciler:
    def __init__(
        self, host_id: str, registry: Registry, records: Records, backend: Backend, reaper: Reaper, ops: OpsEndpoint,
        creating: dict[str, asyncio.Future[None]], js: Callable[[], JetStreamContext | None], pause: Callable[[float], Awaitable[bool]],
        *, period_s: float = 10.0, kv_sweep_every: int = 6,
    ) -> None:
        self.host_id = host_id
        self.registry = registry
        self.records = records
        self.backend = backend
        self.reaper = reaper
        self.ops = ops
        self.creating = creating  # sandboxes being made (the intake's)
        self._js = js
        self._pause = pause  # the service's stop-aware sleep
        self.period_s = period_s
        self.kv_sweep_every = kv_sweep_every  # passes between sweeps of the KV records (0: only at start)
        self.passes = 0
        self.last: dict[str, Any] = {}  # what the last pass did and cost (benchmarks, dsec status)
        self.also_holds: Callable[[str], bool] = lambda sid: False  # sandboxes held outside the registry (fn pools)
        self.fenced = 0  # sandboxes removed because the cluster declared them lost while we were away
        self.suspect = False  # cut off from NATS lately and not swept since: ops check the record first (gave_up)
        self.last_beat = time.monotonic()  # the last heartbeat stored (the service sets it)
        self.silence_s = 6.0  # a heartbeat older than this: suspect too (a put may hang for its whole timeout)

    # --- at start ------------------------------------------------------------------------------------
    async def recover(self) -> None:
        """Rebuild the live table from the local state files and what the backend still runs."""
        known = self.registry.load()
        if known:
            alive = await self.backend.recover({sid: Handle(sid, ls.pid, dict(ls.extra)) for sid, ls in known.items()})
        else:
            alive = await self.backend.recover({}) if self.registry.persist else {}
        for sid, ls in known.items():
            h = alive.get(sid)
            if h is not None:
                ls.pid = h.pid
            self.registry.add(ls, h or Handle(sid, ls.pid, dict(ls.extra)))
            await self.ops.serve(sid)
            if ls.state == "stopping":
                log.info("kill_resumed", sandbox_id=sid, reason=ls.end_reason)
            elif h is not None:
                await self.records.event(ls.spec, "recovered")
                log.info("recovered", sandbox_id=sid, pid=h.pid)
            else:
                self.reaper.lose(sid, "the sandbox was lost while the host agent was down")
        self.reaper.resume()
        if self.registry.persist:
            await self.sweep_records()

    # --- periodically ------------------------------------------------------------------------------------
    async def loop(self) -> None:
        while not await self._pause(self.period_s):
            try:
                await self.run_pass()
            except Exception as exc:  # noqa: BLE001 - containerd or NATS unavailable: next period
                log.warning("reconcile_failed", error=f"{type(exc).__name__}: {exc}")

    async def run_pass(self) -> dict[str, Any]:
        t0, c0 = time.perf_counter(), time.process_time()
        live, creating = self.registry.live, self.creating
        running = {sid: ls.pid for sid, ls in live.items() if ls.state != "stopping" and sid not in creating}
        also = self.also_holds
        lost, removed = await self.backend.reconcile(lambda sid: sid in live or sid in creating or also(sid), running)
        for sid in lost:
            if sid in self.registry.live and sid not in self.creating:  # still held, and not being created again
                self.reaper.lose(sid, "its container is gone")
        resumed = self.reaper.resume()
        self.passes += 1
        swept = 0
        if self.registry.persist and self.kv_sweep_every and self.passes % self.kv_sweep_every == 0:
            swept = await self.sweep_records()
        self.last = {
            "sandboxes": len(live), "lost": len(lost), "orphans_removed": len(removed), "resumed": resumed, "records_lost": swept,
            "wall_ms": round((time.perf_counter() - t0) * 1000, 2), "cpu_ms": round((time.process_time() - c0) * 1000, 2),
        }
        if lost or removed or resumed or swept:
            log.info("reconciled", **self.last, removed=removed[:20])
        return self.last

    async def sweep_records(self) -> int:
        """Records naming this host as the owner of a live sandbox it does not hold become ``lost``."""
        assert self._js() is not None and self.records.kv is not None
        kv = self.records.kv
        sem = asyncio.Semaphore(_SWEEP_CONCURRENCY)
        marked = 0

        def held(sid: str) -> bool:
            return sid in self.registry.live or sid in self.creating

        async def one(sid: str) -> None:
            nonlocal marked
            if held(sid):
                async with sem:
                    await self._fence(sid)
                return
            async with sem:
                e = await kv.entry(sid)
                if e is None or e.value.host_id != self.host_id or e.value.state not in _LIVE_RECORD_STATES or held(sid):
                    return
                rec = e.value
                rec.state, rec.ended_at, rec.end_reason = "lost", time.time(), "no such sandbox on its host"
                if not await kv.update(sid, rec, last=e.revision):  # a record rewritten meanwhile (a finishing kill) wins
                    return
                await self.records.event(rec.spec, "lost", err=InternalError("the sandbox's host holds no such sandbox"))
                log.warning("record_lost", sandbox_id=sid)
                marked += 1

        await asyncio.gather(*(one(k) for k in await kv.keys()))
        return marked

    async def _fence(self, sid: str) -> str:
        """Remove a held sandbox whose record says the cluster gave it up (see the module note). Returns
        "" (ours: nothing done), "lost" (declared lost: being removed) or "elsewhere" (another host or a
        later incarnation holds the id: being removed, and that one answers for it)."""
        assert self.records.kv is not None
        ls = self.registry.get(sid)
        if ls is None or ls.state == "stopping" or sid in self.creating:
            return ""
        rec = await self.records.kv.get(sid)
        if rec is None:
            return ""
        mine = rec.host_id == self.host_id and rec.spec.generation == ls.spec.generation
        if mine and rec.state != "lost":
            return ""
        log.warning("sandbox_fenced", sandbox_id=sid, record_state=rec.state, record_host=rec.host_id, generation=rec.spec.generation)
        self.fenced += 1
        self.reaper.begin(sid, FENCED)
        await self.ops.unserve(sid)  # at once: the sandbox's owner (if any) answers alone from now on
        return "lost" if mine else "elsewhere"

    async def gave_up(self, sid: str) -> str:
        """Before an op, while ``suspect`` or the heartbeat is late: what ``_fence`` says (between a cut
        link's return and the sweep, a sandbox restored elsewhere must not answer here too)."""
        if not self.suspect and time.monotonic() - self.last_beat <= self.silence_s:
            return ""
        return await self._fence(sid)


__all__ = ["Reconciler"]
