"""The gateway's WebSocket framing (the client role it takes toward a sandbox's server), the OpenEnv
provider's reading of ``openenv.yaml``, and the size a rollout job asks for: checks without a stack."""

from __future__ import annotations

import asyncio
import struct

import pytest

from sdk._openenv import _app_of
from sdk.errors import InvalidArgument
from sdk.gateway._websocket import OP_BINARY, OP_CLOSE, OP_TEXT, FrameError, accept_of, encode_frame, read_frame
from sdk.rollouts import AsyncRollouts


def _reader(data: bytes) -> asyncio.StreamReader:
    r = asyncio.StreamReader()
    r.feed_data(data)
    r.feed_eof()
    return r


@pytest.mark.parametrize("size", [0, 1, 125, 126, 65535, 65536, 200_000])
async def test_frames_round_trip_at_every_length_encoding(size: int) -> None:
    payload = bytes(i % 251 for i in range(size))
    frame = encode_frame(OP_BINARY, payload)
    assert frame[1] & 0x80  # a client's frames are masked
    if size >= 4:
        assert payload[:4] not in frame[2:16]  # ... so the payload is not there in the clear
    assert await read_frame(_reader(frame)) == (True, OP_BINARY, payload)


async def test_an_unmasked_server_frame_and_fragments_read_as_sent() -> None:
    server = bytes([0x01, 3]) + b"hel" + bytes([0x80, 2]) + b"lo" + bytes([0x88, 2]) + struct.pack("!H", 1000)
    r = _reader(server)
    assert await read_frame(r) == (False, OP_TEXT, b"hel")
    assert await read_frame(r) == (True, 0, b"lo")
    assert await read_frame(r) == (True, OP_CLOSE, struct.pack("!H", 1000))


async def test_bad_frames_are_refused_with_their_close_code() -> None:
    with pytest.raises(FrameError) as exc:
        await read_frame(_reader(bytes([0xC1, 0])))  # RSV1 without a negotiated extension
    assert exc.value.code == 1002
    with pytest.raises(FrameError) as exc:
        await read_frame(_reader(bytes([0x82, 127]) + struct.pack("!Q", 1 << 40)))
    assert exc.value.code == 1009
    with pytest.raises(asyncio.IncompleteReadError):
        await read_frame(_reader(bytes([0x82, 10]) + b"short"))


def test_handshake_accept_is_rfc6455s() -> None:
    assert accept_of("dGhlIHNhbXBsZSBub25jZQ==") == "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="  # RFC 6455, section 1.3


def test_openenv_yaml_app() -> None:
    assert _app_of("spec_version: 1\nname: x\napp: server.app:app  # served\nport: 8000\n") == "server.app:app"
    assert _app_of("app: 'server.app:app'\n") == "server.app:app"
    assert _app_of("name: x\n  app: nested.not:top\n") is None
    assert _app_of("app:\n") is None


async def test_a_rollout_job_size_is_checked_before_anything_is_sent() -> None:
    ro = AsyncRollouts(nats_url="nats://127.0.0.1:1")  # nothing listens: a refusal must come first
    for bad in ({"memory_mb": 0}, {"memory_mb": True}, {"memory_mb": 1.5}, {"cpu": 0}, {"cpu": "1"}):
        with pytest.raises(InvalidArgument):
            await ro.submit(task="t", policy_url="http://127.0.0.1:1/v1", **bad)
