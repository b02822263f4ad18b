"""What a host agent reports to Prometheus (bus.metrics): creates, their latency, ops, and this host's
sandboxes, memory and CPU, read from the agent's own tables on each scrape."""

from __future__ import annotations

import time
import asyncio
from collections.abc import Callable

from bus.messages import HostStatus, SandboxSpec
from bus.metrics import Registry as MetricsRegistry
from bus.metrics import machine_collector

from ._registry import Registry

MB = 1024 * 1024


class HostMetrics:
    def __init__(
        self, reg: MetricsRegistry, creating: dict[str, asyncio.Future[None]], registry: Registry, status: Callable[[], HostStatus],
    ) -> None:
        self.creates = reg.counter("dsec_host_creates_total", "Creates this host finished, by result", ["result"])
        self.create_s = reg.histogram("dsec_host_create_seconds", "Time this host took to start a sandbox (layers, rootfs, container)")
        self.ready_s = reg.histogram("dsec_create_seconds", "From the client's create request to the sandbox running (queueing and placement included)")
        self.op_s = reg.histogram("dsec_sandbox_op_seconds", "Round trip of a sandbox operation on this host (exec, files, ...)", ["op"])
        self.ops = reg.counter("dsec_sandbox_ops_total", "Sandbox operations answered, by operation and result code", ["op", "code"])
        sandboxes = reg.gauge("dsec_host_sandboxes", "Sandboxes on this host, by state", ["state"])
        cpu = reg.gauge("dsec_host_cpu", "CPUs of this host: total, allocated to sandboxes, busy", ["kind"])
        mem = reg.gauge("dsec_host_memory_bytes", "Memory of this host: total, allocated to sandboxes, resident in sandboxes", ["kind"])
        machine_collector(reg)

        def fill() -> None:
            sandboxes.clear()
            for state in ("creating", "running"):
                sandboxes.set(0, state=state)
            sandboxes.set(len(creating), state="creating")
            for ls in list(registry.live.values()):
                sandboxes.inc(1, state=ls.state)
            st = status()
            cpu.set(st.cpu_total, kind="total")
            cpu.set(st.cpu_alloc, kind="allocated")
            cpu.set(st.cpu_busy, kind="busy")
            mem.set(st.mem_total_mb * MB, kind="total")
            mem.set(st.mem_alloc_mb * MB, kind="allocated")
            mem.set(st.mem_resident_mb * MB, kind="resident")

        reg.collector(fill)

    def ready(self, spec: SandboxSpec, host_seconds: float) -> None:
        self.ready_many([spec], host_seconds)

    def ready_many(self, specs: list[SandboxSpec], host_seconds: float) -> None:
        """Sandboxes made in ``host_seconds`` (a batch's members made together: the counter bumped once)."""
        if not specs:
            return
        self.creates.inc(len(specs), result="ready")
        now = time.time()
        for spec in specs:
            self.create_s.observe(host_seconds)
            if spec.requested_at:
                self.ready_s.observe(max(0.0, now - spec.requested_at))

    def op(self, op: str, code: str, seconds: float) -> None:
        self.ops.inc(op=op, code=code)
        self.op_s.observe(seconds, op=op)


__all__ = ["HostMetrics"]
