"""``dsec schema``: every subject's messages as JSON Schema, and the AsyncAPI document."""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec

from bus import codec
from bus import subjects as S
from bus.messages import CreateSandbox, SandboxSpec
from bus.schema import CHANNELS, CLIENT_CREATE, CLIENT_CREATE_BATCH, asyncapi, subject_schemas
from tests.integration.conftest import REPO


def test_every_sandbox_op_and_request_subject_has_a_schema() -> None:
    schemas = subject_schemas()
    for op in S.SBX_OPS:
        d = schemas[f"dsec.sbx.{{tenant}}.{{id}}.{op}"]
        assert d["transport"] == "core"
        assert op == "ack" or ("reply" in d and "ErrorReply" in json.dumps(d["reply"])), op  # acks are published, not requested
    for subject in (CLIENT_CREATE, CLIENT_CREATE_BATCH, S.EVT_GUARD_VIOLATION, S.IMG_BUILD):
        assert subject in schemas
    assert schemas[CLIENT_CREATE]["transport"] == "jetstream:DSEC_REQ"
    assert set(codec.SBX_REQUEST_DECODERS) == set(S.SBX_OPS) == {c.subject.rsplit(".", 1)[1] for c in CHANNELS if c.subject.startswith("dsec.sbx.")}


def test_a_message_valid_by_the_schema_decodes() -> None:
    """What the schema says a create looks like is what placement's decoder accepts (and the tag is `type`)."""
    s = subject_schemas()[CLIENT_CREATE]["message"]
    assert s["$defs"]["SandboxSpec"]["required"] == ["type", "sandbox_id"]
    raw = msgspec.msgpack.encode({"type": "CreateSandbox", "spec": {"type": "SandboxSpec", "sandbox_id": "x1", "memory_mb": 64}})
    msg = codec.REQ.decode(raw)
    assert isinstance(msg, CreateSandbox) and isinstance(msg.spec, SandboxSpec) and msg.spec.memory_mb == 64


def test_asyncapi_lists_subjects_streams_and_replies() -> None:
    doc = asyncapi()
    assert doc["asyncapi"].startswith("3.")
    addresses = {c["address"] for c in doc["channels"].values()}
    assert CLIENT_CREATE in addresses and "dsec.sbx.{tenant}.{id}.exec" in addresses
    assert doc["x-dsec-streams"][S.STREAM_EVT] == S.EVT_SUBJECTS
    replies = [op for op in doc["operations"].values() if "reply" in op]
    assert len(replies) >= len(S.SBX_OPS) - 1  # all but ack
    for ref in (m["$ref"].rsplit("/", 1)[1] for c in doc["channels"].values() for m in c["messages"].values()):
        assert ref in doc["components"]["messages"]


def test_cli_prints_one_subject_or_refuses_an_unknown_one() -> None:
    def run(*a: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "sdk.cli", "schema", *a], cwd=REPO, capture_output=True, text=True, timeout=60, check=False)

    r = run("--subject", CLIENT_CREATE)
    assert r.returncode == 0 and list(json.loads(r.stdout)) == [CLIENT_CREATE]
    r = run("--subject", "dsec.nope")
    assert r.returncode == 2 and CLIENT_CREATE in r.stderr
    r = run("--asyncapi")
    assert r.returncode == 0 and json.loads(r.stdout)["asyncapi"].startswith("3.")
