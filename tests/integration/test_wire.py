"""The bus is a public API: a trainer in another language publishes a create straight to NATS.

The publishing side below imports nothing of dsec: plain nats-py, a dozen-line msgpack encoder and
the JSON Schema that ``dsec schema`` prints (run as a separate process). It hears its ready event,
execs through the sandbox subject and kills the sandbox, all in plain msgpack maps.
"""

from __future__ import annotations

import asyncio
import json
import struct
import uuid
from typing import Any

import msgspec
import nats
import pytest

from .conftest import PY, REPO, Stack, needs_stack, subprocess_env

pytestmark = [pytest.mark.containerd, needs_stack]


def mp(v: Any) -> bytes:
    """msgpack, by hand (maps, strings, ints, floats, bools, lists, bytes, nil)."""
    if v is None:
        return b"\xc0"
    if v is True or v is False:
        return b"\xc3" if v else b"\xc2"
    if isinstance(v, int):
        return struct.pack(">Bq", 0xD3, v) if v < 0 else struct.pack(">BQ", 0xCF, v)
    if isinstance(v, float):
        return struct.pack(">Bd", 0xCB, v)
    if isinstance(v, str):
        b = v.encode()
        return struct.pack(">BI", 0xDB, len(b)) + b
    if isinstance(v, bytes):
        return struct.pack(">BI", 0xC6, len(v)) + v
    if isinstance(v, list):
        return struct.pack(">BI", 0xDD, len(v)) + b"".join(mp(x) for x in v)
    if isinstance(v, dict):
        return struct.pack(">BI", 0xDF, len(v)) + b"".join(mp(k) + mp(x) for k, x in v.items())
    raise TypeError(type(v))


async def _schema(url: str, subject: str) -> dict[str, Any]:
    proc = await asyncio.create_subprocess_exec(PY, "-m", "sdk.cli", "schema", "--subject", subject, cwd=str(REPO), env=subprocess_env(url),
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err
    return json.loads(out)[subject]


def _struct(schema: dict[str, Any], name: str, **fields: Any) -> dict[str, Any]:
    """A message of type ``name`` (its tag in ``type``), checked against the schema's properties."""
    d = schema["$defs"][name]
    assert d["properties"]["type"] == {"enum": [name]}
    missing = set(d.get("required", [])) - {"type"} - set(fields)
    assert not missing, f"{name} needs {missing}"
    unknown = set(fields) - set(d["properties"])
    assert not unknown, f"{name} has no {unknown}"
    return {"type": name, **fields}


async def test_plain_nats_client_creates_execs_and_kills(stack: Stack) -> None:
    create = await _schema(stack.url, "dsec.req.{tenant}.create")
    exec_s = await _schema(stack.url, "dsec.sbx.{tenant}.{id}.exec")
    kill_s = await _schema(stack.url, "dsec.sbx.{tenant}.{id}.kill")
    assert create["transport"] == "jetstream:DSEC_REQ" and "reply" in exec_s

    nc = await nats.connect(stack.url)
    sid = f"wire-{stack.uid}-{uuid.uuid4().hex[:8]}"
    tenant = "wire"  # this stack's NATS checks no users; on a real one, the tenant is your NATS user
    try:
        events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        replies: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        inbox = nc.new_inbox()

        async def on_event(m: Any) -> None:
            events.put_nowait(msgspec.msgpack.decode(m.data))

        async def on_reply(m: Any) -> None:
            replies.put_nowait(msgspec.msgpack.decode(m.data))

        await nc.subscribe(f"dsec.evt.sandbox.{tenant}.{sid}.>", cb=on_event)
        await nc.subscribe(inbox, cb=on_reply)
        spec = _struct(create["message"], "SandboxSpec", sandbox_id=sid, template="base", memory_mb=64, pool=stack.pool, reply_to=inbox)
        msg = _struct(create["message"], "CreateSandbox", spec=spec)
        ack = await nc.jetstream().publish(f"dsec.req.{tenant}.create", mp(msg), headers={"Nats-Msg-Id": sid})
        assert ack.stream == "DSEC_REQ"

        async def until(q: asyncio.Queue[dict[str, Any]], kind: str) -> dict[str, Any]:
            while True:
                ev = await asyncio.wait_for(q.get(), 60)
                assert ev["kind"] != "failed", ev
                if ev["kind"] == kind:
                    return ev

        ready = await until(replies, "ready")  # the reply_to copy
        assert ready["type"] == "SandboxEvent" and ready["sandbox_id"] == sid
        assert (await until(events, "ready"))["sandbox_id"] == sid  # and the event on its subject

        r = await nc.request(f"dsec.sbx.{tenant}.{sid}.exec", mp(_struct(exec_s["message"], "ExecRequest", cmd="echo from-the-wire")), timeout=30)
        res = msgspec.msgpack.decode(r.data)
        assert res["type"] == "ExecResult" and res["exit_code"] == 0 and res["stdout"] == b"from-the-wire\n", res
        # A malformed request gets the error envelope the schema names as the reply's other branch.
        bad = msgspec.msgpack.decode((await nc.request(f"dsec.sbx.{tenant}.{sid}.exec", mp({"type": "ExecRequest"}), timeout=30)).data)
        assert bad["type"] == "ErrorReply" and bad["code"] == "bad_request", bad
        assert "ErrorReply" in json.dumps(exec_s["reply"])

        done = msgspec.msgpack.decode((await nc.request(f"dsec.sbx.{tenant}.{sid}.kill", mp(_struct(kill_s["message"], "KillRequest")), timeout=60)).data)
        assert done["type"] == "Done", done
        assert (await until(events, "killed"))["sandbox_id"] == sid
    finally:
        await nc.close()
    await stack.assert_gone(sid)
