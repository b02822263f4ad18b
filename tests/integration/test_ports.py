"""Sandbox ports on the bus (``dsec.sbx.<id>.port``): the host agent relays a TCP connection it opens
inside the sandbox's network namespace; bad requests get typed errors and never aim it elsewhere."""

from __future__ import annotations

import asyncio

import pytest

from bus import codec
from bus import subjects as S
from bus.errors import BadRequest, InvalidArgument, PortClosed
from bus.messages import Done, PortOpen, PortOpened, PortSend
from sdk.gateway._ports import PortConnection

from .conftest import Stack, needs_stack

pytestmark = [pytest.mark.containerd, needs_stack]


async def test_port_relay_and_its_refusals(stack: Stack) -> None:
    async with stack.sandbox(memory_mb=64) as sb:
        await sb.files.write("/tmp/www/x", "relayed")
        # busybox nc as a one-shot server: it answers the first connection with the file.
        await sb.commands.run("(nc -l -p 9000 < /tmp/www/x > /tmp/got &) ; sleep 0.2", timeout=10)
        pc = PortConnection(sb)
        await pc.open(9000)
        try:
            await pc.send(b"hello server", eof=True)
            got = await asyncio.wait_for(pc.reader.read(), 10)
            assert got == b"relayed"
        finally:
            await pc.close()
        assert await sb.files.read("/tmp/got") == "hello server"
        # Refusals: nothing listening, a port out of range, a reply subject that is not an inbox,
        # a connection id that is not open.
        with pytest.raises(PortClosed):
            await sb._request("port", PortOpen(port=9001, to=sb._nc.new_inbox()), PortOpened)
        with pytest.raises(InvalidArgument):
            await sb._request("port", PortOpen(port=70000, to=sb._nc.new_inbox()), PortOpened)
        with pytest.raises(BadRequest):
            await sb._request("port", PortOpen(port=9000, to=S.REQ_CREATE), PortOpened)
        with pytest.raises(InvalidArgument):
            await sb._request("port", PortSend(conn="nope", data=b"x"), Done)
        # The host agent closed what it relayed for this sandbox.
        assert not [c for c in stack.host.ports.conns.values() if c.sandbox_id == sb.sandbox_id]
        assert codec.SBX_REQUEST_DECODERS["port"]
