"""``dsec schema``: every subject's messages as JSON Schema, and the AsyncAPI document."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import get_args

import msgspec
import pytest

import sdk.errors as sdk_errors
from bus import codec
from bus import errors as bus_errors
from bus import subjects as S
from bus.errors import BadRequest, DsecError, FileNotFound, InternalError, InvalidArgument, SandboxNotFound, SandboxTimeout, UnknownUser, UnsupportedBackend
from bus.messages import BACKENDS, PRIORITIES, SANDBOX_ENDED, SANDBOX_STATES, CreateSandbox, SandboxEvent, SandboxEventKind, SandboxSpec
from bus.rules import validate_spec
from bus.schema import CHANNELS, asyncapi, subject_schemas
from tests.integration.conftest import REPO


def test_every_sandbox_op_and_request_subject_has_a_schema() -> None:
    schemas = subject_schemas()
    for op in S.SBX_OPS:
        d = schemas[f"dsec.sbx.{{id}}.{op}"]
        assert d["transport"] == "core"
        assert op == "ack" or ("reply" in d and "ErrorReply" in json.dumps(d["reply"])), op  # acks are published, not requested
    for subject in (S.REQ_CREATE, S.REQ_CREATE_BATCH, S.EVT_GUARD_VIOLATION, S.IMG_BUILD):
        assert subject in schemas
    assert schemas[S.REQ_CREATE]["transport"] == "jetstream:DSEC_REQ"
    assert set(codec.SBX_REQUEST_DECODERS) == set(S.SBX_OPS) == {c.subject.rsplit(".", 1)[1] for c in CHANNELS if c.subject.startswith("dsec.sbx.")}


def test_a_message_valid_by_the_schema_decodes() -> None:
    """What the schema says a create looks like is what placement's decoder accepts (and the tag is `type`)."""
    s = subject_schemas()[S.REQ_CREATE]["message"]
    assert s["$defs"]["SandboxSpec"]["required"] == ["type", "sandbox_id"]
    raw = msgspec.msgpack.encode({"type": "CreateSandbox", "spec": {"type": "SandboxSpec", "sandbox_id": "x1", "memory_mb": 64}})
    msg = codec.REQ.decode(raw)
    assert isinstance(msg, CreateSandbox) and isinstance(msg.spec, SandboxSpec) and msg.spec.memory_mb == 64


def test_asyncapi_lists_subjects_streams_and_replies() -> None:
    doc = asyncapi()
    assert doc["asyncapi"].startswith("3.")
    addresses = {c["address"] for c in doc["channels"].values()}
    assert S.REQ_CREATE in addresses and "dsec.sbx.{id}.exec" in addresses
    assert doc["x-dsec-streams"][S.STREAM_EVT] == S.EVT_SUBJECTS
    replies = [op for op in doc["operations"].values() if "reply" in op]
    assert len(replies) >= len(S.SBX_OPS) - 1  # all but ack
    for ref in (m["$ref"].rsplit("/", 1)[1] for c in doc["channels"].values() for m in c["messages"].values()):
        assert ref in doc["components"]["messages"]


def test_cli_prints_one_subject_or_refuses_an_unknown_one() -> None:
    def run(*a: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "sdk.cli", "schema", *a], cwd=REPO, capture_output=True, text=True, timeout=60, check=False)

    r = run("--subject", S.REQ_CREATE)
    assert r.returncode == 0 and list(json.loads(r.stdout)) == [S.REQ_CREATE]
    r = run("--subject", "dsec.nope")
    assert r.returncode == 2 and "dsec.req.create" in r.stderr
    r = run("--asyncapi")
    assert r.returncode == 0 and json.loads(r.stdout)["asyncapi"].startswith("3.")


def _enum_of(schema: dict, struct: str, field: str) -> list[str]:
    return schema["$defs"][struct]["properties"][field]["enum"]


def test_the_vocabulary_is_enumerated_in_the_schema_and_checked_on_decode() -> None:
    """Every wire enumeration is a Literal: the schema lists its values, and a decoder refuses another."""
    schemas = subject_schemas()
    evt = schemas["dsec.evt.sandbox.{id}.{kind}"]["message"]
    assert set(_enum_of(evt, "SandboxEvent", "kind")) == set(get_args(SandboxEventKind)) >= {"paused", "resumed", "ready", "failed"}
    rec = schemas[f"$KV.{S.KV_SANDBOXES}.{{key}}"]["message"]
    assert set(_enum_of(rec, "SandboxRecord", "state")) == set(SANDBOX_STATES)
    assert set(SANDBOX_ENDED) < set(SANDBOX_STATES) and "running" not in SANDBOX_ENDED
    host = schemas[f"$KV.{S.KV_HOSTS}.{{key}}"]["message"]
    assert set(_enum_of(host, "HostStatus", "backend")) == set(BACKENDS) == set(_enum_of(host, "HostBackend", "name"))
    assert set(_enum_of(host, "HostStatus", "state")) == {"ready", "draining", "down"}
    req = schemas[S.REQ_CREATE]["message"]
    assert _enum_of(req, "SandboxSpec", "backend") == list(BACKENDS) and _enum_of(req, "SandboxSpec", "priority") == list(PRIORITIES)
    assert set(_enum_of(schemas["dsec.evt.host.{host}.{kind}"]["message"], "HostEvent", "kind")) == {"up", "down", "recovered"}
    assert set(_enum_of(schemas[S.EVT_GUARD_VIOLATION]["message"], "GuardViolation", "action")) == {"record", "kill", "quarantine"}
    assert set(_enum_of(schemas["dsec.evt.snapshot.{id}.{kind}"]["message"], "SnapshotEvent", "kind")) == {"created", "restored", "forked", "removed"}
    assert set(_enum_of(schemas["dsec.host.{host}.create"]["reply"], "HandoffReply", "state")) == {"done", "working", "refused"}
    components = asyncapi()["components"]["schemas"]
    assert set(components["SandboxEvent"]["properties"]["kind"]["enum"]) == set(get_args(SandboxEventKind))

    # decode: a known kind passes, another is refused with the typed error
    ok = codec.encode(SandboxEvent(sandbox_id="s1", kind="resumed", at=1.0))
    assert codec.EVENT.decode(ok).kind == "resumed"
    bad = msgspec.msgpack.encode({"type": "SandboxEvent", "sandbox_id": "s1", "kind": "exploded", "at": 1.0})
    with pytest.raises(BadRequest, match="kind"):
        codec.EVENT.decode(bad)
    # a client's spec keeps an unknown backend decodable: placement answers it with a typed failure
    spec = codec.REQ.decode(msgspec.msgpack.encode({"type": "CreateSandbox", "spec": {"type": "SandboxSpec", "sandbox_id": "x", "backend": "gpu"}}))
    with pytest.raises(InvalidArgument, match="backend must be one of container, fncall, microvm, vm, sim"):
        validate_spec(spec.spec)


def test_cli_schema_shows_the_enumerations() -> None:
    r = subprocess.run([sys.executable, "-m", "sdk.cli", "schema", "--subject", "dsec.evt.sandbox.{id}.{kind}"],
                       cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)["dsec.evt.sandbox.{id}.{kind}"]
    assert "paused" in _enum_of(doc["message"], "SandboxEvent", "kind") and "paused" in doc["doc"]


def test_every_error_declares_its_http_status_and_the_gateway_uses_it() -> None:
    from sdk.gateway._connect import ConnectError
    from sdk.gateway._e2b import http_status
    from sdk.gateway._tenants import Unauthenticated

    classes = {c for c in vars(bus_errors).values() if isinstance(c, type) and issubclass(c, DsecError) and c is not DsecError}
    assert {c.code for c in classes} == set(bus_errors.HTTP_STATUS)  # every class is on the wire, by its code
    for c in classes:
        assert "http_status" in vars(c), f"{c.__name__} declares no http_status"
        assert 400 <= c.http_status < 600 and http_status(c("x")) == c.http_status == bus_errors.HTTP_STATUS[c.code]
        assert bus_errors.error_class(c.code) is c
    assert http_status(SandboxNotFound("x")) == 404 and http_status(UnsupportedBackend("x")) == 400 and http_status(Unauthenticated("x")) == 401
    # the Connect (envd) code follows the same declaration
    assert ConnectError.of(FileNotFound("x")).code == "not_found" and ConnectError.of(UnknownUser("x")).code == "invalid_argument"
    assert ConnectError.of(SandboxTimeout("x")).code == "deadline_exceeded" and ConnectError.of(InternalError("x")).code == "internal"


def test_sdk_errors_exports_every_bus_error() -> None:
    bus_classes = {n for n, c in vars(bus_errors).items() if isinstance(c, type) and issubclass(c, DsecError)}
    assert bus_classes <= set(sdk_errors.__all__)
    assert set(sdk_errors.__all__) - bus_classes == {"CommandExitError", "CommandTimeoutError"}
    for name in sdk_errors.__all__:
        assert getattr(sdk_errors, name) is getattr(bus_errors, name, getattr(sdk_errors, name))
