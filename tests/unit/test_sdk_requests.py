"""The SDK's sandbox requests (one reply subscription per connection), against a real nats-server."""

from __future__ import annotations

import asyncio
import uuid

import nats.errors
import pytest

from bus import connect
from sdk._requests import release_requests, requests_for


async def test_requests_answered_timed_out_or_nobody_serves(nats_server) -> None:
    nc = await connect(nats_server.url)
    subject = f"t.req.{uuid.uuid4().hex}"
    try:
        async def echo(msg) -> None:
            if msg.data != b"silent":
                await msg.respond(b"re:" + msg.data)

        sub = await nc.subscribe(subject, cb=echo)
        r = await requests_for(nc)
        assert await requests_for(nc) is r  # one per connection
        replies = await asyncio.gather(*(r.request(subject, str(i).encode(), 5.0) for i in range(200)))
        assert [m.data for m in replies] == [f"re:{i}".encode() for i in range(200)]  # each its own answer
        with pytest.raises(nats.errors.TimeoutError):
            await r.request(subject, b"silent", 0.2)
        with pytest.raises(nats.errors.NoRespondersError):
            await r.request(f"t.nobody.{uuid.uuid4().hex}", b"x", 5.0)
        assert not r._futs  # nothing left waiting
        await sub.unsubscribe()
    finally:
        await release_requests(nc)
        await nc.close()
