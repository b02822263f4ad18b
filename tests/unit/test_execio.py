"""The host's output-streaming pieces: replies fitted to the payload limit, and the ack window of
streamed output, against a real nats-server (the session fixture)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from bus import codec, connect
from bus.errors import ErrorReply
from bus.messages import ExecChunk, ExecResult, FileListing, EntryInfo
from hostagent import _execio
from hostagent._execio import ClientStream, encode_reply, fit_output


def test_fit_output_splits_fairly_and_marks_what_it_cut() -> None:
    r = ExecResult(exit_code=0, stdout=b"a" * 100, stderr=b"b" * 10, stdout_bytes=500, stderr_bytes=10)
    fit_output(r, 60)
    assert r.stderr == b"b" * 10 and r.stdout == b"a" * 50  # the small stream keeps all of it
    assert r.stdout_truncated and not r.stderr_truncated and r.stdout_bytes == 500
    r = ExecResult(exit_code=0, stdout=b"a" * 100, stderr=b"b" * 100)
    fit_output(r, 60)
    assert (len(r.stdout), len(r.stderr)) == (30, 30) and r.stdout_truncated and r.stderr_truncated
    assert (r.stdout_bytes, r.stderr_bytes) == (100, 100)  # totals never below what there was
    r = ExecResult(exit_code=0, stdout=b"ok")
    fit_output(r, 60)
    assert r.stdout == b"ok" and not r.stdout_truncated and r.stdout_bytes == 2


def test_encode_reply_fits_or_says_reply_too_large() -> None:
    big = ExecResult(exit_code=0, stdout=b"x" * 200_000)
    data = encode_reply(big, 100_000)
    res = msgspec.msgpack.decode(data, type=ExecResult)
    assert len(data) <= 100_000 and res.stdout_truncated and res.stdout_bytes == 200_000
    listing = FileListing(entries=[EntryInfo(name="n" * 200, path="/d/" + "n" * 200, type="file") for _ in range(1000)])
    err = msgspec.msgpack.decode(encode_reply(listing, 100_000), type=ErrorReply)
    assert err.code == "reply_too_large" and "max_payload" in err.description and err.context["limit"] == 100_000
    assert encode_reply(FileListing(entries=[]), 100_000) == codec.encode(FileListing(entries=[]))


async def _stream_pair(nats_server, answer: bool):
    nc = await connect(nats_server.url)
    inbox = nc.new_inbox()
    st = ClientStream(nc, inbox)
    got: list[ExecChunk] = []

    async def on(msg) -> None:
        ch = codec.EXEC_CHUNK.decode(msg.data)
        got.append(ch)
        if answer and ch.ack:
            st.ack(ch.seq)  # what the host does when the client's StreamAck comes back

    sub = await nc.subscribe(inbox, cb=on)
    return nc, sub, st, got


async def test_stream_numbers_and_asks_for_acks_within_a_window(nats_server, monkeypatch) -> None:
    monkeypatch.setattr(_execio, "ACK_EVERY_BYTES", 1000)
    nc, sub, st, got = await _stream_pair(nats_server, answer=True)
    try:
        for _ in range(50):
            assert await st.send(lambda seq, ack: ExecChunk(seq=seq, stream=1, data=b"x" * 500, ack=ack), 500)
        await nc.flush()
        for _ in range(100):
            if len(got) == 50:
                break
            await asyncio.sleep(0.01)  # delivery poll
        assert [c.seq for c in got] == list(range(50))
        assert [c.seq for c in got if c.ack] == list(range(1, 50, 2))  # one mark per 1000 bytes
    finally:
        await sub.unsubscribe()
        await nc.close()


async def test_stream_gives_up_on_a_client_that_never_acks(nats_server, monkeypatch) -> None:
    monkeypatch.setattr(_execio, "ACK_EVERY_BYTES", 100)
    monkeypatch.setattr(_execio, "ACK_TIMEOUT_S", 0.3)
    nc, sub, st, got = await _stream_pair(nats_server, answer=False)
    try:
        sent = 0
        while await st.send(lambda seq, ack: ExecChunk(seq=seq, stream=1, data=b"y" * 100, ack=ack), 100):
            sent += 1
            assert sent < 100, "the window must stop an unanswered stream"
        assert st.dead and sent == _execio.ACK_WINDOW  # the window filled, then the wait timed out
        assert not await st.send(lambda seq, ack: ExecChunk(seq=seq, stream=1, data=b"z", ack=ack), 1)
    finally:
        await sub.unsubscribe()
        await nc.close()


@pytest.mark.parametrize("mask,kinds", [
    (0x100, ["create"]), (0x80 | 0x40000000, ["create"]), (0x2, ["write"]), (0x200, ["remove"]), (0x40, ["rename"]),
    (0x4, ["chmod"]), (0x4000, ["overflow"]), (0x8, []),
])
def test_inotify_masks_map_to_event_kinds(mask: int, kinds: list[str]) -> None:
    assert _execio._fs_kinds(mask) == kinds


async def test_stream_without_acks_marks_nothing_and_never_waits(nats_server, monkeypatch) -> None:
    """Clients that do not answer acks (ExecRequest.acks=False) stream as before flow control."""
    monkeypatch.setattr(_execio, "ACK_EVERY_BYTES", 100)
    nc = await connect(nats_server.url)
    try:
        st = ClientStream(nc, nc.new_inbox(), acks=False)
        for _ in range(3 * _execio.ACK_WINDOW):
            assert await st.send(lambda seq, ack: ExecChunk(seq=seq, stream=1, data=b"y" * 100, ack=ack), 100)
        assert not st.dead and st.seq == 3 * _execio.ACK_WINDOW and not st._marks
    finally:
        await nc.close()


async def test_the_sdk_detects_a_gap_in_streamed_output(nats_server, monkeypatch) -> None:
    """Chunks are numbered: one missing in the middle, or at the end, is OutputLost, never silence."""
    from bus.errors import OutputLost
    from sdk import AsyncSandbox
    from sdk import _commands

    monkeypatch.setattr(_commands, "DRAIN_S", 0.5)
    nc = await connect(nats_server.url)
    try:
        sb = AsyncSandbox("sb-gap-test", nc)
        got: list[str] = []
        out = await _commands._Output(sb, got.append, None, 0).start()
        for seq in (0, 2):  # 1 lost on the way
            await nc.publish(out.inbox, codec.encode(ExecChunk(seq=seq, stream=1, data=f"c{seq} ".encode())))
        await nc.flush()
        await out.drain(3)
        assert got == ["c0 ", "c2 "] and isinstance(out.error, OutputLost) and out.error.code == "output_lost"
        await out.close()
        tail = await _commands._Output(sb, None, None, 0).start()
        await nc.publish(tail.inbox, codec.encode(ExecChunk(seq=0, stream=1, data=b"x")))
        await nc.flush()
        await tail.drain(2)  # the reply said 2 chunks, only 1 came
        assert isinstance(tail.error, OutputLost) and "never arrived" in tail.error.description
        await tail.close()
    finally:
        await nc.close()
