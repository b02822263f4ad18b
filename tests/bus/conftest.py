"""Fixtures of the runtime contract tests: connections to the session's real nats-server, a
uuid-named stream per test (deleted afterwards)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from bus.runtime import connect, release_publisher
from bus.streams import ensure_all


@pytest.fixture
async def nc(nats_server) -> AsyncIterator:
    c = await connect(nats_server.url, name="runtime-test")
    await ensure_all(c.jetstream())
    yield c
    await release_publisher(c)
    await c.close()


@pytest.fixture
async def nc2(nats_server) -> AsyncIterator:
    c = await connect(nats_server.url, name="runtime-test-2")
    yield c
    await release_publisher(c)
    await c.close()


@pytest.fixture
async def stream(nc, uid) -> AsyncIterator[tuple[str, str]]:
    """(stream name, subject prefix) of a fresh work stream."""
    js = nc.jetstream()
    name, prefix = f"T_{uid}", f"t{uid}"
    await js.add_stream(name=name, subjects=[f"{prefix}.>"])
    yield name, prefix
    await js.delete_stream(name)
