"""Fixtures of the placement tests: a fresh nats-server per test (durable names are fixed), helpers."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator

import pytest

from bus import codec
from bus import subjects as S
from bus.messages import LayerRef, SandboxEvent, TemplateManifest
from bus.natsd import NatsServer
from bus.runtime import connect
from bus.streams import ensure_all, ensure_kv
from tests.conftest import eventually  # noqa: F401 - re-exported for the placement tests

LAYER = "sha256:" + "ab" * 32


@pytest.fixture
def nats_srv():
    d = tempfile.mkdtemp(prefix="dsec-pl-")
    srv = NatsServer(d, port=0)
    srv.start()
    yield srv
    srv.stop()
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
async def nc(nats_srv) -> AsyncIterator:
    c = await connect(nats_srv.url, name="test")
    js = c.jetstream()
    await ensure_all(js)
    kv = await ensure_kv(js, S.KV_IMAGES)
    await kv.put("base", codec.encode(TemplateManifest(name="base", layers=[LayerRef(role="base", digest=LAYER)])))
    yield c
    # the SDK keeps one connection per loop and URL: drop it with the server
    from sdk._async import close_connections

    await close_connections()
    await c.close()


async def ready_counts(js, kinds: tuple[str, ...] = ("ready",)) -> dict[str, list[SandboxEvent]]:
    """Every event of ``kinds`` in DSEC_EVT, per sandbox id (read straight from the stream)."""
    out: dict[str, list[SandboxEvent]] = {}
    info = await js.stream_info(S.STREAM_EVT)
    last = info.state.last_seq
    if not last:
        return out
    sub = await js.subscribe(f"{S.PREFIX}.evt.>", ordered_consumer=True)
    try:
        while True:
            m = await sub.next_msg(timeout=5)
            ev = codec.EVENT.decode(m.data)
            if isinstance(ev, SandboxEvent) and ev.kind in kinds:
                out.setdefault(ev.sandbox_id, []).append(ev)
            if m.metadata.sequence.stream >= last:
                break
    finally:
        await sub.unsubscribe()
    return out


async def stored_events(js, ids, kinds: tuple[str, ...] = ("ready",), timeout: float = 20.0) -> dict[str, list[SandboxEvent]]:
    """``ready_counts`` once every id in ``ids`` has an event of ``kinds`` stored: a ready event is a
    core publish the stream stores, so a subscriber (or the creating client) can hear it first."""
    out: dict[str, list[SandboxEvent]] = {}

    async def all_there() -> bool:
        out.clear()
        out.update(await ready_counts(js, kinds))
        return set(ids) <= set(out)

    await eventually(all_there, timeout=timeout, what=f"{kinds} events of {len(ids)} sandboxes in the stream")
    return out


async def hosts_up(js, host_ids, since: float) -> bool:
    """Every host has heartbeated since ``since`` (a host takes hand-offs before its first heartbeat)."""
    kv = await ensure_kv(js, S.KV_HOSTS)
    for hid in host_ids:
        try:
            st = codec.HOST_STATUS.decode((await kv.get(hid)).value)
        except Exception:  # noqa: BLE001 - not there yet
            return False
        if st.at < since:
            return False
    return True

