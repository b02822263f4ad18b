"""The acked publisher against a real nats-server: decoded PubAck, errors, the in-flight bound."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from bus import subjects as S
from bus.runtime import ERR_WRONG_LAST_SEQUENCE, PubAck, Publisher, StoreError, decode_puback, publisher_for
from tests.conftest import eventually


async def test_puback_is_decoded_and_duplicates_are_flagged(nc, stream) -> None:
    name, prefix = stream
    p = await publisher_for(nc)
    first = await p.store(f"{prefix}.a", b"x", {S.HDR_MSG_ID: "id-1"})
    again = await p.store(f"{prefix}.a", b"x", {S.HDR_MSG_ID: "id-1"})
    other = await p.store(f"{prefix}.a", b"y", {S.HDR_MSG_ID: "id-2"})
    assert isinstance(first, PubAck) and first.stream == name and first.seq == 1 and not first.duplicate
    assert again.duplicate and again.seq == 1
    assert other.seq == 2 and not other.duplicate


async def test_stream_errors_raise_with_their_code(nc, stream) -> None:
    _, prefix = stream
    p = await publisher_for(nc)
    await p.store(f"{prefix}.k", b"1")
    with pytest.raises(StoreError) as ei:
        await p.store(f"{prefix}.k", b"2", {"Nats-Expected-Last-Subject-Sequence": "0"})
    assert ei.value.err_code == ERR_WRONG_LAST_SEQUENCE and ei.value.status == 400
    assert "wrong last sequence" in ei.value.description


async def test_no_stream_is_an_error_not_a_hang(nc, uid) -> None:
    p = await publisher_for(nc)
    with pytest.raises(StoreError) as ei:
        await asyncio.wait_for(p.store(f"nostream{uid}.x", b"1"), 10)
    assert ei.value.status == 503


async def test_a_write_no_stream_took_is_tried_again_until_one_does(nc, uid) -> None:
    """A stream between leaders (a cluster node lost) answers nothing: the store is sent again, jittered,
    and lands once the stream is there. (The control: with no stream ever, the store fails with 503, above.)"""
    sent: list[str] = []

    class Counting(Publisher):
        async def publish(self, subject, data, headers=None):
            sent.append(subject)
            return await super().publish(subject, data, headers)

    js = nc.jetstream()
    p = Counting(nc)
    name = f"L_{uid}"
    try:
        task = asyncio.ensure_future(p.store(f"late{uid}.x", b"1"))
        await eventually(lambda: len(sent) >= 2, timeout=10, what="the store tried a second time")
        assert not task.done()
        await js.add_stream(name=name, subjects=[f"late{uid}.>"])
        ack = await asyncio.wait_for(task, 10)
        assert ack.stream == name and ack.seq == 1
        assert (await js.stream_info(name)).state.messages == 1
    finally:
        await p.stop()
        with contextlib.suppress(Exception):
            await js.delete_stream(name)


def test_decode_puback_error_answer() -> None:
    with pytest.raises(StoreError) as ei:
        decode_puback(b'{"error":{"code":503,"err_code":10077,"description":"maximum messages exceeded"}}')
    assert ei.value.status == 503 and ei.value.err_code == 10077
    assert decode_puback(b'{"stream":"S","seq":7,"duplicate":true}') == PubAck(stream="S", seq=7, duplicate=True)


async def test_in_flight_writes_are_bounded(nc, uid) -> None:
    """A responder that answers only when told: the third write waits for a free slot."""
    subject = f"fake{uid}.store"
    held: list = []

    async def hold(m) -> None:
        held.append(m)

    sub = await nc.subscribe(subject, cb=hold)
    p = Publisher(nc, max_inflight=2)
    try:
        f1 = await p.publish(subject, b"1")
        f2 = await p.publish(subject, b"2")
        third = asyncio.ensure_future(p.publish(subject, b"3"))
        await eventually(lambda: len(held) == 2, what="two writes reached the responder")
        await nc.flush()
        assert not third.done() and p.inflight == 2
        await held[0].respond(b'{"stream":"FAKE","seq":1}')
        f3 = await asyncio.wait_for(third, 10)
        assert (await f1).seq == 1
        await eventually(lambda: len(held) == 3, what="the third write went out")
        for i, m in enumerate(held[1:], start=2):
            await m.respond(f'{{"stream":"FAKE","seq":{i}}}'.encode())
        assert (await f2).seq == 2 and (await f3).seq == 3
    finally:
        await p.stop()
        await sub.unsubscribe()


async def test_unanswered_write_times_out(nc, uid) -> None:
    subject = f"silent{uid}.store"

    async def ignore(m) -> None:
        pass

    sub = await nc.subscribe(subject, cb=ignore)
    p = Publisher(nc, timeout_s=0.2)
    try:
        fut = await p.publish(subject, b"1")
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(fut, 10)
        assert p.inflight == 0
    finally:
        await p.stop()
        await sub.unsubscribe()


async def test_core_publishes_lost_before_a_reconnect_are_stored_again(tmp_path, uid) -> None:
    """A core publish with a msg-id that no stream took (the server restarting, its streams not loaded
    yet) is stored again, acked, once the connection comes back; the stream de-duplicates what it has.
    Control: a plain core publish in the same window stays lost (the stream holds only the fired ones)."""
    from bus.natsd import NatsServer
    from bus.runtime import connect, release_publisher

    srv = NatsServer(tmp_path / "nats", port=0).start()
    nc = await connect(srv.url, name="refire-test", max_reconnect_attempts=-1)
    try:
        js = nc.jetstream()
        p = await publisher_for(nc)
        for i in range(50):  # no stream takes these yet: each is lost as it is sent
            await p.fire(f"r{uid}.a", b"x", {S.HDR_MSG_ID: f"m-{i}"})
            await nc.publish(f"r{uid}.plain", b"y")
        await nc.flush()
        await js.add_stream(name=f"R_{uid}", subjects=[f"r{uid}.>"])
        await p.fire(f"r{uid}.a", b"x", {S.HDR_MSG_ID: "m-0"})  # a copy the stream stores now (once)
        await nc.flush()
        assert (await js.stream_info(f"R_{uid}")).state.messages == 1
        srv.stop()
        srv.start()

        async def stored() -> bool:
            try:
                return (await js.stream_info(f"R_{uid}")).state.messages >= 50
            except Exception:  # noqa: BLE001 - reconnecting, or the stream not loaded yet
                return False

        await eventually(stored, timeout=30, what="the lost core publishes stored again after the reconnect")
        info = await js.stream_info(f"R_{uid}")
        assert info.state.messages == 50  # each id once, and none of the 50 plain publishes
    finally:
        await release_publisher(nc)
        await nc.close()
        srv.stop()


async def test_sync_subscriptions_take_messages_until_unsubscribed(nc, uid) -> None:
    """A sink subscription (no pending queue) gets every message in order, answers requests, and
    after its unsubscribe gets nothing and is forgotten by the connection."""
    from bus.runtime.publisher import subscribe_sync, unsubscribe_answering

    got: list[bytes] = []
    sub = await subscribe_sync(nc, f"sink{uid}.*", lambda m: got.append(m.data))
    answering = await subscribe_sync(nc, f"ask{uid}", lambda m: asyncio.ensure_future(m.respond(b"pong:" + m.data)))
    for i in range(100):
        await nc.publish(f"sink{uid}.{i % 3}", str(i).encode())
    reply = await nc.request(f"ask{uid}", b"1", timeout=10)
    assert reply.data == b"pong:1"
    await eventually(lambda: len(got) == 100, timeout=10)
    assert got == [str(i).encode() for i in range(100)]
    await unsubscribe_answering(sub)
    assert sub._id not in nc._subs
    await nc.publish(f"sink{uid}.0", b"late")
    await nc.flush()
    control: list[bytes] = []  # a message published after the unsubscribe still reaches a live subscriber
    await subscribe_sync(nc, f"sink{uid}.9", lambda m: control.append(m.data))
    await nc.publish(f"sink{uid}.9", b"seen")
    await eventually(lambda: control == [b"seen"], timeout=10)
    assert got[-1] == b"99" and len(got) == 100
    await unsubscribe_answering(answering)


async def test_acked_fires_not_stored_are_stored_again_without_a_reconnect(nc, uid) -> None:
    """On replicated streams (``acked_fires``) a fired publish the stream did not take, with the
    connection up all along (a stream without a leader answers nothing, as no stream does here), is
    stored again until the stream takes it, each id once. Control: the same publishes fired without
    acks stay lost."""
    from bus.runtime import Publisher

    js = nc.jetstream()
    acked, plain = Publisher(nc, acked_fires=True), Publisher(nc, acked_fires=False)
    try:
        for i in range(20):
            await acked.fire(f"f{uid}.a", b"x", {S.HDR_MSG_ID: f"a-{i}"})
            await plain.fire(f"f{uid}.p", b"y", {S.HDR_MSG_ID: f"p-{i}"})
        await nc.flush()
        await eventually(lambda: acked._refire is not None and len(acked._fired) == 20, timeout=10, what="the refusals to come back")
        await js.add_stream(name=f"F_{uid}", subjects=[f"f{uid}.>"])

        async def stored() -> bool:
            return (await js.stream_info(f"F_{uid}")).state.messages >= 20

        await eventually(stored, timeout=30, what="the fired publishes stored again")
        await eventually(lambda: not acked._fired, timeout=10, what="the refire round to finish")
        info = await js.stream_info(f"F_{uid}", subjects_filter=f"f{uid}.>")
        assert info.state.messages == 20 and info.state.subjects == {f"f{uid}.a": 20}  # each acked id once, none of the plain ones
    finally:
        await acked.stop()
        await plain.stop()
        await js.delete_stream(f"F_{uid}")
