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


def _sdk_conns(nats_server, name: str) -> int:
    import json
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{nats_server.monitor_port}/connz?limit=4096", timeout=5) as r:
        return sum(1 for c in json.load(r).get("connections", []) if c.get("name") == name)


async def test_concurrent_first_calls_share_one_connection(nats_server) -> None:
    """A gather of first creates used to open one connection each and keep only the last: the others
    stayed open, unreachable, reconnecting after the server had gone."""
    import sdk._async as sa

    # a spelling of the session server's URL no other test uses: a key of its own
    url = nats_server.url.replace("127.0.0.1", "localhost")
    before = _sdk_conns(nats_server, "dsec-sdk")
    try:
        got = await asyncio.gather(*(sa._nc(url) for _ in range(20)))
        assert len({id(c) for c in got}) == 1
        assert await sa._nc(url) is got[0]  # later calls reuse it
        assert _sdk_conns(nats_server, "dsec-sdk") == before + 1
    finally:
        await sa.close_connections()
    assert got[0].is_closed
    deadline = asyncio.get_running_loop().time() + 5
    while _sdk_conns(nats_server, "dsec-sdk") != before and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)  # the server drops a closed client on its next read: poll for it
    assert _sdk_conns(nats_server, "dsec-sdk") == before

