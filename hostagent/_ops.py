"""The ops endpoint: core request/reply on ``dsec.sbx.<id>.<op>`` (exec, files, kill, timeout, info, display, ...)
for every sandbox this host holds, one subscription per sandbox, each request answered."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bus import codec
from bus import subjects as S
from bus.errors import BadRequest, DsecError, NotSupported, SandboxNotFound, SandboxNotRunning
from bus.messages import (
    KILL_DONE,
    KILL_PENDING,
    DisplayRequest,
    Done,
    ExecRequest,
    ExecResult,
    FileRemove,
    FileRename,
    FileUnwatch,
    FileWatch,
    FileWrite,
    InfoRequest,
    KillRequest,
    NetworkSpec,
    PauseRequest,
    ResumeRequest,
    SnapshotRequest,
    MetricsRequest,
    PortOpen,
    PortSend,
    ProcConnect,
    ProcDisconnect,
    ProcessStarted,
    ProcInput,
    ProcList,
    ProcSignal,
    SandboxInfo,
    SetNetwork,
    SetTimeout,
    StreamAck,
)
from bus.runtime import Endpoint, NotMine

from ._backend import Backend, Handle, Networked
from ._display import display
from ._execio import ExecIO, encode_reply
from ._metrics import HostMetrics
from ._ports import PortRelay
from ._reclaim_link import ReclaimLink
from ._reaper import Reaper
from ._registry import LocalSandbox, Registry
from ._snapshots import Snapshots
from ._trajectory import Trajectory
from ._tenancy import check_tenant
from ._uploads import Uploads

log = structlog.get_logger("dsec.hostagent")


class OpsEndpoint:
    """One ``bus.runtime.Endpoint`` (its error boundary, stats and reply-size check) serving every
    sandbox's ``dsec.sbx.<id>.*``; ops of one sandbox run concurrently (a long exec does not hold up
    a file read)."""

    def __init__(
        self, host_id: str, registry: Registry, backend: Backend, execio: ExecIO, ports: PortRelay, m: HostMetrics, reclaim: ReclaimLink | None = None,
    ) -> None:
        self.host_id = host_id
        self.reclaim = reclaim  # told each operation (idleness), and what the reclaim service reports
        self.registry = registry
        self.backend = backend
        self.execio = execio
        self.ports = ports
        self.m = m
        self.reaper: Reaper | None = None
        self.snapshots: Snapshots | None = None
        self.endpoint: Endpoint | None = None
        self.trajectory: Trajectory | None = None
        self.inflight = 0  # requests being answered now
        self.uploads: Uploads | None = None  # the per-tenant bound on uploaded bytes (hostagent._uploads)
        # True when the cluster gave the sandbox up while this host was cut off (hostagent._reconcile:
        # fencing); asked before each op only while the host is back from a silence and not yet swept.
        self.fenced: Callable[[str], Awaitable[str]] | None = None

    def bind(self, reaper: Reaper, snapshots: Snapshots) -> None:
        """The parts that kill and snapshot sandboxes (made after this endpoint: they unserve through it)."""
        self.reaper, self.snapshots = reaper, snapshots

    def start(self, nc: NATS) -> None:
        self.trajectory = Trajectory(nc, self.host_id)
        # Replies within the payload limit: command output cut to fit, anything else a typed error (execio).
        self.endpoint = Endpoint(nc, "sbx", self._handle, decoder=codec.SBX_REQUEST_DECODERS, bind=_bind, encoder=encode_reply)

    async def serve(self, sid: str) -> None:
        assert self.endpoint is not None
        await self.endpoint.serve(S.sbx_all(sid))

    async def unserve(self, sid: str) -> None:
        if self.endpoint is not None:
            await self.endpoint.unserve(S.sbx_all(sid))

    async def stop(self) -> None:
        if self.endpoint is not None:
            await self.endpoint.stop()
        if self.trajectory is not None:
            await self.trajectory.stop()

    async def _handle(self, msg: Msg, req: Any) -> Any:
        parts = S.parse_sbx(msg.subject)
        if parts is None:
            raise BadRequest(f"not a sandbox operation subject: {msg.subject}")
        tenant, sid, op = parts
        if self.fenced is not None and sid in self.registry:  # nothing logged nor run for a sandbox the cluster gave up
            fenced = await self.fenced(sid)
            if fenced == "elsewhere":
                raise NotMine(sid)  # no answer at all: the host that holds it now answers
            if fenced:
                raise SandboxNotFound(f"sandbox {sid} is not running on this host (declared lost while this host was cut off)")
        self.inflight += 1
        t0 = time.perf_counter()
        code = "ok"
        if self.reclaim is not None and sid in self.registry:
            self.reclaim.touch(sid)
        try:
            ls = self.registry.get(sid)
            owner = S.tenant(ls.spec.client) if ls is not None else S.OPERATOR_TENANT  # the log is under its owner's tenant
            if tenant != owner and tenant != S.OPERATOR_TENANT:  # the owner's own ops skip the call (every exec)
                await check_tenant(self.endpoint.nc if self.endpoint else None, self.host_id, ls, tenant, op)
            assert self.trajectory is not None
            return await self.trajectory.run(sid, op, req, lambda: self._dispatch(sid, req), tenant=owner)
        except DsecError as exc:
            code = exc.code
            raise
        except Exception:
            code = "internal"
            raise
        finally:
            self.inflight -= 1
            if self.reclaim is not None and sid in self.reclaim.last_op:
                self.reclaim.touch(sid)  # idle from the end of a long exec, not its start
            self.m.op(op if op in S.SBX_OPS else "unknown", code, time.perf_counter() - t0)

    async def _dispatch(self, sid: str, req: Any) -> Any:
        assert self.reaper is not None
        handle = self.registry.handles.get(sid)
        ls = self.registry.get(sid)
        if handle is None or ls is None:
            raise SandboxNotFound(f"sandbox {sid} is not running on this host")
        if ls.state == "stopping":
            return await self._while_stopping(sid, ls, handle, req)
        if ls.state == "paused" and not isinstance(req, (InfoRequest, KillRequest, SetTimeout, PauseRequest, ResumeRequest, SnapshotRequest)):
            raise SandboxNotRunning(f"sandbox {sid} is paused: resume it first", state="paused")
        match req:
            case ExecRequest():
                return await self._exec(handle, ls, req)
            case SnapshotRequest() | PauseRequest() | ResumeRequest():
                return await self._snapshot_op(ls, handle, req)
            case StreamAck():
                self.execio.ack(sid, req)
                return Done()
            case ProcList() | ProcSignal() | ProcInput() | ProcConnect() | ProcDisconnect():
                return await self.execio.proc(handle, req)
            case FileWatch() | FileUnwatch():
                return await self.execio.watch(handle, req)
            case MetricsRequest():
                return await self.execio.metrics(handle)
            case KillRequest(reason=reason):
                done = await self.reaper.kill(sid, reason or "user")
                return Done(detail=KILL_DONE if done else KILL_PENDING)
            case SetTimeout() | SetNetwork():
                return await self._settings(ls, handle, req)
            case PortOpen() | PortSend():
                return await self.ports.handle(handle, req)
            case InfoRequest():
                return self._info(sid, ls, handle)
            case _:
                return await self._screen_or_files(handle, req, ls)

    async def _settings(self, ls: LocalSandbox, handle: Handle, req: SetTimeout | SetNetwork) -> Done:
        assert self.reaper is not None
        if isinstance(req, SetTimeout):
            if req.timeout_s <= 0:
                raise BadRequest("timeout must be > 0 seconds")
            await self.reaper.set_timeout(ls, req.timeout_s)
            return Done()
        return await self._set_network(ls, handle, req.network)

    async def _set_network(self, ls: LocalSandbox, handle: Handle, network: NetworkSpec | None) -> Done:
        """Replace the allowlist, then record it (the saved extra re-arms it after a restart; the record
        and spec say what the sandbox has). Idempotent: the same allowlist again changes nothing."""
        if not isinstance(self.backend, Networked):
            raise NotSupported(f"the {self.backend.name} backend cannot change a running sandbox's network")
        assert self.reaper is not None
        handle.extra = await self.backend.set_network(handle, network)
        ls.spec = msgspec.structs.replace(ls.spec, network=network if network is not None and network.allow_out else None)
        ls.extra = {**ls.extra, **handle.extra}
        self.registry.save(ls)
        await self.reaper.records.record(ls, ls.state)
        return Done()

    async def _screen_or_files(self, handle: Handle, req: Any, ls: LocalSandbox) -> Any:
        if isinstance(req, DisplayRequest):
            return await display(self.execio.caps, handle, req)
        up = self.uploads
        if up is None:
            return await self.backend.files(handle, req)
        sid = ls.spec.sandbox_id
        if isinstance(req, FileWrite):  # counted before it is written: an upload in flight is held too
            added = up.charge(S.tenant(ls.spec.client), sid, req.path, req.offset, len(req.data), req.truncate, req.size)
            try:
                return await self.backend.files(handle, req)
            except BaseException:
                up.refund(sid, req.path, added)
                raise
        out = await self.backend.files(handle, req)
        if isinstance(req, FileRemove):
            up.removed(sid, req.path)
        elif isinstance(req, FileRename):
            up.renamed(sid, req.path, req.new_path)
        return out

    async def _while_stopping(self, sid: str, ls: LocalSandbox, handle: Handle, req: Any) -> Any:
        """A sandbox being stopped answers only a (repeated) kill and info."""
        match req:
            case KillRequest():
                assert self.reaper is not None
                done = await self.reaper.kill(sid, ls.end_reason or "user")
                return Done(detail=KILL_DONE if done else KILL_PENDING)
            case InfoRequest():
                return self._info(sid, ls, handle)
        raise SandboxNotFound(f"sandbox {sid} is being stopped ({ls.end_reason})")

    async def _snapshot_op(self, ls: LocalSandbox, handle: Handle, req: Any) -> Any:
        snapshots = self.snapshots
        assert snapshots is not None
        match req:
            case SnapshotRequest():
                return await snapshots.snapshot(ls, handle, req)
            case PauseRequest():
                return await snapshots.pause(ls, handle, req)
            case _:
                return await snapshots.resume(ls, handle)

    def _info(self, sid: str, ls: LocalSandbox, handle: Handle) -> SandboxInfo:
        return SandboxInfo(
            sandbox_id=sid, state=ls.state, host_id=self.host_id, template=ls.spec.template,
            started_at=ls.started_at, expires_at=ls.expires_at, metadata=ls.spec.metadata, pid=handle.pid,
            cpu_class=ls.spec.priority, **self._memory(sid),
        )

    def _memory(self, sid: str) -> dict[str, int]:
        mem = self.reclaim.memory.get(sid) if self.reclaim is not None else None
        if mem is None:
            return {}
        return {"mem_resident_bytes": mem.resident_bytes, "mem_reclaimed_bytes": mem.reclaimed_bytes, "mem_merged_bytes": mem.merged_bytes}

    async def _exec(self, handle: Handle, ls: LocalSandbox, req: ExecRequest) -> ExecResult | ProcessStarted:
        if not req.cwd and ls.extra.get("image_workdir"):  # the template image's WORKDIR / USER
            req.cwd = ls.extra["image_workdir"]
        if not req.user and ls.extra.get("image_user") and not req.trusted:
            req.user = ls.extra["image_user"]
        return await self.execio.exec(handle, ls.spec.envs, req, S.tenant(ls.spec.client))


def _bind(msg: Msg) -> dict[str, str]:
    parts = S.parse_sbx(msg.subject)
    return {"sandbox_id": parts[1] if parts else "", "subject": msg.subject}


__all__ = ["OpsEndpoint"]
