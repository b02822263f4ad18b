"""The placement service: replicas share one durable pull consumer on ``dsec.req.>``."""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid

import structlog
from nats.aio.msg import Msg
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from bus import codec
from bus import subjects as S
from bus.errors import BadRequest, DsecError, InvalidArgument, NoCapacity, SandboxTimeout, UnknownTemplate
from bus.messages import CreateBatch, CreateSandbox, HostStatus, PlaceBatch, PlaceSandbox, SandboxEvent, SandboxSpec, TemplateManifest
from bus.runtime import Service
from bus.streams import StreamOptions, ensure_all, ensure_kv

from ._table import HostTable, Policy

log = structlog.get_logger("dsec.placement")

MAX_ATTEMPTS = 5
VALID_BACKENDS = {"container", "fncall", "microvm", "vm", "sim"}
VALID_PRIORITIES = {"best-effort", "latency-sensitive"}


def validate_spec(spec: SandboxSpec) -> None:
    """Server-side check of what the SDK also checks: a request from any client is validated."""
    if not S.valid_token(spec.sandbox_id):
        raise InvalidArgument(f"sandbox_id {spec.sandbox_id!r} must be 1-128 of [A-Za-z0-9_-]")
    if not (0 < spec.cpu <= 256):
        raise InvalidArgument(f"cpu must be > 0 and <= 256, got {spec.cpu}")
    if not (16 <= spec.memory_mb <= 1024 * 1024):
        raise InvalidArgument(f"memory_mb must be between 16 and 1048576, got {spec.memory_mb}")
    if not (1 <= spec.disk_mb <= 1024 * 1024 * 16):
        raise InvalidArgument(f"disk_mb must be between 1 and 16777216, got {spec.disk_mb}")
    if spec.timeout_s <= 0:
        raise InvalidArgument(f"timeout must be > 0 seconds, got {spec.timeout_s}")
    if spec.backend not in VALID_BACKENDS:
        raise InvalidArgument(f"backend must be one of {sorted(VALID_BACKENDS)}, got {spec.backend!r}")
    if spec.priority not in VALID_PRIORITIES:
        raise InvalidArgument(f"priority must be one of {sorted(VALID_PRIORITIES)}, got {spec.priority!r}")
    if not spec.template:
        raise InvalidArgument("template must be a non-empty name")


class Placement(Service):
    """Chooses a host for each create request and hands it to that host's work subject."""

    name = "placement"

    def __init__(
        self,
        nats_url: str | None = None,
        *,
        replica_id: str | None = None,
        capacity: int = 256,
        policy: Policy = Policy(),
        pending_delay_s: float = 0.5,
        max_attempts: int = MAX_ATTEMPTS,
        stream_options: StreamOptions = StreamOptions(),
        grace_s: float = 10.0,
    ) -> None:
        super().__init__(nats_url, grace_s=grace_s)
        self.replica_id = replica_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.capacity = capacity
        self.table = HostTable(policy)
        self.pending_delay_s = pending_delay_s
        self.max_attempts = max_attempts
        self.stream_options = stream_options
        self.templates: dict[str, TemplateManifest] = {}
        self.placed = 0
        self._kv_hosts: KeyValue | None = None
        self._kv_images: KeyValue | None = None
        self._hosts_seen = asyncio.Event()

    async def setup(self) -> None:
        assert self.js is not None
        await ensure_all(self.js, self.stream_options)
        self._kv_hosts = await ensure_kv(self.js, S.KV_HOSTS)
        self._kv_images = await ensure_kv(self.js, S.KV_IMAGES)
        self.spawn(self._watch_hosts(), name="watch-hosts")
        self.spawn(self._watch_templates(), name="watch-templates")
        await self.add_worker(
            stream=S.STREAM_REQ,
            durable=S.PLACEMENT_DURABLE,
            filter_subject="dsec.req.>",
            handler=self.handle,
            capacity=self.capacity,
            ack_wait_s=30.0,
            max_ack_pending=max(self.capacity * 8, 1024),  # shared by every replica
            name="placement",
        )

    # --- watches -------------------------------------------------------------------
    async def _watch_hosts(self) -> None:
        assert self._kv_hosts is not None
        watcher = await self._kv_hosts.watchall()
        try:
            while not self._stopped.is_set():
                try:
                    entry = await watcher.updates(timeout=1.0)
                except asyncio.TimeoutError:
                    continue
                except Exception:  # noqa: BLE001 - connection closing
                    if self._stopped.is_set():
                        return
                    raise
                if entry is None:
                    self._hosts_seen.set()
                    continue
                if entry.operation in ("DEL", "PURGE") or not entry.value:
                    self.table.remove(entry.key)
                    continue
                try:
                    self.table.update(codec.HOST_STATUS.decode(entry.value))
                except BadRequest as exc:
                    log.warning("bad_heartbeat", key=entry.key, error=str(exc))
        finally:
            try:
                await watcher.stop()
            except Exception:  # noqa: BLE001
                pass

    async def _watch_templates(self) -> None:
        assert self._kv_images is not None
        watcher = await self._kv_images.watchall()
        try:
            while not self._stopped.is_set():
                try:
                    entry = await watcher.updates(timeout=1.0)
                except asyncio.TimeoutError:
                    continue
                except Exception:  # noqa: BLE001
                    if self._stopped.is_set():
                        return
                    raise
                if entry is None:
                    continue
                if entry.operation in ("DEL", "PURGE") or not entry.value:
                    self.templates.pop(entry.key, None)
                    continue
                try:
                    self.templates[entry.key] = codec.TEMPLATE.decode(entry.value)
                except BadRequest as exc:
                    log.warning("bad_manifest", key=entry.key, error=str(exc))
        finally:
            try:
                await watcher.stop()
            except Exception:  # noqa: BLE001
                pass

    async def template(self, name: str) -> TemplateManifest | None:
        t = self.templates.get(name)
        if t is not None or self._kv_images is None:
            return t
        try:
            entry = await self._kv_images.get(name)
        except KeyNotFoundError:
            return None
        if not entry.value:
            return None
        return codec.TEMPLATE.decode(entry.value)

    # --- events ---------------------------------------------------------------------
    async def event(self, spec: SandboxSpec, kind: str, *, attempt: int = 0, host_id: str = "", err: DsecError | None = None, dedup: bool = True) -> None:
        assert self.js is not None
        ev = SandboxEvent(
            sandbox_id=spec.sandbox_id,
            kind=kind,
            at=time.time(),
            host_id=host_id,
            attempt=attempt,
            code=err.code if err else "",
            description=err.description if err else "",
        )
        headers = {S.HDR_MSG_ID: f"{spec.sandbox_id}:{kind}:{attempt}"} if dedup else None
        await self.js.publish(S.evt_sandbox(spec.sandbox_id, kind), codec.encode(ev), headers=headers)

    # --- the handler -------------------------------------------------------------------
    async def handle(self, msg: Msg) -> None:
        try:
            req = codec.REQ.decode(msg.data)
        except BadRequest as exc:
            await self.dead_letter(msg, exc)
            return
        match req:
            case CreateSandbox():
                await self.place_one(msg, req)
            case CreateBatch():
                await self.place_batch(msg, req)

    async def dead_letter(self, msg: Msg, exc: DsecError) -> None:
        """Malformed work is kept (not dropped) on the DLQ stream with the reason, then acked."""
        assert self.js is not None
        log.warning("dead_letter", subject=msg.subject, error=str(exc))
        await self.js.publish(
            S.dlq(msg.subject),
            msg.data,
            headers={S.HDR_ERROR_CODE: exc.code, "Dsec-Error": exc.description[:512], "Dsec-Origin": msg.subject},
        )
        await msg.ack()

    async def _precheck(self, spec: SandboxSpec) -> tuple[DsecError | None, set[str]]:
        try:
            validate_spec(spec)
        except DsecError as exc:
            return exc, set()
        if spec.create_deadline and time.time() > spec.create_deadline:
            return SandboxTimeout(f"create request for {spec.sandbox_id} expired before a host was found"), set()
        tmpl = await self.template(spec.template)
        if tmpl is None:
            return UnknownTemplate(f"unknown template {spec.template!r}; see `dsec image ls`", template=spec.template), set()
        return None, {l.digest for l in tmpl.layers}

    async def place_one(self, msg: Msg, req: CreateSandbox) -> None:
        spec = req.spec
        structlog.contextvars.bind_contextvars(sandbox_id=spec.sandbox_id, subject=msg.subject)
        try:
            err, layers = await self._precheck(spec)
            if err is not None:
                await self.event(spec, "failed", attempt=req.attempt, err=err)
                await msg.ack()
                log.info("create_refused", code=err.code, reason=err.description)
                return
            if req.attempt >= self.max_attempts:
                err = NoCapacity(f"no host accepted {spec.sandbox_id} after {req.attempt} attempts: {req.last_error}")
                await self.event(spec, "failed", attempt=req.attempt, err=err)
                await msg.ack()
                return
            exclude = set(req.exclude_hosts)
            host = self.table.choose(spec, exclude, layers)
            if host is None and exclude:
                host = self.table.choose(spec, set(), layers)  # every host was tried once; try again
            if host is None:
                await self.pending(msg, spec, req.attempt)
                return
            self.table.reserve(host, spec)
            place = PlaceSandbox(
                spec=spec, host_id=host, attempt=req.attempt, exclude_hosts=req.exclude_hosts,
                placed_by=self.replica_id, placed_at=time.time(),
            )
            await self.js.publish(  # type: ignore[union-attr]
                S.host_create(host), codec.encode(place), headers={S.HDR_MSG_ID: f"{spec.sandbox_id}:{req.attempt}"}
            )
            await self.event(spec, "placed", attempt=req.attempt, host_id=host)
            await msg.ack()
            self.placed += 1
            log.debug("placed", host_id=host, attempt=req.attempt)
        finally:
            structlog.contextvars.unbind_contextvars("sandbox_id", "subject")

    async def pending(self, msg: Msg, spec: SandboxSpec, attempt: int) -> None:
        """No host fits: the request waits in the stream (NAK with delay); clients see ``pending``."""
        delivered = msg.metadata.num_delivered if msg.metadata else 1
        if delivered == 1 or delivered % 20 == 0:
            await self.event(spec, "pending", attempt=attempt, err=NoCapacity("no host has room; waiting"), dedup=False)
        await msg.nak(delay=min(self.pending_delay_s * (1 + delivered // 10), 5.0))

    async def place_batch(self, msg: Msg, req: CreateBatch) -> None:
        """A batch lands on as few hosts as possible; specs that fit nowhere go back as single requests."""
        assert self.js is not None
        by_host: dict[str, list[SandboxSpec]] = {}
        leftovers: list[SandboxSpec] = []
        for spec in req.specs:
            err, layers = await self._precheck(spec)
            if err is not None:
                await self.event(spec, "failed", err=err)
                continue
            host = self.table.choose(spec, set(), layers)
            if host is None:
                leftovers.append(spec)
                continue
            self.table.reserve(host, spec)
            by_host.setdefault(host, []).append(spec)
        for host, specs in by_host.items():
            pb = PlaceBatch(batch_id=req.batch_id, host_id=host, specs=specs, attempt=req.attempt, placed_by=self.replica_id, placed_at=time.time())
            await self.js.publish(S.host_create(host), codec.encode(pb), headers={S.HDR_MSG_ID: f"{req.batch_id}:{host}:{req.attempt}"})
            for spec in specs:
                await self.event(spec, "placed", host_id=host)
        for spec in leftovers:
            # Single requests can wait in the stream individually; dedup keeps redeliveries single.
            await self.js.publish(S.REQ_CREATE, codec.encode(CreateSandbox(spec=spec)), headers={S.HDR_MSG_ID: spec.sandbox_id})
        self.placed += sum(len(v) for v in by_host.values())
        await msg.ack()


__all__ = ["Placement", "validate_spec", "HostTable", "Policy"]
