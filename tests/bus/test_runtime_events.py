"""Events and dead letters against a real nats-server: msg-id de-duplication, the reply fan-out, DLQ headers."""

from __future__ import annotations

from bus import codec
from bus import subjects as S
from bus.errors import CreateFailed
from bus.messages import SandboxEvent, SandboxSpec
from bus.runtime import Events, consumer_config, dead_letter, publisher_for
from tests.conftest import eventually


async def test_sandbox_events_dedup_and_fan_out(nc, uid) -> None:
    inbox = nc.new_inbox()
    heard: list[SandboxEvent] = []

    async def on(m) -> None:
        heard.append(codec.EVENT.decode(m.data))

    sub = await nc.subscribe(inbox, cb=on)
    ev = Events(nc, await publisher_for(nc), host_id="h1")
    spec = SandboxSpec(sandbox_id=f"sb-{uid}", reply_to=inbox)
    try:
        a = await ev.sandbox(spec, "ready", attempt=0)
        b = await ev.sandbox(spec, "ready", attempt=0)  # a redelivered create says it again
        c = await ev.sandbox(spec, "ready", attempt=1)
        assert not a.duplicate and b.duplicate and not c.duplicate
        await ev.sandbox(spec, "placed", acked=False)  # not what a create waits for: no fan-out
        await ev.sandbox(spec, "failed", err=CreateFailed("x"))
        await nc.flush()
        await eventually(lambda: len(heard) == 4, what="ready x3 and failed on the inbox")
        assert [e.kind for e in heard] == ["ready", "ready", "ready", "failed"]
        assert heard[0].host_id == "h1" and heard[3].code == "create_failed"
        # a reply_to that is not an inbox is never published to
        spied: list = []

        async def spy(m) -> None:
            spied.append(m)

        spy_sub = await nc.subscribe(f"{S.PREFIX}.spy{uid}", cb=spy)
        bad = SandboxSpec(sandbox_id=f"sb2-{uid}", reply_to=f"{S.PREFIX}.spy{uid}")
        assert (await ev.sandbox(bad, "ready")).stream == S.STREAM_EVT
        await nc.flush()
        await spy_sub.unsubscribe()
        assert not spied
        last = await nc.jetstream().get_last_msg(S.STREAM_EVT, S.evt_sandbox(spec.sandbox_id, "ready", S.tenant(spec.client)))
        assert last.headers[S.HDR_MSG_ID] == f"sb-{uid}:ready:1"
    finally:
        await sub.unsubscribe()


async def test_dead_letter_keeps_the_message_with_its_reason_then_acks(nc, stream) -> None:
    name, prefix = stream
    js = nc.jetstream()
    await js.publish(f"{prefix}.work", b"\x00garbage")
    await js.add_consumer(name, consumer_config("dl", f"{prefix}.>", max_ack_pending=1))
    sub = await js.pull_subscribe_bind("dl", stream=name)
    (msg,) = await sub.fetch(1, timeout=10)
    ack = await dead_letter(await publisher_for(nc), msg, "bad_request", "malformed message: x" * 100)
    assert ack.stream == S.STREAM_DLQ
    kept = await js.get_msg(S.STREAM_DLQ, ack.seq)
    assert kept.data == b"\x00garbage" and kept.subject == S.dlq(f"{prefix}.work")
    assert kept.headers[S.HDR_ERROR_CODE] == "bad_request" and kept.headers[S.HDR_ORIGIN] == f"{prefix}.work"
    assert len(kept.headers[S.HDR_ERROR]) == 512

    async def acked() -> bool:
        info = await js.consumer_info(name, "dl")
        return info.num_ack_pending == 0

    await eventually(acked, what="the original acked")
    await sub.unsubscribe()
