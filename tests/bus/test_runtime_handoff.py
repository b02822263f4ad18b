"""Hand-offs against a real nats-server: answered done, refused with a code, nobody there, silence,
progress while slow work goes on, refusal of what waits when the taker stops, stream deliveries."""

from __future__ import annotations

import asyncio

import pytest

from bus.errors import HostUnreachable, InvalidArgument, Unavailable
from bus.runtime import HandoffInbox, Handoffs
from tests.conftest import eventually


@pytest.fixture
async def giver(nc):
    h = await Handoffs(nc, silence_s=2.0).start()
    yield h
    await h.stop()


async def test_done_when_the_handler_returns_and_refused_with_its_code(nc, nc2, giver, uid) -> None:
    seen: list[bytes] = []

    async def handler(msg) -> None:
        if msg.data == b"bad":
            raise InvalidArgument("not that one")
        seen.append(msg.data)

    inbox = HandoffInbox(nc2, f"ho{uid}.>", handler, capacity=4)
    await inbox.start()
    await nc2.flush()  # the SUB is at the server before anything is sent to it
    try:
        assert await (await giver.send(f"ho{uid}.a", b"good")) is None
        assert seen == [b"good"]  # done is sent after the handler returned
        with pytest.raises(InvalidArgument, match="not that one"):
            await (await giver.send(f"ho{uid}.a", b"bad"))
        assert inbox.taken == 2 and giver.inflight == 0
    finally:
        await inbox.stop_intake()
        await inbox.finish(5)


async def test_nobody_taking_the_subject_fails_at_once(giver, uid) -> None:
    fut = await giver.send(f"nobody{uid}.create", b"x")
    with pytest.raises(HostUnreachable, match="nobody takes work"):
        await asyncio.wait_for(fut, 1.5)  # the server's no-responders answer, well before the silence deadline


async def test_a_silent_taker_fails_after_the_silence_deadline(nc, nc2, giver, uid) -> None:
    # a subscriber that never answers (a taker that died after taking it, or lost the message)
    sub = await nc2.subscribe(f"mute{uid}.create")
    await nc2.flush()
    try:
        fut = await giver.send(f"mute{uid}.create", b"x")
        with pytest.raises(HostUnreachable, match="no answer"):
            await asyncio.wait_for(fut, 10)
    finally:
        await sub.unsubscribe()


async def test_progress_keeps_a_slow_handoff_alive_past_the_silence_deadline(nc, nc2, uid) -> None:
    # Its own giver: a 4 s silence deadline against 0.5 s progress, a margin a busy CI machine keeps
    # (2 s against 0.5 s once failed there while the machine was loaded).
    giver = await Handoffs(nc, silence_s=4.0).start()
    release = asyncio.Event()

    async def slow(msg) -> None:
        await release.wait()

    inbox = HandoffInbox(nc2, f"slow{uid}.>", slow, capacity=1, progress_s=0.5)
    await inbox.start()
    await nc2.flush()  # the SUB is at the server before anything is sent to it
    try:
        running = await giver.send(f"slow{uid}.a", b"1")
        queued = await giver.send(f"slow{uid}.a", b"2")  # waits for the one slot: told "working" too
        await asyncio.sleep(5.0)  # the property itself: longer than silence_s (4 s), kept alive by progress alone
        assert not running.done() and not queued.done()
        release.set()
        await asyncio.wait_for(asyncio.gather(running, queued), 10)
    finally:
        await inbox.stop_intake()
        await inbox.finish(5)
        await giver.stop()


async def test_stopping_refuses_what_waits_and_finishes_what_runs(nc, nc2, giver, uid) -> None:
    release = asyncio.Event()
    started = asyncio.Event()

    async def slow(msg) -> None:
        started.set()
        await release.wait()

    inbox = HandoffInbox(nc2, f"stop{uid}.>", slow, capacity=1, refuse_code="unavailable")
    await inbox.start()
    await nc2.flush()  # the SUB is at the server before anything is sent to it
    running = await giver.send(f"stop{uid}.a", b"1")
    # Bounded, and a refused hand-off says so (CI hung here once: the send met no responders).
    await asyncio.wait({running, asyncio.ensure_future(started.wait())}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    assert started.is_set(), running.exception() if running.done() else "the hand-off did not start within 10 s"
    queued = await giver.send(f"stop{uid}.a", b"2")
    await eventually(lambda: inbox.inflight == 2, what="the second hand-off waiting for the slot")
    await inbox.stop_intake()
    release.set()
    await inbox.finish(5)
    assert await running is None  # what ran was finished and answered
    with pytest.raises(Unavailable, match="is stopping"):  # refused at once: its giver places it again
        await queued
    late = await giver.send(f"stop{uid}.a", b"3")
    with pytest.raises(HostUnreachable):  # nobody takes that subject any more
        await late


async def test_a_stream_delivery_onto_the_subject_is_not_taken(nc, nc2, uid) -> None:
    js = nc.jetstream()
    taken: list[bytes] = []

    async def handler(msg) -> None:
        taken.append(msg.data)

    subject = f"sd{uid}.create"
    inbox = HandoffInbox(nc2, subject, handler, capacity=2)
    await inbox.start()
    await nc2.flush()  # the SUB is at the server before anything is sent to it
    await js.add_stream(name=f"SD{uid}", subjects=[f"sdsrc{uid}.>"])
    try:
        await js.publish(f"sdsrc{uid}.x", b"forged")
        # a push consumer delivering the stream onto the taker's subject (see bus.sign)
        ci = await js.add_consumer(f"SD{uid}", deliver_subject=subject, ack_policy="none")
        await eventually(lambda: inbox.stream_deliveries >= 1, what="the delivery to reach the inbox")
        assert taken == [] and inbox.taken == 0
        await js.delete_consumer(f"SD{uid}", ci.name)
    finally:
        await js.delete_stream(f"SD{uid}")
        await inbox.stop_intake()
        await inbox.finish(5)
