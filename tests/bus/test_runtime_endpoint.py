"""The request/reply endpoint against a real nats-server: typed decoders, the error boundary, stats,
an oversized reply as an error the caller sees, stream deliveries refused."""

from __future__ import annotations

import pytest
from nats.aio.msg import Msg

from bus import codec
from bus.errors import BadRequest, FileNotFound, InternalError, ReplyTooLarge, SandboxNotFound
from bus.messages import Done, FileData, FileRead, InfoRequest, KillRequest
from bus.runtime import Endpoint


async def _ep(nc, uid: str):
    calls: list = []

    async def handler(msg, req):
        calls.append(req)
        match req:
            case InfoRequest():
                return Done(detail="info")
            case KillRequest(reason="boom"):
                raise ValueError("not a DsecError")
            case KillRequest(reason="gone"):
                raise SandboxNotFound("no such sandbox")
            case KillRequest():
                return Done(detail="killed")
            case FileRead(length=n):
                if n < 0:
                    raise FileNotFound("nope")
                return FileData(data=b"x" * n, size=n)

    ep = Endpoint(nc, "ops", handler, decoder={"info": codec.SBX_INFO, "kill": codec.SBX_KILL, "files": codec.SBX_FILES})
    await ep.serve(f"ep{uid}.sb1.*")
    await nc.flush()
    return ep, calls


async def test_typed_decoders_and_error_boundary(nc, uid) -> None:
    ep, calls = await _ep(nc, uid)
    try:
        ask = lambda op, req: nc.request(f"ep{uid}.sb1.{op}", codec.encode(req), timeout=10)  # noqa: E731
        assert codec.decode_reply((await ask("info", InfoRequest())).data, Done).detail == "info"
        assert codec.decode_reply((await ask("kill", KillRequest())).data, Done).detail == "killed"
        with pytest.raises(SandboxNotFound):  # a DsecError keeps its code
            codec.decode_reply((await ask("kill", KillRequest(reason="gone"))).data, Done)
        with pytest.raises(InternalError, match="ValueError: not a DsecError"):  # anything else: internal, still answered
            codec.decode_reply((await ask("kill", KillRequest(reason="boom"))).data, Done)
        with pytest.raises(BadRequest, match="unknown operation 'exec'"):
            codec.decode_reply((await ask("exec", InfoRequest())).data, Done)
        with pytest.raises(BadRequest, match="malformed"):  # an info request on the kill subject: wrong type
            codec.decode_reply((await ask("kill", InfoRequest())).data, Done)
        st = ep.stats
        assert st.num_requests == 6 and st.num_errors == 4
        assert st.last_error.startswith("bad_request: malformed")
        assert st.processing_time_ns > 0 and st.average_processing_time_ns == st.processing_time_ns // 6
        assert len(calls) == 4  # the undecodable ones never reached the handler
    finally:
        await ep.stop()


async def test_reply_over_max_payload_is_an_error_reply(nc, uid) -> None:
    ep, _ = await _ep(nc, uid)
    try:
        big = nc.max_payload  # a result this big cannot be sent
        msg = await nc.request(f"ep{uid}.sb1.files", codec.encode(FileRead(path="/x", length=big)), timeout=10)
        with pytest.raises(ReplyTooLarge) as ei:
            codec.decode_reply(msg.data, FileData)
        assert ei.value.code == "reply_too_large" and ei.value.context["size"] > nc.max_payload
        assert ep.stats.replies_too_large == 1 and ep.stats.num_errors == 1
        ok = await nc.request(f"ep{uid}.sb1.files", codec.encode(FileRead(path="/x", length=1000)), timeout=10)
        assert codec.decode_reply(ok.data, FileData).size == 1000  # positive control: a fitting reply goes out
    finally:
        await ep.stop()


async def test_stream_delivered_request_is_not_answered(nc, uid) -> None:
    ep, calls = await _ep(nc, uid)
    try:
        replayed = Msg(_client=nc, subject=f"ep{uid}.sb1.kill", reply="$JS.ACK.DSEC_EVT.thief.1.5.5.0.0", data=codec.encode(KillRequest()))
        await ep.handle(replayed)
        assert ep.stats.refused == 1 and ep.stats.num_requests == 0 and not calls
    finally:
        await ep.stop()
