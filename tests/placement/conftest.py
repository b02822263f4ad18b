"""Fixtures of the placement tests: a fresh nats-server per test (durable names are fixed), helpers."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import pytest

from bus import codec
from bus import subjects as S
from bus.messages import LayerRef, ReadyMany, SandboxEvent, SandboxRecord, TemplateManifest
from bus.natsd import NatsServer
from bus.runtime import KV, connect
from bus.streams import ensure_all, ensure_kv
from tests.conftest import eventually  # noqa: F401 - re-exported for the placement tests

LAYER = "sha256:" + "ab" * 32
REPO = Path(__file__).resolve().parents[2]


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
    await seed(c.jetstream())
    yield c
    # the SDK keeps one connection per loop and URL: drop it with the server
    from sdk._async import close_connections

    await close_connections()
    await c.close()


async def seed(js) -> None:
    """Every stream and bucket, and the template ``base`` (one layer)."""
    await ensure_all(js)
    kv = await ensure_kv(js, S.KV_IMAGES)
    await kv.put("base", codec.encode(TemplateManifest(name="base", layers=[LayerRef(role="base", digest=LAYER)])))


def spawn(args: list[str], url: str, log: Path, *, level: str = "WARNING", env_extra: dict[str, str] | None = None) -> subprocess.Popen:
    """``python <args>`` as a child in its own session, logging (JSON lines at ``level``) to ``log``."""
    env = dict(
        os.environ, DSEC_NATS_URL=url, DSEC_LOG_LEVEL=level, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **(env_extra or {}),
    )
    with open(log, "ab") as f:
        return subprocess.Popen([sys.executable, *args], env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def stop_process(p: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 10 s; reaped either way (a child already killed is only reaped)."""
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def log_lines(log: Path, event: str) -> list[dict]:
    """The JSON log lines of ``event`` in a child's log."""
    out = []
    for line in log.read_text().splitlines():
        if f'"{event}"' in line:
            try:
                d = json.loads(line)
            except ValueError:
                continue
            if d.get("event") == event:
                out.append(d)
    return out


async def records_of(js, ids: Iterable[str]) -> dict[str, SandboxRecord | None]:
    """The sandbox record of each id in KV ``dsec_sandboxes`` (None: no record)."""
    kv = await KV.bind(js, S.KV_SANDBOXES, codec.SANDBOX_RECORD)
    return {sid: await kv.get(sid) for sid in ids}


def as_sandbox_events(ev: object) -> list[SandboxEvent]:
    """A sandbox event as itself; a host batch's ready event (ReadyMany) as the ``ready`` of each member
    it names (``detail["batch"]``: its batch id); anything else as nothing."""
    if isinstance(ev, SandboxEvent):
        return [ev]
    if isinstance(ev, ReadyMany):
        return [
            SandboxEvent(sandbox_id=sid, kind="ready", at=ev.at, host_id=ev.host_id, attempt=ev.attempt, detail={**ev.detail, "batch": ev.batch_id})
            for sid in ev.sandbox_ids
        ]
    return []


async def ready_counts(js, kinds: tuple[str, ...] = ("ready",)) -> dict[str, list[SandboxEvent]]:
    """Every event of ``kinds`` in DSEC_EVT, per sandbox id (read straight from the stream; a batch
    ready event counts for each member it names)."""
    out: dict[str, list[SandboxEvent]] = {}
    info = await js.stream_info(S.STREAM_EVT)
    last = info.state.last_seq
    if not last:
        return out
    sub = await js.subscribe(f"{S.PREFIX}.evt.>", ordered_consumer=True)
    try:
        while True:
            m = await sub.next_msg(timeout=5)
            for ev in as_sandbox_events(codec.EVENT.decode(m.data)):
                if ev.kind in kinds:
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


async def listen_ready(nc) -> set[str]:
    """Ids whose ``ready`` was announced, in an event of their own or a host batch's (core
    subscriptions: the progress of a burst)."""
    seen: set[str] = set()

    async def on_ready(msg) -> None:
        seen.add(msg.subject.split(".")[4])  # dsec.evt.sandbox.<tenant>.<id>.ready

    async def on_batch(msg) -> None:
        seen.update(e.sandbox_id for e in as_sandbox_events(codec.EVENT.decode(msg.data)))

    await nc.subscribe(f"{S.PREFIX}.evt.sandbox.*.*.ready", cb=on_ready)
    await nc.subscribe(S.EVT_READY_ALL, cb=on_batch)
    return seen
