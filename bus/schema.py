"""The bus as a public API: every subject's message types as JSON Schema, and an AsyncAPI document.

Schemas come from the msgspec types in ``bus.messages`` (what the services decode), keyed by the
subject names in ``bus.subjects``; ``{host}``/``{id}``/``{kind}``/``{name}`` mark the tokens a
subject is parameterised by. On the wire every payload is msgpack (``bytes`` fields as msgpack bin);
see the README's "Wire format" section for the version rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, get_args

import msgspec

from . import codec
from . import subjects as S
from .errors import ErrorReply
from .messages import (
    ExecResult,
    FsEvent,
    MetricsRequest,
    DisplayRequest,
    ProcessStarted,
    ProcOp,
    StreamAck,
    BuildImage,
    CreateBatch,
    CreateReply,
    ReadyMany,
    CreateSandbox,
    Done,
    ExecChunk,
    ExecRequest,
    FileOp,
    GuardViolation,
    HandoffReply,
    HostEvent,
    HostEventKind,
    HostImageStats,
    HostImageStatsRequest,
    HostMessage,
    HostStatus,
    ImageBuilt,
    ImageEvent,
    ImageList,
    ImageStats,
    ImageStatsRequest,
    InfoRequest,
    KillRequest,
    Lease,
    ListImages,
    PortData,
    PortOp,
    RemoveImage,
    SandboxEvent,
    SandboxEventKind,
    SandboxRecord,
    SecurityProfile,
    SetNetwork,
    SetTimeout,
    TemplateManifest,
    PackDirectory,
    PackedLayer,
    PauseRequest,
    RemoveSnapshot,
    ResumeRequest,
    SnapshotEvent,
    SnapshotRecord,
    SnapshotRequest,
)
from .messages import ModelAnswer, ModelCall, RolloutJob, RolloutRecord, TrajStep


@dataclass(frozen=True)
class Channel:
    subject: str
    message: Any  # the type (or union) a publisher sends
    reply: Any = None  # what a request gets back (besides ErrorReply), None for no reply
    stream: str = ""  # the JetStream stream that keeps it ("" for core NATS)
    doc: str = ""
    sends_also: tuple[tuple[str, Any], ...] = ()  # side channels a request opens: (field naming the inbox, type)


CLIENT_CREATE = f"{S.PREFIX}.req.{{tenant}}.create"
CLIENT_CREATE_BATCH = f"{S.PREFIX}.req.{{tenant}}.create_batch"


def _sbx(op: str) -> str:
    return f"{S.PREFIX}.sbx.{{tenant}}.{{id}}.{op}"


CHANNELS: list[Channel] = [
    Channel(CLIENT_CREATE, CreateSandbox, stream=S.STREAM_REQ,
            doc="Ask for a sandbox, as tenant <tenant> (your NATS user: the sandbox's owner, whatever spec.client says). Publish "
                "with header Nats-Msg-Id: <sandbox_id> (JetStream de-duplication); JetStream acks the publish. The outcome is a "
                "SandboxEvent (ready, failed, pending) on dsec.evt.sandbox.<tenant>.<id>.<kind> and, when spec.reply_to names "
                "an inbox, a copy there.",
            sends_also=(("spec.reply_to", CreateReply),)),
    Channel(CLIENT_CREATE_BATCH, CreateBatch, stream=S.STREAM_REQ, doc="Many alike sandboxes in one message; each gets its own events.",
            sends_also=(("specs[].reply_to", CreateReply),)),
    Channel(f"{S.PREFIX}.host.{{host}}.create", HostMessage, HandoffReply,
            doc="Placement's work for one host (signed; services only): a core hand-off the host answers when it is durable."),
    Channel(f"{S.PREFIX}.evt.sandbox.{{tenant}}.{{id}}.{{kind}}", SandboxEvent, stream=S.STREAM_EVT,
            doc=f"Lifecycle of a sandbox; kind is one of {', '.join(get_args(SandboxEventKind))}."),
    Channel(f"{S.PREFIX}.evt.ready.{{tenant}}.{{host}}", ReadyMany, stream=S.STREAM_EVT,
            doc="A host batch's sandboxes of one tenant that became ready (one event naming its members, in place of a "
                "ready SandboxEvent each); each member's record is stored before it."),
    Channel(f"{S.PREFIX}.evt.host.{{host}}.{{kind}}", HostEvent, stream=S.STREAM_EVT,
            doc=f"A host came up, went down or recovered; kind is one of {', '.join(get_args(HostEventKind))}."),
    Channel(S.EVT_GUARD_VIOLATION, GuardViolation, stream=S.STREAM_EVT, doc="A sandbox tripped a security rule."),
    Channel(f"{S.PREFIX}.evt.image.{{name}}.{{kind}}", ImageEvent, stream=S.STREAM_EVT, doc="A template was built or removed."),
    Channel(_sbx("exec"), ExecRequest, codec.REPLY_TYPES["exec"] | ProcessStarted,
            doc="Run a command (/bin/sh -c) in the sandbox; with stream_to (an inbox) its output comes there as ExecChunk first "
                "(background: the reply is ProcessStarted and the final ExecResult is the stream's last message).",
            sends_also=(("stream_to", ExecChunk | ExecResult),)),
    Channel(_sbx("files"), FileOp, codec.REPLY_TYPES["files"],
            doc="Read, write, list, remove, stat, make_dir, rename, watch a file or directory in the sandbox.",
            sends_also=(("stream_to (FileWatch)", FsEvent),)),
    Channel(_sbx("proc"), ProcOp, codec.REPLY_TYPES["proc"], doc="Background processes: list, signal, stdin, connect, disconnect.",
            sends_also=(("stream_to (ProcConnect)", ExecChunk | ExecResult),)),
    Channel(_sbx("metrics"), MetricsRequest, codec.REPLY_TYPES["metrics"], doc="The sandbox's CPU, memory and disk use."),
    Channel(_sbx("display"), DisplayRequest, codec.REPLY_TYPES["display"], doc="A sandbox's screen (backend vm): screenshot, typing, keys, clicks."),
    Channel(_sbx("ack"), StreamAck, doc="Flow control: a client's answer to chunks or events marked ack (no reply)."),
    Channel(_sbx("kill"), KillRequest, codec.REPLY_TYPES["kill"], doc="Kill the sandbox and remove everything it had."),
    Channel(_sbx("timeout"), SetTimeout, codec.REPLY_TYPES["timeout"], doc="Set the sandbox to expire timeout_s from now."),
    Channel(_sbx("network"), SetNetwork, codec.REPLY_TYPES["network"],
            doc="Replace the running sandbox's egress allowlist (a sandbox created with one; empty: no egress)."),
    Channel(_sbx("info"), InfoRequest, codec.REPLY_TYPES["info"], doc="The sandbox's state."),
    Channel(_sbx("port"), PortOp, codec.REPLY_TYPES["port"],
            doc="A TCP connection to a server inside the sandbox, relayed by its host agent: PortOpen (the server's bytes come "
                "to `to` as PortData), then PortSend.", sends_also=(("to", PortData),)),
    Channel(_sbx("snapshot"), SnapshotRequest, codec.REPLY_TYPES["snapshot"],
            doc="Snapshot the sandbox: what changed since its last snapshot as one more layer (memory: its processes too, CRIU)."),
    Channel(_sbx("pause"), PauseRequest, codec.REPLY_TYPES["pause"], doc="Freeze the sandbox; persist: snapshot it and free the host."),
    Channel(_sbx("resume"), ResumeRequest, codec.REPLY_TYPES["resume"], doc="Thaw a frozen sandbox."),
    Channel(f"{S.PREFIX}.evt.snapshot.{{id}}.{{kind}}", SnapshotEvent, stream=S.STREAM_EVT,
            doc="Snapshot provenance: created, forked, restored, removed (source, parent, the client's metadata)."),
    Channel(f"{S.SNAP_REMOVE}.{{tenant}}", RemoveSnapshot, Done,
            doc="Remove a snapshot nothing builds on, and the chunks only it used, as tenant <tenant>: only a snapshot of its own "
                "(another tenant's answers unknown_snapshot)."),
    Channel(S.SNAP_REMOVE, RemoveSnapshot, Done, doc="Remove any snapshot (services and the operator)."),
    Channel(f"{S.PREFIX}.imaged.{{host}}.pack", PackDirectory, PackedLayer, doc="A host's lazy loader packs a host directory into a layer (host agents only)."),
    Channel(S.IMG_LIST, ListImages, ImageList, doc="The templates."),
    Channel(f"{S.IMG_BUILD}.{{tenant}}", BuildImage, ImageBuilt,
            doc="Build a template as tenant <tenant> (its owner): from a registry image, its own snapshot or a template it may use; "
                "a name another tenant (or the operator) owns answers template_taken."),
    Channel(S.IMG_BUILD, BuildImage, ImageBuilt, doc="Build a template from sources on the image service's machine (the operator)."),
    Channel(f"{S.IMG_REMOVE}.{{tenant}}", RemoveImage, Done,
            doc="Remove a template of tenant <tenant>'s own (a shared or another tenant's answers permission_denied)."),
    Channel(S.IMG_REMOVE, RemoveImage, Done, doc="Remove any template (the operator)."),
    Channel(S.IMG_STATS, ImageStatsRequest, ImageStats, doc="A template's size and layers."),
    Channel(f"{S.PREFIX}.img.host.{{host}}.stats", HostImageStatsRequest, HostImageStats, doc="A host's lazy loader cache."),
    Channel(f"{S.PREFIX}.traj.{{id}}", TrajStep, stream=S.STREAM_TRAJ,
            doc="The sandbox's trajectory log: each numbered operation, published by its host before the reply; a policy's turns beside them."),
    Channel(f"{S.PREFIX}.rollout.{{queue}}.{{tenant}}.{{id}}", RolloutJob, stream=S.STREAM_ROLLOUTS, doc="A rollout job of tenant <tenant> on a work queue."),
    Channel(f"{S.PREFIX}.model.{{tenant}}.{{id}}", ModelCall, ModelAnswer,
            doc="A chat-completions request for the policy of a rollout of tenant <tenant> (the gateway's model endpoint)."),
]

# KV buckets a client may read (values are msgpack of these types, keyed as noted).
BUCKETS: dict[str, tuple[Any, str]] = {
    S.KV_SANDBOXES: (SandboxRecord, "sandbox id"),
    S.KV_HOSTS: (HostStatus, "host id"),
    S.KV_IMAGES: (TemplateManifest, "template name"),
    S.KV_LEASES: (Lease, "lease owner or sandbox id"),
    S.KV_PROFILES: (SecurityProfile, "profile name"),
    S.KV_SNAPSHOTS: (SnapshotRecord, "snapshot id"),
    S.KV_ROLLOUTS: (RolloutRecord, "<tenant>.<job id>"),
}

STREAMS: dict[str, list[str]] = {
    S.STREAM_REQ: S.REQ_SUBJECTS, S.STREAM_EVT: S.EVT_SUBJECTS, S.STREAM_DLQ: S.DLQ_SUBJECTS,
    S.STREAM_TRAJ: S.TRAJ_SUBJECTS, S.STREAM_ROLLOUTS: S.ROLLOUT_SUBJECTS,
}


def _schema(t: Any) -> dict[str, Any]:
    return msgspec.json.schema(t)


def subject_schemas() -> dict[str, dict[str, Any]]:
    """Subject -> {message, reply, stream, doc, ...}, each a JSON Schema with its own $defs."""
    out: dict[str, dict[str, Any]] = {}
    for ch in CHANNELS:
        d: dict[str, Any] = {"doc": ch.doc, "transport": f"jetstream:{ch.stream}" if ch.stream else "core", "message": _schema(ch.message)}
        if ch.reply is not None:
            d["reply"] = _schema(ch.reply | ErrorReply)
        for where, t in ch.sends_also:
            d.setdefault("also_sends", {})[where] = _schema(t)
        out[ch.subject] = d
    for bucket, (t, key) in BUCKETS.items():
        out[f"$KV.{bucket}.{{key}}"] = {"doc": f"KV bucket {bucket}, keyed by {key}", "transport": "kv", "message": _schema(t)}
    return out


def _ref_name(t: Any) -> str:
    return getattr(t, "__name__", None) or "Or".join(a.__name__ for a in t.__args__)


def asyncapi() -> dict[str, Any]:
    """An AsyncAPI 3.0 document: channels (subjects), the streams keeping them, and request replies."""
    types: list[Any] = [ErrorReply]
    for ch in CHANNELS:
        types += [ch.message] + ([ch.reply] if ch.reply is not None else []) + [t for _, t in ch.sends_also]
    types += [t for t, _ in BUCKETS.values()]
    _, components = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    messages: dict[str, Any] = {}
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}

    def message(t: Any) -> dict[str, str]:
        name = _ref_name(t)
        if name not in messages:
            schema = msgspec.json.schema_components([t], ref_template="#/components/schemas/{name}")[0][0]
            messages[name] = {"name": name, "contentType": "application/msgpack", "payload": schema}
        return {"$ref": f"#/components/messages/{name}"}

    for i, ch in enumerate(CHANNELS):
        cid = ch.subject.replace(".", "_").replace("{", "").replace("}", "")
        params = {p.strip("{}"): {"description": f"one subject token ({p.strip('{}')})"} for p in ch.subject.split(".") if p.startswith("{")}
        channels[cid] = {
            "address": ch.subject, "description": ch.doc, "messages": {"request": message(ch.message)},
            **({"parameters": params} if params else {}),
            "x-dsec-transport": f"jetstream:{ch.stream}" if ch.stream else "core",
        }
        op: dict[str, Any] = {"action": "send", "channel": {"$ref": f"#/channels/{cid}"}, "summary": ch.doc}
        if ch.reply is not None:
            rid = f"{cid}_reply"
            channels[rid] = {"address": None, "description": f"the requester's inbox for {ch.subject}",
                             "messages": {"reply": message(ch.reply), "error": message(ErrorReply)}}
            op["reply"] = {"channel": {"$ref": f"#/channels/{rid}"}}
        for where, t in ch.sends_also:
            sid = f"{cid}_{''.join(c if c.isalnum() else '_' for c in where)}"
            channels[sid] = {"address": None, "description": f"the inbox named by {where}", "messages": {"msg": message(t)}}
        operations[f"op{i}_{cid}"] = op
    return {
        "asyncapi": "3.0.0",
        "info": {"title": "dsec bus", "version": "1", "description": __doc__},
        "defaultContentType": "application/msgpack",
        "servers": {"nats": {"host": "127.0.0.1:4222", "protocol": "nats"}},
        "channels": channels,
        "operations": operations,
        "components": {"schemas": components, "messages": messages},
        "x-dsec-streams": STREAMS,
        "x-dsec-buckets": {b: {"key": k, "value": _ref_name(t)} for b, (t, k) in BUCKETS.items()},
    }


__all__ = ["BUCKETS", "CHANNELS", "STREAMS", "Channel", "asyncapi", "subject_schemas"]
