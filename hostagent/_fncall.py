"""FnCall on a host: per-template pools of started sandboxes that each serve exactly one stateless
call, answered on ``dsec.fn.<tenant>.<template>.call``.

Why a queue group and not placement: a call is a core request every host with a pool of the template
takes in queue group ``fn``, so NATS spreads calls over those hosts with no placement round trip and
no host table read on the hot path, and a host that dies leaves the group with its connection. A
host that cannot find a free member queues the call (bounded) and answers ``no_capacity`` at its
deadline: never a hang.

Why a member is reset rather than replaced: every call must start from the template's state (upper
dir, processes, ``/tmp``, ``/dev/shm``, SysV IPC, environment, cgroup counters). A fresh container
gives that by construction, but its start (tens of milliseconds of CPU, a few per second on a small
host) then bounds the call rate. A member whose profile makes every path but a known few read-only
(Landlock, required; no mount, namespace or keyring calls) can be put back instead: its processes
killed through the cgroup, fresh layers over those few paths, IPC objects removed, counters zeroed
(the backend's ``fn_reset``, ``CallReset``), milliseconds, off the hot path while other members
serve. A member whose call timed out, hit its memory limit or failed, one that served ``MAX_USES``
calls, and every member of another profile or backend is destroyed and replaced as before.

Pools grow on demand (each call that had to wait raises the pool's idle target, up to its maximum)
and shrink when idle (a target above the configured size falls back one member per idle period,
and surplus idle members are destroyed).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bus import codec
from bus import subjects as S
from bus.errors import DsecError, InvalidArgument, NoCapacity, UnknownTemplate
from bus.fncall import FN_WORKDIR, check_call, check_path
from bus.messages import (
    ExecRequest,
    ExecResult,
    FileData,
    FileMakeDir,
    FileRead,
    FileWrite,
    FnCallRequest,
    FnCallResult,
    HostBackend,
    LayerRef,
    SandboxSpec,
)
from bus.runtime import Endpoint

from . import _fnzygote as zygote
from ._backend import Backend, Handle
from ._fnzygote import STDIN_PATH
from ._tenancy import check_fn_call

log = structlog.get_logger("dsec.hostagent.fncall")

MAINTAIN_S = 1.0  # pools are trimmed and refilled (after a failed start) this often
FAIL_BACKOFF_S = 2.0  # a pool whose member failed to start waits this long before trying again
MAX_USES = 1000  # calls one member serves (reset between them) before it is replaced all the same


def parse_pools(text: str) -> dict[str, int]:
    """``base=8,python=8`` -> {"base": 8, "python": 8}; ValueError naming what is wrong."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, n = part.partition("=")
        if not sep or not S.valid_token(name) or not n.isdigit() or int(n) < 1:
            raise ValueError(f"fn pool {part!r}: expected <template>=<members>, e.g. base=8")
        out[name] = int(n)
    return out


@runtime_checkable
class CallLimits(Protocol):
    """A backend that can change one sandbox's memory limit and count its OOM kills (container)."""

    def set_memory_limit(self, handle: Handle, memory_mb: int) -> None: ...

    def oom_kills(self, handle: Handle) -> int: ...


@runtime_checkable
class CallReset(Protocol):
    """A backend that can put a sandbox back to its template's state between calls (container):
    processes, the ``writable`` paths, IPC objects, cgroup counters. ``first`` before its first
    call; returns the paths it resets (those of ``writable`` the sandbox has) and the sandbox's OOM
    kill count (a baseline: it cannot be zeroed)."""

    async def fn_reset(self, handle: Handle, writable: tuple[str, ...], size_mb: int, first: bool) -> tuple[tuple[str, ...], int]: ...


def reset_paths(security: Any) -> tuple[str, ...] | None:
    """The paths a call can write under ``security`` (an ``Enforcement``), outermost first; None
    when that is not a known few (no required Landlock, ``/`` writable, device rules beyond
    ``/dev``): such a profile's members serve one call each."""
    args = tuple(getattr(security, "agent_args", ()))
    if not getattr(security, "landlock_required", False):
        return None
    rw = {args[i + 1] for i, a in enumerate(args[:-1]) if a == "--landlock-rw"}
    dev = {args[i + 1] for i, a in enumerate(args[:-1]) if a == "--landlock-dev"}
    if "/" in rw or dev - {"/dev"}:
        return None
    return tuple(sorted(rw, key=lambda p: (p.count("/"), p)))


@dataclass
class Member:
    sid: str
    handle: Handle
    idle_since: float = 0.0
    writable: tuple[str, ...] | None = None  # what a reset covers; None: never reused
    uses: int = 0
    oom_base: int = 0  # the cgroup's OOM kill count after the last reset (it cannot be zeroed)
    own_limit: bool = False  # the last call set its own memory limit (the reset puts the pool's back)
    template: str = ""
    zygote: zygote.Zygote | None = None  # a Python interpreter started for the next call (_fnzygote)


def _started_for(req: FnCallRequest) -> Callable[[Member], bool] | None:
    """For a ``python3 <script>`` call: which members hold an interpreter started for its shape."""
    if zygote.script_of(req) is None:
        return None
    key = zygote.key_of(req)
    return lambda m: m.zygote is not None and m.zygote.key == key and m.zygote.alive()


@dataclass
class FnPool:
    """The members of one template on this host."""

    template: str
    size: int  # idle members kept ready at rest
    max_members: int  # idle + busy + starting, at most
    queue_max: int  # calls waiting for a member, at most
    make: Callable[[str], Awaitable[Member]]
    destroy: Callable[[Member], Awaitable[None]]
    reset: Callable[[Member], Awaitable[bool]]
    starts: asyncio.Semaphore  # member starts in flight on this host, every pool together
    idle: deque[Member] = field(default_factory=deque)
    waiters: deque[asyncio.Future[Member]] = field(default_factory=deque)
    busy: int = 0
    starting: int = 0
    retiring: int = 0  # used members being destroyed: they still hold a container, so they count
    resetting: int = 0  # used members being reset for the next call
    want: int = 0  # idle target now: ``size``, raised by demand, back to ``size`` when idle
    last_wait: float = 0.0
    failed_at: float = 0.0
    last_error: DsecError | None = None
    served: int = 0
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _retiring: set[asyncio.Task[None]] = field(default_factory=set)
    stopping: bool = False

    def __post_init__(self) -> None:
        self.want = self.size

    def members(self) -> int:
        return len(self.idle) + self.busy + self.starting + self.retiring + self.resetting

    async def acquire(self, wait_s: float, prefer: Callable[[Member], bool] | None = None) -> Member:
        """A member for one call; ``no_capacity`` when none frees up within ``wait_s`` (or the queue is full).
        Of the idle ones, the oldest that ``prefer`` likes (one started for the call's shape), else the oldest."""
        if self.idle:
            m = next((x for x in self.idle if prefer(x)), None) if prefer is not None else None
            if m is None:
                m = self.idle.popleft()  # the oldest: every member is as fresh as the next
            else:
                self.idle.remove(m)
            self.busy += 1
            self.fill()
            return m
        if len(self.waiters) >= self.queue_max:
            raise NoCapacity(f"{len(self.waiters)} calls of {self.template!r} are waiting on this host already", template=self.template)
        self.last_wait = time.monotonic()
        self.want = min(self.want + 1, self.max_members)  # demand: keep more ready from now on
        fut: asyncio.Future[Member] = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        self.fill()
        try:
            await asyncio.wait({fut}, timeout=wait_s)
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release(fut.result())  # handed over just as the call went away
            raise
        finally:
            if not fut.done():
                fut.cancel()
                self.waiters.remove(fut)
        if fut.cancelled():
            why = f" (the last start failed: {self.last_error.description})" if self.last_error else ""
            raise NoCapacity(f"no {self.template!r} pool member came free within {wait_s:g}s{why}", template=self.template)
        m = fut.result()  # (raises a failed start's error)
        return m

    def retire(self, m: Member) -> None:
        """Destroy ``m`` in the background; its container counts until it is gone."""
        self.retiring += 1
        t = asyncio.ensure_future(self._retire(m))
        self._retiring.add(t)
        t.add_done_callback(self._retiring.discard)

    async def _retire(self, m: Member) -> None:
        try:
            await self.destroy(m)
        finally:
            self.retiring -= 1
            self.fill()

    def release(self, m: Member, reuse: bool = False) -> None:
        """The call is over: the member is reset for the next call (``reuse``), or it goes and a
        fresh one is started."""
        self.busy -= 1
        self.served += 1
        if reuse and not self.stopping:
            self.resetting += 1
            t = asyncio.ensure_future(self._recycle(m))
            self._retiring.add(t)
            t.add_done_callback(self._retiring.discard)
        else:
            self.retire(m)
        self.fill()

    async def _recycle(self, m: Member) -> None:
        ok = False
        try:
            # The call's reply was handed to NATS in the step that released ``m``; its flusher was
            # woken then, after this task was made: one turn lets the reply leave before the reset.
            await asyncio.sleep(0)
            ok = await self.reset(m)
        finally:
            self.resetting -= 1
            if not ok or self.stopping:
                self.retire(m)
                self.fill()
            else:
                self._ready(m)

    def _ready(self, m: Member) -> None:
        """``m`` can serve: to the longest waiting call, else idle."""
        while self.waiters:
            w = self.waiters.popleft()
            if not w.done():
                self.busy += 1
                w.set_result(m)
                return
        m.idle_since = time.monotonic()
        self.idle.append(m)

    def fill(self) -> None:
        """Start members until the idle target plus the waiting calls are covered (within the maximum)."""
        if self.stopping or time.monotonic() - self.failed_at < FAIL_BACKOFF_S:
            return
        need = self.want + len(self.waiters) - len(self.idle) - self.starting - self.resetting
        room = self.max_members - self.members()
        for _ in range(max(0, min(need, room))):
            self.starting += 1
            t = asyncio.ensure_future(self._start_one())
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    async def _start_one(self) -> None:
        try:
            async with self.starts:
                m = await self.make(self.template)
        except asyncio.CancelledError:
            self.starting -= 1
            raise
        except Exception as exc:  # noqa: BLE001 - the waiting call hears why; the pool tries again later
            self.starting -= 1
            err = exc if isinstance(exc, DsecError) else DsecError(f"{type(exc).__name__}: {exc}")
            self.last_error, self.failed_at = err, time.monotonic()
            log.warning("fn_member_start_failed", template=self.template, error=str(exc))
            while self.waiters:  # a template that cannot start fails its calls now, not at their deadline
                w = self.waiters.popleft()
                if not w.done():
                    w.set_exception(err)
                    break
            return
        self.starting -= 1
        self.last_error = None
        self._ready(m)

    def maintain(self, idle_s: float) -> None:
        """Shrink a pool grown by demand once calls stop waiting; retry after failed starts."""
        now = time.monotonic()
        if self.want > self.size and now - self.last_wait > idle_s:
            self.want -= 1
            self.last_wait = now  # one member per idle period
        while len(self.idle) > self.want and now - self.idle[0].idle_since > idle_s:
            self.retire(self.idle.popleft())
        self.fill()

    async def stop(self) -> None:
        """No more starts; every member (idle, or one whose start is cancelled here) destroyed."""
        self.stopping = True
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            try:
                await t
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - stopping anyway
                pass
        for w in self.waiters:
            if not w.done():
                w.cancel()
        while self.idle:
            self.retire(self.idle.popleft())
        while self._retiring:
            await asyncio.gather(*list(self._retiring), return_exceptions=True)


class FnCalls:
    """Every fn pool of this host, and the endpoint that serves their calls."""

    def __init__(
        self, host_id: str, backend: Backend, pools: dict[str, int], *, layers: Callable[[str], Awaitable[list[LayerRef]]],
        security: Callable[[], Any], owner: Callable[[str], str | None] = lambda _t: "", max_members: int = 0, memory_mb: int = 512,
        disk_mb: int = 256, queue_max: int = 4096,
        idle_s: float = 30.0, starts: int = 4,
    ) -> None:
        self.host_id = host_id
        self.backend = backend
        self.limits = backend if isinstance(backend, CallLimits) else None
        self.layers = layers
        self.owner = owner  # a template's owner tenant as its layers were last read ("": shared; None: not read)
        self.security = security
        self.memory_mb = memory_mb
        self.disk_mb = disk_mb
        self.idle_s = idle_s
        self._starts = asyncio.Semaphore(starts)
        self.pools = {
            t: FnPool(t, n, max(max_members, 4 * n), queue_max, self._make, self._destroy, self._reset, self._starts)
            for t, n in pools.items()
        }
        self.resets = backend if isinstance(backend, CallReset) else None
        # The reset's cost, paid off the hot path: the last starts and destroys of members (benchmarks).
        self.start_ms: deque[float] = deque(maxlen=1000)
        self.destroy_ms: deque[float] = deque(maxlen=1000)
        self.reset_ms: deque[float] = deque(maxlen=1000)
        self._sids: set[str] = set()  # every member's sandbox id, from its start until it is destroyed
        # Per template, what its recent ``python3 <script>`` calls ran with: a member reset for the next
        # call starts an interpreter of one of those shapes in it (_fnzygote), off the hot path.
        self._zkeys: dict[str, zygote.Shapes] = {}
        self.zygote_calls = 0  # calls served by a pre-started interpreter (benchmarks, tests)
        self.zygote_ms: deque[float] = deque(maxlen=1000)  # starting one (after the reset) until it is loaded
        self._maintain: asyncio.Task[None] | None = None
        self.endpoint: Endpoint | None = None
        self.nc: NATS | None = None

    def holds(self, sid: str) -> bool:
        """A sandbox of a pool (reconcile leaves it alone)."""
        return sid in self._sids

    # --- lifecycle --------------------------------------------------------------------------------
    async def start(self, nc: NATS) -> None:
        if not self.pools:
            return
        self.nc = nc
        for p in self.pools.values():
            p.fill()
        self.endpoint = Endpoint(nc, "fn", self.handle, decoder=codec.FN_CALL, bind=_bind)
        for t in self.pools:
            await self.endpoint.serve(S.fn_call_all(t), queue=S.FN_QUEUE)
        self._maintain = asyncio.ensure_future(self._maintain_loop())

    async def stop(self, grace_s: float = 10.0) -> None:
        if self.endpoint is not None:
            await self.endpoint.stop(grace_s)
        if self._maintain is not None:
            self._maintain.cancel()
        await asyncio.gather(*(p.stop() for p in self.pools.values()))

    async def _maintain_loop(self) -> None:
        while True:
            await asyncio.sleep(MAINTAIN_S)  # a timer of its own: trims and retries are not urgent
            for p in self.pools.values():
                p.maintain(self.idle_s)

    def advertise(self) -> HostBackend:
        """What the heartbeat says of the pools (``HostStatus.backends``)."""
        ps = self.pools.values()
        return HostBackend(name="fncall", detail={
            "pools": ",".join(f"{p.template}={p.size}" for p in ps),
            "idle": ",".join(f"{p.template}={len(p.idle)}" for p in ps),
            "busy": ",".join(f"{p.template}={p.busy}" for p in ps),
            "waiting": ",".join(f"{p.template}={len(p.waiters)}" for p in ps),
        })

    # --- members ----------------------------------------------------------------------------------
    async def _make(self, template: str) -> Member:
        sid = f"fn-{template[:40]}-{os.urandom(6).hex()}"
        self._sids.add(sid)
        t0 = time.perf_counter()
        try:
            layers = await self.layers(template)
            # Latency-sensitive, not the default best-effort: a best-effort member's threads are
            # SCHED_IDLE, so on a busy host any other task preempted its calls (and the interpreters
            # started for them) and ``print(1)`` ran past a 10 s run_timeout.
            spec = SandboxSpec(sandbox_id=sid, template=template, memory_mb=self.memory_mb, disk_mb=self.disk_mb, timeout_s=0.0,
                               priority="latency-sensitive")
            security = self.security()
            handle = await self.backend.create(spec, layers, security=security)
            await self.backend.files(handle, FileMakeDir(path=FN_WORKDIR))
            m = Member(sid, handle, template=template)
            paths = reset_paths(security) if self.resets is not None else None
            if paths is not None and self.resets is not None:
                # Fresh layers over the writable paths before the first call: their original
                # directories (which the Landlock rules name) are then never written.
                m.writable, m.oom_base = await self.resets.fn_reset(handle, paths, self.disk_mb, True)
                self._prime(m)
        except BaseException:
            await asyncio.shield(self._destroy(Member(sid, Handle(sid))))  # a start cut short leaves nothing
            raise
        self.start_ms.append((time.perf_counter() - t0) * 1000)
        return m

    async def _reset(self, m: Member) -> bool:
        """Put ``m`` back to its template's state for the next call; False (it is destroyed instead)
        when it cannot be."""
        if self.resets is None or m.writable is None:
            return False
        t0 = time.perf_counter()
        try:
            if m.own_limit and self.limits is not None:
                await asyncio.to_thread(self.limits.set_memory_limit, m.handle, self.memory_mb)
                m.own_limit = False
            _, m.oom_base = await self.resets.fn_reset(m.handle, m.writable, self.disk_mb, False)
            m.zygote = None  # (the reset killed it, if the call left it unused)
            self._prime(m)
        except Exception as exc:  # noqa: BLE001 - the member is replaced; the next call never sees it
            log.warning("fn_member_reset_failed", sandbox_id=m.sid, error=str(exc))
            return False
        self.reset_ms.append((time.perf_counter() - t0) * 1000)
        return True

    def _prime(self, m: Member) -> None:
        """A Python interpreter starting in ``m`` for a next call shaped like the template's recent
        ones (if it ran any; ``zygote.Shapes``); ``m`` serves meanwhile."""
        shapes = self._zkeys.get(m.template)
        pool = self.pools.get(m.template)
        started = [x.zygote.key for x in (pool.idle if pool is not None else ()) if x.zygote is not None and x.zygote.alive()]
        key = shapes.next_for(started) if shapes is not None else None
        if key is not None and m.writable is not None:
            t0 = time.perf_counter()
            m.zygote = z = zygote.start(self.backend, m.handle, key)
            if z is not None:
                def took(f: asyncio.Future[None]) -> None:
                    if not f.cancelled():
                        self.zygote_ms.append((time.perf_counter() - t0) * 1000)
                z.ready.add_done_callback(took)

    async def _destroy(self, m: Member) -> None:
        sid = m.sid
        if m.zygote is not None:
            m.zygote.cancel()
        t0 = time.perf_counter()
        try:
            await self.backend.destroy(sid)
        except Exception as exc:  # noqa: BLE001 - reconcile removes what is left once it is no longer held
            log.warning("fn_member_destroy_failed", sandbox_id=sid, error=str(exc))
        self._sids.discard(sid)
        self.destroy_ms.append((time.perf_counter() - t0) * 1000)

    # --- a call -------------------------------------------------------------------------------------
    async def handle(self, msg: Msg, req: FnCallRequest) -> FnCallResult:
        tenant, template = S.parse_fn(msg.subject) or ("", "")
        pool = self.pools.get(template)
        if pool is None:
            raise UnknownTemplate(f"this host keeps no fn pool of {template!r}", template=template)
        check_call(req)
        # Defence in depth: nats-server lets a client credential publish under its own tenant only
        # (bus.auth); a pool of a tenant's private template serves that tenant and the operator.
        owner = self.owner(template)
        if owner is None:
            await self.layers(template)  # (a member's start reads them; before the first, this call does)
            owner = self.owner(template) or ""
        await check_fn_call(self.nc, self.host_id, template, owner, tenant)
        t0 = time.perf_counter()
        m = await pool.acquire(req.queue_s, _started_for(req))
        queued_ms = (time.perf_counter() - t0) * 1000
        reuse = False
        try:
            out = await self._run(m, req)
            m.uses += 1
            # A call cut short by its timeout or its memory limit may have left the member in any
            # state: replaced (as a failed one is), not reset.
            timed_out = any(r is not None and r.timed_out for r in (out.compile, out.run))
            reuse = m.writable is not None and not timed_out and not out.oom and m.uses < MAX_USES
        finally:
            pool.release(m, reuse)
        out.host_id, out.queued_ms = self.host_id, queued_ms
        return out

    async def _run(self, m: Member, req: FnCallRequest) -> FnCallResult:
        b, h = self.backend, m.handle
        # Files one at a time: the agent's channel serialises them anyway, and a call has few.
        for f in req.files:
            await b.files(h, FileWrite(path=f"{FN_WORKDIR}/{check_path(f.path)}", data=f.data, mode=f.mode & 0o7777))
        if req.memory_mb:
            if self.limits is None:
                raise InvalidArgument(f"the {b.name} backend cannot set a call's memory limit")
            m.own_limit = True
            await asyncio.to_thread(self.limits.set_memory_limit, h, req.memory_mb)
        out = FnCallResult()
        if req.compile_cmd:
            out.compile = await self._exec(h, req.compile_cmd, req, req.compile_timeout_s)
            if out.compile.exit_code != 0 or out.compile.timed_out:
                out.oom = self._oom_kills(h) > m.oom_base
                return out
        cmd = req.cmd
        if req.stdin:
            await b.files(h, FileWrite(path=STDIN_PATH, data=req.stdin))
            cmd = f"exec < {STDIN_PATH}\n{cmd}"
        z, m.zygote = m.zygote, None
        script = zygote.script_of(req) if m.writable is not None else None
        if script is not None:
            key = zygote.key_of(req)
            self._zkeys.setdefault(m.template, zygote.Shapes()).saw(key)
            if z is not None and zygote.missing(z):
                self._zkeys.pop(m.template, None)  # no python3 in this template: start no more
            elif z is not None and z.alive() and z.key == key:
                out.run = await zygote.run(b, h, z, script, bool(req.stdin), req.timeout_s)
                self.zygote_calls += out.run is not None
        if out.run is None:
            out.run = await self._exec(h, cmd, req, req.timeout_s)
        out.oom = self._oom_kills(h) > m.oom_base
        for p in req.fetch_files:
            try:
                got = await b.files(h, FileRead(path=f"{FN_WORKDIR}/{check_path(p)}"))
            except DsecError:
                continue  # not there (or not a file): SandboxFusion leaves it out of ``files``
            if isinstance(got, FileData):
                out.files[p] = got.data
        return out

    async def _exec(self, h: Handle, cmd: str, req: FnCallRequest, timeout_s: float) -> ExecResult:
        er = ExecRequest(cmd=cmd, envs=req.envs, cwd=FN_WORKDIR, timeout_s=timeout_s, output_cap=req.output_cap, trusted=req.trusted)
        t0 = time.perf_counter()
        res = await self.backend.exec(h, er, None)
        res.duration_ms = (time.perf_counter() - t0) * 1000
        return res

    def _oom_kills(self, h: Handle) -> int:
        return self.limits.oom_kills(h) if self.limits is not None else 0


def _bind(msg: Msg) -> dict[str, str]:
    return {"subject": msg.subject}


__all__ = ["CallLimits", "CallReset", "FnCalls", "FnPool", "Member", "parse_pools", "reset_paths"]
