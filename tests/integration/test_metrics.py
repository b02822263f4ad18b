"""Every service answers Prometheus scrapes on the bus (and over HTTP with --metrics-port): creates,
create latency, exec latency, sandboxes per host and state, host memory and CPU, consumer pending counts."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
import uuid

import pytest
from nats.js.api import StreamConfig

from bus import subjects as S
from bus.metrics import merge, parse
from bus.runtime import Service, connect, instance_of, scrape_all, scrape_one
from tests.conftest import eventually

from .conftest import Stack, needs_stack


def _value(samples: list, name: str, **labels: str) -> float | None:
    for n, lab, v in samples:
        if n == name and all(lab.get(k) == want for k, want in labels.items()):
            return v
    return None


@pytest.mark.containerd
@needs_stack
async def test_a_scrape_over_the_bus_shows_the_sandbox_just_created(stack: Stack) -> None:
    async with stack.sandbox(memory_mb=128) as sb:
        await sb.commands.run("true")
        replies = await scrape_all(stack.nc)
        who = {(r.service, r.instance) for r in replies}
        assert ("hostagent", stack.host_id) in who, who
        for p in stack.placements:
            assert ("placement", p.replica_id) in who, who
        s = parse(merge(r.text for r in replies))
        host = {"service": "hostagent", "instance": stack.host_id}
        assert _value(s, "dsec_host_creates_total", result="ready", **host) >= 1
        assert _value(s, "dsec_create_seconds_count", **host) >= 1
        assert _value(s, "dsec_host_create_seconds_bucket", le="+Inf", **host) >= 1
        assert _value(s, "dsec_sandbox_op_seconds_count", op="exec", **host) >= 1
        assert _value(s, "dsec_sandbox_ops_total", op="exec", code="ok", **host) >= 1
        assert _value(s, "dsec_host_sandboxes", state="running", **host) >= 1
        assert _value(s, "dsec_host_memory_bytes", kind="total", **host) > 0
        assert _value(s, "dsec_host_memory_bytes", kind="allocated", **host) >= 128 * 1024 * 1024
        assert _value(s, "dsec_machine_memory_bytes", kind="used", **host) > 0
        assert _value(s, "dsec_host_cpu", kind="busy", **host) is not None
        assert _value(s, "dsec_host_cpu", kind="allocated", **host) >= 1
        assert _value(s, "dsec_handoffs_inflight", inbox=f"host-{stack.host_id}", **host) is not None  # placement's hand-offs it holds
        assert _value(s, "process_resident_memory_bytes", **host) > 0
        placed = sum(_value(s, "dsec_placement_events_total", kind="placed", service="placement", instance=p.replica_id) or 0 for p in stack.placements)
        assert placed >= 1
        decided = sum(_value(s, "dsec_placement_decision_seconds_count", service="placement", instance=p.replica_id) or 0 for p in stack.placements)
        assert decided >= 1  # the decision alone (delivery to hand-off), beside request-to-hand-off
        assert _value(s, "dsec_consumer_pending_messages", stream=S.STREAM_REQ, consumer=S.PLACEMENT_DURABLE, service="placement") is not None
        assert _value(s, "dsec_stream_messages", stream=S.STREAM_EVT, service="placement") > 0

        # one process on its own subject
        one = await scrape_one(stack.nc, "hostagent", stack.host_id)
        assert (one.service, one.instance) == ("hostagent", stack.host_id)
        assert "dsec_host_sandboxes" in one.text
    running = _value(parse((await scrape_one(stack.nc, "hostagent", stack.host_id)).text), "dsec_host_sandboxes", state="running")
    assert running == len(stack.host.live)


class _Probe(Service):
    """A service whose one pull worker holds each message until released."""

    name = "probe"

    def __init__(self, url: str, stream: str) -> None:
        super().__init__(url, grace_s=2)
        self.stream = stream
        self.release = asyncio.Event()

    async def setup(self) -> None:
        assert self.js is not None
        await self.js.add_stream(StreamConfig(name=self.stream, subjects=[f"{self.stream}.>"]))
        await self.add_worker(stream=self.stream, durable="w", filter_subject=f"{self.stream}.>", handler=self._handle, capacity=1, name="probe")

    async def _handle(self, msg) -> None:
        await self.release.wait()
        await msg.ack()


def _http_get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


async def test_pending_counts_and_the_http_port(nats_server) -> None:
    stream = f"METRICS_{uuid.uuid4().hex[:8]}"
    svc = _Probe(nats_server.url, stream)
    svc.metrics_port = 0
    nc = await connect(nats_server.url)
    try:
        await svc.start()
        for i in range(5):
            await nc.jetstream().publish(f"{stream}.x", str(i).encode())

        async def held() -> bool:
            s = parse((await scrape_one(nc, svc.name, instance_of(svc))).text)
            return (_value(s, "dsec_consumer_ack_pending_messages", stream=stream, consumer="w"),
                    _value(s, "dsec_consumer_pending_messages", stream=stream, consumer="w"),
                    _value(s, "dsec_consumer_inflight_messages", consumer="w")) == (1, 4, 1)

        await eventually(held, what="1 message in the handler, 4 waiting in the stream")
        s = parse((await scrape_one(nc, svc.name, instance_of(svc))).text)
        assert _value(s, "dsec_endpoint_requests_total", endpoint="metrics") >= 1  # the scrapes so far, from the Endpoint's stats
        port = svc._exposition.port
        assert port > 0
        status, ctype, body = await asyncio.to_thread(_http_get, f"http://127.0.0.1:{port}/metrics")
        assert status == 200 and ctype.startswith("text/plain; version=0.0.4")
        assert 'dsec_consumer_pending_messages{service="probe",instance=' in body and "# TYPE process_cpu_seconds_total counter" in body
        status, _, _ = await asyncio.to_thread(_http_get, f"http://127.0.0.1:{port}/other")
        assert status == 404
        svc.release.set()

        async def drained() -> bool:
            s = parse((await scrape_one(nc, svc.name, instance_of(svc))).text)
            return (_value(s, "dsec_consumer_pending_messages", stream=stream, consumer="w"),
                    _value(s, "dsec_consumer_ack_pending_messages", stream=stream, consumer="w")) == (0, 0)

        await eventually(drained, what="every message handled")
    finally:
        await svc.shutdown()
        try:
            await nc.jetstream().delete_stream(stream)
        finally:
            await nc.close()
    with pytest.raises(OSError):  # the port is closed with the service
        await asyncio.to_thread(urllib.request.urlopen, f"http://127.0.0.1:{port}/metrics", timeout=2)
