"""msgpack encode and one typed decoder per subject family."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from .errors import BadRequest, ErrorReply, from_reply
from .messages import (
    CreateReply,
    DirMade,
    HandoffReply,
    Done,
    EventMessage,
    ExecChunk,
    ExecRequest,
    ExecResult,
    Exists,
    FileData,
    FileInfo,
    FileListing,
    FileOp,
    FileWritten,
    HostMessage,
    BuildImage,
    HostImageStats,
    HostImageStatsRequest,
    HostStatus,
    ImageStatsRequest,
    ListImages,
    RemoveImage,
    InfoRequest,
    KillRequest,
    Lease,
    PortData,
    PortOp,
    PortOpened,
    MetricsRequest,
    DisplayRequest,
    Screenshot,
    ProcessList,
    ProcessStarted,
    ProcOp,
    ReqMessage,
    SandboxInfo,
    SandboxMetrics,
    SandboxRecord,
    SetNetwork,
    SetTimeout,
    StreamAck,
    TemplateManifest,
    PackDirectory,
    PauseRequest,
    RemoveSnapshot,
    ResumeRequest,
    SnapshotRecord,
    TenantLimits,
    TenantUsage,
    SnapshotRequest,
    FsEvent,
    FnCallRequest,
    WatchStarted,
)

T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()


def encode(msg: Any) -> bytes:
    return _encoder.encode(msg)


class Decoder:
    """A typed msgpack decoder that raises ``BadRequest`` (code ``bad_request``) on malformed input."""

    __slots__ = ("_dec", "type")

    def __init__(self, type_: Any) -> None:
        self.type = type_
        self._dec = msgspec.msgpack.Decoder(type_)

    def decode(self, buf: bytes) -> Any:
        try:
            return self._dec.decode(buf)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise BadRequest(f"malformed message: {exc}") from None


# Decoders, one per subject family.
REQ = Decoder(ReqMessage)  # dsec.req.>
HOST = Decoder(HostMessage)  # dsec.host.<id>.>
HANDOFF_REPLY = Decoder(HandoffReply)  # the reply subject of a hand-off
EVENT = Decoder(EventMessage)  # dsec.evt.>
CREATE_REPLY = Decoder(CreateReply)  # a create's reply_to inbox
HOST_STATUS = Decoder(HostStatus)  # KV dsec_hosts
SANDBOX_RECORD = Decoder(SandboxRecord)  # KV dsec_sandboxes
TEMPLATE = Decoder(TemplateManifest)  # KV dsec_images
LEASE = Decoder(Lease)  # KV dsec_leases
SBX_EXEC = Decoder(ExecRequest)  # dsec.sbx.<id>.exec
SBX_FILES = Decoder(FileOp)  # dsec.sbx.<id>.files
SBX_KILL = Decoder(KillRequest)  # dsec.sbx.<id>.kill
SBX_TIMEOUT = Decoder(SetTimeout)  # dsec.sbx.<id>.timeout
SBX_NETWORK = Decoder(SetNetwork)  # dsec.sbx.<id>.network
SBX_INFO = Decoder(InfoRequest)  # dsec.sbx.<id>.info
SBX_SNAPSHOT = Decoder(SnapshotRequest)  # dsec.sbx.<id>.snapshot
SBX_PAUSE = Decoder(PauseRequest)  # dsec.sbx.<id>.pause
SBX_RESUME = Decoder(ResumeRequest)  # dsec.sbx.<id>.resume
SNAPSHOT = Decoder(SnapshotRecord)  # KV dsec_snapshots
TENANT_LIMITS = Decoder(TenantLimits)  # KV dsec_tenants
TENANT_USAGE = Decoder(TenantUsage)  # KV dsec_quota
PACK_REQ = Decoder(PackDirectory)  # dsec.imaged.<host>.pack
SNAP_REMOVE_REQ = Decoder(RemoveSnapshot)  # dsec.img.snap.rm
SBX_PORT = Decoder(PortOp)  # dsec.sbx.<id>.port
PORT_DATA = Decoder(PortData)  # the PortOpen's ``to`` inbox
SBX_PROC = Decoder(ProcOp)  # dsec.sbx.<id>.proc
SBX_METRICS = Decoder(MetricsRequest)  # dsec.sbx.<id>.metrics
SBX_DISPLAY = Decoder(DisplayRequest)  # dsec.sbx.<id>.display
SBX_ACK = Decoder(StreamAck)  # dsec.sbx.<id>.ack (no reply)
EXEC_CHUNK = Decoder(ExecChunk)
EXEC_STREAM = Decoder(ExecChunk | ExecResult)  # what a client's stream_to inbox receives
FS_EVENT = Decoder(FsEvent)  # what a FileWatch's stream_to inbox receives
HOST_IMG_STATS_REQ = Decoder(HostImageStatsRequest)  # dsec.img.host.<id>.stats
HOST_IMG_STATS = Decoder(HostImageStats)
IMG_LIST_REQ = Decoder(ListImages)  # dsec.img.list
IMG_BUILD_REQ = Decoder(BuildImage)  # dsec.img.build
IMG_REMOVE_REQ = Decoder(RemoveImage)  # dsec.img.rm
IMG_STATS_REQ = Decoder(ImageStatsRequest)  # dsec.img.stats
FN_CALL = Decoder(FnCallRequest)  # dsec.fn.<tenant>.<template>.call

SBX_REQUEST_DECODERS = {
    "exec": SBX_EXEC,
    "files": SBX_FILES,
    "kill": SBX_KILL,
    "timeout": SBX_TIMEOUT,
    "network": SBX_NETWORK,
    "info": SBX_INFO,
    "snapshot": SBX_SNAPSHOT,
    "pause": SBX_PAUSE,
    "resume": SBX_RESUME,
    "port": SBX_PORT,
    "proc": SBX_PROC,
    "metrics": SBX_METRICS,
    "display": SBX_DISPLAY,
    "ack": SBX_ACK,
}

_reply_decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}


def decode_reply(buf: bytes, result_type: type[T] | Any) -> T:
    """Decode a reply that is either ``result_type`` or an ``ErrorReply``; raise the typed error for the latter."""
    dec = _reply_decoders.get(result_type)
    if dec is None:
        dec = _reply_decoders[result_type] = msgspec.msgpack.Decoder(result_type | ErrorReply)
    try:
        msg = dec.decode(buf)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadRequest(f"malformed reply: {exc}") from None
    if isinstance(msg, ErrorReply):
        raise from_reply(msg)
    result: T = msg
    return result


REPLY_TYPES = {
    "exec": ExecResult | ProcessStarted,
    "files": FileData | FileListing | FileWritten | Exists | Done | DirMade | FileInfo | WatchStarted,
    "kill": Done,
    "timeout": Done,
    "network": Done,
    "info": SandboxInfo,
    "snapshot": SnapshotRecord,
    "pause": SnapshotRecord | Done,
    "resume": Done,
    "port": PortOpened | Done,
    "proc": ProcessList | ProcessStarted | Done,
    "metrics": SandboxMetrics,
    "display": Screenshot | Done,
}

__all__ = ["encode", "decode_reply", "Decoder", "REPLY_TYPES", "SBX_REQUEST_DECODERS"] + [
    n for n in dir() if n.isupper() and not n.startswith("_")
]
