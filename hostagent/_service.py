"""The host agent: wiring of its parts (registry, records, intake, reaper, reconcile, ops endpoint) into
one service, with heartbeats."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path
from typing import Any

import structlog

from bus import codec
from bus import subjects as S
from bus.messages import HostStatus
from bus.runtime import KV, Service
from bus.streams import StreamOptions, ensure_all

from . import _storage as storage
from ._backend import Backend, Handle
from ._execio import ExecIO
from ._ports import PortRelay
from ._intake import Intake
from ._metrics import HostMetrics
from ._ops import OpsEndpoint
from ._profiles import ProfileCache
from ._reaper import Reaper
from ._reconcile import Reconciler
from ._records import Records
from ._snapshots import Snapshots
from ._registry import LocalSandbox, Registry

log = structlog.get_logger("dsec.hostagent")

TICK_S = 0.5  # timeouts, leases and in-progress pings are checked this often


class HostAgent(Service):
    name = "hostagent"

    def __init__(
        self,
        backend: Backend,
        *,
        nats_url: str | None = None,
        host_id: str | None = None,
        data_dir: str = "/var/lib/dsec",
        concurrency: int = 8,
        heartbeat_s: float = 2.0,
        pool: str = "default",
        cpu_overcommit: float = 50.0,
        mem_overcommit: float = 1.0,
        max_sandboxes: int = 0,
        persist_state: bool = True,
        destroy_on_shutdown: bool = False,
        stream_options: StreamOptions = StreamOptions(),
        connection: Any = None,
        grace_s: float = 10.0,
        control_key: bytes | None = None,
        reconcile_s: float = 10.0,
        kill_wait_s: float = 10.0,
    ) -> None:
        super().__init__(nats_url, grace_s=grace_s)
        self.backend = backend
        self.control_key = control_key  # with a key, only work placement signed runs (bus.sign)
        self.host_id = host_id or socket.gethostname().split(".")[0].replace("_", "-")
        if not S.valid_token(self.host_id):
            raise ValueError(f"host id {self.host_id!r} must be 1-128 of [A-Za-z0-9_-]")
        self.data_dir = Path(data_dir)
        self.concurrency = concurrency
        self.heartbeat_s = heartbeat_s
        self.pool = pool
        self.cpu_overcommit = cpu_overcommit
        self.mem_overcommit = mem_overcommit
        self.max_sandboxes = max_sandboxes
        self.persist_state = persist_state
        self.destroy_on_shutdown = destroy_on_shutdown
        self.stream_options = stream_options
        self._shared_nc = connection
        self.profiles: ProfileCache | None = None  # guard's security profiles (backends that enforce them)
        self.registry = Registry(self.data_dir / "hosts" / self.host_id / "sandboxes", persist=persist_state)
        self.records = Records(self.host_id)
        self.intake = Intake(self)
        self.reaper = Reaper(self, kill_wait_s=kill_wait_s)
        self.reconciler = Reconciler(self, period_s=reconcile_s)
        self.ops = OpsEndpoint(self)
        self.m = HostMetrics(self)  # Prometheus metrics: creates, their latency, ops, sandboxes, memory and CPU
        self.execio = ExecIO(backend, lambda: self.nc, self.host_id)  # exec streaming, background processes, watches
        self.snapshots = Snapshots(self)  # snapshot, fork, pause/resume; restores from snapshots
        self.ports = PortRelay(lambda: self.nc)  # sandbox ports relayed over NATS (the gateway's get_host)
        self.registry.observers.append(self.reaper.observe)
        self._kv_hosts: KV[HostStatus] | None = None
        self._resident_mb = 0
        self._cpu_busy = 0.0

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
        self._kv_hosts = await KV.open(self.js, S.KV_HOSTS, codec.HOST_STATUS)
        self.intake.kv_images = await KV.open(self.js, S.KV_IMAGES, codec.TEMPLATE)
        if getattr(self.backend, "enforces_profiles", False):
            # guard's profiles, watched in KV; built-in copies until guard has written them
            self.profiles = ProfileCache()
            await self.profiles.start(self.js)
        self.registry.ensure_dir()
        await self.backend.start()
        await self.reconciler.recover()
        # Before the first heartbeat: placement hands work to a host as soon as it sees one. What waits
        # for a slot waits here (placement holds each request until this host answers, bus.runtime.handoff).
        await self.add_inbox(S.host_all(self.host_id), self.intake.handle, capacity=self.concurrency, name=f"host-{self.host_id}")
        await self._heartbeat()
        self.spawn(self._heartbeat_loop(), name="heartbeat")
        self.spawn(self._tick_loop(), name="reaper")
        self.spawn(self.reconciler.loop(), name="reconcile")
        await self.records.host_event("up")

    async def teardown(self) -> None:
        if self.destroy_on_shutdown and self.registry.live:
            for sid in list(self.registry.live):
                self.reaper.begin(sid, "host-shutdown")
            if self.reaper.teardowns:
                await asyncio.wait(set(self.reaper.teardowns.values()), timeout=max(self.grace_s, 60.0))
        await self.reaper.stop()
        await self.ops.stop()
        await self.execio.stop()
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
        return HostStatus(
            host_id=self.host_id,
            backend=self.backend.name,
            at=time.time(),
            pool=self.pool,
            cpu_total=float(cap["cpu_total"]),
            mem_total_mb=int(cap["mem_total_mb"]),
            disk_total_mb=int(cap["disk_total_mb"]),
            cpu_alloc=reg.alloc.cpu,
            mem_alloc_mb=int(reg.alloc.mem_mb),
            mem_resident_mb=self._resident_mb,
            disk_alloc_mb=int(reg.alloc.disk_mb),
            cpu_busy=self._cpu_busy,
            sandboxes=len(reg),
            max_sandboxes=self.max_sandboxes,
            concurrency=self.concurrency,
            layers=self._cached_layers(),
            cpu_overcommit=self.cpu_overcommit,
            mem_overcommit=self.mem_overcommit,
            cpu_alloc_ls=reg.alloc.cpu_ls,
            disk_free_mb=storage.heartbeat_free_mb(self.data_dir),
        )

    def _cached_layers(self) -> list[str]:
        cached = getattr(self.backend, "cached_layers", None)
        return list(cached()) if cached else []

    async def _heartbeat(self) -> None:
        if self._kv_hosts is None:
            return
        try:
            u = await self.backend.usage()
            self._resident_mb, self._cpu_busy = u.mem_resident_mb, u.cpu_busy
        except Exception as exc:  # noqa: BLE001 - a usage probe failure must not stop heartbeats
            log.warning("usage_failed", error=str(exc))
        await self._kv_hosts.put(self.host_id, self._status())

    async def _heartbeat_loop(self) -> None:
        while not await self.pause(self.heartbeat_s):
            try:
                await self._heartbeat()
            except Exception as exc:  # noqa: BLE001
                log.warning("heartbeat_failed", error=str(exc))


__all__ = ["HostAgent", "LocalSandbox"]
