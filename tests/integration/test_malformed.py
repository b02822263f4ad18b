"""Malformed messages on every subject: work subjects dead-letter them to DSEC_DLQ, live-sandbox
subjects answer ``bad_request``, and every service keeps running (a valid create works afterwards)."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
from nats.js.api import ConsumerConfig, DeliverPolicy

from bus import codec
from bus import subjects as S
from bus.errors import ErrorReply, UnknownTemplate
from bus.messages import ExecRequest, ExecResult, KillRequest, PlaceSandbox, SandboxSpec
from sdk import AsyncSandbox
from tests.conftest import eventually

from .conftest import Stack, needs_stack

pytestmark = [pytest.mark.containerd, needs_stack]


def _garbage(uid: str) -> list[bytes]:
    """Not msgpack at all, msgpack of the wrong shape, and a valid message of the wrong type."""
    return [
        b"\xc1not msgpack " + uid.encode(),  # 0xc1 is never used in msgpack
        msgspec.msgpack.encode({"type": "CreateSandbox", "spec": 5, "tag": uid}),
        msgspec.msgpack.encode(["CreateSandbox", uid]),
        codec.encode(KillRequest(reason=uid)),  # a real message, on the wrong subject
        codec.encode(SandboxSpec(sandbox_id=f"untagged-{uid}")),  # a spec without its envelope
    ]


def _valid_for(op: str, payload: bytes) -> bool:
    dec = codec.SBX_REQUEST_DECODERS.get(op)
    if dec is None:
        return False
    try:
        dec.decode(payload)
        return True
    except Exception:  # noqa: BLE001 - BadRequest: garbage for this op
        return False


async def _dead_letters(stack: Stack, origin: str, marker: str, expected: int) -> list[bytes]:
    """Payloads on the DLQ subject of ``origin`` that contain ``marker`` (polled until ``expected`` are there)."""
    js = stack.js
    found: list[bytes] = []

    async def collect() -> bool:
        found.clear()
        sub = await js.subscribe(
            S.dlq(origin), stream=S.STREAM_DLQ, ordered_consumer=True, config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
        )
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=0.5)
                except Exception:  # noqa: BLE001 - nats' TimeoutError: caught up
                    break
                if marker.encode() in msg.data:
                    assert msg.headers and msg.headers.get(S.HDR_ERROR_CODE) == "bad_request", msg.headers
                    assert msg.headers.get("Dsec-Origin") == origin
                    found.append(msg.data)
                if msg.metadata.num_pending == 0:
                    break
        finally:
            await sub.unsubscribe()
        return len(found) >= expected

    await eventually(collect, timeout=15, interval=0.1, what=f"{expected} dead letters from {origin}")
    return found


async def test_work_subjects_dead_letter_garbage(stack: Stack) -> None:
    uid = stack.new_id("mal")
    bad = _garbage(uid)
    host_subject = S.host_create(stack.host_id)
    for subject in (S.REQ_CREATE, S.REQ_CREATE_BATCH):
        for i, payload in enumerate(bad):
            await stack.js.publish(subject, payload, headers={S.HDR_MSG_ID: f"{uid}-{subject}-{i}"})
    # A host's hand-offs are core requests: garbage is refused to the sender, and kept as evidence.
    for payload in bad:
        answer = codec.HANDOFF_REPLY.decode((await stack.nc.request(host_subject, payload, timeout=10)).data)
        assert answer.state == "refused" and answer.code == "bad_request" and answer.description, answer
    for subject in (S.REQ_CREATE, S.REQ_CREATE_BATCH, host_subject):
        got = await _dead_letters(stack, subject, uid, len(bad))
        assert sorted(got) == sorted(bad)
    # The request queue is empty again: garbage is acked, not redelivered forever.
    await eventually(lambda: _stream_empty(stack, S.STREAM_REQ), timeout=10, what="DSEC_REQ to drain")
    # Every service keeps going: a valid create works, end to end.
    async with stack.sandbox(memory_mb=32) as sb:
        assert (await sb.commands.run("echo ok")).stdout == "ok\n"
    assert all(not p._stopped.is_set() for p in stack.placements) and not stack.host._stopped.is_set()


async def _stream_empty(stack: Stack, stream: str) -> bool:
    return (await stack.js.stream_info(stream)).state.messages == 0


async def test_sandbox_subjects_answer_bad_request(stack: Stack) -> None:
    async with stack.sandbox(memory_mb=32) as sb:
        sid = sb.sandbox_id
        await sb.files.write("/tmp/canary", "alive")
        bad = _garbage(stack.uid) + [b"", codec.encode(ExecRequest(cmd="echo wrong-op"))]
        for op in (*S.SBX_OPS, "bogus", "snapshotx"):
            for payload in bad:
                if _valid_for(op, payload):
                    continue  # e.g. a KillRequest on .kill: not garbage there
                msg = await stack.nc.request(S.sbx(sid, op), payload, timeout=10)
                reply = msgspec.msgpack.decode(msg.data, type=ErrorReply)
                assert reply.code == "bad_request", (op, payload[:40], reply)
                assert reply.description
        # Unknown ops name the valid ones.
        msg = await stack.nc.request(S.sbx(sid, "bogus"), codec.encode(KillRequest()), timeout=10)
        assert "exec" in msgspec.msgpack.decode(msg.data, type=ErrorReply).description
        # A stream_to that is not an inbox is refused (no publishing on control subjects for a client).
        msg = await stack.nc.request(
            S.sbx(sid, "exec"), codec.encode(ExecRequest(cmd="echo x", stream_to=S.REQ_CREATE)), timeout=10
        )
        assert msgspec.msgpack.decode(msg.data, type=ErrorReply).code == "bad_request"
        # The sandbox survived all of it (garbage on .kill did not kill it) and still answers.
        assert await sb.files.read("/tmp/canary") == "alive"
        res = codec.decode_reply(
            (await stack.nc.request(S.sbx(sid, "exec"), codec.encode(ExecRequest(cmd="echo fine")), timeout=10)).data, ExecResult
        )
        assert res.stdout == b"fine\n"
    # And new sandboxes still come up.
    async with stack.sandbox(memory_mb=32) as sb2:
        assert (await sb2.commands.run("true")).exit_code == 0


async def test_garbage_in_kv_is_ignored(stack: Stack) -> None:
    """A broken heartbeat or manifest in KV is skipped by placement, not fatal."""
    from bus.streams import ensure_kv

    key = f"junk-{stack.uid}"
    kv_hosts = await ensure_kv(stack.js, S.KV_HOSTS)
    kv_images = await ensure_kv(stack.js, S.KV_IMAGES)
    await kv_hosts.put(key, b"\xc1junk")
    await kv_images.put(key, msgspec.msgpack.encode({"name": 1}))
    try:
        # Placement has seen both (the watch delivers in order): a later good entry arrives after them.
        marker = f"marker-{stack.uid}-{time.time_ns()}"
        await kv_images.put(marker, (await kv_images.get("base")).value)
        await eventually(lambda: all(marker in p.templates for p in stack.placements), timeout=10, what="placement to read past the junk")
        assert all(key not in p.table.hosts and key not in p.templates for p in stack.placements)
        with pytest.raises(UnknownTemplate) as ei:  # its broken manifest was skipped: no such template
            await AsyncSandbox.create(template=key, **stack.kw(create_timeout=20))
        assert ei.value.code == "unknown_template" and key in ei.value.description, ei.value
        async with stack.sandbox(memory_mb=32) as sb:
            assert (await sb.commands.run("echo ok")).stdout == "ok\n"
    finally:
        for kv, k in ((kv_hosts, key), (kv_images, key), (kv_images, f"marker-{stack.uid}")):
            try:
                await kv.delete(k)
            except Exception:  # noqa: BLE001
                pass
        for k in await _keys(kv_images):
            if k.startswith(f"marker-{stack.uid}"):
                await kv_images.delete(k)


async def _keys(kv) -> list[str]:
    try:
        return await kv.keys()
    except Exception:  # noqa: BLE001 - NoKeysError on an empty bucket
        return []


async def test_valid_place_for_unknown_template_fails_cleanly(stack: Stack) -> None:
    """A well-formed hand-off straight to the host for a template it cannot find: a ``failed`` event, no crash."""
    sid = stack.new_id("direct")
    spec = SandboxSpec(sandbox_id=sid, template=f"missing-{stack.uid}", pool=stack.pool, memory_mb=32)
    events: list[str] = []
    done = asyncio.Event()

    async def on_evt(msg) -> None:
        ev = codec.EVENT.decode(msg.data)
        events.append(f"{ev.kind}:{ev.code}")
        if ev.kind in ("failed", "ready"):
            done.set()

    sub = await stack.nc.subscribe(S.evt_sandbox_all(sid), cb=on_evt)
    try:
        answer = await stack.nc.request(S.host_create(stack.host_id), codec.encode(PlaceSandbox(spec=spec, host_id=stack.host_id)), timeout=15)
        assert codec.HANDOFF_REPLY.decode(answer.data).state == "done"  # the failure is the outcome, stored
        await asyncio.wait_for(done.wait(), 15)
    finally:
        await sub.unsubscribe()
    assert "failed:unknown_template" in events
    await stack.assert_gone(sid)
