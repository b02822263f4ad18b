"""The host agent's backend seam: every backend implements ``Backend`` as it is called, its optional
abilities are discovered once, an ability a backend lacks is a typed error (never an AttributeError),
a hand-off for a backend the host does not run is refused with ``unsupported_backend``, and the
heartbeat advertises what the host runs. Real NATS, real host agents (simulated backend)."""

from __future__ import annotations

import inspect
import os
import tempfile
import time
import uuid

import pytest

from bus import codec
from bus import subjects as S
from bus.errors import NotSupported, SnapshotUnsupported, UnsupportedBackend
from bus.messages import (
    Done,
    ExecRequest,
    FileData,
    FileRead,
    FileWatch,
    FileWrite,
    FileWritten,
    HostStatus,
    LayerRef,
    MetricsRequest,
    PauseRequest,
    PlaceSandbox,
    SandboxSpec,
    SnapshotRecord,
    SnapshotRequest,
)
from bus.runtime import KV
from bus.runtime.handoff import Handoffs
from bus.streams import ensure_kv
from hostagent import Backend, Capabilities, HostAgent, HostAgentConfig, SimBackend
from hostagent import backends as registry
from hostagent.backends.container import ContainerBackend

from .conftest import eventually, records_of


def _agent(url: str, hid: str, backend: SimBackend | None = None) -> HostAgent:
    cfg = HostAgentConfig(
        nats_url=url, host_id=hid, data_dir=os.path.join(tempfile.gettempdir(), "dsec-pl-unused"), persist_state=False, grace_s=2,
        heartbeat_s=0.2,
    )
    return HostAgent(backend or SimBackend(), cfg)


def _protocol_methods() -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(getattr(Backend, name))
        for name in dir(Backend) if not name.startswith("_") and callable(getattr(Backend, name))
    }


@pytest.mark.parametrize("cls", [SimBackend, ContainerBackend])
def test_every_backend_implements_the_protocol_as_it_is_called(cls: type) -> None:
    methods = _protocol_methods()
    assert {"create", "destroy", "leftovers", "reconcile", "recover", "usage", "capacity", "exec", "files", "advertise"} <= set(methods)
    for name, want in methods.items():
        got = inspect.signature(getattr(cls, name))
        # same parameters, by name and kind: create(spec, layers, *, security, memory), exec(..., *, on_start)
        assert [(p.name, p.kind) for p in got.parameters.values()] == [(p.name, p.kind) for p in want.parameters.values()], (cls, name)
        assert inspect.iscoroutinefunction(getattr(cls, name)) == inspect.iscoroutinefunction(getattr(Backend, name)), (cls, name)


def test_abilities_are_discovered_from_what_a_backend_implements(tmp_path) -> None:
    sim = Capabilities.of(SimBackend())
    assert sim.name == "sim" and not sim.enforces_profiles
    assert (sim.freezer, sim.checkpointer, sim.meter, sim.agents, sim.warm_pool, sim.layer_cache) == (None,) * 6
    c = ContainerBackend(str(tmp_path), warm_pool=0)
    cont = Capabilities.of(c)  # positive control: the container backend has every one
    assert cont.enforces_profiles
    assert all(x is c for x in (cont.freezer, cont.checkpointer, cont.meter, cont.agents, cont.warm_pool, cont.layer_cache))
    # a missing ability is its typed error, with a stable code
    with pytest.raises(NotSupported) as e1:
        sim.need_freezer()
    with pytest.raises(SnapshotUnsupported) as e2:
        sim.need_checkpointer()
    with pytest.raises(NotSupported) as e3:
        sim.need_meter()
    with pytest.raises(NotSupported) as e4:
        sim.need_agents()
    assert [e.value.code for e in (e1, e2, e3, e4)] == ["not_supported", "snapshot_unsupported", "not_supported", "not_supported"]
    assert "sim" in e3.value.description and "sim" in e4.value.description
    assert cont.need_freezer() is c and cont.need_checkpointer() is c and cont.need_meter() is c and cont.need_agents() is c


def test_the_registry_names_each_backend_and_refuses_an_unknown_one() -> None:
    assert sorted(registry.names()) == ["container", "microvm", "sim", "vm"]
    assert isinstance(registry.make(HostAgentConfig(backend="sim", host_id="h")), SimBackend)
    with pytest.raises(UnsupportedBackend) as e:
        registry.factory("fncall")  # a name of the vocabulary no backend package serves
    assert e.value.code == "unsupported_backend" and "container" in e.value.description and "sim" in e.value.description


async def _hand(hand: Handoffs, host_id: str, spec: SandboxSpec) -> None:
    place = PlaceSandbox(spec=spec, host_id=host_id, placed_by="test", placed_at=time.time())
    fut = await hand.send(S.host_create(host_id), codec.encode(place))
    await fut


async def _op(nc, sid: str, op: str, req, result_type):
    msg = await nc.request(S.sbx(sid, op), codec.encode(req), timeout=10)
    return codec.decode_reply(msg.data, result_type)


async def test_host_refuses_a_backend_it_does_not_run_and_serves_the_one_it_does(nats_srv, nc) -> None:
    hid = f"bk-{uuid.uuid4().hex[:6]}"
    host = _agent(nats_srv.url, hid)
    hand = await Handoffs(nc).start()
    await host.start()
    try:
        # The heartbeat names what this host runs.
        hosts = await KV.open(nc.jetstream(), S.KV_HOSTS, codec.HOST_STATUS)

        async def advertised() -> bool:
            st = await hosts.get(hid)
            return st is not None and bool(st.backends)

        await eventually(advertised, timeout=10, what="the heartbeat")
        st = await hosts.get(hid)
        assert isinstance(st, HostStatus) and [b.name for b in st.backends] == ["sim"]

        refused = SandboxSpec(sandbox_id=f"sb-{uuid.uuid4().hex[:8]}", backend="microvm")
        with pytest.raises(UnsupportedBackend) as e:
            await _hand(hand, hid, refused)
        assert e.value.code == "unsupported_backend" and "'microvm'" in e.value.description and "sim" in e.value.description
        assert refused.sandbox_id not in host.live
        assert (await records_of(nc.jetstream(), [refused.sandbox_id]))[refused.sandbox_id] is None  # nothing claimed or made

        # Positive control: the backend it runs is made, and its file ops (agent-free in sim) answer.
        ok = SandboxSpec(sandbox_id=f"sb-{uuid.uuid4().hex[:8]}", backend="sim")
        await _hand(hand, hid, ok)
        assert ok.sandbox_id in host.live
        sid = ok.sandbox_id
        assert isinstance(await _op(nc, sid, "files", FileWrite(path="/f", data=b"x"), FileWritten), FileWritten)
        assert (await _op(nc, sid, "files", FileRead(path="/f"), FileData)).data == b"x"

        # Abilities the sim backend lacks: typed errors, and the host keeps serving.
        with pytest.raises(NotSupported, match="metrics"):
            await _op(nc, sid, "metrics", MetricsRequest(), Done)
        with pytest.raises(NotSupported, match="freeze"):
            await _op(nc, sid, "snapshot", SnapshotRequest(), SnapshotRecord)
        with pytest.raises(NotSupported, match="freeze"):
            await _op(nc, sid, "pause", PauseRequest(), Done)
        with pytest.raises(NotSupported, match="agent"):
            await _op(nc, sid, "exec", ExecRequest(cmd="sleep 1", background=True), Done)
        with pytest.raises(NotSupported, match="agent"):
            await _op(nc, sid, "files", FileWatch(path="/", stream_to="_INBOX.x"), Done)
        assert (await _op(nc, sid, "files", FileRead(path="/f"), FileData)).data == b"x"
    finally:
        await hand.stop()
        await host.shutdown()


async def test_a_memory_restore_on_a_backend_without_checkpoints_fails_typed(nats_srv, nc) -> None:
    """A create from a memory snapshot handed to a backend that cannot restore processes fails with
    ``snapshot_unsupported`` (its record says so), not with an AttributeError or TypeError."""
    hid = f"bk-{uuid.uuid4().hex[:6]}"
    host = _agent(nats_srv.url, hid)
    hand = await Handoffs(nc).start()
    await host.start()
    try:
        snap = f"snap-{uuid.uuid4().hex[:8]}"
        kv = await ensure_kv(nc.jetstream(), S.KV_SNAPSHOTS)
        mem = LayerRef(role="memory", digest="sha256:" + "cd" * 32)
        await kv.put(snap, codec.encode(SnapshotRecord(
            snapshot_id=snap, sandbox_id="sb-parent", template="base", created_at=time.time(), memory=True, memory_layer=mem,
        )))
        spec = SandboxSpec(sandbox_id=f"sb-{uuid.uuid4().hex[:8]}", backend="sim", snapshot=snap)
        await _hand(hand, hid, spec)
        rec = (await records_of(nc.jetstream(), [spec.sandbox_id]))[spec.sandbox_id]
        assert rec is not None and rec.state == "failed" and rec.end_reason == "snapshot_unsupported", rec
        assert spec.sandbox_id not in host.live
        # Positive control: the same snapshot without memory restores on this backend.
        await kv.put(snap, codec.encode(SnapshotRecord(snapshot_id=snap, sandbox_id="sb-parent", template="base", created_at=time.time())))
        again = SandboxSpec(sandbox_id=f"sb-{uuid.uuid4().hex[:8]}", backend="sim", snapshot=snap)
        await _hand(hand, hid, again)
        assert again.sandbox_id in host.live
    finally:
        await hand.stop()
        await host.shutdown()
