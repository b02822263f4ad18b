"""The ops endpoint: core request/reply on ``dsec.sbx.<id>.<op>`` (exec, files, kill, timeout, info)
for every sandbox this host holds, one subscription per sandbox, each request answered."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import structlog
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from bus import codec
from bus import subjects as S
from bus.acks import Sink
from bus.errors import BadRequest, DsecError, SandboxNotFound
from bus.messages import KILL_DONE, KILL_PENDING, Done, ExecChunk, ExecRequest, ExecResult, InfoRequest, KillRequest, SandboxEvent, SandboxInfo, SetTimeout
from bus.runtime import error_of

from ._backend import Handle
from ._registry import LocalSandbox

if TYPE_CHECKING:
    from ._service import HostAgent

log = structlog.get_logger("dsec.hostagent")


class OpsEndpoint:
    def __init__(self, host: "HostAgent") -> None:
        self.host = host
        self.subs: dict[str, Subscription] = {}
        self.running: set[asyncio.Task[Any]] = set()  # ops in progress
        self._sink = Sink(self._on_msg)

    async def serve(self, sid: str) -> None:
        nc = self.host.nc
        assert nc is not None
        if sid in self.subs:
            return
        self.subs[sid] = await nc.subscribe(S.sbx_all(sid), future=self._sink)  # type: ignore[arg-type]

    async def unserve(self, sid: str) -> None:
        sub = self.subs.pop(sid, None)
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - connection closing
                pass

    async def stop(self) -> None:
        for t in list(self.running):
            t.cancel()
        for sid in list(self.subs):
            await self.unserve(sid)

    def _on_msg(self, msg: Msg) -> None:
        # Ops of one sandbox run concurrently: a long exec must not hold up a file read.
        t = asyncio.create_task(self._op(msg))
        self.running.add(t)
        t.add_done_callback(self.running.discard)

    async def _op(self, msg: Msg) -> None:
        if S.is_stream_delivery(msg.reply):
            # A push consumer anyone may create can deliver stored bytes here, past the publish
            # permissions on dsec.sbx.<id>.*, under the stored message's own subject (a KV key like
            # "<id>.kill" makes it look like an op); a real request's reply is an inbox. Not answered:
            # the reply would ack the attacker's consumer.
            log.warning("stream_delivered_op_refused", subject=msg.subject)
            return
        parts = msg.subject.split(".")
        if len(parts) != 4:
            return
        sid, op = parts[2], parts[3]
        structlog.contextvars.bind_contextvars(sandbox_id=sid, subject=msg.subject)
        t0 = time.perf_counter()
        code = "ok"
        try:
            dec = codec.SBX_REQUEST_DECODERS.get(op)
            if dec is None:
                raise BadRequest(f"unknown operation {op!r}; one of {', '.join(S.SBX_OPS)}")
            req = dec.decode(msg.data)
            result = await self._dispatch(sid, req)
        except DsecError as exc:
            code = exc.code
            result = exc.to_reply()
        except Exception as exc:  # noqa: BLE001 - every request gets an answer
            log.exception("op_failed")
            result = error_of(exc)
            code = result.code
        finally:
            structlog.contextvars.unbind_contextvars("sandbox_id", "subject")
        if msg.reply:
            try:
                await msg.respond(codec.encode(result))
            except Exception as exc:  # noqa: BLE001
                log.warning("reply_failed", sandbox_id=sid, error=str(exc))
        log.debug("op", sandbox_id=sid, op=op, code=code, ms=round((time.perf_counter() - t0) * 1000, 2))

    async def _dispatch(self, sid: str, req: Any) -> Any:
        host = self.host
        handle = host.registry.handles.get(sid)
        ls = host.registry.get(sid)
        if handle is None or ls is None:
            raise SandboxNotFound(f"sandbox {sid} is not running on this host")
        if ls.state == "stopping":
            match req:
                case KillRequest():
                    done = await host.reaper.kill(sid, ls.end_reason or "user")
                    return Done(detail=KILL_DONE if done else KILL_PENDING)
                case InfoRequest():
                    return self._info(sid, ls, handle)
            raise SandboxNotFound(f"sandbox {sid} is being stopped ({ls.end_reason})")
        match req:
            case ExecRequest():
                return await self._exec(handle, ls, req)
            case KillRequest(reason=reason):
                done = await host.reaper.kill(sid, reason or "user")
                return Done(detail=KILL_DONE if done else KILL_PENDING)
            case SetTimeout(timeout_s=t):
                if t <= 0:
                    raise BadRequest("timeout must be > 0 seconds")
                await host.reaper.set_timeout(ls, t)
                return Done()
            case InfoRequest():
                return self._info(sid, ls, handle)
            case _:
                return await host.backend.files(handle, req)

    def _info(self, sid: str, ls: LocalSandbox, handle: Handle) -> SandboxInfo:
        return SandboxInfo(
            sandbox_id=sid, state=ls.state, host_id=self.host.host_id, template=ls.spec.template,
            started_at=ls.started_at, expires_at=ls.expires_at, metadata=ls.spec.metadata, pid=handle.pid,
        )

    async def _exec(self, handle: Handle, ls: LocalSandbox, req: ExecRequest) -> ExecResult:
        nc = self.host.nc
        assert nc is not None
        seq = 0
        on_output: Any = None
        if req.stream_to and not S.valid_inbox(req.stream_to):
            # Output goes only to a reply inbox: never let a client make us publish on control subjects.
            raise BadRequest(f"stream_to must be an _INBOX subject, got {req.stream_to!r}")
        if req.stream_to:

            async def on_output(stream: int, data: bytes) -> None:
                nonlocal seq
                await nc.publish(req.stream_to, codec.encode(ExecChunk(seq=seq, stream=stream, data=data)))
                seq += 1

        if ls.spec.envs:
            req.envs = {**ls.spec.envs, **req.envs}
        t0 = time.perf_counter()
        res = await self.host.backend.exec(handle, req, on_output)
        res.chunks = seq
        res.duration_ms = (time.perf_counter() - t0) * 1000
        # Audit trail without an ack round trip on the exec path: a core publish the stream still captures.
        ev = SandboxEvent(
            sandbox_id=handle.sandbox_id, kind="exec", at=time.time(), host_id=self.host.host_id,
            detail={"cmd": req.cmd[:1024], "exit_code": str(res.exit_code), "timed_out": str(res.timed_out).lower()},
        )
        await self.host.records.sandbox_event(ev, acked=False)
        return res


__all__ = ["OpsEndpoint"]
