"""The host agent: wiring of its parts (registry, records, intake, reaper, reconcile, ops endpoint) into
one service, with heartbeats. Each part is given what it uses, never the agent itself."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import structlog
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from bus import codec
from bus import subjects as S
from bus.messages import GuardViolation, HostBackend, HostStatus
from bus.runtime import KV, Service
from bus.streams import StreamOptions, ensure_all

from . import _storage as storage
from ._backend import Backend, Capabilities, Handle
from ._config import HostAgentConfig
from ._diskwatch import DiskWatch
from ._execio import ExecIO
from ._fncall import FnCalls, parse_pools
from ._intake import Intake
from ._metrics import HostMetrics
from ._ops import OpsEndpoint
from ._ports import PortRelay
from ._reclaim_link import ReclaimLink
from ._profiles import ProfileCache
from ._reaper import Reaper
from ._reconcile import Reconciler
from ._records import Records
from ._registry import LocalSandbox, Registry
from ._snapshots import Snapshots
from ._uploads import LIMIT as UPLOAD_LIMIT, Uploads, register_metrics as register_upload_metrics

log = structlog.get_logger("dsec.hostagent")

TICK_S = 0.5  # timeouts, leases and in-progress pings are checked this often


class HostAgent(Service):
    name = "hostagent"

    def __init__(
        self, backend: Backend, config: HostAgentConfig | None = None, *, connection: Any = None,
        stream_options: StreamOptions = StreamOptions(),
    ) -> None:
        config = config or HostAgentConfig()
        super().__init__(config.nats_url, grace_s=config.grace_s)
        self.config = config
        self.backend = backend
        self.caps = Capabilities.of(backend)  # its optional abilities, looked up once
        self.host_id = config.host_id
        if not S.valid_token(self.host_id):
            raise ValueError(f"host id {self.host_id!r} must be 1-128 of [A-Za-z0-9_-]")
        self.data_dir = Path(config.data_dir)
        self.stream_options = stream_options
        self.metrics_port = config.metrics_port
        self._shared_nc = connection
        # guard's security profiles, watched in KV (backends that enforce them)
        self.profiles: ProfileCache | None = ProfileCache() if self.caps.enforces_profiles else None
        self.registry = Registry(self.data_dir / "hosts" / self.host_id / "sandboxes", persist=config.persist_state)
        self.records = Records(self.host_id)
        self.ports = PortRelay(self._connection)  # sandbox ports relayed over NATS (the gateway's get_host)
        self.execio = ExecIO(backend, self.caps, self._connection, self.host_id)  # exec streaming, background processes, watches
        creating: dict[str, asyncio.Future[None]] = {}  # sandboxes being made now (the intake's)
        self.m = HostMetrics(self.metrics, creating, self.registry, self._status)  # Prometheus metrics
        self.reclaim = ReclaimLink(self.host_id, self.registry, backend)
        self.ops = OpsEndpoint(self.host_id, self.registry, backend, self.execio, self.ports, self.m, self.reclaim)
        self.reaper = Reaper(
            self.registry, self.records, backend, creating, self.execio, self.ports, self.ops.unserve, self._jetstream,
            kill_wait_s=config.kill_wait_s,
        )
        self.snapshots = Snapshots(  # snapshot, fork, pause/resume; restores from snapshots
            self.host_id, self.data_dir, self.caps, self.registry, self.records, self.reaper.kill, self.profiles, self._connection, self._jetstream,
            creating,
            limits=storage.Limits.of(config), reserve_mb=config.write_reserve_mb,
        )
        self.diskwatch = DiskWatch(  # who filled the disk: reported to guard
            self.host_id, self.data_dir, self.registry, self.caps, reserve_mb=config.write_reserve_mb, window_s=config.disk_growth_window_s,
            publish=self._violation,
        )
        # the data dir's free space, the snapshots' bytes by tenant, the storage limits
        self._figures_stale = storage.register_metrics(
            self.metrics, self.data_dir, host_id=self.host_id, js=self._jetstream if self.caps.freezer is not None else None,
            limits=lambda: self.snapshots.limits,
        )
        self.ops.uploads = Uploads(config.upload_max_bytes_per_tenant, self.registry.__contains__)
        register_upload_metrics(self.metrics, self.ops.uploads)
        self.snapshots.stored = self._stored
        self.ops.bind(self.reaper, self.snapshots)  # (they unserve through it: bound once both exist)
        self.intake = Intake(
            config, backend, self.caps, self.profiles, self.registry, self.records, self.reaper, self.ops, self.snapshots, self.m, creating,
            stream_options.dedup_window_s,
        )
        self.reconciler = Reconciler(
            self.host_id, self.registry, self.records, backend, self.reaper, self.ops, creating, self._jetstream, self.pause,
            period_s=config.reconcile_s,
        )
        self.registry.observers.append(self.reaper.observe)
        self.fncalls = FnCalls(  # FnCall's warm pools (none unless configured)
            self.host_id, backend, parse_pools(config.fn_pools), layers=self.intake.layers, owner=self.intake.owner,
            security=lambda: self.profiles.enforcement("default") if self.profiles is not None else None,
            max_members=config.fn_pool_max, memory_mb=config.fn_memory_mb, disk_mb=config.fn_disk_mb,
            starts=config.fn_starts,
        )
        self.reconciler.also_holds = self.fncalls.holds
        if self.registry.persist:  # simulated hosts keep no state and never fence
            self.ops.fenced = self.reconciler.gave_up
        self._kv_hosts: KV[HostStatus] | None = None
        self._resident_mb = 0
        self._cpu_busy = 0.0

    def _connection(self) -> NATS | None:
        return self.nc

    def _jetstream(self) -> JetStreamContext | None:
        return self.js

    # The live table, as tests, benchmarks and the simulated hosts read it.
    @property
    def live(self) -> dict[str, LocalSandbox]:
        return self.registry.live

    @property
    def handles(self) -> dict[str, Handle]:
        return self.registry.handles

    @property
    def created(self) -> int:
        return self.intake.created

    # --- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._shared_nc is None:
            await super().start()
            return
        # Many simulated hosts can share one connection in scale runs.
        self.nc = self._shared_nc
        self.js = self.nc.jetstream()
        await self.setup()

    async def setup(self) -> None:
        assert self.js is not None and self.nc is not None
        if self._shared_nc is None:  # many sim hosts on one connection: their runner set streams up once
            await ensure_all(self.js, self.stream_options)
        await self.records.start(self.nc, self.js)
        self.ops.start(self.nc)
        await self.reclaim.start(self.nc)
        self._kv_hosts = await KV.open(self.js, S.KV_HOSTS, codec.HOST_STATUS)
        self.intake.kv_images = await KV.open(self.js, S.KV_IMAGES, codec.TEMPLATE)
        if self.profiles is not None:  # built-in copies until guard has written them
            await self.profiles.start(self.js)
        self.registry.ensure_dir()
        await self.backend.start()
        await self.reconciler.recover()
        try:  # fork directories a restart left: packed again, or removed when nothing stacks them
            await self.snapshots.forks.recover()
        except Exception as exc:  # noqa: BLE001 - KV away: they are looked at again when a child of theirs ends
            log.warning("fork_recovery_failed", error=str(exc))
        # Before the first heartbeat: placement hands work to a host as soon as it sees one. What waits
        # for a slot waits here (placement holds each request until this host answers, bus.runtime.handoff).
        await self.add_inbox(S.host_all(self.host_id), self.intake.handle, capacity=self.config.concurrency, name=f"host-{self.host_id}")
        await self.fncalls.start(self.nc)
        await self._heartbeat()
        self.spawn(self._heartbeat_loop(), name="heartbeat")
        self.spawn(self._tick_loop(), name="reaper")
        self.spawn(self.reconciler.loop(), name="reconcile")
        await self.records.host_event("up")

    async def teardown(self) -> None:
        if self.config.destroy_on_shutdown and self.registry.live:
            for sid in list(self.registry.live):
                self.reaper.begin(sid, "host-shutdown")
            if self.reaper.teardowns:
                await asyncio.wait(set(self.reaper.teardowns.values()), timeout=max(self.grace_s, 60.0))
        await self.reaper.stop()
        await self.intake.stop()
        await self.snapshots.forks.stop()
        await self.ops.stop()
        await self.execio.stop()
        await self.fncalls.stop(self.grace_s)
        try:
            if self._kv_hosts is not None:
                st = self._status()
                st.state = "down"
                await self._kv_hosts.put(self.host_id, st)
            await self.records.host_event("down")
        except Exception:  # noqa: BLE001 - NATS may already be gone
            pass
        if self.profiles is not None:
            await self.profiles.stop()
        await self.backend.stop()
        if self._shared_nc is not None:
            self.nc = None  # not ours to drain

    async def _tick_loop(self) -> None:
        while not await self.pause(TICK_S):
            await self.reaper.tick(time.time())

    # --- heartbeats ------------------------------------------------------------------------------------
    def _status(self) -> HostStatus:
        cap = self.backend.capacity()
        reg = self.registry
        cfg = self.config
        return HostStatus(
            host_id=self.host_id,
            backend=self.backend.name,
            at=time.time(),
            pool=cfg.pool,
            cpu_total=float(cap.cpu_total),
            mem_total_mb=int(cap.mem_total_mb),
            disk_total_mb=int(cap.disk_total_mb),
            cpu_alloc=reg.alloc.cpu,
            mem_alloc_mb=int(reg.alloc.mem_mb),
            mem_resident_mb=self._resident_mb,
            disk_alloc_mb=int(reg.alloc.disk_mb),
            cpu_busy=self._cpu_busy,
            sandboxes=len(reg),
            max_sandboxes=cfg.max_sandboxes,
            concurrency=cfg.concurrency,
            layers=self.caps.layer_cache.cached_layers() if self.caps.layer_cache is not None else [],
            cpu_overcommit=cfg.cpu_overcommit,
            mem_overcommit=cfg.mem_overcommit,
            cpu_alloc_ls=reg.alloc.cpu_ls,
            backends=self._backends(),
            disk_free_mb=storage.heartbeat_free_mb(self.data_dir),
            storage_limits={**self.snapshots.limits.named(), UPLOAD_LIMIT: self.ops.uploads.limit if self.ops.uploads is not None else 0},
            upload_bytes=self.ops.uploads.by_tenant() if self.ops.uploads is not None else {},
        )

    def _backends(self) -> list[HostBackend]:
        """What the heartbeat advertises: each backend this host runs, its limits and probe details."""
        b = self.backend.advertise()
        if self.caps.warm_pool is not None:
            b.detail = {**b.detail, "warm": str(self.caps.warm_pool.warm_ready())}
        return [b, self.fncalls.advertise()] if self.fncalls.pools else [b]

    async def _heartbeat(self) -> None:
        if self._kv_hosts is None:
            return
        try:
            u = await self.backend.usage()
            self._resident_mb, self._cpu_busy = u.mem_resident_mb + self.reclaim.swap_mb(), u.cpu_busy
        except Exception as exc:  # noqa: BLE001 - a usage probe failure must not stop heartbeats
            log.warning("usage_failed", error=str(exc))
        await self._kv_hosts.put(self.host_id, self._status())
        await self.reclaim.publish()
        await self.diskwatch.tick()

    def _stored(self, sandbox_id: str, nbytes: int) -> None:
        self.diskwatch.note_stored(sandbox_id, nbytes)
        self._figures_stale()

    async def _violation(self, v: GuardViolation) -> None:
        assert self.records.publisher is not None
        await self.records.publisher.store(S.EVT_GUARD_VIOLATION, codec.encode(v))

    async def _heartbeat_loop(self) -> None:
        last_ok = time.monotonic()
        reconnects = self._reconnects()
        self.reconciler.silence_s = 3 * self.config.heartbeat_s
        fence: asyncio.Task[Any] | None = None
        while not await self.pause(self.config.heartbeat_s):
            try:
                await self._heartbeat()
            except Exception as exc:  # noqa: BLE001
                log.warning("heartbeat_failed", error=str(exc))
                self.reconciler.suspect = self.registry.persist  # the cluster may be deciding without us
                continue
            # Back after a silence (a cut link, NATS away): the cluster may have declared this host down
            # and its sandboxes lost meanwhile; those must go before they answer anyone (fencing).
            now, n = time.monotonic(), self._reconnects()
            away = now - last_ok > 3 * self.config.heartbeat_s or n != reconnects or self.reconciler.suspect
            last_ok, reconnects = now, n
            if away and self.registry.persist and (fence is None or fence.done()):
                log.info("back_after_silence", reconnects=n)
                self.reconciler.suspect = True  # until the sweep is done, each op checks its record first
                fence = self.spawn(self._fence(), name="fence")
            self.reconciler.last_beat = now

    async def _fence(self) -> int:
        try:
            n = await self.reconciler.sweep_records()
        except Exception as exc:  # noqa: BLE001 - NATS away again: the periodic sweep checks later
            log.warning("fence_failed", error=f"{type(exc).__name__}: {exc}")
            return 0
        self.reconciler.suspect = False
        return n

    def _reconnects(self) -> int:
        return int(self.nc.stats.get("reconnects", 0)) if self.nc is not None else 0


__all__ = ["HostAgent", "LocalSandbox"]
