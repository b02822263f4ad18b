"""The reclaim service: one per host, beside the host agent, which it meets only on the bus.

The host agent publishes its sandboxes (cgroup, class, limit, time since their last operation) on
``bus.subjects.reclaim_targets`` with each heartbeat. Every pass the service reads each one's cgroup;
a running sandbox that has been idle ``idle_s`` (no operation, and under ``idle_cpu`` cores of CPU
since the previous pass) gives up to ``step_mb`` of cold memory (``_memcg.reclaim_step``): page
cache, and anonymous memory into the swap (the host's, or a zram device the service sets up);
ksmd merges the identical pages of processes the in-sandbox agent opted in. Each pass's figures go
out on ``bus.subjects.reclaim_report`` and as metrics.

Nothing a sandbox needs depends on the service: a step puts the sandbox's limit back before it
returns, and a restarted service repairs one it left half done; swapped pages stay the sandbox's."""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass

from nats.aio.msg import Msg

from bus import codec
from bus import subjects as S
from bus.errors import BadRequest
from bus.messages import ReclaimReport, ReclaimTarget, ReclaimTargets, SandboxMemory
from bus.runtime import Service

from . import _memcg as memcg
from . import _pageout
from ._config import ReclaimConfig
from ._host import HostSetup, ksm_saved_bytes, swap_size_mb

TARGETS = codec.Decoder(ReclaimTargets)
MIB = 1 << 20
# Forget the host agent's list when it has not repeated it for this many passes (it stopped).
STALE_PASSES = 6


@dataclass
class _Seen:
    cpu_ns: int = 0
    at: float = 0.0
    reclaimed: int = 0
    exhausted: bool = False  # the last step found nothing cold: wait for the sandbox to run again


class ReclaimService(Service):
    name = "reclaim"

    def __init__(self, config: ReclaimConfig) -> None:
        super().__init__(config.nats_url, grace_s=config.grace_s)
        self.config = config
        self.host_id = config.host_id or socket.gethostname().split(".")[0]
        self.swap_mb = swap_size_mb(config.swap_mb)  # refused (SwapRefused) before anything is set up
        self.host = HostSetup.load(config.data_dir)
        self.swap_device = ""
        self.pageout = config.pageout and _pageout.available()
        self.targets: dict[str, ReclaimTarget] = {}
        self.targets_at = 0.0
        self.seen: dict[str, _Seen] = {}
        self.last: ReclaimReport | None = None
        self.passes = 0
        m = self.metrics
        self._g_resident = m.gauge("dsec_reclaim_sandbox_resident_bytes", "Memory charged to the sandbox's cgroup", ["sandbox"])
        self._g_reclaimed = m.gauge("dsec_reclaim_sandbox_reclaimed_bytes", "Memory the service took from the sandbox", ["sandbox"])
        self._g_merged = m.gauge("dsec_reclaim_sandbox_merged_bytes", "The sandbox's pages KSM merged", ["sandbox"])
        self._g_swapped = m.gauge("dsec_reclaim_sandbox_swapped_bytes", "The sandbox's pages in the swap (uncompressed)", ["sandbox"])
        self._g_class = m.gauge("dsec_reclaim_sandbox_info", "1 for each sandbox, labelled with the CPU class its cgroup is in", ["sandbox", "cpu_class"])
        self._g_host = m.gauge("dsec_reclaim_host_bytes", "Host figures of the reclaim service", ["kind"])
        m.collector(self._fill_metrics)

    async def setup(self) -> None:
        assert self.nc is not None
        if self.config.enabled:
            self.swap_device = await asyncio.to_thread(self.host.ensure_swap, self.swap_mb, self.config.swap_algorithm)
            if self.config.ksm:
                await asyncio.to_thread(self.host.start_ksm, self.config.ksm_pages_to_scan, self.config.ksm_sleep_ms)
        await self.nc.subscribe(S.reclaim_targets(self.host_id), cb=self._on_targets)
        self.spawn(self._loop(), name="reclaim-passes")
        self.log.info("reclaim_started", host_id=self.host_id, enabled=self.config.enabled, swap=self.swap_device or "none")

    async def teardown(self) -> None:
        if self.config.enabled:
            await asyncio.to_thread(self.host.remove_swap)
            await asyncio.to_thread(self.host.stop_ksm)

    async def _on_targets(self, msg: Msg) -> None:
        try:
            t = TARGETS.decode(msg.data)
        except BadRequest as exc:
            self.log.warning("bad_targets", error=str(exc))
            return
        if t.host_id != self.host_id:
            return
        self.targets = {s.sandbox_id: s for s in t.sandboxes if memcg.valid_cgroup(s.cgroup)}
        self.targets_at = time.monotonic()
        for sid in set(self.seen) - set(self.targets):
            del self.seen[sid]

    async def _loop(self) -> None:
        while not await self.pause(self.config.interval_s):
            try:
                report = await asyncio.to_thread(self.run_pass)
                assert self.nc is not None
                await self.nc.publish(S.reclaim_report(self.host_id), codec.encode(report))
            except Exception as exc:  # noqa: BLE001 - one bad pass must not end the passes
                self.log.error("reclaim_pass_failed", error=str(exc))

    # --- one pass (in a thread: cgroupfs writes block while the kernel reclaims) ---------------
    def run_pass(self) -> ReclaimReport:
        self.passes += 1
        if self.targets_at and time.monotonic() - self.targets_at > STALE_PASSES * max(self.config.interval_s, 1.0):
            self.targets, self.seen = {}, {}
        now = time.monotonic()
        out: list[SandboxMemory] = []
        for sid, t in list(self.targets.items()):
            seen = self.seen.setdefault(sid, _Seen())
            memcg.repair(t.cgroup)
            cpu = memcg.cpu_ns(t.cgroup)
            if cpu is None:
                continue  # gone between the list and now
            busy = (cpu - seen.cpu_ns) / 1e9 / (now - seen.at) if seen.at else float("inf")
            if busy < self.config.idle_cpu and memcg.runnable(t.cgroup):
                busy = float("inf")  # starved, not idle
            if busy >= self.config.idle_cpu:
                seen.exhausted = False
            seen.cpu_ns, seen.at = cpu, now
            idle = t.state == "running" and t.idle_s >= self.config.idle_s and busy < self.config.idle_cpu
            if idle and self.config.enabled and not seen.exhausted:
                got = memcg.reclaim_step(t.cgroup, self.config.step_mb * MIB, self.config.keep_mb * MIB, self.pageout,
                                         self.config.agent_hot)
                seen.reclaimed += got
                seen.exhausted = got < MIB
            st = memcg.stat(t.cgroup)
            out.append(SandboxMemory(
                sandbox_id=sid, resident_bytes=memcg.usage(t.cgroup) or 0, reclaimed_bytes=seen.reclaimed,
                swapped_bytes=st.get("swap", 0), merged_bytes=memcg.merged_bytes(t.cgroup), idle_s=t.idle_s,
                cpu_class=memcg.cpu_class(t.cgroup),
            ))
        used, stored = self.host.swap_stored()
        self.last = ReclaimReport(
            host_id=self.host_id, at=time.time(), enabled=self.config.enabled, sandboxes=out,
            resident_bytes=sum(s.resident_bytes for s in out), reclaimed_bytes=sum(s.reclaimed_bytes for s in out),
            swap_device=self.swap_device, swap_used_bytes=used or sum(s.swapped_bytes for s in out), swap_stored_bytes=stored,
            merged_bytes=ksm_saved_bytes(),
        )
        return self.last

    def _fill_metrics(self) -> None:
        r = self.last
        for g in (self._g_resident, self._g_reclaimed, self._g_merged, self._g_swapped, self._g_class, self._g_host):
            g.clear()
        if r is None:
            return
        for s in r.sandboxes:
            self._g_resident.set(s.resident_bytes, sandbox=s.sandbox_id)
            self._g_reclaimed.set(s.reclaimed_bytes, sandbox=s.sandbox_id)
            self._g_merged.set(s.merged_bytes, sandbox=s.sandbox_id)
            self._g_swapped.set(s.swapped_bytes, sandbox=s.sandbox_id)
            self._g_class.set(1, sandbox=s.sandbox_id, cpu_class=s.cpu_class or "unknown")
        for kind, v in (("resident", r.resident_bytes), ("reclaimed", r.reclaimed_bytes), ("swap_used", r.swap_used_bytes),
                        ("swap_stored", r.swap_stored_bytes), ("merged", r.merged_bytes)):
            self._g_host.set(v, kind=kind)


__all__ = ["ReclaimService"]
