"""The pull consumer against a real nats-server: redelivery, capacity, batches, a shared inbox."""

from __future__ import annotations

import asyncio

from bus.runtime import PullConsumer, PullInbox, consumer_config
from tests.conftest import eventually


async def _publish(nc, subject: str, n: int) -> None:
    js = nc.jetstream()
    for i in range(n):
        await js.publish(subject, str(i).encode())


async def test_handler_that_raises_gets_the_message_again(nc, stream) -> None:
    name, prefix = stream
    seen: list[int] = []

    async def handler(msg) -> None:
        seen.append(msg.metadata.num_delivered)
        if msg.metadata.num_delivered == 1:
            raise RuntimeError("first try fails")
        await msg.ack()

    c = PullConsumer(nc, stream=name, config=consumer_config("w", f"{prefix}.>", ack_wait_s=1.0, max_ack_pending=4), capacity=4, handler=handler)
    await c.start()
    try:
        await _publish(nc, f"{prefix}.a", 1)
        await eventually(lambda: seen == [1, 2], timeout=15, what="redelivery after the handler raised")
        await eventually(lambda: c.inflight == 0, what="handler done")

        async def acked() -> bool:
            info = await nc.jetstream().consumer_info(name, "w")
            return info.num_ack_pending == 0 and info.num_pending == 0

        await eventually(acked, what="the second delivery acked")
    finally:
        await c.stop_intake()
        await c.finish(5)


async def test_capacity_is_never_exceeded(nc, stream) -> None:
    name, prefix = stream
    capacity = 3
    running = 0
    peak = 0
    over: list[int] = []
    release = asyncio.Event()
    done = 0
    c: PullConsumer

    async def handler(msg) -> None:
        nonlocal running, peak, done
        running += 1
        peak = max(peak, running)
        if c.inflight + c.credits > capacity:
            over.append(c.inflight + c.credits)
        await release.wait()
        await msg.ack()
        running -= 1
        done += 1

    c = PullConsumer(nc, stream=name, config=consumer_config("cap", f"{prefix}.>", max_ack_pending=100), capacity=capacity, handler=handler)
    await c.start()
    try:
        await _publish(nc, f"{prefix}.x", 30)
        await eventually(lambda: running == capacity, what="capacity reached")
        # With every slot busy nothing more is asked for: the rest waits in the stream.
        info = await nc.jetstream().consumer_info(name, "cap")
        assert info.num_ack_pending == capacity and info.num_pending == 30 - capacity
        release.set()
        await eventually(lambda: done == 30, what="all handled")
        assert peak == capacity and not over
    finally:
        await c.stop_intake()
        await c.finish(5)


async def test_batch_delivery_hands_over_what_arrived_together(nc, stream) -> None:
    name, prefix = stream
    await _publish(nc, f"{prefix}.b", 20)
    batches: list[list[bytes]] = []

    async def on_batch(msgs) -> None:
        batches.append([m.data for m in msgs])
        for m in msgs:
            await m.ack()

    c = PullConsumer(nc, stream=name, config=consumer_config("b", f"{prefix}.>", max_ack_pending=8), capacity=8, on_batch=on_batch)
    await c.start()
    try:
        await eventually(lambda: sum(len(b) for b in batches) == 20, what="20 delivered")
        assert all(len(b) <= 8 for b in batches)
        assert max(len(b) for b in batches) > 1  # whole batches, not one call per message
        assert sorted(int(x) for b in batches for x in b) == list(range(20))
    finally:
        await c.stop_intake()
        await c.finish(5)


async def test_consumers_sharing_one_inbox_get_only_their_own(nc, stream, uid) -> None:
    name, prefix = stream
    js = nc.jetstream()
    other = f"U_{uid}"
    await js.add_stream(name=other, subjects=[f"u{uid}.>"])
    got: dict[str, list[str]] = {"a": [], "b": []}

    def handler(key: str):
        async def h(msg) -> None:
            got[key].append(msg.subject)
            await msg.ack()
        return h

    inbox = await PullInbox(nc).start()
    a = PullConsumer(nc, stream=name, config=consumer_config("a", f"{prefix}.>", max_ack_pending=2), capacity=2, handler=handler("a"), inbox=inbox)
    b = PullConsumer(nc, stream=other, config=consumer_config("b", f"u{uid}.>", max_ack_pending=2), capacity=2, handler=handler("b"), inbox=inbox)
    await a.start()
    await b.start()
    try:
        await _publish(nc, f"{prefix}.one", 5)
        await _publish(nc, f"u{uid}.two", 7)
        await eventually(lambda: len(got["a"]) == 5 and len(got["b"]) == 7, what="both consumers served")
        assert set(got["a"]) == {f"{prefix}.one"} and set(got["b"]) == {f"u{uid}.two"}
    finally:
        for c in (a, b):
            await c.stop_intake()
            await c.finish(5)
        await inbox.stop()
        await js.delete_stream(other)


async def test_a_deleted_consumer_is_made_again_and_delivers_what_the_stream_kept(nc, stream) -> None:
    """The durable disappears under a running consumer (deleted, or lost by a server): the runtime makes
    it again and what the stream still holds, delivered before but never acked, comes again."""
    name, prefix = stream
    js = nc.jetstream()
    got: list[tuple[bytes, int]] = []
    acked: list[bytes] = []

    async def handler(msg) -> None:
        got.append((msg.data, msg.metadata.num_delivered))
        # "held" is in flight when the consumer goes away: acked only when it comes again
        if msg.data != b"held" or [d for d, _ in got].count(b"held") > 1:
            await msg.ack_sync()
            acked.append(msg.data)

    c = PullConsumer(nc, stream=name, config=consumer_config("w", f"{prefix}.>", ack_wait_s=60.0, max_ack_pending=8), capacity=8,
                     handler=handler, expires_s=1.0)
    await c.start()
    try:
        await js.publish(f"{prefix}.a", b"held")
        await js.publish(f"{prefix}.a", b"one")
        await eventually(lambda: {d for d, _ in got} == {b"held", b"one"} and acked == [b"one"], what="both delivered, one acked")
        assert c.recreated == 0  # positive control: nothing to make again while the consumer is there
        await js.delete_consumer(name, "w")
        await eventually(lambda: c.recreated >= 1, timeout=20, what="the consumer made again")
        await js.publish(f"{prefix}.a", b"two")
        # a new durable starts at the stream's first message: "held" and "one" (acked, but a limits
        # stream keeps it) come again as first deliveries, "two" after them
        await eventually(lambda: b"two" in acked and [d for d, _ in got].count(b"held") == 2, timeout=20,
                         what="the un-acked message again, and a new one")
        assert [n for d, n in got if d == b"held"] == [1, 1]
    finally:
        await c.stop_intake()
        await c.finish(5)


def test_deliveries_reads_the_ack_subject_as_nats_py_does() -> None:
    from nats.aio.msg import Msg

    from bus.runtime import deliveries

    v1 = "$JS.ACK.S.c.3.10.7.1700000000000000000.0"
    v2 = "$JS.ACK.dom.ACCHASH.S.c.4.10.7.1700000000000000000.0.tok"
    for reply, n in ((v1, 3), (v2, 4)):
        m = Msg(_client=None, subject="x", reply=reply)  # type: ignore[arg-type]
        assert deliveries(m) == n == m.metadata.num_delivered
    assert deliveries(Msg(_client=None, subject="x", reply="_INBOX.abc")) == 1  # type: ignore[arg-type]
    assert deliveries(Msg(_client=None, subject="x", reply="")) == 1  # type: ignore[arg-type]


async def test_a_batch_handler_settling_early_frees_room_before_the_batch_ends(nc, stream) -> None:
    """Capacity 2: a batch holds one message (its work goes on) and settles the other; the room that
    frees takes the next message while the first batch still runs. Without ``settled`` it would wait."""
    name, prefix = stream
    js = nc.jetstream()
    release = asyncio.Event()
    seen: list[bytes] = []
    sizes: list[int] = []
    c: PullConsumer

    async def on_batch(msgs) -> None:
        sizes.append(len(msgs))
        for m in msgs:
            seen.append(m.data)
        for m in msgs:
            if m.data != b"slow":
                await m.ack()
                c.settled()
        for m in msgs:
            if m.data == b"slow":
                await release.wait()
                await m.ack()

    c = PullConsumer(nc, stream=name, config=consumer_config("b", f"{prefix}.>", ack_wait_s=30.0, max_ack_pending=2), capacity=2,
                     on_batch=on_batch, min_pull=1, expires_s=1.0)
    await js.publish(f"{prefix}.a", b"slow")
    await js.publish(f"{prefix}.a", b"quick")
    await c.start()  # both are in the stream already: one pull, one batch of two
    try:
        await eventually(lambda: {b"slow", b"quick"} <= set(seen), what="the first two delivered")
        assert sizes == [2]
        await js.publish(f"{prefix}.a", b"next")
        await eventually(lambda: b"next" in seen, timeout=10, what="the next message while the slow one is still held")
        assert not release.is_set() and c.inflight <= c.capacity
        release.set()
        await eventually(lambda: c.inflight == 0, what="everything settled")
    finally:
        release.set()
        await c.stop_intake()
        await c.finish(5)
