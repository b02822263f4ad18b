"""``flush()`` on a dsec connection means the server has what was sent before it: a subscription
made and flushed on one connection is found by a request from another, every time. nats-py 2.16
alone writes its PING ahead of commands still queued (bus.runtime.connection._ping_behind_pending);
the control is a plain nats-py connection, where some of the same requests meet no responders."""

from __future__ import annotations

import asyncio
import uuid

import nats
import nats.errors

from bus.runtime import connect
from bus.runtime.publisher import subscribe_sync

TRIES = 1500


async def _no_responders(taker, asker) -> int:
    """Requests that met no responders, each right after the taker subscribed and flushed."""
    missed = 0
    for _ in range(TRIES):
        subject = f"fl{uuid.uuid4().hex[:10]}.a"
        sub = await subscribe_sync(taker, subject, lambda m: asyncio.ensure_future(taker.publish(m.reply, b"ok")))
        await taker.flush()  # the SUB is at the server now: what this test checks
        try:
            assert (await asker.request(subject, b"x", timeout=5)).data == b"ok"
        except nats.errors.NoRespondersError:
            missed += 1
        await sub.unsubscribe()
    return missed


async def test_a_flushed_subscription_is_found_by_another_connection(nats_server) -> None:
    taker, asker = await connect(nats_server.url, name="flush-taker"), await connect(nats_server.url, name="flush-asker")
    try:
        assert await _no_responders(taker, asker) == 0
    finally:
        await taker.close()
        await asker.close()


async def test_control_plain_nats_py_flush_can_return_before_the_subscription(nats_server) -> None:
    # The fault the fix is for: without it, the PING overtakes the SUB queued before it (52 of 3,000 here).
    taker, asker = await nats.connect(nats_server.url), await nats.connect(nats_server.url)
    try:
        assert await _no_responders(taker, asker) > 0
    finally:
        await taker.close()
        await asker.close()
