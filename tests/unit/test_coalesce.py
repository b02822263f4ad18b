"""``sdk._coalesce``: how concurrent single creates of one connection are put into request messages
(the queueing alone; ``tests/placement/test_coalesce.py`` runs it against nats-server and placement)."""

from __future__ import annotations

import asyncio

import pytest

from bus.errors import Unavailable
from bus.messages import SandboxSpec
from sdk._coalesce import MAX_IN_FLIGHT, MAX_SPECS, CreateCoalescer


def spec(i: int) -> SandboxSpec:
    return SandboxSpec(sandbox_id=f"s{i}", template="base")


class Stores:
    """The store function: records each message's ids; each store returns when the test releases it."""

    def __init__(self) -> None:
        self.messages: list[tuple[list[str], str]] = []
        self.gates: list[asyncio.Future[None]] = []

    async def __call__(self, specs: list[SandboxSpec], batch_id: str) -> None:
        gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.messages.append(([s.sandbox_id for s in specs], batch_id))
        self.gates.append(gate)
        await gate

    async def wait_messages(self, n: int) -> None:
        async with asyncio.timeout(5):
            while len(self.messages) < n:
                await asyncio.sleep(0)


async def test_creates_with_room_are_stored_alone_at_once_and_the_rest_share_one_message() -> None:
    st = Stores()
    co = CreateCoalescer(st)
    first = [asyncio.ensure_future(co.store(spec(i))) for i in range(MAX_IN_FLIGHT)]
    await st.wait_messages(MAX_IN_FLIGHT)
    # control: with room in flight, each create is its own message (a CreateSandbox: no batch id)
    assert st.messages == [([f"s{i}"], "") for i in range(MAX_IN_FLIGHT)]
    queued = [asyncio.ensure_future(co.store(spec(100 + i))) for i in range(10)]
    await asyncio.sleep(0)
    assert len(st.messages) == MAX_IN_FLIGHT  # they wait for room
    st.gates[0].set_result(None)
    await st.wait_messages(MAX_IN_FLIGHT + 1)
    ids, bid = st.messages[-1]
    assert ids == [f"s{100 + i}" for i in range(10)] and bid.startswith("cb-")
    assert all(not f.done() for f in queued)  # stored only when their message is acked
    for g in st.gates[1:]:
        g.set_result(None)
    await asyncio.gather(*first, *queued)
    assert (co.stored, co.messages) == (MAX_IN_FLIGHT + 10, MAX_IN_FLIGHT + 1)


async def test_a_shared_message_that_fails_fails_each_of_its_creates_and_no_other() -> None:
    async def store(specs: list[SandboxSpec], batch_id: str) -> None:
        await asyncio.sleep(0)
        if batch_id:
            raise Unavailable("the request was not stored")

    co = CreateCoalescer(store)
    got = await asyncio.gather(*(co.store(spec(i)) for i in range(MAX_IN_FLIGHT + 5)), return_exceptions=True)
    assert got[:MAX_IN_FLIGHT] == [None] * MAX_IN_FLIGHT  # control: stored alone, stored
    assert [type(e) for e in got[MAX_IN_FLIGHT:]] == [Unavailable] * 5
    assert all(e.code == "unavailable" for e in got[MAX_IN_FLIGHT:] if isinstance(e, Unavailable))


async def test_a_create_cancelled_while_queued_is_never_stored() -> None:
    st = Stores()
    co = CreateCoalescer(st)
    busy = [asyncio.ensure_future(co.store(spec(i))) for i in range(MAX_IN_FLIGHT)]
    await st.wait_messages(MAX_IN_FLIGHT)
    keep = asyncio.ensure_future(co.store(spec(10)))
    gone = asyncio.ensure_future(co.store(spec(11)))
    await asyncio.sleep(0)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    st.gates[0].set_result(None)
    await st.wait_messages(MAX_IN_FLIGHT + 1)
    assert st.messages[-1][0] == ["s10"]  # a message of one: stored as a single create
    for g in st.gates[1:]:
        g.set_result(None)
    await asyncio.gather(*busy, keep)
    assert all("s11" not in ids for ids, _ in st.messages)


async def test_a_queue_longer_than_a_message_is_split() -> None:
    async def store(specs: list[SandboxSpec], batch_id: str) -> None:
        sizes.append(len(specs))
        await asyncio.sleep(0)

    sizes: list[int] = []
    co = CreateCoalescer(store)
    await asyncio.gather(*(co.store(spec(i)) for i in range(MAX_IN_FLIGHT + MAX_SPECS + 3)))
    assert sizes[:MAX_IN_FLIGHT] == [1] * MAX_IN_FLIGHT and max(sizes) == MAX_SPECS and sum(sizes) == MAX_IN_FLIGHT + MAX_SPECS + 3
