"""The service lifecycle's pause: periodic loops wait on it, shutdown wakes them all at once."""

from __future__ import annotations

import asyncio

from bus.runtime import Service
from tests.conftest import eventually


class _Idle(Service):
    name = "idle"


async def test_pause_times_out_or_ends_at_shutdown(nats_server) -> None:
    svc = _Idle(nats_server.url, grace_s=1)
    await svc.start()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert await svc.pause(0.05) is False  # positive control: the time passes, not stopping
    assert loop.time() - t0 >= 0.05
    sleepers = [asyncio.ensure_future(svc.pause(60)) for _ in range(100)]
    await eventually(lambda: len(svc._sleepers) == 100, what="every pause waiting")  # the wake path is what is tested
    t1 = loop.time()
    await svc.shutdown()
    assert await asyncio.wait_for(asyncio.gather(*sleepers), 5) == [True] * 100  # woken, not 60 s later
    assert loop.time() - t1 < 5
    assert await svc.pause(60) is True  # after shutdown: at once
    assert not svc._sleepers  # nothing left behind
