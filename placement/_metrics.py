"""What a placement replica reports to Prometheus (bus.metrics): create requests by outcome, how long
they took to reach a host, the streams and the host table (the request queue's pending counts come
with every service's consumers, bus.runtime.metrics)."""

from __future__ import annotations

import time
from typing import Any

from bus import subjects as S
from bus.messages import SandboxSpec
from bus.runtime import stream_collector

STREAMS = (S.STREAM_REQ, S.STREAM_EVT, S.STREAM_DLQ)
DECISION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)  # the aim: p99 < 50 ms


class PlacementMetrics:
    def __init__(self, svc: Any) -> None:
        reg = svc.metrics
        self.events = reg.counter(
            "dsec_placement_events_total", "Create requests seen by this replica, by what became of them (requested, placed, pending, failed)", ["kind"]
        )
        self.placed_s = reg.histogram("dsec_placement_seconds", "From the client's create request to its hand-off to a host")
        self.decision_s = reg.histogram(
            "dsec_placement_decision_seconds",
            "From a request's delivery to this replica to its hand-off to a host: the decision and its bus work, not the wait in the request queue",
            buckets=DECISION_BUCKETS,
        )
        hosts = reg.gauge("dsec_placement_hosts", "Hosts in this replica's table, by state", ["state"])
        refused = reg.gauge("dsec_placement_quota_refused", "Creates this replica refused over a tenant's quota (quota_exceeded) since it started")
        stream_collector(reg, lambda: svc.js, STREAMS)

        def fill() -> None:
            hosts.clear()
            for e in list(svc.table.hosts.values()):
                hosts.inc(1, state=e.status.state)
            refused.set(svc.quotas.refused)

        reg.collector(fill)

    def event(self, spec: SandboxSpec, kind: str) -> None:
        self.events_of([spec], kind)

    def decided(self, since: float, n: int) -> None:
        """``n`` creates delivered at ``since`` (time.monotonic) were just handed to their hosts."""
        v = max(0.0, time.monotonic() - since)
        for _ in range(n):
            self.decision_s.observe(v)

    def events_of(self, specs: list[SandboxSpec], kind: str) -> None:
        """What became of these requests (a batch's members: the counter bumped once)."""
        if not specs:
            return
        self.events.inc(len(specs), kind=kind)
        if kind == "placed":
            now = time.time()
            for spec in specs:
                if spec.requested_at:
                    self.placed_s.observe(max(0.0, now - spec.requested_at))


__all__ = ["PlacementMetrics"]
