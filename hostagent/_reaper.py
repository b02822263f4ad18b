"""Ending sandboxes: timeouts, client leases, and kill intents.

A kill (by a client, a timeout, a lapsed lease, a lost sandbox) is a durable intent: the sandbox's
local state file says ``stopping`` with the reason before anything is removed, and its KV record
says so too. The teardown is retried with bounded, jittered backoff until the backend reports
nothing of the sandbox left (task, container, mounts, cgroups, netns, scratch disk, loop device);
only then does the record become ``gone`` (or ``lost``) and the ``killed`` (``lost``) event go out.
A round of retries that runs out leaves the intent in place: the reconcile loop starts another.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import random
import time
from collections.abc import Awaitable, Callable

import structlog
from nats.js import JetStreamContext

from bus import codec
from bus import subjects as S
from bus.errors import InternalError
from bus.messages import Lease
from bus.runtime import KV

from ._backend import Backend
from ._execio import ExecIO
from ._ports import PortRelay
from ._records import Records
from ._registry import LocalSandbox, Registry

log = structlog.get_logger("dsec.hostagent")

LOST = "lost"  # end reason of a sandbox that vanished behind the host agent's back
FENCED = "fenced"  # end reason of a sandbox the cluster declared lost while this host was away (placement._hostloss)
# End reasons that publish nothing: another host owns the id; a persisted pause writes its own record;
# the cluster already recorded (and announced) the sandbox lost, maybe restored elsewhere.
QUIET = ("duplicate", "paused", FENCED)


class Reaper:
    def __init__(
        self, registry: Registry, records: Records, backend: Backend, creating: dict[str, asyncio.Future[None]], execio: ExecIO,
        ports: PortRelay, unserve: Callable[[str], Awaitable[None]], js: Callable[[], JetStreamContext | None], *,
        kill_wait_s: float = 10.0, retry_base_s: float = 0.2, retry_max_s: float = 5.0, attempts: int = 8,
    ) -> None:
        self.registry = registry
        self.records = records
        self.backend = backend
        self.creating = creating  # sandboxes being made (the intake's): not timed out or reaped meanwhile
        self.execio = execio
        self.ports = ports
        self._unserve = unserve
        self._js = js
        self.kill_wait_s = kill_wait_s  # how long a kill request waits for its teardown before answering "stopping"
        self.retry_base_s = retry_base_s
        self.retry_max_s = retry_max_s
        self.attempts = attempts  # per round; the reconcile loop starts the next round
        self.teardowns: dict[str, asyncio.Task[bool]] = {}
        self._deadlines: list[tuple[float, str]] = []  # heap of (expires_at, sandbox id); stale entries skipped
        self._leased: dict[str, set[str]] = {}  # lease key (owner or sandbox id) -> leased sandboxes here
        self._lease_seen: dict[str, tuple[int, float]] = {}  # lease key -> (KV revision, local time it changed)
        self._lease_checked = 0.0
        self._lease_min = float("inf")  # shortest lease among leased sandboxes here (sets the check period)
        self._kv_leases: KV[Lease] | None = None

    # --- the registry tells us who is in and out ------------------------------------------------
    def observe(self, ls: LocalSandbox, sign: int) -> None:
        spec = ls.spec
        if spec.lease_s > 0:
            key = spec.owner or spec.sandbox_id
            if sign > 0:
                self._leased.setdefault(key, set()).add(spec.sandbox_id)
                self._lease_min = min(self._lease_min, spec.lease_s)
            else:
                ids = self._leased.get(key)
                if ids is not None:
                    ids.discard(spec.sandbox_id)
                    if not ids:
                        del self._leased[key]
                        self._lease_seen.pop(key, None)
                        if not self._leased:
                            self._lease_min = float("inf")
        if sign > 0 and ls.expires_at:
            heapq.heappush(self._deadlines, (ls.expires_at, spec.sandbox_id))

    async def set_timeout(self, ls: LocalSandbox, timeout_s: float) -> None:
        ls.expires_at = time.time() + timeout_s
        heapq.heappush(self._deadlines, (ls.expires_at, ls.spec.sandbox_id))
        self.registry.save(ls)
        await self.records.record(ls, "running")

    # --- timeouts and leases ------------------------------------------------------------------------
    async def tick(self, now: float) -> None:
        creating = self.creating
        dl = self._deadlines
        while dl and dl[0][0] <= now:
            at, sid = heapq.heappop(dl)
            ls = self.registry.get(sid)
            if ls is None or ls.expires_at != at or sid in creating or ls.state != "running":
                continue  # gone, stopping, or its timeout was changed (a newer entry is in the heap)
            log.info("sandbox_timeout", sandbox_id=sid)
            self.begin(sid, "timeout")
        if self._leased:
            try:
                await self._reap_leases(now)
            except Exception as exc:  # noqa: BLE001 - KV unavailable: try again next round
                log.warning("lease_check_failed", error=str(exc))

    async def _reap_leases(self, now: float) -> None:
        """Kill sandboxes whose client lease was not renewed within their ``lease_s`` (the trainer died).

        One KV read per lease key (an owner's key covers all its sandboxes) every quarter of the shortest
        lease here; a renewal is seen as a change of the key's revision, so host and client clocks never meet.
        """
        if now - self._lease_checked < max(0.25, self._lease_min / 4):
            return
        self._lease_checked = now
        if self._kv_leases is None:
            js = self._js()
            assert js is not None
            self._kv_leases = await KV.open(js, S.KV_LEASES, codec.LEASE)
        for key, ids in list(self._leased.items()):
            e = await self._kv_leases.entry(key)
            rev = e.revision if e is not None else 0
            seen = self._lease_seen.get(key)
            if seen is None or seen[0] != rev:
                seen = self._lease_seen[key] = (rev, now)
            for sid in list(ids):
                ls = self.registry.get(sid)
                if ls is None or sid in self.creating or ls.state != "running":
                    continue
                if now - max(seen[1], ls.started_at) > ls.spec.lease_s:
                    log.info("lease_expired", sandbox_id=sid, lease_key=key)
                    self.begin(sid, "lease-expired")

    # --- kill intents ---------------------------------------------------------------------------------
    async def kill(self, sid: str, reason: str, *, wait_s: float | None = None) -> bool:
        """Start (or join) the sandbox's teardown; True once it is gone, False while it is still
        stopping after ``wait_s`` (the intent stays and is retried)."""
        t = self.begin(sid, reason)
        if t is None:
            return True
        done, _ = await asyncio.wait((t,), timeout=self.kill_wait_s if wait_s is None else wait_s)
        return bool(done) and not t.cancelled() and t.exception() is None and t.result()

    def begin(self, sid: str, reason: str) -> "asyncio.Task[bool] | None":
        """Record the intent (local state file, at once) and start a round of teardown unless one runs."""
        ls = self.registry.get(sid)
        if ls is None:
            return None
        if ls.state != "stopping":
            ls.state = "stopping"
            ls.end_reason = reason
            self.registry.save(ls)
        t = self.teardowns.get(sid)
        if t is None or t.done():
            t = self.teardowns[sid] = asyncio.ensure_future(self._teardown(ls))
            t.add_done_callback(functools.partial(self._ended, sid))
        return t

    def _ended(self, sid: str, t: "asyncio.Task[bool]") -> None:
        if self.teardowns.get(sid) is t:
            del self.teardowns[sid]

    def resume(self) -> int:
        """Start a round for every stopping sandbox that has none running (after a restart, or a
        round that ran out); returns how many."""
        n = 0
        for sid, ls in list(self.registry.live.items()):
            if ls.state == "stopping" and sid not in self.teardowns:
                self.begin(sid, ls.end_reason)
                n += 1
        return n

    def lose(self, sid: str, why: str) -> None:
        """The sandbox is gone behind our back: remove what is left of it, then record it ``lost``."""
        ls = self.registry.get(sid)
        if ls is None or ls.state == "stopping":
            return
        log.warning("sandbox_lost", sandbox_id=sid, why=why)
        ls.extra = {**ls.extra, "lost": why}
        self.begin(sid, LOST)

    async def _teardown(self, ls: LocalSandbox) -> bool:
        sid = ls.spec.sandbox_id
        if ls.end_reason not in QUIET:
            try:  # readers see it stopping at once; the local state file is the durable intent
                await self.records.record(ls, "stopping", end_reason=ls.end_reason)
            except Exception as exc:  # noqa: BLE001 - the final record is the one that must be stored
                log.warning("stopping_record_failed", sandbox_id=sid, error=str(exc))
        await self.ports.drop(sid)  # relayed connections end with the kill, not with the teardown
        delay = self.retry_base_s
        why = ""
        for attempt in range(1, self.attempts + 1):
            try:
                await self.backend.destroy(sid)
                left = await self.backend.leftovers(sid)
                if not left:
                    await self._finish(ls)
                    return True
                why = "left: " + ", ".join(left)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - retried: this is an intent, not a one-shot call
                why = f"{type(exc).__name__}: {exc}"
            log.info("teardown_retry", sandbox_id=sid, attempt=attempt, why=why[:500])
            if attempt < self.attempts:
                await asyncio.sleep(delay * random.uniform(0.5, 1.5))  # backoff with jitter between attempts
                delay = min(delay * 2, self.retry_max_s)
        log.warning("teardown_pending", sandbox_id=sid, attempts=self.attempts, why=why[:500])
        return False

    async def _finish(self, ls: LocalSandbox) -> None:
        """Everything is gone: the record says so, then the event, then the local intent is dropped."""
        sid = ls.spec.sandbox_id
        reason = ls.end_reason or "user"
        if reason not in QUIET:
            if reason == LOST:
                await self.records.record(ls, "lost", end_reason=ls.extra.get("lost", LOST))
                await self.records.event(ls.spec, "lost", err=InternalError(ls.extra.get("lost", "the sandbox was lost")))
            else:
                await self.records.record(ls, "gone", end_reason=reason)
                if reason == "timeout":
                    await self.records.event(ls.spec, "timeout")
                await self.records.event(ls.spec, "killed", detail={"reason": reason})
        self.registry.remove(sid)
        self.registry.forget(sid)
        self.execio.forget(sid)
        await self._unserve(sid)

    async def stop(self) -> None:
        """Host shutdown: rounds in progress stop; their intents stay in the local state files."""
        for t in list(self.teardowns.values()):
            t.cancel()
        for t in list(self.teardowns.values()):
            try:
                await t
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - resumed at the next start
                pass


__all__ = ["Reaper", "FENCED", "LOST", "QUIET"]
